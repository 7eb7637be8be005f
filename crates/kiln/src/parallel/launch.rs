//! `kiln launch`: starts the workers of one machine with the torchrun environment contract, prefixes
//! their output with their rank, forwards SIGINT/SIGTERM, and ends the job as soon as one worker
//! fails — stopping the others and naming the failed rank — instead of leaving them waiting. With
//! `max_restarts`, a failure instead stops every worker and starts them all again (as torchrun's
//! elastic agent does); `TORCHELASTIC_RESTART_COUNT` tells them to resume from the latest
//! checkpoint of the run (see `train::output_dir`).

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
    /// How many times a failed job is started again (`--max-restarts`).
    pub max_restarts: usize,
    /// The job's id (`--rdzv-id`, `TORCHELASTIC_RUN_ID`): a restarted worker resumes only a run
    /// this job wrote.
    pub run_id: String,
    /// Where each attempt's worker output is also written, as torchrun lays it out:
    /// `<log_dir>/<run_id>/attempt_<n>/<local_rank>/{stdout,stderr}.log`.
    pub log_dir: Option<PathBuf>,
    /// Show only rank 0's standard output (torchrun's `--local-ranks-filter 0`); every rank's
    /// errors are still shown.
    pub quiet: bool,
}

impl Default for LaunchOptions {
    fn default() -> Self {
        Self {
            nproc_per_node: 1,
            nnodes: 1,
            node_rank: 0,
            master_addr: "127.0.0.1".into(),
            master_port: 29500,
            node_addr: None,
            timeout: Duration::from_secs(60),
            program: PathBuf::new(),
            args: Vec::new(),
            max_restarts: 0,
            run_id: "none".into(),
            log_dir: None,
            quiet: false,
        }
    }
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

/// The environment of worker `local_rank` on this node in attempt `restart` (0 first): the
/// torchrun contract [`super::DistEnv`] reads, torchrun's elastic variables, and kiln's collective
/// timeout.
pub fn worker_env(
    o: &LaunchOptions,
    local_rank: usize,
    restart: usize,
) -> Vec<(&'static str, String)> {
    let world = o.nproc_per_node * o.nnodes;
    let rank = global_rank(o, local_rank).to_string();
    let mut env = vec![
        ("RANK", rank.clone()),
        ("LOCAL_RANK", local_rank.to_string()),
        ("WORLD_SIZE", world.to_string()),
        ("LOCAL_WORLD_SIZE", o.nproc_per_node.to_string()),
        ("MASTER_ADDR", o.master_addr.clone()),
        ("MASTER_PORT", o.master_port.to_string()),
        ("GROUP_RANK", o.node_rank.to_string()),
        ("GROUP_WORLD_SIZE", o.nnodes.to_string()),
        ("ROLE_NAME", "default".into()),
        ("ROLE_RANK", rank),
        ("ROLE_WORLD_SIZE", world.to_string()),
        ("TORCHELASTIC_RESTART_COUNT", restart.to_string()),
        ("TORCHELASTIC_MAX_RESTARTS", o.max_restarts.to_string()),
        ("TORCHELASTIC_RUN_ID", o.run_id.clone()),
        // No agent holds a store on MASTER_PORT here (torchrun's does): the workers meet on it.
        ("TORCHELASTIC_USE_AGENT_STORE", "False".into()),
        ("KILN_DIST_TIMEOUT", o.timeout.as_secs().max(1).to_string()),
    ];
    if let Some(addr) = &o.node_addr {
        env.push(("KILN_NODE_ADDR", addr.clone()));
    }
    env
}

/// Where a worker sits among the attempts of its job, when a launcher that restarts failed jobs
/// (`kiln launch`, torchrun) started it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attempt {
    /// `TORCHELASTIC_RUN_ID`: the job.
    pub run_id: String,
    /// `TORCHELASTIC_RESTART_COUNT`: 0 for the first start.
    pub restart: usize,
}

