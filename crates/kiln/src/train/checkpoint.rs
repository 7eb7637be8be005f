//! Checkpoints and saved models, laid out as transformers' Trainer does:
//! `output_dir/checkpoint-<step>/{config.json, model.safetensors, tokenizer.json, trainer_state.json,
//! optimizer.safetensors, scheduler.json, training_args.json}`.
//!
//! A checkpoint is written into a hidden temporary folder and renamed into place, so a crash never
//! leaves a half-written `checkpoint-N` behind.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{KilnError, Result};
use crate::hub::atomic_write;
use crate::hub::weights::{write_safetensors, HostTensor};

/// The non-weight files of a model folder.
#[derive(Debug, Clone, Default)]
pub struct ModelFiles {
    pub config_json: String,
    /// Copied verbatim into every saved folder.
    pub tokenizer_json: Option<PathBuf>,
    /// Other files copied verbatim when present (`tokenizer_config.json`, `generation_config.json`).
    pub copy: Vec<PathBuf>,
}

/// Writes `config.json`, `model.safetensors` and `tokenizer.json` into `dir`.
pub fn write_model_dir(
    dir: &Path,
    tensors: &BTreeMap<String, HostTensor>,
    files: &ModelFiles,
) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| KilnError::io(dir, e))?;
    atomic_write(&dir.join("config.json"), files.config_json.as_bytes())?;
    write_safetensors(&dir.join("model.safetensors"), tensors)?;
    if let Some(tok) = &files.tokenizer_json {
        let bytes = std::fs::read(tok).map_err(|e| KilnError::io(tok, e))?;
        atomic_write(&dir.join("tokenizer.json"), &bytes)?;
    }
    for src in files.copy.iter().filter(|p| p.exists()) {
        let bytes = std::fs::read(src).map_err(|e| KilnError::io(src, e))?;
        let name = src.file_name().expect("a file name");
        atomic_write(&dir.join(name), &bytes)?;
    }
    Ok(())
}

/// `trainer_state.json`, with transformers' field names.
#[derive(Debug, Clone, Serialize, Deserialize, Default)]
pub struct TrainerState {
    pub epoch: f64,
    pub global_step: u64,
    pub max_steps: u64,
    pub num_train_epochs: f64,
    pub logging_steps: u64,
    pub eval_steps: u64,
    pub save_steps: u64,
    pub train_batch_size: usize,
    pub best_metric: Option<f64>,
    pub best_model_checkpoint: Option<String>,
    pub log_history: Vec<serde_json::Map<String, serde_json::Value>>,
    pub is_local_process_zero: bool,
    pub is_world_process_zero: bool,
    pub total_flos: f64,
}

/// Optimizer/scheduler bookkeeping saved beside the moments.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SchedulerState {
    pub step: u64,
    pub last_lr: f64,
    pub warmup_steps: u64,
    pub total_steps: u64,
    /// The run's seed: data order and dropout masks are derived from (seed, epoch, step).
    pub seed: u64,
}

/// Everything one checkpoint holds.
pub struct Checkpoint<'a> {
    pub model: &'a BTreeMap<String, HostTensor>,
    pub files: &'a ModelFiles,
    pub optimizer: &'a BTreeMap<String, HostTensor>,
    pub state: &'a TrainerState,
    pub scheduler: &'a SchedulerState,
    pub training_args_json: &'a str,
}

pub fn checkpoint_dir(output_dir: &Path, step: u64) -> PathBuf {
    output_dir.join(format!("checkpoint-{step}"))
}

fn json<T: Serialize>(v: &T) -> Vec<u8> {
    serde_json::to_vec_pretty(v).expect("serialisable")
}

/// Writes `output_dir/checkpoint-<step>` atomically and returns its path.
pub fn save_checkpoint(output_dir: &Path, ck: &Checkpoint) -> Result<PathBuf> {
    let step = ck.state.global_step;
    let final_dir = checkpoint_dir(output_dir, step);
    let tmp = output_dir.join(format!(".tmp-checkpoint-{step}"));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(|e| KilnError::io(&tmp, e))?;
    }
    write_model_dir(&tmp, ck.model, ck.files)?;
    write_safetensors(&tmp.join("optimizer.safetensors"), ck.optimizer)?;
    atomic_write(&tmp.join("trainer_state.json"), &json(ck.state))?;
    atomic_write(&tmp.join("scheduler.json"), &json(ck.scheduler))?;
    atomic_write(
        &tmp.join("training_args.json"),
        ck.training_args_json.as_bytes(),
    )?;
    if final_dir.exists() {
        std::fs::remove_dir_all(&final_dir).map_err(|e| KilnError::io(&final_dir, e))?;
    }
    std::fs::rename(&tmp, &final_dir).map_err(|e| KilnError::io(&final_dir, e))?;
    Ok(final_dir)
}

/// Checkpoint folders in `output_dir`, oldest (lowest step) first.
pub fn list_checkpoints(output_dir: &Path) -> Vec<(u64, PathBuf)> {
    let Ok(rd) = std::fs::read_dir(output_dir) else {
        return Vec::new();
    };
    let mut out: Vec<(u64, PathBuf)> = rd
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().to_string();
            let step = name.strip_prefix("checkpoint-")?.parse().ok()?;
            Some((step, e.path()))
        })
        .collect();
    out.sort();
    out
}

/// `DIR`, or the newest checkpoint of `output_dir` for `latest`.
pub fn resolve_resume(spec: &str, output_dir: &Path) -> Result<PathBuf> {
    if spec == "latest" {
        return list_checkpoints(output_dir)
            .pop()
            .map(|(_, p)| p)
            .ok_or_else(|| {
                KilnError::Checkpoint(format!(
                    "--resume-from-checkpoint latest: no checkpoint-* folder in {}",
                    output_dir.display()
                ))
            });
    }
    let p = PathBuf::from(spec);
    if !p.join("trainer_state.json").exists() {
        return Err(KilnError::Checkpoint(format!(
            "{}: not a checkpoint (no trainer_state.json)",
            p.display()
        )));
    }
    Ok(p)
}

/// Deletes the oldest checkpoints beyond `limit`, never the one in `keep` (the best model).
pub fn rotate_checkpoints(output_dir: &Path, limit: usize, keep: Option<&Path>) -> Result<()> {
    let all = list_checkpoints(output_dir);
    let mut excess = all.len().saturating_sub(limit.max(1));
    for (_, path) in all {
        if excess == 0 {
            break;
        }
        if keep.is_some_and(|k| k == path) {
            continue;
        }
        std::fs::remove_dir_all(&path).map_err(|e| KilnError::io(&path, e))?;
        excess -= 1;
    }
    Ok(())
}

pub use crate::hub::read_json;
