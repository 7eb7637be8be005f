//! The collectives every parallel strategy is written against, over one engine per build
//! (burn-collective by default, MPI with `--features mpi`, NCCL for CUDA gradients), and the
//! sub-groups of a device mesh ([`Group`]).
//!
//! Every operation takes and returns a flat `[n]` tensor: strategies flatten what they send (one
//! buffer per step, not one per tensor), and engines need nothing else. All ranks of the world call
//! the same collective at the same time (SPMD, as torch.distributed): a sub-group collective is
//! called by every group of its mesh axis at once, which lets an engine without sub-communicators
//! run it as one world collective (see [`Group`]).

use std::sync::Arc;

use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};

use crate::Result;

/// A reduction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReduceOp {
    Sum,
    Mean,
    Max,
}

/// The collectives of a set of ranks. Every call blocks until all its ranks made it, under the
/// job's watchdog: a peer that died or hung stops this worker with an error naming it.
pub trait Collectives<B: Backend>: Send + Sync {
    /// This rank's index in the set, `0..size`.
    fn rank(&self) -> usize;
    /// How many ranks the set holds.
    fn size(&self) -> usize;
    fn device(&self) -> &B::Device;

    /// Element-wise reduction over the set; every rank gets the result.
    fn all_reduce(&self, t: Tensor<B, 1>, op: ReduceOp) -> Result<Tensor<B, 1>>;

    /// Every rank's `t` concatenated in rank order; rank `r` contributes `counts[r]` values (the
    /// same `counts` on every rank: a vocabulary split unevenly gathers without padding).
    fn all_gather_v(&self, t: Tensor<B, 1>, counts: &[usize]) -> Result<Tensor<B, 1>>;

    /// `root`'s `t` on every rank (the others pass a tensor of the same length).
    fn broadcast(&self, t: Tensor<B, 1>, root: usize) -> Result<Tensor<B, 1>>;

    /// Waits until every rank of the set reaches this point.
    fn barrier(&self) -> Result<()> {
        let one = Tensor::from_data(TensorData::new(vec![1f32], [1]), self.device());
        self.all_reduce(one, ReduceOp::Sum).map(drop)
    }

    /// Sum over the set, of which this rank keeps its chunk: rank `r` gets the values
    /// `chunk_range(n, size, r)` (ZeRO-1's gradient shards).
    fn reduce_scatter(&self, t: Tensor<B, 1>) -> Result<Tensor<B, 1>> {
        reduce_scatter_by_sum(self, t)
    }

    /// Every rank's `t` (all the same length) concatenated in rank order.
    fn all_gather(&self, t: Tensor<B, 1>) -> Result<Tensor<B, 1>> {
        let counts = vec![t.dims()[0]; self.size()];
        self.all_gather_v(t, &counts)
    }

    /// Opens this set's point-to-point links ([`Self::send`], [`Self::recv`]). Every rank calls it
    /// at once, before its first send; later calls do nothing.
    fn open_links(&self) -> Result<()> {
        Err(no_links())
    }

    /// Queues `t` for rank `to` of this set and returns without waiting for it to be received
    /// (a pipeline stage hands its activations on and goes on computing). Tensors sent from one
    /// rank to another arrive in the order they were sent.
    fn send(&self, t: Tensor<B, 1>, to: usize) -> Result<()> {
        let _ = (t, to);
        Err(no_links())
    }

    /// The oldest tensor rank `from` of this set sent to this rank and this rank has not yet
    /// received, waiting for it under the job's watchdog.
    fn recv(&self, from: usize) -> Result<Tensor<B, 1>> {
        let _ = from;
        Err(no_links())
    }

    /// This set's native sub-communicator for the group of `groups` this rank is in, when the
    /// engine has them (MPI's `MPI_Comm_split`); `None` makes [`Group`] emulate it. Called by every
    /// rank at once with the same partition.
    fn split(&self, groups: &[Vec<usize>]) -> Result<Option<Arc<dyn Collectives<B>>>> {
        let _ = groups;
        Ok(None)
    }

    /// Sums host values over the set (eval counts, losses, gathered predictions).
    fn sum_host(&self, values: Vec<f32>) -> Result<Vec<f32>> {
        let n = values.len();
        let t = Tensor::from_data(TensorData::new(values, [n]), self.device());
        Ok(host(self.all_reduce(t, ReduceOp::Sum)?))
    }

