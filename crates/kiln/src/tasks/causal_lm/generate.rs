//! `kiln generate`: KV-cached decoding of a causal LM, greedy or sampled (temperature, top-k,
//! top-p, as transformers' `generate` names them; [`Sampler`]), a chat turn through the model's
//! template, and decoding under a pipeline (each stage its layers and cache, the last picking the
//! token).

use std::path::{Path, PathBuf};
use std::time::Instant;

use tokenizers::Tokenizer;

use crate::data::chat_template::ChatTemplate;
use crate::error::{KilnError, Result};
use crate::models::auto::with_causal_lm;
use crate::models::decoder::{
    CausalLm, DecoderArchitecture, DecoderConfig, DecoderFamily, DecoderVisitor,
};
use crate::ops::KilnBackend;
use crate::parallel::DataParallel;

use super::eval::*;
pub use super::sampler::Sampler;
use super::*;

/// One decoding step under a pipeline: the ids' embeddings (stage 0) or the previous stage's
/// hidden states through this stage's layers and cache, handed on; the last stage picks the token
/// and every stage learns it from there (`u32::MAX` for "the logits were not finite", so every
/// rank stops with the same sentence).
fn decode_stage<B: KilnBackend, M: CausalLm<B>>(
    model: &M,
    stage: &crate::train::pipeline::Stage<'_, B>,
    input: &[i64],
    cache: &mut M::Cache,
    sampler: &mut Sampler,
) -> Result<Option<u32>> {
    use crate::parallel::pipeline::{hand_over, receive};
    let x = if stage.cut.embedding {
        model.embed_ids(input)
    } else {
        receive(stage.group, stage.index - 1)?
    };
    let x = model.decode_layers(x, stage.cut.layers.clone(), cache);
    let last = stage.count - 1;
    let mut token = [0f32];
    if stage.cut.head {
        let logits = model.last_logits(x);
        token[0] = sampler.sample(&logits).map_or(-1.0, |t| t as f32);
    } else {
        hand_over(stage.group, x, stage.index + 1)?;
    }
    // Ids travel as f32: exact below 2^24, far above any vocabulary.
    let device = stage.group.device();
    let t = crate::parallel::collectives::owned_tensor::<B>(token.to_vec(), device);
    let t = crate::parallel::collectives::host(stage.group.broadcast(t, last)?)[0];
    Ok((t >= 0.0).then_some(t as u32))
}

/// Decoding settings, as transformers' `generate` names them.
#[derive(Debug, Clone)]
pub struct GenerateOptions {
    pub max_new_tokens: usize,
    /// 0 = greedy (argmax, ties to the lowest id as `torch.argmax`).
    pub temperature: f64,
    /// Keep only the `top_k` most likely tokens before top-p (0 keeps every token;
    /// transformers' `GenerationConfig` defaults to 50).
    pub top_k: usize,
    /// Nucleus sampling: keep the smallest set of tokens whose probability reaches `top_p`.
    pub top_p: f64,
    pub seed: u64,
    /// Stop at the config's end-of-sequence token(s).
    pub stop_at_eos: bool,
}

impl Default for GenerateOptions {
    fn default() -> Self {
        Self {
            max_new_tokens: 32,
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: 0,
            stop_at_eos: true,
        }
    }
}

impl GenerateOptions {
    /// The ranges transformers' sampling takes: a temperature of 0 decodes greedily (its
    /// `do_sample=False`), above 0 it divides the logits and must be a finite number (NaN would
    /// make every probability NaN, and sampling pick garbage); top_p is a probability mass in
    /// [0, 1], as `TopPLogitsWarper` requires (0 keeps the single most likely token).
    pub fn check(&self) -> Result<()> {
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return Err(KilnError::Config(format!(
                "--temperature must be a finite number ≥ 0 (0 decodes greedily), got {}",
                self.temperature
            )));
        }
        if !(0.0..=1.0).contains(&self.top_p) {
            return Err(KilnError::Config(format!(
                "--top-p must be a probability mass in [0, 1], got {}",
                self.top_p
            )));
        }
        Ok(())
    }
}

/// What [`generate`] produced, with timings.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Generation {
    pub prompt_tokens: usize,
    pub new_ids: Vec<u32>,
    pub text: String,
    /// The prompt's forward pass (and the first new token).
    pub prefill_secs: f64,
    /// Every later token, one forward each with the KV cache.
    pub decode_secs: f64,
}

