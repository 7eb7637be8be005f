//! Checkpoints and saved models, laid out as transformers' Trainer does:
//! `output_dir/checkpoint-<step>/{config.json, model.safetensors, tokenizer.json, trainer_state.json,
//! optimizer.safetensors, scheduler.json, training_args.json}`, plus kiln's marker
//! `kiln_checkpoint.json` (the run that wrote it, and the size of every file).
//!
//! A checkpoint's life is a sequence of atomic steps, so a crash at any moment leaves every
//! `checkpoint-N` folder either complete or absent:
//! - it is written into a hidden `.kiln-tmp-checkpoint-N` folder, every file flushed, the marker
//!   last, then renamed into place (and the parent folder flushed);
//! - it is deleted (rotation) by renaming it to a hidden `.kiln-trash-` name first;
//! - hidden leftovers of an interrupted run are removed at the next start (`output_dir.rs`).
//!
//! Only folders with a marker of the current run are rotated, and `latest` resumes only from a
//! complete marked checkpoint: a user's own `checkpoint-0/` or a stale folder of another run is
//! never deleted and never picked.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{KilnError, Result};
use crate::formats::safetensors::{safetensors_bytes, HostTensor, StoreDtype};
use crate::io::files::{crash_point, remove_dir, sync_dir, write_synced, TEMP_PREFIX};

/// The marker file inside every checkpoint kiln writes.
pub const MARKER: &str = "kiln_checkpoint.json";

/// The non-weight files of a model folder.
#[derive(Debug, Clone, Default)]
pub struct ModelFiles {
    pub config_json: String,
    /// Copied verbatim into every saved folder.
    pub tokenizer_json: Option<PathBuf>,
    /// Other files copied verbatim when present (`tokenizer_config.json`, `generation_config.json`).
    pub copy: Vec<PathBuf>,
    /// The folder the model was loaded from (training must not write its output over it).
    pub source_dir: Option<PathBuf>,
    /// A LoRA run: the folder holds the adapter only, in PEFT's files (`adapter_config.json`,
    /// `adapter_model.safetensors`), beside the tokenizer's files, and no `config.json`: the base
    /// model comes from `base_model_name_or_path`, as `PeftModel.from_pretrained` expects.
    pub adapter: Option<AdapterFiles>,
}

/// What a LoRA run's folders say about the adapter and its base model.
#[derive(Debug, Clone)]
pub struct AdapterFiles {
    pub adapter: crate::models::lora::Adapter,
    /// `adapter_config.json`'s `base_model_name_or_path`.
    pub base_model: String,
}

/// Every parameter finite, or an error naming the first that is not (`what` says what was about to
/// happen: a model with NaN weights is never saved).
pub fn ensure_finite(tensors: &BTreeMap<String, HostTensor>, what: &str) -> Result<()> {
    for (name, t) in tensors {
        if let Some(i) = t.data.iter().position(|v| !v.is_finite()) {
            let bad = t.data.iter().filter(|v| !v.is_finite()).count();
            return Err(KilnError::NonFinite(format!(
                "{what}: parameter {name} holds {bad} non-finite values (the first, at index {i}, is {}); \
                 the model diverged, nothing was saved",
                t.data[i]
            )));
        }
    }
    Ok(())
}

/// Produces the files of a model folder (`config.json`, `model.safetensors`, `tokenizer.json`, the
/// copied extras) one at a time, handing each to `put` (which writes it) before making the next:
/// the serialised weights are never held beside the other files' bytes.
pub fn put_model_files(
    tensors: &BTreeMap<String, HostTensor>,
    files: &ModelFiles,
    mut put: impl FnMut(&str, &[u8]) -> Result<()>,
) -> Result<()> {
    use crate::models::lora::ADAPTER_WEIGHTS;
    if let Some(a) = &files.adapter {
        put(
            ADAPTER_WEIGHTS,
            &safetensors_bytes(&a.adapter.peft_tensors(tensors), StoreDtype::F32)?,
        )?;
        return put_config_files(files, put);
    }
    put(
        "model.safetensors",
        &safetensors_bytes(tensors, StoreDtype::F32)?,
    )?;
    put_config_files(files, put)
}

/// A checkpoint's (or an output folder's) weights by kiln's parameter paths: `model.safetensors`,
/// or a LoRA run's adapter under PEFT's names.
pub fn read_model_tensors(dir: &Path) -> Result<BTreeMap<String, HostTensor>> {
    read_model_tensors_where(dir, &crate::formats::safetensors::keep_all)
}

