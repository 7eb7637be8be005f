//! Language-modelling data, as transformers' `run_clm.py` prepares it: read documents, tokenize each
//! (with the tokenizer's special tokens), append EOS, concatenate, and cut into blocks of
//! `block_size` tokens (the tail shorter than a block is dropped). Every block is one example; its
//! targets are the same tokens shifted left by one, the last position left out of the loss.

use std::path::Path;

use tokenizers::Tokenizer;

use super::reader::{read_examples, read_text, Columns, ReadReport, TextEncoding};
use crate::error::{KilnError, Result};

/// Reads the documents of a corpus file:
/// - `.txt`: paragraphs separated by blank lines are documents (wrapped lines are kept as they are),
///   decoded with `encoding`;
/// - `.jsonl`, `.parquet`, `.csv`, `.tsv`: one document per row, from `text_column`.
pub fn read_documents(
    path: &Path,
    text_column: &str,
    encoding: TextEncoding,
    strict: bool,
) -> Result<(Vec<String>, ReadReport)> {
    let is_txt = path
        .extension()
        .and_then(|e| e.to_str())
        .is_some_and(|e| e.eq_ignore_ascii_case("txt"));
    if !is_txt {
        let cols = Columns {
            text: text_column.to_string(),
            text_pair: None,
            label: None,
        };
        let (rows, report) = read_examples(path, &cols, encoding, strict)?;
        return Ok((rows.into_iter().map(|r| r.text).collect(), report));
    }
    let text = read_text(path, encoding)?;
    let mut docs = Vec::new();
    let mut current: Vec<&str> = Vec::new();
    for line in text.lines().chain(std::iter::once("")) {
        if line.trim().is_empty() {
            if !current.is_empty() {
                docs.push(current.join("\n"));
                current.clear();
            }
        } else {
            current.push(line);
        }
    }
    if docs.is_empty() {
        return Err(KilnError::Data(format!("{}: no text", path.display())));
    }
    let report = ReadReport {
        rows: docs.len(),
        ..Default::default()
    };
    Ok((docs, report))
}

/// Token blocks of equal length.
#[derive(Debug, Clone, Default)]
pub struct LmBlocks {
    pub blocks: Vec<Vec<u32>>,
    pub block_size: usize,
    /// Tokens before packing (the dropped tail included).
    pub tokens: usize,
    pub documents: usize,
}

impl LmBlocks {
    /// Tokenizes `docs` (special tokens as the tokenizer adds them), appends `eos` to each, and packs.
    pub fn from_documents(
        tok: &Tokenizer,
        docs: &[String],
        eos: Option<u32>,
        block_size: usize,
    ) -> Result<Self> {
        if block_size < 2 {
            return Err(KilnError::Config(format!(
                "--block-size {block_size}: a block needs at least 2 tokens"
            )));
        }
        let stream = Self::token_stream(tok, docs, eos)?;
        Ok(Self::pack(stream, block_size, docs.len()))
    }

    /// `docs` tokenized and concatenated, each followed by `eos` (unless it already ends with it).
    pub fn token_stream(tok: &Tokenizer, docs: &[String], eos: Option<u32>) -> Result<Vec<u32>> {
        for doc in docs {
            crate::data::tokenize::check_text_size(doc, "a document")?;
        }
        let enc = tok
            .encode_batch(docs.iter().map(String::as_str).collect::<Vec<_>>(), true)
            .map_err(|e| KilnError::Data(format!("tokenization failed: {e}")))?;
        let mut stream: Vec<u32> = Vec::new();
        for e in &enc {
            stream.extend_from_slice(e.get_ids());
            if let Some(eos) = eos {
                if e.get_ids().last() != Some(&eos) {
                    stream.push(eos);
                }
            }
        }
        Ok(stream)
    }

    /// Cuts a token stream into blocks.
    pub fn pack(stream: Vec<u32>, block_size: usize, documents: usize) -> Self {
        let blocks = stream
            .chunks_exact(block_size)
            .map(<[u32]>::to_vec)
            .collect();
        Self {
            blocks,
            block_size,
            tokens: stream.len(),
            documents,
        }
    }

