//! Sharded model and optimizer files: what a tensor-parallel (and ZeRO-1) run saves per rank, and
//! the self-describing layout that lets any tool put them back together or cut them again.
//!
//! A sharded folder holds, beside the usual `config.json` / tokenizer files:
//! - `model/tp_rank_NN.safetensors`: tensor-parallel rank NN's parameters, Hugging Face names,
//!   local shapes (NxD's `model/dp_rank_00_tp_rank_NN_pp_rank_00.pt`, in safetensors);
//! - `optimizer/tp_rank_NN_dp_rank_MM.safetensors`: AdamW's `<name>.exp_avg` / `.exp_avg_sq` of
//!   the values data-parallel rank MM updates (all of the shard without ZeRO-1, one file per TP
//!   rank; a contiguous part of each with ZeRO-1);
//! - `shards.json` ([`ShardLayout`]): every parameter's whole shape, how each TP rank holds it,
//!   which pipeline stage holds it, and which values of it each optimizer file covers.
//!
//! Under pipeline parallelism every stage writes its own parameters' files, the PP rank in their
//! names (`model/tp_rank_NN_pp_rank_SS.safetensors`,
//! `optimizer/tp_rank_NN_pp_rank_SS_dp_rank_MM.safetensors`); a tied embedding is stored once, by
//! stage 0. Without a pipeline the names stay as above.
//!
//! The functions here are pure: cutting a whole tensor for a rank, and putting every rank's
//! pieces back (replicas checked equal, never one picked silently).

use std::collections::BTreeMap;
use std::ops::Range;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::contract::ParamSplit;
use crate::formats::safetensors::{keep_all, read_safetensors_with, HostTensor, Keep};
use crate::{KilnError, Result};

/// The layout file of a sharded folder.
pub const LAYOUT_FILE: &str = "shards.json";

/// The name part of tensor-parallel rank `tp` and pipeline stage `pp` (`None`: no pipeline).
fn rank_name(tp: usize, pp: Option<usize>) -> String {
    match pp {
        Some(pp) => format!("tp_rank_{tp:02}_pp_rank_{pp:02}"),
        None => format!("tp_rank_{tp:02}"),
    }
}

/// Tensor-parallel rank `tp`'s model file (of pipeline stage `pp` under a pipeline).
pub fn model_file(tp: usize, pp: Option<usize>) -> String {
    format!("model/{}.safetensors", rank_name(tp, pp))
}

/// The optimizer file of tensor-parallel rank `tp`, pipeline stage `pp` (`None`: no pipeline)
/// and data-parallel rank `dp`.
pub fn optimizer_file(tp: usize, pp: Option<usize>, dp: usize) -> String {
    format!(
        "optimizer/{}_dp_rank_{dp:02}.safetensors",
        rank_name(tp, pp)
    )
}

/// How one tensor-parallel rank holds a parameter: rows/columns `range` of dimension `axis`, or
/// (`None`) the whole tensor.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Cut {
    pub axis: usize,
    pub range: Range<usize>,
}

impl Cut {
    /// The cut a [`ParamSplit`] makes (`None`: the whole tensor).
    pub fn of(split: Option<&ParamSplit>) -> Option<Self> {
        match split {
            Some(ParamSplit::Sharded { axis, range, .. }) => Some(Self {
                axis: *axis,
                range: range.clone(),
            }),
            _ => None,
        }
    }
}

/// One parameter of a sharded folder.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ParamLayout {
    /// The whole tensor's shape.
    pub shape: Vec<usize>,
    /// Per tensor-parallel rank: its cut, or `None` for a whole copy.
    pub ranks: Vec<Option<Cut>>,
    /// The pipeline stage whose files hold it (0 without a pipeline).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub stage: usize,
}

fn is_zero(n: &usize) -> bool {
    *n == 0
}

fn is_one(n: &usize) -> bool {
    *n == 1
}

fn one() -> usize {
    1
}

impl ParamLayout {
    /// Rank `tp`'s local shape.
    pub fn local_shape(&self, tp: usize) -> Vec<usize> {
        let mut shape = self.shape.clone();
        if let Some(c) = &self.ranks[tp] {
            shape[c.axis] = c.range.len();
        }
        shape
    }
}

/// `shards.json`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShardLayout {
    pub tensor_parallel_size: usize,
    /// The number of pipeline stages whose files hold the parameters (1: no pipeline).
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub pipeline_parallel_size: usize,
    /// The data-parallel size of the run that wrote the optimizer files.
    pub data_parallel_size: usize,
    pub zero_1: bool,
    pub params: BTreeMap<String, ParamLayout>,
    /// Per tensor-parallel rank, per optimizer file (data-parallel rank): the values of each
    /// parameter's flat local shard that file's moments cover. Empty when no optimizer was saved.
    #[serde(default)]
    pub optimizer: Vec<Vec<BTreeMap<String, Range<usize>>>>,
    /// Whether the model files hold attention's q/k/v as one `qkv_proj` per layer (NxD's fused
    /// layout: the rank's q rows, then its k rows, then its v rows); `params` still describes
    /// q_proj, k_proj and v_proj.
    #[serde(default)]
    pub coalesced_qkv: bool,
}