/// [`read_model_tensors`] of the parameters `wanted` names (an adapter's are read whole: it is
/// small).
pub fn read_model_tensors_where(
    dir: &Path,
    wanted: crate::formats::safetensors::Keep,
) -> Result<BTreeMap<String, HostTensor>> {
    let adapter = dir.join(crate::models::lora::ADAPTER_WEIGHTS);
    if adapter.exists() && !dir.join("model.safetensors").exists() {
        return crate::models::lora::read_adapter_tensors(dir);
    }
    let path = dir.join("model.safetensors");
    crate::formats::safetensors::read_safetensors_with(&path, wanted, &mut |_, t| t)
}

/// The files of a model folder besides its weights: `config.json` (a LoRA run's
/// `adapter_config.json`), `tokenizer.json`, the extras. Beside a causal LM's adapter there is no `config.json` (the base's is the base's, as PEFT saves
/// it); beside a classifier's there is, because it alone records the labels the trained head
/// predicts (`id2label`), which neither the base nor `adapter_config.json` holds. PEFT and
/// transformers read an adapter folder's `adapter_config.json` and ignore a `config.json` there.
pub fn put_config_files(
    files: &ModelFiles,
    mut put: impl FnMut(&str, &[u8]) -> Result<()>,
) -> Result<()> {
    if let Some(a) = &files.adapter {
        put(
            crate::models::lora::ADAPTER_CONFIG,
            a.adapter.config_json(&a.base_model).as_bytes(),
        )?;
    }
    let labelled = |a: &AdapterFiles| a.adapter.task_type == "SEQ_CLS";
    if files.adapter.as_ref().is_none_or(labelled) {
        put("config.json", stamped_config(&files.config_json).as_bytes())?;
    }
    let read =
        |src: &Path| crate::io::files::read_regular(src, "file to copy into the model folder");
    if let Some(tok) = &files.tokenizer_json {
        put("tokenizer.json", &read(tok)?)?;
    }
    // The extras are optional (a model folder may lack generation_config.json).
    let mut copied_tokenizer_config = false;
    for src in files.copy.iter().filter(|p| p.exists()) {
        let name = src.file_name().map(|n| n.to_string_lossy().to_string());
        let name = name.unwrap_or_default();
        copied_tokenizer_config |= name == "tokenizer_config.json";
        put(&name, &read(src)?)?;
    }
    // Without a tokenizer_config.json, transformers' AutoTokenizer takes the maximum length to be
    // 1e30 and a pipeline fed a long text overruns the position embeddings: write the model's.
    if files.tokenizer_json.is_some() && !copied_tokenizer_config {
        let config: serde_json::Value =
            serde_json::from_str(&files.config_json).unwrap_or_default();
        if let Some(n) = config["max_position_embeddings"].as_u64() {
            let tc = serde_json::json!({ "model_max_length": n });
            put("tokenizer_config.json", &json(&tc))?;
        }
    }
    Ok(())
}

/// The transformers release whose file formats kiln writes (its interop tests load them with it).
pub const TRANSFORMERS_FORMAT: &str = "5.23.0";

/// `config.json` stamped as transformers stamps what it saves: `transformers_version` is the
/// format's release (not the input model's), and `kiln_version` says who wrote it.
fn stamped_config(config_json: &str) -> String {
    match serde_json::from_str::<serde_json::Value>(config_json) {
        Ok(serde_json::Value::Object(mut m)) => {
            m.insert("transformers_version".into(), TRANSFORMERS_FORMAT.into());
            m.insert("kiln_version".into(), env!("CARGO_PKG_VERSION").into());
            // transformers writes config.json with sorted keys.
            crate::io::to_sorted_json_pretty(&serde_json::Value::Object(m))
        }
        _ => config_json.to_string(),
    }
}

/// Writes `config.json`, `model.safetensors` and `tokenizer.json` (and the extras) into `dir`, as a
/// group: a failure leaves the old files whole.
pub fn write_model_dir(
    dir: &Path,
    tensors: &BTreeMap<String, HostTensor>,
    files: &ModelFiles,
) -> Result<()> {
    let mut group = crate::io::files::FileGroup::new(dir)?;
    put_model_files(tensors, files, |name, bytes| group.add(name, bytes))?;
    group.commit()
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
    /// Steps whose update was skipped for a non-finite loss or gradient (`--skip-nonfinite-steps`).
    #[serde(default)]
    pub skipped_nonfinite: u64,
    /// reduce_lr_on_plateau's rate, best metric and counters.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub plateau: Option<crate::train::schedule::Plateau>,
    /// The finite step losses summed from step 1 (in order, in f64), so a resumed or restarted
    /// run reports the very `train_loss` of an unbroken one. Absent in older checkpoints.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub train_loss_sum: Option<f64>,
    /// The tokens (padding aside) trained on so far, over all ranks (TRL's `num_tokens`), so a
    /// resumed run counts on. 0 in older checkpoints.
    #[serde(default)]
    pub num_tokens: u64,
}

