//! Causal language modelling with any decoder family (`models/decoder.rs`; Llama, Mistral, Qwen2
//! today): `kiln train --task causal-lm` (continued pretraining, or pretraining from
//! `--from-config`), `kiln eval --task causal-lm` (perplexity) and `kiln generate` (KV-cached
//! decoding, greedy or sampled). Each entry point reads `config.json` once, through
//! `models::auto::with_causal_lm`, and runs the family it names; nothing here names a family.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use burn::tensor::{Int, Tensor, TensorData};
use rand::{rngs::StdRng, Rng, SeedableRng};
use tokenizers::Tokenizer;
use tracing::info;

use crate::contract::{BatchSource, CrossEntropy, Loss, IGNORE_INDEX};
use crate::data::chat_template::ChatTemplate;
use crate::data::lm::{read_documents, LmBlocks, TokenBatch};
use crate::data::TextEncoding;
use crate::error::{KilnError, Result};
use crate::models::auto::with_causal_lm;
use crate::models::decoder::{
    CausalLm, DecoderArchitecture, DecoderConfig, DecoderFamily, DecoderVisitor,
};
use crate::ops::{KilnBackend, TrainBackend};
use crate::parallel::{DataParallel, SharedCollectives, TpGroup, VocabParallelCrossEntropy};
use crate::tasks::adapter::LoraSetup;
use crate::tasks::sft::{SftData, SftSet, SftTokenization};
use crate::train::checkpoint::ModelFiles;
use crate::train::evaluate::evaluate_by;
use crate::train::trainer::{evaluate, EvalOutput, Reported, TokenMetrics, TrainOutput};
use crate::train::{ModelOutline, ParallelPlan};
use crate::train::{Trainer, TrainingArguments};

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
            _: &'static DecoderFamily<A>,
            config: A::Config,
        ) -> Self::Output {
            train_family::<B, A, L>(
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
    let (shard, builtin) = tensor_parallel_plan::<A, _>(&config, tp_group)?;
    // Under tensor parallelism the user's loss and metrics see whole rows of logits.
    let whole_vocab = match &builtin {
        LmLoss::VocabParallel(v) => Some(WholeVocab::new(v.tp.clone(), v.vocab)),
        LmLoss::Plain(_) => None,
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
    let tok_path = opts.tokenizer_path()?;
    let tok = load_tokenizer(&tok_path)?;
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
    let (train_set, eval_set) = match &opts.sft {
        None => (
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
        Some(sft) => {
            let (train, eval) = sft_sets(opts, sft, &tok, eos, train_file)?;
            (LmData::Sft(train), eval.map(LmData::Sft))
        }
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
    let mut trainer = Trainer::<B, _, _>::new(args, model, device.clone(), loss, files, plan);
    trainer.token_metrics = metrics;
    trainer.origin = crate::train::RunOrigin::from_paths(
        opts.model_dir.as_deref(),
        opts.train_file.as_deref(),
        opts.eval_file.as_deref(),
        true,
    );
    trainer.train_and_evaluate(&train_set, eval_set.as_ref())
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
    let bad = |e: crate::data::chat_template::ChatTemplateError| KilnError::Config(e.to_string());
    let template = match dir {
        Some(d) => ChatTemplate::from_model_dir(d).map_err(bad)?,
        None => None,
    };
    let special = match dir {
        Some(d) => crate::data::chat_template::special_tokens(d).map_err(bad)?,
        None => Default::default(),
    };
    let mut options = sft.options.clone();
    if options.eos_token.is_none() {
        options.eos_token = special
            .get("eos_token")
            .cloned()
            .or_else(|| eos.and_then(|id| tok.id_to_token(id)));
    }
    // TRL's collator pads with the pad token, else EOS.
    let pad_id = special
        .get("pad_token")
        .and_then(|t| tok.token_to_id(t))
        .or(eos)
        .unwrap_or(0);
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
        ]
        .iter()
        .map(|f| source.join(f))
        .collect(),
        source_dir: opts.model_dir.clone(),
        adapter: None,
    }
}

/// A causal LM's loss: plain cross-entropy, or its vocab-parallel form for a sharded model.
#[derive(Debug, Clone)]
pub enum LmLoss {
    Plain(CrossEntropy),
    VocabParallel(VocabParallelCrossEntropy),
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
pub struct WholeVocab {
    tp: crate::ops::TpComm,
    /// This rank's columns, of `vocab`.
    columns: std::ops::Range<usize>,
    vocab: usize,
}

impl WholeVocab {
    /// The decoder families cut the vocabulary as `ops::chunk_range` cuts it (`LlamaShard`).
    fn new(tp: crate::ops::TpComm, vocab: usize) -> Self {
        let columns = crate::ops::chunk_range(vocab, tp.size(), tp.rank());
        Self { tp, columns, vocab }
    }

    /// `[tokens, columns]` → `[tokens, vocab]`: this rank's columns set in zeros, summed over the
    /// group. The sum's backward is the identity, so each rank's logits get their own columns of
    /// the whole rows' gradient (which every rank computes alike).
    fn gather<B: KilnBackend>(&self, logits: Tensor<B, 2>) -> Tensor<B, 2> {
        let [n, width] = logits.dims();
        assert_eq!(width, self.columns.len(), "this rank's vocabulary columns");
        let device = logits.device();
        let mut parts = Vec::with_capacity(3);
        if self.columns.start > 0 {
            parts.push(Tensor::zeros([n, self.columns.start], &device));
        }
        parts.push(logits);
        if self.columns.end < self.vocab {
            parts.push(Tensor::zeros([n, self.vocab - self.columns.end], &device));
        }
        crate::ops::tp_sum(Tensor::cat(parts, 1), &self.tp)
    }

    /// [`Self::gather`] of host rows.
    fn gather_host(&self, logits: &[f32], tokens: usize) -> Vec<f32> {
        let width = self.columns.len();
        let mut whole = vec![0f32; tokens * self.vocab];
        for (row, part) in whole
            .chunks_mut(self.vocab)
            .zip(logits.chunks(width.max(1)))
        {
            row[self.columns.clone()].copy_from_slice(part);
        }
        self.tp.sum(whole)
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
        self.inner.batch(&whole, self.whole.vocab, targets)
    }
    fn finish(&self, totals: &[f64]) -> Vec<(String, f64)> {
        self.inner.finish(totals)
    }
}

/// How `kiln eval` and `kiln generate` spread a model over the processes started together: its
/// tensor-parallel size, and its pipeline stages with their cut (as training cuts them).
#[derive(Debug, Clone)]
pub struct InferenceLayout {
    pub tensor_parallel_size: usize,
    pub pipeline_parallel_size: usize,
    /// `--pipeline-cuts`: where stages 1, 2, … begin (`None`: the default cut).
    pub pipeline_cuts: Option<Vec<usize>>,
}

impl InferenceLayout {
    /// The layout the command line asks for: `--pipeline-cuts` as written (`4,8`); a size of 0 is
    /// one sentence (not read as 1).
    pub fn from_args(
        tensor_parallel_size: usize,
        pipeline_parallel_size: usize,
        pipeline_cuts: Option<&str>,
    ) -> Result<Self> {
        for (flag, n) in [
            ("--tensor-parallel-size", tensor_parallel_size),
            ("--pipeline-parallel-size", pipeline_parallel_size),
        ] {
            if n == 0 {
                return Err(KilnError::Config(format!(
                    "{flag} 0: a model is cut over at least 1 process"
                )));
            }
        }
        Ok(Self {
            tensor_parallel_size,
            pipeline_parallel_size,
            pipeline_cuts: pipeline_cuts
                .map(crate::parallel::pipeline::parse_cuts)
                .transpose()?,
        })
    }
}

/// Loss and perplexity of a model folder on a held-out corpus (every rank's own result).
pub fn eval<B: KilnBackend>(
    opts: &CausalLmOptions,
    batch_size: usize,
    tensor_parallel_size: usize,
    device: &B::Device,
) -> Result<EvalOutput> {
    let layout = InferenceLayout {
        tensor_parallel_size,
        pipeline_parallel_size: 1,
        pipeline_cuts: None,
    };
    Ok(eval_layout::<B>(opts, batch_size, &layout, device)?.0)
}

/// [`eval`] at `layout`; also says whether this rank reports the result: the world's first rank
/// (under a pipeline the last stage computes it and hands it to the first).
pub fn eval_layout<B: KilnBackend>(
    opts: &CausalLmOptions,
    batch_size: usize,
    layout: &InferenceLayout,
    device: &B::Device,
) -> Result<(EvalOutput, bool)> {
    let dir = opts
        .model_dir
        .as_ref()
        .ok_or_else(|| KilnError::Config("kiln eval needs --model".into()))?;
    struct Run<'a, B: KilnBackend>(
        &'a CausalLmOptions,
        &'a Path,
        usize,
        &'a InferenceLayout,
        &'a B::Device,
    );
    impl<B: KilnBackend> DecoderVisitor for Run<'_, B> {
        type Output = Result<(EvalOutput, bool)>;
        fn visit<A: DecoderArchitecture>(
            self,
            _: &'static DecoderFamily<A>,
            config: A::Config,
        ) -> Self::Output {
            let Run(opts, dir, batch_size, layout, device) = self;
            let tok_path = opts.tokenizer_path()?;
            let tok = load_tokenizer(&tok_path)?;
            let (tp, pp) = (layout.tensor_parallel_size, layout.pipeline_parallel_size);
            let (parallel, tp_group, pp_group) = DataParallel::<B>::join_mesh_pp(device, tp, pp)?;
            let tp_rank = tp_group.as_ref().map_or(0, |g| g.rank());
            let (shard, loss) = tensor_parallel_plan::<A, _>(&config, tp_group)?;
            let keep = inference_keep(&config, pp_group.as_deref(), layout)?;
            let model = A::load(dir, &config, device, shard, &keep)?;
            crate::data::tokenize::check_ids_fit(&tok, &tok_path, config.vocab_size())?;
            warn_beyond_positions(&config, opts.block_size, "--block-size");
            let file = opts
                .eval_file
                .as_ref()
                .ok_or_else(|| KilnError::Config("kiln eval needs --eval-file".into()))?;
            let set = opts.blocks(file, &tok, eos_id(&config, &tok), opts.max_eval_samples)?;
            let (mut out, reports) = match &pp_group {
                None => {
                    let r = Reported::default();
                    let out = evaluate(&model, &set, batch_size, &loss, r, &parallel)?;
                    (out, parallel.is_main())
                }
                Some(group) => {
                    let stage = eval_stage(&model, group.as_ref(), layout)?;
                    let logits = |batch: &TokenBatch| stage.logits(batch);
                    let r = Reported::default();
                    let mut out =
                        evaluate_by(logits, device, &set, batch_size, &loss, r, &parallel)?;
                    // The result is reported by the first stage, where a launcher shows it.
                    stage.metrics_to_first_stage(&mut out, device)?;
                    (
                        out,
                        stage.index == 0 && parallel.rank() == 0 && tp_rank == 0,
                    )
                }
            };
            out.metrics.insert(
                "eval_tokens".into(),
                (set.len() * (set.block_size - 1)) as f64,
            );
            Ok((out, reports))
        }
    }
    let run = Run::<B>(opts, dir, batch_size, layout, device);
    with_causal_lm(&dir.join("config.json"), run)?
}

/// One pipeline stage of an evaluation: its model's segments and its cut.
struct EvalStage<'a, B: KilnBackend> {
    segments: &'a dyn crate::contract::Segments<B, TokenBatch>,
    cut: crate::parallel::pipeline::StageCut,
    group: &'a dyn crate::parallel::Collectives<B>,
    index: usize,
    count: usize,
}

