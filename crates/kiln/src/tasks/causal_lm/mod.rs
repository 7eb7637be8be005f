//! Causal language modelling with any decoder family (`models/decoder.rs`; Llama, Mistral, Qwen2
//! today): `kiln train --task causal-lm` (continued pretraining, or pretraining from
//! `--from-config`), `kiln eval --task causal-lm` (perplexity) and `kiln generate` (KV-cached
//! decoding, greedy or sampled). Each entry point reads `config.json` once, through
//! `models::auto::with_causal_lm`, and runs the family it names; nothing here names a family.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use burn::tensor::{Int, Tensor};
use tokenizers::Tokenizer;
use tracing::info;

use crate::contract::{BatchSource, CrossEntropy, Loss, IGNORE_INDEX};
use crate::data::chat_template::ChatTemplate;
use crate::data::lm::{read_documents, LmBlocks, TokenBatch};
use crate::data::preference::SpecialIds;
use crate::data::TextEncoding;
use crate::error::{KilnError, Result};
use crate::models::auto::with_causal_lm;
use crate::models::decoder::{DecoderArchitecture, DecoderConfig, DecoderFamily, DecoderVisitor};
use crate::ops::{KilnBackend, TrainBackend};
use crate::parallel::{DataParallel, SharedCollectives, TpGroup, VocabParallelCrossEntropy};
use crate::tasks::adapter::LoraSetup;
use crate::tasks::preference::{
    PreferenceData, PreferenceMethod, PreferenceSet, PreferenceTokenization,
};
use crate::tasks::reward::{RewardData, RewardSet, RewardTokenization};
use crate::tasks::sft::{SftData, SftSet, SftTokenization};
use crate::train::checkpoint::ModelFiles;
use crate::train::trainer::{EvalOutput, TokenMetrics, TrainOutput};
use crate::train::ParallelPlan;
use crate::train::{Trainer, TrainingArguments};

mod chunked;
mod eval;
mod generate;
mod sampler;
pub use chunked::{auto_chunk, ChunkedLossBatches, ChunkedMean};
pub use eval::*;
pub use generate::*;

/// Token blocks as training examples: each block's targets are its tokens shifted left by one, the
/// last position left out of the loss.
impl BatchSource for LmBlocks {
    type Batch = TokenBatch;
    fn len(&self) -> usize {
        self.blocks.len()
    }
    fn lengths(&self) -> Vec<usize> {
        vec![self.block_size; self.blocks.len()]
    }
    fn batch(&self, indices: &[usize]) -> (TokenBatch, Vec<i64>) {
        let seq = self.block_size;
        let mut ids = Vec::with_capacity(indices.len() * seq);
        let mut targets = Vec::with_capacity(indices.len() * seq);
        for &i in indices {
            let b = &self.blocks[i];
            ids.extend(b.iter().map(|&t| t as i64));
            targets.extend(b[1..].iter().map(|&t| t as i64));
            targets.push(IGNORE_INDEX);
        }
        (
            TokenBatch {
                ids,
                batch: indices.len(),
                seq,
                segments: Vec::new(),
                chunked_loss: None,
                scoring: None,
                carried: Default::default(),
                attended_tokens: None,
            },
            targets,
        )
    }
}

/// This rank's cut of a model of `config` over the tensor-parallel `group` (none without one) and
/// the loss that fits it. Worked out before any weight is read: more ranks than attention heads
/// is one sentence at once, not after minutes of loading.
fn tensor_parallel_plan<A: DecoderArchitecture, X: burn::tensor::backend::Backend>(
    config: &A::Config,
    group: Option<SharedCollectives<X>>,
) -> Result<(Option<A::Shard>, LmLoss)> {
    let Some(group) = group else {
        return Ok((None, LmLoss::Plain(CrossEntropy)));
    };
    let tp = TpGroup::comm(group);
    let shard = A::plan_shard(config, tp.clone())?;
    let loss = LmLoss::VocabParallel(VocabParallelCrossEntropy {
        tp,
        vocab: config.vocab_size(),
    });
    Ok((Some(shard), loss))
}

pub fn load_tokenizer(path: &Path) -> Result<Tokenizer> {
    let file = if path.is_dir() {
        path.join("tokenizer.json")
    } else {
        path.to_path_buf()
    };
    let mut tok = Tokenizer::from_file(&file).map_err(|e| {
        KilnError::Config(format!("{}: cannot load tokenizer: {e}", file.display()))
    })?;
    tok.with_padding(None);
    tok.with_truncation(None)
        .map_err(|e| KilnError::Config(format!("{}: {e}", file.display())))?;
    Ok(tok)
}

