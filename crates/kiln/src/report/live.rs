//! Each rank's live state, for `kiln top`.
//!
//! Every rank of a training job keeps a small [`RankState`] (step, loss, rates, time in
//! collectives, CPU and memory) and a background thread writes it twice a second to
//! `OUTPUT_DIR/live/rank-N.json` (write to a temporary name, then rename: a reader never sees half
//! a file). The training thread only updates the state under an uncontended lock, so publishing
//! costs nothing measurable on the step (the `live_state` bench row shows it).
//!
//! Two clocks tell a reader what a rank is doing: `heartbeat_unix`, set by the writer thread on
//! every write, says the process is alive; `last_step_unix`, set by the training thread, says it
//! makes progress. A crashed or killed rank stops its heartbeat (and, on this machine, its pid is
//! gone); a hung one (a peer that never reaches a collective) keeps its heartbeat but stops
//! stepping. [`RankView`] turns those into a status a person can read.
//!
//! Ranks on other machines appear when the output folder is shared (NFS, a mounted volume), as it
//! is for resuming anyway. Jobs are found without configuration through a per-user folder
//! ([`runtime_dir`]) where each rank leaves the path of its output folder while it runs.

use std::collections::{BTreeMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use crate::error::{KilnError, Result};

/// How often the writer thread publishes.
pub const INTERVAL: Duration = Duration::from_millis(500);
/// A heartbeat older than this means the rank is no longer running (crashed, killed, stopped).
pub const LOST_AFTER: f64 = 5.0;
/// Steps kept for the loss sparkline.
const LOSS_HISTORY: usize = 240;
/// Steps over which rates and the step time are averaged.
const RATE_WINDOW: usize = 20;

/// What a rank is doing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    #[default]
    Starting,
    Training,
    Evaluating,
    Saving,
    Finished,
    Failed,
}

/// A GPU's utilisation and memory, from NVML.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct GpuState {
    pub index: u32,
    pub utilization_percent: u32,
    pub memory_used_bytes: u64,
    pub memory_total_bytes: u64,
}

/// One rank's published state (`live/rank-N.json`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(default)]
pub struct RankState {
    pub rank: usize,
    pub world_size: usize,
    pub pid: u32,
    pub host: String,
    pub output_dir: String,
    pub phase: Phase,
    pub step: u64,
    pub total_steps: u64,
    pub epoch: f64,
    /// The last optimizer step's loss (averaged over ranks), learning rate and gradient norm.
    pub loss: Option<f64>,
    pub learning_rate: Option<f64>,
    pub grad_norm: Option<f64>,
    /// This rank's own examples and (padded) tokens per second over the last steps.
    pub samples_per_second: f64,
    pub tokens_per_second: f64,
    /// The mean wall time of the last steps, and the seconds left at that pace.
    pub step_seconds: f64,
    pub eta_seconds: Option<f64>,
    /// Seconds spent since the start computing, and waiting in collectives (gradient all-reduce,
    /// ZeRO-1 gathers): a rank that mostly waits is held up by a slower peer.
    pub compute_seconds: f64,
    pub collective_seconds: f64,
    pub cpu_percent: f64,
    pub rss_bytes: u64,
    pub gpu: Option<GpuState>,
    /// The losses of the last steps, oldest first.
    pub loss_history: Vec<f64>,
    pub started_unix: f64,
    pub last_step_unix: f64,
    pub heartbeat_unix: f64,
    /// Why the run failed (phase `failed`).
    pub error: Option<String>,
}

/// One finished optimizer step, as the trainer reports it.
#[derive(Debug, Clone, Copy)]
pub struct StepReport {
    pub step: u64,
    pub total_steps: u64,
    pub epoch: f64,
    pub loss: f64,
    pub learning_rate: f64,
    pub grad_norm: f64,
    /// This rank's examples and tokens in the step.
    pub samples: usize,
    pub tokens: usize,
    /// The step's wall time, and the part of it spent in collectives.
    pub seconds: f64,
    pub collective_seconds: f64,
}

/// The state and the recent steps the rates come from.
struct Shared {
    state: RankState,
    /// (seconds, samples, tokens) of the last steps.
    recent: VecDeque<(f64, usize, usize)>,
}

/// Publishes one rank's state until dropped (then writes its last state once more).
pub struct LivePublisher {
    shared: Arc<Mutex<Shared>>,
    stop: Option<mpsc::Sender<()>>,
    writer: Option<JoinHandle<()>>,
    job_entry: Option<PathBuf>,
}

