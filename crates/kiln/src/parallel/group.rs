//! The process group: every collective the data-parallel trainer needs, on Burn's collective engine
//! (`burn-collective`): each worker process is one of its "nodes" with one device, global rank 0
//! also runs its orchestrator (the rendezvous), and all-reduce runs peer to peer.
//!
//! Burn's collectives block until every peer has called them and have no timeout of their own, so
//! each call runs under a watchdog: if it does not finish within the timeout (a peer died or hung),
//! this worker prints one line — which rank it is, what it waited for and, from the heartbeat
//! board (`heartbeat.rs`), which peer did not arrive — and exits non-zero. A connection that breaks
//! inside Burn's networking threads (a peer was killed) ends the worker the same way, with one line
//! instead of a panic's backtrace. The launcher then stops the whole job — never a silent hang.

use std::marker::PhantomData;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Tensor, TensorPrimitive};
use burn_collective::{CollectiveConfig, PeerId, ReduceOperation};

use super::collectives::{host, placed, Collectives, ReduceOp};
use super::heartbeat::Heartbeat;
use super::{ensure_port_free, DistEnv};
use crate::{KilnError, Result};

/// The most values one collective carries (64 MiB of f32).
pub const BUCKET_ELEMENTS: usize = 16 << 20;

/// Exit status of a worker whose collective timed out.
pub const TIMEOUT_EXIT_CODE: i32 = 75;
/// Exit status of a worker whose connection to a peer broke.
pub const PEER_LOST_EXIT_CODE: i32 = 76;
/// Exit status of a worker that joined a job of another WORLD_SIZE.
pub const MISMATCH_EXIT_CODE: i32 = 77;

/// This worker's heartbeat, once it joined a job (read by the watchdog and the panic hook).
static HEARTBEAT: OnceLock<Arc<Heartbeat>> = OnceLock::new();

/// Which peers a stuck collective waits for, from the heartbeat board.
fn peers_clause() -> String {
    HEARTBEAT
        .get()
        .map_or_else(String::new, |hb| format!(": {}", hb.describe_peers()))
}

/// Burn's networking runs on tokio threads and panics when a peer's connection breaks (a peer was
/// killed). In a worker that is not a bug to debug but the end of the job: one line, naming the
/// collective and the peer that went silent, then exit. Panics elsewhere keep the default hook.
fn install_peer_lost_hook(rank: usize) {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let networking = std::thread::current()
            .name()
            .is_some_and(|n| n.starts_with("tokio"));
        if !networking {
            return default(info);
        }
        let payload = info
            .payload()
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| info.payload().downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_default();
        // The payload is Burn's debug dump of a socket error; its gist is enough. Any other
        // payload is quoted (its first line), so that a break no gist names still says its cause.
        let cause = [
            ("eset", "connection reset"),
            ("roken pipe", "broken pipe"),
            ("efused", "connection refused"),
            ("losed", "connection closed"),
        ]
        .iter()
        .find(|(needle, _)| payload.contains(needle))
        .map_or_else(|| unnamed_cause(&payload), |(_, gist)| gist.to_string());
        // Give the board a moment to see which peer went silent.
        std::thread::sleep(std::time::Duration::from_millis(2500));
        let during = Watchdog::get(rank)
            .current()
            .unwrap_or_else(|| "a collective".into());
        eprintln!(
            "error: rank {rank}: lost the connection to a peer during {during} ({cause}){}; stopping this worker",
            peers_clause()
        );
        std::process::exit(PEER_LOST_EXIT_CODE);
    }));
}

/// "connection error", with the first line of a networking panic's payload that no known cause
/// matched (at most 200 characters, escaped: it came from the network stack).
fn unnamed_cause(payload: &str) -> String {
    let line: String = payload
        .lines()
        .next()
        .unwrap_or("")
        .chars()
        .take(200)
        .collect();
    match line.trim() {
        "" => "connection error".into(),
        line => format!(
            "connection error: {}",
            crate::error::escape_for_terminal(line)
        ),
    }
}

