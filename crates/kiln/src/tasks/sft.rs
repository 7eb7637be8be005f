//! Supervised fine-tuning data for the causal-LM task (`kiln train --task sft`): rows of TRL's
//! formats read from any file kind ([`crate::data::records`]), prepared row by row as TRL prepares
//! them ([`crate::data::sft`]: the chat template, completion / assistant masks, truncation), and
//! batched as TRL's collator pads them (right padding, labels −100 on padding, shifted into one
//! target per position for the trainer's loss).
//!
//! A row that cannot be prepared (a message with an unknown role, an empty completion, a row
//! whose targets truncation removed) is skipped and counted with its file and line, or stops the
//! run under `--strict`.

use std::path::Path;

use tokenizers::Tokenizer;
use tracing::info;

use crate::contract::{BatchSource, IGNORE_INDEX};
use crate::data::chat_template::ChatTemplate;
use crate::data::lm::TokenBatch;
use crate::data::prepared::{prepare_records, RowRefusal};
use crate::data::sft::{collate, prepare_labelled_row, LabelledExample, SftError, SftOptions};
use crate::error::Result;

/// How SFT rows become examples and batches: TRL's options, and whether they are packed.
#[derive(Debug, Clone, Default)]
pub struct SftData {
    pub options: SftOptions,
    /// TRL's `packing` with `padding_free`: examples packed best-fit-decreasing into sequences
    /// of at most `max_length` tokens, a batch's sequences laid end to end in one row with no
    /// attention and no positions crossing from one example to the next ([`SftSet::pack`]).
    pub packing: bool,
    /// Round each batch's padded length up to a multiple of this (TRL's `pad_to_multiple_of`;
    /// packed, the one row's length); `None` or 1: no rounding.
    pub pad_to_multiple_of: Option<usize>,
    /// Print the first this many training examples with what is trained on
    /// ([`LabelledExample::show_masks`]), as a person checks a chat template's masks.
    pub print_masks: usize,
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

/// Prepared SFT examples, batched with right padding, or packed.
#[derive(Debug, Clone)]
pub struct SftSet {
    pub examples: Vec<LabelledExample>,
    pub pad_id: u32,
    /// Tokens that are targets, over all examples (for the log).
    pub targets: usize,
    /// Packed: the examples of each packed sequence (the set's items are these sequences).
    pub packed: Option<Vec<Vec<usize>>>,
    /// Batches padded to a multiple of this (TRL's `pad_to_multiple_of`).
    pub pad_to_multiple_of: Option<usize>,
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
        let examples = prepare_records(path, strict, limit, "supervised fine-tuning", |row| {
            prepare_labelled_row(row, how.tokenizer, how.template, how.options)
                .map_err(|e| row_error(e, how.model_dir))
        })?;
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
            packed: None,
            pad_to_multiple_of: None,
        })
    }

    /// Packs the examples into sequences of at most `capacity` tokens, best fit decreasing (TRL's
    /// `packing_strategy="bfd"`): longest first, each into the fullest sequence it still fits,
    /// else a new one. An example longer than `capacity` (none after `--max-length`) gets one of
    /// its own.
    pub fn pack(mut self, capacity: usize) -> Self {
        let mut order: Vec<usize> = (0..self.examples.len()).collect();
        order.sort_by_key(|&i| std::cmp::Reverse(self.examples[i].input_ids.len()));
        let mut bins: Vec<(usize, Vec<usize>)> = Vec::new();
        for i in order {
            let n = self.examples[i].input_ids.len();
            let best = bins
                .iter_mut()
                .filter(|(used, _)| used + n <= capacity)
                .max_by_key(|(used, _)| *used);
            match best {
                Some((used, items)) => {
                    *used += n;
                    items.push(i);
                }
                None => bins.push((n, vec![i])),
            }
        }
        info!(
            "packed {} examples into {} sequences of at most {capacity} tokens",
            self.examples.len(),
            bins.len()
        );
        self.packed = Some(bins.into_iter().map(|(_, items)| items).collect());
        self
    }

    /// The examples of the set's items `indices` (packed sequences' examples in order).
    fn members(&self, indices: &[usize]) -> Vec<usize> {
        match &self.packed {
            None => indices.to_vec(),
            Some(bins) => indices.iter().flat_map(|&i| bins[i].clone()).collect(),
        }
    }
}

/// A row's error as one sentence, and whether it stops the run whatever `--strict` says: a
/// model without a chat template, or a template that cannot render, fails every row alike.
fn row_error(e: SftError, model_dir: Option<&Path>) -> RowRefusal {
    match e {
        SftError::Config(m) if m.contains("has no chat template") => {
            let dir = model_dir.map_or("the model folder".to_string(), |d| d.display().to_string());
            RowRefusal {
                reason: format!(
                    "{m} in {dir}: use a chat model, add the template to its \
                     tokenizer_config.json, or give the rows as prompt/completion strings or text"
                ),
                stops_the_run: true,
            }
        }
        SftError::Config(m) => RowRefusal {
            reason: m,
            stops_the_run: true,
        },
        e => RowRefusal {
            reason: e.to_string(),
            stops_the_run: false,
        },
    }
}

