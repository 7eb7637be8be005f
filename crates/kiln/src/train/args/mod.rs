//! `TrainingArguments` with Hugging Face's names and defaults. The same struct is the CLI's flags
//! (`--per-device-train-batch-size`, underscores accepted too) and a YAML/JSON file's keys.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::hf_values::hf_bool;
use super::optim::OptimizerType;
use super::schedule::SchedulerType;
use crate::error::{KilnError, Result};
use crate::parallel::pipeline::{Balance, ScheduleKind};

mod file;
mod layers;
mod validate;
pub use layers::ArgLayers;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum IntervalStrategy {
    No,
    #[default]
    Steps,
    Epoch,
}

impl IntervalStrategy {
    /// Whether a log, an evaluation or a save with this strategy is due after global step
    /// `step`: every `every` steps (never when `every` is 0), or at each epoch's end.
    pub fn due(self, every: u64, step: u64, epoch_end: bool) -> bool {
        match self {
            IntervalStrategy::No => false,
            IntervalStrategy::Steps => every > 0 && step.is_multiple_of(every),
            IntervalStrategy::Epoch => epoch_end,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, clap::Args)]
#[serde(default)]
#[command(next_help_heading = "Training")]
pub struct TrainingArguments {
    /// Where checkpoints, logs and the final model go.
    #[arg(
        long,
        default_value = "runs/kiln",
        help_heading = "Evaluation & saving"
    )]
    pub output_dir: PathBuf,
    /// Passes over the training data (fractions stop part-way through the last).
    #[arg(long, default_value_t = 3.0, value_parser = finite_f64, allow_negative_numbers = true)]
    pub num_train_epochs: f64,
    /// If > 0, the total number of optimizer steps (overrides num_train_epochs).
    #[arg(long, default_value_t = -1, allow_negative_numbers = true)]
    pub max_steps: i64,
    /// Training examples per step in each process (before gradient accumulation).
    #[arg(long, default_value_t = 8)]
    pub per_device_train_batch_size: usize,
    /// Evaluation examples per forward pass in each process.
    #[arg(long, default_value_t = 8, help_heading = "Evaluation & saving")]
    pub per_device_eval_batch_size: usize,
    /// Batches whose gradients are summed before each optimizer step.
    #[arg(long, default_value_t = 1)]
    pub gradient_accumulation_steps: usize,
    /// The peak learning rate (after warmup).
    #[arg(long, default_value_t = 5e-5, value_parser = finite_f64, allow_negative_numbers = true)]
    pub learning_rate: f64,
    /// Decoupled weight decay (not applied to biases and LayerNorm weights).
    #[arg(long, default_value_t = 0.0, value_parser = finite_f64, allow_negative_numbers = true)]
    pub weight_decay: f64,
    /// AdamW's first-moment decay.
    #[arg(long, default_value_t = 0.9, value_parser = finite_f64, allow_negative_numbers = true)]
    pub adam_beta1: f64,
    /// AdamW's second-moment decay.
    #[arg(long, default_value_t = 0.999, value_parser = finite_f64, allow_negative_numbers = true)]
    pub adam_beta2: f64,
    /// AdamW's denominator epsilon.
    #[arg(long, default_value_t = 1e-8, value_parser = finite_f64, allow_negative_numbers = true)]
    pub adam_epsilon: f64,
    /// Clip gradients to this global L2 norm (0 disables).
    #[arg(long, default_value_t = 1.0, value_parser = finite_f64, allow_negative_numbers = true)]
    pub max_grad_norm: f64,
    /// linear, cosine, constant, constant_with_warmup, cosine_with_restarts, polynomial,
    /// inverse_sqrt, cosine_with_min_lr, warmup_stable_decay (as transformers' get_scheduler,
    /// checked step by step against it), reduce_lr_on_plateau (stepped by each evaluation's
    /// metric_for_best_model, as torch's ReduceLROnPlateau; options via --lr-scheduler-kwargs).
    #[arg(long, value_enum, default_value_t = SchedulerType::Linear)]
    pub lr_scheduler_type: SchedulerType,
    /// The optimizer: `adamw_torch` (default; `adamw_torch_fused` is the same update), `sgd`
    /// (momentum etc. through --optim-args), `adafactor` or `lion_32bit`, as transformers' Trainer
    /// builds each (checked step by step against torch, transformers and bitsandbytes).
    #[arg(long, value_enum, default_value_t = OptimizerType::AdamwTorch)]
    pub optim: OptimizerType,
    /// Options of the optimizer as transformers reads them, `key=value,...`: for sgd,
    /// `momentum`, `dampening` and `nesterov` (e.g. `momentum=0.9,nesterov=True`).
    #[arg(long)]
    pub optim_args: Option<String>,
    /// Linear warmup steps; below 1, a ratio of the total steps (transformers 5.x).
    #[arg(long, default_value_t = 0.0, value_parser = steps_value)]
    pub warmup_steps: f64,
    /// Fraction of total steps used for warmup when warmup_steps is 0 (transformers 4.x).
    #[arg(long, default_value_t = 0.0, value_parser = finite_f64, allow_negative_numbers = true)]
    pub warmup_ratio: f64,
    /// Seed of the weights drawn fresh (a new classifier head), dropout and, without --data-seed, the data order.
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    /// The seed of the data order (shuffling); default: seed.
    #[arg(long)]
    pub data_seed: Option<u64>,
    /// Smooth the classification targets: (1 − ε) on the label, ε spread over all classes.
    #[arg(long, default_value_t = 0.0, value_parser = finite_f64)]
    pub label_smoothing_factor: f64,
    /// Scheduler options, as a JSON object: num_cycles (cosine_with_restarts), power and lr_end
    /// (polynomial), timescale (inverse_sqrt), min_lr or min_lr_rate (cosine_with_min_lr),
    /// num_decay_steps, num_stable_steps, min_lr_ratio, decay_type (warmup_stable_decay).
    #[arg(long, value_parser = json_object)]
    pub lr_scheduler_kwargs: Option<serde_json::Value>,
    /// Log every N steps; below 1, a ratio of the total steps.
    #[arg(long, default_value_t = 500.0, value_parser = steps_value, help_heading = "Evaluation & saving")]
    pub logging_steps: f64,
    /// `steps` (every logging_steps), `epoch`, or `no`.
    #[arg(long, value_enum, default_value_t = IntervalStrategy::Steps, help_heading = "Evaluation & saving")]
    pub logging_strategy: IntervalStrategy,
    /// Log the first step too.
    #[arg(long, default_value_t = false, num_args = 0..=1, default_missing_value = "true", value_parser = hf_bool, action = clap::ArgAction::Set, help_heading = "Evaluation & saving")]
    pub logging_first_step: bool,
    /// Where logs go: `jsonl` (log.jsonl in output_dir), `tensorboard` (event files in
    /// logging_dir, with Hugging Face's tag names), `all` (both) or `none`; a comma-separated list.
    #[arg(long, default_value = "all", value_parser = ReportTo::parse, help_heading = "Evaluation & saving")]
    pub report_to: ReportTo,
    /// TensorBoard's folder (default: $TENSORBOARD_LOGGING_DIR, else
    /// output_dir/runs/<start time>_<host name>, as transformers names it).
    #[arg(long, help_heading = "Evaluation & saving")]
    pub logging_dir: Option<PathBuf>,
    /// A name for the run: its label in `kiln plot`, the model card and the recorded arguments
    /// (never a folder name, as in transformers).
    #[arg(long, help_heading = "Evaluation & saving")]
    pub run_name: Option<String>,
    /// When to evaluate: `no`, `steps` (every eval_steps) or `epoch`.
    #[arg(long, value_enum, default_value_t = IntervalStrategy::No, help_heading = "Evaluation & saving")]
    pub eval_strategy: IntervalStrategy,
    /// Evaluate every N steps with eval_strategy=steps (default: logging_steps); below 1, a ratio
    /// of the total steps.
    #[arg(long, value_parser = steps_value, help_heading = "Evaluation & saving")]
    pub eval_steps: Option<f64>,
    /// Evaluate once before the first step (a baseline).
    #[arg(long, default_value_t = false, num_args = 0..=1, default_missing_value = "true", value_parser = hf_bool, action = clap::ArgAction::Set, help_heading = "Evaluation & saving")]
    pub eval_on_start: bool,
    /// `steps`, `epoch`, `best` (whenever the evaluation metric improves) or `no`.
    #[arg(long, value_enum, default_value_t = SaveStrategy::Steps, help_heading = "Evaluation & saving")]
    pub save_strategy: SaveStrategy,
    /// Save every N steps; below 1, a ratio of the total steps.
    #[arg(long, default_value_t = 500.0, value_parser = steps_value, help_heading = "Evaluation & saving")]
    pub save_steps: f64,
    /// Checkpoints hold the model only (no optimizer, scheduler or RNG state): smaller, but a run
    /// cannot resume from them.
    #[arg(long, default_value_t = false, num_args = 0..=1, default_missing_value = "true", value_parser = hf_bool, action = clap::ArgAction::Set, help_heading = "Evaluation & saving")]
    pub save_only_model: bool,
    /// Keep at most this many checkpoints (oldest deleted first; the best one is kept).
    #[arg(long, help_heading = "Evaluation & saving")]
    pub save_total_limit: Option<usize>,
    /// At the end, load the checkpoint with the best metric_for_best_model into the saved model.
    #[arg(long, default_value_t = false, num_args = 0..=1, default_missing_value = "true", value_parser = hf_bool, action = clap::ArgAction::Set, help_heading = "Evaluation & saving")]
    pub load_best_model_at_end: bool,
    /// `loss`, `accuracy`, `f1`, `f1_macro`, ... (an `eval_` prefix is optional).
    #[arg(long, help_heading = "Evaluation & saving")]
    pub metric_for_best_model: Option<String>,
    /// Defaults to false for metrics containing "loss", true otherwise.
    #[arg(long, value_parser = hf_bool, help_heading = "Evaluation & saving")]
    pub greater_is_better: Option<bool>,
    /// Drop the last incomplete batch of each epoch.
    #[arg(long, default_value_t = false, num_args = 0..=1, default_missing_value = "true", value_parser = hf_bool, action = clap::ArgAction::Set)]
    pub dataloader_drop_last: bool,
    /// Batch examples of similar length together (less padding).
    #[arg(long, default_value_t = false, num_args = 0..=1, default_missing_value = "true", value_parser = hf_bool, action = clap::ArgAction::Set)]
    pub group_by_length: bool,
    /// A checkpoint folder, or `latest` (or `True`, as transformers' scripts write it) for the
    /// newest checkpoint in output_dir.
    #[arg(long, help_heading = "Evaluation & saving")]
    pub resume_from_checkpoint: Option<String>,
    /// bf16 mixed precision: Linear layers multiply bf16 operands with f32 accumulation (forward
    /// and backward); master weights, optimizer state, LayerNorm, softmax and the loss stay f32.
    #[arg(long, default_value_t = false, num_args = 0..=1, default_missing_value = "true", value_parser = hf_bool, action = clap::ArgAction::Set)]
    pub bf16: bool,
    /// TF32 tensor cores for f32 GEMMs (10-bit mantissa products, f32 accumulation), as
    /// transformers sets `torch.backends.cuda.matmul.allow_tf32`: CUDA only, an error elsewhere.
    /// Without it f32 GEMMs are IEEE f32.
    #[arg(long, default_value_t = false, num_args = 0..=1, default_missing_value = "true", value_parser = hf_bool, action = clap::ArgAction::Set)]
    pub tf32: bool,
    /// Activation checkpointing per layer: keep each layer's input only and recompute the layer
    /// during the backward pass (BERT and causal LMs; about one extra forward pass of compute; dropout
    /// masks are replayed, so training is unchanged).
    #[arg(long, default_value_t = false, num_args = 0..=1, default_missing_value = "true", value_parser = hf_bool, action = clap::ArgAction::Set)]
    pub gradient_checkpointing: bool,
    /// Train into an --output-dir that already holds a run (its files are replaced; its checkpoints
    /// are left alone, never rotated nor resumed).
    #[arg(long, default_value_t = false, num_args = 0..=1, default_missing_value = "true", value_parser = hf_bool, action = clap::ArgAction::Set, help_heading = "Evaluation & saving")]
    pub overwrite_output_dir: bool,
    /// Skip the update of up to N steps whose loss or gradient norm is NaN or infinite (each is
    /// logged and counted) instead of stopping at the first, as large-scale trainers allow.
    #[arg(long, default_value_t = 0)]
    pub skip_nonfinite_steps: u64,
    /// With a causal LM (whose step loss is the mean over the step's target tokens): count the
    /// target tokens over all data-parallel ranks, so a step's loss is the mean over every rank's
    /// tokens; `false` averages the ranks' own token means instead.
    #[arg(long, default_value_t = true, num_args = 0..=1, default_missing_value = "true", value_parser = hf_bool, action = clap::ArgAction::Set)]
    pub average_tokens_across_devices: bool,
    /// Tensor parallelism (optimum-neuron / NxD's name): each layer's weights cut over N
    /// processes, which must be launched together (`kiln launch --nproc-per-node`); data
    /// parallelism takes the rest of the world (DP = world / N).
    #[arg(long, default_value_t = 1, help_heading = "Parallelism")]
    pub tensor_parallel_size: usize,
    /// The batch of one optimizer step over the whole job (NxD's global batch size): the
    /// accumulation steps follow from it, `global / (per-device batch × data-parallel size)`.
    #[arg(long, help_heading = "Parallelism")]
    pub global_batch_size: Option<usize>,
    /// ZeRO stage 1 (optimum-neuron / NxD's `zero_1`): AdamW's moments are split over the
    /// data-parallel ranks, each updating its part of the parameters and sharing the result.
    #[arg(long = "zero-1", default_value_t = false, num_args = 0..=1, default_missing_value = "true", value_parser = hf_bool, action = clap::ArgAction::Set, help_heading = "Parallelism")]
    pub zero_1: bool,
    /// Pipeline parallelism (optimum-neuron / NxD's name): the model's layers cut into N stages on
    /// N processes, micro-batches flowing through them; world = TP × PP × DP.
    #[arg(long, default_value_t = 1, help_heading = "Parallelism")]
    pub pipeline_parallel_size: usize,
    /// Micro-batches per optimizer step under pipeline parallelism (optimum-neuron's name and
    /// default): they split `per_device_train_batch_size × gradient_accumulation_steps`; -1 makes
    /// micro-batches of one example.
    #[arg(long, default_value_t = -1, allow_negative_numbers = true, help_heading = "Parallelism")]
    pub pipeline_parallel_num_microbatches: i64,
    /// The order each stage runs its micro-batches in: `1f1b` (at most as many in flight as
    /// stages after it) or `gpipe` (every forward, then every backward).
    #[arg(long, default_value = "1f1b", value_parser = ScheduleKind::from_flag, help_heading = "Parallelism")]
    pub pipeline_schedule: ScheduleKind,
    /// Where stages 1, 2, … begin, as decoder-layer indices (`4,8` or `model.layers.4,…`); unset,
    /// the layers are spread evenly with the embedding and the head counted as one layer each.
    #[arg(long, help_heading = "Parallelism")]
    pub pipeline_cuts: Option<String>,
    /// How the default cut weighs the stages: `layers` (each decoder layer, the embedding and the
    /// head one layer each) or `compute` (each part's matrix work per token, so a large
    /// vocabulary's head gets a stage with fewer layers).
    #[arg(long, default_value = "layers", value_parser = Balance::from_flag, help_heading = "Parallelism")]
    pub pipeline_balance: Balance,
    /// Set by `kiln precompile` in its child process: training runs one step per batch shape,
    /// to compile the kernels each shape needs, instead of training ([`super::precompile`]).
    #[arg(skip)]
    #[serde(skip)]
    pub precompile_shapes: bool,
    /// transformers fields kiln accepts without acting on them (see `hf_fields`), as given:
    /// written back to training_args.json.
    #[arg(skip)]
    #[serde(skip)]
    pub recorded: std::collections::BTreeMap<String, serde_json::Value>,
}

