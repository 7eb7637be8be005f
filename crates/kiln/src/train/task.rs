//! What the trainer needs from a model and a dataset, whatever the task (text classification,
//! MNIST, causal LM): logits for a host-side batch, and batches of examples with integer targets.

use burn::module::Module;
use burn::tensor::activation::log_softmax;
use burn::tensor::{backend::Backend, Int, Tensor};

use super::optim::GradAccumulator;
use crate::ops::TrainBackend;

/// Target value that is left out of the loss (transformers' `ignore_index`).
pub const IGNORE_INDEX: i64 = -100;

/// A model that maps a batch to logits `[N, C]`, one row per target.
pub trait Classifier<B: Backend>: Module<B> {
    /// The batch as host data, independent of the backend.
    type Batch;
    fn logits(&self, batch: &Self::Batch) -> Tensor<B, 2>;

    /// The loss of `batch` times `scale`, and its gradients, when the model computes them its own
    /// way (activation checkpointing recomputes each layer during the backward pass). `None`, the
    /// default, lets the trainer differentiate [`logits`](Self::logits).
    fn loss_and_grads<L: Loss>(
        &self,
        _batch: &Self::Batch,
        _targets: &[i64],
        _loss: &L,
        _scale: f64,
    ) -> Option<(f64, GradAccumulator<B::InnerBackend>)>
    where
        B: TrainBackend,
    {
        None
    }
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
}

/// A loss over logits and integer targets. The built-in one is [`CrossEntropy`]; a user's own is
/// honoured in training and in evaluation alike.
pub trait Loss: Send + Sync {
    fn loss<B: Backend>(&self, logits: Tensor<B, 2>, targets: Tensor<B, 1, Int>) -> Tensor<B, 1>;
}

/// Mean cross-entropy over the targets that are not [`IGNORE_INDEX`] (PyTorch's `cross_entropy`).
#[derive(Debug, Clone, Copy, Default)]
pub struct CrossEntropy;

impl Loss for CrossEntropy {
    fn loss<B: Backend>(&self, logits: Tensor<B, 2>, targets: Tensor<B, 1, Int>) -> Tensor<B, 1> {
        let [n, _] = logits.dims();
        let keep = targets.clone().not_equal_elem(IGNORE_INDEX);
        let safe = targets.mask_fill(keep.clone().bool_not(), 0);
        let picked = log_softmax(logits, 1)
            .gather(1, safe.reshape([n, 1]))
            .reshape([n]);
        let keep = keep.float();
        let count = keep.clone().sum().clamp_min(1.0);
        (picked * keep).sum().neg() / count
    }
}
