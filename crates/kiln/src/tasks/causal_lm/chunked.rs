//! The causal-LM loss computed inside the head a chunk of positions at a time (Liger's fused
//! linear cross-entropy; TRL's `nll`, which never materialises the logits): training batches ask
//! the head for each position's loss ([`ChunkedLoss`]), and the loss is their mean. At Qwen2's
//! 151,936-token vocabulary the whole logits and their gradient are 0.6 GB per 1,000 tokens each;
//! chunked, a few dozen MB.

use std::sync::Arc;

use burn::tensor::{Int, Tensor};

use crate::contract::{target_count, BatchSource, Loss};
use crate::data::lm::{ChunkedLoss, TokenBatch};
use crate::ops::KilnBackend;

/// At most this many positions per chunk for a vocabulary of `vocab`: ~256 MB of f32 logits,
/// between 256 and 8192 positions. Each chunk reads the whole head weight again (packing it for
/// the product costs about what 30 rows of the product do), so chunks stay large: the saving is
/// the whole logits against one chunk's, not more.
pub fn auto_chunk(vocab: usize) -> usize {
    ((64 << 20) / vocab.max(1)).clamp(256, 8192)
}

/// `inner`'s batches, each asking the head for its positions' losses `chunk` at a time.
pub struct ChunkedLossBatches<'a, S> {
    pub inner: &'a S,
    pub chunk: usize,
}

impl<S: BatchSource<Batch = TokenBatch>> BatchSource for ChunkedLossBatches<'_, S> {
    type Batch = TokenBatch;
    fn len(&self) -> usize {
        self.inner.len()
    }
    fn lengths(&self) -> Vec<usize> {
        self.inner.lengths()
    }
    fn padded_length(&self, longest: usize) -> usize {
        self.inner.padded_length(longest)
    }
    fn batch(&self, indices: &[usize]) -> (TokenBatch, Vec<i64>) {
        let (mut batch, targets) = self.inner.batch(indices);
        batch.chunked_loss = Some(Arc::new(ChunkedLoss {
            targets: targets.clone(),
            chunk: self.chunk,
        }));
        (batch, targets)
    }
}

/// The mean over the kept targets of the per-position losses the head computed (`[N, 1]`, 0 at
/// ignored positions): the cross-entropy [`crate::contract::CrossEntropy`] gives from the logits.
#[derive(Debug, Clone, Copy, Default)]
pub struct ChunkedMean;

impl Loss for ChunkedMean {
    fn loss<B: KilnBackend>(
        &self,
        losses: Tensor<B, 2>,
        targets: Tensor<B, 1, Int>,
    ) -> Tensor<B, 1> {
        let count = target_count(&targets);
        losses.sum() / count
    }
}
