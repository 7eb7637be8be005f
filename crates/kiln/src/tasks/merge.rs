//! `kiln merge`: a base model folder and a LoRA adapter (PEFT's folder) into one Hugging Face
//! folder, as PEFT's `merge_and_unload()` followed by `save_pretrained` writes it.

use std::collections::BTreeMap;
use std::path::Path;

use tracing::info;

use crate::error::{KilnError, Result};
use crate::formats::safetensors::HostTensor;
use crate::models::lora::{self, LoraConfig};
use crate::train::checkpoint::{write_model_dir, ModelFiles};

/// The files copied beside the merged weights: the tokenizer's and the generation settings, from
/// the adapter's folder where it has them (a fine-tune may bring its own template), else the
/// base's.
const COPIED: [&str; 4] = [
    "tokenizer_config.json",
    "generation_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
];

/// Writes `base` with the adapter of `adapter` folded into its weights to `out`; returns how many
/// layers were merged.
pub fn merge_folder(base: &Path, adapter: &Path, out: &Path) -> Result<usize> {
    // Refused before the slow part: --out naming an input by any spelling, or a full folder.
    let inputs = [("base model folder", base), ("adapter folder", adapter)];
    crate::io::files::check_new_folder(out, "--out", &inputs)?;
    let config = LoraConfig::from_adapter_dir(adapter)?;
    let tensors = lora::read_adapter_tensors(adapter)?;
    let mut weights = crate::formats::model_weights::read_model_weights(base)?;
    // A classifier's adapter on a headless base (`BertModel`, as sentence encoders ship): the
    // base's parameters take the classifier's prefix (`bert.`), and the head, which the base
    // lacks, comes whole from the adapter (PEFT's `modules_to_save`).
    let classifier = adapter.join("config.json").exists() && task_type(adapter)? == "SEQ_CLS";
    if classifier {
        add_classifier_prefix(&mut weights, &tensors);
        for (path, t) in tensors.iter().filter(|(p, _)| !lora::is_lora_param(p)) {
            weights.entry(path.clone()).or_insert_with(|| t.clone());
        }
    }
    let merged = lora::merge(&mut weights, &tensors, &config)?;
    // A decoder's classifier (a reward model's adapter on a causal LM) has `score` in place of
    // the base's language-model head, which transformers would not read.
    if classifier && weights.contains_key("score.weight") {
        weights.retain(|name, _| !name.starts_with("lm_head."));
    }
    // A classifier's config is the adapter folder's (its labels, its architecture).
    let config_path = if classifier {
        adapter.join("config.json")
    } else {
        base.join("config.json")
    };
    let config_json =
        std::fs::read_to_string(&config_path).map_err(|e| KilnError::io(&config_path, e))?;
    let from = |name: &str| {
        let own = adapter.join(name);
        if own.exists() {
            own
        } else {
            base.join(name)
        }
    };
    let files = ModelFiles {
        config_json,
        tokenizer_json: Some(from("tokenizer.json")).filter(|p| p.exists()),
        copy: COPIED.iter().map(|f| from(f)).collect(),
        source_dir: Some(base.to_path_buf()),
        adapter: None,
    };
    crate::io::files::write_new_folder(out, "--out", &inputs, |tmp| {
        write_model_dir(tmp, &weights, &files)
    })?;
    info!(
        "{} + {} → {}: {merged} layers merged (scaling {})",
        base.display(),
        adapter.display(),
        out.display(),
        config.scaling()
    );
    Ok(merged)
}

/// `adapter_config.json`'s `task_type`.
fn task_type(adapter: &Path) -> Result<String> {
    let path = adapter.join(lora::ADAPTER_CONFIG);
    let bytes = crate::io::files::read_regular(&path, "adapter config")?;
    let v: serde_json::Value = crate::io::parse_json(&path, &bytes)?;
    Ok(v["task_type"].as_str().unwrap_or_default().to_string())
}

/// Where the adapter's layers (`bert.encoder.layer.0.attention.self.query`) are found in the
/// base only without a leading prefix (`encoder.layer.0.…`: a headless base's names), every base
/// parameter without it gets it.
fn add_classifier_prefix(
    weights: &mut BTreeMap<String, HostTensor>,
    adapter: &BTreeMap<String, HostTensor>,
) {
    let Some(layer) = adapter
        .keys()
        .find_map(|p| p.strip_suffix(".lora_a.weight"))
    else {
        return;
    };
    let weight = format!("{layer}.weight");
    if weights.contains_key(&weight) {
        return;
    }
    let mut prefix = String::new();
    for part in weight.split('.') {
        let rest = &weight[prefix.len()..];
        let rest = rest.strip_prefix('.').unwrap_or(rest);
        if !prefix.is_empty() && weights.contains_key(rest) {
            let old = std::mem::take(weights);
            let lead = format!("{prefix}.");
            *weights = old
                .into_iter()
                .map(|(k, t)| {
                    if k.starts_with(&lead) {
                        (k, t)
                    } else {
                        (format!("{lead}{k}"), t)
                    }
                })
                .collect();
            return;
        }
        if !prefix.is_empty() {
            prefix.push('.');
        }
        prefix.push_str(part);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_headless_base_takes_the_classifiers_prefix() {
        let t = || HostTensor {
            shape: vec![1],
            data: vec![0.0],
        };
        let mut base = BTreeMap::from([
            (
                "encoder.layer.0.attention.self.query.weight".to_string(),
                t(),
            ),
            ("embeddings.word_embeddings.weight".to_string(), t()),
        ]);
        let adapter = BTreeMap::from([(
            "bert.encoder.layer.0.attention.self.query.lora_a.weight".to_string(),
            t(),
        )]);
        add_classifier_prefix(&mut base, &adapter);
        let keys: Vec<&String> = base.keys().collect();
        assert_eq!(
            keys,
            [
                "bert.embeddings.word_embeddings.weight",
                "bert.encoder.layer.0.attention.self.query.weight"
            ]
        );
        // A base that already has the names is left as it is.
        let before = base.clone();
        add_classifier_prefix(&mut base, &adapter);
        assert_eq!(
            base.keys().collect::<Vec<_>>(),
            before.keys().collect::<Vec<_>>()
        );
    }
}
