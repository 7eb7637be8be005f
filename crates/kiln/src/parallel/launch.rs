//! `kiln launch`: starts the workers of one machine with the torchrun environment contract, prefixes
//! their output with their rank, forwards SIGINT/SIGTERM, and ends the job as soon as one worker
//! fails — stopping the others and naming the failed rank — instead of leaving them waiting.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::{KilnError, Result};

/// What to start, and where it sits in the job.
#[derive(Debug, Clone)]
pub struct LaunchOptions {
    pub nproc_per_node: usize,
    pub nnodes: usize,
    pub node_rank: usize,
    pub master_addr: String,
    pub master_port: u16,
    /// The address other machines reach this machine's workers at (`KILN_NODE_ADDR`); they serve
    /// their tensors there. Unset: `master_addr`, which is right when every worker is on node 0.
    pub node_addr: Option<String>,
    /// How long a worker waits for the rendezvous or a collective before giving up
    /// (`KILN_DIST_TIMEOUT` in the workers).
    pub timeout: Duration,
    /// The worker program and its arguments.
    pub program: PathBuf,
    pub args: Vec<String>,
}

/// `kiln launch --backend mpi`: replaces this process by `mpirun` starting all `nnodes ×
/// nproc_per_node` workers (on the machines of `hostfile` when given), which join through MPI.
/// mpirun then owns the job: it prefixes nothing but ends every rank when one fails.
pub fn exec_mpirun(o: &LaunchOptions, hostfile: Option<&std::path::Path>) -> Result<()> {
    if o.nproc_per_node == 0 || o.nnodes == 0 {
        return Err(KilnError::Config(
            "--nproc-per-node and --nnodes must be at least 1".into(),
        ));
    }
    if o.nnodes > 1 && hostfile.is_none() {
        return Err(KilnError::Config(format!(
            "--backend mpi with --nnodes {} needs --hostfile (mpirun starts the workers of every machine from this one)",
            o.nnodes
        )));
    }
    let world = o.nproc_per_node * o.nnodes;
    let mut cmd = Command::new("mpirun");
    cmd.args(["--oversubscribe", "-n", &world.to_string()]);
    if let Some(h) = hostfile {
        cmd.arg("--hostfile").arg(h);
    }
    if o.nnodes > 1 {
        cmd.args(["--map-by", &format!("ppr:{}:node", o.nproc_per_node)]);
    }
    // Containers run as root, which Open MPI refuses unless told.
    use std::os::unix::fs::MetadataExt;
    if std::fs::metadata("/proc/self").is_ok_and(|m| m.uid() == 0) {
        cmd.arg("--allow-run-as-root");
    }
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let per_worker = (threads / o.nproc_per_node).max(1).to_string();
    for (k, v) in [
        ("KILN_COLLECTIVES", "mpi".to_string()),
        ("KILN_DIST_TIMEOUT", o.timeout.as_secs().max(1).to_string()),
        ("OMP_NUM_THREADS", per_worker.clone()),
        ("RAYON_NUM_THREADS", per_worker),
    ] {
        cmd.env(k, &v).args(["-x", k]);
    }
    cmd.arg(&o.program).args(&o.args);
    let err = cmd.exec();
    Err(KilnError::Distributed(format!(
        "cannot run mpirun (install Open MPI: Debian's openmpi-bin): {err}"
    )))
}

/// The environment of worker `local_rank` on this node: the torchrun contract [`super::DistEnv`]
/// reads, plus kiln's collective timeout.
pub fn worker_env(o: &LaunchOptions, local_rank: usize) -> Vec<(&'static str, String)> {
    let world = o.nproc_per_node * o.nnodes;
    let mut env = vec![
        ("RANK", global_rank(o, local_rank).to_string()),
        ("LOCAL_RANK", local_rank.to_string()),
        ("WORLD_SIZE", world.to_string()),
        ("LOCAL_WORLD_SIZE", o.nproc_per_node.to_string()),
        ("MASTER_ADDR", o.master_addr.clone()),
        ("MASTER_PORT", o.master_port.to_string()),
        ("KILN_DIST_TIMEOUT", o.timeout.as_secs().max(1).to_string()),
    ];
    if let Some(addr) = &o.node_addr {
        env.push(("KILN_NODE_ADDR", addr.clone()));
    }
    env
}