    /// Sums integers over the set exactly (counts, shapes, hashes, steps), each below
    /// [`EXACT_MAX`], on up to [`EXACT_MAX_RANKS`] ranks. The collectives add f32, which holds
    /// integers exactly only below 2²⁴, so every value travels as [`LIMBS`] limbs of
    /// [`LIMB_BITS`] bits: a limb is below 2¹², and the sum of 4,096 of them below 2²⁴.
    fn sum_exact(&self, values: &[u64]) -> Result<Vec<u64>> {
        check_exact(values, self.size())?;
        let limbs: Vec<f32> = values.iter().flat_map(|&v| to_limbs(v)).collect();
        Ok(self
            .sum_host(limbs)?
            .chunks(LIMBS)
            .map(from_limbs)
            .collect())
    }
}

/// Bits per limb of [`Collectives::sum_exact`]: 12, so that 4,096 ranks' limbs sum below 2²⁴.
pub const LIMB_BITS: u32 = 12;
/// Limbs per value of [`Collectives::sum_exact`].
pub const LIMBS: usize = 4;
/// The largest value [`Collectives::sum_exact`] sums: 2⁴⁸ − 1 (any count or shape kiln meets).
pub const EXACT_MAX: u64 = (1 << (LIMB_BITS as usize * LIMBS)) - 1;
/// The most ranks [`Collectives::sum_exact`] is exact over: 2²⁴ / 2¹².
pub const EXACT_MAX_RANKS: usize = 1 << (24 - LIMB_BITS);

/// A value as [`LIMBS`] f32 limbs, lowest first.
fn to_limbs(v: u64) -> impl Iterator<Item = f32> {
    let mask = (1u64 << LIMB_BITS) - 1;
    (0..LIMBS).map(move |i| ((v >> (LIMB_BITS as usize * i)) & mask) as f32)
}

/// The sum of values from the sums of their limbs (each an exact integer in f32); the carries
/// between limbs are added here, in u64.
fn from_limbs(limbs: &[f32]) -> u64 {
    limbs
        .iter()
        .enumerate()
        .map(|(i, &s)| (s as u64) << (LIMB_BITS as usize * i))
        .sum()
}

/// Refuses a sum [`Collectives::sum_exact`] could not make exact.
fn check_exact(values: &[u64], ranks: usize) -> Result<()> {
    if ranks > EXACT_MAX_RANKS {
        return Err(crate::KilnError::Distributed(format!(
            "an exact integer sum over {ranks} ranks: kiln's collectives add integers exactly over \
             at most {EXACT_MAX_RANKS} ranks"
        )));
    }
    if let Some(v) = values.iter().find(|&&v| v > EXACT_MAX) {
        return Err(crate::KilnError::Distributed(format!(
            "an exact integer sum of {v}: kiln's collectives add integers exactly up to {EXACT_MAX}"
        )));
    }
    Ok(())
}

fn no_links() -> crate::KilnError {
    crate::KilnError::Distributed(
        "this collective engine has no point-to-point links (pipeline parallelism needs them)"
            .into(),
    )
}

/// A reduce-scatter as a sum all-reduce of which each rank keeps its chunk (what an engine
/// without a native one does).
pub(crate) fn reduce_scatter_by_sum<B: Backend, C: Collectives<B> + ?Sized>(
    c: &C,
    t: Tensor<B, 1>,
) -> Result<Tensor<B, 1>> {
    let n = t.dims()[0];
    let r = chunk_range(n, c.size(), c.rank());
    Ok(c.all_reduce(t, ReduceOp::Sum)?.narrow(0, r.start, r.len()))
}

/// A flat tensor of `values` with a buffer of its own. Burn's ndarray backend keeps a tensor
/// made from `TensorData` as a borrowed view and copies it on every later use; a gradient buffer
/// that is then cut into hundreds of parameters would be copied whole for each (SmolLM2's 540 MB
/// flat gradient took 12 GB). One multiplication makes it an array of its own.
pub fn owned_tensor<B: Backend>(values: Vec<f32>, device: &B::Device) -> Tensor<B, 1> {
    let n = values.len();
    Tensor::<B, 1>::from_data(TensorData::new(values, [n]), device).mul_scalar(1.0)
}

