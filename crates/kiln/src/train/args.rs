//! `TrainingArguments` with Hugging Face's names and defaults. The same struct is the CLI's flags
//! (`--per-device-train-batch-size`, underscores accepted too) and a YAML/JSON file's keys.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::optim::OptimizerType;
use super::schedule::SchedulerType;
use crate::error::{KilnError, Result};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum IntervalStrategy {
    No,
    #[default]
    Steps,
    Epoch,
}

#[derive(Debug, Clone, Serialize, Deserialize, clap::Args)]
#[serde(default)]
pub struct TrainingArguments {
    /// Where checkpoints, logs and the final model go.
    #[arg(long, default_value = "runs/kiln")]
    pub output_dir: PathBuf,
    #[arg(long, default_value_t = 3.0, value_parser = finite_f64, allow_negative_numbers = true)]
    pub num_train_epochs: f64,
    /// If > 0, the total number of optimizer steps (overrides num_train_epochs).
    #[arg(long, default_value_t = -1, allow_negative_numbers = true)]
    pub max_steps: i64,
    #[arg(long, default_value_t = 8)]
    pub per_device_train_batch_size: usize,
    #[arg(long, default_value_t = 8)]
    pub per_device_eval_batch_size: usize,
    #[arg(long, default_value_t = 1)]
    pub gradient_accumulation_steps: usize,
    #[arg(long, default_value_t = 5e-5, value_parser = finite_f64, allow_negative_numbers = true)]
    pub learning_rate: f64,
    /// Decoupled weight decay (not applied to biases and LayerNorm weights).
    #[arg(long, default_value_t = 0.0, value_parser = finite_f64, allow_negative_numbers = true)]
    pub weight_decay: f64,
    #[arg(long, default_value_t = 0.9, value_parser = finite_f64, allow_negative_numbers = true)]
    pub adam_beta1: f64,
    #[arg(long, default_value_t = 0.999, value_parser = finite_f64, allow_negative_numbers = true)]
    pub adam_beta2: f64,
    #[arg(long, default_value_t = 1e-8, value_parser = finite_f64, allow_negative_numbers = true)]
    pub adam_epsilon: f64,
    /// Clip gradients to this global L2 norm (0 disables).
    #[arg(long, default_value_t = 1.0, value_parser = finite_f64, allow_negative_numbers = true)]
    pub max_grad_norm: f64,
    #[arg(long, value_enum, default_value_t = SchedulerType::Linear)]
    pub lr_scheduler_type: SchedulerType,
    /// The optimizer: `adamw_torch` (default) or plain `sgd` (the MNIST sample's).
    #[arg(long, value_enum, default_value_t = OptimizerType::AdamwTorch)]
    pub optim: OptimizerType,
    #[arg(long, default_value_t = 0)]
    pub warmup_steps: u64,
    /// Fraction of total steps used for warmup (when warmup_steps is 0).
    #[arg(long, default_value_t = 0.0, value_parser = finite_f64, allow_negative_numbers = true)]
    pub warmup_ratio: f64,
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    #[arg(long, default_value_t = 500)]
    pub logging_steps: u64,
    #[arg(long, value_enum, default_value_t = IntervalStrategy::No)]
    pub eval_strategy: IntervalStrategy,
    /// Evaluate every N steps with eval_strategy=steps (default: logging_steps).
    #[arg(long)]
    pub eval_steps: Option<u64>,
    #[arg(long, value_enum, default_value_t = IntervalStrategy::Steps)]
    pub save_strategy: IntervalStrategy,
    #[arg(long, default_value_t = 500)]
    pub save_steps: u64,
    /// Keep at most this many checkpoints (oldest deleted first; the best one is kept).
    #[arg(long)]
    pub save_total_limit: Option<usize>,
    #[arg(long, default_value_t = false, num_args = 0..=1, default_missing_value = "true", value_parser = hf_bool, action = clap::ArgAction::Set)]
    pub load_best_model_at_end: bool,
    /// `loss`, `accuracy`, `f1`, `f1_macro`, ... (an `eval_` prefix is optional).
    #[arg(long)]
    pub metric_for_best_model: Option<String>,
    /// Defaults to false for metrics containing "loss", true otherwise.
    #[arg(long, value_parser = hf_bool)]
    pub greater_is_better: Option<bool>,
    #[arg(long, default_value_t = false, num_args = 0..=1, default_missing_value = "true", value_parser = hf_bool, action = clap::ArgAction::Set)]
    pub dataloader_drop_last: bool,
    /// Batch examples of similar length together (less padding).
    #[arg(long, default_value_t = false, num_args = 0..=1, default_missing_value = "true", value_parser = hf_bool, action = clap::ArgAction::Set)]
    pub group_by_length: bool,
    /// A checkpoint folder, or `latest` for the newest checkpoint in output_dir.
    #[arg(long)]
    pub resume_from_checkpoint: Option<String>,
    /// bf16 mixed precision: Linear layers multiply bf16 operands with f32 accumulation (forward
    /// and backward); master weights, optimizer state, LayerNorm, softmax and the loss stay f32.
    #[arg(long, default_value_t = false, num_args = 0..=1, default_missing_value = "true", value_parser = hf_bool, action = clap::ArgAction::Set)]
    pub bf16: bool,
    /// Activation checkpointing per layer: keep each layer's input only and recompute the layer
    /// during the backward pass (causal LMs; about one extra forward pass of compute).
    #[arg(long, default_value_t = false, num_args = 0..=1, default_missing_value = "true", value_parser = hf_bool, action = clap::ArgAction::Set)]
    pub gradient_checkpointing: bool,
    /// Train into an --output-dir that already holds a run (its files are replaced; its checkpoints
    /// are left alone, never rotated nor resumed).
    #[arg(long, default_value_t = false, num_args = 0..=1, default_missing_value = "true", value_parser = hf_bool, action = clap::ArgAction::Set)]
    pub overwrite_output_dir: bool,
    /// Skip the update of up to N steps whose loss or gradient norm is NaN or infinite (each is
    /// logged and counted) instead of stopping at the first, as large-scale trainers allow.
    #[arg(long, default_value_t = 0)]
    pub skip_nonfinite_steps: u64,
    /// Tensor parallelism (optimum-neuron / NxD's name): each layer's weights cut over N
    /// processes, which must be launched together (`kiln launch --nproc-per-node`); data
    /// parallelism takes the rest of the world (DP = world / N).
    #[arg(long, default_value_t = 1)]
    pub tensor_parallel_size: usize,
    /// The batch of one optimizer step over the whole job (NxD's global batch size): the
    /// accumulation steps follow from it, `global / (per-device batch × data-parallel size)`.
    #[arg(long)]
    pub global_batch_size: Option<usize>,
    /// ZeRO stage 1 (optimum-neuron / NxD's `zero_1`): AdamW's moments are split over the
    /// data-parallel ranks, each updating its part of the parameters and sharing the result.
    #[arg(long = "zero-1", default_value_t = false, num_args = 0..=1, default_missing_value = "true", value_parser = hf_bool, action = clap::ArgAction::Set)]
    pub zero_1: bool,
}