impl ShardLayout {
    /// The layout of `tp` ranks whose cuts `splits[r]` (every rank's [`ParamSplit`] by name) of
    /// whole shapes `shapes` describe, stored with q/k/v fused when `coalesced_qkv`.
    pub fn from_splits(
        shapes: &BTreeMap<String, Vec<usize>>,
        splits: &[BTreeMap<String, ParamSplit>],
        coalesced_qkv: bool,
    ) -> Result<Self> {
        let mut params = BTreeMap::new();
        for (name, shape) in shapes {
            let ranks = splits
                .iter()
                .map(|s| match s.get(name) {
                    Some(ParamSplit::Sharded { axis, full, .. })
                        if shape.get(*axis) != Some(full) =>
                    {
                        Err(KilnError::Weights(format!(
                            "{name}: config.json makes dimension {axis} {full} long, the tensor \
                             has shape {shape:?}; the tensors decide, so correct config.json \
                             (vocab_size, intermediate_size, num_attention_heads, \
                             num_key_value_heads, head_dim)"
                        )))
                    }
                    Some(ParamSplit::Sharded { axis, range, .. }) => Ok(Some(Cut {
                        axis: *axis,
                        range: range.clone(),
                    })),
                    Some(ParamSplit::Replicated) => Ok(None),
                    None => Err(KilnError::Weights(format!(
                        "{name}: no tensor-parallel split is known for it"
                    ))),
                })
                .collect::<Result<_>>()?;
            params.insert(
                name.clone(),
                ParamLayout {
                    shape: shape.clone(),
                    ranks,
                    stage: 0,
                },
            );
        }
        let layout = Self {
            tensor_parallel_size: splits.len(),
            pipeline_parallel_size: 1,
            data_parallel_size: 1,
            zero_1: false,
            params,
            optimizer: Vec::new(),
            coalesced_qkv,
        };
        layout.check().map_err(KilnError::Weights)?;
        Ok(layout)
    }

    /// Puts every parameter on the pipeline stage `stage_of` names, of `stages`.
    pub fn with_stages(mut self, stages: usize, stage_of: impl Fn(&str) -> usize) -> Result<Self> {
        self.pipeline_parallel_size = stages;
        for (name, p) in self.params.iter_mut() {
            p.stage = stage_of(name);
        }
        self.check().map_err(KilnError::Weights)?;
        Ok(self)
    }

    /// The stage part of a file name: `None` without a pipeline.
    fn stage_name(&self, stage: usize) -> Option<usize> {
        (self.pipeline_parallel_size > 1).then_some(stage)
    }

    /// Tensor-parallel rank `tp`'s model file of pipeline stage `stage`.
    pub fn model_file(&self, tp: usize, stage: usize) -> String {
        model_file(tp, self.stage_name(stage))
    }

    /// The optimizer file of tensor-parallel rank `tp`, stage `stage`, data-parallel rank `dp`.
    pub fn optimizer_file(&self, tp: usize, stage: usize, dp: usize) -> String {
        optimizer_file(tp, self.stage_name(stage), dp)
    }

    /// Whether tensor-parallel rank `tp` of a `size`-rank split cutting parameters as `split`
    /// says holds exactly this folder's model files of rank `tp` (then nothing else need be read).
    pub fn same_cut(&self, tp: usize, size: usize, split: impl Fn(&str) -> ParamSplit) -> bool {
        !self.coalesced_qkv
            && self.tensor_parallel_size == size
            && self
                .params
                .iter()
                .all(|(name, p)| p.ranks[tp] == Cut::of(Some(&split(name))))
    }

    fn param(&self, name: &str) -> Result<&ParamLayout> {
        self.params.get(name).ok_or_else(|| {
            KilnError::Weights(format!("{name}: not in the sharded layout ({LAYOUT_FILE})"))
        })
    }

    /// Rank `tp`'s piece of the whole tensor `name`.
    pub fn cut(&self, name: &str, tp: usize, whole: &HostTensor) -> Result<HostTensor> {
        let p = self.param(name)?;
        if whole.shape != p.shape {
            return Err(KilnError::Weights(format!(
                "{name}: shape {:?}, the layout says {:?}",
                whole.shape, p.shape
            )));
        }
        Ok(match &p.ranks[tp] {
            None => whole.clone(),
            Some(c) => cut_axis(whole, c.axis, &c.range),
        })
    }

