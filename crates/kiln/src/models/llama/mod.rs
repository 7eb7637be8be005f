//! Llama's layers, on which Mistral and Qwen2 are built too (their folders set the layer rules):
//! the config (`config.rs`), the model (`model.rs`), its tensor-parallel cut and resharding
//! splits (`parallel.rs`), loading a folder or a fresh model (`load.rs`), and the GGUF → Hugging
//! Face conversion (`gguf.rs`). [`Llama`] is this architecture as the causal-LM task uses it.

pub mod config;
pub mod gguf;
pub mod gguf_export;
pub mod load;
mod model;
pub mod parallel;

use std::collections::BTreeMap;
use std::path::Path;

use burn::tensor::Tensor;

pub use model::*;

use self::config::LlamaConfig;
use super::decoder::{CausalLm, DecoderArchitecture, DecoderConfig, DecoderFamily};
use crate::contract::ParamSplit;
use crate::error::Result;
use crate::models::params::Keep;
use crate::ops::{KilnBackend, TpComm, TrainBackend};

/// `model_type: "llama"`.
pub static FAMILY: DecoderFamily<Llama> = DecoderFamily {
    model_type: "llama",
    class_prefix: "Llama",
    read_config: |path, bytes| LlamaConfig::from_bytes(path, bytes, config::LayerRules::LLAMA),
};

/// The Llama architecture (`LlamaForCausalLM` and the families built on its layers).
pub struct Llama;

impl DecoderArchitecture for Llama {
    type Config = LlamaConfig;
    type Shard = LlamaShard;
    type Model<B: KilnBackend> = LlamaForCausalLM<B>;
    type Trainable<B: TrainBackend> = LlamaForCausalLM<B>;

    fn plan_shard(c: &LlamaConfig, tp: TpComm) -> Result<LlamaShard> {
        LlamaShard::new(c, tp)
    }

    fn fresh<B: KilnBackend>(
        c: &LlamaConfig,
        device: &B::Device,
        shard: Option<LlamaShard>,
        seed: u64,
        keep: Keep,
    ) -> Result<LlamaForCausalLM<B>> {
        load::fresh_llama(c, device, shard, seed, keep)
    }

    fn load<B: KilnBackend>(
        dir: &Path,
        c: &LlamaConfig,
        device: &B::Device,
        shard: Option<LlamaShard>,
        keep: Keep,
    ) -> Result<LlamaForCausalLM<B>> {
        load::load_shard_of(dir, c, device, shard, keep)
    }

    fn trainable<B: TrainBackend>(m: LlamaForCausalLM<B>) -> LlamaForCausalLM<B> {
        m
    }

    fn splits_for(
        c: &LlamaConfig,
        names: &[&str],
        n: usize,
        kv_heads_read: bool,
    ) -> Result<Vec<BTreeMap<String, ParamSplit>>> {
        parallel::splits_for(c, names.iter().copied(), n, kv_heads_read)
    }
}

impl DecoderConfig for LlamaConfig {
    fn vocab_size(&self) -> usize {
        self.vocab_size
    }
    fn max_position_embeddings(&self) -> usize {
        self.max_position_embeddings
    }
    fn eos_ids(&self) -> Vec<u32> {
        LlamaConfig::eos_ids(self)
    }
    fn to_json(&self) -> String {
        LlamaConfig::to_json(self)
    }
    fn num_layers(&self) -> usize {
        self.num_hidden_layers
    }
    fn param_shapes(&self) -> BTreeMap<String, Vec<usize>> {
        LlamaConfig::param_shapes(self)
    }
    fn sequence_classifier_labels(&self) -> Option<usize> {
        LlamaConfig::sequence_classifier_labels(self)
    }
    fn into_sequence_classifier(self, class_prefix: &str, num_labels: usize) -> Self {
        LlamaConfig::into_sequence_classifier(self, class_prefix, num_labels)
    }
    fn pad_token_id(&self) -> Option<u32> {
        self.pad_token_id
    }
    fn with_pad_token_id(mut self, pad: u32) -> Self {
        self.pad_token_id = Some(pad);
        self
    }
}

impl<B: KilnBackend> CausalLm<B> for LlamaForCausalLM<B> {
    type Cache = KvCache<B>;
    fn new_cache(&self) -> KvCache<B> {
        KvCache::new(self.num_layers())
    }
    fn next_token_logits(&self, ids: &[i64], cache: &mut KvCache<B>) -> Vec<f32> {
        LlamaForCausalLM::next_token_logits(self, ids, cache)
    }
    fn embed_ids(&self, ids: &[i64]) -> Tensor<B, 3> {
        LlamaForCausalLM::embed_ids(self, ids)
    }
    fn decode_layers(
        &self,
        x: Tensor<B, 3>,
        layers: std::ops::Range<usize>,
        cache: &mut KvCache<B>,
    ) -> Tensor<B, 3> {
        LlamaForCausalLM::decode_layers(self, x, layers, cache)
    }
    fn last_logits(&self, x: Tensor<B, 3>) -> Vec<f32> {
        LlamaForCausalLM::last_logits(self, x)
    }
    fn for_inference(self) -> Self {
        self.into_inference_layout()
    }
}