/// The file a rank publishes to.
pub fn rank_file(output_dir: &Path, rank: usize) -> PathBuf {
    output_dir.join("live").join(format!("rank-{rank}.json"))
}

/// The per-user folder where running ranks leave their output folder's path, so `kiln top`
/// without arguments finds every job on this machine: `$KILN_RUNTIME_DIR`, else
/// `$XDG_RUNTIME_DIR/kiln`, else `<temp>/kiln-<uid>`.
///
/// The last one sits in a folder every user can write to, so another user can create it first
/// (or as a symbolic link to your files): [`ensure_runtime_dir`] and [`running_jobs`] use it only
/// when it is a real folder owned by this user.
pub fn runtime_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("KILN_RUNTIME_DIR") {
        return PathBuf::from(d);
    }
    if let Some(d) = std::env::var_os("XDG_RUNTIME_DIR") {
        return PathBuf::from(d).join("kiln");
    }
    std::env::temp_dir().join(format!("kiln-{}", current_uid()))
}

fn current_uid() -> u32 {
    // SAFETY: getuid has no preconditions and cannot fail.
    unsafe { libc::getuid() }
}

/// Creates `runtime` and its `jobs/` folder (mode 0700) where missing, and returns `jobs/` once
/// both are real folders owned by this user; otherwise an error naming the folder.
pub fn ensure_runtime_dir(runtime: &Path) -> Result<PathBuf> {
    use std::os::unix::fs::DirBuilderExt;
    let jobs = runtime.join("jobs");
    for dir in [runtime, jobs.as_path()] {
        match std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
        {
            Ok(()) => {}
            // A symbolic link (even to a folder) or a file: said by the check below.
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(KilnError::io(dir, e)),
        }
        check_own_folder(dir)?;
        make_private(dir)?;
    }
    Ok(jobs)
}

/// Takes group and other access away from our own folder `dir` (one made before kiln created
/// these folders 0700, e.g. an old `/tmp/kiln-<uid>` at 0755): other users need not read the job
/// list.
fn make_private(dir: &Path) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::symlink_metadata(dir)
        .map_err(|e| KilnError::io(dir, e))?
        .permissions()
        .mode();
    if mode & 0o077 != 0 {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(mode & 0o700))
            .map_err(|e| KilnError::io(dir, e))?;
    }
    Ok(())
}

/// `dir` must be a folder itself (not a symbolic link to one) owned by this user: kiln deletes
/// stale entries in it, and must never do that in a folder someone else controls.
fn check_own_folder(dir: &Path) -> Result<()> {
    use std::os::unix::fs::MetadataExt;
    let refuse = |why: String| {
        Err(KilnError::Config(format!(
            "the kiln runtime folder {} {why}: refusing to use it (set KILN_RUNTIME_DIR to a \
             folder of your own)",
            dir.display()
        )))
    };
    let meta = std::fs::symlink_metadata(dir).map_err(|e| KilnError::io(dir, e))?;
    let (uid, me) = (meta.uid(), current_uid());
    if meta.file_type().is_symlink() {
        refuse("is a symbolic link".into())
    } else if !meta.is_dir() {
        refuse("is not a folder".into())
    } else if uid != me {
        refuse(format!("is owned by uid {uid}, not by you (uid {me})"))
    } else {
        Ok(())
    }
}

/// The GPU this process trains on, set once by whoever picks the device (the CLI), so the live
/// state reports its load without every layer in between passing it on.
static GPU_INDEX: std::sync::OnceLock<u32> = std::sync::OnceLock::new();

pub fn set_gpu_index(index: u32) {
    let _ = GPU_INDEX.set(index);
}

pub fn gpu_index() -> Option<u32> {
    GPU_INDEX.get().copied()
}

pub fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// This machine's name, as gethostname(2) gives it ("localhost" when it has none): the one source
/// the live files, `kiln top` and TensorBoard's event file names all read.
pub fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: the buffer is valid for `buf.len()` bytes; gethostname writes at most that many.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    let name = if rc == 0 {
        String::from_utf8_lossy(&buf[..end]).trim().to_string()
    } else {
        String::new()
    };
    if name.is_empty() {
        "localhost".into()
    } else {
        name
    }
}

impl LivePublisher {
    /// Starts publishing rank `rank` of `world_size` into `output_dir/live/`. `gpu` is the index
    /// of the GPU this rank trains on (NVML then reports its load; a missing driver just leaves
    /// it out).
    pub fn start(
        output_dir: &Path,
        rank: usize,
        world_size: usize,
        gpu: Option<u32>,
    ) -> Result<Self> {
        Self::start_in(output_dir, rank, world_size, gpu, &runtime_dir())
    }

