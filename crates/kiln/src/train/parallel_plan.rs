//! The run's parallelism as one value the trainer calls. Tasks build it before the trainer
//! (`ParallelPlan::new(DataParallel::join(..))`, like `init_process_group` at the top of a
//! script) and hand it to [`super::Trainer::new`]; training settles the rest from the model and
//! the arguments. It holds:
//! - the data-parallel strategy: this rank's share of the data, the initial broadcast, rank 0's
//!   writes, the evaluation gather (a world of one when run alone);
//! - the model's tensor-parallel layout, if it is sharded;
//! - ZeRO-1 over the data-parallel group (`--zero-1` with more than one data-parallel rank).
//!
//! A step's gradients go through it twice: [`ParallelPlan::sync_and_clip`] averages and clips
//! them (whole, or this rank's ZeRO-1 chunk), and [`ParallelPlan::update`] applies them. The
//! pipeline-parallel strategy will be one more part of this value.

use burn::module::AutodiffModule;
use burn::tensor::backend::AutodiffBackend;

use super::grad_sync::{sync_and_clip, sync_and_clip_zero1, Synced, SyncedGrads};
use super::optim::{GradAccumulator, Optimizer};
use crate::ops::KilnBackend;
use crate::parallel::{DataParallel, Zero1};
use crate::task::TensorParallelLayout;
use crate::Result;

pub struct ParallelPlan<B: KilnBackend> {
    pub data: DataParallel<B>,
    tensor: Option<TensorParallelLayout>,
    zero: Option<Zero1<B>>,
}

impl<B: KilnBackend> ParallelPlan<B> {
    /// A plan over `data`'s group; tensor parallelism and ZeRO-1 are settled when training starts.
    pub fn new(data: DataParallel<B>) -> Self {
        Self {
            data,
            tensor: None,
            zero: None,
        }
    }

    /// One process alone.
    pub fn single() -> Self {
        Self::new(DataParallel::single())
    }

    /// Takes the model's tensor-parallel layout (if sharded) and, with `zero_1`, ZeRO-1 over the
    /// data-parallel group (none when that group is one rank).
    pub(super) fn settle(&mut self, tensor: Option<TensorParallelLayout>, zero_1: bool) {
        self.tensor = tensor;
        self.zero = if zero_1 { self.data.zero1() } else { None };
    }

    pub fn tensor(&self) -> Option<&TensorParallelLayout> {
        self.tensor.as_ref()
    }

    pub fn zero(&self) -> Option<&Zero1<B>> {
        self.zero.as_ref()
    }

    /// Whether checkpoints are written per rank (tensor parallelism or ZeRO-1).
    pub fn sharded(&self) -> bool {
        self.tensor.is_some() || self.zero.is_some()
    }

    /// Whether a step needs no peer at all (one data-parallel rank, no tensor parallelism).
    pub fn alone(&self) -> bool {
        self.data.size() == 1 && self.tensor.is_none()
    }

    /// A step's accumulated gradients (and its summed loss) averaged over the data-parallel
    /// ranks and clipped to `max_norm` by one global norm.
    pub(super) fn sync_and_clip(
        &self,
        acc: GradAccumulator<B>,
        loss_sum: f64,
        device: &B::Device,
        max_norm: f64,
    ) -> Result<Synced<B>> {
        let tp = self.tensor.as_ref();
        match &self.zero {
            Some(zero) => sync_and_clip_zero1(acc, loss_sum, zero, tp, max_norm),
            None => sync_and_clip(acc, loss_sum, device, &self.data, tp, max_norm),
        }
    }

    /// Applies synced gradients at learning rate `lr`: every parameter, or (ZeRO-1) this rank's
    /// chunk, whose updated values are then gathered from every rank.
    pub(super) fn update<AB, M>(
        &self,
        optimizer: &mut Optimizer<B>,
        model: M,
        lr: f64,
        grads: SyncedGrads<B>,
    ) -> Result<M>
    where
        AB: AutodiffBackend<InnerBackend = B>,
        M: AutodiffModule<AB>,
    {
        match grads {
            SyncedGrads::Whole(acc) => Ok(optimizer.step::<AB, M>(model, lr, acc)),
            SyncedGrads::Chunk {
                partition,
                chunk,
                factor,
                zero,
            } => optimizer.step_zero1::<AB, M>(model, lr, &partition, (chunk, factor), |c| {
                zero.gather(c, &partition)
            }),
        }
    }
}