/// Runs `f` (a collective of rank `rank`) under the job's watchdog: if it takes longer than
/// `timeout`, the worker prints `what` and which peers are missing, and exits.
#[cfg_attr(not(feature = "mpi"), allow(dead_code))]
pub(crate) fn watched<T>(rank: usize, timeout: Duration, what: String, f: impl FnOnce() -> T) -> T {
    Watchdog::get(rank).guard(timeout, what, f)
}

/// One pending deadline, checked by a background thread.
struct Watchdog {
    rank: usize,
    pending: Mutex<Option<(Instant, String)>>,
}

impl Watchdog {
    fn get(rank: usize) -> &'static Watchdog {
        static DOG: OnceLock<Watchdog> = OnceLock::new();
        DOG.get_or_init(|| {
            std::thread::Builder::new()
                .name("kiln-watchdog".into())
                .spawn(|| loop {
                    std::thread::sleep(Duration::from_millis(200));
                    let dog = DOG.get().expect("initialised before the thread runs");
                    if let Some(m) = HEARTBEAT.get().and_then(|hb| hb.mismatch()) {
                        eprintln!("error: rank {}: {m}; stopping this worker", dog.rank);
                        std::process::exit(MISMATCH_EXIT_CODE);
                    }
                    let late = dog
                        .pending
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .as_ref()
                        .filter(|(deadline, _)| Instant::now() > *deadline)
                        .map(|(_, what)| what.clone());
                    if let Some(what) = late {
                        eprintln!(
                            "error: rank {}: {what}{}; stopping this worker",
                            dog.rank,
                            peers_clause()
                        );
                        std::process::exit(TIMEOUT_EXIT_CODE);
                    }
                })
                .expect("spawn watchdog thread");
            Watchdog {
                rank,
                pending: Mutex::new(None),
            }
        })
    }

    /// What the worker is waiting for now, if anything.
    fn current(&self) -> Option<String> {
        self.pending
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .map(|(_, what)| what.split(" did not").next().unwrap_or(what).to_string())
    }

    /// Runs `f`; if it takes longer than `timeout`, the process exits with `what` as the reason.
    fn guard<T>(&self, timeout: Duration, what: String, f: impl FnOnce() -> T) -> T {
        *self.pending.lock().unwrap_or_else(|e| e.into_inner()) =
            Some((Instant::now() + timeout, what));
        let out = f();
        *self.pending.lock().unwrap_or_else(|e| e.into_inner()) = None;
        out
    }
}

/// The data-parallel process group of this worker, over backend `B` (the inner backend when
/// training with autodiff: gradients are plain tensors).
pub struct ProcessGroup<B: Backend> {
    pub env: DistEnv,
    peer: PeerId,
    timeout: Duration,
    device: B::Device,
    /// CUDA workers reduce on the GPU through NCCL (see `nccl.rs`).
    #[cfg(feature = "cuda")]
    nccl: Option<super::nccl::NcclComm>,
    /// Point-to-point links (a pipeline's hand-overs), once opened.
    links: OnceLock<super::p2p::Links>,
    _backend: PhantomData<B>,
}

impl<B: Backend> std::fmt::Debug for ProcessGroup<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProcessGroup")
            .field("rank", &self.env.rank)
            .field("world_size", &self.env.world_size)
            .finish()
    }
}