/// `report_to`: which of kiln's loggers run. Written as a list of names; read from one name, a
/// comma-separated list or a list (transformers' `"all"`, `"none"`, `["tensorboard"]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReportTo {
    /// `log.jsonl` in output_dir.
    pub jsonl: bool,
    /// TensorBoard event files in logging_dir.
    pub tensorboard: bool,
}

impl ReportTo {
    /// One value as given on the command line or in a file: names separated by commas.
    pub fn parse(s: &str) -> std::result::Result<Self, String> {
        Self::from_names(s.split(',').map(str::trim).filter(|n| !n.is_empty()))
    }

    fn from_names<'a>(names: impl Iterator<Item = &'a str>) -> std::result::Result<Self, String> {
        let mut r = Self {
            jsonl: false,
            tensorboard: false,
        };
        for name in names {
            match name.to_ascii_lowercase().as_str() {
                "all" => (r.jsonl, r.tensorboard) = (true, true),
                "none" => {}
                "jsonl" => r.jsonl = true,
                "tensorboard" => r.tensorboard = true,
                "azure_ml" | "clearml" | "codecarbon" | "comet_ml" | "dagshub" | "dvclive"
                | "flyte" | "mlflow" | "neptune" | "swanlab" | "trackio" | "wandb" => {
                    return Err(format!(
                        "{name} is not built into kiln, which reports to tensorboard and jsonl \
                         (log.jsonl): most trackers import TensorBoard logs (e.g. `wandb sync \
                         --sync-tensorboard <logging_dir>`)"
                    ))
                }
                other => {
                    return Err(format!(
                        "unknown report_to {other:?}: use tensorboard, jsonl, all or none"
                    ))
                }
            }
        }
        Ok(r)
    }

    fn names(&self) -> Vec<&'static str> {
        let mut v = Vec::new();
        if self.jsonl {
            v.push("jsonl");
        }
        if self.tensorboard {
            v.push("tensorboard");
        }
        v
    }
}