/// This node's worker `local_rank` as a global rank.
fn global_rank(o: &LaunchOptions, local_rank: usize) -> usize {
    o.node_rank * o.nproc_per_node + local_rank
}

/// How long stopped workers get between SIGTERM and SIGKILL.
const GRACE: Duration = Duration::from_secs(5);

struct Worker {
    rank: usize,
    child: Child,
    status: Option<ExitStatus>,
}

/// The last `error: ...` line each rank printed, for the launcher's own one-line verdict.
type LastErrors = Arc<Mutex<std::collections::BTreeMap<usize, String>>>;

/// Copies `from` line by line to `to`, each line prefixed with `[rank N]`; keeps the rank's last
/// `error:` line in `errors`.
fn relay(
    from: impl Read + Send + 'static,
    rank: usize,
    to_stderr: bool,
    errors: LastErrors,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let mut r = BufReader::new(from);
        let mut line = Vec::new();
        while r
            .read_until(b'\n', &mut line)
            .map(|n| n > 0)
            .unwrap_or(false)
        {
            let text = String::from_utf8_lossy(&line);
            let text = text.trim_end_matches(['\n', '\r']);
            if let Some(e) = text.strip_prefix("error: ") {
                let mut errors = errors.lock().unwrap_or_else(|p| p.into_inner());
                errors.insert(rank, e.to_string());
            }
            if to_stderr {
                let _ = writeln!(std::io::stderr().lock(), "[rank {rank}] {text}");
            } else {
                let _ = writeln!(std::io::stdout().lock(), "[rank {rank}] {text}");
            }
            line.clear();
        }
    })
}

/// Signals a worker's whole process group (it leads one: see `process_group(0)`), so programs it
/// started die with it and release the output pipes.
fn signal(child: &Child, sig: i32) {
    // SAFETY: sends a signal to the process group of a child we started and have not reaped.
    unsafe {
        libc::kill(-(child.id() as libc::pid_t), sig);
    }
}