impl<B: Backend> ProcessGroup<B> {
    /// Joins the job described by `env`: rank 0 starts the rendezvous on `MASTER_PORT`, every rank
    /// registers and waits (up to `timeout`) until all `WORLD_SIZE` workers have.
    pub fn init(env: DistEnv, device: &B::Device, timeout: Duration) -> Result<Self> {
        let dog = Watchdog::get(env.rank);
        // Reports start before the rendezvous, so a WORLD_SIZE mismatch or a missing peer is
        // named whatever the timing.
        let _ = HEARTBEAT.set(Heartbeat::start(&env));
        install_peer_lost_hook(env.rank);
        if env.rank == 0 {
            // Rank 0's machine is MASTER_ADDR; bind it by this machine's own address
            // (KILN_NODE_ADDR, which defaults to MASTER_ADDR): in a cluster MASTER_ADDR is often a
            // DNS name that other pods resolve before this pod can.
            ensure_port_free(&env.node_addr, env.master_port, "rendezvous (MASTER_PORT)")?;
            let (host, port) = (env.node_addr.clone(), env.master_port);
            std::thread::Builder::new()
                .name("kiln-rendezvous".into())
                .spawn(move || {
                    let rt = tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()
                        .expect("tokio runtime for the rendezvous");
                    rt.block_on(burn_collective::start_global_orchestrator_on(&host, port));
                })
                .map_err(|e| KilnError::Distributed(format!("rendezvous thread: {e}")))?;
        }
        let data_port = env.data_port(env.rank);
        ensure_port_free(
            &env.node_addr,
            data_port,
            &format!("rank {}'s tensor service", env.rank),
        )?;
        let addr = |host: &str, port: u16| {
            format!("ws://{host}:{port}")
                .parse()
                .map_err(|e| KilnError::Distributed(format!("bad address {host}:{port}: {e}")))
        };
        let config = CollectiveConfig::default()
            .with_num_devices(1)
            .with_num_nodes(env.world_size as u32)
            .with_global_address(addr(&env.master_addr, env.master_port)?)
            .with_node_address(addr(&env.node_addr, data_port)?)
            .with_data_service_port(data_port)
            // Ring all-reduce cannot split tensors smaller than the world (scalars, biases of
            // tiny heads); the centralized strategy takes any shape.
            .with_global_all_reduce_strategy(burn_collective::AllReduceStrategy::Centralized);
        let peer = PeerId::from(env.rank as u32);
        let what = format!(
            "rendezvous at {}:{} did not complete within {}s: expected WORLD_SIZE={} workers",
            env.master_addr,
            env.master_port,
            timeout.as_secs(),
            env.world_size
        );
        dog.guard(timeout, what, || {
            burn_collective::register::<B>(peer, device.clone(), config)
        })
        .map_err(|e| {
            // The orchestrator's error type is private to Burn; its name is all there is.
            if format!("{e:?}").contains("RegisterParamsMismatch") {
                KilnError::Distributed(format!(
                    "rank {}: joining the job at {}:{}: another worker registered with a different WORLD_SIZE than this one's {} (every worker needs the same --nnodes × --nproc-per-node)",
                    env.rank, env.master_addr, env.master_port, env.world_size
                ))
            } else {
                KilnError::Distributed(format!("rank {}: joining the job: {e:?}", env.rank))
            }
        })?;
        tracing::info!(
            "rank {} of {} joined the job (rendezvous {}:{})",
            env.rank,
            env.world_size,
            env.master_addr,
            env.master_port
        );
        #[allow(unused_mut)]
        let mut group = Self {
            env,
            peer,
            timeout,
            device: device.clone(),
            #[cfg(feature = "cuda")]
            nccl: None,
            links: OnceLock::new(),
            _backend: PhantomData,
        };
        #[cfg(feature = "cuda")]
        if super::nccl::wanted::<B>() {
            group.nccl = Some(group.init_nccl(device)?);
            tracing::info!("rank {}: gradients all-reduce through NCCL", group.env.rank);
        }
        Ok(group)
    }

