//! `kiln launch`: the data-parallel launcher (like torchrun).

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;

#[derive(Args)]
pub struct LaunchCmd {
    /// Worker processes on this machine: a number, `gpu` (one per visible GPU), `cpu` (one per
    /// core) or `auto` (`gpu` when there are GPUs, else `cpu`), as torchrun counts them.
    #[arg(long, default_value = "1")]
    nproc_per_node: String,
    /// Machines in the job: N, or torchrun's MIN:MAX with MIN = MAX (kiln does not grow or
    /// shrink a running job).
    #[arg(long, default_value = "1")]
    nnodes: String,
    /// This machine's index, `0..nnodes` (the rendezvous runs on node 0).
    #[arg(long, default_value_t = 0)]
    node_rank: usize,
    /// Host of node 0, reachable from every machine.
    #[arg(long, default_value = "127.0.0.1")]
    master_addr: String,
    /// Rendezvous port on node 0; worker r also uses master_port + 1 + r.
    #[arg(long, default_value_t = 29500)]
    master_port: u16,
    /// One machine, rendezvous on loopback at a free port, a fresh run id (torchrun's
    /// `--standalone`).
    #[arg(long, conflicts_with_all = ["nnodes", "node_rank", "master_addr", "master_port", "rdzv_endpoint"])]
    standalone: bool,
    /// The rendezvous as torchrun names it, `host:port` (the same as --master-addr and
    /// --master-port).
    #[arg(long, conflicts_with_all = ["master_addr", "master_port"])]
    rdzv_endpoint: Option<String>,
    /// The job's id, the same on every machine (TORCHELASTIC_RUN_ID; default: a fresh one, or
    /// "none" with --nnodes above 1, as torchrun's). Restarted workers continue only the run their
    /// job wrote.
    #[arg(long)]
    rdzv_id: Option<String>,
    /// torchrun's rendezvous backend: c10d or static (both mean node 0 hosts it here).
    #[arg(long, default_value = "static")]
    rdzv_backend: String,
    /// After a worker fails, stop every worker and start them all again, up to N times; they
    /// resume from the run's latest checkpoint (torchrun's elastic restarts).
    #[arg(long, default_value_t = 0)]
    max_restarts: usize,
    /// Also write each worker's output to `DIR/<run id>/attempt_<n>/<local rank>/{stdout,stderr}.log`.
    #[arg(long, value_name = "DIR")]
    log_dir: Option<PathBuf>,
    /// Show every rank's standard output (by default only rank 0's, as with torchrun's
    /// `--local-ranks-filter 0`; errors and warnings of every rank are always shown).
    #[arg(long)]
    all_ranks: bool,
    /// This machine's address, reachable from every other machine: its workers serve their
    /// tensors there (default: --master-addr, right when all workers run on node 0).
    #[arg(long)]
    node_addr: Option<String>,
    /// Seconds a worker waits for its peers (rendezvous, any collective) before the job fails.
    #[arg(long, default_value_t = 60)]
    timeout: u64,
    /// The collective engine: burn (this launcher starts the workers) or mpi (runs `mpirun`;
    /// needs a kiln built with --features mpi).
    #[arg(long, value_enum, default_value_t = LaunchBackend::Burn)]
    backend: LaunchBackend,
    /// With --backend mpi: mpirun's hostfile naming the machines (needed for --nnodes > 1).
    #[arg(long)]
    hostfile: Option<PathBuf>,
    /// The worker command, with or without `--` before it: a kiln subcommand (`train ...`), or
    /// a program and its arguments.
    #[arg(last = true, required = true)]
    command: Vec<String>,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LaunchBackend {
    Burn,
    Mpi,
}

/// Runs the workers; `device` is the launcher's global `--device`, which kiln workers take too
/// (`kiln --device cuda launch ... -- train ...` trains on GPUs). Threads are not passed on: the
/// launcher gives each worker its share of the cores.
pub fn run(cmd: LaunchCmd, device: &str, kiln_command: &dyn Fn(&str) -> bool) -> Result<()> {
    // A kiln subcommand (`train ...`, as `kiln_command` says) runs this binary; anything else is
    // a program.
    let is_subcommand = kiln_command(&cmd.command[0]);
    let (program, args) = if is_subcommand {
        let mut args = Vec::new();
        let worker_sets = |flag: &str| {
            cmd.command
                .iter()
                .take_while(|a| *a != "--")
                .any(|a| a == flag || a.starts_with(&format!("{flag}=")))
        };
        // The worker's own --device wins (clap takes it once).
        if device != "cpu" && !worker_sets("--device") {
            args.push(format!("--device={device}"));
        }
        args.extend(cmd.command.iter().cloned());
        (std::env::current_exe()?, args)
    } else {
        if device != "cpu" {
            bail!(
                "--device {device}: the launcher passes it to kiln's own workers (`train ...`), \
                 not to {}; give the program its own device option",
                cmd.command[0]
            );
        }
        (PathBuf::from(&cmd.command[0]), cmd.command[1..].to_vec())
    };
    let backend = cmd.backend;
    let hostfile = cmd.hostfile.clone();
    let opts = launch_options(cmd, program, args)?;
    match backend {
        LaunchBackend::Burn => kiln::parallel::launch::launch(&opts)?,
        LaunchBackend::Mpi => {
            if !cfg!(feature = "mpi") {
                bail!(
                    "--backend mpi: this kiln was built without MPI (build it with --features mpi)"
                );
            }
            kiln::parallel::launch::exec_mpirun(&opts, hostfile.as_deref())?
        }
    }
    Ok(())
}

/// `kiln launch`'s options as the launcher takes them: torchrun's spellings resolved.
fn launch_options(
    cmd: LaunchCmd,
    program: PathBuf,
    args: Vec<String>,
) -> Result<kiln::parallel::launch::LaunchOptions> {
    use kiln::parallel::launch;
    let nproc_per_node = launch::nproc_per_node(&cmd.nproc_per_node)?;
    let nnodes = launch::nnodes(&cmd.nnodes)?;
    if !matches!(cmd.rdzv_backend.as_str(), "c10d" | "static") {
        bail!(
            "--rdzv-backend {:?}: kiln's rendezvous is hosted by rank 0 (c10d or static); etcd is not supported",
            cmd.rdzv_backend
        );
    }
    let (master_addr, master_port) = if cmd.standalone {
        let addr = "127.0.0.1".to_string();
        let workers = u16::try_from(nproc_per_node)
            .ok()
            .filter(|n| *n < u16::MAX)
            .with_context(|| {
                format!(
                    "--nproc-per-node {nproc_per_node}: too many workers for one machine's ports"
                )
            })?;
        let port = launch::free_port_block(&addr, workers + 1)?;
        (addr, port)
    } else if let Some(ep) = &cmd.rdzv_endpoint {
        match ep.rsplit_once(':') {
            Some((host, port)) => (
                host.trim_matches(['[', ']']).to_string(),
                port.parse().with_context(|| {
                    format!("--rdzv-endpoint {ep:?}: {port:?} is not a port number")
                })?,
            ),
            None => (ep.clone(), cmd.master_port),
        }
    } else {
        (cmd.master_addr, cmd.master_port)
    };
    let run_id = cmd.rdzv_id.unwrap_or_else(|| {
        if nnodes > 1 {
            "none".into()
        } else {
            launch::fresh_run_id()
        }
    });
    Ok(launch::LaunchOptions {
        nproc_per_node,
        nnodes,
        node_rank: cmd.node_rank,
        master_addr,
        master_port,
        node_addr: cmd.node_addr,
        timeout: std::time::Duration::from_secs(cmd.timeout),
        program,
        args,
        max_restarts: cmd.max_restarts,
        run_id,
        log_dir: cmd.log_dir,
        quiet: !cmd.all_ranks,
    })
}
