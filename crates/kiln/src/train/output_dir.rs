//! The output folder of a training run: which run owns it, what an interrupted run left in it, and
//! when training into it would destroy something.
//!
//! A run claims its folder before the first step: it takes an exclusive lock on the folder (a second
//! run into the same folder is refused while the first holds it), removes the hidden temporary and
//! trash entries an interrupted run left, refuses a folder that is the input model's or that holds
//! another run unless told `--overwrite-output-dir` (as transformers' example scripts do), and records
//! its run id in `kiln_run.json`. Checkpoints carry that id (see `checkpoint.rs`): rotation and
//! `--resume-from-checkpoint latest` only ever act on the current run's checkpoints.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use tracing::{info, warn};

use super::checkpoint::{list_checkpoints, resolve_resume, Marker};
use crate::error::{KilnError, Result};
use crate::io::files::{remove_leftovers, TEMP_PREFIX, TRASH_PREFIX};
use crate::parallel::launch::Attempt;

/// The run record kept in the output folder.
pub const RUN_FILE: &str = "kiln_run.json";

#[derive(Debug, Clone, Serialize, Deserialize)]
struct RunRecord {
    run_id: String,
    /// The launcher's job (`TORCHELASTIC_RUN_ID`) that trains into the folder, if one started it:
    /// its restarted workers continue this run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    job: Option<String>,
}

/// A claimed output folder. The lock is held as long as this value lives.
#[derive(Debug)]
pub struct RunDir {
    pub run_id: String,
    /// The checkpoint to resume from, resolved (`latest` → a folder).
    pub resume: Option<PathBuf>,
    /// Whether a restarted worker continued the run its job's earlier attempt began (then
    /// `resume` is that run's latest checkpoint, whatever `--resume-from-checkpoint` says).
    pub restarted: bool,
    _lock: File,
}

/// What [`claim`] needs to know about the run.
pub struct Claim<'a> {
    pub output_dir: &'a Path,
    /// The folder the model was loaded from.
    pub source_dir: Option<&'a Path>,
    /// `--resume-from-checkpoint`: a folder or `latest`.
    pub resume: Option<&'a str>,
    pub overwrite: bool,
    /// The launcher's attempt this worker belongs to, if one started it.
    pub attempt: Option<&'a Attempt>,
}

/// The run record kept in `output_dir`, if any.
fn recorded(output_dir: &Path) -> Option<RunRecord> {
    let path = output_dir.join(RUN_FILE);
    if !path.exists() {
        return None;
    }
    crate::io::read_json::<RunRecord>(&path).ok()
}

/// The run id recorded in `output_dir`, if any.
pub fn recorded_run_id(output_dir: &Path) -> Option<String> {
    recorded(output_dir).map(|r| r.run_id)
}

/// Resolves `--resume-from-checkpoint` the way [`claim`] does, for ranks that do not claim.
pub fn resolve_resume_for(output_dir: &Path, spec: &str) -> Result<PathBuf> {
    resolve_resume(spec, output_dir, recorded_run_id(output_dir).as_deref())
}