/// Where the model, tokenizer and data come from.
#[derive(Debug, Clone, Default)]
pub struct CausalLmOptions {
    /// A Hugging Face causal-LM folder (weights, config, tokenizer).
    pub model_dir: Option<PathBuf>,
    /// Start from random weights with this config.json instead (pretraining from scratch).
    pub from_config: Option<PathBuf>,
    /// tokenizer.json (or a folder holding one); defaults to the model folder's.
    pub tokenizer: Option<PathBuf>,
    pub train_file: Option<PathBuf>,
    pub eval_file: Option<PathBuf>,
    pub text_column: String,
    pub encoding: TextEncoding,
    pub strict: bool,
    pub block_size: usize,
    /// Use only the first N documents of each file.
    pub max_train_samples: Option<usize>,
    pub max_eval_samples: Option<usize>,
    /// Train a LoRA adapter (a fresh one or a PEFT folder's) on the frozen model instead of the
    /// model itself.
    pub lora: Option<LoraSetup>,
    /// What the frozen base of a LoRA run is held in (`--base-dtype`).
    pub lora_base_dtype: crate::models::lora::BaseDtype,
    /// Supervised fine-tuning (`--task sft`): rows of TRL's formats instead of a packed corpus.
    pub sft: Option<SftData>,
    /// Preference optimisation (`--task dpo`): preference rows and DPO's loss.
    pub dpo: Option<PreferenceData>,
    /// Reward modelling (`--task reward-modeling`): the model becomes a one-label sequence
    /// classifier trained on preference pairs.
    pub reward: Option<RewardData>,
    /// The loss of causal-LM and SFT training, and the completion scores of DPO and ORPO (their
    /// reference pass too), computed inside the output head this many positions at a time,
    /// never holding the whole logits: `None` picks [`auto_chunk`]'s size, `Some(0)` computes
    /// the whole logits first (as before). Under tensor parallelism each rank computes its
    /// vocabulary columns of each chunk; under a pipeline the last stage does. Not used with a
    /// user's loss or metrics (which read the logits).
    pub loss_chunk: Option<usize>,
}

impl CausalLmOptions {
    fn tokenizer_path(&self) -> Result<PathBuf> {
        self.tokenizer
            .clone()
            .or_else(|| self.model_dir.as_ref().map(|d| d.join("tokenizer.json")))
            .ok_or_else(|| {
                KilnError::Config(
                    "--from-config needs --tokenizer (or --model for its tokenizer)".into(),
                )
            })
    }

    fn blocks(
        &self,
        path: &Path,
        tok: &Tokenizer,
        eos: Option<u32>,
        limit: Option<usize>,
    ) -> Result<LmBlocks> {
        let (mut docs, report) =
            read_documents(path, &self.text_column, self.encoding, self.strict)?;
        info!("{}: {}", path.display(), report.summary());
        if let Some(n) = limit {
            docs.truncate(n);
        }
        let blocks = LmBlocks::from_documents(tok, &docs, eos, self.block_size)?;
        if blocks.is_empty() {
            return Err(KilnError::Data(format!(
                "{}: {} tokens, fewer than one block of --block-size {}",
                path.display(),
                blocks.tokens,
                self.block_size
            )));
        }
        info!(
            "{}: {} documents, {} tokens → {} blocks of {}",
            path.display(),
            blocks.documents,
            blocks.tokens,
            blocks.len(),
            self.block_size
        );
        Ok(blocks)
    }
}

/// RoPE has no position table to overrun, but a model was trained only up to
/// `max_position_embeddings`: past it, quality is not what the config promises.
pub fn warn_beyond_positions(config: &impl DecoderConfig, len: usize, what: &str) {
    if len > config.max_position_embeddings() {
        tracing::warn!(
            "{what} {len} is beyond the model's max_position_embeddings {}: positions past it were \
             never trained",
            config.max_position_embeddings()
        );
    }
}

/// The token that ends a document: the config's first `eos_token_id`, else the tokenizer's.
fn eos_id(config: &impl DecoderConfig, tok: &Tokenizer) -> Option<u32> {
    config.eos_ids().first().copied().or_else(|| {
        ["</s>", "<|endoftext|>", "<|end_of_text|>"]
            .iter()
            .find_map(|t| tok.token_to_id(t))
    })
}

