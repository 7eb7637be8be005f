//! How a run starts, in named steps: the arguments validated, the output folder claimed, the
//! parallel layout settled, the run's sizes made, a checkpoint resumed (model, optimizer and trainer
//! state, whatever layout wrote it), the reporters opened, the banner printed.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use burn::module::AutodiffModule;
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::{json, Value};
use tracing::info;

use super::*;
use crate::contract::{BatchSource, Loss, Model};
use crate::error::{KilnError, Result};
use crate::formats::sharded::LAYOUT_FILE;
use crate::models::params::{load_into, module_shapes};
use crate::ops::TrainBackend;
use crate::parallel::launch::Attempt;
use crate::train::args::TrainingArguments;
use crate::train::checkpoint::sharded::{read_rank_state, RankState};
use crate::train::checkpoint::{read_json, Checkpointer, SchedulerState, TrainerState};
use crate::train::optim::{Optimizer, OptimizerType};
use crate::train::output_dir::{claim, resolve_resume_for, Claim, RunDir};
use crate::train::reporters::Reporters;
use crate::train::run_sizes::RunSizes;
use crate::train::schedule::{Plateau, SchedulerType};

impl<B, M, L> Trainer<B, M, L>
where
    B: TrainBackend,
    M: AutodiffModule<B> + Model<B> + Clone,
    M::InnerModule: Model<B::InnerBackend, Batch = M::Batch>,
    L: Loss,
{
    /// This rank's model and optimizer state in checkpoint `dir`, whatever layout wrote it.
    /// Under a pipeline the model comes whole (the other stages' layers are let go of after the
    /// start) and the moments are those of the parameters this stage trains.
    pub(super) fn rank_state(&self, dir: &Path) -> Result<RankState> {
        let mut trained = module_shapes(self.model());
        if let Some(p) = self.parallel.pipeline() {
            trained.retain(|path, _| p.holds(path));
        }
        read_rank_state(
            dir,
            self.place(),
            self.parallel.tensor().map(|l| &l.splits),
            &trained,
        )
    }

    /// A checkpoint's optimizer state belongs to the optimizer that wrote it: resuming it with
    /// another would drop that state without a word (transformers fails loading it).
    pub(super) fn check_same_optimizer(&self, dir: &Path) -> Result<()> {
        let saved: Value = match std::fs::read_to_string(dir.join("training_args.json")) {
            Ok(s) => serde_json::from_str(&s).unwrap_or(Value::Null),
            Err(_) => return Ok(()), // written by a kiln without it: nothing to compare
        };
        let Some(name) = saved.get("optim").and_then(Value::as_str) else {
            return Ok(());
        };
        let now = self.args.optim;
        match serde_json::from_value::<OptimizerType>(json!(name)) {
            Ok(then) if then != now => Err(KilnError::Checkpoint(format!(
                "{} was trained with optim {name}; resuming it with {} would throw its optimizer \
                 state away: resume with --optim {name}, or start a new run from its weights with \
                 --model {}",
                dir.display(),
                json!(now).as_str().unwrap_or("another optimizer"),
                dir.display()
            ))),
            _ => Ok(()),
        }
    }

    /// Restores model, optimizer and trainer state from a checkpoint folder.
    pub(super) fn resume(&mut self, dir: &Path) -> Result<SchedulerState> {
        let model_only =
            !dir.join("optimizer.safetensors").exists() && !dir.join(LAYOUT_FILE).exists();
        if model_only {
            return Err(KilnError::Checkpoint(format!(
                "{} holds the model only (saved with save_only_model): there is no optimizer \
                 state to resume from; start a new run from it with --model {}",
                dir.display(),
                dir.display()
            )));
        }
        self.check_same_optimizer(dir)?;
        let rank = self.rank_state(dir)?;
        let (model, report) = load_into(self.take_model(), rank.model, None, &self.device)?;
        // A LoRA run's checkpoints hold the adapter only: the frozen base comes from --model.
        // A pipeline stage reads and holds its own parameters only.
        let held = self.parallel.keep();
        let missing: Vec<&String> = report
            .missing
            .iter()
            .filter(|p| held(p))
            .filter(|p| {
                self.files
                    .adapter
                    .as_ref()
                    .is_none_or(|a| a.adapter.owns(p))
            })
            .collect();
        if !missing.is_empty() {
            return Err(KilnError::Checkpoint(format!(
                "{}: checkpoint lacks parameters {:?}",
                dir.display(),
                missing
            )));
        }
        self.model = Some(model);
        self.state = read_json(&dir.join("trainer_state.json"))?;
        let sched: SchedulerState = read_json(&dir.join("scheduler.json"))?;
        self.optimizer
            .load_state(sched.step, &rank.moments, Some(&rank.covers), &self.device);
        self.counters.skipped_nonfinite = sched.skipped_nonfinite;
        self.counters.resumed_loss_sum = sched.train_loss_sum;
        self.counters.num_tokens = sched.num_tokens;
        info!(
            "resumed from {} at step {} (epoch {:.2})",
            dir.display(),
            self.state.global_step,
            self.state.epoch
        );
        Ok(sched)
    }

    /// Starts training, step by step: the arguments validated, the output folder claimed and the
    /// checkpoint to resume agreed, the plan (and the parallel layout) made, the checkpoint
    /// resumed, the reporters opened, every rank given rank 0's weights, the banner printed.
    pub(in crate::train) fn start<S: BatchSource>(
        &mut self,
        train: &S,
        has_eval: bool,
    ) -> Result<RunSizes> {
        let a = self.validated_args(has_eval)?;
        self.settle_layout(&a)?;
        let (resume_dir, run) = self.claim_output(&a)?;
        let plan = self.make_plan(&a, train)?;
        self.checkpointer = Checkpointer::new(&a, plan.total, run);
        if let Some(dir) = &resume_dir {
            self.resume_into_plan(&a, dir, &plan)?;
        }
        self.open_reporters(&a)?;
        let model = self.take_model();
        let model = self.parallel.data.broadcast_model(model)?;
        self.model = Some(self.parallel.release_other_stages::<B, M>(model));
        self.reporters.started(plan.total, self.state.global_step);
        if self.is_main() {
            self.banner(&a, &plan);
        }
        crate::ops::take_activation_overflow();
        Ok(plan)
    }

    /// The arguments checked for this run (the global batch resolved over the data-parallel
    /// group), with the optimizer, the matmul precision and the device's abilities set from them.
    pub(super) fn validated_args(&mut self, has_eval: bool) -> Result<TrainingArguments> {
        self.args.resolve_global_batch(self.parallel.data.size())?;
        let a = self.args.clone();
        a.validate()?;
        self.optimizer =
            Optimizer::with_optim_args(a.optim, adamw_config(&a), a.optim_args.as_deref())?;
        if a.bf16 && !B::kiln_has_bf16() {
            return Err(KilnError::Config(
                "--bf16 needs bf16 arithmetic, which this device has not (wgpu: WGSL has no bf16); \
                 drop --bf16, or train on --device cpu or cuda"
                    .into(),
            ));
        }
        let precision = crate::ops::mixed_precision::<B>(a.bf16);
        if a.bf16 && precision == crate::ops::MatmulPrecision::F32 && self.is_main() {
            tracing::info!(
                "--bf16: no bf16 arithmetic faster than f32 here ({}), so the products stay f32: \
                 as fast as without --bf16 and no less accurate (rounding to bf16 here would only \
                 cost time)",
                crate::ops::isa::cpu_isa().describe()
            );
        }
        crate::ops::set_matmul_precision(precision);
        if a.tf32 && !B::kiln_has_tf32() {
            return Err(KilnError::Config(
                "--tf32 needs TF32 tensor cores, which only --device cuda has; drop --tf32 (f32 \
                 GEMMs are IEEE f32 here)"
                    .into(),
            ));
        }
        crate::ops::set_tf32(a.tf32);
        a.check_eval_data(has_eval)?;
        Ok(a)
    }

    /// Rank 0 claims the output folder; every rank agrees on the checkpoint to resume, if any.
    pub(super) fn claim_output(
        &mut self,
        a: &TrainingArguments,
    ) -> Result<(Option<PathBuf>, Option<RunDir>)> {
        // Rank 0 claims the output folder (lock, leftovers, another run's files); every rank
        // resumes from the same checkpoint.
        let attempt = Attempt::from_env()?;
        let (mut resume_dir, mut restarted, mut claimed) = (None, false, None);
        if self.is_main() {
            let run = claim(&Claim {
                output_dir: &a.output_dir,
                source_dir: self.files.source_dir.as_deref(),
                resume: a.resume_from_checkpoint.as_deref(),
                overwrite: a.overwrite_output_dir,
                attempt: attempt.as_ref(),
            })?;
            (resume_dir, restarted) = (run.resume.clone(), run.restarted);
            claimed = Some(run);
        }
        // A restarted job's ranks take rank 0's choice: only it reads the folder before
        // rewriting the run's record. Agreed over the whole job, not the data-parallel group:
        // under tensor parallelism rank 0's group may be itself alone, and a peer that started
        // over from random weights would train a different model beside it.
        if attempt.is_some_and(|a| a.restart > 0) && self.parallel.data.world_size() > 1 {
            let step = resume_dir
                .as_deref()
                .and_then(|p| {
                    p.file_name()?
                        .to_str()?
                        .strip_prefix("checkpoint-")?
                        .parse()
                        .ok()
                })
                .map_or(0, |s: u64| s + 1);
            let mine = if self.is_main() {
                [u64::from(restarted), step]
            } else {
                [0, 0]
            };
            let chosen = self.parallel.data.sum_exact_world(&mine)?;
            restarted = chosen[0] > 0;
            if restarted && !self.is_main() {
                resume_dir = (chosen[1] > 0).then(|| {
                    crate::train::checkpoint::checkpoint_dir(&a.output_dir, chosen[1] - 1)
                });
            }
        }
        if !self.is_main() && !restarted {
            resume_dir = a
                .resume_from_checkpoint
                .as_deref()
                .map(|spec| resolve_resume_for(&a.output_dir, spec))
                .transpose()?;
        }
        Ok((resume_dir, claimed))
    }

    /// The parallel layout settled from the model and checked against the arguments, before
    /// anything is written.
    pub(super) fn settle_layout(&mut self, a: &TrainingArguments) -> Result<()> {
        let tensor = self.model().tensor_parallel();
        let model = self
            .model
            .as_ref()
            .expect("the model is held between steps");
        self.parallel
            .settle(tensor, a, || model_outline::<B, M>(model))?;
        if a.pipeline_parallel_size > 1 && self.parallel.pipeline().is_none() {
            return Err(KilnError::Config(format!(
                "--pipeline-parallel-size {} cuts decoders (--task causal-lm, sft, dpo, orpo or \
                 reward-modeling) into stages; this task trains without it",
                a.pipeline_parallel_size
            )));
        }
        Ok(())
    }

    /// The run's plan (steps, batches, warmup) with the trainer state and the plateau scheduler it sets.
    pub(super) fn make_plan<S: BatchSource>(
        &mut self,
        a: &TrainingArguments,
        train: &S,
    ) -> Result<RunSizes> {
        self.counters.flos_params = self.non_embedding_parameters()? as f64;
        self.counters.current_flos = 0.0;
        if a.save_only_model && self.sharded() {
            return Err(KilnError::Config(
                "save_only_model is not implemented for sharded checkpoints (tensor parallelism or --zero-1)".into(),
            ));
        }
        let micro = self.parallel.pipeline().map(|p| p.micro_batches());
        let plan = RunSizes::new(a, train.len(), &self.parallel.data, micro)?;
        self.state = TrainerState {
            max_steps: plan.total,
            num_train_epochs: plan.total as f64 / plan.updates_per_epoch as f64,
            logging_steps: a.logging_interval(plan.total),
            eval_steps: a.eval_interval(plan.total),
            save_steps: a.save_interval(plan.total),
            train_batch_size: a.per_device_train_batch_size,
            is_local_process_zero: self.parallel.data.is_local_main(),
            is_world_process_zero: self.is_main(),
            ..TrainerState::default()
        };
        let plateau = a.lr_scheduler_type == SchedulerType::ReduceLrOnPlateau;
        self.plateau = plateau.then(|| Plateau::new(a.learning_rate));
        if plateau && plan.warmup > 0 {
            tracing::warn!(
                "reduce_lr_on_plateau has no warmup (as in transformers): warmup of {} steps ignored",
                plan.warmup
            );
        }
        Ok(plan)
    }

    /// Resumes checkpoint `dir` into the state `plan` set (the plateau state too, when saved).
    pub(super) fn resume_into_plan(
        &mut self,
        a: &TrainingArguments,
        dir: &Path,
        plan: &RunSizes,
    ) -> Result<()> {
        let sched = self.resume(dir)?;
        if self.is_main() {
            crate::train::output_dir::trim_log(&a.output_dir, self.state.global_step)?;
        }
        // `make_plan` made a plateau state exactly when the scheduler is reduce_lr_on_plateau.
        if self.plateau.is_some() {
            match sched.plateau {
                Some(p) => self.plateau = Some(p),
                None => tracing::warn!(
                    "{} was saved without reduce_lr_on_plateau: its plateau state starts afresh",
                    dir.display()
                ),
            }
        }
        if sched.total_steps != plan.total || sched.seed != a.seed {
            tracing::warn!(
                    "resuming with different total steps ({} → {}) or seed ({} → {}): the run will not match an uninterrupted one",
                    sched.total_steps, plan.total, sched.seed, a.seed
                );
        }
        self.state.max_steps = plan.total;
        Ok(())
    }

    /// log.jsonl, TensorBoard and the live state, for this rank.
    pub(super) fn open_reporters(&mut self, a: &TrainingArguments) -> Result<()> {
        let (rank, world) = self
            .parallel
            .data
            .env()
            .map_or((0, 1), |e| (e.rank, e.world_size));
        self.reporters = Reporters::open(
            a,
            self.is_main(),
            (rank, world),
            self.reporting.live_state,
            self.reporting
                .gpu_index
                .or_else(crate::report::live::gpu_index),
        )?;
        Ok(())
    }

    /// transformers' "***** Running training *****" block, with the parallel layout and what
    /// each rank keeps between steps.
    pub(super) fn banner(&self, a: &TrainingArguments, plan: &RunSizes) {
        let world = self.parallel.data.size();
        info!("***** Running training *****");
        info!("  Num examples = {}", plan.examples);
        info!("  Num epochs = {:.2}", self.state.num_train_epochs);
        info!(
            "  Instantaneous batch size per device = {}",
            plan.batch_size
        );
        info!("  World size (data parallel) = {world}");
        if let Some(p) = self.parallel.pipeline() {
            let cut = &p.cuts()[p.index()];
            info!(
                "  Layout: tensor parallel {tp} × pipeline parallel {pp} × data parallel {world} = {} processes",
                a.tensor_parallel_size * p.count() * world,
                tp = a.tensor_parallel_size,
                pp = p.count(),
            );
            info!(
                "  Pipeline: {} schedule, {} micro-batches of {} per step; stage {} holds layers {:?}{}{}",
                p.schedule(),
                plan.accumulation,
                plan.batch_size,
                p.index(),
                cut.layers,
                if cut.embedding { " + embedding" } else { "" },
                if cut.head { " + norm and head" } else { "" },
            );
        } else if a.tensor_parallel_size > 1 {
            info!(
                "  Layout: tensor parallel {tp} × data parallel {world} = {} processes",
                a.tensor_parallel_size * world,
                tp = a.tensor_parallel_size
            );
        }
        // What each rank keeps between steps (f32): its weights, the gradients and the two
        // AdamW moments of what it trains (a LoRA run: the adapter only) — a ZeRO-1 rank only its
        // data-parallel share of the moments.
        let shapes = module_shapes(self.model());
        let trained: BTreeMap<&String, &Vec<usize>> = shapes
            .iter()
            .filter(|(p, _)| {
                self.files
                    .adapter
                    .as_ref()
                    .is_none_or(|a| a.adapter.owns(p))
            })
            .collect();
        let size = |s: &Vec<usize>| s.iter().product::<usize>();
        let weights: usize = shapes.values().map(size).sum();
        let grads: usize = trained.values().map(|s| size(s)).sum();
        let moments = match self.parallel.zero() {
            Some(z) => 2 * grads.div_ceil(z.size()),
            None => self.optimizer.state_len(trained.values().copied()),
        };
        let mb = |n: usize| n as f64 * 4.0 / 1e6;
        info!(
                "  Training state per rank = {:.1} MB weights + {:.1} MB gradients + {:.1} MB optimizer",
                mb(weights),
                mb(grads),
                mb(moments)
            );
        match (self.parallel.zero(), a.zero_1) {
            (Some(z), _) => info!(
                "  ZeRO-1: AdamW moments split over {} data-parallel ranks",
                z.size()
            ),
            (None, true) => info!("  ZeRO-1: one data-parallel rank, nothing to split"),
            _ => {}
        }
        info!(
            "  Total train batch size (w. parallel, distributed & accumulation) = {}",
            plan.batch_size * world * plan.accumulation
        );
        info!(
            "  Gradient accumulation steps = {}",
            a.gradient_accumulation_steps
        );
        info!(
            "  Total optimization steps = {} (warmup {})",
            plan.total, plan.warmup
        );
    }

    pub(super) fn progress_bar(&self, plan: &RunSizes) -> ProgressBar {
        if !(self.reporting.progress && self.is_main()) {
            return ProgressBar::hidden();
        }
        let pb = ProgressBar::new(plan.total);
        pb.set_style(
            ProgressStyle::with_template(
                "{bar:30.cyan/blue} {pos}/{len} [{elapsed_precise}<{eta_precise}] {msg}",
            )
            .expect("template"),
        );
        pb.set_position(self.state.global_step);
        pb
    }
}