impl Serialize for ReportTo {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        self.names().serialize(s)
    }
}

impl<'de> Deserialize<'de> for ReportTo {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Given {
            One(Option<String>),
            Many(Vec<String>),
        }
        let parsed = match Given::deserialize(d)? {
            Given::One(None) => Self::parse("none"),
            Given::One(Some(s)) => Self::parse(&s),
            Given::Many(v) => Self::from_names(v.iter().map(String::as_str)),
        };
        parsed.map_err(serde::de::Error::custom)
    }
}

/// `save_strategy`: [`IntervalStrategy`] plus transformers' `best`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum SaveStrategy {
    No,
    #[default]
    Steps,
    Epoch,
    /// Save whenever an evaluation improves on the best metric so far.
    Best,
}

/// A `*_steps` value: a count, or a ratio of the total steps below 1 (transformers 5.x).
fn steps_value(s: &str) -> std::result::Result<f64, String> {
    let v = finite_f64(s)?;
    if v < 0.0 {
        return Err("must be at least 0".into());
    }
    if v >= 1.0 && v.fract() != 0.0 {
        return Err(format!(
            "{v} is neither a whole number of steps nor a ratio below 1"
        ));
    }
    Ok(v)
}

/// A JSON object given on the command line (`--lr-scheduler-kwargs '{"num_cycles": 2}'`).
fn json_object(s: &str) -> std::result::Result<serde_json::Value, String> {
    match serde_json::from_str::<serde_json::Value>(s) {
        Ok(v @ serde_json::Value::Object(_)) => Ok(v),
        Ok(_) => Err("must be a JSON object, like '{\"num_cycles\": 2}'".into()),
        Err(e) => Err(format!("not JSON: {e}")),
    }
}

