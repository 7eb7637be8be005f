//! Parallelism across processes and machines, the one layer the trainer calls: the torchrun
//! environment contract ([`DistEnv`]) and the launcher that starts workers with it ([`launch`]);
//! the [`Collectives`] every strategy is written against, on the world's [`ProcessGroup`] (Burn's
//! collective engine) and on the sub-groups of a device [`Mesh`]; and the strategies themselves
//! ([`DataParallel`], ZeRO-1's optimizer-state sharding in [`zero`]; tensor parallelism's pieces in
//! [`tensor_parallel`]). [`threads`] runs ranks as threads of one process, for tests of a
//! strategy's arithmetic.

pub mod collectives;
mod data_parallel;
mod group;
mod heartbeat;
pub mod launch;
pub mod mesh;
#[cfg(feature = "mpi")]
pub mod mpi;
#[cfg(feature = "cuda")]
mod nccl;
mod p2p;
pub mod pipeline;
pub mod tensor_parallel;
pub mod threads;
pub mod zero;

pub use collectives::{chunk_range, Collectives, Group, ReduceOp};
pub use data_parallel::{
    broadcast_module, is_main_process, world_size_from_env, DataParallel, SharedCollectives,
};
pub use group::{ProcessGroup, BUCKET_ELEMENTS};
pub use mesh::{Coords, Mesh};
pub use tensor_parallel::{TpGroup, VocabParallelCrossEntropy};
pub use zero::{Zero1, ZeroPartition};

use std::sync::Arc;
use std::time::Duration;

use burn::tensor::backend::Backend;

use crate::{KilnError, Result};

/// A clear error when `port` cannot be bound on `host` (checked before Burn's servers bind it,
/// since they only log a failure): the port is taken, or `host` is not an address of this machine.
pub(crate) fn ensure_port_free(host: &str, port: u16, what: &str) -> Result<()> {
    match std::net::TcpListener::bind((host, port)) {
        Ok(_) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => Err(KilnError::Distributed(format!(
            "cannot use port {port} on {host} for the {what}: {e} (is another job running? pick another --master-port)"
        ))),
        Err(e) => Err(KilnError::Distributed(format!(
            "cannot serve the {what} on {host}:{port}: {e} ({host} must be an address of this machine; \
             set MASTER_ADDR / KILN_NODE_ADDR to this machine's address)"
        ))),
    }
}

/// The collective engine of a job: `KILN_COLLECTIVES=burn|mpi`; by default MPI when kiln was
/// built with it and the workers were started by an MPI launcher, Burn's engine otherwise.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Engine {
    Burn,
    Mpi,
}

impl Engine {
    pub fn from_env() -> Result<Self> {
        match std::env::var("KILN_COLLECTIVES").as_deref() {
            Ok("burn") => Ok(Self::Burn),
            Ok("mpi") => Ok(Self::Mpi),
            Ok(other) => Err(KilnError::Distributed(format!(
                "KILN_COLLECTIVES={other:?} is not a collective engine (burn or mpi)"
            ))),
            Err(_) if cfg!(feature = "mpi") && mpi_launcher_env() => Ok(Self::Mpi),
            Err(_) => Ok(Self::Burn),
        }
    }
}

/// Whether an MPI launcher (Open MPI's mpirun, MPICH/Hydra, PMIx) started this process.
fn mpi_launcher_env() -> bool {
    ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"]
        .iter()
        .any(|k| std::env::var_os(k).is_some())
}

/// Linux's default range of ephemeral ports (`ip_local_port_range`), a constant rather than read
/// from /proc so that every machine of a job computes the same port.
const EPHEMERAL_PORTS: std::ops::RangeInclusive<usize> = 32768..=60999;

/// Where kiln's workers meet when torchrun's store holds `store_port`: the port above it, unless
/// that block of ports lies in the ephemeral range. torchrun usually draws its store port there,
/// and the kernel hands out the ports right above it to outgoing connections (torchrun's own
/// clients among them), so a block there is often taken; kiln then meets at
/// `20000 + store_port mod 10000`, below the range, where no connection takes a port.
fn beside_agent_store(store_port: usize, world_size: usize) -> usize {
    let above = store_port + 1;
    if EPHEMERAL_PORTS.contains(&above) || EPHEMERAL_PORTS.contains(&(above + world_size)) {
        20_000 + store_port % 10_000
    } else {
        above
    }
}

/// A job this process joined: its collectives over the whole world, and where it sits.
pub struct Joined<B: Backend> {
    pub world: Arc<dyn Collectives<B>>,
    pub env: DistEnv,
}

