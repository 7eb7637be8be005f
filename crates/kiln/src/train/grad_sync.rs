//! How one step's accumulated gradients become what the optimizer applies: averaged over the
//! data-parallel ranks (whole, or each rank's ZeRO-1 chunk), then clipped by one global norm that
//! counts every value once — a tensor-parallel shard once per group, a replicated parameter once,
//! a ZeRO-1 chunk once per data-parallel group.

use burn::tensor::Tensor;

use super::optim::{clip_coefficient, GradAccumulator};
use crate::contract::{ParamSplit, TensorParallelLayout};
use crate::ops::KilnBackend;
use crate::parallel::{DataParallel, Zero1, ZeroPartition};
use crate::Result;

/// The gradients an update applies.
pub enum SyncedGrads<B: KilnBackend> {
    /// Every parameter's averaged gradient.
    Whole(GradAccumulator<B>),
    /// This rank's ZeRO-1 chunk of the averaged gradients, the clipping factor to apply, and the
    /// group that gathers the updated chunks back.
    Chunk {
        partition: ZeroPartition,
        chunk: Tensor<B, 1>,
        factor: f64,
        zero: Zero1<B>,
    },
}

/// A step's loss and gradient norm as every rank sees them, and its gradients.
pub struct Synced<B: KilnBackend> {
    pub loss: f64,
    /// The norm before clipping.
    pub grad_norm: f64,
    pub grads: SyncedGrads<B>,
}

/// What a global norm's sums of squares are put together over: a tensor-parallel layout's shards
/// are summed over its group; a pipeline's stages each add their own parameters, a tied weight
/// counted on one stage only.
pub struct NormParts<'a> {
    pub tp: Option<&'a TensorParallelLayout>,
    pub stages: Option<&'a dyn StageNorm>,
}

/// What a global norm needs of a pipeline: which parameters another stage counts, and the sum of
/// one value over the stages. The pipeline's plan gives it, so gradient syncing need not know it.
pub trait StageNorm {
    /// Whether another stage counts parameter `name` (a tied embedding, counted on stage 0).
    fn counted_elsewhere(&self, name: &str) -> bool;
    /// `v` summed over the stages.
    fn stage_sum(&self, v: f64) -> Result<f64>;
}

impl NormParts<'_> {
    /// Whether parameter `name` is a tensor-parallel shard (its squares are summed over the group).
    fn is_shard(&self, name: &str) -> bool {
        self.tp
            .is_some_and(|l| matches!(l.splits.get(name), Some(ParamSplit::Sharded { .. })))
    }

    /// Whether this rank counts `name` at all (not when another stage counts it).
    fn counts(&self, name: &str) -> bool {
        !self.stages.is_some_and(|p| p.counted_elsewhere(name))
    }

    /// The global norm from this rank's sums of squares of sharded and replicated values.
    fn norm(&self, shards: f64, replicated: f64) -> Result<f64> {
        let shards = match self.tp {
            Some(l) => l.tp.sum(vec![shards as f32])[0] as f64,
            None => shards,
        };
        let total = match self.stages {
            Some(p) => p.stage_sum(shards + replicated)?,
            None => shards + replicated,
        };
        Ok(total.sqrt())
    }
}

/// Averages `acc` (and the step's summed micro-batch loss) over the data-parallel ranks and clips
/// it to `max_norm` (0 = no clipping).
pub fn sync_and_clip<B: KilnBackend>(
    mut acc: GradAccumulator<B>,
    loss_sum: f64,
    device: &B::Device,
    parallel: &DataParallel<B>,
    parts: &NormParts<'_>,
    max_norm: f64,
) -> Result<Synced<B>> {
    let loss = if parallel.size() > 1 {
        acc.reduce_flat(loss_sum, device, |flat| parallel.average(flat))?
    } else {
        loss_sum
    };
    let shards = acc.sum_squares(|n| parts.counts(n) && parts.is_shard(n));
    let replicated = acc.sum_squares(|n| parts.counts(n) && !parts.is_shard(n));
    let grad_norm = parts.norm(shards, replicated)? * acc.factor.abs();
    acc.clip_norm(grad_norm, max_norm);
    Ok(Synced {
        loss,
        grad_norm,
        grads: SyncedGrads::Whole(acc),
    })
}

/// ZeRO-1's [`sync_and_clip`]: gradients are reduce-scattered, so this rank receives the average
/// of its own chunk only, and the norm is summed from every rank's chunk.
pub fn sync_and_clip_zero1<B: KilnBackend>(
    acc: GradAccumulator<B>,
    loss_sum: f64,
    zero: &Zero1<B>,
    parts: &NormParts<'_>,
    max_norm: f64,
) -> Result<Synced<B>> {
    let partition = ZeroPartition::new(
        acc.grads.iter().map(|(p, g)| (p.as_str(), g.dims()[0])),
        zero.rank(),
        zero.size(),
    );
    let pending = acc.factor;
    let flat = Tensor::cat(acc.grads.into_values().collect(), 0);
    let chunk = zero.average_chunk(flat)?;
    let (mut shards, mut replicated) = (0.0, 0.0);
    for seg in partition.owned() {
        let part = chunk.clone().narrow(0, seg.at.start, seg.at.len());
        let sq = B::kiln_sum_squares(part.into_primitive().tensor());
        if !parts.counts(&seg.path) {
            continue;
        }
        if parts.is_shard(&seg.path) {
            shards += sq;
        } else {
            replicated += sq;
        }
    }
    let sums = zero.sum_host(vec![loss_sum as f32, shards as f32, replicated as f32])?;
    let loss = sums[0] as f64 / zero.size() as f64;
    let grad_norm = parts.norm(sums[1] as f64, sums[2] as f64)? * pending.abs();
    let factor = pending * clip_coefficient(grad_norm, max_norm);
    Ok(Synced {
        loss,
        grad_norm,
        grads: SyncedGrads::Chunk {
            partition,
            chunk,
            factor,
            zero: zero.clone(),
        },
    })
}