    /// The whole tensor `name` from every rank's piece (in rank order). Whole copies must be
    /// equal on every rank: replicas that drifted apart are an error naming the parameter.
    pub fn join(&self, name: &str, pieces: &[&HostTensor]) -> Result<HostTensor> {
        let p = self.param(name)?;
        if pieces.len() != p.ranks.len() {
            return Err(KilnError::Weights(format!(
                "{name}: {} pieces for {} tensor-parallel ranks",
                pieces.len(),
                p.ranks.len()
            )));
        }
        // Every piece is checked before the whole is allocated: its size then comes from data
        // that was read, never from the layout alone.
        for (tp, piece) in pieces.iter().enumerate() {
            let expect = p.local_shape(tp);
            if piece.shape != expect || piece.data.len() != expect.iter().product::<usize>() {
                return Err(KilnError::Weights(format!(
                    "{name}: tensor-parallel rank {tp} holds shape {:?}, the layout says {expect:?}",
                    piece.shape
                )));
            }
        }
        let mut out = HostTensor {
            shape: p.shape.clone(),
            data: vec![0.0; p.shape.iter().product()],
        };
        let mut copy: Option<&HostTensor> = None;
        for (tp, piece) in pieces.iter().enumerate() {
            match &p.ranks[tp] {
                Some(c) => place_axis(&mut out.data, piece, c.axis, &c.range, p.shape[c.axis]),
                None => match copy {
                    Some(first) if first.data != piece.data => {
                        return Err(KilnError::Weights(format!(
                            "{name}: its copies on tensor-parallel ranks 0 and {tp} differ; a \
                             replicated parameter must be equal on every rank"
                        )))
                    }
                    Some(_) => {}
                    None => {
                        copy = Some(piece);
                        out.data.clone_from(&piece.data);
                    }
                },
            }
        }
        // Rows held by several ranks (repeated key/value heads) must be the same on each.
        for (tp, piece) in pieces.iter().enumerate() {
            if let Some(c) = p.ranks[tp].as_ref().filter(|_| repeats_heads(self, name)) {
                if cut_axis(&out, c.axis, &c.range).data != piece.data {
                    return Err(KilnError::Weights(format!(
                        "{name}: the rows tensor-parallel rank {tp} shares with another rank \
                         differ; repeated key/value heads must be equal on every rank"
                    )));
                }
            }
        }
        Ok(out)
    }
}

const QKV: [&str; 3] = ["q_proj", "k_proj", "v_proj"];

/// NxD's fused attention input: every layer's `q_proj`, `k_proj`, `v_proj` (weight and bias)
/// of one rank's tensors stacked by rows into `qkv_proj`.
pub fn coalesce_qkv(mut t: BTreeMap<String, HostTensor>) -> BTreeMap<String, HostTensor> {
    let queries: Vec<String> = t
        .keys()
        .filter(|k| k.contains(".q_proj."))
        .cloned()
        .collect();
    for q in queries {
        let parts: Vec<HostTensor> = QKV
            .iter()
            .filter_map(|p| t.remove(&q.replace("q_proj", p)))
            .collect();
        let mut shape = parts[0].shape.clone();
        shape[0] = parts.iter().map(|p| p.shape[0]).sum();
        let data = parts.into_iter().flat_map(|p| p.data).collect();
        t.insert(q.replace("q_proj", "qkv_proj"), HostTensor { shape, data });
    }
    t
}

/// [`coalesce_qkv`] undone for rank `tp`: each fused tensor cut back into q, k and v by the row
/// counts the layout gives them.
fn split_qkv(
    layout: &ShardLayout,
    tp: usize,
    mut t: BTreeMap<String, HostTensor>,
) -> Result<BTreeMap<String, HostTensor>> {
    let fused: Vec<String> = t
        .keys()
        .filter(|k| k.contains(".qkv_proj."))
        .cloned()
        .collect();
    for name in fused {
        let whole = t.remove(&name).expect("listed");
        if whole.shape.is_empty() {
            return Err(KilnError::Weights(format!(
                "{name}: a fused q/k/v tensor needs rows, it has shape []"
            )));
        }
        let inner: usize = whole.shape[1..].iter().product();
        let mut at = 0;
        for p in QKV {
            let part = name.replace("qkv_proj", p);
            let shape = layout.param(&part)?.local_shape(tp);
            let n = shape.iter().product::<usize>();
            let row: usize = shape.iter().skip(1).product();
            if at + n > whole.data.len() || row != inner {
                return Err(KilnError::Weights(format!(
                    "{name}: shape {:?} does not hold the layout's q/k/v rows for rank {tp}",
                    whole.shape
                )));
            }
            let data = whole.data[at..at + n].to_vec();
            at += n;
            t.insert(part, HostTensor { shape, data });
        }
    }
    Ok(t)
}

/// Rank's piece of the whole tensor `t` by `split`, or `None` when `t` is not the whole tensor
/// the split cuts (too few dimensions, or another size on the split axis): the caller then keeps
/// it whole, and loading names the shape mismatch in a sentence.
pub fn cut_split(t: &HostTensor, split: &ParamSplit) -> Option<HostTensor> {
    match split {
        ParamSplit::Replicated => Some(t.clone()),
        ParamSplit::Sharded { axis, range, full } => (t.shape.get(*axis) == Some(full)
            && range.end <= *full)
            .then(|| cut_axis(t, *axis, range)),
    }
}

/// Values `range` of dimension `axis` of `t`.
pub fn cut_axis(t: &HostTensor, axis: usize, range: &Range<usize>) -> HostTensor {
    let full = t.shape[axis];
    let inner: usize = t.shape[axis + 1..].iter().product();
    let outer: usize = t.shape[..axis].iter().product();
    let mut data = Vec::with_capacity(outer * range.len() * inner);
    for o in 0..outer {
        let start = (o * full + range.start) * inner;
        data.extend_from_slice(&t.data[start..start + range.len() * inner]);
    }
    let mut shape = t.shape.clone();
    shape[axis] = range.len();
    HostTensor { shape, data }
}