/// Joins the job this process was launched into (`kiln launch`, torchrun, mpirun, a Kubernetes
/// Job), or `None` for a single-process run. `KILN_DIST_TIMEOUT` (seconds, default 60) bounds
/// every wait.
pub fn init_from_env<B: Backend>(device: &B::Device) -> Result<Option<Joined<B>>> {
    let Some(env) = DistEnv::from_env()? else {
        return Ok(None);
    };
    let timeout = Duration::from_secs(match std::env::var("KILN_DIST_TIMEOUT") {
        Ok(v) => v.trim().parse().map_err(|_| {
            KilnError::Distributed(format!(
                "KILN_DIST_TIMEOUT={v:?} is not a number of seconds"
            ))
        })?,
        Err(_) => 60,
    });
    let world: Arc<dyn Collectives<B>> = match Engine::from_env()? {
        Engine::Burn => Arc::new(ProcessGroup::init(env.clone(), device, timeout)?),
        #[cfg(feature = "mpi")]
        Engine::Mpi => {
            let comm = mpi::MpiComm::<B>::world(device, timeout)?;
            if (comm.rank(), comm.size()) != (env.rank, env.world_size) {
                return Err(KilnError::Distributed(format!(
                    "MPI places this worker at rank {} of {}, the environment at RANK={} of WORLD_SIZE={}",
                    comm.rank(), comm.size(), env.rank, env.world_size
                )));
            }
            tracing::info!(
                "rank {} of {} joined the job (MPI)",
                env.rank,
                env.world_size
            );
            Arc::new(comm)
        }
        #[cfg(not(feature = "mpi"))]
        Engine::Mpi => return Err(KilnError::Distributed(
            "KILN_COLLECTIVES=mpi: this kiln was built without MPI (build it with --features mpi)"
                .into(),
        )),
    };
    Ok(Some(Joined { world, env }))
}

/// Where this process sits in the job: the variables torchrun (and Kubeflow's PyTorchJob, or a
/// Kubernetes Indexed Job running `kiln launch`) sets for every worker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DistEnv {
    /// Global rank, `0..world_size`.
    pub rank: usize,
    /// Rank among the workers of this machine.
    pub local_rank: usize,
    pub world_size: usize,
    pub local_world_size: usize,
    /// Host of the rendezvous (rank 0's machine).
    pub master_addr: String,
    /// Port of the rendezvous (`MASTER_PORT`, or the one above it under torchrun, whose store
    /// holds `MASTER_PORT`); worker `r` also serves its tensor data on `master_port + 1 + r`.
    pub master_port: u16,
    /// The address other machines reach this worker at (`KILN_NODE_ADDR`; defaults to
    /// `master_addr` when every worker is on one machine).
    pub node_addr: String,
}

/// The environment variables of the contract, in the order a launcher sets them.
pub const ENV_VARS: [&str; 6] = [
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
];

impl DistEnv {
    /// Reads the contract from the process environment. `None` when `WORLD_SIZE` is unset or 1
    /// (a plain single-process run).
    pub fn from_env() -> Result<Option<Self>> {
        Self::from_lookup(|k| std::env::var(k).ok())
    }

    /// [`Self::from_env`] over any variable lookup (tests, manifests).
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Option<Self>> {
        // Workers an MPI launcher started carry its variables instead of torchrun's.
        let mpi = |torch: &str| -> Option<String> {
            let alt: &[&str] = match torch {
                "WORLD_SIZE" => &["OMPI_COMM_WORLD_SIZE", "PMI_SIZE"],
                "RANK" => &["OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"],
                "LOCAL_RANK" => &["OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID"],
                "LOCAL_WORLD_SIZE" => &["OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS"],
                _ => &[],
            };
            alt.iter().find_map(|k| get(k))
        };
        let get = |k: &str| get(k).or_else(|| mpi(k));
        let Some(world) = get("WORLD_SIZE") else {
            return Ok(None);
        };
        let num = |k: &str, default: Option<usize>| -> Result<usize> {
            match get(k) {
                Some(v) => v.trim().parse().map_err(|_| {
                    KilnError::Distributed(format!("{k}={v:?} is not a non-negative integer"))
                }),
                None => default.ok_or_else(|| {
                    KilnError::Distributed(format!("WORLD_SIZE is set but {k} is not"))
                }),
            }
        };
        // A job has at least one process: WORLD_SIZE=0 is a launcher's mistake, not a lone run.
        let world_size: usize = world
            .trim()
            .parse()
            .ok()
            .filter(|&n| n > 0)
            .ok_or_else(|| {
                KilnError::Distributed(format!("WORLD_SIZE={world:?} is not a positive integer"))
            })?;
        if world_size == 1 {
            // A lone run, but a RANK set beside it must still be its only rank.
            let rank = num("RANK", Some(0))?;
            if rank != 0 {
                return Err(KilnError::Distributed(format!(
                    "RANK={rank} is outside WORLD_SIZE=1 (ranks are 0..WORLD_SIZE)"
                )));
            }
            return Ok(None);
        }
        let rank = num("RANK", None)?;
        let local_rank = num("LOCAL_RANK", Some(rank))?;
        let local_world_size = num("LOCAL_WORLD_SIZE", Some(world_size))?;
        if rank >= world_size {
            return Err(KilnError::Distributed(format!(
                "RANK={rank} is outside WORLD_SIZE={world_size} (ranks are 0..WORLD_SIZE)"
            )));
        }
        if local_rank >= local_world_size {
            return Err(KilnError::Distributed(format!(
                "LOCAL_RANK={local_rank} is outside LOCAL_WORLD_SIZE={local_world_size} (local ranks are 0..LOCAL_WORLD_SIZE)"
            )));
        }
        let master_addr = get("MASTER_ADDR").unwrap_or_else(|| "127.0.0.1".into());
        // torchrun's agent keeps its TCP store on MASTER_PORT for the whole job
        // (TORCHELASTIC_USE_AGENT_STORE=True; older torchruns only set TORCHELASTIC_RUN_ID):
        // its workers meet on the port above instead. `kiln launch` holds no store there.
        let agent_store = match get("TORCHELASTIC_USE_AGENT_STORE") {
            Some(v) => v.trim().eq_ignore_ascii_case("true"),
            None => get("TORCHELASTIC_RUN_ID").is_some(),
        };
        let master_port = num("MASTER_PORT", Some(29500))?;
        let master_port = if agent_store {
            beside_agent_store(master_port, world_size)
        } else {
            master_port
        };
        let master_port = u16::try_from(master_port)
            .ok()
            .filter(|p| (*p as usize) + world_size < 65536)
            .ok_or_else(|| {
                KilnError::Distributed(format!(
                    "MASTER_PORT={master_port} leaves no room for {world_size} worker ports above it"
                ))
            })?;
        let node_addr = get("KILN_NODE_ADDR").unwrap_or_else(|| master_addr.clone());
        Ok(Some(Self {
            rank,
            local_rank,
            world_size,
            local_world_size,
            master_addr,
            master_port,
            node_addr,
        }))
    }