/// Continued pretraining (or pretraining from a config) on a text corpus, or SFT; reports loss and
/// perplexity, saves folders transformers loads.
pub fn train<B: TrainBackend>(
    opts: &CausalLmOptions,
    args: TrainingArguments,
    device: &B::Device,
) -> Result<(TrainOutput, Option<EvalOutput>)> {
    train_with::<B, CrossEntropy>(opts, args, device, None, None)
}

/// [`train`] with the user's `loss` (instead of the cross-entropy) and streamed evaluation
/// `metrics`, both honoured in training and evaluation under data and tensor parallelism (as
/// transformers' `compute_loss_func` and `compute_metrics` with `batch_eval_metrics`). The loss
/// sees one row of logits per token over the whole vocabulary and the targets (`IGNORE_INDEX`
/// where no token is predicted: prompt tokens, padding, the last position); under tensor
/// parallelism the vocabulary-parallel logits are put together for it first (forward: each
/// rank's columns summed into the whole row; backward: each rank keeps its columns' gradient),
/// which costs the memory of whole logits that the built-in vocabulary-parallel loss avoids.
pub fn train_with<B: TrainBackend, L: Loss + Clone + 'static>(
    opts: &CausalLmOptions,
    args: TrainingArguments,
    device: &B::Device,
    loss: Option<L>,
    metrics: Option<Arc<dyn TokenMetrics>>,
) -> Result<(TrainOutput, Option<EvalOutput>)> {
    // Join the job first: workers meet before each spends time loading.
    let pipeline = args.pipeline()?;
    let (parallel, tp_group, pp_group) = DataParallel::<B::InnerBackend>::join_mesh_pp(
        device,
        args.tensor_parallel_size,
        args.pipeline_parallel_size,
    )?;
    // The batch arithmetic is checked before anything is loaded.
    let mut args = args;
    args.resolve_global_batch(parallel.size())?;
    let config_path = match (&opts.from_config, &opts.model_dir) {
        (Some(cfg), _) => cfg.clone(),
        (None, Some(dir)) => dir.join("config.json"),
        (None, None) => {
            return Err(KilnError::Config(
                "give --model DIR or --from-config FILE".into(),
            ))
        }
    };
    struct Run<'a, B: TrainBackend, L> {
        opts: &'a CausalLmOptions,
        args: TrainingArguments,
        device: &'a B::Device,
        parallel: DataParallel<B::InnerBackend>,
        tp_group: Option<SharedCollectives<B::InnerBackend>>,
        pipeline: (
            Option<SharedCollectives<B::InnerBackend>>,
            Option<crate::train::PipelineOptions>,
        ),
        user: User<L>,
    }
    impl<B: TrainBackend, L: Loss + Clone + 'static> DecoderVisitor for Run<'_, B, L> {
        type Output = Result<(TrainOutput, Option<EvalOutput>)>;
        fn visit<A: DecoderArchitecture>(
            self,
            family: &'static DecoderFamily<A>,
            config: A::Config,
        ) -> Self::Output {
            train_family::<B, A, L>(
                family,
                self.opts,
                self.args,
                self.device,
                Layout {
                    data: self.parallel,
                    tp: self.tp_group,
                    pp: self.pipeline,
                },
                config,
                self.user,
            )
        }
    }
    // config.json is read and validated once, here.
    let run = Run::<B, L> {
        opts,
        args,
        device,
        parallel,
        tp_group,
        pipeline: (pp_group, pipeline),
        user: User { loss, metrics },
    };
    with_causal_lm(&config_path, run)?
}

/// The run's parallel layout as joined: the data-parallel strategy, this rank's tensor-parallel
/// group, and its pipeline group with the pipeline options.
struct Layout<B: burn::tensor::backend::Backend> {
    data: DataParallel<B>,
    tp: Option<SharedCollectives<B>>,
    pp: (
        Option<SharedCollectives<B>>,
        Option<crate::train::PipelineOptions>,
    ),
}

/// What a library user gives [`train_with`].
struct User<L> {
    loss: Option<L>,
    metrics: Option<Arc<dyn TokenMetrics>>,
}

