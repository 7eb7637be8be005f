//! Text classification with an encoder (BERT, RoBERTa, XLM-RoBERTa, DistilBERT, ModernBERT, chosen
//! by the folder's `config.json`): `kiln train`, `kiln eval`, `kiln predict`.

use std::path::{Path, PathBuf};

use crate::ops::{KilnBackend, TrainBackend};
use burn::tensor::activation::softmax;
use tracing::{info, warn};

use crate::contract::{BatchSource, CrossEntropy, Loss, Model};
use crate::data::batch::{collate, TextBatch};
use crate::data::{self, DataArgs, LabelSet, Padding, TextClassificationSet, TextTokenizer};
use crate::error::{KilnError, Result};
use crate::formats::model_weights::read_model_weights;
use crate::models::auto::EncoderConfig;
use crate::models::classifier::SequenceClassifier;
use crate::models::params::load_into;
use crate::parallel::DataParallel;
use crate::tasks::adapter::LoraSetup;
use crate::train::checkpoint::ModelFiles;
use crate::train::metrics::argmax;
use crate::train::trainer::{evaluate, EvalOutput, Reported, TrainOutput};
use crate::train::ParallelPlan;
use crate::train::{Trainer, TrainerBuilder, TrainingArguments};

/// Batches of a tokenized classification set.
pub struct ClassificationBatches<'a> {
    pub set: &'a TextClassificationSet,
    pub padding: Padding,
    pub pad_id: u32,
}

impl BatchSource for ClassificationBatches<'_> {
    type Batch = TextBatch;
    fn len(&self) -> usize {
        self.set.len()
    }
    fn lengths(&self) -> Vec<usize> {
        self.set.lengths()
    }
    fn batch(&self, indices: &[usize]) -> (TextBatch, Vec<i64>) {
        let ex: Vec<_> = indices.iter().map(|&i| &self.set.examples[i]).collect();
        let labels = indices.iter().map(|&i| self.set.labels[i] as i64).collect();
        (collate(&ex, self.padding, self.pad_id), labels)
    }
    fn padded_length(&self, longest: usize) -> usize {
        self.padding.padded_length(longest)
    }
}

/// A Hugging Face model folder's files.
pub struct ModelDir {
    pub dir: PathBuf,
}

impl ModelDir {
    pub fn new(dir: &Path) -> Result<Self> {
        if !dir.is_dir() {
            return Err(KilnError::Config(format!(
                "{}: model folder not found",
                dir.display()
            )));
        }
        for f in ["config.json", "tokenizer.json"] {
            if !dir.join(f).exists() {
                return Err(KilnError::Config(format!(
                    "{}: no {f} in the model folder",
                    dir.display()
                )));
            }
        }
        if !dir.join("model.safetensors").exists()
            && !dir.join("model.safetensors.index.json").exists()
        {
            let hint = if dir.join("pytorch_model.bin").exists() {
                " (only pytorch_model.bin: convert it with `transformers` save_pretrained(safe_serialization=True))"
            } else {
                ""
            };
            return Err(KilnError::Config(format!(
                "{}: no model.safetensors{hint}",
                dir.display()
            )));
        }
        Ok(Self {
            dir: dir.to_path_buf(),
        })
    }
    pub fn config(&self) -> Result<EncoderConfig> {
        EncoderConfig::from_file(&self.dir.join("config.json"))
    }
    /// The tokenizer, truncating to `max_length` — at most the model's `max_position_embeddings`
    /// (a longer request is clamped with a warning, as transformers' `run_glue.py` does) — after
    /// checking that every id it produces has a row in the model's embeddings.
    pub fn tokenizer(&self, config: &EncoderConfig, max_length: usize) -> Result<TextTokenizer> {
        let path = self.dir.join("tokenizer.json");
        let limit = config.max_length();
        let max_length = if max_length > limit {
            warn!(
                "--max-length {max_length} is above the model's max_position_embeddings {limit}: \
                 using {limit}"
            );
            limit
        } else {
            max_length
        };
        let tok = TextTokenizer::from_file(&path, max_length)?;
        crate::data::tokenize::check_ids_fit(tok.inner(), &path, config.vocab_size())?;
        Ok(tok)
    }
}

/// Loads the folder's sequence classifier (its family from `config.json`). With `labels`, the head has that many
/// classes (a head of another size, or none, is freshly initialised and reported); without, the
/// config's `id2label` decides.
pub fn load_classifier<B: KilnBackend>(
    md: &ModelDir,
    labels: Option<&LabelSet>,
    seed: u64,
    device: &B::Device,
) -> Result<(SequenceClassifier<B>, EncoderConfig, LabelSet)> {
    load_classifier_of(md, md.config()?, labels, seed, device)
}