impl Generation {
    pub fn prefill_tokens_per_sec(&self) -> f64 {
        self.prompt_tokens as f64 / self.prefill_secs.max(1e-9)
    }
    pub fn decode_tokens_per_sec(&self) -> f64 {
        self.new_ids.len().saturating_sub(1) as f64 / self.decode_secs.max(1e-9)
    }
}

/// Continues `prompt_ids` with a KV cache; `on_text` receives the decoded text as it grows (each
/// call gets only the new part, so it can be streamed).
pub fn generate<B: KilnBackend, M: CausalLm<B>>(
    model: &M,
    tok: &Tokenizer,
    config: &impl DecoderConfig,
    prompt_ids: &[u32],
    o: &GenerateOptions,
    on_text: impl FnMut(&str),
) -> Result<Generation> {
    let mut cache = model.new_cache();
    let next = |input: &[i64], sampler: &mut Sampler| {
        let logits = model.next_token_logits(input, &mut cache);
        Ok(sampler.sample(&logits))
    };
    generate_by(next, tok, config, prompt_ids, o, on_text)
}

/// [`generate`] with each step's token from `next`: given the ids that continue the cached
/// positions (the prompt, then the last token) and the sampler, it returns the next id,
/// or `None` when the model's logits were not finite.
fn generate_by(
    mut next: impl FnMut(&[i64], &mut Sampler) -> Result<Option<u32>>,
    tok: &Tokenizer,
    config: &impl DecoderConfig,
    prompt_ids: &[u32],
    o: &GenerateOptions,
    mut on_text: impl FnMut(&str),
) -> Result<Generation> {
    o.check()?;
    if prompt_ids.is_empty() {
        return Err(KilnError::Config("the prompt encodes to no tokens".into()));
    }
    if let Some(&bad) = prompt_ids
        .iter()
        .find(|&&t| t as usize >= config.vocab_size())
    {
        return Err(KilnError::Config(format!(
            "the prompt holds token id {bad}, outside the model's vocab_size {}: the tokenizer \
             does not belong to this model",
            config.vocab_size()
        )));
    }
    warn_beyond_positions(
        config,
        prompt_ids.len() + o.max_new_tokens,
        "prompt + --max-new-tokens",
    );
    let eos = config.eos_ids();
    let mut sampler = Sampler::new(o.temperature, o.top_k, o.top_p, o.seed);
    let mut input: Vec<i64> = prompt_ids.iter().map(|&t| t as i64).collect();
    let mut new_ids: Vec<u32> = Vec::new();
    let mut printed = String::new();
    let start = Instant::now();
    let mut prefill_secs = 0.0;
    while new_ids.len() < o.max_new_tokens {
        let Some(next) = next(&input, &mut sampler)? else {
            return Err(KilnError::NonFinite(format!(
                "generating token {}: the model gives non-finite logits (its weights are not finite)",
                new_ids.len() + 1
            )));
        };
        if new_ids.is_empty() {
            prefill_secs = start.elapsed().as_secs_f64();
        }
        new_ids.push(next);
        let text = tok
            .decode(&new_ids, true)
            .map_err(|e| KilnError::Data(format!("decoding failed: {e}")))?;
        // Print only once the text is stable (a multi-byte character may still be incomplete).
        if !text.ends_with('\u{FFFD}') && text.starts_with(&printed) {
            on_text(&text[printed.len()..]);
            printed = text;
        }
        if o.stop_at_eos && eos.contains(&next) {
            break;
        }
        input = vec![next as i64];
    }
    let text = tok
        .decode(&new_ids, true)
        .map_err(|e| KilnError::Data(format!("decoding failed: {e}")))?;
    if text.len() > printed.len() && text.starts_with(&printed) {
        on_text(&text[printed.len()..]);
    }
    let total = start.elapsed().as_secs_f64();
    Ok(Generation {
        prompt_tokens: prompt_ids.len(),
        new_ids,
        text,
        prefill_secs,
        decode_secs: total - prefill_secs,
    })
}

