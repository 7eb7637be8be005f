//! The arguments checked before a run starts: values in range, intervals that agree, checkpoints
//! that can hold the best model, evaluation data when an evaluation is asked for; each refusal is
//! one sentence naming the argument.

use crate::error::{json_kind, KilnError, Result};
use crate::train::optim::OptimizerType;

use super::*;

impl TrainingArguments {
    /// The checks of one value on its own (a bad one is wrong whatever else is given, so a file
    /// holding it is named at its line): the error is the key and the sentence.
    pub(crate) fn check_values(&self) -> std::result::Result<(), (&'static str, String)> {
        self.check_finite()?;
        // numpy's seeding, which transformers' set_seed calls, takes 0 ≤ seed < 2^32.
        if self.seed > u64::from(u32::MAX) {
            return Err((
                "seed",
                format!(
                    "seed must be below 2^32 = 4294967296 (transformers seeds numpy with it), got {}",
                    self.seed
                ),
            ));
        }
        // transformers passes it as `**lr_scheduler_kwargs`: only a mapping can be one (serde
        // would otherwise read a list into the options by position).
        match &self.lr_scheduler_kwargs {
            None | Some(serde_json::Value::Null | serde_json::Value::Object(_)) => Ok(()),
            Some(other) => Err((
                "lr_scheduler_kwargs",
                format!(
                    "lr_scheduler_kwargs must be a mapping of option names to values, like \
                     {{\"num_cycles\": 2}}, not {}",
                    json_kind(other)
                ),
            )),
        }
    }

    /// Every float argument finite (NaN in a YAML file would otherwise surface later, nameless).
    pub(crate) fn check_finite(&self) -> std::result::Result<(), (&'static str, String)> {
        let floats = [
            ("num_train_epochs", self.num_train_epochs),
            ("learning_rate", self.learning_rate),
            ("weight_decay", self.weight_decay),
            ("adam_beta1", self.adam_beta1),
            ("adam_beta2", self.adam_beta2),
            ("adam_epsilon", self.adam_epsilon),
            ("max_grad_norm", self.max_grad_norm),
            ("warmup_ratio", self.warmup_ratio),
            ("warmup_steps", self.warmup_steps),
            ("logging_steps", self.logging_steps),
            ("save_steps", self.save_steps),
            ("eval_steps", self.eval_steps.unwrap_or(0.0)),
            ("label_smoothing_factor", self.label_smoothing_factor),
        ];
        match floats.iter().find(|(_, v)| !v.is_finite()) {
            Some((name, v)) => Err((name, format!("{name} must be a finite number, got {v}"))),
            None => Ok(()),
        }
    }