/// [`load_classifier`] with the folder's config already read (and validated) by the caller.
fn load_classifier_of<B: KilnBackend>(
    md: &ModelDir,
    mut config: EncoderConfig,
    labels: Option<&LabelSet>,
    seed: u64,
    device: &B::Device,
) -> Result<(SequenceClassifier<B>, EncoderConfig, LabelSet)> {
    let saved = config.labels().map(LabelSet::new);
    crate::io::limits::ensure_params_fit(
        &md.dir.join("config.json"),
        config.param_count(labels.map_or(2, |l| l.len())),
    )?;
    let labels = match (labels, saved.clone()) {
        (Some(l), _) => l.clone(),
        (None, Some(s)) => s,
        (None, None) => {
            return Err(KilnError::Config(format!(
                "{}: config.json has no id2label — is this a fine-tuned classifier?",
                md.dir.display()
            )))
        }
    };
    let head_matches = saved.as_ref() == Some(&labels);
    config.set_labels(labels.names());
    // The weights first: a corrupt file fails before the model is allocated. One file, or the
    // shards an index lists (large models, as transformers saves them).
    let path = match md.dir.join("model.safetensors") {
        single if single.exists() => single,
        _ => md.dir.join("model.safetensors.index.json"),
    };
    let mut tensors = read_model_weights(&md.dir)?;
    if !head_matches {
        // A different label set: the saved head (if any) does not apply, as in transformers
        // (a classifier's output layer is named `classifier` in every family).
        tensors.retain(|k, _| !k.starts_with("classifier."));
    }
    let model = crate::ops::with_seeded_rng::<B, _>(device, seed, || {
        SequenceClassifier::new(&config, labels.len(), device)
    });
    let (model, report) = load_into(model, tensors, Some(config.base_prefix()), device)?;
    let model =
        fresh_weights_from_cpu(model, &report.missing, &config, labels.len(), seed, device)?;
    // A new classification head is expected (and BERT's pooler, as transformers initialises one
    // for encoders saved without it); any other missing weight means this is not the model it
    // claims.
    let heads = config.head_prefixes();
    let (head, rest): (Vec<&String>, Vec<&String>) = report
        .missing
        .iter()
        .partition(|m| heads.iter().any(|h| m.starts_with(h)));
    if !rest.is_empty() {
        return Err(KilnError::Weights(format!(
            "{}: {} of the model's weights are not in the file (first: {}){}; is this a {} model, as config.json says?",
            path.display(),
            rest.len(),
            rest.iter().take(3).map(|s| s.as_str()).collect::<Vec<_>>().join(", "),
            crate::formats::safetensors::stored_as_other_dtype(&path, &rest),
            config.model_type()
        )));
    }
    if !head.is_empty() {
        let msg = format!(
            "{}: newly initialized (not in {}): {}",
            config.architecture(),
            path.display(),
            report.missing.join(", ")
        );
        if head.iter().all(|m| m.starts_with("classifier.")) {
            info!(
                "{msg} — a fresh classification head for labels {:?}",
                labels.names()
            );
        } else {
            warn!("{msg}");
        }
    }
    if !report.unexpected.is_empty() {
        info!(
            "unused tensors in {}: {}",
            path.display(),
            report.unexpected.join(", ")
        );
    }
    Ok((model, config, labels))
}

/// The weights the file lacks (a new head, a pooler), drawn on the CPU whatever the device, as
/// transformers initialises on the CPU before moving a model: the same seed starts the same run on
/// a GPU as on the CPU (each backend's own generator draws different numbers).
fn fresh_weights_from_cpu<B: KilnBackend>(
    model: SequenceClassifier<B>,
    missing: &[String],
    config: &EncoderConfig,
    num_labels: usize,
    seed: u64,
    device: &B::Device,
) -> Result<SequenceClassifier<B>> {
    use crate::backend::{Cpu, CpuDevice};
    if missing.is_empty() || std::any::TypeId::of::<B>() == std::any::TypeId::of::<Cpu>() {
        return Ok(model);
    }
    let cpu = CpuDevice::default();
    let fresh = crate::ops::with_seeded_rng::<Cpu, _>(&cpu, seed, || {
        SequenceClassifier::<Cpu>::new(config, num_labels, &cpu)
    });
    let mut tensors = crate::models::params::module_tensors(&fresh);
    tensors.retain(|k, _| missing.contains(k));
    Ok(load_into(model, tensors, None, device)?.0)
}

/// BERT tells text pairs apart by token type 0 and 1: it needs two token-type embeddings (the
/// other families have no token types and separate a pair by the separator token alone).
fn check_pairs(config: &EncoderConfig, data: &DataArgs) -> Result<()> {
    match config.token_types() {
        Some(n) if n < 2 && data.columns.text_pair.is_some() => Err(KilnError::Config(format!(
            "--text-pair-column needs a model with type_vocab_size ≥ 2 (config.json has {n})"
        ))),
        _ => Ok(()),
    }
}