/// [`train_with`] with the family's architecture `A` and its `config`.
fn train_family<B: TrainBackend, A: DecoderArchitecture, L: Loss + Clone + 'static>(
    family: &'static DecoderFamily<A>,
    opts: &CausalLmOptions,
    args: TrainingArguments,
    device: &B::Device,
    layout: Layout<B::InnerBackend>,
    config: A::Config,
    user: User<L>,
) -> Result<(TrainOutput, Option<EvalOutput>)> {
    let Layout {
        data: parallel,
        tp: tp_group,
        pp: (pp_group, pipeline),
    } = layout;
    // The cut is worked out (and refused) before the tokenizer is looked for; it does not
    // depend on the head.
    let (shard, builtin) = tensor_parallel_plan::<A, _>(&config, tp_group)?;
    let tok_path = opts.tokenizer_path()?;
    let tok = load_tokenizer(&tok_path)?;
    let config = head_for_task(family, opts, config, &tok)?;
    // Under tensor parallelism the user's loss and metrics see whole rows of logits.
    let whole_vocab = match &builtin {
        LmLoss::VocabParallel(v) => Some(WholeVocab::new(v.tp.clone(), v.vocab)),
        LmLoss::Plain(_) | LmLoss::Chunked(_) => None,
    };
    let loss = match user.loss {
        None => CausalLmLoss::Builtin(builtin),
        Some(loss) => CausalLmLoss::User {
            loss,
            whole_vocab: whole_vocab.clone(),
        },
    };
    let metrics: Option<Arc<dyn TokenMetrics>> = match (user.metrics, whole_vocab) {
        (Some(m), Some(w)) => Some(Arc::new(WholeVocabMetrics { inner: m, whole: w })),
        (m, _) => m,
    };
    // A pipeline is cut from the config before anything is built, so each stage builds and
    // reads only its own layers.
    let mut plan = ParallelPlan::new(parallel).with_pipeline(pp_group, pipeline);
    plan.cut_before_building(&decoder_outline(&config))?;
    let keep = plan.keep();
    // Each rank holds only its shard (and stage) from the start: a whole model is built (from
    // the seed) layer by layer and cut, or loaded tensor by tensor and cut, so TP = N and PP = N
    // start from exactly the weights of one process.
    let model = match (&opts.from_config, &opts.model_dir) {
        (Some(cfg), _) => {
            let model = A::fresh::<B>(&config, device, shard, args.seed, &keep)?;
            info!(
                "{}: random initialisation (seed {})",
                cfg.display(),
                args.seed
            );
            model
        }
        (None, Some(dir)) => A::load::<B>(dir, &config, device, shard, &keep)?,
        (None, None) => unreachable!("checked by train"),
    };
    crate::data::tokenize::check_ids_fit(&tok, &tok_path, config.vocab_size())?;
    warn_beyond_positions(&config, opts.block_size, "--block-size");
    let eos = eos_id(&config, &tok);
    let train_file = opts
        .train_file
        .as_ref()
        .ok_or_else(|| KilnError::Config("kiln train needs --train-file".into()))?;
    // Positions per chunk of the output head's product and loss (0: the whole logits).
    let loss_chunk = opts
        .loss_chunk
        .unwrap_or_else(|| auto_chunk(config.vocab_size()));
    let data = match (&opts.sft, &opts.dpo, &opts.reward) {
        (_, _, Some(reward)) => {
            let (train, eval) = reward_sets(opts, reward, &tok, eos, train_file)?;
            RunData::Reward(train, eval, reward)
        }
        (_, Some(dpo), None) => {
            let (train, eval) = preference_sets(opts, dpo, &tok, eos, train_file, loss_chunk)?;
            let (train, eval) = if dpo.method.needs_reference() {
                // The reference is the policy before training: the model as loaded, before any
                // adapter is put on it; in batches of the run's sizes (TRL's
                // `precompute_ref_batch_size` default).
                // Under a pipeline each stage runs its layers, the last its head.
                let reference = burn::module::AutodiffModule::valid(&A::trainable(model.clone()));
                let stage = plan.pipeline().map(|p| p.stage());
                use crate::contract::Model;
                let scores_of = |batch: &TokenBatch| match (&stage, reference.segments()) {
                    (Some(stage), Some(segments)) => stage.forward_only(segments, batch),
                    _ => Ok(Some(reference.logits(batch))),
                };
                let stages = stage.as_ref().map(|s| s.group);
                let train = train.with_reference(
                    scores_of,
                    args.per_device_train_batch_size,
                    &plan.data,
                    stages,
                )?;
                let eval = match eval {
                    Some(e) => Some(e.with_reference(
                        scores_of,
                        args.per_device_eval_batch_size,
                        &plan.data,
                        stages,
                    )?),
                    None => None,
                };
                info!("reference log-probabilities computed for every preference pair");
                (train, eval)
            } else {
                (train, eval)
            };
            RunData::Preference(train, eval, dpo)
        }
        (Some(sft), None, None) => {
            let (train, eval) = sft_sets(opts, sft, &tok, eos, train_file)?;
            RunData::Lm(LmData::Sft(train), eval.map(LmData::Sft))
        }
        (None, None, None) => RunData::Lm(
            LmData::Blocks(opts.blocks(train_file, &tok, eos, opts.max_train_samples)?),
            match &opts.eval_file {
                Some(p) => Some(LmData::Blocks(opts.blocks(
                    p,
                    &tok,
                    eos,
                    opts.max_eval_samples,
                )?)),
                None => None,
            },
        ),
    };
    let mut files = model_files(opts, &tok_path, &config);
    let model = match &opts.lora {
        None => model,
        Some(lora) => {
            let (model, adapter) = crate::tasks::adapter::with_adapter(
                model,
                lora,
                opts.lora_base_dtype,
                args.seed,
                opts.model_dir.as_deref(),
                device,
                &keep,
            )?;
            files.adapter = Some(adapter);
            model
        }
    };
    let model = A::trainable(model);
    let origin = crate::train::RunOrigin::from_paths(
        opts.model_dir.as_deref(),
        opts.train_file.as_deref(),
        opts.eval_file.as_deref(),
        // A reward model is a sequence classifier (the model card's task).
        opts.reward.is_none(),
    );
    let chunked = loss_chunk > 0
        && matches!(
            loss,
            CausalLmLoss::Builtin(LmLoss::Plain(_) | LmLoss::VocabParallel(_))
        )
        && metrics.is_none();
    let builder = Trainer::<B, _>::builder(args, model, device.clone())
        .files(files)
        .parallel(plan)
        .origin(origin);
    // TRL's SFT, DPO and reward trainers log the tokens trained on; its ORPO trainer and a plain
    // causal LM's (transformers' Trainer) do not.
    let dpo = opts
        .dpo
        .as_ref()
        .is_some_and(|d| d.method != PreferenceMethod::Orpo);
    let builder = match opts.sft.is_some() || dpo || opts.reward.is_some() {
        true => builder.log_num_tokens(),
        false => builder,
    };
    match data {
        RunData::Lm(train, eval) if chunked => {
            info!("the loss is computed in the output head, {loss_chunk} positions at a time");
            let train = ChunkedLossBatches {
                inner: &train,
                chunk: loss_chunk,
            };
            let eval = eval.as_ref().map(|inner| ChunkedLossBatches {
                inner,
                chunk: loss_chunk,
            });
            builder
                .loss(CausalLmLoss::<L>::Builtin(LmLoss::Chunked(ChunkedMean)))
                .build()
                .train_and_evaluate(&train, eval.as_ref())
        }
        RunData::Lm(train, eval) => builder
            .loss(loss)
            .token_metrics(metrics)
            .build()
            .train_and_evaluate(&train, eval.as_ref()),
        RunData::Preference(train, eval, dpo) => builder
            .loss(dpo.loss())
            .token_metrics(Some(dpo.metrics()))
            .train_metrics(dpo.metrics())
            .no_perplexity()
            .build()
            .train_and_evaluate(&train, eval.as_ref()),
        RunData::Reward(train, eval, reward) => builder
            .loss(reward.loss())
            .token_metrics(Some(reward.metrics()))
            .train_metrics(reward.metrics())
            .no_perplexity()
            .build()
            .train_and_evaluate(&train, eval.as_ref()),
    }
}

