//! `kiln convert --to-tp N [--to-pp M]` / `--to-full`: a model folder or checkpoint, whole or
//! sharded at any tensor- and pipeline-parallel sizes, rewritten whole (a Hugging Face folder, or
//! a plain checkpoint) or as tensor-parallel shards per pipeline stage — the optimizer moments
//! too, so a run can resume at another layout from the converted folder (NxD's converter leaves
//! the optimizer behind).
//!
//! The output is written into a hidden folder beside `--out` and renamed into place, so a failed
//! conversion leaves nothing half-written.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use super::checkpoint::{write_marker, Marker, MARKER};
use crate::contract::ParamSplit;
use crate::formats::model_weights::read_model_weights;
use crate::formats::safetensors::{read_safetensors, safetensors_bytes, HostTensor, StoreDtype};
use crate::formats::sharded::{
    read_layout, read_whole_model, read_whole_optimizer, ShardLayout, LAYOUT_FILE,
};
use crate::io::files::{sync_dir, write_synced};
use crate::models::decoder::DECODER_EMBEDDING;
use crate::models::lora::{ADAPTER_CONFIG, ADAPTER_WEIGHTS};
use crate::parallel::pipeline::{cut_stages, layer_index, owner_stage};
use crate::{KilnError, Result};

/// What to write.
pub enum Target {
    /// One `model.safetensors` (and a flat `optimizer.safetensors` for a checkpoint).
    Full,
    /// Tensor-parallel shards: every rank's cut of every parameter, by name; with
    /// `coalesce_qkv`, attention's q/k/v stored as NxD's one `qkv_proj` per rank. With
    /// `stages`, each pipeline stage's parameters in files of their own.
    TensorParallel {
        splits: Vec<BTreeMap<String, ParamSplit>>,
        coalesce_qkv: bool,
        stages: Option<Stages>,
    },
}

/// Pipeline stages of a sharded folder: how many, and which holds each parameter.
pub struct Stages {
    pub count: usize,
    pub of: BTreeMap<String, usize>,
}

/// A folder's contents, put together.
pub struct WholeFolder {
    pub model: BTreeMap<String, HostTensor>,
    /// AdamW's moments in their parameters' shapes (a checkpoint's), if any.
    pub moments: Option<BTreeMap<String, HostTensor>>,
    /// The other files (config, tokenizer, trainer state), copied as they are.
    pub others: Vec<PathBuf>,
    /// The marker of a kiln checkpoint.
    pub marker: Option<Marker>,
    /// A LoRA run's folder: the weights are its adapter's (`adapter_config.json` beside them),
    /// written whole as PEFT's `adapter_model.safetensors`.
    pub adapter: bool,
}

impl Stages {
    /// The stages of a decoder whose parameters are `names`, cut as training at
    /// `--pipeline-parallel-size stages` (with `--pipeline-cuts cuts`, if given) cuts it.
    pub fn of_decoder(names: &[&str], stages: usize, cuts: Option<&[usize]>) -> Result<Self> {
        // The layers' indices come from the file: they must be 0..n, so n is bounded by the
        // names read, never taken from one index alone.
        let indices: std::collections::BTreeSet<usize> =
            names.iter().filter_map(|n| layer_index(n)).collect();
        let layers = indices.len();
        if indices.last().is_some_and(|&last| last + 1 != layers) {
            return Err(KilnError::Weights(format!(
                "the model's decoder layers are numbered up to {}, but only {layers} of them \
                 exist: their parameters' names must number the layers 0 to n − 1",
                indices.last().expect("checked")
            )));
        }
        let cut = cut_stages(layers, stages, cuts)?;
        let embedding = [DECODER_EMBEDDING.to_string()];
        Ok(Self {
            count: stages,
            of: names
                .iter()
                .map(|n| (n.to_string(), owner_stage(n, &cut, &embedding)))
                .collect(),
        })
    }
}

/// Files a conversion rewrites rather than copies.
fn is_rewritten(name: &str) -> bool {
    name.ends_with(".safetensors")
        || name == "model.safetensors.index.json"
        || name == LAYOUT_FILE
        || name == MARKER
}

/// Reads a model folder or checkpoint (whole or sharded) whole.
pub fn read_whole_folder(dir: &Path) -> Result<WholeFolder> {
    let layout = read_layout(dir)?;
    let adapter = dir.join(ADAPTER_CONFIG).exists() && !dir.join("model.safetensors").exists();
    let (model, moments) = match &layout {
        Some(l) => (
            read_whole_model(dir, l)?,
            (!l.optimizer.is_empty())
                .then(|| read_whole_optimizer(dir, l))
                .transpose()?,
        ),
        None => {
            let model = if adapter {
                crate::models::lora::read_adapter_tensors(dir)?
            } else {
                read_model_weights(dir)?
            };
            let opt = dir.join("optimizer.safetensors");
            let moments = if opt.exists() {
                // A plain checkpoint keeps moments flat: they take their parameter's shape.
                let mut m = read_safetensors(&opt)?;
                for (key, t) in m.iter_mut() {
                    let name = key.rsplit_once('.').map_or(key.as_str(), |(n, _)| n);
                    let shape = model.get(name).map(|w| w.shape.clone());
                    match shape {
                        Some(s) if s.iter().product::<usize>() == t.data.len() => t.shape = s,
                        _ => {
                            return Err(KilnError::Checkpoint(format!(
                                "{}: {key} matches no parameter of the model",
                                opt.display()
                            )))
                        }
                    }
                }
                Some(m)
            } else {
                None
            };
            (model, moments)
        }
    };
    let mut others = Vec::new();
    for e in std::fs::read_dir(dir).map_err(|e| KilnError::io(dir, e))? {
        let e = e.map_err(|e| KilnError::io(dir, e))?;
        let name = e.file_name().to_string_lossy().to_string();
        if e.file_type().is_ok_and(|t| t.is_file()) && !is_rewritten(&name) {
            others.push(e.path());
        }
    }
    others.sort();
    let marker = crate::io::read_json(&dir.join(MARKER)).ok();
    Ok(WholeFolder {
        model,
        moments,
        others,
        marker,
        adapter,
    })
}