    /// [`Self::start`], registering the job in `runtime` instead of [`runtime_dir`].
    pub fn start_in(
        output_dir: &Path,
        rank: usize,
        world_size: usize,
        gpu: Option<u32>,
        runtime: &Path,
    ) -> Result<Self> {
        let dir = output_dir.join("live");
        std::fs::create_dir_all(&dir).map_err(|e| KilnError::io(&dir, e))?;
        let abs = std::path::absolute(output_dir).unwrap_or_else(|_| output_dir.to_path_buf());
        let now = unix_now();
        let state = RankState {
            rank,
            world_size,
            pid: std::process::id(),
            host: hostname(),
            output_dir: abs.display().to_string(),
            started_unix: now,
            last_step_unix: now,
            ..RankState::default()
        };
        let shared = Arc::new(Mutex::new(Shared {
            state,
            recent: VecDeque::with_capacity(RATE_WINDOW + 1),
        }));
        let path = rank_file(output_dir, rank);
        // A rank that cannot write its state says so once and trains on.
        write_state(&path, &lock(&shared).state).map_err(|e| KilnError::io(&path, e))?;
        let job_entry = register_job(runtime, &abs, rank);
        let (tx, rx) = mpsc::channel::<()>();
        let thread_shared = Arc::clone(&shared);
        let writer = std::thread::Builder::new()
            .name(format!("kiln-live-{rank}"))
            .spawn(move || publish_loop(&path, &thread_shared, &rx, gpu))
            .map_err(|e| KilnError::io(&dir, e))?;
        Ok(Self {
            shared,
            stop: Some(tx),
            writer: Some(writer),
            job_entry,
        })
    }

    /// Records a finished optimizer step.
    pub fn step(&self, s: &StepReport) {
        let mut g = lock(&self.shared);
        g.recent.push_back((s.seconds, s.samples, s.tokens));
        if g.recent.len() > RATE_WINDOW {
            g.recent.pop_front();
        }
        let (secs, samples, tokens) = g
            .recent
            .iter()
            .fold((0.0, 0, 0), |a, r| (a.0 + r.0, a.1 + r.1, a.2 + r.2));
        let n = g.recent.len() as f64;
        let st = &mut g.state;
        st.phase = Phase::Training;
        st.step = s.step;
        st.total_steps = s.total_steps;
        st.epoch = s.epoch;
        st.loss = s.loss.is_finite().then_some(s.loss);
        st.learning_rate = Some(s.learning_rate);
        st.grad_norm = s.grad_norm.is_finite().then_some(s.grad_norm);
        st.compute_seconds += (s.seconds - s.collective_seconds).max(0.0);
        st.collective_seconds += s.collective_seconds;
        st.step_seconds = secs / n;
        st.samples_per_second = samples as f64 / secs.max(1e-9);
        st.tokens_per_second = tokens as f64 / secs.max(1e-9);
        st.eta_seconds = Some(s.total_steps.saturating_sub(s.step) as f64 * st.step_seconds);
        st.last_step_unix = unix_now();
        if st.loss_history.len() == LOSS_HISTORY {
            st.loss_history.remove(0);
        }
        if let Some(l) = st.loss {
            st.loss_history.push(l);
        }
    }

    /// Sets what the rank is doing (evaluating, saving, ...); `total_steps` once it is known.
    pub fn phase(&self, phase: Phase) {
        lock(&self.shared).state.phase = phase;
    }

    pub fn set_total_steps(&self, total: u64, step: u64) {
        let mut g = lock(&self.shared);
        g.state.total_steps = total;
        g.state.step = step;
    }

    /// Marks the run failed with its error (written at once).
    pub fn fail(&self, error: &str) {
        let mut g = lock(&self.shared);
        g.state.phase = Phase::Failed;
        g.state.error = Some(error.to_string());
    }

    /// The state as it stands.
    pub fn snapshot(&self) -> RankState {
        lock(&self.shared).state.clone()
    }
}

impl Drop for LivePublisher {
    fn drop(&mut self) {
        // Closing the channel wakes the writer, which writes the last state and returns.
        drop(self.stop.take());
        if let Some(w) = self.writer.take() {
            let _ = w.join();
        }
        if let Some(p) = &self.job_entry {
            let _ = std::fs::remove_file(p);
        }
    }
}

