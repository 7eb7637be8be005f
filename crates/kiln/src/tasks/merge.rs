//! `kiln merge`: a base model folder and a LoRA adapter (PEFT's folder) into one Hugging Face
//! folder, as PEFT's `merge_and_unload()` followed by `save_pretrained` writes it.

use std::path::Path;

use tracing::info;

use crate::error::{KilnError, Result};
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
    if out == base || out == adapter {
        return Err(KilnError::Config(format!(
            "--out {}: would write over an input folder; give a new folder",
            out.display()
        )));
    }
    let config = LoraConfig::from_adapter_dir(adapter)?;
    let tensors = lora::read_adapter_tensors(adapter)?;
    let mut weights = crate::hub::model_weights::read_model_weights(base)?;
    let merged = lora::merge(&mut weights, &tensors, &config)?;
    let config_path = base.join("config.json");
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
    write_model_dir(out, &weights, &files)?;
    info!(
        "{} + {} → {}: {merged} layers merged (scaling {})",
        base.display(),
        adapter.display(),
        out.display(),
        config.scaling()
    );
    Ok(merged)
}
