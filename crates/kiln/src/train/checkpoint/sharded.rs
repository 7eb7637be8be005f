//! Checkpoints of a sharded run (tensor or pipeline parallelism, ZeRO-1): every rank writes its own
//! files into the checkpoint's staging folder, rank 0 adds the shared files, composes the layout
//! (`shards.json`, see [`crate::formats::sharded`]) and the marker, and moves the folder into place —
//! the same atomic life as a plain checkpoint. The output folder must be one filesystem for all
//! ranks (as NxD's checkpoints need a shared one across nodes).
//!
//! Under a pipeline each stage writes only the parameters it owns (a tied embedding once, from
//! stage 0), the PP rank in its files' names.
//!
//! Resuming reads only this tensor-parallel rank's files when the cut is the same (every stage's
//! of them: a stage's rank loads the whole model before it lets the other stages' layers go); at
//! another tensor-, pipeline- or data-parallel size (or from a plain checkpoint) it puts the whole
//! model and moments together and cuts this rank's part from them.

use std::collections::BTreeMap;
use std::ops::Range;
use std::path::Path;

use serde::{Deserialize, Serialize};

use super::folder::ensure_finite;
use crate::contract::ParamSplit;
use crate::formats::safetensors::{
    read_safetensors_with, safetensors_bytes, HostTensor, StoreDtype,
};
use crate::formats::sharded::{
    cut_split, model_file, moments_of, optimizer_file, read_layout, read_rank_model_where,
    read_rank_optimizer_where, read_whole_model_where, read_whole_optimizer_where, Cut,
    ParamLayout, ShardLayout, LAYOUT_FILE,
};
use crate::io::files::write_synced;
use crate::parallel::mesh::{Coords, Mesh};
use crate::parallel::ZeroPartition;
use crate::{KilnError, Result};

/// Where a rank sits in a sharded run: the mesh, the rank's coordinates on it, and whether
/// AdamW's moments are split over the data-parallel ranks (ZeRO-1).
#[derive(Debug, Clone, Copy)]
pub struct ShardedRank {
    pub mesh: Mesh,
    pub at: Coords,
    pub zero: bool,
}

impl ShardedRank {
    /// The stage part of this rank's file names (`None` without a pipeline).
    fn stage(&self) -> Option<usize> {
        (self.mesh.pp > 1).then_some(self.at.pp)
    }
}

/// A rank's part of the layout, written beside its model shard and composed by rank 0.
#[derive(Serialize, Deserialize)]
struct RankCuts {
    /// Every parameter's whole shape and this rank's cut.
    params: BTreeMap<String, (Vec<usize>, Option<Cut>)>,
}

fn cuts_file(tp: usize, pp: Option<usize>) -> String {
    model_file(tp, pp).replace(".safetensors", ".cuts.json")
}

fn covers_file(tp: usize, pp: Option<usize>, dp: usize) -> String {
    optimizer_file(tp, pp, dp).replace(".safetensors", ".covers.json")
}

fn write_json_file<T: Serialize>(dir: &Path, name: &str, v: &T) -> Result<()> {
    let path = dir.join(name);
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent).map_err(|e| KilnError::io(parent, e))?;
    }
    write_synced(&path, &serde_json::to_vec_pretty(v).expect("plain data"))
}

fn write_tensors(dir: &Path, name: &str, t: &BTreeMap<String, HostTensor>) -> Result<()> {
    let path = dir.join(name);
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent).map_err(|e| KilnError::io(parent, e))?;
    }
    write_synced(&path, &safetensors_bytes(t, StoreDtype::F32)?)
}

/// Whole shape of a local tensor cut by `split`.
fn whole_shape(local: &[usize], split: Option<&ParamSplit>) -> Vec<usize> {
    let mut shape = local.to_vec();
    if let Some(ParamSplit::Sharded { axis, full, .. }) = split {
        shape[*axis] = *full;
    }
    shape
}

/// Writes this rank's files into the staging folder `tmp`: its model shard (the first
/// data-parallel rank of each tensor-parallel rank and stage; the others hold the same) and its
/// moments (every rank under ZeRO-1, the first data-parallel rank otherwise). Under a pipeline,
/// `model`, `moments` and `covers` are this stage's own parameters' only.
pub fn write_rank_files(
    tmp: &Path,
    place: ShardedRank,
    model: &BTreeMap<String, HostTensor>,
    splits: Option<&BTreeMap<String, ParamSplit>>,
    moments: &BTreeMap<String, HostTensor>,
    covers: &BTreeMap<String, Range<usize>>,
) -> Result<()> {
    let (tp, pp) = (place.at.tp, place.stage());
    if place.at.dp == 0 {
        ensure_finite(model, &format!("saving {}", model_file(tp, pp)))?;
        write_tensors(tmp, &model_file(tp, pp), model)?;
        let params = model
            .iter()
            .map(|(name, t)| {
                let split = splits.and_then(|s| s.get(name));
                (name.clone(), (whole_shape(&t.shape, split), Cut::of(split)))
            })
            .collect();
        write_json_file(tmp, &cuts_file(tp, pp), &RankCuts { params })?;
    }
    if place.zero || place.at.dp == 0 {
        write_tensors(tmp, &optimizer_file(tp, pp, place.at.dp), moments)?;
        write_json_file(tmp, &covers_file(tp, pp, place.at.dp), covers)?;
    }
    Ok(())
}