/// A boolean flag's value as Hugging Face scripts write it: `True`/`False` (any case), `1`/`0`,
/// `yes`/`no` (HfArgumentParser's `string_to_bool`); a bare flag means true.
fn hf_bool(s: &str) -> std::result::Result<bool, String> {
    match s.trim().to_ascii_lowercase().as_str() {
        "true" | "1" | "yes" | "y" | "t" => Ok(true),
        "false" | "0" | "no" | "n" | "f" => Ok(false),
        other => Err(format!("{other:?} is not a boolean (True or False)")),
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
    /// Reads a YAML or JSON file (by extension) of TrainingArguments keys; absent keys keep defaults.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| KilnError::io(path, e))?;
        let is_json = path.extension().and_then(|e| e.to_str()) == Some("json");
        // The error names the key (`learning_rate: invalid type: ...`), not only the line.
        let located = |field: String, line: usize, msg: String| KilnError::Parse {
            path: path.to_path_buf(),
            line,
            msg: if field == "." {
                msg
            } else {
                format!("key `{field}`: {msg}")
            },
        };
        if is_json {
            let mut de = serde_json::Deserializer::from_str(&text);
            serde_path_to_error::deserialize(&mut de).map_err(|e| {
                let field = e.path().to_string();
                let inner = e.into_inner();
                located(field, inner.line(), inner.to_string())
            })
        } else {
            serde_path_to_error::deserialize(serde_yaml_ng::Deserializer::from_str(&text)).map_err(
                |e| {
                    let field = e.path().to_string();
                    let inner = e.into_inner();
                    let line = inner.location().map(|l| l.line()).unwrap_or(0);
                    located(field, line, inner.to_string())
                },
            )
        }
    }

    /// Only the keys a YAML/JSON file sets (validated as [`Self::from_file`] does), so that they can
    /// be laid over other defaults (a task's) rather than the generic ones.
    pub fn file_entries(path: &Path) -> Result<serde_json::Map<String, serde_json::Value>> {
        Self::from_file(path)?
            .check_finite()
            .map_err(|m| KilnError::Config(format!("{}: {m}", path.display())))?;
        let text = std::fs::read_to_string(path).map_err(|e| KilnError::io(path, e))?;
        let value: serde_json::Value =
            serde_yaml_ng::from_str(&text).map_err(|e| KilnError::Parse {
                path: path.to_path_buf(),
                line: e.location().map(|l| l.line()).unwrap_or(0),
                msg: e.to_string(),
            })?;
        Ok(value.as_object().cloned().unwrap_or_default())
    }

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

    pub fn eval_interval(&self) -> u64 {
        self.eval_steps.unwrap_or(self.logging_steps).max(1)
    }

    /// Every float argument finite (NaN in a YAML file would otherwise surface later, nameless).
    fn check_finite(&self) -> std::result::Result<(), String> {
        let floats = [
            ("num_train_epochs", self.num_train_epochs),
            ("learning_rate", self.learning_rate),
            ("weight_decay", self.weight_decay),
            ("adam_beta1", self.adam_beta1),
            ("adam_beta2", self.adam_beta2),
            ("adam_epsilon", self.adam_epsilon),
            ("max_grad_norm", self.max_grad_norm),
            ("warmup_ratio", self.warmup_ratio),
        ];
        match floats.iter().find(|(_, v)| !v.is_finite()) {
            Some((name, v)) => Err(format!("{name} must be a finite number, got {v}")),
            None => Ok(()),
        }
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

    /// Ranges as transformers and torch enforce them, checked before anything runs.
    pub fn validate(&self) -> Result<()> {
        self.check_finite().map_err(KilnError::Config)?;
        let bad = |m: String| Err(KilnError::Config(m));
        if self.tensor_parallel_size == 0 {
            return bad("tensor_parallel_size must be at least 1".into());
        }
        if self.zero_1 && self.optim != OptimizerType::AdamwTorch {
            return bad(
                "--zero-1 shards AdamW's moments; --optim sgd keeps no state to shard".into(),
            );
        }
        if self.global_batch_size == Some(0) {
            return bad("global_batch_size must be at least 1".into());
        }

        // torch.optim's own checks: a negative rate, decay or epsilon, or a beta outside [0, 1).
        for (name, v) in [
            ("learning_rate", self.learning_rate),
            ("weight_decay", self.weight_decay),
            ("adam_epsilon", self.adam_epsilon),
            ("max_grad_norm", self.max_grad_norm),
        ] {
            if v < 0.0 {
                return bad(format!("{name} must be at least 0, got {v}"));
            }
        }
        for (name, v) in [
            ("adam_beta1", self.adam_beta1),
            ("adam_beta2", self.adam_beta2),
        ] {
            if !(0.0..1.0).contains(&v) {
                return bad(format!("{name} must be in [0, 1), got {v}"));
            }
        }
        if self.max_steps <= 0 && self.num_train_epochs <= 0.0 {
            return bad(format!(
                "num_train_epochs must be above 0 (or set max_steps), got {}",
                self.num_train_epochs
            ));
        }
        if self.per_device_train_batch_size == 0 || self.per_device_eval_batch_size == 0 {
            return bad("batch sizes must be at least 1".into());
        }
        if self.gradient_accumulation_steps == 0 {
            return bad("gradient_accumulation_steps must be at least 1".into());
        }
        if !(0.0..=1.0).contains(&self.warmup_ratio) {
            return bad(format!(
                "warmup_ratio must be in [0, 1], got {}",
                self.warmup_ratio
            ));
        }
        if self.save_strategy == IntervalStrategy::Steps && self.save_steps == 0 {
            return bad("save_steps must be at least 1 with save_strategy \"steps\"".into());
        }
        if self.eval_steps == Some(0) {
            return bad("eval_steps must be at least 1".into());
        }
        if self.save_total_limit == Some(0) {
            return bad(
                "save_total_limit must be at least 1 (leave it unset to keep every checkpoint)"
                    .into(),
            );
        }
        if self.load_best_model_at_end
            && (self.eval_strategy == IntervalStrategy::No
                || self.eval_strategy != self.save_strategy)
        {
            return bad(
                "load_best_model_at_end needs eval_strategy equal to save_strategy (and not \"no\")".into(),
            );
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
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
}
