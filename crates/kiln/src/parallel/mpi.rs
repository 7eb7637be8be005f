//! The collectives on MPI (`--features mpi`): the standard engine of CPU clusters, through the
//! `mpi` crate (rsmpi) and the system's Open MPI or MPICH. MPI moves data inside a machine through
//! shared memory and between machines over TCP, UCX or InfiniBand, reduces with max as well as sum,
//! and has real sub-communicators, so nothing here is emulated.
//!
//! Workers are started by `mpirun` / `srun` (or `kiln launch --backend mpi`, which runs
//! `mpirun`); each call runs under the same watchdog as Burn's engine, so a hung peer stops the
//! job with an error instead of a silent wait (mpirun itself ends the job when a rank dies).

use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Duration;

use burn::tensor::backend::Backend;
use burn::tensor::Tensor;
use mpi::collective::SystemOperation;
use mpi::environment::{Threading, Universe};
use mpi::topology::{Color, SimpleCommunicator};
use mpi::traits::*;

use super::collectives::{chunk_range, host, Collectives, ReduceOp};
use super::group::watched;
use crate::{KilnError, Result};

/// MPI may be initialised once per process. Every communicator holds the universe; when the last
/// is dropped (the job is over), MPI is finalised, which mpirun needs to see a clean exit.
static UNIVERSE: Mutex<Weak<Holder<Universe>>> = Mutex::new(Weak::new());

/// MPI handles are plain integers or pointers the library guards itself: with the thread level
/// MPI granted at start (at least `Serialized`) and one collective at a time per communicator,
/// sharing them between threads is sound.
struct Holder<T>(T);
// SAFETY: see above; kiln calls a communicator from one thread at a time (every collective is
// a blocking call of the trainer's thread).
unsafe impl<T> Send for Holder<T> {}
unsafe impl<T> Sync for Holder<T> {}

/// One MPI communicator (the world, or a mesh group's sub-communicator) as [`Collectives`].
pub struct MpiComm<B: Backend> {
    /// Dropped before `universe` (fields drop in order): a communicator is freed before MPI ends.
    comm: Holder<SimpleCommunicator>,
    universe: Arc<Holder<Universe>>,
    /// The world rank, for the watchdog's messages.
    world_rank: usize,
    rank: usize,
    size: usize,
    device: B::Device,
    timeout: Duration,
    /// Point-to-point links (a pipeline's hand-overs), once opened; shared by the world and its
    /// sub-communicators, which address peers by world rank.
    links: Arc<OnceLock<super::p2p::Links>>,
    /// The world rank of each rank of this communicator.
    members: Vec<usize>,
}

impl<B: Backend> MpiComm<B> {
    /// Initialises MPI (once per process) and returns its world.
    pub fn world(device: &B::Device, timeout: Duration) -> Result<Self> {
        let mut live = UNIVERSE.lock().unwrap_or_else(|e| e.into_inner());
        let universe = match live.upgrade() {
            Some(u) => u,
            None => {
                let (universe, level) = mpi::initialize_with_threading(Threading::Multiple)
                    .ok_or_else(|| {
                        KilnError::Distributed(
                            "MPI can be started once per process, and it was already".into(),
                        )
                    })?;
                if level < Threading::Serialized {
                    return Err(KilnError::Distributed(format!(
                        "the MPI library grants thread level {level:?}; kiln needs at least Serialized"
                    )));
                }
                let u = Arc::new(Holder(universe));
                *live = Arc::downgrade(&u);
                u
            }
        };
        let world = universe.0.world();
        let (rank, size) = (world.rank() as usize, world.size() as usize);
        Ok(Self {
            comm: Holder(world),
            universe,
            world_rank: rank,
            rank,
            size,
            device: device.clone(),
            timeout,
            links: Arc::new(OnceLock::new()),
            members: (0..size).collect(),
        })
    }

    fn comm(&self) -> &SimpleCommunicator {
        &self.comm.0
    }

    /// Runs one MPI call under the watchdog.
    fn call<T>(&self, what: &str, f: impl FnOnce(&SimpleCommunicator) -> T) -> T {
        let msg = format!(
            "MPI {what} did not complete within {}s (a peer died or hung)",
            self.timeout.as_secs()
        );
        watched(self.world_rank, self.timeout, msg, || f(self.comm()))
    }

    /// The world rank of this communicator's rank `r`.
    fn world_rank_of(&self, r: usize) -> Result<usize> {
        self.members.get(r).copied().ok_or_else(|| {
            KilnError::Distributed(format!(
                "rank {r} is outside this MPI communicator of {} ranks",
                self.size
            ))
        })
    }

    fn tensor(&self, v: Vec<f32>) -> Tensor<B, 1> {
        super::collectives::owned_tensor(v, &self.device)
    }
}

impl<B: Backend> Collectives<B> for MpiComm<B> {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn device(&self) -> &B::Device {
        &self.device
    }

