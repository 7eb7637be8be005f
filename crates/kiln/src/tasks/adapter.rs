//! LoRA in a training run, shared by the causal-LM, SFT and classification tasks: a fresh adapter
//! attached to the frozen model (`--use-peft`, `--lora-*`), or an existing PEFT adapter loaded to
//! train further (`--adapter DIR`, as `PeftModel.from_pretrained(base, dir, is_trainable=True)`).

use std::path::PathBuf;

use burn::module::Module;
use tracing::info;

use crate::contract::ParamSplit;
use crate::error::Result;
use crate::models::lora::{Adapter, BaseDtype, LoraConfig, LoraTarget};
use crate::ops::KilnBackend;
use crate::train::checkpoint::AdapterFiles;

/// Which adapter a run trains.
#[derive(Debug, Clone, PartialEq)]
pub enum LoraSetup {
    /// A new adapter with this configuration.
    Fresh(LoraConfig),
    /// The adapter of a PEFT folder: its configuration (`adapter_config.json`) and its weights.
    Continue(PathBuf),
}

/// `model` with its adapter attached and its base frozen (held in `base_dtype`), and what the
/// saved folders say about it (`base_model`: `adapter_config.json`'s `base_model_name_or_path`).
/// The trainable share is logged as PEFT's `print_trainable_parameters` prints it.
pub fn with_adapter<B: KilnBackend, M: LoraTarget<B> + Module<B>>(
    model: M,
    setup: &LoraSetup,
    base_dtype: BaseDtype,
    seed: u64,
    base_dir: Option<&std::path::Path>,
    device: &B::Device,
    keep: crate::models::params::Keep,
) -> Result<(M, AdapterFiles)> {
    // PEFT records the base as it was named: a Hub id where the base came from the Hub (its
    // files then lie in the local cache, whose path means nothing on another machine).
    let base_model = base_dir.map_or_else(String::new, |d| {
        crate::hub::remote::cached_repo_id(d).unwrap_or_else(|| d.display().to_string())
    });
    let (model, adapter) = match setup {
        LoraSetup::Fresh(config) => crate::models::lora::attach(model, config, seed)?,
        LoraSetup::Continue(dir) => {
            let loaded = crate::models::lora::load_adapter(model, dir, device, keep)?;
            info!("{}: training this adapter further", dir.display());
            loaded
        }
    };
    info!("{}", describe(&model, &adapter));
    let model = match base_dtype {
        BaseDtype::F32 => model,
        BaseDtype::Bf16 => {
            let model = crate::models::lora::hold_base_in_bf16(model, &adapter)?;
            info!("the frozen base is held in bf16 (--base-dtype bf16); the adapter trains in f32");
            model
        }
    };
    Ok((
        model,
        AdapterFiles {
            adapter,
            base_model,
        },
    ))
}

/// `LoRA r=16 alpha=32 on q_proj, v_proj: trainable params: … || all params: … ||
/// trainable%: …`.
fn describe<B: KilnBackend, M: LoraTarget<B> + Module<B>>(model: &M, adapter: &Adapter) -> String {
    // A tensor-parallel rank counts the whole model, as PEFT on one device does.
    let shapes = crate::models::params::module_shapes(model)
        .into_iter()
        .map(|(path, mut shape)| {
            if let ParamSplit::Sharded { axis, full, .. } = model.split_of(&path) {
                shape[axis] = full;
            }
            (path, shape)
        })
        .collect::<Vec<_>>();
    format!(
        "LoRA r={} alpha={} on {}: {}",
        adapter.config.r,
        adapter.config.alpha,
        adapter
            .targeted
            .iter()
            .cloned()
            .collect::<Vec<_>>()
            .join(", "),
        crate::models::lora::trainable_line(
            shapes
                .iter()
                .map(|(p, s)| (p.as_str(), s.iter().product::<usize>())),
            adapter
        )
    )
}