/// `kiln generate`: the model folder `dir` (cut over the processes started together as `layout`
/// says, each decoding the same tokens) continues `prompt`; `on_text` receives the text as it
/// grows. Returns the prompt's ids with the generation.
pub fn generate_from_folder<B: KilnBackend>(
    dir: &Path,
    prompt: &Prompt,
    layout: &InferenceLayout,
    o: &GenerateOptions,
    device: &B::Device,
    on_text: impl FnMut(&str),
) -> Result<(Vec<u32>, Generation)> {
    // A bad sampling option is said before minutes of loading.
    o.check()?;
    struct Run<'a, B: KilnBackend, F>(
        &'a Path,
        &'a Prompt,
        &'a InferenceLayout,
        &'a GenerateOptions,
        &'a B::Device,
        F,
    );
    impl<B: KilnBackend, F: FnMut(&str)> DecoderVisitor for Run<'_, B, F> {
        type Output = Result<(Vec<u32>, Generation)>;
        fn visit<A: DecoderArchitecture>(
            self,
            _: &'static DecoderFamily<A>,
            config: A::Config,
        ) -> Self::Output {
            let Run(dir, prompt, layout, o, device, on_text) = self;
            let tok = load_tokenizer(dir)?;
            let ids = prompt.token_ids(dir, &tok)?;
            let (tp, pp) = (layout.tensor_parallel_size, layout.pipeline_parallel_size);
            let (_, tp_group, pp_group) = DataParallel::<B>::join_mesh_pp(device, tp, pp)?;
            let (shard, _) = tensor_parallel_plan::<A, _>(&config, tp_group)?;
            let keep = inference_keep(&config, pp_group.as_deref(), layout)?;
            let model = A::load(dir, &config, device, shard, &keep)?;
            let model = match &prompt.adapter {
                Some(adapter) => {
                    crate::models::lora::load_adapter(model, adapter, device, &keep)?.0
                }
                None => model,
            };
            let model = model.for_inference();
            let Some(group) = pp_group else {
                let g = generate(&model, &tok, &config, &ids, o, on_text)?;
                return Ok((ids, g));
            };
            // The stages are cut as training and `kiln eval` cut them.
            let stage = eval_stage(&model, group.as_ref(), layout)?;
            let mut cache = model.new_cache();
            let next = |input: &[i64], sampler: &mut Sampler| {
                decode_stage(&model, &stage.stage, input, &mut cache, sampler)
            };
            let g = generate_by(next, &tok, &config, &ids, o, on_text)?;
            Ok((ids, g))
        }
    }
    let run = Run::<B, _>(dir, prompt, layout, o, device, on_text);
    with_causal_lm(&dir.join("config.json"), run)?
}

/// What `kiln generate` continues: the prompt, as text or as a user's turn of a chat, and the
/// LoRA adapter (a PEFT folder) to generate with, unmerged.
#[derive(Debug, Clone, Default)]
pub struct Prompt {
    pub text: String,
    /// Render the text as one user message with the model's chat template and its generation
    /// prompt (`apply_chat_template(..., add_generation_prompt=True)`).
    pub chat: bool,
    pub adapter: Option<PathBuf>,
}

impl Prompt {
    /// The prompt's token ids: the text with the tokenizer's special tokens, or the chat
    /// template's rendering without them (the template writes its own).
    pub fn token_ids(&self, dir: &Path, tok: &Tokenizer) -> Result<Vec<u32>> {
        let (text, special) = if self.chat {
            let bad =
                |e: crate::data::chat_template::ChatTemplateError| KilnError::Config(e.to_string());
            let template = ChatTemplate::from_model_dir(dir)
                .map_err(bad)?
                .ok_or_else(|| {
                    KilnError::Config(format!(
                        "--chat: {} has no chat template (tokenizer_config.json \"chat_template\" \
                     or chat_template.jinja); give the prompt as plain text instead",
                        dir.display()
                    ))
                })?;
            let message = crate::data::chat_template::Message::new("user", self.text.as_str());
            (template.render(&[message], true).map_err(bad)?.text, false)
        } else {
            (self.text.clone(), true)
        };
        crate::data::tokenize::check_text_size(&text, "the prompt")?;
        let enc = tok
            .encode(text, special)
            .map_err(|e| KilnError::Data(format!("tokenizing the prompt: {e}")))?;
        Ok(enc.get_ids().to_vec())
    }
}