/// Resolves a `*_steps` value against the run's total steps as transformers does: a ratio below 1
/// is `ceil(total × ratio)`, a count is itself.
pub fn resolve_steps(value: f64, total: u64) -> u64 {
    if value > 0.0 && value < 1.0 {
        (value * total as f64).ceil() as u64
    } else {
        value as u64
    }
}

/// A flag's f64 value, refusing NaN and infinities (clap then names the flag in its error).
fn finite_f64(s: &str) -> std::result::Result<f64, String> {
    let v: f64 = s.trim().parse().map_err(|e| format!("{e}"))?;
    if v.is_finite() {
        Ok(v)
    } else {
        Err("must be a finite number".into())
    }
}

impl Default for TrainingArguments {
    fn default() -> Self {
        use clap::Parser;
        #[derive(clap::Parser)]
        struct Wrap {
            #[command(flatten)]
            a: TrainingArguments,
        }
        Wrap::parse_from(["kiln"]).a
    }
}

impl TrainingArguments {
    /// The metric that selects the best checkpoint, as `eval_<name>`, and whether higher is better.
    pub fn best_metric(&self) -> (String, bool) {
        let m = self
            .metric_for_best_model
            .clone()
            .unwrap_or_else(|| "loss".into());
        let m = if m.starts_with("eval_") {
            m
        } else {
            format!("eval_{m}")
        };
        let greater = self.greater_is_better.unwrap_or(!m.contains("loss"));
        (m, greater)
    }