    /// Rank 0 makes the NCCL id, Burn's layer broadcasts it, and every rank joins.
    #[cfg(feature = "cuda")]
    fn init_nccl(&self, device: &B::Device) -> Result<super::nccl::NcclComm> {
        let id = if self.env.rank == 0 {
            super::nccl::new_id()?
        } else {
            [0u8; 128]
        };
        // Bytes are exact as f32 values; the other ranks add zeros.
        let shared = Collectives::sum_host(self, id.iter().map(|&b| b as f32).collect())?;
        let mut id = [0u8; 128];
        for (dst, v) in id.iter_mut().zip(shared) {
            *dst = v as u8;
        }
        let what = format!(
            "NCCL set-up did not complete within {}s",
            self.timeout.as_secs()
        );
        Watchdog::get(self.env.rank).guard(self.timeout, what, || {
            super::nccl::NcclComm::init::<B>(device, self.env.rank, self.env.world_size, &id)
        })
    }

    /// Reduces `t`, in buckets of at most [`BUCKET_ELEMENTS`] values: burn-communication sends a
    /// tensor as one WebSocket frame and its peers accept frames up to 512 MiB, so a whole model's
    /// gradient (SmolLM2-135M: 540 MB) would reset the connection. PyTorch's DDP buckets too.
    fn reduce_buckets(
        &self,
        t: FloatTensor<B>,
        op: ReduceOperation,
        what: &str,
    ) -> Result<FloatTensor<B>> {
        use burn::tensor::{Tensor, TensorMetadata, TensorPrimitive};
        let shape = t.shape();
        let n = shape.num_elements();
        if n <= BUCKET_ELEMENTS {
            return self.all_reduce_one(t, op, what);
        }
        let flat = Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(B::float_reshape(
            t,
            burn::tensor::Shape::new([n]),
        )));
        let mut parts = Vec::with_capacity(n.div_ceil(BUCKET_ELEMENTS));
        for start in (0..n).step_by(BUCKET_ELEMENTS) {
            let len = BUCKET_ELEMENTS.min(n - start);
            let part = flat.clone().narrow(0, start, len).into_primitive().tensor();
            let reduced = self.all_reduce_one(part, op, what)?;
            parts.push(Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(
                reduced,
            )));
        }
        Ok(B::float_reshape(
            Tensor::cat(parts, 0).into_primitive().tensor(),
            shape,
        ))
    }

    fn all_reduce_one(
        &self,
        t: FloatTensor<B>,
        op: ReduceOperation,
        what: &str,
    ) -> Result<FloatTensor<B>> {
        let n = HEARTBEAT.get().map_or(0, |hb| hb.enter());
        let msg = format!(
            "{what} #{n} did not complete within {}s",
            self.timeout.as_secs()
        );
        #[cfg(feature = "cuda")]
        if let Some(nccl) = &self.nccl {
            return Watchdog::get(self.env.rank)
                .guard(self.timeout, msg, || nccl.all_reduce::<B>(t, op))
                .map_err(|e| {
                    KilnError::Distributed(format!("rank {}: {what}: {e}", self.env.rank))
                });
        }
        Watchdog::get(self.env.rank)
            .guard(self.timeout, msg, || {
                burn_collective::all_reduce::<B>(self.peer, t, op)
            })
            .map_err(|e| KilnError::Distributed(format!("rank {}: {what}: {e:?}", self.env.rank)))
    }
}

/// The world's collectives on Burn's engine. It reduces only by sum and mean, across processes
/// only as a whole world, so the rest is built from sum all-reduces (costs in docs/DESIGN.md):
/// a broadcast is a sum to which the other ranks add zeros, a gather a sum in which each rank
/// fills its own slot, and a max a gather reduced locally.
impl<B: Backend> Collectives<B> for ProcessGroup<B> {
    fn rank(&self) -> usize {
        self.env.rank
    }

    fn size(&self) -> usize {
        self.env.world_size
    }

    fn device(&self) -> &B::Device {
        &self.device
    }

    fn reduce_scatter(&self, t: Tensor<B, 1>) -> Result<Tensor<B, 1>> {
        #[cfg(feature = "cuda")]
        if let Some(nccl) = &self.nccl {
            return self.nccl_reduce_scatter(nccl, t);
        }
        super::collectives::reduce_scatter_by_sum(self, t)
    }

