//! A tensor-parallel rank's slice of the vocabulary (Megatron's and NxD's vocabulary-parallel
//! head: rank `r` holds columns [`chunk_range`]`(vocab, size, r)` of every row of logits), and
//! the cross-entropy of whole rows computed from the slices. Per row three values cross the
//! group — the max (a shift, without gradient), the sum of exponentials, and the target's logit
//! from the rank that holds it — never the rows themselves. Written once for the loss of whole
//! per-rank logits (differentiated through [`tp_sum`]) and for the chunked head
//! ([`KilnBackend::kiln_linear_cross_entropy`]), whose backward uses [`VocabSlice::cross_entropy_grad`].

use std::ops::Range;

use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};

use super::{chunk_range, tp_sum, KilnBackend, TpComm};

/// A tensor-parallel rank's slice of the vocabulary: its logits are `columns` of `vocab`, and
/// every sum over the vocabulary crosses `tp`.
#[derive(Debug, Clone)]
pub struct VocabSlice {
    pub tp: TpComm,
    pub columns: Range<usize>,
    pub vocab: usize,
}

impl VocabSlice {
    /// This rank's slice of `vocab` as the decoder families cut it ([`chunk_range`]).
    pub fn of(tp: TpComm, vocab: usize) -> Self {
        let columns = chunk_range(vocab, tp.size(), tp.rank());
        Self { tp, columns, vocab }
    }

    /// [`local_targets`] of this rank's columns.
    pub fn local_targets<B: Backend>(
        &self,
        targets: Tensor<B, 1, Int>,
        ignore: i64,
    ) -> (Tensor<B, 1>, Tensor<B, 1, Int>) {
        local_targets(targets, self.columns.clone(), ignore)
    }

    /// Each row's max over the whole vocabulary, `[n]` (no gradient).
    pub fn row_max<B: Backend>(&self, logits: Tensor<B, 2>) -> Tensor<B, 1> {
        let n = logits.dims()[0];
        let device = logits.device();
        let local: Vec<f32> = logits
            .detach()
            .max_dim(1)
            .reshape([n])
            .into_data()
            .convert::<f32>()
            .into_vec()
            .expect("f32 row maxima");
        Tensor::from_data(TensorData::new(self.tp.max(local), [n]), &device)
    }

    /// Each row's cross-entropy against its target (0 where it is `ignore`) and its log-sum-exp
    /// over the whole vocabulary, from this rank's logits `[n, columns]`; the same on every rank.
    pub fn cross_entropy<B: KilnBackend>(
        &self,
        logits: Tensor<B, 2>,
        targets: Tensor<B, 1, Int>,
        ignore: i64,
    ) -> (Tensor<B, 1>, Tensor<B, 1>) {
        let n = logits.dims()[0];
        debug_assert_eq!(logits.dims()[1], self.columns.len(), "this rank's columns");
        let max = self.row_max(logits.clone());
        let z = logits - max.clone().reshape([n, 1]);
        let log_sum_exp = tp_sum(z.clone().exp().sum_dim(1).reshape([n]), &self.tp).log();
        let keep = targets.clone().not_equal_elem(ignore).float();
        let (mine, at) = self.local_targets(targets, ignore);
        let picked = z.gather(1, at.reshape([n, 1])).reshape([n]) * mine;
        let target_logit = tp_sum(picked, &self.tp);
        (
            (log_sum_exp.clone() - target_logit) * keep,
            log_sum_exp + max,
        )
    }

    /// The gradient of this rank's logits `[n, columns]` for each row's upstream gradient `g`:
    /// `g · (softmax − one-hot)` on this rank's columns, 0 on ignored rows, from the whole rows'
    /// log-sum-exp `lse` (so no value crosses the group).
    pub fn cross_entropy_grad<B: Backend>(
        &self,
        logits: Tensor<B, 2>,
        targets: Tensor<B, 1, Int>,
        ignore: i64,
        lse: Tensor<B, 1>,
        g: Tensor<B, 1>,
    ) -> Tensor<B, 2> {
        let [n, local] = logits.dims();
        let keep = targets.clone().not_equal_elem(ignore).float();
        let (mine, at) = self.local_targets(targets, ignore);
        let probs = (logits - lse.reshape([n, 1])).exp();
        let one_hot = at.one_hot::<2>(local).float() * mine.reshape([n, 1]);
        (probs - one_hot) * (g * keep).reshape([n, 1])
    }
}

/// Each row's cross-entropy against its target (0 where it is `ignore`) of whole rows of logits,
/// or of this rank's columns under `slice` (the whole rows' loss, the same on every rank).
pub fn row_cross_entropy<B: KilnBackend>(
    logits: Tensor<B, 2>,
    targets: Tensor<B, 1, Int>,
    ignore: i64,
    slice: Option<&VocabSlice>,
) -> Tensor<B, 1> {
    match slice {
        Some(s) => s.cross_entropy(logits, targets, ignore).0,
        None => super::cross_entropy(logits, targets, ignore),
    }
}

/// Per row: 1 where the target is one of `columns` (and not `ignore`), and its index among them
/// (clamped into them where it is not).
pub(crate) fn local_targets<B: Backend>(
    targets: Tensor<B, 1, Int>,
    columns: Range<usize>,
    ignore: i64,
) -> (Tensor<B, 1>, Tensor<B, 1, Int>) {
    let (start, end) = (columns.start as i64, columns.end as i64);
    let mine = targets
        .clone()
        .greater_equal_elem(start)
        .bool_and(targets.clone().lower_elem(end))
        .bool_and(targets.clone().not_equal_elem(ignore));
    let last = (end - start - 1).max(0);
    (mine.float(), (targets - start).clamp(0, last))
}