impl BatchSource for SftSet {
    type Batch = TokenBatch;
    fn len(&self) -> usize {
        self.packed.as_ref().map_or(self.examples.len(), Vec::len)
    }
    fn lengths(&self) -> Vec<usize> {
        let len = |i: &usize| self.examples[*i].input_ids.len();
        match &self.packed {
            None => self.examples.iter().map(|e| e.input_ids.len()).collect(),
            Some(bins) => bins.iter().map(|b| b.iter().map(len).sum()).collect(),
        }
    }
    /// TRL's collator ([`collate`], the one its tests hold to TRL's): right padding with the
    /// pad token to the longest example rounded up to `pad_to_multiple_of`, labels −100 there;
    /// packed, the examples laid end to end in one row (`padding_free`), each one's first label
    /// −100. Then each position's target is the next label (transformers' shift inside the
    /// model's loss), so no target crosses from one packed example to the next.
    fn batch(&self, indices: &[usize]) -> (TokenBatch, Vec<i64>) {
        let packed = self.packed.is_some();
        let examples: Vec<&LabelledExample> = self
            .members(indices)
            .into_iter()
            .map(|i| &self.examples[i])
            .collect();
        let b = collate(&examples, self.pad_id, packed, self.pad_to_multiple_of);
        let seq = b.input_ids.first().map_or(0, Vec::len);
        let ids = b
            .input_ids
            .iter()
            .flatten()
            .map(|&t| i64::from(t))
            .collect();
        let targets = b
            .labels
            .iter()
            .flat_map(|row| row.iter().skip(1).copied().chain([IGNORE_INDEX]))
            .collect();
        // Packed: each example is a segment (positions and attention restart), and so is the
        // padding after them.
        let mut segments = Vec::new();
        if packed {
            segments.extend(examples.iter().map(|e| e.input_ids.len()));
            let padding = seq - segments.iter().sum::<usize>();
            if padding > 0 {
                segments.push(padding);
            }
        }
        (
            TokenBatch {
                ids,
                batch: b.input_ids.len(),
                seq,
                segments,
                chunked_loss: None,
                scoring: None,
                carried: Default::default(),
                attended_tokens: Some(examples.iter().map(|e| e.input_ids.len()).sum()),
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
            packed: None,
            pad_to_multiple_of: None,
        };
        let (b, t) = set.batch(&[0, 1]);
        assert_eq!((b.batch, b.seq), (2, 3));
        assert_eq!(b.ids, vec![5, 6, 7, 8, 9, 2]);
        assert_eq!(t, vec![6, 7, -100, 9, -100, -100]);
        assert_eq!(set.lengths(), vec![3, 2]);
        // TRL's num_tokens counts the attention mask: the padding is not a token.
        assert_eq!(b.attended_tokens, Some(5));

        // Packed (capacity 5): both in one sequence, no padding, no target across the seam.
        let packed = set.clone().pack(5);
        assert_eq!(packed.len(), 1);
        let (b, t) = packed.batch(&[0]);
        assert_eq!((b.batch, b.seq), (1, 5));
        assert_eq!(b.ids, vec![5, 6, 7, 8, 9]);
        assert_eq!(b.segments, vec![3, 2]);
        assert_eq!(t, vec![6, 7, -100, 9, -100]);

        // --pad-to-multiple-of 4: the longest (3) rounds up to 4, padded as above.
        let multiple = SftSet {
            pad_to_multiple_of: Some(4),
            ..set.clone()
        };
        let (b, t) = multiple.batch(&[0, 1]);
        assert_eq!((b.batch, b.seq), (2, 4));
        assert_eq!(b.ids, vec![5, 6, 7, 2, 8, 9, 2, 2]);
        assert_eq!(t, vec![6, 7, -100, -100, 9, -100, -100, -100]);
        assert_eq!(b.attended_tokens, Some(5));
        // Packed, the row of 5 rounds up to 8; the padding is a segment of its own, untrained.
        let (b, t) = multiple.pack(5).batch(&[0]);
        assert_eq!((b.batch, b.seq), (1, 8));
        assert_eq!(b.ids, vec![5, 6, 7, 8, 9, 2, 2, 2]);
        assert_eq!(b.segments, vec![3, 2, 3]);
        assert_eq!(t, vec![6, 7, -100, 9, -100, -100, -100, -100]);
    }

    #[test]
    fn packing_is_best_fit_decreasing() {
        let ex = |n: usize| LabelledExample {
            input_ids: vec![1; n],
            labels: vec![1; n],
        };
        let set = SftSet {
            examples: [6, 5, 4, 3, 2].map(ex).to_vec(),
            pad_id: 0,
            targets: 0,
            packed: None,
            pad_to_multiple_of: None,
        }
        .pack(8);
        // 6 opens a sequence, 5 another; 4 fits neither (10, 9) and opens a third; 3 best fits
        // the 5 (8); 2 best fits the 6 (8).
        assert_eq!(set.packed, Some(vec![vec![0, 4], vec![1, 3], vec![2]]));
        assert_eq!(set.lengths(), vec![8, 8, 4]);
    }
}
