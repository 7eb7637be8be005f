//! Data: files → rows ([`reader`]) → labels ([`labels`]) → token ids ([`tokenize`]) → padded
//! batches ([`batch`]). Tokenization happens once per run; batches pad dynamically by default.

pub mod batch;
pub mod chat_template;
pub mod collector;
mod csv_quotes;
pub mod idx;
pub mod labels;
pub mod lm;
pub mod preference;
pub mod prepared;
pub mod reader;
pub mod records;
pub mod reward;
pub mod saved_dataset;
pub mod sft;
pub mod tokenize;

use std::path::PathBuf;

use rand::{rngs::StdRng, seq::SliceRandom, SeedableRng};

pub use batch::Padding;
pub use labels::LabelSet;
pub use reader::{Columns, RawExample, ReadReport, Skipped, TextEncoding};
pub use tokenize::{Encoded, TextTokenizer};

use crate::error::{KilnError, Result};

/// Where the examples come from and how to read them.
#[derive(Debug, Clone)]
pub struct DataArgs {
    pub train_file: Option<PathBuf>,
    pub eval_file: Option<PathBuf>,
    /// Hold out this fraction of the training file for evaluation (seeded), when no eval file.
    pub eval_split: Option<f64>,
    pub columns: Columns,
    pub encoding: TextEncoding,
    pub strict: bool,
    pub max_train_samples: Option<usize>,
    pub max_eval_samples: Option<usize>,
    pub seed: u64,
}

/// Tokenized, labelled examples, ready to batch.
#[derive(Debug, Clone, Default)]
pub struct TextClassificationSet {
    pub examples: Vec<Encoded>,
    pub labels: Vec<usize>,
    /// Source line of each example (for reports).
    pub lines: Vec<usize>,
}

impl TextClassificationSet {
    pub fn len(&self) -> usize {
        self.examples.len()
    }
    pub fn is_empty(&self) -> bool {
        self.examples.is_empty()
    }
    pub fn lengths(&self) -> Vec<usize> {
        self.examples.iter().map(|e| e.input_ids.len()).collect()
    }
}

/// Everything a classification run needs from its data files.
pub struct PreparedData {
    pub train: Option<TextClassificationSet>,
    pub eval: Option<TextClassificationSet>,
    pub labels: LabelSet,
    pub reports: Vec<(PathBuf, ReadReport)>,
}

fn labelled(
    rows: Vec<RawExample>,
    labels: &LabelSet,
    path: &std::path::Path,
    strict: bool,
    report: &mut ReadReport,
) -> Result<Vec<(RawExample, usize)>> {
    let mut out = Vec::with_capacity(rows.len());
    for r in rows {
        let name = r.label.clone().unwrap_or_default();
        match labels.id(&name) {
            Some(id) => out.push((r, id)),
            None => {
                let s = Skipped {
                    path: path.to_path_buf(),
                    line: r.line,
                    reason: format!(
                        "unknown label {name:?} (known: {})",
                        labels.names().join(", ")
                    ),
                };
                if strict {
                    return Err(KilnError::Data(format!("{s} (--strict)")));
                }
                report.skipped.push(s);
            }
        }
    }
    Ok(out)
}

fn tokenize(tok: &TextTokenizer, rows: Vec<(RawExample, usize)>) -> Result<TextClassificationSet> {
    let texts: Vec<(String, Option<String>)> = rows
        .iter()
        .map(|(r, _)| (r.text.clone(), r.text_pair.clone()))
        .collect();
    Ok(TextClassificationSet {
        examples: tok.encode(&texts)?,
        labels: rows.iter().map(|(_, l)| *l).collect(),
        lines: rows.iter().map(|(r, _)| r.line).collect(),
    })
}

/// Reads, labels and tokenizes the train and eval files. `known_labels` (from a fine-tuned model's
/// config) fixes the label order; otherwise it is inferred from the training file.
pub fn prepare(
    args: &DataArgs,
    tok: &TextTokenizer,
    known_labels: Option<LabelSet>,
) -> Result<PreparedData> {
    let mut reports = Vec::new();
    let read =
        |path: &PathBuf| reader::read_examples(path, &args.columns, args.encoding, args.strict);
    let (mut train_rows, mut eval_rows) = (None, None);
    if let Some(path) = &args.train_file {
        let (mut rows, rep) = read(path)?;
        if let Some(n) = args.max_train_samples {
            rows.truncate(n);
        }
        reports.push((path.clone(), rep));
        train_rows = Some((path.clone(), rows));
    }
    if let Some(path) = &args.eval_file {
        let (rows, rep) = read(path)?;
        reports.push((path.clone(), rep));
        eval_rows = Some((path.clone(), rows));
    } else if let (Some(frac), Some((path, rows))) = (args.eval_split, train_rows.as_mut()) {
        if !(0.0..1.0).contains(&frac) || frac == 0.0 {
            return Err(KilnError::Config(format!(
                "--eval-split must be in (0, 1), got {frac}"
            )));
        }
        let mut idx: Vec<usize> = (0..rows.len()).collect();
        idx.shuffle(&mut StdRng::seed_from_u64(args.seed));
        let n_eval = ((rows.len() as f64) * frac).round().max(1.0) as usize;
        let held: std::collections::HashSet<usize> = idx[..n_eval].iter().copied().collect();
        let all = std::mem::take(rows);
        let (ev, tr): (Vec<_>, Vec<_>) = all
            .into_iter()
            .enumerate()
            .partition(|(i, _)| held.contains(i));
        *rows = tr.into_iter().map(|(_, r)| r).collect();
        eval_rows = Some((path.clone(), ev.into_iter().map(|(_, r)| r).collect()));
    }
    if let (Some(n), Some((_, rows))) = (args.max_eval_samples, eval_rows.as_mut()) {
        rows.truncate(n);
    }

    let labels = match (known_labels, &train_rows) {
        (Some(l), _) => l,
        // A `datasets` ClassLabel fixes the label ids, in its own order.
        (None, Some((path, rows))) => match args
            .columns
            .label
            .as_deref()
            .map(|col| saved_dataset::class_names(path, col))
            .transpose()?
            .flatten()
        {
            Some(names) => LabelSet::new(names),
            None => LabelSet::infer(rows.iter().filter_map(|r| r.label.as_deref())),
        },
        (None, None) => {
            return Err(KilnError::Config(
                "no label set: give a training file or a model whose config.json has id2label"
                    .into(),
            ))
        }
    };
    if labels.len() < 2 {
        return Err(KilnError::Data(format!(
            "need at least 2 distinct labels, found {:?}",
            labels.names()
        )));
    }

    let mut finish =
        |split: Option<(PathBuf, Vec<RawExample>)>| -> Result<Option<TextClassificationSet>> {
            let Some((path, rows)) = split else {
                return Ok(None);
            };
            let rep = match reports.iter_mut().find(|(p, _)| *p == path) {
                Some((_, r)) => r,
                None => {
                    reports.push((path.clone(), ReadReport::default()));
                    &mut reports.last_mut().expect("just pushed").1
                }
            };
            let rows = labelled(rows, &labels, &path, args.strict, rep)?;
            if rows.is_empty() {
                return Err(KilnError::Data(format!(
                    "{}: no rows with a known label",
                    path.display()
                )));
            }
            tokenize(tok, rows).map(Some)
        };
    let train = finish(train_rows)?;
    let eval = finish(eval_rows)?;
    Ok(PreparedData {
        train,
        eval,
        labels,
        reports,
    })
}
