//! The contract between models, data and the trainer, whatever the task (text classification,
//! MNIST, causal LM): a model maps a host-side batch to logits, a dataset hands out batches with
//! integer targets, a loss compares the two. Models, data and the trainer all depend on this
//! module and on nothing of each other's, so data → model → trainer stays one way.

use burn::module::Module;
use burn::tensor::activation::log_softmax;
use burn::tensor::{backend::Backend, Int, Tensor};

use crate::ops::KilnBackend;

/// Target value that is left out of the loss (transformers' `ignore_index`).
pub const IGNORE_INDEX: i64 = -100;

/// A model that maps a batch to logits `[N, C]`, one row per target.
pub trait Model<B: Backend>: Module<B> {
    /// The batch as host data, independent of the backend.
    type Batch;
    fn logits(&self, batch: &Self::Batch) -> Tensor<B, 2>;

    /// The model as a chain of segments (embedding, layers, head), when it is one: the trainer's
    /// activation checkpointing runs and differentiates them one at a time (and a pipeline would
    /// place them on stages). `None`, the default, for models that are not split.
    fn segments(&self) -> Option<&dyn Segments<B, Self::Batch>> {
        None
    }

    /// Elements of the batch's `input_ids`, padding included: the tokens transformers' Trainer
    /// counts for `total_flos` (6 × tokens × non-embedding parameters). 0, the default, for a
    /// model without token inputs (no flos are counted, as transformers counts none).
    fn input_ids_numel(&self, _batch: &Self::Batch) -> usize {
        0
    }

    /// The batch's tokens that are not padding (TRL's `attention_mask.sum()`, what its trainers
    /// count as `num_tokens`); by default every input id.
    fn attended_tokens(&self, batch: &Self::Batch) -> usize {
        self.input_ids_numel(batch)
    }

    /// Whether a step's loss is the mean over all its target tokens (transformers' causal LMs,
    /// whose `model_accepts_loss_kwargs` makes the Trainer pass `num_items_in_batch`) rather than
    /// the mean of its micro-batches' means (every other model, as transformers' Trainer does
    /// with them). The two differ when micro-batches hold different numbers of targets (SFT).
    fn loss_over_step_tokens(&self) -> bool {
        false
    }

    /// Names of the embedding tables, which `total_flos` leaves out as transformers'
    /// `num_parameters(exclude_embeddings=True)` does.
    fn embedding_parameters(&self) -> Vec<String> {
        Vec::new()
    }

    /// Under tensor parallelism: how each parameter (by its Hugging Face name) is cut over the
    /// group, and the group. `None`, the default, for a whole model.
    fn tensor_parallel(&self) -> Option<TensorParallelLayout> {
        None
    }
}

/// How a parameter is cut over the ranks of a tensor-parallel group.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum ParamSplit {
    /// Every rank holds all of it, and the copies stay equal.
    Replicated,
    /// This rank holds `range` of dimension `axis`, whose whole size is `full`.
    Sharded {
        axis: usize,
        range: std::ops::Range<usize>,
        full: usize,
    },
}

/// A sharded model's place in its tensor-parallel group.
#[derive(Debug, Clone)]
pub struct TensorParallelLayout {
    pub tp: crate::ops::TpComm,
    /// Every parameter's split, by Hugging Face name.
    pub splits: std::collections::BTreeMap<String, ParamSplit>,
}

/// A forward pass cut into segments: `head(layer(n−1, … layer(0, embed(batch)) …))` equals the
/// model's logits. Every segment maps hidden states `[B, T, H]` to the next, so each can be run
/// and differentiated alone.
pub trait Segments<B: Backend, Batch> {
    fn num_layers(&self) -> usize;
    /// The first segment: a batch → hidden states.
    fn embed(&self, batch: &Batch) -> Tensor<B, 3>;
    /// Layer `i` (0-based); `batch` gives what every layer needs besides `x` (positions).
    fn layer(&self, i: usize, x: Tensor<B, 3>, batch: &Batch) -> Tensor<B, 3>;
    /// The last segment: hidden states → logits `[N, C]`, one row per target.
    fn head(&self, h: Tensor<B, 3>, batch: &Batch) -> Tensor<B, 2>;
}

/// A dataset the trainer can batch.
pub trait BatchSource {
    type Batch;
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Length of each example (for `group_by_length`); all ones where length is meaningless.
    fn lengths(&self) -> Vec<usize>;
    /// The examples at `indices`, collated, with one target per logits row.
    fn batch(&self, indices: &[usize]) -> (Self::Batch, Vec<i64>);
    /// The length a batch is padded to when its longest example is `longest` long (see
    /// [`Self::lengths`]): `kiln precompile` enumerates batch shapes with it. Sources whose
    /// batches are not padded keep this default.
    fn padded_length(&self, longest: usize) -> usize {
        longest
    }
}