/// `t` at position `start` of `total` zeros: how an engine without gathers builds one from a
/// sum, each rank filling its own part.
pub(crate) fn placed<B: Backend>(
    t: Tensor<B, 1>,
    start: usize,
    total: usize,
    device: &B::Device,
) -> Tensor<B, 1> {
    let n = t.dims()[0];
    let mut parts = Vec::with_capacity(3);
    if start > 0 {
        parts.push(Tensor::zeros([start], device));
    }
    parts.push(t);
    if total > start + n {
        parts.push(Tensor::zeros([total - start - n], device));
    }
    Tensor::cat(parts, 0)
}

/// The values of a flat tensor.
pub fn host<B: Backend>(t: Tensor<B, 1>) -> Vec<f32> {
    t.into_data()
        .convert::<f32>()
        .into_vec::<f32>()
        .expect("f32 data")
}

pub use crate::ops::chunk_range;

/// A sub-group of the world: one group of a mesh axis (the TP ranks holding one model replica's
/// shards, or the DP ranks holding one shard).
///
/// burn-collective has no sub-communicators, so a group's collective runs as one world all-reduce
/// of `groups × n` values in which each group fills its own slot (zeros elsewhere). Every group of
/// the axis calls at once, so each gets its own result from one world call. The cost, stated in
/// docs/DESIGN.md: the world moves `groups ×` the data of a native sub-group collective.
///
/// That needs every rank of the world in every call, which a pipeline breaks: its stages run
/// their tensor-parallel layers at different times. A group made [`Group::over_links`] instead
/// runs its collectives over the point-to-point links between its own members: each sends its
/// tensor to every other and adds what it receives in group order, so every member gets the same
/// bits without the rest of the world.
pub struct Group<B: Backend> {
    world: Arc<dyn Collectives<B>>,
    /// The engine's own sub-communicator, where it has them.
    native: Option<Arc<dyn Collectives<B>>>,
    /// The axis's partition of the world: every group's global ranks, in group order.
    groups: Vec<Vec<usize>>,
    /// Which group this rank is in, and its index there.
    group: usize,
    index: usize,
    /// Whether collectives without a native sub-communicator run over the links.
    linked: bool,
}

impl<B: Backend> Group<B> {
    /// This rank's group of the partition `groups` (every world rank in exactly one group, all
    /// groups of equal size). Every rank calls it at once with the same partition.
    pub fn new(world: Arc<dyn Collectives<B>>, groups: Vec<Vec<usize>>) -> Result<Self> {
        let me = world.rank();
        let (group, index) = groups
            .iter()
            .enumerate()
            .find_map(|(g, members)| members.iter().position(|&r| r == me).map(|i| (g, i)))
            .expect("every rank is in one group of a mesh axis");
        let native = if groups.len() > 1 {
            world.split(&groups)?
        } else {
            None
        };
        Ok(Self {
            world,
            native,
            groups,
            group,
            index,
            linked: false,
        })
    }

    /// The group with its collectives over the point-to-point links (which the caller opened on
    /// the world) where the engine has no sub-communicator of its own.
    pub fn over_links(mut self) -> Self {
        self.linked = self.native.is_none() && self.groups.len() > 1;
        self
    }

    /// Every member's `t` in group order, exchanged over the links (sends are queued, so all
    /// members sending first cannot deadlock).
    fn exchange(&self, t: Tensor<B, 1>) -> Result<Vec<Tensor<B, 1>>> {
        let members = self.members();
        for (i, &r) in members.iter().enumerate() {
            if i != self.index {
                self.world.send(t.clone(), r)?;
            }
        }
        members
            .iter()
            .enumerate()
            .map(|(i, &r)| {
                if i == self.index {
                    Ok(t.clone())
                } else {
                    self.world.recv(r)
                }
            })
            .collect()
    }

    /// [`Collectives::all_reduce`] over the links.
    fn linked_all_reduce(&self, t: Tensor<B, 1>, op: ReduceOp) -> Result<Tensor<B, 1>> {
        let all = self.exchange(t)?.into_iter();
        let folded = match op {
            ReduceOp::Sum | ReduceOp::Mean => all.reduce(|a, b| a + b),
            ReduceOp::Max => all.reduce(|a, b| a.max_pair(b)),
        }
        .expect("a group has a member");
        Ok(match op {
            ReduceOp::Mean => folded / self.size() as f32,
            _ => folded,
        })
    }