/// Everything one checkpoint holds.
pub struct Checkpoint<'a> {
    pub model: &'a BTreeMap<String, HostTensor>,
    pub files: &'a ModelFiles,
    /// `None` with save_only_model: no optimizer.safetensors, and no resuming from it.
    pub optimizer: Option<&'a BTreeMap<String, HostTensor>>,
    pub state: &'a TrainerState,
    pub scheduler: &'a SchedulerState,
    pub training_args_json: &'a str,
}

/// `kiln_checkpoint.json`: which run wrote the checkpoint, and every file's size (a checkpoint is
/// complete when each listed file has its size).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Marker {
    pub run_id: String,
    pub global_step: u64,
    pub files: BTreeMap<String, u64>,
}

impl Marker {
    fn read(dir: &Path) -> Option<Self> {
        crate::io::read_json(&dir.join(MARKER)).ok()
    }

    /// The first listed file that is missing or has another size.
    fn first_damage(&self, dir: &Path) -> Option<String> {
        self.files.iter().find_map(|(name, &size)| {
            match std::fs::metadata(dir.join(name)).map(|m| m.len()) {
                Ok(s) if s == size => None,
                Ok(s) => Some(format!("{name} has {s} bytes, {size} were written")),
                Err(_) => Some(format!("{name} is missing")),
            }
        })
    }
}

pub fn checkpoint_dir(output_dir: &Path, step: u64) -> PathBuf {
    output_dir.join(format!("checkpoint-{step}"))
}

fn json<T: Serialize>(v: &T) -> Vec<u8> {
    serde_json::to_vec_pretty(v).expect("plain data serialises")
}

/// Writes `output_dir/checkpoint-<step>` atomically (see the module comment) for run `run_id` and
/// returns its path. On failure (a full disk) the temporary folder is removed.
pub fn save_checkpoint(output_dir: &Path, ck: &Checkpoint, run_id: &str) -> Result<PathBuf> {
    let step = ck.state.global_step;
    let tmp = staging_dir(output_dir, step)?;
    let written = write_checkpoint_files(&tmp, ck, run_id);
    if let Err(e) = written {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(e);
    }
    publish(output_dir, &tmp, step)
}

/// The hidden folder checkpoint `step` is written into, emptied of any leftover.
pub fn staging_dir(output_dir: &Path, step: u64) -> Result<PathBuf> {
    let tmp = output_dir.join(format!("{TEMP_PREFIX}checkpoint-{step}"));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(|e| KilnError::io(&tmp, e))?;
    }
    std::fs::create_dir_all(&tmp).map_err(|e| KilnError::io(&tmp, e))?;
    Ok(tmp)
}

/// Moves the complete staging folder `tmp` into place as `checkpoint-<step>` (one rename).
pub fn publish(output_dir: &Path, tmp: &Path, step: u64) -> Result<PathBuf> {
    let final_dir = checkpoint_dir(output_dir, step);
    crash_point("checkpoint:complete");
    // rename(2) cannot replace a non-empty folder: a checkpoint of the same step (another run's,
    // with --overwrite-output-dir) is moved aside first, and deleted once the new one is in place.
    let old = final_dir.exists().then(|| {
        output_dir.join(format!(
            "{}checkpoint-{step}-{}",
            crate::io::files::TRASH_PREFIX,
            std::process::id()
        ))
    });
    if let Some(old) = &old {
        std::fs::rename(&final_dir, old).map_err(|e| KilnError::io(&final_dir, e))?;
    }
    std::fs::rename(tmp, &final_dir).map_err(|e| KilnError::io(&final_dir, e))?;
    sync_dir(output_dir)?;
    crash_point("checkpoint:renamed");
    if let Some(old) = old {
        std::fs::remove_dir_all(&old).map_err(|e| KilnError::io(&old, e))?;
    }
    Ok(final_dir)
}