impl Attempt {
    /// The attempt this process belongs to, from the environment a launcher set; `None` when it
    /// was not started by one.
    pub fn from_env() -> Result<Option<Self>> {
        let Ok(run_id) = std::env::var("TORCHELASTIC_RUN_ID") else {
            return Ok(None);
        };
        let restart = match std::env::var("TORCHELASTIC_RESTART_COUNT") {
            Err(_) => 0,
            Ok(v) => v.trim().parse().map_err(|_| {
                KilnError::Distributed(format!(
                    "TORCHELASTIC_RESTART_COUNT={v:?} is not a non-negative integer"
                ))
            })?,
        };
        Ok(Some(Self { run_id, restart }))
    }
}

/// A port `p` of `host` with `p..=p + n` all free (the rendezvous and `n` workers' tensor
/// services), as `--standalone` picks one.
pub fn free_port_block(host: &str, n: u16) -> Result<u16> {
    for _ in 0..50 {
        let p = std::net::TcpListener::bind((host, 0))
            .and_then(|l| l.local_addr())
            .map_err(|e| KilnError::Distributed(format!("no free port on {host}: {e}")))?
            .port();
        let free = |q: u16| std::net::TcpListener::bind((host, q)).is_ok();
        if (p as usize) + (n as usize) < 65536 && (1..=n).all(|i| free(p + i)) {
            return Ok(p);
        }
    }
    Err(KilnError::Distributed(format!(
        "no {} consecutive free ports on {host}",
        n as usize + 1
    )))
}

/// The GPUs workers on this machine can see: `CUDA_VISIBLE_DEVICES` when set, else the NVIDIA
/// driver's list (none without it).
pub fn visible_gpus() -> usize {
    if let Ok(v) = std::env::var("CUDA_VISIBLE_DEVICES") {
        // CUDA stops at the first invalid entry, as `-1` is used to hide every GPU.
        return v
            .split(',')
            .map(str::trim)
            .take_while(|d| !d.is_empty() && !d.starts_with('-'))
            .count();
    }
    std::fs::read_dir("/proc/driver/nvidia/gpus").map_or(0, |d| d.count())
}

/// A job id for `--rdzv-id` left unset on one machine (torchrun's `--standalone` draws one too).
pub fn fresh_run_id() -> String {
    format!("{:08x}", rand::random::<u32>())
}

/// `--nproc-per-node` as torchrun reads it: a number, `gpu`, `cpu`, or `auto`.
pub fn nproc_per_node(spec: &str) -> Result<usize> {
    let cores = || std::thread::available_parallelism().map_or(1, |n| n.get());
    match spec.trim() {
        "cpu" => Ok(cores()),
        "gpu" => match visible_gpus() {
            0 => Err(KilnError::Config(
                "--nproc-per-node gpu: this machine has no visible GPU".into(),
            )),
            n => Ok(n),
        },
        "auto" => Ok(match visible_gpus() {
            0 => cores(),
            n => n,
        }),
        n => n.parse().ok().filter(|&n| n > 0).ok_or_else(|| {
            KilnError::Config(format!(
                "--nproc-per-node {n:?}: give a number of workers, or gpu, cpu or auto"
            ))
        }),
    }
}