    fn all_reduce(&self, t: Tensor<B, 1>, op: ReduceOp) -> Result<Tensor<B, 1>> {
        #[cfg(feature = "cuda")]
        if let (Some(nccl), ReduceOp::Max) = (&self.nccl, op) {
            return self.on_nccl("all-reduce (max)", |_| {
                nccl.all_reduce_max::<B>(t.into_primitive().tensor())
            });
        }
        let (op, what) = match op {
            ReduceOp::Sum => (ReduceOperation::Sum, "all-reduce (sum)"),
            ReduceOp::Mean => (ReduceOperation::Mean, "all-reduce (mean)"),
            ReduceOp::Max => {
                let (n, size) = (t.dims()[0], self.env.world_size);
                let all = self.all_gather(t)?.reshape([size, n]);
                return Ok(all.max_dim(0).reshape([n]));
            }
        };
        let out = self.reduce_buckets(t.into_primitive().tensor(), op, what)?;
        Ok(Tensor::from_primitive(TensorPrimitive::Float(out)))
    }

    fn all_gather_v(&self, t: Tensor<B, 1>, counts: &[usize]) -> Result<Tensor<B, 1>> {
        #[cfg(feature = "cuda")]
        if let Some(nccl) = &self.nccl {
            // ncclAllGather takes one length: every rank pads to the longest, the padding is
            // dropped after.
            let most = counts.iter().copied().max().unwrap_or(0);
            let padded = placed(t, 0, most, &self.device);
            let out = Tensor::<B, 1>::zeros([most * counts.len()], &self.device);
            let all = self.on_nccl("all-gather", |_| {
                nccl.all_gather::<B>(
                    padded.into_primitive().tensor(),
                    out.into_primitive().tensor(),
                )
            })?;
            let parts = counts
                .iter()
                .enumerate()
                .map(|(r, &c)| all.clone().narrow(0, r * most, c))
                .collect();
            return Ok(Tensor::cat(parts, 0));
        }
        let total: usize = counts.iter().sum();
        let before: usize = counts[..self.env.rank].iter().sum();
        let out = self.reduce_buckets(
            placed(t, before, total, &self.device)
                .into_primitive()
                .tensor(),
            ReduceOperation::Sum,
            "all-gather",
        )?;
        Ok(Tensor::from_primitive(TensorPrimitive::Float(out)))
    }

    fn broadcast(&self, t: Tensor<B, 1>, root: usize) -> Result<Tensor<B, 1>> {
        #[cfg(feature = "cuda")]
        if let Some(nccl) = &self.nccl {
            return self.on_nccl(&format!("broadcast from rank {root}"), |_| {
                nccl.broadcast::<B>(t.into_primitive().tensor(), root)
            });
        }
        let t = if self.env.rank == root {
            t
        } else {
            t.zeros_like()
        };
        let out = self.reduce_buckets(
            t.into_primitive().tensor(),
            ReduceOperation::Sum,
            &format!("broadcast from rank {root}"),
        )?;
        Ok(Tensor::from_primitive(TensorPrimitive::Float(out)))
    }

    // Burn's engine has no point-to-point transfer: kiln's own links carry it (`p2p.rs`), their
    // addresses exchanged by one all-gather here. CUDA tensors travel through the host.
    fn open_links(&self) -> Result<()> {
        if self.links.get().is_none() {
            let links = super::p2p::Links::open(self, &self.env.node_addr, self.timeout)?;
            let _ = self.links.set(links);
        }
        Ok(())
    }

    fn send(&self, t: Tensor<B, 1>, to: usize) -> Result<()> {
        super::p2p::opened(&self.links, self.env.rank)?.send(to, host(t))
    }

    fn recv(&self, from: usize) -> Result<Tensor<B, 1>> {
        let links = super::p2p::opened(&self.links, self.env.rank)?;
        // A silent peer is named with what the heartbeat board knows of it (dead, or waiting).
        let v = links
            .recv(from)
            .map_err(|e| KilnError::Distributed(format!("{e}{}", peers_clause())))?;
        Ok(super::collectives::owned_tensor(v, &self.device))
    }
}