/// Writes `piece` (values `range` of dimension `axis`, whose whole size is `full`) into the
/// whole tensor's values `whole`.
pub fn place_axis(
    whole: &mut [f32],
    piece: &HostTensor,
    axis: usize,
    range: &Range<usize>,
    full: usize,
) {
    let inner: usize = piece.shape[axis + 1..].iter().product();
    let outer: usize = piece.shape[..axis].iter().product();
    let n = range.len() * inner;
    for o in 0..outer {
        let dst = (o * full + range.start) * inner;
        whole[dst..dst + n].copy_from_slice(&piece.data[o * n..(o + 1) * n]);
    }
}

/// The most bytes one tensor may describe: shapes from a file are multiplied with checked
/// arithmetic and must stay below what one allocation can hold.
const MAX_TENSOR_BYTES: usize = isize::MAX as usize;

/// The number of values of `shape`, or `None` when it overflows or exceeds [`MAX_TENSOR_BYTES`]
/// as f32.
pub fn checked_numel(shape: &[usize]) -> Option<usize> {
    shape
        .iter()
        .try_fold(1usize, |n, &d| n.checked_mul(d))
        .filter(|n| n.checked_mul(4).is_some_and(|b| b <= MAX_TENSOR_BYTES))
}

/// Whether `ranges` cover `0..n` exactly once (any order; empty ranges allowed), or, with
/// `overlap`, at least once.
fn tiles(ranges: &[&Range<usize>], n: usize, overlap: bool) -> bool {
    let mut sorted: Vec<&Range<usize>> = ranges.iter().copied().filter(|r| !r.is_empty()).collect();
    sorted.sort_by_key(|r| r.start);
    let mut at = 0;
    for r in sorted {
        let joins = if overlap {
            r.start <= at
        } else {
            r.start == at
        };
        if !joins || r.end > n {
            return false;
        }
        at = at.max(r.end);
    }
    at == n
}

/// Whether `name` is a key/value projection NxD's fused layout holds per rank as the heads its
/// queries read: with fewer key/value heads than ranks, those rows repeat on several ranks.
fn repeats_heads(layout: &ShardLayout, name: &str) -> bool {
    layout.coalesced_qkv && (name.contains(".k_proj.") || name.contains(".v_proj."))
}

impl ShardLayout {
    /// What `shards.json` must hold to put a model and its moments back without a gap or an
    /// overlap: every shape countable, every sharded tensor's cuts (one axis) tiling that axis
    /// exactly once, replicated tensors whole on every rank, and each rank's optimizer files
    /// covering every parameter's local values exactly once (or not at all: no gradient yet).
    pub fn check(&self) -> std::result::Result<(), String> {
        let tp = self.tensor_parallel_size;
        if tp == 0 {
            return Err("tensor_parallel_size must be at least 1".into());
        }
        if self.data_parallel_size == 0 {
            return Err("data_parallel_size must be at least 1".into());
        }
        if self.pipeline_parallel_size == 0 {
            return Err("pipeline_parallel_size must be at least 1".into());
        }
        for (name, p) in &self.params {
            if p.stage >= self.pipeline_parallel_size {
                return Err(format!(
                    "{name}: stage {} of pipeline_parallel_size {}",
                    p.stage, self.pipeline_parallel_size
                ));
            }
            if checked_numel(&p.shape).is_none() {
                return Err(format!(
                    "{name}: shape {:?} holds more values than memory can",
                    p.shape
                ));
            }
            if p.ranks.len() != tp {
                return Err(format!(
                    "{name}: {} ranks listed for tensor_parallel_size {tp}",
                    p.ranks.len()
                ));
            }
            let cuts: Vec<&Cut> = p.ranks.iter().flatten().collect();
            if cuts.is_empty() {
                continue;
            }
            let axis = cuts[0].axis;
            if cuts.len() != tp || cuts.iter().any(|c| c.axis != axis) || axis >= p.shape.len() {
                return Err(format!(
                    "{name}: a sharded tensor needs one cut per rank along one axis of shape \
                     {:?}, the layout lists {:?}",
                    p.shape, p.ranks
                ));
            }
            let ranges: Vec<&Range<usize>> = cuts.iter().map(|c| &c.range).collect();
            if !tiles(&ranges, p.shape[axis], repeats_heads(self, name)) {
                return Err(format!(
                    "{name}: the cuts {ranges:?} of dimension {axis} do not cover 0..{} exactly \
                     once",
                    p.shape[axis]
                ));
            }
        }
        // Every stage holds at least one parameter: the size is bounded by the parameters.
        let held: std::collections::BTreeSet<usize> =
            self.params.values().map(|p| p.stage).collect();
        if self.pipeline_parallel_size > 1 && held.len() != self.pipeline_parallel_size {
            return Err(format!(
                "pipeline_parallel_size is {}, but the parameters are on {} stages; every stage \
                 holds at least one",
                self.pipeline_parallel_size,
                held.len()
            ));
        }
        if self.optimizer.is_empty() {
            return Ok(());
        }
        if self.optimizer.len() != tp {
            return Err(format!(
                "optimizer lists {} tensor-parallel ranks for tensor_parallel_size {tp}",
                self.optimizer.len()
            ));
        }
        for (rank, files) in self.optimizer.iter().enumerate() {
            for name in files.iter().flat_map(|f| f.keys()) {
                if !self.params.contains_key(name) {
                    return Err(format!(
                        "optimizer of tensor-parallel rank {rank}: {name} is not a parameter of \
                         the layout"
                    ));
                }
            }
            for (name, p) in &self.params {
                let n = checked_numel(&p.local_shape(rank)).unwrap_or(usize::MAX);
                let ranges: Vec<&Range<usize>> = files.iter().filter_map(|f| f.get(name)).collect();
                if !ranges.is_empty() && !tiles(&ranges, n, false) {
                    return Err(format!(
                        "{name}: the optimizer files of tensor-parallel rank {rank} cover values \
                         {ranges:?}, not 0..{n} exactly once"
                    ));
                }
            }
        }
        Ok(())
    }
}