/// A loss over logits and integer targets. The built-in one is [`CrossEntropy`]; a user's own is
/// honoured in training and in evaluation alike.
pub trait Loss: Send + Sync {
    fn loss<B: KilnBackend>(
        &self,
        logits: Tensor<B, 2>,
        targets: Tensor<B, 1, Int>,
    ) -> Tensor<B, 1>;
}

/// How many of `targets` are not [`IGNORE_INDEX`] (at least 1: the divisor of a mean over them).
pub fn target_count<B: Backend>(targets: &Tensor<B, 1, Int>) -> Tensor<B, 1> {
    targets
        .clone()
        .not_equal_elem(IGNORE_INDEX)
        .float()
        .sum()
        .clamp_min(1.0)
}

/// Mean cross-entropy over the targets that are not [`IGNORE_INDEX`] (PyTorch's `cross_entropy`).
#[derive(Debug, Clone, Copy, Default)]
pub struct CrossEntropy;

impl Loss for CrossEntropy {
    fn loss<B: KilnBackend>(
        &self,
        logits: Tensor<B, 2>,
        targets: Tensor<B, 1, Int>,
    ) -> Tensor<B, 1> {
        let count = target_count(&targets);
        crate::ops::cross_entropy(logits, targets, IGNORE_INDEX).sum() / count
    }
}

/// Cross-entropy against smoothed targets, as transformers' `LabelSmoother`
/// (`label_smoothing_factor` ε): (1 − ε) × the cross-entropy of the labels plus ε × the mean over
/// all classes of −log p, over the targets that are not [`IGNORE_INDEX`]. ε = 0 is [`CrossEntropy`].
#[derive(Debug, Clone, Copy, Default)]
pub struct LabelSmoothedCrossEntropy {
    pub epsilon: f64,
}

impl Loss for LabelSmoothedCrossEntropy {
    fn loss<B: KilnBackend>(
        &self,
        logits: Tensor<B, 2>,
        targets: Tensor<B, 1, Int>,
    ) -> Tensor<B, 1> {
        if self.epsilon == 0.0 {
            return CrossEntropy.loss(logits, targets);
        }
        let [n, classes] = logits.dims();
        let (keep, safe) = crate::ops::kept_targets(targets, IGNORE_INDEX);
        let log_p = log_softmax(logits, 1);
        let picked = log_p.clone().gather(1, safe.reshape([n, 1])).reshape([n]);
        let all = log_p.sum_dim(1).reshape([n]);
        let count = keep.clone().sum().clamp_min(1.0);
        let nll = (picked * keep.clone()).sum().neg() / count.clone();
        let smooth = (all * keep).sum().neg() / (count * classes as f64);
        nll * (1.0 - self.epsilon) + smooth * self.epsilon
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::Cpu;
    use burn::tensor::TensorData;

    /// transformers' LabelSmoother (= torch's `cross_entropy(label_smoothing=ε)`), written out in
    /// f64: (1 − ε)·mean(−log p[label]) + ε·mean over rows and classes of −log p, ignored rows out.
    fn reference(logits: &[[f64; 3]], targets: &[i64], eps: f64) -> f64 {
        let (mut nll, mut all, mut n) = (0.0, 0.0, 0.0);
        for (row, &t) in logits.iter().zip(targets) {
            if t == IGNORE_INDEX {
                continue;
            }
            let z = row.iter().map(|v| v.exp()).sum::<f64>().ln();
            nll -= row[t as usize] - z;
            all -= row.iter().map(|v| v - z).sum::<f64>() / row.len() as f64;
            n += 1.0;
        }
        (1.0 - eps) * nll / n + eps * all / n
    }

    #[test]
    fn label_smoothing_matches_transformers_label_smoother() {
        let logits = [
            [2.0, -1.0, 0.5],
            [0.1, 0.2, 3.0],
            [-2.0, 1.5, 0.0],
            [1.0, 1.0, 1.0],
        ];
        let targets = [0i64, 2, IGNORE_INDEX, 1];
        let device = Default::default();
        let flat: Vec<f32> = logits.iter().flatten().map(|&v| v as f32).collect();
        for eps in [0.0, 0.1, 0.3] {
            let l = Tensor::<Cpu, 2>::from_data(TensorData::new(flat.clone(), [4, 3]), &device);
            let t =
                Tensor::<Cpu, 1, Int>::from_data(TensorData::new(targets.to_vec(), [4]), &device);
            let got: f64 = LabelSmoothedCrossEntropy { epsilon: eps }
                .loss(l, t)
                .into_scalar()
                .into();
            let want = reference(&logits, &targets, eps);
            assert!(
                (got - want).abs() < 1e-6,
                "ε {eps}: kiln {got}, reference {want}"
            );
        }
    }
}