/// The config of the model the task trains: a causal LM's as it is; for `--task reward-modeling`,
/// the same decoder with a one-label `score` head (a causal LM's folder is read as transformers'
/// `AutoModelForSequenceClassification.from_pretrained(…, num_labels=1)` reads it), and the
/// tokenizer's padding token as `pad_token_id` where the config has none (as TRL sets it), since
/// each row is scored before its padding.
pub(super) fn head_for_task<A: DecoderArchitecture>(
    family: &'static DecoderFamily<A>,
    opts: &CausalLmOptions,
    config: A::Config,
    tok: &Tokenizer,
) -> Result<A::Config> {
    let config_path = || {
        opts.from_config
            .clone()
            .or_else(|| opts.model_dir.as_ref().map(|d| d.join("config.json")))
            .unwrap_or_default()
    };
    let labels = config.sequence_classifier_labels();
    if opts.reward.is_none() {
        return match labels {
            Some(_) => Err(KilnError::Config(format!(
                "{}: architectures names a sequence classifier (a reward model): use --task \
                 reward-modeling",
                config_path().display()
            ))),
            None => Ok(config),
        };
    }
    let config = match labels {
        None => config.into_sequence_classifier(family.class_prefix, 1),
        Some(1) => config,
        Some(n) => {
            return Err(KilnError::Config(format!(
                "{}: a sequence classifier of {n} labels; a reward model has one (id2label of \
                 one entry)",
                config_path().display()
            )))
        }
    };
    if config.pad_token_id().is_some() {
        return Ok(config);
    }
    let eos = eos_id(&config, tok);
    let pad = ChatSetup::of(opts, tok, eos)?.pad_id;
    info!("pad_token_id is not in the config: rows are scored before token {pad} (the tokenizer's padding token, else its EOS)");
    Ok(config.with_pad_token_id(pad))
}

