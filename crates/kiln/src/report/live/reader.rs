//! The reading side, for `kiln top`: rank files read without following links and within a size
//! bound (a hostile file is refused, not loaded), and each rank's status from its two clocks.

use std::collections::BTreeMap;
use std::path::Path;

use serde::Serialize;

use super::*;
use crate::error::{KilnError, Result};

/// A rank file holds a few hundred numbers (its loss history included).
pub const RANK_FILE_MAX_BYTES: u64 = 1 << 20;

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

pub(super) fn not_regular(what: &str) -> std::io::Error {
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
            Err(why) => skipped.push(crate::report::escape_for_terminal(&format!(
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