    /// Steps between evaluations with eval_strategy `steps`, for a run of `total` steps.
    pub fn eval_interval(&self, total: u64) -> u64 {
        resolve_steps(self.eval_steps.unwrap_or(self.logging_steps), total).max(1)
    }

    /// Steps between log lines with logging_strategy `steps` (0: none).
    pub fn logging_interval(&self, total: u64) -> u64 {
        resolve_steps(self.logging_steps, total)
    }

    /// Steps between checkpoints with save_strategy `steps`.
    pub fn save_interval(&self, total: u64) -> u64 {
        resolve_steps(self.save_steps, total).max(1)
    }

    /// Warmup steps of a run of `total` steps: warmup_steps (a count, or a ratio below 1), else
    /// 4.x's warmup_ratio.
    pub fn warmup_of(&self, total: u64) -> u64 {
        if self.warmup_steps > 0.0 {
            resolve_steps(self.warmup_steps, total)
        } else {
            (self.warmup_ratio * total as f64).ceil() as u64
        }
    }

    /// The seed of the data order: data_seed, else seed.
    pub fn shuffle_seed(&self) -> u64 {
        self.data_seed.unwrap_or(self.seed)
    }

    /// Derives the gradient accumulation steps from `--global-batch-size` for a job of
    /// `data_parallel` data-parallel ranks (each with the per-device batch), as NxD and
    /// optimum-neuron do; without a global batch size, nothing changes.
    pub fn resolve_global_batch(&mut self, data_parallel: usize) -> Result<()> {
        let Some(global) = self.global_batch_size else {
            return Ok(());
        };
        let per_step = self.per_device_train_batch_size * data_parallel;
        if per_step == 0 || global == 0 || !global.is_multiple_of(per_step) {
            return Err(KilnError::Config(format!(
                "--global-batch-size {global} is not a multiple of --per-device-train-batch-size \
                 {} × {data_parallel} data-parallel ranks = {per_step}",
                self.per_device_train_batch_size
            )));
        }
        let accumulation = global / per_step;
        if self.gradient_accumulation_steps != 1 && self.gradient_accumulation_steps != accumulation
        {
            return Err(KilnError::Config(format!(
                "--global-batch-size {global} means {accumulation} accumulation steps at \
                 {data_parallel} data-parallel ranks × batch {}, but \
                 --gradient-accumulation-steps {} was given: give one of the two",
                self.per_device_train_batch_size, self.gradient_accumulation_steps
            )));
        }
        self.gradient_accumulation_steps = accumulation;
        Ok(())
    }

