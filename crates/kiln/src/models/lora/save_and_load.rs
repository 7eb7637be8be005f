//! PEFT's adapter files (as its `utils/save_and_load`): parameter names as PEFT writes them
//! (`base_model.model.<layer>.lora_A.weight`), `adapter_model.safetensors` read and checked
//! against the model, and an adapter folder loaded onto a model.

use crate::error::{KilnError, Result};
use crate::formats::safetensors::HostTensor;
use crate::ops::KilnBackend;
use burn::module::Module;
use std::path::Path;

use super::*;

pub const ADAPTER_WEIGHTS: &str = "adapter_model.safetensors";

/// The prefix PEFT puts before the base model's own parameter paths.
pub(crate) const PEFT_PREFIX: &str = "base_model.model.";

/// kiln's parameter path → PEFT's key in `adapter_model.safetensors`.
pub fn peft_key(path: &str) -> String {
    let p = path
        .replace(".lora_a.weight", ".lora_A.weight")
        .replace(".lora_b.weight", ".lora_B.weight");
    format!("{PEFT_PREFIX}{p}")
}

/// PEFT's key → kiln's parameter path (`None` for a key outside `base_model.model.`). The names
/// PEFT's modules have in memory (`lora_A.default.weight`, `classifier.modules_to_save.default.
/// weight`) are read too.
pub fn internal_key(key: &str) -> Option<String> {
    let p = key.strip_prefix(PEFT_PREFIX)?;
    let p = p
        .replace(".modules_to_save.default.", ".")
        .replace(".lora_A.default.weight", ".lora_a.weight")
        .replace(".lora_B.default.weight", ".lora_b.weight")
        .replace(".lora_A.weight", ".lora_a.weight")
        .replace(".lora_B.weight", ".lora_b.weight");
    Some(p)
}

/// A PEFT folder's tensors under kiln's paths, checked against the adapter its
/// `adapter_config.json` describes (see [`check_tensors`]): every reader of an adapter (training
/// on it, merging, resharding, resuming) goes through here.
pub fn read_adapter_tensors(dir: &Path) -> Result<BTreeMap<String, HostTensor>> {
    let config = LoraConfig::from_adapter_dir(dir)?;
    let path = dir.join(ADAPTER_WEIGHTS);
    let tensors = crate::formats::safetensors::read_safetensors(&path)?;
    let tensors = tensors
        .into_iter()
        .map(|(key, t)| match internal_key(&key) {
            Some(p) => Ok((p, t)),
            None => Err(KilnError::Config(format!(
                "{}: tensor `{key}` is not under `{PEFT_PREFIX}`, so it is not a PEFT adapter's",
                path.display()
            ))),
        })
        .collect::<Result<BTreeMap<_, _>>>()?;
    check_tensors(&config, &tensors).map_err(|why| {
        KilnError::Config(format!(
            "{}: {why} (adapter_config.json beside it says r = {}{})",
            path.display(),
            config.r,
            if config.modules_to_save.is_empty() {
                String::new()
            } else {
                format!(", modules_to_save {:?}", config.modules_to_save)
            }
        ))
    })?;
    Ok(tensors)
}

/// The adapter's tensors agree with its config as PEFT builds it: each factor pair of rank `r`
/// (`A` `[r, in]`, `B` `[out, r]`; the merge scale `alpha / r` depends on it), and each
/// `modules_to_save` entry saved (a sequence classifier's `classifier` / `score`, which PEFT lists
/// for every model, need only one of them).
pub(crate) fn check_tensors(
    config: &LoraConfig,
    tensors: &BTreeMap<String, HostTensor>,
) -> std::result::Result<(), String> {
    for (path, t) in tensors.iter().filter(|(p, _)| is_lora_param(p)) {
        let key = peft_key(path);
        let a = path.ends_with(".lora_a.weight");
        let rank = match (t.shape.as_slice(), a) {
            ([r, _], true) | ([_, r], false) => *r,
            (shape, _) => return Err(format!("`{key}` is {shape:?}, not a matrix")),
        };
        if rank != config.r {
            return Err(format!("`{key}` {:?} has rank {rank}", t.shape));
        }
        let layer = path
            .trim_end_matches(".lora_a.weight")
            .trim_end_matches(".lora_b.weight");
        let other = format!("{layer}.lora_{}.weight", if a { 'b' } else { 'a' });
        if !tensors.contains_key(&other) {
            return Err(format!("`{key}` has no {} beside it", peft_key(&other)));
        }
    }
    let saved = |m: &str| {
        tensors.keys().filter(|p| !is_lora_param(p)).any(|p| {
            let module = p.rsplit_once('.').map_or("", |(m, _)| m);
            suffix_match(module, m) || module_under(module, m)
        })
    };
    let heads = ["classifier", "score"];
    for m in &config.modules_to_save {
        let head_saved = heads.contains(&m.as_str()) && heads.iter().any(|h| saved(h));
        if !saved(m) && !head_saved {
            return Err(format!(
                "modules_to_save names `{m}`, but no tensor of it is saved"
            ));
        }
    }
    Ok(())
}

/// `model` with the PEFT adapter of folder `dir` attached (its `adapter_config.json` and
/// weights) and its base frozen, and the adapter; every adapter tensor must find its parameter
/// and every adapter parameter its tensor.
pub fn load_adapter<B: KilnBackend, M: LoraTarget<B> + Module<B>>(
    model: M,
    dir: &Path,
    device: &B::Device,
    keep: crate::models::params::Keep,
) -> Result<(M, Adapter)> {
    let config = LoraConfig::from_adapter_dir(dir)?;
    // An adapter of another architecture fails here, naming its file.
    let source = format!("{}: target_modules", dir.join(ADAPTER_CONFIG).display());
    let (model, adapter) = attach_from(model, &config, 0, &source)?;
    // A pipeline stage holds (and reads) the factors of its own layers only.
    let model = crate::models::params::empty_where(model, "", keep);
    // Under tensor parallelism each rank takes its cut of the whole adapter.
    let tensors = read_adapter_tensors(dir)?
        .into_iter()
        .filter(|(path, _)| keep(path))
        .map(|(path, t)| {
            let cut = crate::formats::sharded::cut_split(&t, &model.split_of(&path)).unwrap_or(t);
            (path, cut)
        })
        .collect();
    let (model, report) = crate::models::params::load_into(model, tensors, None, device)?;
    let missing: Vec<&String> = report
        .missing
        .iter()
        .filter(|p| adapter.owns(p) && keep(p))
        .collect();
    if !report.unexpected.is_empty() || !missing.is_empty() {
        return Err(KilnError::Weights(format!(
            "{}: the adapter does not fit this model ({}{}): is it an adapter of another base \
             model?",
            dir.join(ADAPTER_WEIGHTS).display(),
            if report.unexpected.is_empty() {
                String::new()
            } else {
                format!("no parameter for {}", peft_key(&report.unexpected[0]))
            },
            match missing.first() {
                Some(p) => format!(
                    "{}no tensor for {}",
                    if report.unexpected.is_empty() {
                        ""
                    } else {
                        "; "
                    },
                    peft_key(p)
                ),
                None => String::new(),
            }
        )));
    }
    Ok((model, adapter))
}