/// Claims `c.output_dir` for a run (see the module comment); called by the process that writes.
pub fn claim(c: &Claim) -> Result<RunDir> {
    let dir = c.output_dir;
    std::fs::create_dir_all(dir).map_err(|e| KilnError::io(dir, e))?;
    let lock = lock_dir(dir)?;
    if let Some(src) = c.source_dir {
        let same = crate::io::files::same_path(dir, src);
        if same && !c.overwrite {
            return Err(KilnError::Config(format!(
                "--output-dir {} is the model folder training reads: the run would overwrite its own \
                 input model; choose another --output-dir (or pass --overwrite-output-dir)",
                dir.display()
            )));
        }
    }
    let removed = remove_leftovers(dir, &[TEMP_PREFIX, TRASH_PREFIX, ".tmp-checkpoint-"])?;
    if !removed.is_empty() {
        info!(
            "{}: removed what an interrupted run left: {}",
            dir.display(),
            removed.join(", ")
        );
    }
    let record = recorded(dir);
    let job = c.attempt.map(|a| a.run_id.clone());
    // A restarted worker of the job that began this run continues it from its latest complete
    // checkpoint (what the first attempt was told to resume from is behind it), or, when it
    // saved none, begins again as the first attempt did.
    if let (Some(a), Some(r)) = (c.attempt.filter(|a| a.restart > 0), &record) {
        if r.job.is_some() && r.job == job {
            let latest = list_checkpoints(dir)
                .into_iter()
                .rev()
                .find(|k| k.is_complete_of(Some(&r.run_id)));
            if let Some(k) = latest {
                info!("restart {}: resuming from {}", a.restart, k.path.display());
                return finish_claim(dir, r.run_id.clone(), job, Some(k.path), true, lock);
            }
            if c.resume.is_none() {
                info!(
                    "restart {}: the run saved no checkpoint yet; starting it over",
                    a.restart
                );
                remove_log(dir)?;
                return finish_claim(dir, new_run_id(), job, None, true, lock);
            }
        }
    }
    let recorded = record.map(|r| r.run_id);
    let (run_id, resume) = match c.resume {
        Some(spec) => {
            let path = resolve_resume(spec, dir, recorded.as_deref())?;
            // The run continues: it keeps the id of the checkpoint it resumes.
            let id = crate::io::read_json::<Marker>(&path.join(super::checkpoint::MARKER))
                .ok()
                .map(|m| m.run_id)
                .or(recorded)
                .unwrap_or_else(new_run_id);
            (id, Some(path))
        }
        None => {
            let previous = previous_run(dir);
            if !previous.is_empty() {
                if !c.overwrite {
                    return Err(KilnError::Config(format!(
                        "--output-dir {} already holds a training run ({}): pass \
                         --resume-from-checkpoint latest to continue it, or --overwrite-output-dir \
                         to train into it anyway",
                        dir.display(),
                        previous.join(", ")
                    )));
                }
                warn!(
                    "--overwrite-output-dir: {} holds an earlier run ({}); its files are replaced, \
                     its checkpoints are left as they are and never rotated or resumed",
                    dir.display(),
                    previous.join(", ")
                );
            }
            remove_log(dir)?;
            (new_run_id(), None)
        }
    };
    finish_claim(dir, run_id, job, resume, false, lock)
}

/// A fresh run starts a fresh log.
fn remove_log(dir: &Path) -> Result<()> {
    let log = dir.join("log.jsonl");
    if log.exists() {
        std::fs::remove_file(&log).map_err(|e| KilnError::io(&log, e))?;
    }
    Ok(())
}

/// A run resumed at `step` in its own folder: `log.jsonl` keeps only the entries up to that step,
/// so the steps the interrupted attempt took after its checkpoint (taken again now) are not
/// listed twice, as `trainer_state.json`'s history is cut at the checkpoint too.
pub fn trim_log(dir: &Path, step: u64) -> Result<()> {
    let log = dir.join("log.jsonl");
    let Ok(text) = std::fs::read_to_string(&log) else {
        return Ok(());
    };
    let kept: String = text
        .lines()
        .filter(|l| {
            serde_json::from_str::<serde_json::Value>(l)
                .ok()
                .and_then(|v| v["step"].as_u64())
                .is_none_or(|s| s <= step)
        })
        .map(|l| format!("{l}\n"))
        .collect();
    if kept.len() != text.len() {
        crate::io::files::replace_files(dir, &[("log.jsonl", kept.as_bytes())])?;
    }
    Ok(())
}

/// Records the run that now owns `dir`.
fn finish_claim(
    dir: &Path,
    run_id: String,
    job: Option<String>,
    resume: Option<PathBuf>,
    restarted: bool,
    lock: File,
) -> Result<RunDir> {
    let record = serde_json::to_vec_pretty(&RunRecord {
        run_id: run_id.clone(),
        job,
    })
    .expect("plain data serialises");
    crate::io::atomic_write(&dir.join(RUN_FILE), &record)?;
    Ok(RunDir {
        run_id,
        resume,
        restarted,
        _lock: lock,
    })
}

/// What in `dir` shows an earlier run: its record, checkpoints, a saved model.
fn previous_run(dir: &Path) -> Vec<String> {
    let mut found: Vec<String> = list_checkpoints(dir)
        .into_iter()
        .filter(|c| c.marker.is_some() || c.path.join("trainer_state.json").exists())
        .map(|c| format!("checkpoint-{}", c.step))
        .collect();
    for f in [RUN_FILE, "model.safetensors", "trainer_state.json"] {
        if dir.join(f).exists() {
            found.push(f.to_string());
        }
    }
    found
}

fn new_run_id() -> String {
    format!("{:016x}", rand::random::<u64>())
}

