//! What the causal-LM task (training, perplexity, generation) and `kiln convert` need of a decoder,
//! so that a new family plugs in without touching them.
//!
//! Two levels, as transformers' "modular" families are built: a [`DecoderArchitecture`] is the
//! code (a model, its loader, its tensor-parallel cut: Llama's today), and a [`DecoderFamily`] is
//! one `model_type` built on an architecture, with its own reading of `config.json` (Mistral and
//! Qwen2 are Llama's layers with a sliding window or q/k/v biases). `models/auto.rs` lists the
//! families; the task reaches the right one through a [`DecoderVisitor`], so it is written once
//! for any architecture and compiled once per architecture, not per family.

use std::collections::BTreeMap;
use std::path::Path;

use burn::module::AutodiffModule;
use burn::tensor::Tensor;

use crate::contract::{Model, ParamSplit};
use crate::data::lm::TokenBatch;
use crate::error::Result;
use crate::models::params::Keep;
use crate::ops::{KilnBackend, TpComm, TrainBackend};

/// The token embedding's parameter in every decoder family kiln builds (Hugging Face's name):
/// the pipeline's stage 0 holds it, and a tied head reads it.
pub const DECODER_EMBEDDING: &str = "model.embed_tokens.weight";

/// The parts of a decoder's config the task reads, whatever the family.
pub trait DecoderConfig: Clone + Send + Sync + 'static {
    fn vocab_size(&self) -> usize;
    /// The longest sequence the model was trained for (RoPE models run past it, untrained).
    fn max_position_embeddings(&self) -> usize;
    /// The token ids that end a sequence (`eos_token_id`, a number or a list).
    fn eos_ids(&self) -> Vec<u32>;
    /// `config.json` as saved beside trained weights.
    fn to_json(&self) -> String;
    /// The decoder layers.
    fn num_layers(&self) -> usize;
    /// Every parameter's shape of the whole model, by Hugging Face name, without building it.
    fn param_shapes(&self) -> BTreeMap<String, Vec<usize>>;
    /// The labels of the sequence-classification head the config names
    /// (`…ForSequenceClassification`, a reward model's `score`); `None` for a causal LM.
    fn sequence_classifier_labels(&self) -> Option<usize>;
    /// The config of the same decoder with a sequence-classification head of `num_labels` instead
    /// of its language-model head, under the family's class name `{class_prefix}ForSequenceClassification`.
    fn into_sequence_classifier(self, class_prefix: &str, num_labels: usize) -> Self;
    /// The padding token's id, which a sequence classifier reads each row's score before.
    fn pad_token_id(&self) -> Option<u32>;
    /// The same config with `pad_token_id` set (as TRL sets it from the tokenizer).
    fn with_pad_token_id(self, pad: u32) -> Self;
}

/// A causal LM: logits for every position of a token batch (the trainer's [`Model`]) and
/// KV-cached decoding.
pub trait CausalLm<B: KilnBackend>: Model<B, Batch = TokenBatch> + Clone {
    /// The keys and values of the positions decoded so far.
    type Cache;
    fn new_cache(&self) -> Self::Cache;
    /// One decoding step of one sequence: `ids` continue the cached positions (the whole prompt
    /// first, then one token at a time); the vocabulary logits of the last one.
    fn next_token_logits(&self, ids: &[i64], cache: &mut Self::Cache) -> Vec<f32>;
    /// The same step in the three pieces a pipeline stage runs some of: the embeddings
    /// `[1, T, H]` of `ids`, …
    fn embed_ids(&self, ids: &[i64]) -> Tensor<B, 3>;
    /// … decoder layers `layers` (continuing and extending the cached positions), …
    fn decode_layers(
        &self,
        x: Tensor<B, 3>,
        layers: std::ops::Range<usize>,
        cache: &mut Self::Cache,
    ) -> Tensor<B, 3>;
    /// … and the final norm and head: the vocabulary logits of the last position.
    fn last_logits(&self, x: Tensor<B, 3>) -> Vec<f32>;
    /// The same model laid out for inference only (faster decoding, no training).
    fn for_inference(self) -> Self {
        self
    }
}

/// A decoder's code: its config type, its model on any backend, how a tensor-parallel rank cuts
/// it, and how it is built or loaded.
pub trait DecoderArchitecture: 'static {
    type Config: DecoderConfig;
    /// One tensor-parallel rank's cut, worked out from the config before any weight is read.
    type Shard: Clone + Send + Sync;
    type Model<B: KilnBackend>: CausalLm<B> + crate::models::lora::LoraTarget<B>;
    /// The model under autodiff, whose inner module (for evaluation) is [`Self::Model`].
    type Trainable<B: TrainBackend>: CausalLm<B>
        + AutodiffModule<B, InnerModule = Self::Model<B::InnerBackend>>;

    /// This rank's cut of a model of config `c` over the tensor-parallel group `tp`; one sentence
    /// when the model cannot be cut that way (more ranks than heads, …).
    fn plan_shard(c: &Self::Config, tp: TpComm) -> Result<Self::Shard>;
    /// A randomly initialised model (this rank's shard of it), the same on every backend for
    /// one seed.
    /// It holds the parameters `keep` accepts (a pipeline stage's); the others are empty.
    fn fresh<B: KilnBackend>(
        c: &Self::Config,
        device: &B::Device,
        shard: Option<Self::Shard>,
        seed: u64,
        keep: Keep,
    ) -> Result<Self::Model<B>>;
    /// The weights of a Hugging Face folder (whole, indexed shards or tensor-parallel), cut to
    /// `shard`; only those `keep` accepts are read and held (a pipeline stage's).
    fn load<B: KilnBackend>(
        dir: &Path,
        c: &Self::Config,
        device: &B::Device,
        shard: Option<Self::Shard>,
        keep: Keep,
    ) -> Result<Self::Model<B>>;
    /// A model as the trainer differentiates it (the same value: autodiff is the backend's).
    fn trainable<B: TrainBackend>(m: Self::Model<B>) -> Self::Trainable<B>;
    /// Every rank's cut of the parameters `names` over `n` ranks, as training at
    /// `--tensor-parallel-size n` holds them (`kiln convert --to-tp`); `kv_heads_read` cuts
    /// replicated key/value projections to the heads each rank reads (NxD's fused `qkv_proj`).
    fn splits_for(
        c: &Self::Config,
        names: &[&str],
        n: usize,
        kv_heads_read: bool,
    ) -> Result<Vec<BTreeMap<String, ParamSplit>>>;
}

/// One `model_type` built on architecture `A`.
pub struct DecoderFamily<A: DecoderArchitecture> {
    /// `config.json`'s `model_type`.
    pub model_type: &'static str,
    /// What transformers' class names start with (`MistralForCausalLM`), for configs that name
    /// only their `architectures`.
    pub class_prefix: &'static str,
    /// Reads and validates the `config.json` text (read from the path) as this family means it,
    /// naming the path in every error.
    pub read_config: fn(&Path, &[u8]) -> Result<A::Config>,
}

/// Code run with whichever family a `config.json` names, and the config as that family read it
/// (`models::auto::with_causal_lm`).
pub trait DecoderVisitor {
    type Output;
    fn visit<A: DecoderArchitecture>(
        self,
        family: &'static DecoderFamily<A>,
        config: A::Config,
    ) -> Self::Output;
}