fn lock(m: &Mutex<Shared>) -> std::sync::MutexGuard<'_, Shared> {
    // A panic elsewhere while holding the lock leaves plain data: keep publishing it.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn publish_loop(path: &Path, shared: &Mutex<Shared>, stop: &mpsc::Receiver<()>, gpu: Option<u32>) {
    let mut cpu = CpuClock::new();
    let mut nvml = gpu.and_then(Gpu::open);
    let mut warned = false;
    loop {
        // A message or a closed channel: write once more and stop.
        let last = !matches!(stop.recv_timeout(INTERVAL), Err(RecvTimeoutError::Timeout));
        let (cpu_percent, rss) = (cpu.percent(), resident_bytes());
        let gpu_state = nvml.as_mut().and_then(Gpu::sample);
        let state = {
            let mut g = lock(shared);
            let st = &mut g.state;
            st.cpu_percent = cpu_percent;
            st.rss_bytes = rss;
            st.gpu = gpu_state;
            st.heartbeat_unix = unix_now();
            st.clone()
        };
        if let Err(e) = write_state(path, &state) {
            if !warned {
                tracing::warn!("cannot publish the live state to {}: {e}", path.display());
                warned = true;
            }
        }
        if last {
            return;
        }
    }
}

fn write_state(path: &Path, state: &RankState) -> std::io::Result<()> {
    let tmp = path.with_extension("json.tmp");
    std::fs::write(&tmp, serde_json::to_vec(state).expect("plain data"))?;
    std::fs::rename(&tmp, path)
}

/// Leaves `runtime_dir()/jobs/<pid>.json` pointing at the output folder (best effort: a job
/// that cannot register is still found by `kiln top OUTPUT_DIR`, and says why once).
fn register_job(runtime: &Path, output_dir: &Path, rank: usize) -> Option<PathBuf> {
    let dir = match ensure_runtime_dir(runtime) {
        Ok(d) => d,
        Err(e) => {
            tracing::warn!("kiln top will not list this job without its folder: {e}");
            return None;
        }
    };
    let pid = std::process::id();
    let path = dir.join(job_entry_name(pid));
    let entry = JobEntry {
        output_dir: output_dir.display().to_string(),
        rank,
        pid,
    };
    std::fs::write(&path, serde_json::to_vec(&entry).expect("plain data")).ok()?;
    Some(path)
}

/// A running rank's entry in the runtime folder's `jobs/`, named [`job_entry_name`].
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct JobEntry {
    output_dir: String,
    rank: usize,
    pid: u32,
}

/// Job entries are small: anything larger is not one.
const JOB_ENTRY_MAX_BYTES: u64 = 64 << 10;
/// A rank file holds a few hundred numbers (its loss history included).
pub const RANK_FILE_MAX_BYTES: u64 = 1 << 20;

fn job_entry_name(pid: u32) -> String {
    format!("{pid}.json")
}

/// The pid in a job entry's file name (`<pid>.json`, digits only), or None for any other name.
fn job_entry_pid(name: &std::ffi::OsStr) -> Option<u32> {
    let digits = name.to_str()?.strip_suffix(".json")?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// The output folders of the kiln jobs registered in `runtime` (normally [`runtime_dir`]) whose
/// ranks are alive, sorted. No folder means no job; a folder that is not this user's own (see
/// [`ensure_runtime_dir`]) is an error, and nothing in it is read or deleted.
///
/// The entries of processes that are gone are removed, and only those: a regular file (never a
/// symbolic link) named `<pid>.json` whose content is a kiln job entry for that pid. Anything
/// else in the folder is left alone.
pub fn running_jobs(runtime: &Path) -> Result<Vec<PathBuf>> {
    let dir = runtime.join("jobs");
    for d in [runtime, dir.as_path()] {
        match std::fs::symlink_metadata(d) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            _ => check_own_folder(d)?,
        }
    }
    let entries = std::fs::read_dir(&dir).map_err(|e| KilnError::io(&dir, e))?;
    let mut found = std::collections::BTreeSet::new();
    for e in entries.flatten() {
        let Some(pid) = job_entry_pid(&e.file_name()) else {
            continue;
        };
        let path = e.path();
        // Not following a link, not blocking on a FIFO, reading a bounded amount.
        let Ok(bytes) = read_regular(&path, JOB_ENTRY_MAX_BYTES, false) else {
            continue;
        };
        let Ok(entry) = serde_json::from_slice::<JobEntry>(&bytes) else {
            continue;
        };
        if entry.pid != pid {
            continue;
        }
        if pid_alive(pid) {
            found.insert(PathBuf::from(entry.output_dir));
        } else {
            // unlink never follows a symbolic link; the folder is this user's own.
            let _ = std::fs::remove_file(&path);
        }
    }
    Ok(found.into_iter().collect())
}