/// What this rank of an inference pipeline over `group` builds and reads of a model of `config`
/// (every parameter without a pipeline): its stage's parameters, the stages cut as
/// [`eval_stage`] cuts them.
fn inference_keep<B: KilnBackend>(
    config: &impl DecoderConfig,
    group: Option<&dyn crate::parallel::Collectives<B>>,
    layout: &InferenceLayout,
) -> Result<impl Fn(&str) -> bool + Sync> {
    let stage = match group {
        None => None,
        Some(g) => {
            let outline = decoder_outline(config);
            Some(crate::parallel::pipeline::StageHolds {
                index: g.rank(),
                cuts: crate::parallel::pipeline::cut_stages(
                    config.num_layers(),
                    g.size(),
                    layout.pipeline_cuts.as_deref(),
                )?,
                embedding: outline.embedding,
                tied: outline.tied,
            })
        }
    };
    Ok(move |path: &str| stage.as_ref().is_none_or(|s| s.holds(path)))
}

/// What a pipeline cuts a decoder of `config` by, worked out without building it: its layers,
/// every parameter's whole shape, the embedding, and whether the head is tied to it (it has no
/// `lm_head.weight` of its own).
fn decoder_outline(config: &impl DecoderConfig) -> ModelOutline {
    let shapes = config.param_shapes();
    ModelOutline {
        layers: Some(config.num_layers()),
        tied: !shapes.contains_key("lm_head.weight"),
        shapes,
        embedding: vec![crate::models::decoder::DECODER_EMBEDDING.to_string()],
    }
}

