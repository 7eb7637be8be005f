//! Supervised fine-tuning data for the causal-LM task (`kiln train --task sft`): rows of TRL's
//! formats read from any file kind ([`crate::data::records`]), prepared row by row as TRL prepares
//! them ([`crate::data::sft`]: the chat template, completion / assistant masks, truncation), and
//! batched as TRL's collator pads them (right padding, labels −100 on padding, shifted into one
//! target per position for the trainer's loss).
//!
//! A row that cannot be prepared (a message with an unknown role, an empty completion, a row
//! whose targets truncation removed) is skipped and counted with its file and line, or stops the
//! run under `--strict`.

use std::path::{Path, PathBuf};

use tokenizers::Tokenizer;
use tracing::info;

use crate::data::chat_template::ChatTemplate;
use crate::data::lm::TokenBatch;
use crate::data::records::read_records;
use crate::data::rows::{ReadReport, Skipped};
use crate::data::sft::{prepare_labelled_row, LabelledExample, SftError, SftOptions};
use crate::error::{KilnError, Result};
use crate::task::{BatchSource, IGNORE_INDEX};

/// How SFT rows become examples: TRL's options and the model folder's chat template.
#[derive(Debug, Clone, Default)]
pub struct SftData {
    pub options: SftOptions,
}

/// What preparing rows needs besides the rows: the tokenizer, the chat template (if the model
/// has one) and the padding id.
pub struct SftTokenization<'a> {
    pub tokenizer: &'a Tokenizer,
    pub template: Option<&'a ChatTemplate>,
    pub options: &'a SftOptions,
    /// Where the template would come from, for the message when a conversation needs one.
    pub model_dir: Option<&'a Path>,
}

/// Prepared SFT examples, batched with right padding.
#[derive(Debug, Clone)]
pub struct SftSet {
    pub examples: Vec<LabelledExample>,
    pub pad_id: u32,
    /// Tokens that are targets, over all examples (for the log).
    pub targets: usize,
}

impl SftSet {
    /// Reads and prepares every row of `path` (the first `limit` rows that prepare, if given).
    pub fn read(
        path: &Path,
        how: &SftTokenization,
        pad_id: u32,
        strict: bool,
        limit: Option<usize>,
    ) -> Result<Self> {
        let (records, mut report) = read_records(path, strict)?;
        let mut examples = Vec::new();
        for record in records {
            if limit.is_some_and(|n| examples.len() >= n) {
                break;
            }
            match prepare_labelled_row(&record.fields, how.tokenizer, how.template, how.options) {
                Ok(ex) => examples.push(ex),
                Err(e) => {
                    let reason = row_error(e, how.model_dir);
                    if strict || reason.1 {
                        return Err(KilnError::Data(format!(
                            "{}:{}: {}",
                            path.display(),
                            record.line,
                            reason.0
                        )));
                    }
                    report.skipped.push(Skipped {
                        path: PathBuf::from(path),
                        line: record.line,
                        reason: reason.0,
                    });
                }
            }
        }
        log_report(path, &report);
        if examples.is_empty() {
            return Err(KilnError::Data(format!(
                "{}: no row could be prepared for supervised fine-tuning ({})",
                path.display(),
                report.summary()
            )));
        }
        let targets = examples
            .iter()
            .map(|e| e.labels.iter().filter(|&&l| l != IGNORE_INDEX).count())
            .sum();
        let tokens: usize = examples.iter().map(|e| e.input_ids.len()).sum();
        info!(
            "{}: {} examples, {tokens} tokens, {targets} of them trained on",
            path.display(),
            examples.len()
        );
        Ok(Self {
            examples,
            pad_id,
            targets,
        })
    }
}

/// A row's error as one sentence, and whether it stops the run whatever `--strict` says: a
/// model without a chat template, or a template that cannot render, fails every row alike.
fn row_error(e: SftError, model_dir: Option<&Path>) -> (String, bool) {
    match e {
        SftError::Config(m) if m.contains("has no chat template") => {
            let dir = model_dir.map_or("the model folder".to_string(), |d| d.display().to_string());
            (
                format!(
                    "{m} in {dir}: use a chat model, add the template to its \
                     tokenizer_config.json, or give the rows as prompt/completion strings or text"
                ),
                true,
            )
        }
        SftError::Config(m) => (m, true),
        e => (e.to_string(), false),
    }
}

fn log_report(path: &Path, report: &ReadReport) {
    info!("{}: {}", path.display(), report.summary());
}

impl BatchSource for SftSet {
    type Batch = TokenBatch;
    fn len(&self) -> usize {
        self.examples.len()
    }
    fn lengths(&self) -> Vec<usize> {
        self.examples.iter().map(|e| e.input_ids.len()).collect()
    }
    /// TRL's collator: right padding with the pad token, labels −100 there; then each position's
    /// target is the next label (transformers' shift inside the model's loss).
    fn batch(&self, indices: &[usize]) -> (TokenBatch, Vec<i64>) {
        let seq = indices
            .iter()
            .map(|&i| self.examples[i].input_ids.len())
            .max()
            .unwrap_or(0);
        let mut ids = Vec::with_capacity(indices.len() * seq);
        let mut targets = Vec::with_capacity(indices.len() * seq);
        for &i in indices {
            let e = &self.examples[i];
            let n = e.input_ids.len();
            ids.extend(e.input_ids.iter().map(|&t| t as i64));
            ids.extend(std::iter::repeat_n(self.pad_id as i64, seq - n));
            targets.extend(e.labels.iter().skip(1).copied());
            targets.extend(std::iter::repeat_n(IGNORE_INDEX, seq - n + 1));
        }
        (
            TokenBatch {
                ids,
                batch: indices.len(),
                seq,
            },
            targets,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batches_pad_right_and_shift_labels() {
        let set = SftSet {
            examples: vec![
                LabelledExample {
                    input_ids: vec![5, 6, 7],
                    labels: vec![-100, 6, 7],
                },
                LabelledExample {
                    input_ids: vec![8, 9],
                    labels: vec![8, 9],
                },
            ],
            pad_id: 2,
            targets: 4,
        };
        let (b, t) = set.batch(&[0, 1]);
        assert_eq!((b.batch, b.seq), (2, 3));
        assert_eq!(b.ids, vec![5, 6, 7, 8, 9, 2]);
        assert_eq!(t, vec![6, 7, -100, 9, -100, -100]);
        assert_eq!(set.lengths(), vec![3, 2]);
    }
}