/// Opens `path` for reading when it is a regular file, and only then: never blocks on a FIFO or
/// a device (O_NONBLOCK), and with `follow` false does not follow a symbolic link (O_NOFOLLOW).
/// A file kiln only inspects (a rank's state, a job entry, a log) may have been put there by
/// someone else; a FIFO used to hang `kiln top` and `/dev/zero` to fill its memory.
pub fn open_regular(path: &Path, follow: bool) -> std::io::Result<std::fs::File> {
    use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
    let flags = libc::O_NONBLOCK | if follow { 0 } else { libc::O_NOFOLLOW };
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(flags)
        .open(path)
        .map_err(|e| match e.raw_os_error() {
            Some(libc::ELOOP) if !follow => not_regular("a symbolic link"),
            _ => e,
        })?;
    let t = file.metadata()?.file_type();
    if t.is_file() {
        return Ok(file);
    }
    Err(not_regular(if t.is_dir() {
        "a folder"
    } else if t.is_fifo() {
        "a FIFO"
    } else if t.is_char_device() || t.is_block_device() {
        "a device"
    } else if t.is_socket() {
        "a socket"
    } else {
        "not a plain file"
    }))
}

fn not_regular(what: &str) -> std::io::Error {
    std::io::Error::new(
        std::io::ErrorKind::InvalidInput,
        format!("{what}, not a regular file"),
    )
}

/// The content of the regular file `path` ([`open_regular`]), refused above `max_bytes`.
pub fn read_regular(path: &Path, max_bytes: u64, follow: bool) -> std::io::Result<Vec<u8>> {
    use std::io::Read;
    let mut bytes = Vec::new();
    open_regular(path, follow)?
        .take(max_bytes + 1)
        .read_to_end(&mut bytes)?;
    if bytes.len() as u64 > max_bytes {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("larger than {max_bytes} bytes"),
        ));
    }
    Ok(bytes)
}

/// Whether process `pid` runs on this machine (a zombie, dead but not yet reaped, does not).
pub fn pid_alive(pid: u32) -> bool {
    if pid == 0 {
        return false;
    }
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state letter follows the command name's closing parenthesis.
        Ok(stat) => stat
            .rfind(')')
            .and_then(|i| stat[i + 1..].split_whitespace().next())
            .is_some_and(|state| state != "Z" && state != "X"),
        Err(_) => false,
    }
}

/// A rank's state as a reader sees it now: the state plus what its clocks say.
#[derive(Debug, Clone, Serialize)]
pub struct RankView {
    #[serde(flatten)]
    pub state: RankState,
    /// `training`, `evaluating`, `saving`, `finished`, `failed`, `starting`, or what went wrong:
    /// `lost` (no heartbeat for LOST_AFTER s), `exited` (its process is gone without finishing),
    /// `stalled` (alive, but no step for much longer than its steps take).
    pub status: String,
    /// Seconds since the rank last wrote its state, and since its last step.
    pub last_seen_seconds: f64,
    pub since_step_seconds: f64,
}

impl RankView {
    pub fn new(state: RankState, now: f64, this_host: &str) -> Self {
        let seen = (now - state.heartbeat_unix).max(0.0);
        let since_step = (now - state.last_step_unix).max(0.0);
        let done = matches!(state.phase, Phase::Finished | Phase::Failed);
        let gone = state.host == this_host && !pid_alive(state.pid);
        let status = if done {
            phase_name(state.phase).to_string()
        } else if gone {
            "exited".to_string()
        } else if seen > LOST_AFTER {
            "lost".to_string()
        } else if state.phase == Phase::Training
            && since_step > (20.0 * state.step_seconds).max(60.0)
        {
            "stalled".to_string()
        } else {
            phase_name(state.phase).to_string()
        };
        Self {
            state,
            status,
            last_seen_seconds: seen,
            since_step_seconds: since_step,
        }
    }

    /// Whether the status says something is wrong.
    pub fn is_unhealthy(&self) -> bool {
        matches!(
            self.status.as_str(),
            "lost" | "exited" | "stalled" | "failed"
        )
    }
}

pub fn phase_name(p: Phase) -> &'static str {
    match p {
        Phase::Starting => "starting",
        Phase::Training => "training",
        Phase::Evaluating => "evaluating",
        Phase::Saving => "saving",
        Phase::Finished => "finished",
        Phase::Failed => "failed",
    }
}