/// This rank's stage of `model` cut over the pipeline `group` as `layout` says.
fn eval_stage<'a, B: KilnBackend, M: crate::contract::Model<B, Batch = TokenBatch>>(
    model: &'a M,
    group: &'a dyn crate::parallel::Collectives<B>,
    layout: &InferenceLayout,
) -> Result<EvalStage<'a, B>> {
    let segments = model.segments().ok_or_else(|| {
        KilnError::Config(
            "--pipeline-parallel-size cuts a model at its decoder layers, and this model is not \
             split into layers"
                .into(),
        )
    })?;
    let cuts = crate::parallel::pipeline::cut_stages(
        segments.num_layers(),
        group.size(),
        layout.pipeline_cuts.as_deref(),
    )?;
    Ok(EvalStage {
        segments,
        cut: cuts[group.rank()].clone(),
        group,
        index: group.rank(),
        count: group.size(),
    })
}

impl<B: KilnBackend> EvalStage<'_, B> {
    /// Hands the last stage's metrics (the only ones computed from logits) to the first stage,
    /// which reports them: `kiln launch` shows rank 0's output, as torchrun's filter does. Each
    /// value travels as its f64 bits in four 16-bit pieces (exact in f32), its name as bytes.
    fn metrics_to_first_stage(&self, out: &mut EvalOutput, device: &B::Device) -> Result<()> {
        if self.count < 2 {
            return Ok(());
        }
        if self.index + 1 == self.count {
            let mut payload = vec![out.metrics.len() as f32];
            for (name, value) in &out.metrics {
                payload.push(name.len() as f32);
                payload.extend(name.bytes().map(f32::from));
                let bits = value.to_bits();
                payload.extend((0..4).map(|i| ((bits >> (16 * i)) & 0xffff) as f32));
            }
            let n = payload.len();
            let t = Tensor::<B, 1>::from_data(TensorData::new(payload, [n]), device);
            self.group.send(t, 0)?;
        } else if self.index == 0 {
            let got = self.group.recv(self.count - 1)?;
            let payload: Vec<f32> =
                got.into_data().convert::<f32>().to_vec().map_err(|e| {
                    KilnError::Distributed(format!("the last stage's metrics: {e:?}"))
                })?;
            let mut at = payload.iter().map(|&v| v as usize);
            let bad =
                || KilnError::Distributed("the last stage's metrics arrived cut short".into());
            let mut metrics = std::collections::BTreeMap::new();
            for _ in 0..at.next().ok_or_else(bad)? {
                let len = at.next().ok_or_else(bad)?;
                let name: Vec<u8> = at.by_ref().take(len).map(|b| b as u8).collect();
                let pieces: Vec<u64> = at.by_ref().take(4).map(|p| p as u64).collect();
                if name.len() != len || pieces.len() != 4 {
                    return Err(bad());
                }
                let bits = pieces.iter().rev().fold(0u64, |acc, p| (acc << 16) | p);
                metrics.insert(
                    String::from_utf8_lossy(&name).into_owned(),
                    f64::from_bits(bits),
                );
            }
            out.metrics = metrics;
        }
        Ok(())
    }

    /// A batch through this stage, forward only: from the embedding or the previous stage's
    /// hidden states, through its layers, to the next stage (`None`) or, on the last stage, to
    /// the logits.
    fn logits(&self, batch: &TokenBatch) -> Result<Option<Tensor<B, 2>>> {
        use crate::train::pipeline_stage::{hand_over, receive};
        let mut x = if self.cut.embedding {
            self.segments.embed(batch)
        } else {
            receive(self.group, self.index - 1)?
        };
        for i in self.cut.layers.clone() {
            x = self.segments.layer(i, x, batch);
        }
        if self.cut.head {
            return Ok(Some(self.segments.head(x, batch)));
        }
        hand_over(self.group, x, self.index + 1)?;
        Ok(None)
    }
}