/// Reads `shards.json` of a sharded folder, or `None` when `dir` is not sharded. Its coverage is
/// checked ([`ShardLayout::check`]) before anything trusts it.
pub fn read_layout(dir: &Path) -> Result<Option<ShardLayout>> {
    let path = dir.join(LAYOUT_FILE);
    if !path.exists() {
        return Ok(None);
    }
    let layout: ShardLayout = crate::io::read_json(&path)?;
    layout
        .check()
        .map_err(|msg| KilnError::Config(format!("{}: {msg}", path.display())))?;
    Ok(Some(layout))
}

/// Tensor-parallel rank `tp`'s parameters of a sharded folder (every stage's file of it, put
/// side by side). Each file must hold exactly its stage's parameters.
pub fn read_rank_model(
    dir: &Path,
    layout: &ShardLayout,
    tp: usize,
) -> Result<BTreeMap<String, HostTensor>> {
    read_rank_model_where(dir, layout, tp, &keep_all)
}

/// [`read_rank_model`] of the parameters `wanted` names only: a stage file holding none of them
/// is not opened (a pipeline stage reads its own).
pub fn read_rank_model_where(
    dir: &Path,
    layout: &ShardLayout,
    tp: usize,
    wanted: Keep,
) -> Result<BTreeMap<String, HostTensor>> {
    let mut out = BTreeMap::new();
    for stage in 0..layout.pipeline_parallel_size {
        let listed = layout
            .params
            .iter()
            .any(|(n, p)| p.stage == stage && wanted(n));
        if !listed {
            continue;
        }
        let file = dir.join(layout.model_file(tp, stage));
        // q/k/v fused in one tensor are read whole and split (their names are not the file's).
        let names = |n: &str| layout.coalesced_qkv || wanted(n);
        let mut t = read_safetensors_with(&file, &names, &mut |_, t| t)?;
        if layout.coalesced_qkv {
            t = split_qkv(layout, tp, t)?;
        }
        // A tensor the layout does not list (or lists on another stage) would be dropped from
        // the whole model unseen, or taken twice.
        for name in t.keys() {
            match layout.params.get(name) {
                None => {
                    return Err(KilnError::Weights(format!(
                        "{}: holds {name}, which {LAYOUT_FILE} does not list",
                        file.display()
                    )))
                }
                Some(p) if p.stage != stage => {
                    return Err(KilnError::Weights(format!(
                        "{}: holds {name}, which {LAYOUT_FILE} puts on pipeline stage {}",
                        file.display(),
                        p.stage
                    )))
                }
                Some(_) => {}
            }
        }
        t.retain(|n, _| wanted(n));
        out.append(&mut t);
    }
    for (name, p) in layout.params.iter().filter(|(n, _)| wanted(n)) {
        if !out.contains_key(name) {
            return Err(KilnError::Weights(format!(
                "{}: lacks {name}",
                dir.join(layout.model_file(tp, p.stage)).display()
            )));
        }
    }
    Ok(out)
}

/// The whole model of a sharded folder.
pub fn read_whole_model(dir: &Path, layout: &ShardLayout) -> Result<BTreeMap<String, HostTensor>> {
    read_whole_model_where(dir, layout, &keep_all)
}

