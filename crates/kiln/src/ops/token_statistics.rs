//! What TRL's preference trainers log of each scored position's next-token distribution besides
//! its log-probability (transformers' `fused_lm_head` outputs `mean_logits`, `entropy`,
//! `is_top1`), from a chunk of logits or the whole of them, and from a tensor-parallel rank's
//! slice of the vocabulary as from all of it.

use burn::tensor::{Int, Tensor};

use super::vocab_slice::local_targets;
use super::{tp_sum, KilnBackend, VocabSlice};

/// Per position (no gradient): the mean logit over the vocabulary, the entropy of the softmax,
/// and 1 where the target is the most likely token (also where it is ignored: the caller masks).
#[derive(Debug, Clone)]
pub struct TokenStatistics<B: KilnBackend> {
    pub mean_logit: Tensor<B, 1>,
    pub entropy: Tensor<B, 1>,
    pub top1: Tensor<B, 1>,
}

impl<B: KilnBackend> TokenStatistics<B> {
    /// Each statistic through `f` (another backend's tensors, the positions of a chunk joined).
    pub fn map<C: KilnBackend>(
        self,
        f: impl Fn(Tensor<B, 1>) -> Tensor<C, 1>,
    ) -> TokenStatistics<C> {
        TokenStatistics {
            mean_logit: f(self.mean_logit),
            entropy: f(self.entropy),
            top1: f(self.top1),
        }
    }

    /// Consecutive chunks' statistics as one.
    pub fn cat(parts: Vec<Self>) -> Self {
        let join = |pick: fn(&Self) -> &Tensor<B, 1>| -> Tensor<B, 1> {
            Tensor::cat(parts.iter().map(|p| pick(p).clone()).collect(), 0)
        };
        TokenStatistics {
            mean_logit: join(|p| &p.mean_logit),
            entropy: join(|p| &p.entropy),
            top1: join(|p| &p.top1),
        }
    }
}

/// The statistics of `logits` `[n, columns]` (a rank's slice under `slice`) at `targets` `[n]`
/// (`ignore` where a position has none).
pub fn token_statistics<B: KilnBackend>(
    logits: Tensor<B, 2>,
    targets: Tensor<B, 1, Int>,
    ignore: i64,
    slice: Option<&VocabSlice>,
) -> TokenStatistics<B> {
    let [n, local] = logits.dims();
    let across = |x: Tensor<B, 1>| match slice {
        Some(s) => tp_sum(x, &s.tp),
        None => x,
    };
    let vocab = slice.map_or(local, |s| s.vocab);
    let mean_logit = across(logits.clone().sum_dim(1).reshape([n])) / vocab as f64;
    // Shifted by the row max over the whole vocabulary: the most likely token's z is exactly 0.
    let max = match slice {
        Some(s) => s.row_max(logits.clone()),
        None => logits.clone().max_dim(1).reshape([n]),
    };
    let z = logits - max.reshape([n, 1]);
    let e = z.clone().exp();
    let sum_exp = across(e.clone().sum_dim(1).reshape([n]));
    // H = log Σe^z − Σ softmax·z (the shift cancels).
    let entropy = sum_exp.clone().log() - across((e * z.clone()).sum_dim(1).reshape([n])) / sum_exp;
    let columns = slice.map_or(0..local, |s| s.columns.clone());
    let (mine, at) = local_targets(targets, columns, ignore);
    let target_z = across(z.gather(1, at.reshape([n, 1])).reshape([n]) * mine);
    let top1 = target_z.greater_equal_elem(0.0).float();
    TokenStatistics {
        mean_logit,
        entropy,
        top1,
    }
}