/// One decoding step under a pipeline: the ids' embeddings (stage 0) or the previous stage's
/// hidden states through this stage's layers and cache, handed on; the last stage picks the token
/// and every stage learns it from there (`u32::MAX` for "the logits were not finite", so every
/// rank stops with the same sentence).
fn decode_stage<B: KilnBackend, M: CausalLm<B>>(
    model: &M,
    stage: &EvalStage<'_, B>,
    input: &[i64],
    cache: &mut M::Cache,
    o: &GenerateOptions,
    rng: &mut StdRng,
) -> Result<Option<u32>> {
    use crate::train::pipeline_stage::{hand_over, receive};
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
        token[0] = pick(&logits, o, rng).map_or(-1.0, |t| t as f32);
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

/// Picks the next token from one row of logits.
fn choose(logits: &[f32], o: &GenerateOptions, rng: &mut StdRng) -> u32 {
    if o.temperature <= 0.0 {
        return crate::train::metrics::argmax(logits) as u32;
    }
    let max = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    let mut probs: Vec<(u32, f64)> = logits
        .iter()
        .enumerate()
        .map(|(i, &v)| (i as u32, (((v - max) as f64) / o.temperature).exp()))
        .collect();
    let total: f64 = probs.iter().map(|p| p.1).sum();
    probs.sort_by(|a, b| b.1.total_cmp(&a.1));
    let mut kept = 0.0;
    let mut cut = probs.len();
    for (i, p) in probs.iter().enumerate() {
        kept += p.1 / total;
        if kept >= o.top_p {
            cut = i + 1;
            break;
        }
    }
    probs.truncate(cut);
    let mass: f64 = probs.iter().map(|p| p.1).sum();
    let mut r = rng.random::<f64>() * mass;
    for (id, p) in &probs {
        r -= p;
        if r <= 0.0 {
            return *id;
        }
    }
    probs.last().map_or(0, |p| p.0)
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
    let next = |input: &[i64], rng: &mut StdRng| {
        let logits = model.next_token_logits(input, &mut cache);
        Ok(pick(&logits, o, rng))
    };
    generate_by(next, tok, config, prompt_ids, o, on_text)
}

/// The next token from a row of logits, `None` when they are not all finite.
fn pick(logits: &[f32], o: &GenerateOptions, rng: &mut StdRng) -> Option<u32> {
    logits
        .iter()
        .all(|v| v.is_finite())
        .then(|| choose(logits, o, rng))
}

/// [`generate`] with each step's token from `next`: given the ids that continue the cached
/// positions (the prompt, then the last token) and the sampling stream, it returns the next id,
/// or `None` when the model's logits were not finite.
fn generate_by(
    mut next: impl FnMut(&[i64], &mut StdRng) -> Result<Option<u32>>,
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
    let mut rng = StdRng::seed_from_u64(o.seed);
    let mut input: Vec<i64> = prompt_ids.iter().map(|&t| t as i64).collect();
    let mut new_ids: Vec<u32> = Vec::new();
    let mut printed = String::new();
    let start = Instant::now();
    let mut prefill_secs = 0.0;
    while new_ids.len() < o.max_new_tokens {
        let Some(next) = next(&input, &mut rng)? else {
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
            let next = |input: &[i64], rng: &mut StdRng| {
                decode_stage(&model, &stage, input, &mut cache, o, rng)
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
