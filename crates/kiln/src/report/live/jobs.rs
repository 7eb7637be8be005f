//! Where live jobs are found: each rank's file in its output folder, and the per-user runtime
//! folder (made private, checked to be the user's own) where every running rank leaves the path of
//! its output folder, so `kiln top` finds jobs without being told.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::*;
use crate::error::{KilnError, Result};

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

pub(super) fn current_uid() -> u32 {
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
pub(super) fn make_private(dir: &Path) -> Result<()> {
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
pub(super) fn check_own_folder(dir: &Path) -> Result<()> {
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

/// Leaves `runtime_dir()/jobs/<pid>.json` pointing at the output folder (best effort: a job
/// that cannot register is still found by `kiln top OUTPUT_DIR`, and says why once).
pub(super) fn register_job(runtime: &Path, output_dir: &Path, rank: usize) -> Option<PathBuf> {
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
pub(super) struct JobEntry {
    output_dir: String,
    rank: usize,
    pid: u32,
}

/// Job entries are small: anything larger is not one.
pub(super) const JOB_ENTRY_MAX_BYTES: u64 = 64 << 10;

pub(super) fn job_entry_name(pid: u32) -> String {
    format!("{pid}.json")
}

/// The pid in a job entry's file name (`<pid>.json`, digits only), or None for any other name.
pub(super) fn job_entry_pid(name: &std::ffi::OsStr) -> Option<u32> {
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