/// Writes the marker of a staging folder whose files are all written: it lists every file (in
/// sub-folders too) with its size, so a checkpoint missing a rank's shard is never complete.
pub fn write_marker(tmp: &Path, run_id: &str, step: u64) -> Result<()> {
    fn walk(root: &Path, dir: &Path, out: &mut BTreeMap<String, u64>) -> Result<()> {
        for e in std::fs::read_dir(dir).map_err(|e| KilnError::io(dir, e))? {
            let e = e.map_err(|e| KilnError::io(dir, e))?;
            let path = e.path();
            let meta = e.metadata().map_err(|e| KilnError::io(&path, e))?;
            if meta.is_dir() {
                walk(root, &path, out)?;
                sync_dir(&path)?;
            } else {
                let name = path.strip_prefix(root).expect("inside root");
                out.insert(name.to_string_lossy().replace('\\', "/"), meta.len());
            }
        }
        Ok(())
    }
    let mut files = BTreeMap::new();
    walk(tmp, tmp, &mut files)?;
    files.remove(MARKER);
    let marker = Marker {
        run_id: run_id.to_string(),
        global_step: step,
        files,
    };
    write_synced(&tmp.join(MARKER), &json(&marker))?;
    sync_dir(tmp)
}

fn write_checkpoint_files(tmp: &Path, ck: &Checkpoint, run_id: &str) -> Result<()> {
    let mut sizes = BTreeMap::new();
    // Each file is written (and its bytes dropped) before the next is made.
    let mut put = |name: &str, bytes: &[u8]| -> Result<()> {
        write_synced(&tmp.join(name), bytes)?;
        sizes.insert(name.to_string(), bytes.len() as u64);
        crash_point("checkpoint:file");
        Ok(())
    };
    put_model_files(ck.model, ck.files, &mut put)?;
    if let Some(optimizer) = ck.optimizer {
        put(
            "optimizer.safetensors",
            &safetensors_bytes(optimizer, StoreDtype::F32)?,
        )?;
    }
    put("trainer_state.json", &json(ck.state))?;
    put("scheduler.json", &json(ck.scheduler))?;
    put("training_args.json", ck.training_args_json.as_bytes())?;
    let marker = Marker {
        run_id: run_id.to_string(),
        global_step: ck.state.global_step,
        files: sizes,
    };
    write_synced(&tmp.join(MARKER), &json(&marker))?;
    sync_dir(tmp)
}

/// One `checkpoint-N` folder of an output folder.
#[derive(Debug, Clone)]
pub struct CheckpointEntry {
    pub step: u64,
    pub path: PathBuf,
    /// `None` when the folder has no readable marker: not written by kiln (or by a kiln before
    /// markers), so never rotated and never resumed by `latest`.
    pub marker: Option<Marker>,
    /// Why a marked checkpoint is not whole (`None` when complete).
    pub damage: Option<String>,
}

impl CheckpointEntry {
    pub fn is_complete_of(&self, run_id: Option<&str>) -> bool {
        self.damage.is_none()
            && self
                .marker
                .as_ref()
                .is_some_and(|m| run_id.is_none_or(|r| m.run_id == r))
    }
}

/// The `checkpoint-N` folders of `output_dir`, oldest (lowest step) first.
pub fn list_checkpoints(output_dir: &Path) -> Vec<CheckpointEntry> {
    let Ok(rd) = std::fs::read_dir(output_dir) else {
        return Vec::new();
    };
    let mut out: Vec<CheckpointEntry> = rd
        .filter_map(|e| e.ok())
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().to_string();
            let step = name.strip_prefix("checkpoint-")?.parse().ok()?;
            let path = e.path();
            let marker = Marker::read(&path);
            let damage = match &marker {
                Some(m) => m.first_damage(&path),
                None => Some(format!("no {MARKER}")),
            };
            Some(CheckpointEntry {
                step,
                path,
                marker,
                damage,
            })
        })
        .collect();
    out.sort_by_key(|c| c.step);
    out
}

/// `DIR`, or for `latest` the newest complete checkpoint of run `run_id` (any kiln run when
/// `None`) in `output_dir`.
pub fn resolve_resume(spec: &str, output_dir: &Path, run_id: Option<&str>) -> Result<PathBuf> {
    if spec == "latest" {
        let all = list_checkpoints(output_dir);
        if let Some(c) = all.iter().rev().find(|c| c.is_complete_of(run_id)) {
            return Ok(c.path.clone());
        }
        let passed: Vec<String> = all
            .iter()
            .map(|c| {
                let why = match (&c.damage, &c.marker) {
                    (Some(d), _) => d.clone(),
                    (None, Some(m)) => format!("written by another run ({})", m.run_id),
                    (None, None) => "not kiln's".into(),
                };
                format!("{}: {why}", c.path.display())
            })
            .collect();
        return Err(KilnError::Checkpoint(format!(
            "--resume-from-checkpoint latest: no complete checkpoint of this run in {}{}",
            output_dir.display(),
            if passed.is_empty() {
                String::new()
            } else {
                format!(" (passed over: {})", passed.join("; "))
            }
        )));
    }
    let p = PathBuf::from(spec);
    if !p.join("trainer_state.json").exists() {
        return Err(KilnError::Checkpoint(format!(
            "{}: not a checkpoint (no trainer_state.json)",
            p.display()
        )));
    }
    if let Some(damage) = Marker::read(&p).and_then(|m| m.first_damage(&p)) {
        return Err(KilnError::Checkpoint(format!(
            "{}: incomplete checkpoint: {damage}",
            p.display()
        )));
    }
    Ok(p)
}