/// Writes a model folder with freshly initialised encoder weights (transformers' init scheme) for
/// `config`, with the given tokenizer — a starting point for training from scratch.
pub fn init_model_dir(
    dir: &Path,
    config: &EncoderConfig,
    tokenizer_json: &Path,
    seed: u64,
) -> Result<()> {
    use crate::backend::{Cpu, CpuDevice};
    let device = CpuDevice::default();
    let model = crate::ops::with_seeded_rng::<Cpu, _>(&device, seed, || {
        SequenceClassifier::<Cpu>::new(config, 2, &device)
    });
    let mut tensors = crate::models::params::module_tensors(&model);
    let prefix = format!("{}.", config.base_prefix());
    tensors.retain(|k, _| k.starts_with(&prefix));
    let files = ModelFiles {
        config_json: config.to_json(),
        tokenizer_json: Some(tokenizer_json.to_path_buf()),
        copy: Vec::new(),
        source_dir: None,
        adapter: None,
    };
    crate::train::checkpoint::write_model_dir(dir, &tensors, &files)
}

/// Options of `kiln train` / `kiln eval` beyond TrainingArguments.
#[derive(Debug, Clone)]
pub struct ClassificationOptions {
    pub model_dir: PathBuf,
    pub data: DataArgs,
    pub max_length: usize,
    pub pad_to_max_length: bool,
    /// Round each batch's padded length up to a multiple of this (transformers'
    /// `pad_to_multiple_of`); `None` or 1: the longest example.
    pub pad_to_multiple_of: Option<usize>,
    /// Train a LoRA adapter (a fresh one or a PEFT folder's) and the head instead of the whole
    /// model.
    pub lora: Option<LoraSetup>,
    /// What the frozen base of a LoRA run is held in (`--base-dtype`).
    pub lora_base_dtype: crate::models::lora::BaseDtype,
}

impl ClassificationOptions {
    fn padding(&self) -> Padding {
        match (self.pad_to_max_length, self.pad_to_multiple_of) {
            (true, _) => Padding::MaxLength(self.max_length),
            (false, Some(multiple)) if multiple > 1 => Padding::MultipleOf {
                multiple,
                max: self.max_length,
            },
            _ => Padding::Longest,
        }
    }
}

/// Each file's rows used; skipped rows (malformed, empty, an eval label training never saw) are a
/// warning with their count and first lines: data left out is never only an info line.
fn log_reports(reports: &[(PathBuf, data::ReadReport)]) {
    for (path, r) in reports {
        if r.skipped.is_empty() {
            info!("{}: {}", path.display(), r.summary());
            continue;
        }
        tracing::warn!("{}: {}", path.display(), r.summary());
        for s in r.skipped.iter().skip(1).take(4) {
            tracing::warn!("  also skipped {s}");
        }
    }
}

/// Fine-tunes a classifier with `loss` (use [`CrossEntropy`] for transformers' behaviour); `customize`
/// may set more of the trainer (a `compute_metrics`, the progress bar). Returns the training summary
/// and the final evaluation (if any).
pub fn train<B: TrainBackend, L: Loss>(
    opts: &ClassificationOptions,
    args: TrainingArguments,
    device: &B::Device,
    loss: L,
    customize: impl FnOnce(
        TrainerBuilder<B, SequenceClassifier<B>, L>,
    ) -> TrainerBuilder<B, SequenceClassifier<B>, L>,
) -> Result<(TrainOutput, Option<EvalOutput>)> {
    // Join the job first: workers meet before each spends time loading.
    let parallel = DataParallel::join(device)?;
    let md = ModelDir::new(&opts.model_dir)?;
    let config = md.config()?;
    let tok = md.tokenizer(&config, opts.max_length)?;
    check_pairs(&config, &opts.data)?;
    let data = data::prepare(&opts.data, &tok, None)?;
    log_reports(&data.reports);
    let train_set = data.train.as_ref().ok_or_else(|| {
        KilnError::Config("kiln train needs --train-file, --dataset-dir or --dataset-name".into())
    })?;
    // config.json was read and validated once, above.
    let (model, config, labels) =
        load_classifier_of::<B>(&md, config, Some(&data.labels), args.seed, device)?;
    info!(
        "labels {:?}; {} train / {} eval examples",
        labels.names(),
        train_set.len(),
        data.eval.as_ref().map_or(0, |e| e.len())
    );
    let (model, adapter) = match &opts.lora {
        None => (model, None),
        Some(lora) => {
            let (model, files) = crate::tasks::adapter::with_adapter(
                model,
                lora,
                opts.lora_base_dtype,
                args.seed,
                Some(&md.dir),
                device,
                &crate::models::params::keep_all,
            )?;
            (model, Some(files))
        }
    };
    let files = ModelFiles {
        config_json: config.to_json(),
        tokenizer_json: Some(md.dir.join("tokenizer.json")),
        // What AutoTokenizer reads besides tokenizer.json (model_max_length, special tokens).
        copy: [
            "tokenizer_config.json",
            "special_tokens_map.json",
            "vocab.txt",
            "vocab.json",
            "merges.txt",
            "sentencepiece.bpe.model",
        ]
        .iter()
        .map(|f| md.dir.join(f))
        .collect(),
        source_dir: Some(md.dir.clone()),
        adapter,
    };
    let plan = ParallelPlan::new(parallel);
    let origin = crate::train::RunOrigin::from_paths(
        Some(&opts.model_dir),
        opts.data.train_file.as_deref(),
        opts.data.eval_file.as_deref(),
        false,
    );
    let builder = Trainer::<B, _>::builder(args, model, device.clone())
        .loss(loss)
        .files(files)
        .parallel(plan)
        .label_names(labels.names().to_vec())
        .origin(origin);
    let mut trainer = customize(builder).build();
    let batches = |set| ClassificationBatches {
        set,
        padding: opts.padding(),
        pad_id: tok.pad_id,
    };
    let train_b = batches(train_set);
    let eval_b = data.eval.as_ref().map(batches);
    trainer.train_and_evaluate(&train_b, eval_b.as_ref())
}

