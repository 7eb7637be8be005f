//! Loading a Llama-family model: a Hugging Face folder (whole, indexed shards, or a
//! tensor-parallel folder) into the whole model or one tensor-parallel rank's shard, and a fresh
//! random one drawn on the CPU as transformers draws it.

use std::collections::BTreeMap;
use std::path::Path;

use tracing::info;

use super::config::LlamaConfig;
use super::{LlamaForCausalLM, LlamaShard};
use crate::error::{KilnError, Result};
use crate::formats::model_weights::read_model_weights_with;
use crate::formats::safetensors::HostTensor;
use crate::formats::sharded::{cut_split, read_layout, read_rank_model_where};
use crate::models::params::{load_into, Keep};
use crate::ops::KilnBackend;

/// The model of the Hugging Face folder `dir`, whose config (already read and validated) is
/// `config`, for tensor-parallel rank `shard` (whole without one), holding only its shard and
/// the parameters `keep` accepts (a pipeline stage's; the others are never read): a
/// tensor-parallel folder cut the same way is read from this rank's own file, any other folder
/// tensor by tensor, each cut as it is read. Every kept parameter must be present.
pub fn load_shard_of<B: KilnBackend>(
    dir: &Path,
    config: &LlamaConfig,
    device: &B::Device,
    shard: Option<LlamaShard>,
    keep: Keep,
) -> Result<LlamaForCausalLM<B>> {
    // The weights first: a corrupt file fails before the model is allocated.
    let tensors = match &shard {
        None => read_model_weights_with(dir, keep, &mut |_, t| t)?,
        Some(s) => read_shard_weights(dir, s, keep)?,
    };
    let model = crate::ops::with_seeded_rng::<B, _>(device, 0, || {
        LlamaForCausalLM::new_stage(config, device, shard, keep)
    });
    let (mut model, mut report) = load_into(model, tensors, None, device)?;
    report.missing.retain(|p| keep(p));
    // A causal LM's folder read as a sequence classifier (a reward model's start): its body is
    // the checkpoint's and its head is new, as transformers' `from_pretrained` starts one.
    let classifier = config.sequence_classifier_labels();
    if classifier.is_some() && report.missing.iter().any(|p| p == "score.weight") {
        report.missing.retain(|p| p != "score.weight");
        model.score = Some(fresh_score(config, device));
        info!(
            "{}: no score.weight: the sequence-classification head starts from N(0, {}²), as \
             transformers starts it",
            dir.display(),
            config.initializer_range
        );
    }
    if !report.missing.is_empty() {
        return Err(KilnError::Weights(format!(
            "{}: weights missing for {} (is this a LlamaForCausalLM folder?)",
            dir.display(),
            report.missing.join(", ")
        )));
    }
    let unexpected: Vec<_> = report
        .unexpected
        .iter()
        .filter(|k| {
            !((config.tie_word_embeddings || classifier.is_some()) && *k == "lm_head.weight")
        })
        .collect();
    // Weights of layers past the config's count: the config does not describe this model, and
    // running the layers it names would silently drop the rest.
    let past = unexpected.iter().find_map(|k| {
        let layer: usize = k
            .strip_prefix("model.layers.")?
            .split('.')
            .next()?
            .parse()
            .ok()?;
        (layer >= config.num_hidden_layers).then_some((layer, k))
    });
    if let Some((layer, name)) = past {
        return Err(KilnError::Config(format!(
            "{}: num_hidden_layers is {}, but the weights in {} hold layer {layer} too ({name}): \
             the config does not describe these weights",
            dir.join("config.json").display(),
            config.num_hidden_layers,
            dir.display()
        )));
    }
    if !unexpected.is_empty() {
        info!("unused tensors in {}: {unexpected:?}", dir.display());
    }
    Ok(model)
}

/// A randomly initialised Llama (this rank's shard of it), drawn on the CPU whatever the device,
/// as transformers draws weights before `.to(device)`: each backend has its own generator, so one
/// seed would otherwise start a different run on a GPU than on the CPU.
pub fn fresh_llama<B: KilnBackend>(
    config: &LlamaConfig,
    device: &B::Device,
    shard: Option<LlamaShard>,
    seed: u64,
    keep: Keep,
) -> Result<LlamaForCausalLM<B>> {
    use crate::backend::{Cpu, CpuDevice, CpuTrain};
    use std::any::TypeId;
    let on_cpu = [TypeId::of::<Cpu>(), TypeId::of::<CpuTrain>()].contains(&TypeId::of::<B>());
    let model = crate::ops::with_seeded_rng::<B, _>(device, seed, || {
        LlamaForCausalLM::new_stage(config, device, shard.clone(), keep)
    });
    if on_cpu {
        return Ok(model);
    }
    let cpu = CpuDevice::default();
    let fresh = crate::ops::with_seeded_rng::<Cpu, _>(&cpu, seed, || {
        LlamaForCausalLM::<Cpu>::new_stage(config, &cpu, shard, keep)
    });
    let tensors = crate::models::params::module_tensors_where(&fresh, keep);
    Ok(crate::models::params::load_into(model, tensors, None, device)?.0)
}

/// A new sequence-classification head, drawn on the CPU from a fixed seed whatever the device
/// (so every rank and backend starts from the same head).
fn fresh_score<B: KilnBackend>(
    config: &LlamaConfig,
    device: &B::Device,
) -> crate::models::layers::Linear<B> {
    use crate::backend::{Cpu, CpuDevice};
    use crate::models::layers::Linear;
    let labels = config.sequence_classifier_labels().unwrap_or(1);
    let cpu = CpuDevice::default();
    let head = crate::ops::with_seeded_rng::<Cpu, _>(&cpu, 0, || {
        Linear::<Cpu>::new(
            config.hidden_size,
            labels,
            false,
            config.initializer_range,
            &cpu,
        )
    });
    let weight = head.weight.val().into_data();
    let mut out = Linear::<B>::new(
        config.hidden_size,
        labels,
        false,
        config.initializer_range,
        device,
    );
    out.weight = burn::module::Param::from_tensor(crate::ops::owned(
        burn::tensor::Tensor::from_data(weight, device),
    ));
    out
}

/// Tensor-parallel rank `s`'s weights of the model folder `dir`, those `keep` accepts.
fn read_shard_weights(
    dir: &Path,
    s: &LlamaShard,
    keep: Keep,
) -> Result<BTreeMap<String, HostTensor>> {
    if let Some(layout) = read_layout(dir)? {
        if layout.same_cut(s.tp.rank(), s.tp.size(), |n| s.split_of(n)) {
            return read_rank_model_where(dir, &layout, s.tp.rank(), keep);
        }
    }
    // A tensor of another shape than the config's stays whole: loading then names the mismatch.
    read_model_weights_with(dir, keep, &mut |name, t| {
        cut_split(&t, &s.split_of(name)).unwrap_or(t)
    })
}