    fn all_reduce(&self, t: Tensor<B, 1>, op: ReduceOp) -> Result<Tensor<B, 1>> {
        let send = host(t);
        let mut out = vec![0f32; send.len()];
        self.call("all-reduce", |c| match op {
            ReduceOp::Sum | ReduceOp::Mean => {
                c.all_reduce_into(&send[..], &mut out[..], SystemOperation::sum())
            }
            ReduceOp::Max => c.all_reduce_into(&send[..], &mut out[..], SystemOperation::max()),
        });
        if op == ReduceOp::Mean {
            let k = self.size as f32;
            out.iter_mut().for_each(|v| *v /= k);
        }
        Ok(self.tensor(out))
    }

    fn all_gather_v(&self, t: Tensor<B, 1>, counts: &[usize]) -> Result<Tensor<B, 1>> {
        // Pieces padded to the longest, gathered, then packed: one call for uneven splits too.
        let width = counts.iter().copied().max().unwrap_or(0);
        let mut send = host(t);
        send.resize(width, 0.0);
        let mut all = vec![0f32; width * self.size];
        self.call("all-gather", |c| c.all_gather_into(&send[..], &mut all[..]));
        drop(send);
        // Packed in place: each piece moves left over the padding before it.
        let mut at = 0;
        for (r, &k) in counts.iter().enumerate() {
            all.copy_within(r * width..r * width + k, at);
            at += k;
        }
        all.truncate(at);
        Ok(self.tensor(all))
    }

    fn broadcast(&self, t: Tensor<B, 1>, root: usize) -> Result<Tensor<B, 1>> {
        let mut buf = host(t);
        self.call("broadcast", |c| {
            c.process_at_rank(root as i32).broadcast_into(&mut buf[..])
        });
        Ok(self.tensor(buf))
    }

    fn barrier(&self) -> Result<()> {
        self.call("barrier", |c| c.barrier());
        Ok(())
    }

    fn reduce_scatter(&self, t: Tensor<B, 1>) -> Result<Tensor<B, 1>> {
        let mut send = host(t);
        let n = send.len();
        // MPI's block form takes equal chunks: kiln's uneven ones (`chunk_range`: the first
        // `n % size` one longer) sit in slots of the longest, zero-padded, moved in place.
        let width = n.div_ceil(self.size);
        send.resize(width * self.size, 0.0);
        for r in (0..self.size).rev() {
            let c = chunk_range(n, self.size, r);
            send.copy_within(c.clone(), r * width);
            send[r * width + c.len()..(r + 1) * width].fill(0.0);
        }
        let mut out = vec![0f32; width];
        self.call("reduce-scatter", |c| {
            c.reduce_scatter_block_into(&send[..], &mut out[..], SystemOperation::sum())
        });
        drop(send);
        out.truncate(chunk_range(n, self.size, self.rank).len());
        Ok(self.tensor(out))
    }

    fn split(&self, groups: &[Vec<usize>]) -> Result<Option<Arc<dyn Collectives<B>>>> {
        let (color, key) = groups
            .iter()
            .enumerate()
            .find_map(|(g, m)| m.iter().position(|&r| r == self.rank).map(|i| (g, i)))
            .expect("every rank is in one group");
        let sub = self
            .call("communicator split", |c| {
                c.split_by_color_with_key(Color::with_value(color as i32), key as i32)
            })
            .ok_or_else(|| KilnError::Distributed("MPI_Comm_split gave no communicator".into()))?;
        Ok(Some(Arc::new(Self {
            rank: sub.rank() as usize,
            size: sub.size() as usize,
            comm: Holder(sub),
            universe: self.universe.clone(),
            world_rank: self.world_rank,
            device: self.device.clone(),
            timeout: self.timeout,
            links: self.links.clone(),
            members: groups[color].clone(),
        })))
    }

    // MPI's own sends block until matched in standard mode, and two neighbours sending to each
    // other at once then deadlock; kiln's links queue instead (`p2p.rs`), their addresses
    // exchanged over MPI. The node address: KILN_NODE_ADDR, else MASTER_ADDR, else loopback.
    fn open_links(&self) -> Result<()> {
        if self.links.get().is_none() {
            if self.members.len() != self.universe.0.world().size() as usize {
                return Err(KilnError::Distributed(
                    "point-to-point links open on the MPI world, not a sub-communicator".into(),
                ));
            }
            let node = std::env::var("KILN_NODE_ADDR")
                .or_else(|_| std::env::var("MASTER_ADDR"))
                .unwrap_or_else(|_| "127.0.0.1".into());
            let links = super::p2p::Links::open(self, &node, self.timeout)?;
            let _ = self.links.set(links);
        }
        Ok(())
    }

    fn send(&self, t: Tensor<B, 1>, to: usize) -> Result<()> {
        let to = self.world_rank_of(to)?;
        super::p2p::opened(&self.links, self.world_rank)?.send(to, host(t))
    }

    fn recv(&self, from: usize) -> Result<Tensor<B, 1>> {
        let from = self.world_rank_of(from)?;
        let v = super::p2p::opened(&self.links, self.world_rank)?.recv(from)?;
        Ok(self.tensor(v))
    }
}