/// `--nnodes` as torchrun reads it: `N`, or `MIN:MAX` with both equal.
pub fn nnodes(spec: &str) -> Result<usize> {
    let bad = || {
        KilnError::Config(format!(
            "--nnodes {spec:?}: give a number of machines (or MIN:MAX with MIN = MAX)"
        ))
    };
    let n = match spec.split_once(':') {
        None => spec.trim().parse().map_err(|_| bad())?,
        Some((lo, hi)) => {
            let (lo, hi): (usize, usize) = (
                lo.trim().parse().map_err(|_| bad())?,
                hi.trim().parse().map_err(|_| bad())?,
            );
            if lo != hi {
                return Err(KilnError::Config(format!(
                    "--nnodes {spec}: kiln runs a fixed number of machines (elastic scaling \
                     between {lo} and {hi} is not supported); give --nnodes {hi}"
                )));
            }
            lo
        }
    };
    if n == 0 {
        return Err(bad());
    }
    Ok(n)
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

/// Where a worker's stream goes: the console (prefixed `[rank N]`, or not at all when `show` is
/// false) and, with `--log-dir`, a file of its own.
struct Sink {
    rank: usize,
    to_stderr: bool,
    show: bool,
    file: Option<std::fs::File>,
}

/// Copies `from` line by line to `sink`; keeps the rank's last `error:` line in `errors`.
fn relay(
    from: impl Read + Send + 'static,
    mut sink: Sink,
    errors: LastErrors,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let mut r = BufReader::new(from);
        let mut line = Vec::new();
        let rank = sink.rank;
        while r
            .read_until(b'\n', &mut line)
            .map(|n| n > 0)
            .unwrap_or(false)
        {
            if let Some(f) = sink.file.as_mut() {
                let _ = f.write_all(&line);
            }
            let text = String::from_utf8_lossy(&line);
            let text = text.trim_end_matches(['\n', '\r']);
            if let Some(e) = text.strip_prefix("error: ") {
                let mut errors = errors.lock().unwrap_or_else(|p| p.into_inner());
                errors.insert(rank, e.to_string());
            }
            if sink.show {
                if sink.to_stderr {
                    let _ = writeln!(std::io::stderr().lock(), "[rank {rank}] {text}");
                } else {
                    let _ = writeln!(std::io::stdout().lock(), "[rank {rank}] {text}");
                }
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

/// How one attempt of the job ended, short of success.
enum Failure {
    Interrupted,
    Worker {
        rank: usize,
        status: ExitStatus,
        said: Option<String>,
    },
}

impl Failure {
    fn message(&self) -> String {
        use std::os::unix::process::ExitStatusExt;
        match self {
            Failure::Interrupted => "interrupted: stopped every worker".into(),
            Failure::Worker { rank, status, said } => {
                let why = match (status.code(), status.signal()) {
                    (Some(super::group::TIMEOUT_EXIT_CODE), _) => {
                        "timed out waiting for its peers".into()
                    }
                    (Some(super::group::PEER_LOST_EXIT_CODE), _) => {
                        "lost the connection to a peer".into()
                    }
                    (Some(c), _) => format!("exited with status {c}"),
                    (None, Some(sig)) => format!("was killed by signal {sig}"),
                    (None, None) => "was killed by a signal".into(),
                };
                // The verdict quotes the failed worker's own error line (which names the peer
                // it waited for).
                let said = said
                    .as_ref()
                    .map_or_else(String::new, |s| format!(" ({s})"));
                format!("worker rank {rank} {why}{said}; stopped the other workers")
            }
        }
    }
}

/// How long a worker that only lost its peers (or timed out waiting for them) is held back from
/// the verdict, so the peer whose death it echoes (killed, crashed) can be reaped and named
/// instead: both often end within one poll of each other, and rank order must not decide.
const ECHO_GRACE: Duration = Duration::from_millis(1500);

/// Whether a worker's exit only echoes another's failure: it lost a peer or timed out waiting.
fn echoes_a_peer(status: &ExitStatus) -> bool {
    matches!(
        status.code(),
        Some(super::group::PEER_LOST_EXIT_CODE | super::group::TIMEOUT_EXIT_CODE)
    )
}

/// The failure to report among those seen so far (rank, status, when it was reaped), if it is
/// time to report one: the first that is a cause of its own at once; else, once the first
/// echo is [`ECHO_GRACE`] old, that echo (a hung peer is found this way: only its waiters end).
fn verdict(failed: &[(usize, ExitStatus, Instant)], now: Instant) -> Option<(usize, ExitStatus)> {
    if let Some((rank, status, _)) = failed.iter().find(|f| !echoes_a_peer(&f.1)) {
        return Some((*rank, *status));
    }
    let (rank, status, at) = failed.first()?;
    (now.duration_since(*at) >= ECHO_GRACE).then_some((*rank, *status))
}

/// Runs the job's workers on this machine and waits for them. `Ok` when all exit successfully; an
/// error naming the first rank that failed otherwise (the others are stopped) once
/// `max_restarts` fresh starts of every worker have failed too.
pub fn launch(o: &LaunchOptions) -> Result<()> {
    if o.nproc_per_node == 0 || o.nnodes == 0 {
        return Err(KilnError::Config(
            "--nproc-per-node and --nnodes must be at least 1".into(),
        ));
    }
    // The id names the job's folder under --log-dir: it must be one plain folder name.
    if !is_plain_name(&o.run_id) {
        return Err(KilnError::Config(format!(
            "--rdzv-id {:?}: a job id names its folder under --log-dir, so it must be one folder \
             name (letters, digits, '.', '-', '_', not '.' or '..')",
            o.run_id
        )));
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
    tracing::info!(
        "launching {} worker(s) on node {}/{} (world size {world}, rendezvous {}:{}, run id {})",
        o.nproc_per_node,
        o.node_rank,
        o.nnodes,
        o.master_addr,
        o.master_port,
        o.run_id
    );
    let interrupted = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(sig, interrupted.clone())
            .map_err(|e| KilnError::Distributed(format!("installing a signal handler: {e}")))?;
    }
    for restart in 0.. {
        let failure = match run_attempt(o, restart, &interrupted)? {
            None => return Ok(()),
            Some(f) => f,
        };
        let message = failure.message();
        if matches!(failure, Failure::Interrupted) || restart >= o.max_restarts {
            let tried = if o.max_restarts > 0 {
                format!(" (after {restart} restart(s) of {})", o.max_restarts)
            } else {
                String::new()
            };
            return Err(KilnError::Distributed(format!("{message}{tried}")));
        }
        let wait = restart_backoff(restart);
        tracing::warn!(
            "{message}; restarting every worker in {:.1} s (restart {} of {}): they resume from the run's latest checkpoint",
            wait.as_secs_f64(),
            restart + 1,
            o.max_restarts
        );
        if !sleep_unless(wait, &interrupted) {
            return Err(KilnError::Distributed(format!(
                "{message}; interrupted before restart {}",
                restart + 1
            )));
        }
    }
    unreachable!("the attempts loop returns")
}

/// Whether `s` is one folder name that stays inside its parent: ASCII letters, digits, `.`, `-`,
/// `_`, `:` and `@`, not `.` or `..`, at most 255 bytes.
pub fn is_plain_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 255
        && s != "."
        && s != ".."
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-:@".contains(&b))
}

/// How long to wait before restart `restart + 1`: half a second, doubling per restart up to
/// [`MAX_BACKOFF`], so a worker that always fails costs a restart every half minute, not dozens a
/// second (each restart respawns every worker and rereads the model).
pub fn restart_backoff(restart: usize) -> Duration {
    let half_seconds = 1u64 << restart.min(16);
    Duration::from_millis(500 * half_seconds).min(MAX_BACKOFF)
}

/// The longest wait between restarts.
pub const MAX_BACKOFF: Duration = Duration::from_secs(30);

/// Sleeps `d`, waking early (and returning false) when `interrupted` is set.
fn sleep_unless(d: Duration, interrupted: &AtomicBool) -> bool {
    let end = Instant::now() + d;
    while Instant::now() < end {
        if interrupted.load(Ordering::Relaxed) {
            return false;
        }
        std::thread::sleep(Duration::from_millis(50).min(end - Instant::now()));
    }
    !interrupted.load(Ordering::Relaxed)
}

/// Starts every worker of this node for attempt `restart` and waits for them: `None` when all
/// succeed.
fn run_attempt(
    o: &LaunchOptions,
    restart: usize,
    interrupted: &Arc<AtomicBool>,
) -> Result<Option<Failure>> {
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
    let mut workers = Vec::new();
    let mut relays = Vec::new();
    let errors: LastErrors = Arc::default();
    for local_rank in 0..o.nproc_per_node {
        let rank = global_rank(o, local_rank);
        let mut cmd = Command::new(&o.program);
        cmd.args(&o.args)
            .envs(worker_env(o, local_rank, restart))
            .process_group(0)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        // A launcher killed outright (SIGKILL, the OOM killer) takes its workers with it: the
        // kernel sends each SIGKILL when the launcher's thread that started it dies, so no orphan
        // trains on, holding the GPU and the output folder's lock. SIGKILL, not SIGTERM: the
        // rendezvous server's runtime catches SIGTERM for a graceful shutdown and the worker then
        // waits for peers that are gone. Checkpoints are atomic, so nothing is left half-written.
        // SAFETY: prctl is async-signal-safe and touches only the child about to exec.
        unsafe {
            cmd.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        // Like torchrun's OMP_NUM_THREADS=1 default: workers of one machine share its cores.
        if std::env::var_os("RAYON_NUM_THREADS").is_none() {
            cmd.env("RAYON_NUM_THREADS", &per_worker);
        }
        let (out_file, err_file) = log_files(o, restart, local_rank)?;
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
            Sink {
                rank,
                to_stderr: false,
                show: !o.quiet || rank == 0,
                file: out_file,
            },
            errors.clone(),
        ));
        relays.push(relay(
            child.stderr.take().expect("piped"),
            Sink {
                rank,
                to_stderr: true,
                show: true,
                file: err_file,
            },
            errors.clone(),
        ));
        workers.push(Worker {
            rank,
            child,
            status: None,
        });
    }

    let result = watch(&mut workers, interrupted);
    // A worker's leftover children could hold its pipes open: end its group, then drain.
    for w in &workers {
        signal(&w.child, libc::SIGKILL);
    }
    for r in relays {
        let _ = r.join();
    }
    Ok(result.map(|f| match f {
        Failure::Worker { rank, status, .. } => Failure::Worker {
            rank,
            status,
            said: errors
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .get(&rank)
                .cloned(),
        },
        other => other,
    }))
}

/// Rank `local_rank`'s stdout and stderr files under `--log-dir` for this attempt (none without it).
fn log_files(
    o: &LaunchOptions,
    restart: usize,
    local_rank: usize,
) -> Result<(Option<std::fs::File>, Option<std::fs::File>)> {
    let files = match &o.log_dir {
        Some(dir) => {
            let dir = dir
                .join(&o.run_id)
                .join(format!("attempt_{restart}"))
                .join(local_rank.to_string());
            std::fs::create_dir_all(&dir).map_err(|e| KilnError::io(&dir, e))?;
            let open = |name: &str| {
                let p = dir.join(name);
                std::fs::File::create(&p).map_err(|e| KilnError::io(&p, e))
            };
            Some((open("stdout.log")?, open("stderr.log")?))
        }
        None => None,
    };
    Ok(files.map_or((None, None), |(a, b)| (Some(a), Some(b))))
}

/// Waits for the workers: the first failure (a worker's exit, judged by [`verdict`], or an
/// interrupt) stops the others; `None` when every worker ended well.
fn watch(workers: &mut [Worker], interrupted: &AtomicBool) -> Option<Failure> {
    let mut failed = Vec::new();
    loop {
        if interrupted.load(Ordering::Relaxed) {
            stop_all(workers, libc::SIGTERM);
            break Some(Failure::Interrupted);
        }
        for w in workers.iter_mut().filter(|w| w.status.is_none()) {
            if let Ok(Some(s)) = w.child.try_wait() {
                w.status = Some(s);
                if !s.success() {
                    failed.push((w.rank, s, Instant::now()));
                }
            }
        }
        if let Some((rank, status)) = verdict(&failed, Instant::now()) {
            stop_all(workers, libc::SIGTERM);
            break Some(Failure::Worker {
                rank,
                status,
                said: None,
            });
        }
        if workers.iter().all(|w| w.status.is_some()) {
            // Everyone has ended: no cause is still to come, so an echo is the verdict now.
            break verdict(&failed, Instant::now() + ECHO_GRACE).map(|(rank, status)| {
                Failure::Worker {
                    rank,
                    status,
                    said: None,
                }
            });
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn job_ids_are_plain_folder_names() {
        for ok in ["job7", "none", "3f2a-b1_c.d", "run:1"] {
            assert!(super::is_plain_name(ok), "{ok}");
        }
        for bad in ["", ".", "..", "../..", "/tmp/x", "a/b", "a\0b", "a\x1b[2J"] {
            assert!(!super::is_plain_name(bad), "{bad:?}");
        }
    }

    #[test]
    fn the_verdict_names_the_cause_not_its_echo() {
        use std::os::unix::process::ExitStatusExt;
        let exited = |code: i32| ExitStatus::from_raw(code << 8);
        let killed = ExitStatus::from_raw(libc::SIGKILL);
        let lost = exited(super::super::group::PEER_LOST_EXIT_CODE);
        let t0 = Instant::now();
        // Rank 0 lost its peer and rank 1 was killed, both reaped in one poll: rank 1 is named.
        let v = super::verdict(&[(0, lost, t0), (1, killed, t0)], t0).unwrap();
        assert_eq!((v.0, v.1.signal()), (1, Some(libc::SIGKILL)));
        // An echo alone waits for its cause, then is named (a hung peer shows only as its waiters).
        assert!(super::verdict(&[(0, lost, t0)], t0).is_none());
        let later = t0 + super::ECHO_GRACE;
        assert_eq!(super::verdict(&[(0, lost, t0)], later).unwrap().0, 0);
        // A crash is named at once, whatever its rank.
        assert_eq!(super::verdict(&[(3, exited(1), t0)], t0).unwrap().0, 3);
        assert!(super::verdict(&[], later).is_none());
    }

    #[test]
    fn restarts_back_off_to_half_a_minute() {
        let waits: Vec<f64> = (0..10)
            .map(|r| super::restart_backoff(r).as_secs_f64())
            .collect();
        assert_eq!(&waits[..4], &[0.5, 1.0, 2.0, 4.0]);
        assert_eq!(waits[9], 30.0);
        assert_eq!(super::restart_backoff(usize::MAX).as_secs_f64(), 30.0);
    }

    use super::*;

    #[test]
    fn reads_torchruns_spellings_of_the_worker_and_machine_counts() {
        assert_eq!(nproc_per_node("4").unwrap(), 4);
        let cores = std::thread::available_parallelism().unwrap().get();
        assert_eq!(nproc_per_node("cpu").unwrap(), cores);
        assert!(nproc_per_node("0").is_err());
        assert!(nproc_per_node("two")
            .unwrap_err()
            .to_string()
            .contains("gpu, cpu or auto"));
        assert_eq!(nnodes("3").unwrap(), 3);
        assert_eq!(nnodes("2:2").unwrap(), 2);
        let e = nnodes("1:4").unwrap_err().to_string();
        assert!(e.contains("elastic scaling"), "{e}");
        assert!(nnodes("0").is_err() && nnodes("x:2").is_err());
    }

    #[test]
    fn workers_get_torchruns_elastic_variables() {
        let o = LaunchOptions {
            nproc_per_node: 2,
            nnodes: 3,
            node_rank: 1,
            max_restarts: 2,
            run_id: "job7".into(),
            ..LaunchOptions::default()
        };
        let env: std::collections::BTreeMap<_, _> = worker_env(&o, 1, 2).into_iter().collect();
        assert_eq!(env["RANK"], "3");
        assert_eq!(env["GROUP_RANK"], "1");
        assert_eq!(env["GROUP_WORLD_SIZE"], "3");
        assert_eq!(env["ROLE_WORLD_SIZE"], "6");
        assert_eq!(env["TORCHELASTIC_RESTART_COUNT"], "2");
        assert_eq!(env["TORCHELASTIC_MAX_RESTARTS"], "2");
        assert_eq!(env["TORCHELASTIC_RUN_ID"], "job7");
        // The workers meet on MASTER_PORT itself: no agent store holds it.
        let d = super::super::DistEnv::from_lookup(|k| env.get(k).cloned())
            .unwrap()
            .unwrap();
        assert_eq!(d.master_port, o.master_port);
    }
}