/// Rank 0, once every rank wrote its files: composes `shards.json` from their pieces (`place`
/// gives the run's sizes).
pub fn write_layout(tmp: &Path, place: ShardedRank) -> Result<()> {
    let (tp_size, pp_size, dp_size) = (place.mesh.tp, place.mesh.pp, place.mesh.dp);
    let stage = |pp: usize| (pp_size > 1).then_some(pp);
    let read = |name: String| -> Result<Vec<u8>> {
        let p = tmp.join(&name);
        let bytes = std::fs::read(&p).map_err(|e| KilnError::io(&p, e))?;
        std::fs::remove_file(&p).map_err(|e| KilnError::io(&p, e))?;
        Ok(bytes)
    };
    fn parse<T: serde::de::DeserializeOwned>(tmp: &Path, name: &str, bytes: &[u8]) -> Result<T> {
        serde_json::from_slice(bytes)
            .map_err(|e| KilnError::Checkpoint(format!("{}: {e}", tmp.join(name).display())))
    }
    let mut params: BTreeMap<String, ParamLayout> = BTreeMap::new();
    for tp in 0..tp_size {
        for pp in 0..pp_size {
            let name = cuts_file(tp, stage(pp));
            let cuts: RankCuts = parse(tmp, &name, &read(name.clone())?)?;
            for (param, (shape, cut)) in cuts.params {
                let entry = params.entry(param.clone()).or_insert_with(|| ParamLayout {
                    shape,
                    ranks: vec![None; tp_size],
                    stage: pp,
                });
                if entry.stage != pp {
                    return Err(KilnError::Checkpoint(format!(
                        "{}: pipeline stages {} and {pp} both saved {param}",
                        tmp.display(),
                        entry.stage
                    )));
                }
                entry.ranks[tp] = cut;
            }
        }
    }
    let files = if place.zero { dp_size } else { 1 };
    let mut optimizer = Vec::with_capacity(tp_size);
    for tp in 0..tp_size {
        let mut per_dp = Vec::with_capacity(files);
        for dp in 0..files {
            // Each stage covers its own parameters: one map over the stages.
            let mut covers: BTreeMap<String, Range<usize>> = BTreeMap::new();
            for pp in 0..pp_size {
                let name = covers_file(tp, stage(pp), dp);
                let part: BTreeMap<String, Range<usize>> = parse(tmp, &name, &read(name.clone())?)?;
                covers.extend(part);
            }
            per_dp.push(covers);
        }
        optimizer.push(per_dp);
    }
    let layout = ShardLayout {
        tensor_parallel_size: tp_size,
        pipeline_parallel_size: pp_size,
        data_parallel_size: dp_size,
        zero_1: place.zero,
        params,
        optimizer,
        coalesced_qkv: false,
    };
    write_json_file(tmp, LAYOUT_FILE, &layout)
}

/// Optimizer state slots not shaped like their parameter (Adafactor's factored second moment);
/// every other slot (AdamW's and Lion's `exp_avg`, `exp_avg_sq`, SGD's `momentum_buffer`) is.
const FACTORED_SLOTS: [&str; 2] = ["exp_avg_sq_row", "exp_avg_sq_col"];

/// What a rank resumes from: its model shard and its moments (with the values they cover).
pub struct RankState {
    pub model: BTreeMap<String, HostTensor>,
    pub moments: BTreeMap<String, HostTensor>,
    pub covers: BTreeMap<String, Range<usize>>,
}