    /// The pipeline options checked and parsed: `None` without pipeline parallelism.
    pub fn pipeline(&self) -> Result<Option<PipelineOptions>> {
        let bad = |m: String| Err(KilnError::Config(m));
        if self.pipeline_parallel_size == 0 {
            return bad("--pipeline-parallel-size must be at least 1".into());
        }
        let m = self.pipeline_parallel_num_microbatches;
        if m == 0 || m < -1 {
            return bad(format!(
                "--pipeline-parallel-num-microbatches {m} is not a count: give at least 1, or -1 \
                 for micro-batches of one example"
            ));
        }
        let schedule = self.pipeline_schedule;
        let cuts = self
            .pipeline_cuts
            .as_deref()
            .map(crate::parallel::pipeline::parse_cuts)
            .transpose()?;
        let balance = self.pipeline_balance;
        if cuts.is_some() && balance != Balance::Layers {
            return bad(format!(
                "--pipeline-cuts and --pipeline-balance {} both set the cut: give one of the two",
                self.pipeline_balance
            ));
        }
        if self.pipeline_parallel_size == 1 {
            return Ok(None);
        }
        Ok(Some(PipelineOptions {
            size: self.pipeline_parallel_size,
            num_microbatches: usize::try_from(m).ok(),
            schedule,
            cuts,
            balance,
        }))
    }
}

/// The pipeline options of a run with more than one stage, checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PipelineOptions {
    pub size: usize,
    /// `None`: micro-batches of one example.
    pub num_microbatches: Option<usize>,
    pub schedule: ScheduleKind,
    pub cuts: Option<Vec<usize>>,
    /// How the default cut weighs the stages (when `cuts` is not given).
    pub balance: Balance,
}