/// Evaluates a fine-tuned classifier on labelled data.
pub fn eval<B: KilnBackend>(
    opts: &ClassificationOptions,
    batch_size: usize,
    device: &B::Device,
) -> Result<EvalOutput> {
    let md = ModelDir::new(&opts.model_dir)?;
    let config = md.config()?;
    let tok = md.tokenizer(&config, opts.max_length)?;
    check_pairs(&config, &opts.data)?;
    let (model, _, labels) = load_classifier::<B>(&md, None, 0, device)?;
    let data = data::prepare(&opts.data, &tok, Some(labels.clone()))?;
    log_reports(&data.reports);
    let set = data.eval.as_ref().ok_or_else(|| {
        KilnError::Config(
            "kiln eval needs --eval-file, or a --dataset-dir / --dataset-name with an eval split"
                .into(),
        )
    })?;
    let src = ClassificationBatches {
        set,
        padding: opts.padding(),
        pad_id: tok.pad_id,
    };
    evaluate(
        &model,
        &src,
        batch_size,
        &CrossEntropy,
        Reported::labels(labels.names()),
        &crate::parallel::DataParallel::single(),
    )
}

/// One prediction: the most probable label and every label's probability.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Prediction {
    pub text: String,
    pub label: String,
    pub score: f32,
    pub probabilities: std::collections::BTreeMap<String, f32>,
    pub logits: Vec<f32>,
}

/// Classifies raw texts with a fine-tuned model.
pub fn predict<B: KilnBackend>(
    model_dir: &Path,
    texts: &[String],
    max_length: usize,
    batch_size: usize,
    device: &B::Device,
) -> Result<Vec<Prediction>> {
    let md = ModelDir::new(model_dir)?;
    let tok = md.tokenizer(&md.config()?, max_length)?;
    let (model, _, labels) = load_classifier::<B>(&md, None, 0, device)?;
    let mut out = Vec::with_capacity(texts.len());
    for chunk in texts.chunks(batch_size.max(1)) {
        let pairs: Vec<(String, Option<String>)> =
            chunk.iter().map(|t| (t.clone(), None)).collect();
        let enc = tok.encode(&pairs)?;
        let refs: Vec<_> = enc.iter().collect();
        let batch = collate(&refs, Padding::Longest, tok.pad_id);
        let logits = model.logits(&batch);
        let probs = softmax(logits.clone(), 1);
        let rows = |t: burn::tensor::Tensor<B, 2>| -> Vec<Vec<f32>> {
            let c = t.dims()[1];
            let v = t
                .into_data()
                .convert::<f32>()
                .into_vec::<f32>()
                .expect("f32");
            v.chunks(c).map(|r| r.to_vec()).collect()
        };
        for ((text, l), p) in chunk.iter().zip(rows(logits)).zip(rows(probs)) {
            if l.iter().any(|v| !v.is_finite()) {
                return Err(KilnError::NonFinite(format!(
                    "{}: the model gives non-finite logits {l:?} for {text:?}: its weights are not finite",
                    model_dir.display()
                )));
            }
            let best = argmax(&p);
            out.push(Prediction {
                text: text.clone(),
                label: labels.names()[best].clone(),
                score: p[best],
                probabilities: labels
                    .names()
                    .iter()
                    .cloned()
                    .zip(p.iter().copied())
                    .collect(),
                logits: l,
            });
        }
    }
    Ok(out)
}
