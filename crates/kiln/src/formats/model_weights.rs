//! Reading a model folder's weights, whichever of transformers' and kiln's layouts it has: one
//! `model.safetensors`, the shards an index lists, or tensor-parallel shards ([`crate::formats::sharded`])
//! put back together.

use std::collections::BTreeMap;
use std::path::Path;

use crate::error::{KilnError, Result};
use crate::formats::safetensors::{keep_all, read_safetensors_with, HostTensor, Keep};
use crate::formats::sharded::{read_layout, read_whole_model_where};

/// Every weight of a model folder: `model.safetensors`, the shards listed in
/// `model.safetensors.index.json` (transformers' layout for large models), or tensor-parallel
/// shards put back together.
pub fn read_model_weights(dir: &Path) -> Result<BTreeMap<String, HostTensor>> {
    read_model_weights_with(dir, &keep_all, &mut |_, t| t)
}

/// [`read_model_weights`] of the tensors `wanted` names only (a file or shard holding none of
/// them is not opened), each handed to `keep` as it is read (see [`read_safetensors_with`]).
pub fn read_model_weights_with(
    dir: &Path,
    wanted: Keep,
    keep: &mut dyn FnMut(&str, HostTensor) -> HostTensor,
) -> Result<BTreeMap<String, HostTensor>> {
    // A tensor-parallel folder (`kiln convert --to-tp`, a sharded checkpoint) is put together.
    if let Some(layout) = read_layout(dir)? {
        let whole = read_whole_model_where(dir, &layout, wanted)?;
        return Ok(whole
            .into_iter()
            .map(|(n, t)| (n.clone(), keep(&n, t)))
            .collect());
    }
    let single = dir.join("model.safetensors");
    if single.exists() {
        return read_safetensors_with(&single, wanted, keep);
    }
    let index = dir.join("model.safetensors.index.json");
    if !index.exists() {
        return Err(KilnError::Config(format!(
            "{}: no model.safetensors or model.safetensors.index.json",
            dir.display()
        )));
    }
    let json: serde_json::Value = crate::io::read_json(&index)?;
    let map = json["weight_map"].as_object().ok_or_else(|| {
        KilnError::Config(format!("{}: no \"weight_map\" object", index.display()))
    })?;
    let mut shards: Vec<&str> = Vec::with_capacity(map.len());
    for (name, v) in map.iter().filter(|(name, _)| wanted(name)) {
        let shard = v.as_str().ok_or_else(|| {
            KilnError::Config(format!(
                "{}: weight_map[{name:?}] is not a file name",
                index.display()
            ))
        })?;
        // Shards sit beside the index: a path elsewhere ("../x", "/dev/zero") is not a shard.
        let plain = Path::new(shard)
            .components()
            .all(|c| matches!(c, std::path::Component::Normal(_)))
            && !shard.contains('/');
        if !plain {
            return Err(KilnError::Config(format!(
                "{}: weight_map[{name:?}] = {shard:?} is not a file name in the model folder",
                index.display()
            )));
        }
        shards.push(shard);
    }
    shards.sort_unstable();
    shards.dedup();
    let mut out = BTreeMap::new();
    for shard in shards {
        out.extend(read_safetensors_with(&dir.join(shard), wanted, keep)?);
    }
    let mut listed = map.keys().filter(|name| wanted(name));
    if let Some(name) = listed.find(|name| !out.contains_key(*name)) {
        return Err(KilnError::Weights(format!(
            "{}: {name} is listed but no shard holds it",
            index.display()
        )));
    }
    Ok(out)
}