    /// The port worker `rank` serves tensor data on.
    pub fn data_port(&self, rank: usize) -> u16 {
        self.master_port + 1 + rank as u16
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env<'a>(pairs: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |k| {
            pairs
                .iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        }
    }

    #[test]
    fn reads_the_torchrun_contract() {
        let e = DistEnv::from_lookup(env(&[
            ("RANK", "3"),
            ("LOCAL_RANK", "1"),
            ("WORLD_SIZE", "4"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("MASTER_ADDR", "10.0.0.7"),
            ("MASTER_PORT", "29400"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!((e.rank, e.local_rank, e.world_size), (3, 1, 4));
        assert_eq!((e.master_addr.as_str(), e.master_port), ("10.0.0.7", 29400));
        assert_eq!(e.data_port(3), 29404);
        // Under torchrun its store holds MASTER_PORT: kiln meets on the port above.
        let e = DistEnv::from_lookup(env(&[
            ("WORLD_SIZE", "2"),
            ("RANK", "1"),
            ("MASTER_PORT", "29400"),
            ("TORCHELASTIC_RUN_ID", "none"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!(e.master_port, 29401);
        // A store port in the ephemeral range: kiln meets below it.
        assert_eq!(beside_agent_store(36427, 2), 26427);
        // `kiln launch` sets the elastic variables too, but no store holds MASTER_PORT.
        let e = DistEnv::from_lookup(env(&[
            ("WORLD_SIZE", "2"),
            ("RANK", "1"),
            ("MASTER_PORT", "29400"),
            ("TORCHELASTIC_RUN_ID", "b3f1"),
            ("TORCHELASTIC_USE_AGENT_STORE", "False"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!(e.master_port, 29400);
        assert_eq!(DistEnv::from_lookup(env(&[])).unwrap(), None);
        assert_eq!(
            DistEnv::from_lookup(env(&[("WORLD_SIZE", "1")])).unwrap(),
            None
        );
    }

    #[test]
    fn rejects_an_inconsistent_contract() {
        let err =
            |pairs: &[(&str, &str)]| DistEnv::from_lookup(env(pairs)).unwrap_err().to_string();
        assert!(err(&[("WORLD_SIZE", "2")]).contains("RANK"));
        assert!(err(&[("WORLD_SIZE", "2"), ("RANK", "2")]).contains("outside"));
        assert!(err(&[("WORLD_SIZE", "two"), ("RANK", "0")]).contains("WORLD_SIZE"));
        // WORLD_SIZE 0 is no job at all, not a lone run; a lone run's RANK is 0.
        assert!(err(&[("WORLD_SIZE", "0")]).contains("WORLD_SIZE=\"0\" is not a positive integer"));
        assert!(err(&[("WORLD_SIZE", "-1")]).contains("WORLD_SIZE"));
        assert!(
            err(&[("WORLD_SIZE", "1"), ("RANK", "1")]).contains("RANK=1 is outside WORLD_SIZE=1")
        );
        assert!(err(&[("WORLD_SIZE", "1"), ("RANK", "x")]).contains("RANK=\"x\""));
        assert!(err(&[("WORLD_SIZE", "2"), ("RANK", "-1")]).contains("RANK"));
        assert!(err(&[
            ("WORLD_SIZE", "2"),
            ("RANK", "1"),
            ("LOCAL_RANK", "2"),
            ("LOCAL_WORLD_SIZE", "2")
        ])
        .contains("LOCAL_RANK=2 is outside LOCAL_WORLD_SIZE=2"));
        assert!(
            err(&[("WORLD_SIZE", "2"), ("RANK", "0"), ("MASTER_PORT", "65535")])
                .contains("MASTER_PORT")
        );
    }
}