/// This rank's part of checkpoint `dir` (sharded at any layout, or plain): `splits` are its
/// tensor-parallel cuts (`None` without tensor parallelism), `shapes` its parameters' local shapes.
pub fn read_rank_state(
    dir: &Path,
    place: ShardedRank,
    splits: Option<&BTreeMap<String, ParamSplit>>,
    shapes: &BTreeMap<String, Vec<usize>>,
) -> Result<RankState> {
    let split = |name: &str| splits.and_then(|s| s.get(name));
    let layout = read_layout(dir)?;
    let same_cuts = layout.as_ref().is_some_and(|l| {
        l.same_cut(place.at.tp, place.mesh.tp, |name| {
            split(name).cloned().unwrap_or(ParamSplit::Replicated)
        })
    });
    // Only the parameters this rank trains are read (a pipeline stage's own).
    let wanted = |name: &str| shapes.contains_key(name);
    let (model, moments) = match &layout {
        // The same tensor-parallel layout: this rank's own files only.
        Some(l) if same_cuts => (
            read_rank_model_where(dir, l, place.at.tp, &wanted)?,
            read_rank_optimizer_where(dir, l, place.at.tp, &wanted)?,
        ),
        _ => {
            let (whole, moments) = match &layout {
                Some(l) => (
                    read_whole_model_where(dir, l, &wanted)?,
                    read_whole_optimizer_where(dir, l, &wanted)?,
                ),
                None => {
                    // save_only_model checkpoints have no optimizer file: resuming refuses them.
                    let opt = dir.join("optimizer.safetensors");
                    let moments = if opt.exists() {
                        read_safetensors_with(&opt, &moments_of(&wanted), &mut |_, t| t)?
                    } else {
                        BTreeMap::new()
                    };
                    let mut whole = super::folder::read_model_tensors_where(dir, &wanted)?;
                    whole.retain(|n, _| wanted(n));
                    (whole, moments)
                }
            };
            // A tensor of another shape than this model's stays whole: loading names it. Each
            // whole tensor goes as soon as this rank's cut of it is taken.
            let local = |name: &str, t: HostTensor| match split(name) {
                Some(sp) => cut_split(&t, sp).unwrap_or(t),
                None => t,
            };
            let mut cut_moments = BTreeMap::new();
            for (key, m) in moments {
                let (name, slot) = key.rsplit_once('.').unwrap_or((key.as_str(), ""));
                if FACTORED_SLOTS.contains(&slot) {
                    // Adafactor's row and column statistics are not shaped like the parameter.
                    cut_moments.insert(key, m);
                    continue;
                }
                let Some(w) = whole.get(name) else { continue };
                if m.data.len() != w.data.len() {
                    return Err(KilnError::Checkpoint(format!(
                        "{}: {key} has {} values, {name} has {}",
                        dir.display(),
                        m.data.len(),
                        w.data.len()
                    )));
                }
                // A plain checkpoint keeps moments flat: they take their parameter's shape.
                let m = HostTensor {
                    shape: w.shape.clone(),
                    data: m.data,
                };
                let m = local(name, m);
                cut_moments.insert(key, m);
            }
            let model = whole
                .into_iter()
                .map(|(n, t)| {
                    let t = local(&n, t);
                    (n, t)
                })
                .collect();
            (model, cut_moments)
        }
    };
    owned_moments(dir, place, shapes, model, &moments)
}

/// This rank's state: `model`, and the moments it updates from `moments` (this rank's
/// tensor-parallel cut): under ZeRO-1 its data-parallel rank's range of each parameter, else all
/// of them, with the range each covers; Adafactor's factored statistics checked against the
/// parameter's shape.
fn owned_moments(
    dir: &Path,
    place: ShardedRank,
    shapes: &BTreeMap<String, Vec<usize>>,
    model: BTreeMap<String, HostTensor>,
    moments: &BTreeMap<String, HostTensor>,
) -> Result<RankState> {
    // ZeRO-1: keep the moments of the values this data-parallel rank updates.
    let partition = (place.zero && place.mesh.dp > 1).then(|| {
        ZeroPartition::new(
            shapes.iter().map(|(p, s)| (p.as_str(), s.iter().product())),
            place.at.dp,
            place.mesh.dp,
        )
    });
    let mut covers = BTreeMap::new();
    let mut kept = BTreeMap::new();
    let owned: BTreeMap<String, Range<usize>> = match &partition {
        Some(p) => p.owned().into_iter().map(|s| (s.path, s.within)).collect(),
        None => shapes
            .iter()
            .map(|(p, s)| (p.clone(), 0..s.iter().product()))
            .collect(),
    };
    for (key, m) in moments {
        let Some((path, slot)) = key
            .rsplit_once('.')
            .filter(|(_, slot)| FACTORED_SLOTS.contains(slot))
        else {
            continue;
        };
        if partition.is_some() {
            return Err(KilnError::Checkpoint(format!(
                "{}: {key} is Adafactor state, which ZeRO-1 does not split",
                dir.display()
            )));
        }
        // A row statistic has one value per row of the last two dimensions, a column one per
        // column: checked here, so a checkpoint of another model is a sentence, not a panic.
        let needed = shapes.get(path).filter(|d| d.len() >= 2).map(|d| {
            let n: usize = d.iter().product();
            n / d[d.len() - if slot == "exp_avg_sq_row" { 1 } else { 2 }].max(1)
        });
        if needed != Some(m.data.len()) {
            return Err(KilnError::Checkpoint(format!(
                "{}: {key} has {} values; this model's {path} has shape {:?}",
                dir.display(),
                m.data.len(),
                shapes.get(path)
            )));
        }
        kept.insert(key.clone(), m.clone());
    }
    for (path, within) in owned {
        for moment in ["exp_avg", "exp_avg_sq", "momentum_buffer"] {
            let key = format!("{path}.{moment}");
            if let Some(m) = moments.get(&key) {
                let Some(data) = m.data.get(within.clone()).map(<[f32]>::to_vec) else {
                    return Err(KilnError::Checkpoint(format!(
                        "{}: {key} has {} values; this model's {path} needs {}",
                        dir.display(),
                        m.data.len(),
                        shapes[&path].iter().product::<usize>()
                    )));
                };
                kept.insert(
                    key,
                    HostTensor {
                        shape: vec![data.len()],
                        data,
                    },
                );
                covers.insert(path.clone(), within.clone());
            }
        }
    }
    Ok(RankState {
        model,
        moments: kept,
        covers,
    })
}