    /// Ranges as transformers and torch enforce them, checked before anything runs.
    pub fn validate(&self) -> Result<()> {
        self.check_values()
            .map_err(|(_, msg)| KilnError::Config(msg))?;
        let bad = |m: String| Err(KilnError::Config(m));
        if self.tensor_parallel_size == 0 {
            return bad("tensor_parallel_size must be at least 1".into());
        }
        self.pipeline()?;
        if self.zero_1 && self.optim != OptimizerType::AdamwTorch {
            return bad("--zero-1 shards AdamW's moments only; use --optim adamw_torch".into());
        }
        let stateful = match self.optim {
            OptimizerType::AdamwTorch => false,
            OptimizerType::Sgd => {
                crate::train::optim::rules::Rule::sgd_from_optim_args(self.optim_args.as_deref())?
                    .keeps_state()
            }
            OptimizerType::Adafactor | OptimizerType::Lion32bit => true,
        };
        if stateful && self.tensor_parallel_size > 1 {
            return bad(format!(
                "--optim {:?} with state under --tensor-parallel-size {}: sharded checkpoints hold AdamW's moments only; use --optim adamw_torch",
                self.optim, self.tensor_parallel_size
            ));
        }
        crate::train::schedule::Schedule::new(
            self.lr_scheduler_type,
            self.lr_scheduler_kwargs.as_ref(),
            self.learning_rate,
        )
        .map_err(KilnError::Config)?;
        if self.lr_scheduler_type == crate::train::schedule::SchedulerType::ReduceLrOnPlateau
            && self.eval_strategy == IntervalStrategy::No
        {
            return bad(
                "lr_scheduler_type reduce_lr_on_plateau requires an eval strategy (--eval-strategy steps or epoch)"
                    .into(),
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
        for (name, v) in [
            ("warmup_steps", Some(self.warmup_steps)),
            ("logging_steps", Some(self.logging_steps)),
            ("save_steps", Some(self.save_steps)),
            ("eval_steps", self.eval_steps),
        ] {
            if let Some(v) = v {
                if let Err(m) = steps_value(&v.to_string()) {
                    return bad(format!("{name}: {m}"));
                }
            }
        }
        if self.save_strategy == SaveStrategy::Steps && self.save_steps == 0.0 {
            return bad("save_steps must be above 0 with save_strategy \"steps\"".into());
        }
        if self.eval_steps == Some(0.0) {
            return bad("eval_steps must be above 0".into());
        }
        self.check_intervals().map_err(KilnError::Config)?;
        if !(0.0..1.0).contains(&self.label_smoothing_factor) {
            return bad(format!(
                "label_smoothing_factor must be in [0, 1), got {}",
                self.label_smoothing_factor
            ));
        }
        if self.save_strategy == SaveStrategy::Best && self.eval_strategy == IntervalStrategy::No {
            return bad("save_strategy \"best\" needs an eval_strategy (steps or epoch)".into());
        }
        if self.save_total_limit == Some(0) {
            return bad(
                "save_total_limit must be at least 1 (leave it unset to keep every checkpoint)"
                    .into(),
            );
        }
        let same = matches!(
            (self.eval_strategy, self.save_strategy),
            (IntervalStrategy::Steps, SaveStrategy::Steps)
                | (IntervalStrategy::Epoch, SaveStrategy::Epoch)
                | (
                    IntervalStrategy::Steps | IntervalStrategy::Epoch,
                    SaveStrategy::Best
                )
        );
        if self.load_best_model_at_end && !same {
            return bad(
                "load_best_model_at_end needs eval_strategy equal to save_strategy (and not \"no\"), or save_strategy \"best\"".into(),
            );
        }
        self.check_saves_follow_evals().map_err(KilnError::Config)
    }

    /// A `steps` schedule needs a step count: transformers refuses logging_steps 0 with
    /// logging_strategy `steps`, and evaluates every logging_steps when eval_steps is unset.
    pub(crate) fn check_intervals(&self) -> std::result::Result<(), String> {
        if self.logging_strategy == IntervalStrategy::Steps && self.logging_steps == 0.0 {
            return Err(
                "logging_steps must be above 0 with logging_strategy \"steps\" (logging_strategy \"no\" logs nothing)"
                    .into(),
            );
        }
        if self.eval_strategy == IntervalStrategy::Steps
            && self.eval_steps.is_none()
            && self.logging_steps == 0.0
        {
            return Err(
                "eval_strategy \"steps\" needs eval_steps, or a logging_steps above 0 to take it from"
                    .into(),
            );
        }
        Ok(())
    }

    /// With load_best_model_at_end and `steps`, each checkpoint must be saved at a step that was
    /// evaluated, or the best metric is attached to a checkpoint of another step: save_steps a
    /// multiple of eval_steps, with transformers' own test (a count and a ratio mix only where
    /// the remainder is 0; two ratios compare in millionths, so 0.3 is a multiple of 0.1).
    pub(crate) fn check_saves_follow_evals(&self) -> std::result::Result<(), String> {
        if !self.saves_pick_the_best_by_steps() {
            return Ok(());
        }
        let (eval, save) = (
            self.eval_steps.unwrap_or(self.logging_steps),
            self.save_steps,
        );
        let not_multiple = || {
            format!(
                "load_best_model_at_end needs save_steps ({save}) to be a multiple of eval_steps \
                 ({eval}), so that every checkpoint is saved at an evaluated step"
            )
        };
        if eval <= 0.0 {
            return Err(not_multiple());
        }
        if save % eval == 0.0 {
            return Ok(());
        }
        match (eval < 1.0, save < 1.0) {
            (false, false) => Err(not_multiple()),
            (true, true) => {
                let millionths = |v: f64| (v * 1e6).round() as u64;
                if millionths(save).is_multiple_of(millionths(eval).max(1)) {
                    Ok(())
                } else {
                    Err(not_multiple())
                }
            }
            _ => Err(format!(
                "load_best_model_at_end needs save_steps ({save}) to be a multiple of eval_steps \
                 ({eval}), which a ratio of the total steps and a count of steps cannot guarantee: \
                 give both as counts or both as ratios"
            )),
        }
    }

    /// load_best_model_at_end with eval_strategy and save_strategy both `steps`.
    pub(crate) fn saves_pick_the_best_by_steps(&self) -> bool {
        self.load_best_model_at_end
            && self.eval_strategy == IntervalStrategy::Steps
            && self.save_strategy == SaveStrategy::Steps
    }

    /// [`Self::check_saves_follow_evals`] on the step counts of a run of `total` steps: ratios
    /// that pass transformers' test can still resolve to intervals that do not divide (0.1 and
    /// 0.3 of 25 steps are 3 and 8), which only the total shows.
    pub fn check_best_checkpoints(&self, total: u64) -> Result<()> {
        if !self.saves_pick_the_best_by_steps() {
            return Ok(());
        }
        let (eval, save) = (self.eval_interval(total), self.save_interval(total));
        if save.is_multiple_of(eval) {
            return Ok(());
        }
        Err(KilnError::Config(format!(
            "load_best_model_at_end: over {total} steps, eval_steps {} is every {eval} steps and \
             save_steps {} every {save}, which is not a multiple, so some checkpoints would be \
             saved at steps that were not evaluated",
            self.eval_steps.unwrap_or(self.logging_steps),
            self.save_steps
        )))
    }

    /// Evaluation data is needed by eval_strategy `steps`/`epoch` and by eval_on_start, which
    /// transformers' Trainer refuses to run without an eval_dataset.
    pub fn check_eval_data(&self, has_eval: bool) -> Result<()> {
        if has_eval {
            return Ok(());
        }
        if self.eval_strategy != IntervalStrategy::No {
            return Err(KilnError::Config(
                "eval_strategy needs evaluation data (--eval-file or --eval-split)".into(),
            ));
        }
        if self.eval_on_start {
            return Err(KilnError::Config(
                "eval_on_start needs evaluation data (--eval-file or --eval-split)".into(),
            ));
        }
        Ok(())
    }
}
