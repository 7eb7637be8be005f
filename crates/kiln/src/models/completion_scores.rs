//! A causal LM's head asked to score completions ([`CompletionScoring`]) instead of returning
//! logits: per sequence, the log-probability of its completion's tokens, and the statistics TRL's
//! preference trainers log beside it (transformers' `fused_lm_head` outputs `log_probs`,
//! `mean_logits`, `entropy`, `is_top1`, summed over each row's scored tokens). Under tensor
//! parallelism each rank holds a slice of the vocabulary; every sum over it crosses the group,
//! so every rank gets the same scores.

use burn::tensor::{Int, Tensor, TensorData};

use crate::contract::IGNORE_INDEX;
use crate::data::lm::{CompletionScoring, RowValues};
use crate::ops::{
    row_cross_entropy, scored_linear_cross_entropy, token_statistics, KilnBackend, TokenStatistics,
    VocabSlice,
};

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

/// `logits` `[rows × seq, vocab]` (a rank's `[…, columns]` under `slice`) → `[rows, COMPUTED +
/// carried.per_row]` scores.
pub fn completion_scores<B: KilnBackend>(
    logits: Tensor<B, 2>,
    rows: usize,
    scoring: &CompletionScoring,
    carried: &RowValues,
    slice: Option<VocabSlice>,
) -> Tensor<B, 2> {
    let n = logits.dims()[0];
    let targets = scoring_targets(scoring, n, &logits.device());
    let stats = token_statistics(
        logits.clone().detach(),
        targets.clone(),
        IGNORE_INDEX,
        slice.as_ref(),
    );
    let losses = row_cross_entropy(logits, targets, IGNORE_INDEX, slice.as_ref());
    row_scores(losses, stats, rows, scoring, carried)
}

/// [`completion_scores`] of the logits `h wᵀ` (`h` the normed last hidden states `[rows × seq,
/// H]`, `w` the output head's weight `[vocab, H]`) computed `chunk` positions at a time, forward
/// and backward ([`crate::ops::scored_linear_cross_entropy`]): the same scores without the
/// whole logits or their gradient (`w` this rank's rows of the head under `slice`).
pub fn chunked_completion_scores<B: KilnBackend>(
    h: Tensor<B, 2>,
    w: Tensor<B, 2>,
    rows: usize,
    scoring: &CompletionScoring,
    carried: &RowValues,
    slice: Option<VocabSlice>,
) -> Tensor<B, 2> {
    let n = h.dims()[0];
    let targets = scoring_targets(scoring, n, &h.device());
    let chunk = scoring.chunk.max(1);
    let (losses, stats) = scored_linear_cross_entropy(h, w, targets, IGNORE_INDEX, chunk, slice);
    row_scores(losses, stats, rows, scoring, carried)
}

fn scoring_targets<B: KilnBackend>(
    scoring: &CompletionScoring,
    n: usize,
    device: &B::Device,
) -> Tensor<B, 1, Int> {
    assert_eq!(scoring.targets.len(), n, "one scoring target per position");
    assert_eq!(
        scoring.completion.len(),
        n,
        "one completion flag per position"
    );
    Tensor::from_data(TensorData::new(scoring.targets.clone(), [n]), device)
}

/// Each row's [`Column`]s from its positions' cross-entropies `losses` `[rows × seq]` and their
/// statistics, then the carried values.
fn row_scores<B: KilnBackend>(
    losses: Tensor<B, 1>,
    stats: TokenStatistics<B>,
    rows: usize,
    scoring: &CompletionScoring,
    carried: &RowValues,
) -> Tensor<B, 2> {
    let n = losses.dims()[0];
    let device = losses.device();
    let seq = n / rows.max(1);
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
            chunk: 0,
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

    /// The scores of `h wᵀ` a few positions at a time against those of the whole logits: every
    /// column, and the gradients of a weighted sum of them (each row's factor its own, as a
    /// preference loss weighs them) with respect to the hidden states and the head's weight, for
    /// chunks that leave a short last one and of one position.
    #[test]
    fn chunked_scores_equal_the_whole_logits_scores() {
        use crate::backend::CpuTrain;
        let (rows, seq, hidden, vocab) = (4usize, 6usize, 8usize, 50usize);
        let n = rows * seq;
        let device = Default::default();
        let values = |len: usize, seed: usize| -> Vec<f32> {
            (0..len)
                .map(|i| (((i * 7919 + seed * 104_729) % 1000) as f32 / 500.0 - 1.0) * 0.8)
                .collect()
        };
        let targets: Vec<i64> = (0..n)
            .map(|i| match i % seq {
                5 => IGNORE_INDEX,
                _ => ((i * 31) % vocab) as i64,
            })
            .collect();
        let completion: Vec<bool> = (0..n).map(|i| i % seq >= 2).collect();
        let carried = RowValues {
            values: (0..rows).map(|r| r as f32).collect(),
            per_row: 1,
        };
        let factors = Tensor::<CpuTrain, 2>::from_data(
            TensorData::new(
                values(rows * (Column::COMPUTED + 1), 3),
                [rows, Column::COMPUTED + 1],
            ),
            &device,
        );
        let run = |chunk: usize| {
            let h = Tensor::<CpuTrain, 2>::from_data(
                TensorData::new(values(n * hidden, 1), [n, hidden]),
                &device,
            )
            .require_grad();
            let w = Tensor::<CpuTrain, 2>::from_data(
                TensorData::new(values(vocab * hidden, 2), [vocab, hidden]),
                &device,
            )
            .require_grad();
            let scoring = CompletionScoring {
                targets: targets.clone(),
                completion: completion.clone(),
                chunk,
            };
            let scores = match chunk {
                0 => {
                    let logits = h.clone().matmul(w.clone().transpose());
                    completion_scores(logits, rows, &scoring, &carried, None)
                }
                _ => {
                    chunked_completion_scores(h.clone(), w.clone(), rows, &scoring, &carried, None)
                }
            };
            let grads = (scores.clone() * factors.clone()).sum().backward();
            let host = |t: Tensor<crate::backend::Cpu, 2>| -> Vec<f32> {
                t.into_data().convert::<f32>().into_vec().unwrap()
            };
            [
                host(scores.inner()),
                host(h.grad(&grads).unwrap()),
                host(w.grad(&grads).unwrap()),
            ]
        };
        let whole = run(0);
        for chunk in [5, 1] {
            let got = run(chunk);
            for (what, (g, w)) in ["scores", "dh", "dw"].iter().zip(got.iter().zip(&whole)) {
                let scale = w.iter().fold(0f32, |a, b| a.max(b.abs()));
                assert!(scale > 1e-3, "{what}: all zero");
                for (i, (a, b)) in g.iter().zip(w).enumerate() {
                    assert!(
                        (a - b).abs() <= 2e-5 * scale.max(1.0),
                        "chunk {chunk} {what}[{i}]: {a} vs the whole logits' {b}"
                    );
                }
            }
        }
    }
}