/// Deletes the oldest complete checkpoints of run `run_id` beyond `limit`, never the one in `keep`
/// (the best model), each through an atomic rename out of the way. Folders of other runs and
/// folders kiln did not write are never touched.
pub fn rotate_checkpoints(
    output_dir: &Path,
    limit: usize,
    keep: Option<&Path>,
    run_id: &str,
) -> Result<()> {
    let ours: Vec<CheckpointEntry> = list_checkpoints(output_dir)
        .into_iter()
        .filter(|c| c.is_complete_of(Some(run_id)))
        .collect();
    let mut excess = ours.len().saturating_sub(limit.max(1));
    for c in ours {
        if excess == 0 {
            break;
        }
        if keep.is_some_and(|k| k == c.path) {
            continue;
        }
        remove_dir(&c.path)?;
        excess -= 1;
    }
    Ok(())
}

pub use crate::io::read_json;

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny_checkpoint(out: &Path, step: u64, run: &str) -> PathBuf {
        let model = BTreeMap::from([(
            "w".to_string(),
            HostTensor {
                shape: vec![2],
                data: vec![1.0, 2.0],
            },
        )]);
        let files = ModelFiles {
            config_json: "{}".into(),
            ..Default::default()
        };
        let state = TrainerState {
            global_step: step,
            ..Default::default()
        };
        let sched = SchedulerState {
            step,
            last_lr: 0.0,
            warmup_steps: 0,
            total_steps: 10,
            seed: 1,
            skipped_nonfinite: 0,
            plateau: None,
            train_loss_sum: None,
            num_tokens: 0,
        };
        let ck = Checkpoint {
            model: &model,
            files: &files,
            optimizer: Some(&BTreeMap::new()),
            state: &state,
            scheduler: &sched,
            training_args_json: "{}",
        };
        save_checkpoint(out, &ck, run).unwrap()
    }

    #[test]
    fn rotation_touches_only_this_runs_complete_checkpoints() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path();
        // A user's own folder with a checkpoint-like name, and a stale checkpoint of another run.
        std::fs::create_dir(out.join("checkpoint-0")).unwrap();
        std::fs::write(out.join("checkpoint-0/notes.txt"), "mine").unwrap();
        tiny_checkpoint(out, 999, "old-run");
        for step in [1, 2, 3] {
            tiny_checkpoint(out, step, "run");
            rotate_checkpoints(out, 2, None, "run").unwrap();
        }
        let names: Vec<u64> = list_checkpoints(out).iter().map(|c| c.step).collect();
        assert_eq!(names, vec![0, 2, 3, 999]);
        assert!(out.join("checkpoint-0/notes.txt").exists());
        // `latest` of this run is 3, not the stale 999 nor the foreign 0.
        let latest = resolve_resume("latest", out, Some("run")).unwrap();
        assert_eq!(latest, out.join("checkpoint-3"));
        // A damaged checkpoint is passed over.
        std::fs::write(out.join("checkpoint-3/model.safetensors"), b"short").unwrap();
        let latest = resolve_resume("latest", out, Some("run")).unwrap();
        assert_eq!(latest, out.join("checkpoint-2"));
        let e = resolve_resume(out.join("checkpoint-3").to_str().unwrap(), out, None).unwrap_err();
        assert!(e.to_string().contains("incomplete checkpoint"), "{e}");
        let e = resolve_resume("latest", out, Some("nobody")).unwrap_err();
        assert!(e.to_string().contains("no complete checkpoint"), "{e}");
    }

    #[test]
    fn non_finite_weights_are_never_saved() {
        let t = BTreeMap::from([(
            "layer.weight".to_string(),
            HostTensor {
                shape: vec![3],
                data: vec![0.0, f32::NAN, f32::INFINITY],
            },
        )]);
        let e = ensure_finite(&t, "saving checkpoint-4").unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.contains("layer.weight holds 2 non-finite values"),
            "{msg}"
        );
        assert!(msg.contains("saving checkpoint-4"), "{msg}");
    }
}
