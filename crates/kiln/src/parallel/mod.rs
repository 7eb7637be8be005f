//! Data parallelism across processes and machines: the torchrun environment contract ([`DistEnv`]),
//! the launcher that starts workers with it ([`launch`]), and the process group the trainer uses to
//! average gradients ([`ProcessGroup`], on Burn's collective engine).

mod group;
mod heartbeat;
pub mod launch;
#[cfg(feature = "cuda")]
mod nccl;

pub use group::{ProcessGroup, BUCKET_ELEMENTS};

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

/// Joins the job this process was launched into (`kiln launch`, torchrun, a Kubernetes Job), or
/// `None` for a single-process run. `KILN_DIST_TIMEOUT` (seconds, default 60) bounds every wait.
pub fn init_from_env<B: Backend>(device: &B::Device) -> Result<Option<Arc<ProcessGroup<B>>>> {
    let Some(env) = DistEnv::from_env()? else {
        return Ok(None);
    };
    let timeout = match std::env::var("KILN_DIST_TIMEOUT") {
        Ok(v) => v.trim().parse().map_err(|_| {
            KilnError::Distributed(format!(
                "KILN_DIST_TIMEOUT={v:?} is not a number of seconds"
            ))
        })?,
        Err(_) => 60,
    };
    Ok(Some(Arc::new(ProcessGroup::init(
        env,
        device,
        Duration::from_secs(timeout),
    )?)))
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
    /// Port of the rendezvous; worker `r` also serves its tensor data on `master_port + 1 + r`.
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
        let world_size: usize = world.trim().parse().map_err(|_| {
            KilnError::Distributed(format!("WORLD_SIZE={world:?} is not a positive integer"))
        })?;
        if world_size <= 1 {
            return Ok(None);
        }
        let rank = num("RANK", None)?;
        let local_rank = num("LOCAL_RANK", Some(rank))?;
        let local_world_size = num("LOCAL_WORLD_SIZE", Some(world_size))?;
        if rank >= world_size {
            return Err(KilnError::Distributed(format!(
                "RANK={rank} is outside WORLD_SIZE={world_size}"
            )));
        }
        let master_addr = get("MASTER_ADDR").unwrap_or_else(|| "127.0.0.1".into());
        let master_port = num("MASTER_PORT", Some(29500))?;
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
        assert!(
            err(&[("WORLD_SIZE", "2"), ("RANK", "0"), ("MASTER_PORT", "65535")])
                .contains("MASTER_PORT")
        );
    }
}