/// The training and evaluation pairs of `--task reward-modeling`, prepared with the model
/// folder's chat template and special tokens.
fn reward_sets(
    opts: &CausalLmOptions,
    reward: &RewardData,
    tok: &Tokenizer,
    eos: Option<u32>,
    train_file: &Path,
) -> Result<(RewardSet, Option<RewardSet>)> {
    let train = reward_set(opts, reward, tok, eos, train_file, opts.max_train_samples)?;
    let eval = match &opts.eval_file {
        Some(p) => Some(reward_set(
            opts,
            reward,
            tok,
            eos,
            p,
            opts.max_eval_samples,
        )?),
        None => None,
    };
    Ok((train, eval))
}

/// The pairs of `path` (its first `limit`) for `--task reward-modeling`.
pub(super) fn reward_set(
    opts: &CausalLmOptions,
    reward: &RewardData,
    tok: &Tokenizer,
    eos: Option<u32>,
    path: &Path,
    limit: Option<usize>,
) -> Result<RewardSet> {
    let setup = ChatSetup::of(opts, tok, eos)?;
    let mut options = reward.options.clone();
    if options.eos_token.is_none() {
        options.eos_token = setup.eos_token.clone();
    }
    let how = RewardTokenization {
        tokenizer: tok,
        template: setup.template.as_ref(),
        options: &options,
    };
    let set = RewardSet::read(path, &how, setup.pad_id, opts.strict, limit)?;
    Ok(RewardSet {
        pad_to_multiple_of: reward.pad_to_multiple_of,
        ..set
    })
}