/// [`read_whole_model`]'s parameters that `wanted` names.
pub fn read_whole_model_where(
    dir: &Path,
    layout: &ShardLayout,
    wanted: Keep,
) -> Result<BTreeMap<String, HostTensor>> {
    let mut ranks = (0..layout.tensor_parallel_size)
        .map(|tp| read_rank_model_where(dir, layout, tp, wanted))
        .collect::<Result<Vec<_>>>()?;
    // Shards of more ranks or stages than the layout names: its sizes are not the folder's.
    let (tp, pp) = (layout.tensor_parallel_size, layout.pipeline_parallel_size);
    let beyond = [
        (layout.model_file(tp, 0), "tensor_parallel_size", tp),
        (model_file(0, Some(pp)), "pipeline_parallel_size", pp),
    ];
    for (next, field, n) in beyond {
        let next = dir.join(next);
        if next.exists() {
            return Err(KilnError::Weights(format!(
                "{}: {LAYOUT_FILE} says {field} {n}, but {} exists",
                dir.display(),
                next.display()
            )));
        }
    }
    let mut out = BTreeMap::new();
    // Each tensor's pieces go as soon as it is put together: the model is held once, not twice.
    for name in layout.params.keys().filter(|n| wanted(n)) {
        let pieces = ranks
            .iter_mut()
            .map(|r| r.remove(name).expect("read_rank_model checked every name"))
            .collect::<Vec<_>>();
        out.insert(
            name.clone(),
            layout.join(name, &pieces.iter().collect::<Vec<_>>())?,
        );
    }
    Ok(out)
}

/// The moments of tensor-parallel rank `tp`'s whole shard (`<name>.exp_avg` / `.exp_avg_sq`, in
/// local shapes), put together from its optimizer files.
pub fn read_rank_optimizer(
    dir: &Path,
    layout: &ShardLayout,
    tp: usize,
) -> Result<BTreeMap<String, HostTensor>> {
    read_rank_optimizer_where(dir, layout, tp, &keep_all)
}

/// [`read_rank_optimizer`]'s moments of the parameters `wanted` names only (a file holding none
/// of them is not opened).
pub fn read_rank_optimizer_where(
    dir: &Path,
    layout: &ShardLayout,
    tp: usize,
    wanted: Keep,
) -> Result<BTreeMap<String, HostTensor>> {
    let files = layout.optimizer.get(tp).ok_or_else(|| {
        KilnError::Checkpoint(format!(
            "{}: {LAYOUT_FILE} lists no optimizer files for tensor-parallel rank {tp}",
            dir.display()
        ))
    })?;
    // Per data-parallel file, per stage: a stage's file holds its own parameters' moments.
    let mut parts = (0..files.len())
        .map(|dp| {
            (0..layout.pipeline_parallel_size)
                .map(|s| {
                    let listed = layout
                        .params
                        .iter()
                        .any(|(n, p)| p.stage == s && files[dp].contains_key(n) && wanted(n));
                    if listed {
                        let file = dir.join(layout.optimizer_file(tp, s, dp));
                        read_safetensors_with(&file, &moments_of(wanted), &mut |_, t| t)
                    } else {
                        Ok(BTreeMap::new())
                    }
                })
                .collect::<Result<Vec<_>>>()
        })
        .collect::<Result<Vec<_>>>()?;
    let mut out = BTreeMap::new();
    for (name, p) in layout.params.iter().filter(|(n, _)| wanted(n)) {
        let shape = p.local_shape(tp);
        for moment in ["exp_avg", "exp_avg_sq"] {
            let key = format!("{name}.{moment}");
            // Each file's piece is checked against its range before anything is allocated; the
            // ranges tile the local values exactly once (`ShardLayout::check`).
            let mut pieces = Vec::new();
            // Each piece is taken out of what was read: the moments are held once, not twice.
            for (dp, (ranges, tensors)) in files.iter().zip(&mut parts).enumerate() {
                let Some(r) = ranges.get(name) else { continue };
                let tensors = &mut tensors[p.stage];
                let Some(t) = tensors.remove(&key).filter(|t| t.data.len() == r.len()) else {
                    return Err(KilnError::Checkpoint(format!(
                        "{}: lacks {key} over values {r:?}",
                        dir.join(layout.optimizer_file(tp, p.stage, dp)).display()
                    )));
                };
                pieces.push((r.clone(), t));
            }
            if pieces.is_empty() {
                // A parameter that never had a gradient has no moments.
                continue;
            }
            let n: usize = pieces.iter().map(|(r, _)| r.len()).sum();
            if n != shape.iter().product::<usize>() {
                return Err(KilnError::Checkpoint(format!(
                    "{}: the optimizer files of tensor-parallel rank {tp} cover {n} of {key}'s \
                     {} values",
                    dir.display(),
                    shape.iter().product::<usize>()
                )));
            }
            let data = match pieces.len() {
                // One file covers the whole shard (no ZeRO-1): its values are the shard's.
                1 => pieces.pop().expect("one piece").1.data,
                _ => {
                    let mut data = vec![0.0; n];
                    for (r, t) in pieces {
                        data[r].copy_from_slice(&t.data);
                    }
                    data
                }
            };
            out.insert(
                key,
                HostTensor {
                    shape: shape.clone(),
                    data,
                },
            );
        }
    }
    Ok(out)
}

