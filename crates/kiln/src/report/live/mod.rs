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
//!
//! Here: the state a rank publishes ([`RankState`], [`StepReport`]) and the host facts it
//! carries; `publisher.rs` writes it, `jobs.rs` finds the running jobs, `reader.rs` reads the
//! files back for `kiln top`.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

mod jobs;
mod publisher;
mod reader;
pub use jobs::*;
pub use publisher::*;
pub use reader::*;

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

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

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