impl<B: Backend> ProcessGroup<B> {
    /// Runs one NCCL collective under the watchdog; `call` gets this rank.
    #[cfg(feature = "cuda")]
    fn on_nccl(
        &self,
        what: &str,
        call: impl FnOnce(usize) -> Result<FloatTensor<B>>,
    ) -> Result<Tensor<B, 1>> {
        let n = HEARTBEAT.get().map_or(0, |hb| hb.enter());
        let msg = format!(
            "{what} #{n} did not complete within {}s",
            self.timeout.as_secs()
        );
        let rank = self.env.rank;
        let out = Watchdog::get(rank)
            .guard(self.timeout, msg, || call(rank))
            .map_err(|e| KilnError::Distributed(format!("rank {rank}: {what}: {e}")))?;
        Ok(Tensor::from_primitive(TensorPrimitive::Float(out)))
    }

    /// ZeRO-1's reduce-scatter through NCCL: the sum padded to a multiple of the world, each rank
    /// receiving its padded chunk, trimmed to its `chunk_range`.
    #[cfg(feature = "cuda")]
    fn nccl_reduce_scatter(
        &self,
        nccl: &super::nccl::NcclComm,
        t: Tensor<B, 1>,
    ) -> Result<Tensor<B, 1>> {
        let (n, size) = (t.dims()[0], self.env.world_size);
        let (mine, chunks) = (
            super::chunk_range(n, size, self.env.rank),
            (0..size).map(|r| super::chunk_range(n, size, r)),
        );
        let most = n.div_ceil(size);
        // Every rank's chunk at slot r × most, so NCCL's equal chunks are kiln's uneven ones.
        let slots = chunks
            .map(|c| placed(t.clone().narrow(0, c.start, c.len()), 0, most, &self.device))
            .collect();
        let padded = Tensor::cat(slots, 0);
        let out = Tensor::<B, 1>::zeros([most], &self.device);
        let got = self.on_nccl("reduce-scatter", |_| {
            nccl.reduce_scatter::<B>(
                padded.into_primitive().tensor(),
                out.into_primitive().tensor(),
            )
        })?;
        Ok(got.narrow(0, 0, mine.len()))
    }
}

/// How long leaving the job may take before a worker exits without the orchestrator's answer.
const FINISH_WAIT: Duration = Duration::from_secs(10);

impl<B: Backend> Drop for ProcessGroup<B> {
    fn drop(&mut self) {
        // Leaving the job is clean-up (every result is written by now): it must not hang the
        // exit of a worker whose peers have already gone.
        let peer = self.peer;
        let (done, wait) = std::sync::mpsc::channel();
        let leave = std::thread::Builder::new()
            .name("kiln-finish".into())
            .spawn(move || {
                let _ = burn_collective::finish_collective::<B>(peer);
                let _ = done.send(());
            });
        if leave.is_ok() && wait.recv_timeout(FINISH_WAIT).is_err() {
            tracing::warn!(
                "rank {}: leaving the job took over {}s; exiting without waiting",
                self.env.rank,
                FINISH_WAIT.as_secs()
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::unnamed_cause;

    #[test]
    fn an_unknown_networking_panic_is_quoted_cut_and_escaped() {
        assert_eq!(unnamed_cause(""), "connection error");
        assert_eq!(
            unnamed_cause("Tungstenite(Protocol(ResetWithoutClosingHandshake))\nat worker.rs"),
            "connection error: Tungstenite(Protocol(ResetWithoutClosingHandshake))"
        );
        let long = "x".repeat(300);
        assert_eq!(
            unnamed_cause(&long),
            format!("connection error: {}", &long[..200])
        );
        assert_eq!(
            unnamed_cause("bad\u{1b}[2J"),
            "connection error: bad\\u{1b}[2J"
        );
    }
}