/// Which optimizer tensors (`<name>.<slot>`) belong to the parameters `wanted` names.
pub fn moments_of(wanted: Keep<'_>) -> impl Fn(&str) -> bool + Sync + '_ {
    move |key: &str| key.rsplit_once('.').is_some_and(|(name, _)| wanted(name))
}

/// The whole model's moments (whole shapes) of a sharded folder.
pub fn read_whole_optimizer(
    dir: &Path,
    layout: &ShardLayout,
) -> Result<BTreeMap<String, HostTensor>> {
    read_whole_optimizer_where(dir, layout, &keep_all)
}

/// [`read_whole_optimizer`]'s moments of the parameters `wanted` names.
pub fn read_whole_optimizer_where(
    dir: &Path,
    layout: &ShardLayout,
    wanted: Keep,
) -> Result<BTreeMap<String, HostTensor>> {
    let mut ranks = (0..layout.tensor_parallel_size)
        .map(|tp| read_rank_optimizer_where(dir, layout, tp, wanted))
        .collect::<Result<Vec<_>>>()?;
    let mut out = BTreeMap::new();
    let keys: Vec<String> = ranks[0].keys().cloned().collect();
    for key in &keys {
        let name = key
            .rsplit_once('.')
            .map(|(n, _)| n)
            .expect("moment keys end in .exp_avg or .exp_avg_sq");
        let pieces = ranks
            .iter_mut()
            .map(|r| {
                r.remove(key).ok_or_else(|| {
                    KilnError::Checkpoint(format!(
                        "{}: {key} is missing on some rank",
                        dir.display()
                    ))
                })
            })
            .collect::<Result<Vec<_>>>()?;
        out.insert(
            key.clone(),
            layout.join(name, &pieces.iter().collect::<Vec<_>>())?,
        );
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(shape: &[usize]) -> HostTensor {
        let n: usize = shape.iter().product();
        HostTensor {
            shape: shape.to_vec(),
            data: (0..n).map(|i| i as f32).collect(),
        }
    }

    #[test]
    fn cuts_put_back_together_along_either_axis() {
        let whole = t(&[5, 3]);
        for axis in [0, 1] {
            let full = whole.shape[axis];
            let cuts = [0..2, 2..full];
            let pieces: Vec<HostTensor> = cuts.iter().map(|r| cut_axis(&whole, axis, r)).collect();
            let mut back = vec![0.0; 15];
            for (p, r) in pieces.iter().zip(&cuts) {
                place_axis(&mut back, p, axis, r, full);
            }
            assert_eq!(back, whole.data, "axis {axis}");
        }
        // Rows 2..5 of a [5, 3] tensor are its values 6..15; columns 0..2 skip every third value.
        assert_eq!(
            cut_axis(&whole, 0, &(2..5)).data,
            (6..15).map(|v| v as f32).collect::<Vec<_>>()
        );
        assert_eq!(
            cut_axis(&whole, 1, &(0..2)).data,
            vec![0., 1., 3., 4., 6., 7., 9., 10., 12., 13.]
        );
    }

    #[test]
    fn a_tensor_of_another_shape_is_not_cut() {
        let split = ParamSplit::Sharded {
            axis: 0,
            range: 2..4,
            full: 5,
        };
        assert_eq!(cut_split(&t(&[5, 3]), &split).unwrap().shape, vec![2, 3]);
        // Rows 2..4 of a 3-row or a 0-d tensor: not the tensor the split cuts.
        assert!(cut_split(&t(&[3, 3]), &split).is_none());
        assert!(cut_split(&t(&[]), &split).is_none());
    }

    #[test]
    fn replicas_that_differ_are_refused() {
        let layout = ShardLayout {
            tensor_parallel_size: 2,
            pipeline_parallel_size: 1,
            data_parallel_size: 1,
            zero_1: false,
            params: [(
                "norm".to_string(),
                ParamLayout {
                    shape: vec![3],
                    ranks: vec![None, None],
                    stage: 0,
                },
            )]
            .into(),
            optimizer: vec![],
            coalesced_qkv: false,
        };
        let a = t(&[3]);
        let mut b = a.clone();
        assert_eq!(layout.join("norm", &[&a, &b]).unwrap().data, a.data);
        b.data[1] = 7.0;
        let err = layout.join("norm", &[&a, &b]).unwrap_err().to_string();
        assert!(
            err.contains("norm: its copies on tensor-parallel ranks 0 and 1 differ"),
            "{err}"
        );
    }

    fn two_ranks(ranges: [Range<usize>; 2]) -> ShardLayout {
        ShardLayout {
            tensor_parallel_size: 2,
            pipeline_parallel_size: 1,
            data_parallel_size: 1,
            zero_1: false,
            params: [(
                "w".to_string(),
                ParamLayout {
                    shape: vec![6, 2],
                    ranks: ranges
                        .into_iter()
                        .map(|range| Some(Cut { axis: 0, range }))
                        .collect(),
                    stage: 0,
                },
            )]
            .into(),
            optimizer: vec![],
            coalesced_qkv: false,
        }
    }

    /// A pipeline stage reads the parameters it wants from the stage files that hold them and
    /// never opens another stage's file (here a broken one, which a whole read refuses).
    #[test]
    fn a_stage_reads_only_the_files_holding_its_parameters() {
        let dir = tempfile::tempdir().unwrap();
        let whole = ParamLayout {
            shape: vec![3, 2],
            ranks: vec![None, None],
            stage: 0,
        };
        let mut layout = two_ranks([0..3, 3..6]);
        layout.params.insert("norm".into(), whole.clone());
        layout.params.insert("head".into(), whole);
        let layout = layout.with_stages(2, |n| usize::from(n == "head")).unwrap();
        std::fs::create_dir_all(dir.path().join("model")).unwrap();
        for tp in 0..2 {
            let stage0: BTreeMap<String, HostTensor> = [
                ("w".to_string(), t(&[3, 2])),
                ("norm".to_string(), t(&[3, 2])),
            ]
            .into();
            let file = dir.path().join(layout.model_file(tp, 0));
            crate::formats::safetensors::write_safetensors(&file, &stage0).unwrap();
            std::fs::write(
                dir.path().join(layout.model_file(tp, 1)),
                b"not safetensors",
            )
            .unwrap();
        }
        let first = |n: &str| n != "head";
        let got = read_whole_model_where(dir.path(), &layout, &first).unwrap();
        assert_eq!(got.keys().collect::<Vec<_>>(), ["norm", "w"]);
        assert_eq!(got["w"].shape, [6, 2]);
        let only_w = |n: &str| n == "w";
        let got = read_rank_model_where(dir.path(), &layout, 1, &only_w).unwrap();
        assert_eq!(got.keys().collect::<Vec<_>>(), ["w"]);
        let err = read_whole_model(dir.path(), &layout)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("pp_rank_01") && err.contains("not a safetensors file"),
            "{err}"
        );
    }

    /// A stage outside the pipeline is refused; without a pipeline `shards.json` is written as
    /// before (no stage fields), and an old one reads as one stage.
    #[test]
    fn stages_are_checked_and_absent_without_a_pipeline() {
        let plain = two_ranks([0..3, 3..6]);
        let json = serde_json::to_string(&plain).unwrap();
        assert!(!json.contains("stage"), "{json}");
        let back: ShardLayout = serde_json::from_str(&json).unwrap();
        assert_eq!(back, plain);
        let mut two = plain.clone();
        let norm = ParamLayout {
            shape: vec![2],
            ranks: vec![None, None],
            stage: 0,
        };
        two.params.insert("norm".into(), norm);
        let piped = two.with_stages(2, |n| usize::from(n == "w")).unwrap();
        assert_eq!(
            piped.model_file(1, 1),
            "model/tp_rank_01_pp_rank_01.safetensors"
        );
        assert_eq!(
            piped.optimizer_file(0, 1, 3),
            "optimizer/tp_rank_00_pp_rank_01_dp_rank_03.safetensors"
        );
        assert_eq!(plain.model_file(1, 0), "model/tp_rank_01.safetensors");
        let err = plain.clone().with_stages(2, |_| 2).unwrap_err().to_string();
        assert!(
            err.contains("w: stage 2 of pipeline_parallel_size 2"),
            "{err}"
        );
        // A size no parameter fills (read from a hostile file) is one sentence, not a long loop.
        let err = plain.with_stages(1 << 40, |_| 0).unwrap_err().to_string();
        assert!(err.contains("but the parameters are on 1 stages"), "{err}");
    }

    #[test]
    fn cuts_must_tile_the_axis_exactly_once() {
        assert!(two_ranks([0..3, 3..6]).check().is_ok());
        assert!(two_ranks([3..6, 0..3]).check().is_ok());
        for bad in [[0..3, 0..3], [0..3, 4..6], [0..4, 3..6], [0..3, 3..7]] {
            let err = two_ranks(bad.clone()).check().unwrap_err();
            assert!(
                err.contains("do not cover 0..6 exactly once"),
                "{bad:?}: {err}"
            );
        }
        // Repeated key/value heads of NxD's fused layout may overlap, never leave a gap.
        let mut l = two_ranks([0..4, 2..6]);
        l.coalesced_qkv = true;
        l.params = [("a.k_proj.weight".to_string(), l.params["w"].clone())].into();
        assert!(l.check().is_ok());
        l.params.get_mut("a.k_proj.weight").unwrap().ranks[1] = Some(Cut {
            axis: 0,
            range: 5..6,
        });
        assert!(l.check().is_err());
    }

    #[test]
    fn optimizer_ranges_must_tile_each_shard_exactly_once() {
        let mut l = two_ranks([0..3, 3..6]);
        let files = |a: Range<usize>, b: Range<usize>| {
            vec![[("w".to_string(), a)].into(), [("w".to_string(), b)].into()]
        };
        l.optimizer = vec![files(0..4, 4..6), files(0..2, 2..6)];
        assert!(l.check().is_ok());
        l.optimizer[1] = files(0..3, 0..3);
        let err = l.check().unwrap_err();
        assert!(err.contains("rank 1 cover values"), "{err}");
        l.optimizer[1] = files(0..2, 3..6);
        assert!(l.check().is_err());
    }

    #[test]
    fn shapes_are_counted_with_checked_arithmetic() {
        assert_eq!(checked_numel(&[3, 4]), Some(12));
        assert_eq!(checked_numel(&[1 << 62, 96]), None);
        assert_eq!(checked_numel(&[usize::MAX, 2]), None);
        let mut l = two_ranks([0..3, 3..6]);
        l.params.get_mut("w").unwrap().shape = vec![6, 1 << 62];
        assert!(l
            .check()
            .unwrap_err()
            .contains("more values than memory can"));
    }
}