    /// The whole world as one group.
    pub fn world(world: Arc<dyn Collectives<B>>) -> Self {
        let all = (0..world.size()).collect();
        Self::new(world, vec![all]).expect("the world needs no split")
    }

    /// The collectives that serve this group directly: the world itself when the group is the
    /// world, or the engine's sub-communicator.
    fn direct(&self) -> Option<&dyn Collectives<B>> {
        if self.groups.len() == 1 {
            Some(self.world.as_ref())
        } else {
            self.native.as_deref()
        }
    }

    /// The global ranks of this group.
    pub fn members(&self) -> &[usize] {
        &self.groups[self.group]
    }

    /// The longest payload any group of the axis brings to this call: groups hold different
    /// shards (a data-parallel group of tensor-parallel rank 0 averages a bigger shard than rank
    /// 2's), so every emulated call first agrees on one slot size. The length travels as two
    /// values below 2^20, exact in f32.
    fn slot_len(&self, n: usize) -> Result<usize> {
        let groups = self.groups.len();
        let mut v = vec![0f32; 2 * groups];
        if self.index == 0 {
            v[2 * self.group] = (n >> 20) as f32;
            v[2 * self.group + 1] = (n & ((1 << 20) - 1)) as f32;
        }
        let t = Tensor::from_data(TensorData::new(v, [2 * groups]), self.world.device());
        let all = host(self.world.all_reduce(t, ReduceOp::Sum)?);
        Ok(all
            .chunks(2)
            .map(|p| ((p[0] as usize) << 20) + p[1] as usize)
            .max()
            .unwrap_or(n))
    }

    /// A world buffer of `groups × slot` zeros with `t` in this group's slot at `offset`.
    fn in_slot(&self, t: Tensor<B, 1>, slot: usize, offset: usize) -> Tensor<B, 1> {
        let start = self.group * slot + offset;
        placed(t, start, self.groups.len() * slot, self.world.device())
    }
}

impl<B: Backend> Collectives<B> for Group<B> {
    fn rank(&self) -> usize {
        self.index
    }

    fn size(&self) -> usize {
        self.members().len()
    }

    fn device(&self) -> &B::Device {
        self.world.device()
    }

    fn all_reduce(&self, t: Tensor<B, 1>, op: ReduceOp) -> Result<Tensor<B, 1>> {
        if let Some(c) = self.direct() {
            return c.all_reduce(t, op);
        }
        if self.size() == 1 {
            return Ok(t);
        }
        if self.linked {
            return self.linked_all_reduce(t, op);
        }
        let n = t.dims()[0];
        match op {
            ReduceOp::Sum | ReduceOp::Mean => {
                let slot = self.slot_len(n)?;
                let all = self
                    .world
                    .all_reduce(self.in_slot(t, slot, 0), ReduceOp::Sum)?;
                let mine = all.narrow(0, self.group * slot, n);
                Ok(if op == ReduceOp::Mean {
                    mine / self.size() as f32
                } else {
                    mine
                })
            }
            // No engine slot can take a max of sums: gather, then reduce locally.
            ReduceOp::Max => {
                let size = self.size();
                let all = self.all_gather(t)?.reshape([size, n]);
                Ok(all.max_dim(0).reshape([n]))
            }
        }
    }

    fn all_gather_v(&self, t: Tensor<B, 1>, counts: &[usize]) -> Result<Tensor<B, 1>> {
        if let Some(c) = self.direct() {
            return c.all_gather_v(t, counts);
        }
        if self.size() == 1 {
            return Ok(t);
        }
        if self.linked {
            return Ok(Tensor::cat(self.exchange(t)?, 0));
        }
        // Each member writes its piece at its offset of the group's slot; the sum assembles it.
        let total: usize = counts.iter().sum();
        let offset: usize = counts[..self.index].iter().sum();
        let slot = self.slot_len(total)?;
        let all = self
            .world
            .all_reduce(self.in_slot(t, slot, offset), ReduceOp::Sum)?;
        Ok(all.narrow(0, self.group * slot, total))
    }