/// The ranks published in `output_dir/live/`, by rank ([`read_live`] without what was skipped).
pub fn read_ranks(output_dir: &Path) -> Result<Vec<RankState>> {
    read_live(output_dir).map(|l| l.ranks)
}

/// What `output_dir/live/` holds: the ranks, and the files named like rank files that were not
/// read as one.
#[derive(Debug, Default)]
pub struct LiveRanks {
    pub ranks: Vec<RankState>,
    /// One line per file skipped: its path and why (escaped for a terminal).
    pub skipped: Vec<String>,
}

/// The ranks published in `output_dir/live/`, by rank. Files left by an earlier, larger run in
/// the same folder are left out: only ranks below the newest run's world size count. A file that
/// is not a regular one (a FIFO, a device, a symbolic link), is larger than
/// [`RANK_FILE_MAX_BYTES`] or is not a rank's state is skipped and said in `skipped`.
pub fn read_live(output_dir: &Path) -> Result<LiveRanks> {
    if !output_dir.is_dir() {
        return Err(KilnError::Config(format!(
            "{} is not a folder (give a training job's output folder)",
            output_dir.display()
        )));
    }
    let dir = output_dir.join("live");
    let entries = std::fs::read_dir(&dir).map_err(|_| {
        KilnError::Config(format!(
            "{} has no live/ folder: no kiln training job (of this version) has written to it",
            output_dir.display()
        ))
    })?;
    let mut by_rank = BTreeMap::new();
    let mut skipped = Vec::new();
    for e in entries.flatten() {
        let name = e.file_name();
        let name = name.to_string_lossy();
        if !(name.starts_with("rank-") && name.ends_with(".json")) {
            continue;
        }
        let path = e.path();
        let state = read_regular(&path, RANK_FILE_MAX_BYTES, false)
            .map_err(|e| e.to_string())
            .and_then(|bytes| {
                serde_json::from_slice::<RankState>(&bytes)
                    .map_err(|e| format!("not a kiln rank state: {e}"))
            });
        match state {
            Ok(s) => {
                by_rank.insert(s.rank, s);
            }
            // Ranks write by rename, so a file is never seen half written.
            Err(why) => skipped.push(super::escape_for_terminal(&format!(
                "skipped {}: {why}",
                path.display()
            ))),
        }
    }
    skipped.sort();
    let newest = by_rank
        .values()
        .max_by(|a, b| a.started_unix.total_cmp(&b.started_unix))
        .map(|s| (s.world_size, s.started_unix));
    let ranks = match newest {
        // Ranks of one job start within seconds of each other; an older run's are far older.
        Some((world, started)) => by_rank
            .into_values()
            .filter(|s| s.rank < world.max(1) && started - s.started_unix < 600.0)
            .collect(),
        None => Vec::new(),
    };
    Ok(LiveRanks { ranks, skipped })
}

/// This process's CPU time, turned into a percentage of one core between calls.
struct CpuClock {
    last: Option<(Instant, f64)>,
}

impl CpuClock {
    fn new() -> Self {
        Self { last: None }
    }

    fn percent(&mut self) -> f64 {
        let Some(cpu) = process_cpu_seconds() else {
            return 0.0;
        };
        let now = Instant::now();
        let p = match self.last {
            Some((t, c)) => 100.0 * (cpu - c) / now.duration_since(t).as_secs_f64().max(1e-6),
            None => 0.0,
        };
        self.last = Some((now, cpu));
        p
    }
}

/// User + system CPU seconds of this process (all threads).
fn process_cpu_seconds() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after the command name (which may hold spaces) start at ") ".
    let rest = &stat[stat.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let (utime, stime): (f64, f64) = (f.get(11)?.parse().ok()?, f.get(12)?.parse().ok()?);
    // SAFETY: sysconf has no preconditions.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    Some((utime + stime) / ticks)
}

/// Resident memory of this process.
fn resident_bytes() -> u64 {
    let pages = std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1)?.parse::<u64>().ok())
        .unwrap_or(0);
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(1) as u64;
    pages * page
}

/// One GPU through NVML (libnvidia-ml loaded at run time).
struct Gpu {
    nvml: nvml_wrapper::Nvml,
    index: u32,
}