#[cfg(test)]
mod tests {
    /// `--config` reads are bounded: a device that never ends is an error at 16 MiB, a pipe
    /// nobody writes to is an error after the wait, and a pipe that is written works.
    #[test]
    fn config_reads_are_bounded() {
        let err = super::file::read_config_text_within(Path::new("/dev/zero"), 100)
            .unwrap_err()
            .to_string();
        assert!(err.contains("larger than 16 MiB"), "{err}");
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("c.yaml");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: mkfifo with a valid C path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let t0 = std::time::Instant::now();
        let err = super::file::read_config_text_within(&fifo, 200)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("a pipe that nothing wrote to in 0.2 s"),
            "{err}"
        );
        assert!(t0.elapsed() < std::time::Duration::from_secs(10));
        let writer = std::thread::spawn({
            let fifo = fifo.clone();
            move || std::fs::write(fifo, "max_steps: 3\n").unwrap()
        });
        let text = super::file::read_config_text_within(&fifo, 10_000).unwrap();
        writer.join().unwrap();
        assert_eq!(text, "max_steps: 3\n");
    }

    use super::file::flow_too_deep;
    use super::*;

    #[test]
    fn global_batch_size_sets_accumulation_or_says_why_not() {
        let mut a = TrainingArguments {
            per_device_train_batch_size: 4,
            global_batch_size: Some(32),
            ..TrainingArguments::default()
        };
        a.resolve_global_batch(2).unwrap();
        assert_eq!(a.gradient_accumulation_steps, 4);
        // Again (resuming, another call): the same answer, no conflict with itself.
        a.resolve_global_batch(2).unwrap();
        assert_eq!(a.gradient_accumulation_steps, 4);
        let e = a.resolve_global_batch(3).unwrap_err().to_string();
        assert!(
            e.contains("--global-batch-size 32 is not a multiple of"),
            "{e}"
        );
        let mut b = TrainingArguments {
            per_device_train_batch_size: 4,
            gradient_accumulation_steps: 2,
            global_batch_size: Some(32),
            ..TrainingArguments::default()
        };
        let e = b.resolve_global_batch(2).unwrap_err().to_string();
        assert!(e.contains("give one of the two"), "{e}");
        let mut c = TrainingArguments::default();
        c.resolve_global_batch(8).unwrap();
        assert_eq!(c.gradient_accumulation_steps, 1);
    }

    /// The error of `validate` for the defaults with `f` applied, or "" when they pass.
    fn refusal(f: impl FnOnce(&mut TrainingArguments)) -> String {
        let mut a = TrainingArguments::default();
        f(&mut a);
        a.validate()
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default()
    }

    #[test]
    fn checkpoints_of_load_best_fall_on_evaluated_steps() {
        let best = |eval: Option<f64>, save: f64| {
            refusal(|a| {
                a.load_best_model_at_end = true;
                a.eval_strategy = IntervalStrategy::Steps;
                a.eval_steps = eval;
                a.save_steps = save;
            })
        };
        assert!(best(Some(3.0), 4.0).contains("save_steps (4) to be a multiple of eval_steps (3)"));
        assert_eq!(best(Some(2.0), 4.0), "");
        assert_eq!(best(Some(4.0), 4.0), "");
        // eval_steps unset: every logging_steps (500).
        assert!(best(None, 750.0).contains("multiple of eval_steps (500)"));
        assert_eq!(best(None, 1000.0), "");
        assert_eq!(best(Some(0.1), 0.3), "");
        assert!(best(Some(0.2), 0.3).contains("multiple"));
        assert!(best(Some(0.3), 10.0).contains("both as counts or both as ratios"));
        assert!(best(Some(2.0), 0.5).contains("both as counts or both as ratios"));
        // transformers lets a count pass that its remainder divides exactly.
        assert_eq!(best(Some(0.5), 10.0), "");
        // Ratios are checked again on the run's step counts: 0.1 and 0.3 of 25 are 3 and 8.
        let a = TrainingArguments {
            load_best_model_at_end: true,
            eval_strategy: IntervalStrategy::Steps,
            eval_steps: Some(0.1),
            save_steps: 0.3,
            ..TrainingArguments::default()
        };
        let e = a.check_best_checkpoints(25).unwrap_err().to_string();
        assert!(
            e.contains("every 3 steps and save_steps 0.3 every 8"),
            "{e}"
        );
        a.check_best_checkpoints(30).unwrap();
        TrainingArguments::default()
            .check_best_checkpoints(25)
            .unwrap();
    }

    #[test]
    fn steps_strategies_need_a_step_count() {
        assert!(refusal(|a| a.logging_steps = 0.0).contains("logging_steps must be above 0"));
        assert_eq!(
            refusal(|a| {
                a.logging_steps = 0.0;
                a.logging_strategy = IntervalStrategy::No;
            }),
            ""
        );
        assert!(refusal(|a| {
            a.logging_steps = 0.0;
            a.logging_strategy = IntervalStrategy::Epoch;
            a.eval_strategy = IntervalStrategy::Steps;
        })
        .contains("eval_strategy \"steps\" needs eval_steps"));
    }

    #[test]
    fn seeds_and_scheduler_options_in_range() {
        assert!(refusal(|a| a.seed = 1 << 40).contains("seed must be below 2^32"));
        assert_eq!(refusal(|a| a.seed = u64::from(u32::MAX)), "");
        assert!(
            refusal(|a| a.lr_scheduler_kwargs = Some(serde_json::json!([1, 2])))
                .contains("lr_scheduler_kwargs must be a mapping")
        );
        assert!(
            refusal(|a| a.lr_scheduler_kwargs = Some(serde_json::json!("x")))
                .contains("not a string")
        );
    }

    #[test]
    fn eval_on_start_needs_eval_data() {
        let a = TrainingArguments {
            eval_on_start: true,
            ..TrainingArguments::default()
        };
        let e = a.check_eval_data(false).unwrap_err().to_string();
        assert!(e.contains("eval_on_start needs evaluation data"), "{e}");
        a.check_eval_data(true).unwrap();
        TrainingArguments::default().check_eval_data(false).unwrap();
    }

    #[test]
    fn deep_yaml_is_found_before_parsing() {
        let deep = format!("a: {}{}\n", "[".repeat(200_000), "]".repeat(200_000));
        let t = std::time::Instant::now();
        assert_eq!(flow_too_deep(&deep, 128), Some(1));
        assert!(t.elapsed().as_secs() < 5);
        let deep_maps = format!("x: 1\nb:\n  {}\n", "{a: ".repeat(200));
        assert_eq!(flow_too_deep(&deep_maps, 128), Some(3));
        // After an anchor or a tag, a bracket still opens a collection.
        let anchored = format!("a: &x !!seq {}\n", "[".repeat(200));
        assert_eq!(flow_too_deep(&anchored, 128), Some(1));
        // Brackets in quotes, comments and plain scalars are not nesting.
        let many = "[".repeat(300);
        for fine in [
            format!("a: '{many}'\n"),
            format!("a: \"{many}\\\"\"\n"),
            format!("a: 1 # {many}\n"),
            format!("a: x{many}\n"),
            format!("a: 'it''s {many}\n  still quoted'\nb: [[1], {{c: [2]}}]\n"),
        ] {
            assert_eq!(flow_too_deep(&fine, 128), None, "{fine}");
        }
        // Exactly the limit passes.
        let limit = format!("a: {}{}\n", "[".repeat(128), "]".repeat(128));
        assert_eq!(flow_too_deep(&limit, 128), None);
    }

    #[test]
    fn a_config_value_out_of_range_names_its_file_and_line() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("args.yaml");
        std::fs::write(&path, "learning_rate: 1e-4\nlr_scheduler_kwargs: [1, 2]\n").unwrap();
        let e = TrainingArguments::from_file(&path).unwrap_err().to_string();
        assert!(
            e.contains("args.yaml:2: lr_scheduler_kwargs must be a mapping"),
            "{e}"
        );
        std::fs::write(&path, "seed: 1099511627776\n").unwrap();
        let e = TrainingArguments::from_file(&path).unwrap_err().to_string();
        assert!(e.contains("args.yaml:1: seed must be below 2^32"), "{e}");
        // transformers reads a JSON string that starts with `{` as the mapping.
        std::fs::write(
            &path,
            "lr_scheduler_type: cosine\nlr_scheduler_kwargs: '{\"num_cycles\": 2}'\n",
        )
        .unwrap();
        let a = TrainingArguments::from_file(&path).unwrap();
        assert_eq!(
            a.lr_scheduler_kwargs,
            Some(serde_json::json!({"num_cycles": 2}))
        );
    }
}