    fn broadcast(&self, t: Tensor<B, 1>, root: usize) -> Result<Tensor<B, 1>> {
        if let Some(c) = self.direct() {
            return c.broadcast(t, root);
        }
        if self.size() == 1 {
            return Ok(t);
        }
        if self.linked {
            let members = self.members();
            if self.index != root {
                return self.world.recv(members[root]);
            }
            for (i, &r) in members.iter().enumerate() {
                if i != root {
                    self.world.send(t.clone(), r)?;
                }
            }
            return Ok(t);
        }
        let t = if self.index == root {
            t
        } else {
            t.zeros_like()
        };
        self.all_reduce(t, ReduceOp::Sum)
    }

    // Point-to-point always goes through the world's links (a rank has one set, whatever group
    // names its peer): this group's index `to` is the world's rank `members[to]`.
    fn open_links(&self) -> Result<()> {
        self.world.open_links()
    }

    fn send(&self, t: Tensor<B, 1>, to: usize) -> Result<()> {
        self.world.send(t, self.members()[to])
    }

    fn recv(&self, from: usize) -> Result<Tensor<B, 1>> {
        self.world.recv(self.members()[from])
    }

    fn barrier(&self) -> Result<()> {
        // Every group of the axis reaches it together: a world barrier is this group's too.
        match self.direct() {
            Some(c) => c.barrier(),
            None if self.linked => {
                let one = Tensor::zeros([1], self.world.device());
                self.exchange(one).map(|_| ())
            }
            None => self.world.barrier(),
        }
    }

    fn reduce_scatter(&self, t: Tensor<B, 1>) -> Result<Tensor<B, 1>> {
        match self.direct() {
            Some(c) => c.reduce_scatter(t),
            None => {
                let n = t.dims()[0];
                let r = chunk_range(n, self.size(), self.index);
                Ok(self
                    .all_reduce(t, ReduceOp::Sum)?
                    .narrow(0, r.start, r.len()))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_cover_uneven_dimensions_without_padding() {
        // SmolLM2's 49152-token vocabulary over 5 ranks; 9 heads over 2.
        let r: Vec<_> = (0..5).map(|i| chunk_range(49152, 5, i)).collect();
        assert_eq!(r[0], 0..9831);
        assert_eq!(r[1], 9831..19662);
        assert_eq!(r[4].end, 49152);
        assert!(r.windows(2).all(|w| w[0].end == w[1].start));
        assert_eq!(chunk_range(9, 2, 0), 0..5);
        assert_eq!(chunk_range(9, 2, 1), 5..9);
        assert_eq!(chunk_range(1, 3, 2), 1..1);
    }

    /// Sums an f32 all-reduce could not hold (above 2²⁴, and carries between limbs) come out
    /// exact, against the same sum in u64; values past the limit are refused.
    #[test]
    fn sum_exact_adds_integers_an_f32_sum_would_round() {
        type B = burn::backend::NdArray<f32>;
        let device = Default::default();
        let ranks = crate::parallel::threads::ThreadComm::<B>::group(3, &device);
        let per_rank: [[u64; 4]; 3] = [
            [(1 << 24) + 1, EXACT_MAX, 0, 4095],
            [(1 << 40) + 3, 0, 7, 4095],
            [123_456_789_012, 0, 1, 1],
        ];
        let want: Vec<u64> = (0..4)
            .map(|i| per_rank.iter().map(|r| r[i]).sum())
            .collect();
        std::thread::scope(|s| {
            let handles: Vec<_> = ranks
                .into_iter()
                .zip(per_rank)
                .map(|(c, v)| s.spawn(move || c.sum_exact(&v).unwrap()))
                .collect();
            for h in handles {
                assert_eq!(h.join().unwrap(), want);
            }
        });
        // Rounded by f32, the first sum loses its low bits.
        assert_ne!(
            ((1u64 << 24) + 1 + (1 << 40) + 3) as f32 as u64,
            want[0] - 123_456_789_012
        );
        let alone = crate::parallel::threads::ThreadComm::<B>::group(1, &device);
        let err = alone[0]
            .sum_exact(&[EXACT_MAX + 1])
            .unwrap_err()
            .to_string();
        assert!(err.contains("exactly up to 281474976710655"), "{err}");
        assert!(check_exact(&[1], EXACT_MAX_RANKS + 1).is_err());
        assert!(check_exact(&[EXACT_MAX], EXACT_MAX_RANKS).is_ok());
    }
}
