//! A causal LM's head asked to score completions ([`CompletionScoring`]) instead of returning
//! logits: per sequence, the log-probability of its completion's tokens, and the statistics TRL's
//! preference trainers log beside it (transformers' `fused_lm_head` outputs `log_probs`,
//! `mean_logits`, `entropy`, `is_top1`, summed over each row's scored tokens). Under tensor
//! parallelism each rank holds a slice of the vocabulary; every sum over it crosses the group,
//! so every rank gets the same scores.

use std::ops::Range;

use burn::tensor::{Int, Tensor, TensorData};

use crate::contract::IGNORE_INDEX;
use crate::data::lm::{CompletionScoring, RowValues};
use crate::ops::{tp_sum, KilnBackend, TpComm};
use crate::parallel::VocabParallelCrossEntropy;

/// The columns of a row of scores, then the row's carried values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Column {
    /// Σ log p(token) over the row's scored tokens; the only column with a gradient.
    LogProb,
    /// How many tokens the row scores.
    Tokens,
    /// Σ over the scored tokens of the mean logit over the vocabulary (TRL's `logits/*`).
    MeanLogit,
    /// Σ over the scored tokens of the entropy of the next-token distribution.
    Entropy,
    /// How many scored tokens are the model's most likely next token.
    Top1,
    /// Σ log p(token) over every target of the row, the prompt's too (ORPO's NLL); with a
    /// gradient.
    SequenceLogProb,
    /// How many targets the row has.
    SequenceTokens,
}

impl Column {
    /// Columns computed from the logits; the carried values follow them.
    pub const COMPUTED: usize = 7;

    pub fn index(self) -> usize {
        self as usize
    }
}

/// A tensor-parallel rank's slice of the vocabulary.
pub struct VocabSlice<'a> {
    pub tp: &'a TpComm,
    pub columns: Range<usize>,
    pub vocab: usize,
}

/// `logits` `[rows × seq, vocab]` (a rank's `[…, columns]` under `slice`) → `[rows, COMPUTED +
/// carried.per_row]` scores.
pub fn completion_scores<B: KilnBackend>(
    logits: Tensor<B, 2>,
    rows: usize,
    scoring: &CompletionScoring,
    carried: &RowValues,
    slice: Option<VocabSlice<'_>>,
) -> Tensor<B, 2> {
    let [n, _] = logits.dims();
    let device = logits.device();
    assert_eq!(scoring.targets.len(), n, "one scoring target per position");
    let seq = n / rows.max(1);
    let targets =
        Tensor::<B, 1, Int>::from_data(TensorData::new(scoring.targets.clone(), [n]), &device);
    assert_eq!(
        scoring.completion.len(),
        n,
        "one completion flag per position"
    );
    let per_row_count = |flags: &[f32]| -> Tensor<B, 2> {
        let counts: Vec<f32> = flags.chunks(seq.max(1)).map(|r| r.iter().sum()).collect();
        Tensor::from_data(TensorData::new(counts, [rows, 1]), &device)
    };
    let completion_host: Vec<f32> = scoring
        .targets
        .iter()
        .zip(&scoring.completion)
        .map(|(&t, &c)| f32::from(u8::from(t != IGNORE_INDEX && c)))
        .collect();
    let target_host: Vec<f32> = scoring
        .targets
        .iter()
        .map(|&t| f32::from(u8::from(t != IGNORE_INDEX)))
        .collect();
    let (tokens, sequence_tokens) = (per_row_count(&completion_host), per_row_count(&target_host));
    let keep = Tensor::<B, 1>::from_data(TensorData::new(completion_host, [n]), &device);
    let stats = token_statistics(logits.clone().detach(), targets.clone(), &slice);
    let losses = match &slice {
        None => crate::ops::cross_entropy(logits, targets, IGNORE_INDEX),
        Some(s) => VocabParallelCrossEntropy {
            tp: s.tp.clone(),
            vocab: s.vocab,
        }
        .token_losses(logits, targets),
    };
    let per_row = |x: Tensor<B, 1>| x.reshape([rows, seq]).sum_dim(1);
    let log_probs = losses.neg();
    with_carried(
        vec![
            per_row(log_probs.clone() * keep.clone()),
            tokens,
            per_row(stats.mean_logit * keep.clone()),
            per_row(stats.entropy * keep.clone()),
            per_row(stats.top1 * keep),
            per_row(log_probs),
            sequence_tokens,
        ],
        carried,
    )
}

/// `columns` (each `[rows, k]`) side by side, then the batch's `carried` values.
pub fn with_carried<B: KilnBackend>(
    mut columns: Vec<Tensor<B, 2>>,
    carried: &RowValues,
) -> Tensor<B, 2> {
    if carried.per_row > 0 {
        let rows = columns.first().map_or(0, |c| c.dims()[0]);
        let device = columns[0].device();
        columns.push(Tensor::from_data(
            TensorData::new(carried.values.clone(), [rows, carried.per_row]),
            &device,
        ));
    }
    Tensor::cat(columns, 1)
}