/// A run's training and evaluation data: a corpus or SFT rows, preference pairs with the settings
/// of their loss, or reward pairs with theirs.
enum RunData<'a> {
    Lm(LmData, Option<LmData>),
    Preference(PreferenceSet, Option<PreferenceSet>, &'a PreferenceData),
    Reward(RewardSet, Option<RewardSet>, &'a RewardData),
}

/// The chat template of the model folder (if it has one), the EOS token string completions get,
/// and the padding id (the pad token, else EOS, as TRL's collators pad).
struct ChatSetup {
    template: Option<ChatTemplate>,
    eos_token: Option<String>,
    pad_id: u32,
    /// The tokenizer's BOS token's id, if it has one (what ORPO puts before a prompt).
    bos_id: Option<u32>,
}

impl ChatSetup {
    fn of(opts: &CausalLmOptions, tok: &Tokenizer, eos: Option<u32>) -> Result<Self> {
        let dir = opts.model_dir.as_deref();
        let bad =
            |e: crate::data::chat_template::ChatTemplateError| KilnError::Config(e.to_string());
        let template = match dir {
            Some(d) => ChatTemplate::from_model_dir(d).map_err(bad)?,
            None => None,
        };
        let special = match dir {
            Some(d) => crate::data::chat_template::special_tokens(d).map_err(bad)?,
            None => Default::default(),
        };
        let eos_token = special
            .get("eos_token")
            .cloned()
            .or_else(|| eos.and_then(|id| tok.id_to_token(id)));
        let pad_id = special
            .get("pad_token")
            .and_then(|t| tok.token_to_id(t))
            .or(eos)
            .unwrap_or(0);
        let bos_id = special.get("bos_token").and_then(|t| tok.token_to_id(t));
        Ok(Self {
            template,
            eos_token,
            pad_id,
            bos_id,
        })
    }
}

/// The training and evaluation pairs of `--task dpo`, prepared with the model folder's chat
/// template and special tokens.
fn preference_sets(
    opts: &CausalLmOptions,
    dpo: &PreferenceData,
    tok: &Tokenizer,
    eos: Option<u32>,
    train_file: &Path,
    loss_chunk: usize,
) -> Result<(PreferenceSet, Option<PreferenceSet>)> {
    let setup = ChatSetup::of(opts, tok, eos)?;
    let mut options = dpo.options.clone();
    if options.eos_token.is_none() {
        options.eos_token = setup.eos_token.clone();
    }
    let eos_id = options
        .eos_token
        .as_deref()
        .and_then(|t| tok.token_to_id(t))
        .or(eos);
    let how = PreferenceTokenization {
        tokenizer: tok,
        template: setup.template.as_ref(),
        options: &options,
        orpo: (dpo.method == PreferenceMethod::Orpo).then_some(SpecialIds {
            bos: setup.bos_id,
            eos: eos_id,
        }),
    };
    let read = |path: &Path, limit| -> Result<PreferenceSet> {
        let set = PreferenceSet::read(path, &how, setup.pad_id, opts.strict, limit)?;
        Ok(PreferenceSet {
            pad_to_multiple_of: dpo.pad_to_multiple_of,
            loss_chunk,
            ..set
        })
    };
    let train = read(train_file, opts.max_train_samples)?;
    let eval = match &opts.eval_file {
        Some(p) => Some(read(p, opts.max_eval_samples)?),
        None => None,
    };
    Ok((train, eval))
}

/// The training and evaluation rows of `--task sft`, prepared with the model folder's chat
/// template and special tokens.
fn sft_sets(
    opts: &CausalLmOptions,
    sft: &SftData,
    tok: &Tokenizer,
    eos: Option<u32>,
    train_file: &Path,
) -> Result<(SftSet, Option<SftSet>)> {
    let dir = opts.model_dir.as_deref();
    let ChatSetup {
        template,
        eos_token,
        pad_id,
        ..
    } = ChatSetup::of(opts, tok, eos)?;
    let mut options = sft.options.clone();
    if options.eos_token.is_none() {
        options.eos_token = eos_token;
    }
    let how = SftTokenization {
        tokenizer: tok,
        template: template.as_ref(),
        options: &options,
        model_dir: dir,
    };
    let pack = |set: SftSet| {
        let set = SftSet {
            pad_to_multiple_of: sft.pad_to_multiple_of,
            ..set
        };
        match (sft.packing, options.max_length) {
            (true, Some(capacity)) => set.pack(capacity),
            _ => set,
        }
    };
    let train = SftSet::read(
        train_file,
        &how,
        pad_id,
        opts.strict,
        opts.max_train_samples,
    )?;
    if sft.print_masks > 0 && crate::parallel::is_main_process()? {
        for (i, ex) in train.examples.iter().take(sft.print_masks).enumerate() {
            let shown = ex
                .show_masks(tok)
                .map_err(|e| KilnError::Data(e.to_string()))?;
            println!(
                "{} example {i} ({} tokens; + trained on, · not):\n{shown}",
                train_file.display(),
                ex.input_ids.len()
            );
        }
    }
    let eval = match &opts.eval_file {
        Some(p) => Some(SftSet::read(
            p,
            &how,
            pad_id,
            opts.strict,
            opts.max_eval_samples,
        )?),
        None => None,
    };
    Ok((pack(train), eval.map(pack)))
}

/// A causal LM's training data: a corpus packed into blocks, or SFT rows.
pub enum LmData {
    Blocks(LmBlocks),
    Sft(SftSet),
}

impl BatchSource for LmData {
    type Batch = TokenBatch;
    fn len(&self) -> usize {
        match self {
            Self::Blocks(b) => b.len(),
            Self::Sft(s) => s.len(),
        }
    }
    fn lengths(&self) -> Vec<usize> {
        match self {
            Self::Blocks(b) => b.lengths(),
            Self::Sft(s) => s.lengths(),
        }
    }
    fn batch(&self, indices: &[usize]) -> (TokenBatch, Vec<i64>) {
        match self {
            Self::Blocks(b) => b.batch(indices),
            Self::Sft(s) => s.batch(indices),
        }
    }
}

/// What a trained causal LM's folder holds besides its weights: the config, the tokenizer and
/// its settings from the source folder.
fn model_files(opts: &CausalLmOptions, tok_path: &Path, config: &impl DecoderConfig) -> ModelFiles {
    let source = opts
        .model_dir
        .clone()
        .unwrap_or_else(|| tok_path.to_path_buf());
    let source = if source.is_dir() {
        source
    } else {
        source.parent().map(Path::to_path_buf).unwrap_or_default()
    };
    ModelFiles {
        config_json: config.to_json(),
        tokenizer_json: Some(if tok_path.is_dir() {
            tok_path.join("tokenizer.json")
        } else {
            tok_path.to_path_buf()
        }),
        copy: [
            "tokenizer_config.json",
            "generation_config.json",
            "special_tokens_map.json",
            // transformers 5 saves the chat template beside tokenizer_config.json.
            "chat_template.jinja",
        ]
        .iter()
        .map(|f| source.join(f))
        .collect(),
        source_dir: opts.model_dir.clone(),
        adapter: None,
    }
}

/// A causal LM's loss: plain cross-entropy, its vocab-parallel form for a sharded model, or the
/// mean of the losses the head computed in chunks.
#[derive(Debug, Clone)]
pub enum LmLoss {
    Plain(CrossEntropy),
    VocabParallel(VocabParallelCrossEntropy),
    Chunked(ChunkedMean),
}

impl Loss for LmLoss {
    fn loss<B: KilnBackend>(
        &self,
        logits: Tensor<B, 2>,
        targets: Tensor<B, 1, Int>,
    ) -> Tensor<B, 1> {
        match self {
            Self::Plain(l) => l.loss(logits, targets),
            Self::VocabParallel(l) => l.loss(logits, targets),
            Self::Chunked(l) => l.loss(logits, targets),
        }
    }
}

/// A causal LM's training loss: the built-in one ([`LmLoss`]), or the user's, given whole rows of
/// logits.
#[derive(Debug, Clone)]
pub enum CausalLmLoss<L> {
    Builtin(LmLoss),
    User {
        loss: L,
        /// Under tensor parallelism: how this rank's vocabulary columns become whole rows.
        whole_vocab: Option<WholeVocab>,
    },
}

impl<L: Loss> Loss for CausalLmLoss<L> {
    fn loss<B: KilnBackend>(
        &self,
        logits: Tensor<B, 2>,
        targets: Tensor<B, 1, Int>,
    ) -> Tensor<B, 1> {
        match self {
            Self::Builtin(l) => l.loss(logits, targets),
            Self::User { loss, whole_vocab } => {
                let logits = match whole_vocab {
                    Some(w) => w.gather(logits),
                    None => logits,
                };
                loss.loss(logits, targets)
            }
        }
    }
}

/// A tensor-parallel rank's vocabulary columns of the logits (the vocabulary-parallel head's
/// cut), put together into whole rows on every rank of the group.
#[derive(Debug, Clone)]
pub struct WholeVocab(crate::ops::VocabSlice);

impl WholeVocab {
    /// The decoder families cut the vocabulary as `ops::chunk_range` cuts it (`LlamaShard`).
    fn new(tp: crate::ops::TpComm, vocab: usize) -> Self {
        Self(crate::ops::VocabSlice::of(tp, vocab))
    }

    /// `[tokens, columns]` → `[tokens, vocab]`: this rank's columns set in zeros, summed over the
    /// group. The sum's backward is the identity, so each rank's logits get their own columns of
    /// the whole rows' gradient (which every rank computes alike).
    fn gather<B: KilnBackend>(&self, logits: Tensor<B, 2>) -> Tensor<B, 2> {
        let [n, width] = logits.dims();
        let (columns, vocab) = (&self.0.columns, self.0.vocab);
        assert_eq!(width, columns.len(), "this rank's vocabulary columns");
        let device = logits.device();
        let mut parts = Vec::with_capacity(3);
        if columns.start > 0 {
            parts.push(Tensor::zeros([n, columns.start], &device));
        }
        parts.push(logits);
        if columns.end < vocab {
            parts.push(Tensor::zeros([n, vocab - columns.end], &device));
        }
        crate::ops::tp_sum(Tensor::cat(parts, 1), &self.0.tp)
    }

    /// [`Self::gather`] of host rows.
    fn gather_host(&self, logits: &[f32], tokens: usize) -> Vec<f32> {
        let (columns, vocab) = (&self.0.columns, self.0.vocab);
        let mut whole = vec![0f32; tokens * vocab];
        for (row, part) in whole
            .chunks_mut(vocab)
            .zip(logits.chunks(columns.len().max(1)))
        {
            row[columns.clone()].copy_from_slice(part);
        }
        self.0.tp.sum(whole)
    }
}

/// The user's streamed metrics, given whole rows of logits under tensor parallelism.
struct WholeVocabMetrics {
    inner: Arc<dyn TokenMetrics>,
    whole: WholeVocab,
}

impl TokenMetrics for WholeVocabMetrics {
    fn batch(&self, logits: &[f32], _vocab: usize, targets: &[i64]) -> Vec<f64> {
        if targets.is_empty() {
            return self.inner.batch(&[], 0, &[]);
        }
        let whole = self.whole.gather_host(logits, targets.len());
        self.inner.batch(&whole, self.whole.0.vocab, targets)
    }
    fn finish(&self, totals: &[f64]) -> Vec<(String, f64)> {
        self.inner.finish(totals)
    }
}