impl Gpu {
    fn open(index: u32) -> Option<Self> {
        match nvml_wrapper::Nvml::init() {
            Ok(nvml) => Some(Self { nvml, index }),
            Err(e) => {
                tracing::debug!("no GPU figures in the live state: NVML: {e}");
                None
            }
        }
    }

    fn sample(&mut self) -> Option<GpuState> {
        let d = self.nvml.device_by_index(self.index).ok()?;
        let util = d.utilization_rates().ok()?;
        let mem = d.memory_info().ok()?;
        Some(GpuState {
            index: self.index,
            utilization_percent: util.gpu,
            memory_used_bytes: mem.used,
            memory_total_bytes: mem.total,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step(n: u64, secs: f64, wait: f64) -> StepReport {
        StepReport {
            step: n,
            total_steps: 100,
            epoch: n as f64 / 50.0,
            loss: 1.0 / n as f64,
            learning_rate: 1e-4,
            grad_norm: 2.0,
            samples: 8,
            tokens: 256,
            seconds: secs,
            collective_seconds: wait,
        }
    }

    #[test]
    fn a_rank_publishes_its_steps_and_rates() {
        let tmp = tempfile::tempdir().unwrap();
        let rt = tmp.path().join("rt");
        let out = tmp.path().join("run");
        let p = LivePublisher::start_in(&out, 1, 2, None, &rt).unwrap();
        for n in 1..=4 {
            p.step(&step(n, 0.5, 0.1));
        }
        // The job is registered while it runs.
        assert_eq!(
            running_jobs(&rt).unwrap(),
            vec![std::path::absolute(&out).unwrap()]
        );
        drop(p);
        assert!(
            running_jobs(&rt).unwrap().is_empty(),
            "the entry goes with the publisher"
        );
        let ranks = read_ranks(&out).unwrap();
        assert_eq!(ranks.len(), 1);
        let r = &ranks[0];
        assert_eq!(
            (r.rank, r.world_size, r.step, r.total_steps),
            (1, 2, 4, 100)
        );
        assert_eq!(r.loss, Some(0.25));
        assert_eq!(r.loss_history, vec![1.0, 0.5, 1.0 / 3.0, 0.25]);
        // 8 samples and 256 tokens per 0.5 s step; 96 steps left at 0.5 s.
        assert!((r.samples_per_second - 16.0).abs() < 1e-9);
        assert!((r.tokens_per_second - 512.0).abs() < 1e-9);
        assert_eq!(r.eta_seconds, Some(48.0));
        assert!((r.collective_seconds - 0.4).abs() < 1e-9);
        assert!((r.compute_seconds - 1.6).abs() < 1e-9);
        assert!(r.rss_bytes > 0, "resident memory is read from /proc");
        assert_eq!(r.pid, std::process::id());
    }

    #[test]
    fn status_tells_lost_exited_and_stalled_ranks() {
        let now = 1000.0;
        let host = "here";
        let base = RankState {
            host: host.into(),
            pid: std::process::id(),
            phase: Phase::Training,
            step_seconds: 0.5,
            heartbeat_unix: now - 0.4,
            last_step_unix: now - 1.0,
            ..RankState::default()
        };
        let status = |s: RankState| RankView::new(s, now, host).status;
        assert_eq!(status(base.clone()), "training");
        let lost = RankState {
            heartbeat_unix: now - 30.0,
            ..base.clone()
        };
        assert_eq!(status(lost.clone()), "lost");
        // Elsewhere, a silent rank can only be lost; here, its missing process says more.
        let gone = RankState {
            pid: u32::MAX - 1,
            ..lost.clone()
        };
        assert_eq!(status(gone.clone()), "exited");
        assert_eq!(
            RankView::new(gone, now, "another-host").status,
            "lost",
            "a pid on another machine says nothing"
        );
        let stalled = RankState {
            last_step_unix: now - 120.0,
            ..base.clone()
        };
        assert_eq!(status(stalled), "stalled");
        let finished = RankState {
            phase: Phase::Finished,
            heartbeat_unix: now - 3600.0,
            ..base
        };
        assert_eq!(status(finished), "finished");
    }

    #[test]
    fn an_older_runs_extra_ranks_are_not_shown() {
        let tmp = tempfile::tempdir().unwrap();
        let live = tmp.path().join("live");
        std::fs::create_dir_all(&live).unwrap();
        let put = |rank: usize, world: usize, started: f64| {
            let s = RankState {
                rank,
                world_size: world,
                started_unix: started,
                ..RankState::default()
            };
            write_state(&rank_file(tmp.path(), rank), &s).unwrap();
        };
        // Four ranks last week, then a run of two.
        for r in 0..4 {
            put(r, 4, 1000.0);
        }
        put(0, 2, 900_000.0);
        put(1, 2, 900_001.0);
        let ranks: Vec<usize> = read_ranks(tmp.path())
            .unwrap()
            .iter()
            .map(|s| s.rank)
            .collect();
        assert_eq!(ranks, vec![0, 1]);
        std::fs::write(live.join("rank-7.json"), "{ half").unwrap();
        assert_eq!(
            read_ranks(tmp.path()).unwrap().len(),
            2,
            "a torn file is skipped"
        );
        let skipped = read_live(tmp.path()).unwrap().skipped;
        assert_eq!(skipped.len(), 1, "and said: {skipped:?}");
        assert!(skipped[0].contains("rank-7.json: not a kiln rank state"));
        assert!(read_ranks(&tmp.path().join("nothing")).is_err());
    }

    #[test]
    fn the_runtime_folder_is_created_private_and_must_be_ours() {
        use std::os::unix::fs::PermissionsExt;
        let tmp = tempfile::tempdir().unwrap();
        let rt = tmp.path().join("a/kiln");
        let jobs = ensure_runtime_dir(&rt).unwrap();
        for d in [&rt, &jobs] {
            let mode = std::fs::metadata(d).unwrap().permissions().mode();
            assert_eq!(mode & 0o777, 0o700, "{}", d.display());
        }
        // One of ours made open (0755, an older kiln's /tmp/kiln-<uid>) is made private.
        let open = tmp.path().join("open");
        std::fs::create_dir(&open).unwrap();
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o755)).unwrap();
        let open_jobs = ensure_runtime_dir(&open).unwrap();
        for d in [&open, &open_jobs] {
            let mode = std::fs::metadata(d).unwrap().permissions().mode();
            assert_eq!(mode & 0o777, 0o700, "{}", d.display());
        }
        // A symbolic link to a folder of ours is still refused: it can be someone else's link.
        let link = tmp.path().join("link");
        std::os::unix::fs::symlink(&rt, &link).unwrap();
        let e = ensure_runtime_dir(&link).unwrap_err().to_string();
        assert!(
            e.contains("is a symbolic link") && e.contains("link"),
            "{e}"
        );
        let e = running_jobs(&link).unwrap_err().to_string();
        assert!(e.contains("is a symbolic link"), "{e}");
        // A jobs/ that is a link is refused the same way.
        let rt2 = tmp.path().join("rt2");
        std::fs::create_dir(&rt2).unwrap();
        std::os::unix::fs::symlink(&jobs, rt2.join("jobs")).unwrap();
        assert!(running_jobs(&rt2).is_err());
        assert!(ensure_runtime_dir(&rt2).is_err());
        // No folder at all is no job, and reading creates nothing.
        assert!(running_jobs(&tmp.path().join("none")).unwrap().is_empty());
        assert!(!tmp.path().join("none").exists());
    }

    #[test]
    fn only_regular_files_are_read_and_only_so_much() {
        let tmp = tempfile::tempdir().unwrap();
        let fifo = tmp.path().join("fifo");
        let c = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let e = read_regular(&fifo, 100, true).unwrap_err().to_string();
        assert!(e.contains("a FIFO, not a regular file"), "{e}");
        let e = read_regular(Path::new("/dev/zero"), 100, true)
            .unwrap_err()
            .to_string();
        assert!(e.contains("a device"), "{e}");
        let file = tmp.path().join("f");
        std::fs::write(&file, "12345").unwrap();
        let link = tmp.path().join("link");
        std::os::unix::fs::symlink(&file, &link).unwrap();
        let e = read_regular(&link, 100, false).unwrap_err().to_string();
        assert!(e.contains("a symbolic link"), "{e}");
        assert_eq!(read_regular(&link, 100, true).unwrap(), b"12345");
        assert_eq!(read_regular(&file, 5, false).unwrap(), b"12345");
        let e = read_regular(&file, 4, false).unwrap_err().to_string();
        assert!(e.contains("larger than 4 bytes"), "{e}");
    }

    #[test]
    fn job_entry_names_are_digits_dot_json() {
        let pid = |n: &str| job_entry_pid(std::ffi::OsStr::new(n));
        assert_eq!(pid("1234.json"), Some(1234));
        for bad in [
            "x.json",
            ".json",
            "12.json.tmp",
            "+12.json",
            "1 2.json",
            "12",
        ] {
            assert_eq!(pid(bad), None, "{bad}");
        }
    }
}