/// Writes `src` (any layout) into the new folder `out` as `target` says, which sees the whole
/// folder (its parameter names and shapes) first.
pub fn reshard(
    src: &Path,
    out: &Path,
    target: impl FnOnce(&WholeFolder) -> Result<Target>,
) -> Result<()> {
    let inputs = [("model folder", src)];
    crate::io::files::check_new_folder(out, "--out", &inputs)?;
    let whole = read_whole_folder(src)?;
    let target = target(&whole)?;
    crate::io::files::write_new_folder(out, "--out", &inputs, |tmp| {
        write_folder(tmp, &whole, &target)
    })
}

fn put(dir: &Path, name: &str, bytes: &[u8]) -> Result<()> {
    let path = dir.join(name);
    if let Some(p) = path.parent() {
        std::fs::create_dir_all(p).map_err(|e| KilnError::io(p, e))?;
    }
    write_synced(&path, bytes)
}

fn flat(t: &BTreeMap<String, HostTensor>) -> BTreeMap<String, HostTensor> {
    t.iter()
        .map(|(k, v)| {
            let data = v.data.clone();
            let shape = vec![data.len()];
            (k.clone(), HostTensor { shape, data })
        })
        .collect()
}

fn write_folder(tmp: &Path, whole: &WholeFolder, target: &Target) -> Result<()> {
    std::fs::create_dir_all(tmp).map_err(|e| KilnError::io(tmp, e))?;
    for src in &whole.others {
        let bytes = std::fs::read(src).map_err(|e| KilnError::io(src, e))?;
        let name = src.file_name().expect("a file").to_string_lossy();
        put(tmp, &name, &bytes)?;
    }
    match target {
        Target::Full => {
            // A LoRA run's folder goes back to PEFT's file and names; a model to its own.
            let (name, model) = if whole.adapter {
                let peft: BTreeMap<String, HostTensor> = whole
                    .model
                    .iter()
                    .map(|(k, t)| (crate::models::lora::peft_key(k), t.clone()))
                    .collect();
                (ADAPTER_WEIGHTS, std::borrow::Cow::Owned(peft))
            } else {
                (
                    "model.safetensors",
                    std::borrow::Cow::Borrowed(&whole.model),
                )
            };
            put(tmp, name, &safetensors_bytes(&model, StoreDtype::F32)?)?;
            if let Some(m) = &whole.moments {
                put(
                    tmp,
                    "optimizer.safetensors",
                    &safetensors_bytes(&flat(m), StoreDtype::F32)?,
                )?;
            }
        }
        Target::TensorParallel {
            splits,
            coalesce_qkv,
            stages,
        } => {
            let shapes = whole
                .model
                .iter()
                .map(|(k, t)| (k.clone(), t.shape.clone()))
                .collect();
            let mut layout = ShardLayout::from_splits(&shapes, splits, *coalesce_qkv)?;
            if let Some(st) = stages {
                layout = layout.with_stages(st.count, |n| st.of.get(n).copied().unwrap_or(0))?;
            }
            let stage_of = |param: &str| layout.params.get(param).map_or(0, |p| p.stage);
            for tp in 0..splits.len() {
                let cut = |t: &BTreeMap<String, HostTensor>, param: fn(&str) -> &str, s: usize| {
                    t.iter()
                        .filter(|(k, _)| stage_of(param(k)) == s)
                        .map(|(k, v)| Ok((k.clone(), layout.cut(param(k), tp, v)?)))
                        .collect::<Result<BTreeMap<_, _>>>()
                };
                let mut covers = BTreeMap::new();
                for s in 0..layout.pipeline_parallel_size {
                    let model = cut(&whole.model, |k| k, s)?;
                    let stored = if *coalesce_qkv {
                        crate::formats::sharded::coalesce_qkv(model.clone())
                    } else {
                        model.clone()
                    };
                    put(
                        tmp,
                        &layout.model_file(tp, s),
                        &safetensors_bytes(&stored, StoreDtype::F32)?,
                    )?;
                    if let Some(m) = &whole.moments {
                        let moments = cut(m, |k| k.rsplit_once('.').map_or(k, |(n, _)| n), s)?;
                        put(
                            tmp,
                            &layout.optimizer_file(tp, s, 0),
                            &safetensors_bytes(&moments, StoreDtype::F32)?,
                        )?;
                        covers.extend(
                            model
                                .iter()
                                .filter(|(k, _)| m.contains_key(&format!("{k}.exp_avg")))
                                .map(|(k, t)| (k.clone(), 0..t.data.len())),
                        );
                    }
                }
                if whole.moments.is_some() {
                    layout.optimizer.push(vec![covers]);
                }
            }
            put(
                tmp,
                LAYOUT_FILE,
                &serde_json::to_vec_pretty(&layout).expect("plain data"),
            )?;
        }
    }
    // A converted checkpoint stays a complete checkpoint of the run that wrote it.
    if let Some(m) = &whole.marker {
        write_marker(tmp, &m.run_id, m.global_step)?;
    }
    sync_dir(tmp)
}