/// Per position (no gradient): the mean logit over the vocabulary, the entropy of the softmax,
/// and 1 where the target is the most likely token.
struct TokenStatistics<B: KilnBackend> {
    mean_logit: Tensor<B, 1>,
    entropy: Tensor<B, 1>,
    top1: Tensor<B, 1>,
}

fn token_statistics<B: KilnBackend>(
    logits: Tensor<B, 2>,
    targets: Tensor<B, 1, Int>,
    slice: &Option<VocabSlice<'_>>,
) -> TokenStatistics<B> {
    let [n, local] = logits.dims();
    let device = logits.device();
    let across = |x: Tensor<B, 1>| match slice {
        Some(s) => tp_sum(x, s.tp),
        None => x,
    };
    let vocab = slice.as_ref().map_or(local, |s| s.vocab);
    let mean_logit = across(logits.clone().sum_dim(1).reshape([n])) / vocab as f64;
    // Shifted by the row max over the whole vocabulary: the most likely token's z is exactly 0.
    let local_max = logits.clone().max_dim(1).reshape([n]);
    let max = match slice {
        Some(s) => Tensor::from_data(
            TensorData::new(s.tp.max(crate::parallel::collectives::host(local_max)), [n]),
            &device,
        ),
        None => local_max,
    };
    let z = logits - max.reshape([n, 1]);
    let e = z.clone().exp();
    let sum_exp = across(e.clone().sum_dim(1).reshape([n]));
    // H = log Σe^z − Σ softmax·z (the shift cancels).
    let entropy = sum_exp.clone().log() - across((e * z.clone()).sum_dim(1).reshape([n])) / sum_exp;
    let start = slice.as_ref().map_or(0, |s| s.columns.start) as i64;
    let end = start + local as i64;
    let mine = targets
        .clone()
        .greater_equal_elem(start)
        .bool_and(targets.clone().lower_elem(end))
        .bool_and(targets.clone().not_equal_elem(IGNORE_INDEX));
    let local_idx = (targets - start).clamp(0, local.saturating_sub(1) as i64);
    let picked = across(z.gather(1, local_idx.reshape([n, 1])).reshape([n]) * mine.float());
    let top1 = picked.greater_equal_elem(0.0).float();
    TokenStatistics {
        mean_logit,
        entropy,
        top1,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::Cpu;

    /// The scores against a direct f64 computation from the same logits.
    #[test]
    fn scores_sum_each_rows_scored_tokens() {
        let (rows, seq, vocab) = (2usize, 3usize, 5usize);
        let logits: Vec<f32> = (0..rows * seq * vocab)
            .map(|i| ((i * 37 % 11) as f32 - 5.0) * 0.3)
            .collect();
        // Row 0's completion is positions 1 and 2 (position 0 is prompt), row 1's position 0.
        let targets = vec![1, 3, 0, 4, IGNORE_INDEX, IGNORE_INDEX];
        let completion = vec![false, true, true, true, false, false];
        let scoring = CompletionScoring {
            targets: targets.clone(),
            completion: completion.clone(),
        };
        let carried = RowValues {
            values: vec![-1.5, 2.5],
            per_row: 1,
        };
        let device = Default::default();
        let t = Tensor::<Cpu, 2>::from_data(
            TensorData::new(logits.clone(), [rows * seq, vocab]),
            &device,
        );
        let got: Vec<f32> = completion_scores(t, rows, &scoring, &carried, None)
            .into_data()
            .into_vec()
            .unwrap();
        const W: usize = Column::COMPUTED + 1;
        let mut want = vec![0f64; rows * W];
        for pos in 0..rows * seq {
            let Ok(target) = usize::try_from(targets[pos]) else {
                continue;
            };
            let row = &logits[pos * vocab..(pos + 1) * vocab];
            let max = row.iter().fold(f32::MIN, |a, &b| a.max(b)) as f64;
            let sum: f64 = row.iter().map(|&x| (x as f64 - max).exp()).sum();
            let lse = max + sum.ln();
            let p: Vec<f64> = row.iter().map(|&x| (x as f64 - lse).exp()).collect();
            let r = pos / seq;
            want[r * W + 5] += row[target] as f64 - lse;
            want[r * W + 6] += 1.0;
            if !completion[pos] {
                continue;
            }
            want[r * W] += row[target] as f64 - lse;
            want[r * W + 1] += 1.0;
            want[r * W + 2] += row.iter().map(|&x| x as f64).sum::<f64>() / vocab as f64;
            want[r * W + 3] -= p.iter().map(|q| q * q.ln()).sum::<f64>();
            want[r * W + 4] += f64::from(u8::from(row[target] as f64 == max));
        }
        want[W - 1] = -1.5;
        want[2 * W - 1] = 2.5;
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!((*g as f64 - w).abs() < 1e-5, "score {i}: {g} vs {w}");
        }
    }
}