/// An exclusive advisory lock on the folder itself, released when the process ends (even by
/// SIGKILL): two runs writing checkpoints into one folder would rotate each other's away.
///
/// A lock this process dropped a moment ago can still be held for a few milliseconds: a child
/// another thread is starting shares every open descriptor between its fork and its exec (which
/// closes them). So a busy folder is retried for half a second before it is refused; another run
/// holds it for as long as it trains.
fn lock_dir(dir: &Path) -> Result<File> {
    let f = File::open(dir).map_err(|e| KilnError::io(dir, e))?;
    for _ in 0..25 {
        // SAFETY: flock on a descriptor this function owns; no memory is involved.
        let r = unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
        if r == 0 {
            return Ok(f);
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::WouldBlock {
            return Err(KilnError::io(dir, e));
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    Err(KilnError::Config(format!(
        "--output-dir {}: another kiln run is training into this folder right now",
        dir.display()
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claim_in(dir: &Path, resume: Option<&str>, overwrite: bool) -> Result<RunDir> {
        claim(&Claim {
            output_dir: dir,
            source_dir: None,
            resume,
            overwrite,
            attempt: None,
        })
    }

    #[test]
    fn a_folder_holding_a_run_is_refused_unless_resumed_or_overwritten() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("out");
        let first = claim_in(&dir, None, false).unwrap();
        let first_id = first.run_id.clone();
        // The same folder while the first run holds it.
        let e = claim_in(&dir, None, true).unwrap_err();
        assert!(e.to_string().contains("another kiln run"), "{e}");
        drop(first);
        let e = claim_in(&dir, None, false).unwrap_err();
        assert!(
            e.to_string().contains("already holds a training run"),
            "{e}"
        );
        let second = claim_in(&dir, None, true).unwrap();
        assert_ne!(second.run_id, first_id);
        assert_eq!(recorded_run_id(&dir), Some(second.run_id.clone()));
    }

    /// A folder `checkpoint-<step>` that lists as a complete checkpoint of `run_id`.
    fn fake_checkpoint(dir: &Path, step: u64, run_id: &str) -> PathBuf {
        let p = super::super::checkpoint::checkpoint_dir(dir, step);
        std::fs::create_dir_all(&p).unwrap();
        let marker = Marker {
            run_id: run_id.into(),
            global_step: step,
            files: Default::default(),
        };
        std::fs::write(
            p.join(super::super::checkpoint::MARKER),
            serde_json::to_vec(&marker).unwrap(),
        )
        .unwrap();
        std::fs::write(p.join("trainer_state.json"), b"{}").unwrap();
        p
    }

    #[test]
    fn a_restarted_worker_continues_the_run_its_job_began() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("out");
        let job = |run_id: &str, restart| Attempt {
            run_id: run_id.into(),
            restart,
        };
        let claim_as = |a: &Attempt, overwrite| {
            claim(&Claim {
                output_dir: &dir,
                source_dir: None,
                resume: None,
                overwrite,
                attempt: Some(a),
            })
        };
        let first = claim_as(&job("job-a", 0), false).unwrap();
        assert!(!first.restarted);
        drop(first);
        // Failed before its first checkpoint: the restart begins again instead of refusing
        // the folder its own first attempt claimed.
        let again = claim_as(&job("job-a", 1), false).unwrap();
        assert!(again.restarted && again.resume.is_none());
        let id = again.run_id.clone();
        drop(again);
        fake_checkpoint(&dir, 4, &id);
        let eight = fake_checkpoint(&dir, 8, &id);
        fake_checkpoint(&dir, 12, "another-run");
        let resumed = claim_as(&job("job-a", 2), false).unwrap();
        assert_eq!(resumed.resume.as_deref(), Some(eight.as_path()));
        assert_eq!(resumed.run_id, id);
        drop(resumed);
        // Another job's restart is no continuation: the folder holds someone else's run.
        let e = claim_as(&job("job-b", 1), false).unwrap_err();
        assert!(
            e.to_string().contains("already holds a training run"),
            "{e}"
        );
        // Nor is a first attempt of the same job id.
        assert!(claim_as(&job("job-a", 0), false).is_err());
    }

    #[test]
    fn the_model_folder_is_not_an_output_folder() {
        let tmp = tempfile::tempdir().unwrap();
        let e = claim(&Claim {
            output_dir: tmp.path(),
            source_dir: Some(&tmp.path().join(".")),
            resume: None,
            overwrite: false,
            attempt: None,
        })
        .unwrap_err();
        assert!(
            e.to_string().contains("overwrite its own input model"),
            "{e}"
        );
    }

    #[test]
    fn leftovers_of_an_interrupted_run_are_removed() {
        let tmp = tempfile::tempdir().unwrap();
        std::fs::create_dir(tmp.path().join(".kiln-tmp-checkpoint-8")).unwrap();
        std::fs::create_dir(tmp.path().join(".kiln-trash-checkpoint-2-77")).unwrap();
        std::fs::write(tmp.path().join(".kiln-tmp-config.json-77"), b"{").unwrap();
        claim_in(tmp.path(), None, false).unwrap();
        let left: Vec<String> = std::fs::read_dir(tmp.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
            .collect();
        assert_eq!(left, vec![RUN_FILE.to_string()]);
    }
}