    pub fn len(&self) -> usize {
        self.blocks.len()
    }
    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }
}

/// A batch of token blocks, row-major `[batch, seq]`.
#[derive(Debug, Clone, Default)]
pub struct TokenBatch {
    pub ids: Vec<i64>,
    pub batch: usize,
    pub seq: usize,
    /// Padding-free packing (one row, `batch` 1): the lengths of the sequences laid end to end
    /// in it, whose attention and positions never cross from one to the next. Empty: each row
    /// is one sequence.
    pub segments: Vec<usize>,
    /// Score each row's completion instead of returning logits (see [`CompletionScoring`]).
    pub scoring: Option<std::sync::Arc<CompletionScoring>>,
    /// Ask the head for each position's cross-entropy against these targets instead of its
    /// logits, the head's product and the loss computed a chunk of positions at a time (see
    /// [`ChunkedLoss`]).
    pub chunked_loss: Option<std::sync::Arc<ChunkedLoss>>,
    /// Values each row's scores carry along unchanged after the computed columns, for the loss
    /// and metrics to read (the reference model's log-probability of a DPO row's completion, a
    /// reward pair's margin). Only heads that return one row per sequence carry them.
    pub carried: RowValues,
    /// How many of the positions are tokens rather than padding (TRL's `attention_mask.sum()`,
    /// which its trainers log as `num_tokens`); `None`: every position.
    pub attended_tokens: Option<usize>,
}

/// A causal LM's loss computed inside its head (Liger's fused linear cross-entropy, TRL's `nll`
/// that never materialises the logits): the head returns `[batch·seq, 1]`, each position's
/// cross-entropy against `targets` (0 where the target is `IGNORE_INDEX`), and at most `chunk`
/// positions' vocabulary logits (and their gradient) exist at once.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ChunkedLoss {
    pub targets: Vec<i64>,
    pub chunk: usize,
}

/// `per_row` values for each row of a batch, row-major (`batch × per_row`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RowValues {
    pub values: Vec<f32>,
    pub per_row: usize,
}

/// Asks a causal LM for one row of scores per sequence instead of a row of logits per token:
/// what TRL's preference trainers read from transformers' `fused_lm_head` outputs (the
/// log-probability of each completion, and the statistics TRL logs beside it). The columns are
/// `models::completion_scores::Column`'s.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CompletionScoring {
    /// Per position of `[batch, seq]`: the next token, whose log-probability counts, or
    /// `IGNORE_INDEX` where there is none (padding, a sequence's last position).
    pub targets: Vec<i64>,
    /// Per position: whether its target is a completion token (the completion columns sum over
    /// these; the sequence columns over every target, the prompt's too).
    pub completion: Vec<bool>,
    /// The head's product and the scores computed this many positions at a time, never holding
    /// the whole logits (as [`ChunkedLoss`]); 0: the whole logits.
    pub chunk: usize,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::contract::{BatchSource, IGNORE_INDEX};

    #[test]
    fn packing_drops_the_tail_and_shifts_targets() {
        let b = LmBlocks::pack((0..10).collect(), 4, 1);
        assert_eq!(b.blocks, vec![vec![0, 1, 2, 3], vec![4, 5, 6, 7]]);
        assert_eq!(b.tokens, 10);
        let (batch, targets) = b.batch(&[1, 0]);
        assert_eq!(batch.ids, vec![4, 5, 6, 7, 0, 1, 2, 3]);
        assert_eq!(targets, vec![5, 6, 7, IGNORE_INDEX, 1, 2, 3, IGNORE_INDEX]);
    }

    #[test]
    fn text_files_split_on_blank_lines() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("c.txt");
        std::fs::write(&p, "one\nstill one\n\n\ntwo\n  \nthree").unwrap();
        let (docs, r) = read_documents(&p, "text", TextEncoding::Utf8, false).unwrap();
        assert_eq!(docs, vec!["one\nstill one", "two", "three"]);
        assert_eq!(r.rows, 3);
    }
}