/// Stops every worker still running: SIGTERM, then SIGKILL after [`GRACE`].
fn stop_all(workers: &mut [Worker], sig: i32) {
    for w in workers.iter().filter(|w| w.status.is_none()) {
        signal(&w.child, sig);
    }
    let deadline = Instant::now() + GRACE;
    loop {
        let mut running = false;
        for w in workers.iter_mut().filter(|w| w.status.is_none()) {
            match w.child.try_wait() {
                Ok(Some(s)) => w.status = Some(s),
                _ => running = true,
            }
        }
        if !running {
            return;
        }
        if Instant::now() > deadline {
            for w in workers.iter_mut().filter(|w| w.status.is_none()) {
                signal(&w.child, libc::SIGKILL);
                w.status = w.child.wait().ok();
            }
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Runs the job's workers on this machine and waits for them. `Ok` when all exit successfully; an
/// error naming the first rank that failed otherwise (the others are stopped).
pub fn launch(o: &LaunchOptions) -> Result<()> {
    if o.nproc_per_node == 0 || o.nnodes == 0 {
        return Err(KilnError::Config(
            "--nproc-per-node and --nnodes must be at least 1".into(),
        ));
    }
    if o.node_rank >= o.nnodes {
        return Err(KilnError::Config(format!(
            "--node-rank {} is outside --nnodes {}",
            o.node_rank, o.nnodes
        )));
    }
    let world = o.nproc_per_node * o.nnodes;
    if o.master_port as usize + world >= 65536 {
        return Err(KilnError::Config(format!(
            "--master-port {} leaves no room for {world} worker ports above it",
            o.master_port
        )));
    }
    if o.node_rank == 0 {
        // The rendezvous runs in rank 0 on this machine: fail now, clearly, if its port is taken.
        // Workers bind this machine's address (KILN_NODE_ADDR, else MASTER_ADDR), as checked here.
        let host = o
            .node_addr
            .clone()
            .or_else(|| std::env::var("KILN_NODE_ADDR").ok())
            .unwrap_or_else(|| o.master_addr.clone());
        super::ensure_port_free(&host, o.master_port, "rendezvous (--master-port)")?;
    }
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let per_worker = (threads / o.nproc_per_node).max(1).to_string();
    tracing::info!(
        "launching {} worker(s) on node {}/{} (world size {world}, rendezvous {}:{})",
        o.nproc_per_node,
        o.node_rank,
        o.nnodes,
        o.master_addr,
        o.master_port
    );

    let interrupted = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(sig, interrupted.clone())
            .map_err(|e| KilnError::Distributed(format!("installing a signal handler: {e}")))?;
    }

    let mut workers = Vec::new();
    let mut relays = Vec::new();
    let errors: LastErrors = Arc::default();
    for local_rank in 0..o.nproc_per_node {
        let rank = global_rank(o, local_rank);
        let mut cmd = Command::new(&o.program);
        cmd.args(&o.args)
            .envs(worker_env(o, local_rank))
            .process_group(0)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        // Like torchrun's OMP_NUM_THREADS=1 default: workers of one machine share its cores.
        if std::env::var_os("RAYON_NUM_THREADS").is_none() {
            cmd.env("RAYON_NUM_THREADS", &per_worker);
        }
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => {
                stop_all(&mut workers, libc::SIGTERM);
                return Err(KilnError::Distributed(format!(
                    "starting rank {rank} ({}): {e}",
                    o.program.display()
                )));
            }
        };
        relays.push(relay(
            child.stdout.take().expect("piped"),
            rank,
            false,
            errors.clone(),
        ));
        relays.push(relay(
            child.stderr.take().expect("piped"),
            rank,
            true,
            errors.clone(),
        ));
        workers.push(Worker {
            rank,
            child,
            status: None,
        });
    }

    let result = loop {
        if interrupted.load(Ordering::Relaxed) {
            stop_all(&mut workers, libc::SIGTERM);
            for w in &workers {
                signal(&w.child, libc::SIGKILL);
            }
            return Err(KilnError::Distributed(
                "interrupted: stopped every worker".into(),
            ));
        }
        let mut failed = None;
        for w in workers.iter_mut().filter(|w| w.status.is_none()) {
            if let Ok(Some(s)) = w.child.try_wait() {
                w.status = Some(s);
                if !s.success() && failed.is_none() {
                    failed = Some((w.rank, s));
                }
            }
        }
        if let Some((rank, status)) = failed {
            stop_all(&mut workers, libc::SIGTERM);
            break Err((rank, status));
        }
        if workers.iter().all(|w| w.status.is_some()) {
            break Ok(());
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    // A worker's leftover children could hold its pipes open: end its group, then drain.
    for w in &workers {
        signal(&w.child, libc::SIGKILL);
    }
    for r in relays {
        let _ = r.join();
    }
    // The verdict quotes the failed worker's own error line (which names the peer it waited for).
    result.map_err(|(rank, status)| {
        use std::os::unix::process::ExitStatusExt;
        let said = errors
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&rank)
            .cloned();
        let why = match (status.code(), status.signal()) {
            (Some(super::group::TIMEOUT_EXIT_CODE), _) => "timed out waiting for its peers".into(),
            (Some(super::group::PEER_LOST_EXIT_CODE), _) => "lost the connection to a peer".into(),
            (Some(c), _) => format!("exited with status {c}"),
            (None, Some(sig)) => format!("was killed by signal {sig}"),
            (None, None) => "was killed by a signal".into(),
        };
        let said = said.map_or_else(String::new, |s| format!(" ({s})"));
        KilnError::Distributed(format!(
            "worker rank {rank} {why}{said}; stopped the other workers"
        ))
    })
}
