//! The training loop: Hugging Face `Trainer` semantics (accumulation, global-norm clipping, AdamW,
//! warmup schedules, step/epoch evaluation and saving, best-model tracking, exact resume).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use burn::module::AutodiffModule;
use burn::tensor::backend::Backend;
use burn::tensor::ElementConversion;
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::{json, Map, Value};
use tracing::info;

use super::activation_checkpointing::loss_and_grads_by_segment;
use super::args::TrainingArguments;
use super::checkpoint::sharded::{read_rank_state, RankState, ShardedRank};
use super::checkpoint::{
    ensure_finite, put_model_files, read_json, Checkpointer, ModelFiles, SchedulerState, Snapshot,
    TrainerState,
};
pub use super::evaluate::{evaluate, EvalOutput, MetricFn, Reported, TokenMetrics};
use super::evaluate::{round3, round4, targets_tensor, EvalMetrics};
use super::grad_sync::Synced;
use super::optim::{AdamWConfig, GradAccumulator, Optimizer, OptimizerType};
use super::output_dir::{claim, resolve_resume_for, Claim, RunDir};
use super::parallel_plan::{ModelOutline, ParallelPlan};
use super::pipeline_stage::stage_loss_and_grads;
use super::reporters::{write_run_summary, Reporters, Reporting};
use super::run_sizes::RunSizes;
use super::schedule::{Plateau, SchedulerType};
use crate::contract::{BatchSource, CrossEntropy, Loss, Model, ParamSplit};
use crate::data::batch::epoch_order;
use crate::error::{KilnError, Result};
use crate::formats::sharded::LAYOUT_FILE;
use crate::models::params::{load_into, module_shapes, module_tensors, module_tensors_where};
use crate::ops::{profile, TrainBackend};
use crate::parallel::launch::Attempt;
use crate::parallel::mesh::{Coords, Mesh};
use crate::report::live::{Phase, StepReport};

/// Set in `kiln precompile`'s child process: the next [`Trainer::train`] or
/// [`Trainer::train_and_evaluate`] runs one step per batch shape instead of training
/// ([`super::precompile`]).
static SHAPES_ONLY: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Makes the next training run in this process precompile instead of training.
pub fn set_shapes_only(on: bool) {
    SHAPES_ONLY.store(on, std::sync::atomic::Ordering::Relaxed);
}

fn shapes_only() -> bool {
    SHAPES_ONLY.load(std::sync::atomic::Ordering::Relaxed)
}

/// The outcome of training.
#[derive(Debug, Clone)]
pub struct TrainOutput {
    pub global_step: u64,
    pub metrics: BTreeMap<String, f64>,
}

pub struct Trainer<B: TrainBackend, M, L = CrossEntropy> {
    pub args: TrainingArguments,
    /// Always `Some` between calls; taken while the optimizer rebuilds it, so no second reference
    /// keeps the parameter buffers shared (the fused AdamW then updates them in place).
    model: Option<M>,
    pub device: B::Device,
    pub loss: L,
    /// What evaluations report besides the loss (class names, the user's metrics).
    pub metrics: EvalMetrics,
    pub files: ModelFiles,
    pub state: TrainerState,
    optimizer: Optimizer<B::InnerBackend>,
    /// The run's parallelism, given to [`Self::new`]: data parallelism, and the tensor-parallel
    /// layout and ZeRO-1 settled when training starts.
    pub(super) parallel: ParallelPlan<B::InnerBackend>,
    /// Decides when a checkpoint is due, saves and rotates them, keeps the best metric.
    checkpointer: Checkpointer,
    /// reduce_lr_on_plateau's state: the rate follows the evaluations instead of the step.
    plateau: Option<Plateau>,
    /// log.jsonl, TensorBoard and the live state (opened when training starts).
    reporters: Reporters,
    /// The progress bar, `kiln top`'s live state, the run's origin for the model card.
    pub reporting: Reporting,
    /// What the run has counted so far (skipped steps, FLOs, pipeline waits, the last loss).
    counters: Counters,
}

impl<B, M, L> Trainer<B, M, L>
where
    B: TrainBackend,
    M: AutodiffModule<B> + Model<B> + Clone,
    M::InnerModule: Model<B::InnerBackend, Batch = M::Batch>,
    L: Loss,
{
    pub fn new(
        args: TrainingArguments,
        model: M,
        device: B::Device,
        loss: L,
        files: ModelFiles,
        parallel: ParallelPlan<B::InnerBackend>,
    ) -> Self {
        // Built again from the checked arguments when training starts (optim_args may be bad).
        let optimizer = Optimizer::new(args.optim, adamw_config(&args));
        Self {
            args,
            model: Some(model),
            device,
            loss,
            metrics: EvalMetrics::default(),
            files,
            state: TrainerState::default(),
            optimizer,
            parallel,
            checkpointer: Checkpointer::default(),
            plateau: None,
            reporters: Reporters::default(),
            reporting: Reporting::default(),
            counters: Counters::default(),
        }
    }

    /// The loss of the last optimizer step, averaged over the ranks (NaN before the first).
    pub fn last_step_loss(&self) -> f64 {
        self.counters.last_step_loss
    }

    /// The model being trained.
    pub fn model(&self) -> &M {
        self.model.as_ref().expect("model present between steps")
    }

    /// The trained model.
    pub fn into_model(mut self) -> M {
        self.take_model()
    }

    fn take_model(&mut self) -> M {
        self.model.take().expect("model present between steps")
    }

    fn log(&mut self, mut entry: Map<String, Value>) -> Result<()> {
        entry.insert("step".into(), json!(self.state.global_step));
        entry.insert("epoch".into(), json!(round4(self.state.epoch)));
        // Only rank 0's loggers write files.
        self.reporters.log(&entry)?;
        self.state.log_history.push(entry);
        Ok(())
    }

    /// Rank 0 (or a single process): the one that logs and writes files.
    pub fn is_main(&self) -> bool {
        self.parallel.data.is_main()
    }

    /// Where this rank sits in a sharded run (tensor-parallel and data-parallel ranks).
    fn place(&self) -> ShardedRank {
        let tensor = self.parallel.tensor();
        let pipeline = self.parallel.pipeline();
        ShardedRank {
            mesh: Mesh {
                tp: tensor.map_or(1, |l| l.tp.size()),
                dp: self.parallel.data.size(),
                pp: pipeline.map_or(1, |p| p.count()),
            },
            at: Coords {
                tp: tensor.map_or(0, |l| l.tp.rank()),
                dp: self.parallel.data.rank(),
                pp: pipeline.map_or(0, |p| p.index()),
            },
            zero: self.parallel.zero().is_some(),
        }
    }

    /// Whether checkpoints are written per rank (tensor or pipeline parallelism, ZeRO-1).
    fn sharded(&self) -> bool {
        self.parallel.sharded()
    }

    /// This rank's model and optimizer state in checkpoint `dir`, whatever layout wrote it.
    /// Under a pipeline the model comes whole (the other stages' layers are let go of after the
    /// start) and the moments are those of the parameters this stage trains.
    fn rank_state(&self, dir: &Path) -> Result<RankState> {
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
    fn check_same_optimizer(&self, dir: &Path) -> Result<()> {
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
    fn resume(&mut self, dir: &Path) -> Result<SchedulerState> {
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
        info!(
            "resumed from {} at step {} (epoch {:.2})",
            dir.display(),
            self.state.global_step,
            self.state.epoch
        );
        Ok(sched)
    }

    /// Trains on `train`, evaluating on `eval` as the arguments say; saves the final model in
    /// `output_dir`. One optimizer step at a time ([`Self::optimizer_step`]), then logging,
    /// evaluation and saving when they are due.
    pub fn train<S, E>(&mut self, train: &S, eval: Option<&E>) -> Result<TrainOutput>
    where
        S: BatchSource<Batch = M::Batch>,
        E: BatchSource<Batch = M::Batch>,
    {
        if shapes_only() {
            return self.precompile_shapes(train, eval).map(|(out, _)| out);
        }
        let out = self.train_reporting(train, eval)?;
        self.write_summary(None);
        Ok(out)
    }

    /// [`Self::train_steps`] with the loggers closed at the end, and a failure published.
    fn train_reporting<S, E>(&mut self, train: &S, eval: Option<&E>) -> Result<TrainOutput>
    where
        S: BatchSource<Batch = M::Batch>,
        E: BatchSource<Batch = M::Batch>,
    {
        let out = self.train_steps(train, eval);
        if let Err(e) = &out {
            // `kiln top` shows why this rank stopped.
            self.reporters.fail(&e.to_string());
        }
        self.reporters.close();
        out
    }

    fn train_steps<S, E>(&mut self, train: &S, eval: Option<&E>) -> Result<TrainOutput>
    where
        S: BatchSource<Batch = M::Batch>,
        E: BatchSource<Batch = M::Batch>,
    {
        let plan = self.start(train, eval.is_some())?;
        let a = self.args.clone();
        let mut run = RunProgress::new(self.state.global_step, self.progress_bar(&plan));
        // The loss sum goes on from step 1 when the resumed checkpoint recorded it.
        let from_step_1 = match (run.start_step, self.counters.resumed_loss_sum) {
            (0, _) => Some(0.0),
            (_, sum) => sum,
        };
        if let Some(sum) = from_step_1 {
            run.loss_sum = sum;
            run.counts_from_step_1 = true;
        }
        let lengths = train.lengths();
        let first_epoch = run.start_step / plan.updates_per_epoch;
        let skip_groups = (run.start_step % plan.updates_per_epoch) as usize;
        if let (Some(ev), true, 0) = (eval, a.eval_on_start, run.start_step) {
            // A baseline before the first step (eval_on_start); it never counts as a best model.
            let out = run.bar.suspend(|| self.evaluate_phase(ev))?;
            self.log_eval(&out)?;
        }
        'epochs: for epoch in first_epoch.. {
            if self.state.global_step >= plan.total {
                break;
            }
            let order = epoch_order(
                &lengths,
                a.shuffle_seed(),
                epoch,
                true,
                a.group_by_length.then_some(plan.batch_size),
            );
            let order = self.parallel.data.shard(&order, a.dataloader_drop_last);
            let batches: Vec<&[usize]> = order
                .chunks(plan.batch_size)
                .filter(|c| !a.dataloader_drop_last || c.len() == plan.batch_size)
                .collect();
            let groups = batches.len().div_ceil(plan.accumulation);
            for (g, group) in batches.chunks(plan.accumulation).enumerate() {
                if epoch == first_epoch && g < skip_groups {
                    continue;
                }
                let step = self.optimizer_step(train, group, &plan)?;
                run.record(&step);
                self.reporters.step(&StepReport {
                    step: self.state.global_step,
                    total_steps: plan.total,
                    epoch: self.state.epoch,
                    loss: step.loss,
                    learning_rate: step.lr,
                    grad_norm: step.grad_norm,
                    samples: step.rank_samples,
                    tokens: step.tokens,
                    seconds: step.seconds,
                    collective_seconds: step.collective_seconds,
                });
                let epoch_end = g + 1 == groups;
                self.maybe_log(&plan, &step, &mut run, epoch_end)?;
                let mut improved = false;
                if let Some(ev) = eval {
                    let every = a.eval_interval(plan.total);
                    if a.eval_strategy
                        .due(every, self.state.global_step, epoch_end)
                    {
                        self.gather_stages()?;
                        let out = run.bar.suspend(|| self.evaluate_phase(ev))?;
                        let model = self.take_model();
                        self.model = Some(self.parallel.release_other_stages::<B, M>(model));
                        self.log_eval(&out)?;
                        self.step_plateau(&out.metrics, &plan)?;
                        improved = self
                            .checkpointer
                            .improves(&out.metrics, self.state.best_metric);
                        run.pending_eval = Some(out.metrics);
                    }
                }
                let last = self.state.global_step >= plan.total;
                let step = self.state.global_step;
                if self.checkpointer.due(step, epoch_end, improved, last) {
                    let mut sched = self.scheduler_state(&plan);
                    sched.train_loss_sum = run.counts_from_step_1.then_some(run.loss_sum);
                    let pending = run.pending_eval.take();
                    self.reporters.phase(Phase::Saving);
                    run.bar.suspend(|| self.save_checkpoint(&sched, pending))?;
                    self.reporters.phase(Phase::Training);
                }
                crate::io::files::crash_point("train:step");
                if last {
                    break 'epochs;
                }
            }
        }
        self.finish(run)
    }

    /// Starts training, step by step: the arguments validated, the output folder claimed and the
    /// checkpoint to resume agreed, the plan (and the parallel layout) made, the checkpoint
    /// resumed, the reporters opened, every rank given rank 0's weights, the banner printed.
    pub(super) fn start<S: BatchSource>(&mut self, train: &S, has_eval: bool) -> Result<RunSizes> {
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
    fn validated_args(&mut self, has_eval: bool) -> Result<TrainingArguments> {
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
                "--bf16: no bf16 arithmetic here ({}), so the products stay f32: as fast as \
                 without --bf16 and no less accurate (rounding to bf16 here would only cost time)",
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
    fn claim_output(&mut self, a: &TrainingArguments) -> Result<(Option<PathBuf>, Option<RunDir>)> {
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
                resume_dir = (chosen[1] > 0)
                    .then(|| super::checkpoint::checkpoint_dir(&a.output_dir, chosen[1] - 1));
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
    fn settle_layout(&mut self, a: &TrainingArguments) -> Result<()> {
        let tensor = self.model().tensor_parallel();
        let model = self
            .model
            .as_ref()
            .expect("the model is held between steps");
        self.parallel
            .settle(tensor, a, || model_outline::<B, M>(model))?;
        if a.pipeline_parallel_size > 1 && self.parallel.pipeline().is_none() {
            return Err(KilnError::Config(format!(
                "--pipeline-parallel-size {} cuts causal LMs (--task causal-lm or sft) into \
                 stages; this task trains without it",
                a.pipeline_parallel_size
            )));
        }
        Ok(())
    }

    /// The run's plan (steps, batches, warmup) with the trainer state and the plateau scheduler it sets.
    fn make_plan<S: BatchSource>(&mut self, a: &TrainingArguments, train: &S) -> Result<RunSizes> {
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
    fn resume_into_plan(
        &mut self,
        a: &TrainingArguments,
        dir: &Path,
        plan: &RunSizes,
    ) -> Result<()> {
        let sched = self.resume(dir)?;
        if self.is_main() {
            super::output_dir::trim_log(&a.output_dir, self.state.global_step)?;
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
    fn open_reporters(&mut self, a: &TrainingArguments) -> Result<()> {
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
    fn banner(&self, a: &TrainingArguments, plan: &RunSizes) {
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

    fn progress_bar(&self, plan: &RunSizes) -> ProgressBar {
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

    /// One optimizer step over the micro-batches of `group`: forward and backward of each
    /// (accumulating gradients), the data-parallel average, global-norm clipping and the update —
    /// or, for a non-finite loss or norm, the skip `--skip-nonfinite-steps` allows.
    pub(super) fn optimizer_step<S>(
        &mut self,
        train: &S,
        group: &[&[usize]],
        plan: &RunSizes,
    ) -> Result<StepOutcome>
    where
        S: BatchSource<Batch = M::Batch>,
    {
        let started = Instant::now();
        let a = &self.args;
        // Dropout masks come from a stream re-seeded per step: resuming is exact.
        let step_seed = a
            .seed
            .wrapping_mul(1_000_003)
            .wrapping_add(self.state.global_step);
        crate::ops::reseed_dropout(step_seed);
        let checkpointing = a.gradient_checkpointing;
        let mut acc = GradAccumulator::default();
        let mut loss_sum = 0.0;
        let mut samples = 0;
        let mut tokens = 0;
        // Under pipeline parallelism: the time this stage waited for its neighbours.
        let mut stage_wait = 0.0;
        let batches: Vec<_> = group.iter().map(|idx| train.batch(idx)).collect();
        let scales = self.micro_batch_scales(batches.iter().map(|(_, t)| t.as_slice()))?;
        if let Some(p) = self.parallel.pipeline() {
            // This stage's share of every micro-batch, in the schedule's order; the step's loss
            // is the last stage's, summed to every stage.
            let _fwd = profile::scope("step: pipeline stage");
            for (idx, (batch, _)) in group.iter().zip(&batches) {
                samples += idx.len();
                let numel = self.model().input_ids_numel(batch);
                tokens += numel;
                self.counters.current_flos += 6.0 * numel as f64 * self.counters.flos_params;
            }
            let got = stage_loss_and_grads(
                self.model(),
                &batches,
                &scales,
                &self.loss,
                (p.schedule(), self.args.gradient_checkpointing),
                &p.stage(),
            )?;
            loss_sum = p.stage_sum(got.loss_sum)?;
            acc = got.grads;
            stage_wait = got.waited;
            self.counters.pipeline_seconds.0 += got.waited;
            self.counters.pipeline_seconds.1 += got.seconds;
        } else {
            for ((idx, (batch, targets)), scale) in group.iter().zip(batches).zip(scales) {
                let fwd = profile::scope("step: data + forward");
                samples += idx.len();
                let numel = self.model().input_ids_numel(&batch);
                tokens += numel;
                self.counters.current_flos += 6.0 * numel as f64 * self.counters.flos_params;
                let by_segment = if checkpointing {
                    loss_and_grads_by_segment(self.model(), &batch, &targets, &self.loss, scale)
                } else {
                    None
                };
                if let Some((l, grads)) = by_segment {
                    loss_sum += l;
                    acc.merge(grads);
                    continue;
                }
                let logits = self.model().logits(&batch);
                let loss = self
                    .loss
                    .loss(logits, targets_tensor::<B>(targets, &self.device))
                    * scale;
                loss_sum += loss.clone().into_scalar().elem::<f64>();
                drop(fwd);
                let _bwd = profile::scope("step: backward");
                let grads = loss.backward();
                acc.accumulate::<B, M>(self.model(), &grads);
            }
        }
        // Overflowed activations make a finite-looking loss meaningless (the outputs collapsed):
        // the step counts as non-finite, on every rank through the average.
        let overflowed = crate::ops::take_activation_overflow();
        if overflowed {
            loss_sum = f64::NAN;
        }
        // Average gradients (and the logged loss) over ranks before clipping.
        let sync_start = Instant::now();
        let Synced {
            loss,
            grad_norm,
            grads,
        } = self
            .parallel
            .sync_and_clip(acc, loss_sum, &self.device, self.args.max_grad_norm)?;
        // Alone, the sync only adds up the norm: no waiting on peers.
        let collective_seconds = if self.parallel.alone() {
            0.0
        } else {
            stage_wait + sync_start.elapsed().as_secs_f64()
        };
        let _opt = profile::scope("step: clip + optimizer");
        let lr = self.lr(plan);
        // Every rank sees the same averaged loss and norm, so all decide alike.
        let finite = loss.is_finite() && grad_norm.is_finite();
        if finite {
            let model = self.take_model();
            self.model =
                Some(
                    self.parallel
                        .update::<B, M>(&mut self.optimizer, model, lr, grads)?,
                );
        } else {
            self.skip_nonfinite_step(loss, grad_norm, overflowed)?;
        }
        self.state.global_step += 1;
        self.state.epoch = self.state.global_step as f64 / plan.updates_per_epoch as f64;
        self.counters.last_step_loss = loss;
        Ok(StepOutcome {
            loss,
            grad_norm,
            lr,
            finite,
            // Every rank trains on as many examples.
            samples: samples * self.parallel.data.size(),
            rank_samples: samples,
            tokens,
            seconds: started.elapsed().as_secs_f64(),
            collective_seconds,
        })
    }

    /// What each micro-batch's mean loss is multiplied by in a step's loss. Most models: 1/n of
    /// n micro-batches, whose means are then averaged over the data-parallel ranks. A causal LM
    /// (as transformers' Trainer with `num_items_in_batch`): its micro-batch's share of the
    /// step's target tokens, counted over all ranks with `average_tokens_across_devices` (the
    /// scales are then multiplied by the ranks' number, which the ranks' average divides away),
    /// so a step's loss is the mean over all its target tokens.
    fn micro_batch_scales<'t>(&self, targets: impl Iterator<Item = &'t [i64]>) -> Result<Vec<f64>> {
        let counts: Vec<f64> = targets
            .map(|t| {
                t.iter()
                    .filter(|&&x| x != crate::contract::IGNORE_INDEX)
                    .count() as f64
            })
            .collect();
        if !self.model().loss_over_step_tokens() {
            return Ok(vec![1.0 / counts.len().max(1) as f64; counts.len()]);
        }
        let local: f64 = counts.iter().sum();
        let ranks = self.parallel.data.size();
        let (total, ranks) = if self.args.average_tokens_across_devices && ranks > 1 {
            let total = self.parallel.data.sum_host(vec![local as f32])?[0] as f64;
            (total, ranks as f64)
        } else {
            (local, 1.0)
        };
        // A step without a target token (every one masked) adds nothing.
        Ok(counts.iter().map(|c| c * ranks / total.max(1.0)).collect())
    }

    /// The progress bar after every step; a `log.jsonl` line as logging_strategy says (every
    /// logging_steps, or at each epoch's end), and after the first step with logging_first_step.
    fn maybe_log(
        &mut self,
        plan: &RunSizes,
        step: &StepOutcome,
        run: &mut RunProgress,
        epoch_end: bool,
    ) -> Result<()> {
        run.bar.set_position(self.state.global_step);
        run.bar.set_message(format!(
            "loss {:.4} lr {:.2e} {:.1} samples/s",
            step.loss,
            step.lr,
            run.samples as f64 / run.start.elapsed().as_secs_f64().max(1e-9)
        ));
        let global = self.state.global_step;
        let every = self.args.logging_interval(plan.total);
        let due = self.args.logging_strategy.due(every, global, epoch_end);
        if !(due || (global == 1 && self.args.logging_first_step)) {
            return Ok(());
        }
        let loss = run.log_loss_sum / run.log_steps.max(1) as f64;
        // The rate the step just taken used, as transformers logs it.
        let mut entry = json!({"learning_rate": step.lr});
        // Only finite values are logged: a window of skipped steps has no loss.
        if run.log_steps > 0 {
            entry["loss"] = json!(round4(loss));
        }
        if step.grad_norm.is_finite() {
            entry["grad_norm"] = json!(step.grad_norm);
        }
        if self.counters.skipped_nonfinite > 0 {
            entry["skipped_nonfinite_steps"] = json!(self.counters.skipped_nonfinite);
        }
        if self.is_main() {
            run.bar.suspend(|| {
                info!(
                    "step {global}/{} loss {loss:.4} grad_norm {:.3} lr {:.3e} epoch {:.2}",
                    plan.total, step.grad_norm, step.lr, self.state.epoch
                )
            });
        }
        self.log(entry.as_object().cloned().unwrap_or_default())?;
        (run.log_loss_sum, run.log_steps) = (0.0, 0);
        Ok(())
    }

    fn scheduler_state(&self, plan: &RunSizes) -> SchedulerState {
        SchedulerState {
            step: self.optimizer.steps(),
            last_lr: self.lr(plan),
            warmup_steps: plan.warmup,
            total_steps: plan.total,
            seed: self.args.seed,
            skipped_nonfinite: self.counters.skipped_nonfinite,
            plateau: self.plateau.clone(),
            train_loss_sum: None,
        }
    }

    /// Parameters outside the embedding tables, over the whole model: a tensor-parallel shard
    /// counts at its full size (transformers' `num_parameters(exclude_embeddings=True)`), a
    /// pipeline's stages each count what they own, summed over the stages.
    fn non_embedding_parameters(&self) -> Result<usize> {
        let own = self.non_embedding_parameters_owned();
        match self.parallel.pipeline() {
            Some(p) => p.count_sum(own),
            None => Ok(own),
        }
    }

    fn non_embedding_parameters_owned(&self) -> usize {
        let skip = self.model().embedding_parameters();
        let splits = self.parallel.tensor().map(|l| &l.splits);
        module_shapes(self.model())
            .into_iter()
            .filter(|(name, _)| !skip.contains(name) && self.parallel.saves(name))
            .map(|(name, mut shape)| {
                if let Some(ParamSplit::Sharded { axis, full, .. }) =
                    splits.and_then(|s| s.get(&name))
                {
                    shape[*axis] = *full;
                }
                shape.iter().product::<usize>()
            })
            .sum()
    }

    /// Adds every data-parallel rank's floating-point operations since the last call to
    /// `state.total_flos` (transformers' `store_flos`): before a checkpoint and at the end.
    fn store_flos(&mut self) -> Result<()> {
        self.state.total_flos += if self.parallel.data.size() > 1 {
            // f32 keeps 7 significant digits of a count that is itself an estimate.
            f64::from(
                self.parallel
                    .data
                    .sum_host(vec![self.counters.current_flos as f32])?[0],
            )
        } else {
            self.counters.current_flos
        };
        self.counters.current_flos = 0.0;
        Ok(())
    }

    /// The learning rate of the next update: the schedule's at this step, or reduce_lr_on_plateau's.
    fn lr(&self, plan: &RunSizes) -> f64 {
        match &self.plateau {
            Some(p) => p.lr,
            None => plan.lr(&self.args, self.state.global_step),
        }
    }

    /// reduce_lr_on_plateau: one evaluation's metric_for_best_model (default loss) steps it, as
    /// transformers' Trainer does after every evaluation but eval_on_start's.
    fn step_plateau(&mut self, metrics: &BTreeMap<String, f64>, plan: &RunSizes) -> Result<()> {
        let main = self.is_main();
        let Some(p) = self.plateau.as_mut() else {
            return Ok(());
        };
        let (name, _) = self.args.best_metric();
        let Some(&v) = metrics.get(&name) else {
            return Err(KilnError::Config(format!(
                "reduce_lr_on_plateau follows metric_for_best_model {name}, which the evaluation \
                 does not report (it reports: {})",
                metrics.keys().cloned().collect::<Vec<_>>().join(", ")
            )));
        };
        let before = p.lr;
        p.step(v, &plan.schedule.kw);
        if p.lr != before && main {
            info!(
                "{name} {v:.4} has not improved for {} evaluations: learning rate {before:.3e} → {:.3e}",
                plan.schedule.kw.patience + 1,
                p.lr
            );
        }
        Ok(())
    }

    /// The run's summary metrics, the best model when asked for it, and the final model folder.
    fn finish(&mut self, run: RunProgress) -> Result<TrainOutput> {
        run.bar.finish_and_clear();
        let runtime = run.start.elapsed().as_secs_f64();
        let steps_run = self.state.global_step - run.start_step;
        let mut metrics: BTreeMap<String, f64> = BTreeMap::new();
        metrics.insert("train_runtime".into(), round4(runtime));
        metrics.insert(
            "train_samples_per_second".into(),
            round3(run.samples as f64 / runtime),
        );
        metrics.insert(
            "train_steps_per_second".into(),
            round3(steps_run as f64 / runtime),
        );
        // From step 1 when the sum is (so a resumed run reports an unbroken run's value), else
        // over this call's steps.
        let counted = if run.counts_from_step_1 {
            self.state.global_step
        } else {
            steps_run
        };
        let finite_steps = counted
            .saturating_sub(self.counters.skipped_nonfinite)
            .max(1);
        metrics.insert("train_loss".into(), run.loss_sum / finite_steps as f64);
        metrics.insert("epoch".into(), round4(self.state.epoch));
        self.store_flos()?;
        metrics.insert("total_flos".into(), self.state.total_flos);
        if let Some(p) = self.parallel.pipeline() {
            let (waited, ran) = self.counters.pipeline_seconds;
            let m = p.micro_batches().micro_batches;
            info!(
                "pipeline stage {} of {}: waited for its neighbours {waited:.2} s of {ran:.2} s \
                 ({:.1} %; the bubble formula (p − 1)/(m + p − 1) gives {:.1} %)",
                p.index(),
                p.count(),
                100.0 * waited / ran.max(1e-9),
                100.0 * crate::parallel::pipeline::bubble_formula(p.count(), m)
            );
        }
        let entry: Map<String, Value> =
            metrics.iter().map(|(k, v)| (k.clone(), json!(v))).collect();
        self.log(entry)?;

        // Under tensor or pipeline parallelism every rank takes part in putting the model
        // together; otherwise only rank 0 reads its weights.
        self.gather_stages()?;
        if self.args.load_best_model_at_end {
            if let Some(best) = self.state.best_model_checkpoint.clone() {
                info!(
                    "loading best model from {best} ({:?})",
                    self.state.best_metric
                );
                let w = self.rank_state(&PathBuf::from(&best))?.model;
                let model = self.take_model();
                self.model = Some(load_into(model, w, None, &self.device)?.0);
            }
        }
        if self.is_main() || self.parallel.split_model() {
            let tensors = self.whole_model_tensors()?;
            if self.is_main() {
                let dir = self.args.output_dir.clone();
                self.write_model(&dir, tensors)?;
                write_json(&dir.join("train_results.json"), &metrics)?;
            }
        }
        self.parallel.data.barrier()?;
        self.reporters.phase(Phase::Finished);
        Ok(TrainOutput {
            global_step: self.state.global_step,
            metrics,
        })
    }

    fn log_eval(&mut self, out: &EvalOutput) -> Result<()> {
        let entry: Map<String, Value> = out
            .metrics
            .iter()
            .map(|(k, v)| (k.clone(), json!(v)))
            .collect();
        info!(
            "eval at step {}: {}",
            self.state.global_step,
            format_metrics(&out.metrics)
        );
        self.log(entry)
    }

    /// Checkpoint-`global_step`, with the evaluation it goes with (for the best model), through
    /// the [`Checkpointer`].
    fn save_checkpoint(
        &mut self,
        sched: &SchedulerState,
        eval_metrics: Option<BTreeMap<String, f64>>,
    ) -> Result<()> {
        self.store_flos()?;
        self.checkpointer
            .record_best(&mut self.state, eval_metrics.as_ref());
        let sharded = self.sharded();
        self.checkpointer
            .save(self.state.global_step, &self.parallel, self.place(), || {
                if sharded {
                    self.check_tied_copies()?;
                }
                Ok(Snapshot {
                    model: self.saved_tensors(),
                    optimizer: self.optimizer.state_tensors(),
                    covers: self.optimizer.covers(),
                    files: &self.files,
                    state: &self.state,
                    scheduler: sched,
                    training_args_json: self.args.to_hf_json(),
                })
            })
    }

    /// Under a pipeline with a tied embedding: the first and last stages' copies must be equal
    /// bit for bit before stage 0's is saved as the one copy.
    fn check_tied_copies(&self) -> Result<()> {
        match self.parallel.pipeline() {
            Some(p) => p.check_tied_copies::<B, M>(self.model(), self.state.global_step),
            None => Ok(()),
        }
    }

    /// Under pipeline parallelism, gives every stage the layers the others trained, so each rank
    /// holds the whole current model (before an evaluation or the final save).
    fn gather_stages(&mut self) -> Result<()> {
        if self.parallel.pipeline().is_some() {
            let model = self.take_model();
            self.model = Some(self.parallel.gather_stages::<B, M>(model)?);
        }
        Ok(())
    }

    /// Saves the model (config.json, model.safetensors, tokenizer.json) and trainer state to `dir`,
    /// all files as one group: a failure (a full disk) leaves the previous model whole, and a model
    /// with non-finite weights is never written.
    pub fn save_model(&self, dir: &Path) -> Result<()> {
        let tensors = self.whole_model_tensors()?;
        if self.parallel.split_model() && !self.is_main() {
            // Every rank helped put the model together; rank 0 writes it.
            return Ok(());
        }
        self.write_model(dir, tensors)
    }

    /// The model's parameters, whole: a tensor-parallel model's shards are put together (every
    /// rank of its group must call this; only rank 0 receives them, the others an empty map).
    fn whole_model_tensors(
        &self,
    ) -> Result<BTreeMap<String, crate::formats::safetensors::HostTensor>> {
        let local = self.saved_tensors();
        match self.parallel.tensor() {
            None => Ok(local),
            Some(layout) => {
                crate::parallel::tensor_parallel::consolidate(layout, local, self.is_main())
            }
        }
    }

    /// The parameters a saved folder holds: all of them, or a LoRA run's adapter (its factors and
    /// `modules_to_save`): the frozen base is never copied into checkpoints.
    fn saved_tensors(&self) -> BTreeMap<String, crate::formats::safetensors::HostTensor> {
        match &self.files.adapter {
            Some(a) => module_tensors_where(self.model(), |path| a.adapter.owns(path)),
            None => module_tensors(self.model()),
        }
    }

    fn write_model(
        &self,
        dir: &Path,
        tensors: BTreeMap<String, crate::formats::safetensors::HostTensor>,
    ) -> Result<()> {
        ensure_finite(&tensors, &format!("saving the model to {}", dir.display()))?;
        let mut group = crate::io::files::FileGroup::new(dir)?;
        put_model_files(&tensors, &self.files, |name, bytes| group.add(name, bytes))?;
        group.add(
            "trainer_state.json",
            &serde_json::to_vec_pretty(&self.state).expect("json"),
        )?;
        group.add("training_args.json", self.args.to_hf_json().as_bytes())?;
        group.commit()?;
        info!("saved model to {}", dir.display());
        Ok(())
    }

    /// A step whose loss or gradient norm is NaN/inf: its update is skipped while the budget of
    /// `--skip-nonfinite-steps` lasts; past it, training stops with an error naming the step.
    fn skip_nonfinite_step(&mut self, loss: f64, grad_norm: f64, overflowed: bool) -> Result<()> {
        let step = self.state.global_step + 1;
        let budget = self.args.skip_nonfinite_steps;
        if self.counters.skipped_nonfinite < budget {
            self.counters.skipped_nonfinite += 1;
            tracing::warn!(
                "step {step}: loss {loss} / grad_norm {grad_norm} is not finite: update skipped \
                 ({} of --skip-nonfinite-steps {budget})",
                self.counters.skipped_nonfinite
            );
            return Ok(());
        }
        Err(KilnError::NonFinite(format!(
            "step {step}: {}: training diverged and stopped before this update; nothing after \
             step {} was saved (lower --learning-rate, check the data or the model, or let up to \
             N such steps be skipped with --skip-nonfinite-steps N{})",
            if overflowed {
                "the activations are not finite (a LayerNorm/RMSNorm input overflowed f32 or \
                 held NaN, and the layer's output collapsed)"
                    .to_string()
            } else if loss.is_finite() {
                format!("the gradient norm is {grad_norm} (loss {loss})")
            } else {
                format!("the loss is {loss} (grad_norm {grad_norm})")
            },
            step - 1,
            if budget > 0 {
                format!("; {budget} were skipped already")
            } else {
                String::new()
            }
        )))
    }

    /// [`train`](Self::train), then a final evaluation on `eval`. Rank 0 logs both and, as
    /// transformers' example scripts do, writes `eval_results.json`, `eval_report.json` (with
    /// classification metrics) and `all_results.json` into `output_dir`.
    pub fn train_and_evaluate<S, E>(
        &mut self,
        train: &S,
        eval: Option<&E>,
    ) -> Result<(TrainOutput, Option<EvalOutput>)>
    where
        S: BatchSource<Batch = M::Batch>,
        E: BatchSource<Batch = M::Batch>,
    {
        if shapes_only() {
            return self.precompile_shapes(train, eval);
        }
        let out = self.train_reporting(train, eval)?;
        info!(
            "***** train metrics *****  {}",
            format_metrics(&out.metrics)
        );
        let Some(eval) = eval else {
            self.write_summary(None);
            return Ok((out, None));
        };
        let ev = self.evaluate(eval)?;
        // As transformers' example scripts evaluate before `create_model_card()`, this
        // evaluation is the card's result.
        self.write_summary(Some(&ev));
        if self.is_main() {
            let dir = &self.args.output_dir;
            info!("***** eval metrics *****  {}", format_metrics(&ev.metrics));
            write_json(&dir.join("eval_results.json"), &ev.metrics)?;
            if let Some(r) = &ev.report {
                write_json(&dir.join("eval_report.json"), r)?;
            }
            let mut all = out.metrics.clone();
            all.extend(ev.metrics.clone());
            write_json(&dir.join("all_results.json"), &all)?;
        }
        Ok((out, Some(ev)))
    }

    /// The end of a run on rank 0: the curves and the model card, from the log history and, when
    /// given, a final evaluation after training.
    fn write_summary(&self, final_eval: Option<&EvalOutput>) {
        if !self.is_main() {
            return;
        }
        let mut history = self.state.log_history.clone();
        if let Some(ev) = final_eval {
            let mut entry: Map<String, Value> = ev
                .metrics
                .iter()
                .map(|(k, v)| (k.clone(), json!(v)))
                .collect();
            entry.insert("step".into(), json!(self.state.global_step));
            entry.insert("epoch".into(), json!(round4(self.state.epoch)));
            history.push(entry);
        }
        write_run_summary(
            &self.args.output_dir,
            &self.args,
            &self.reporting.origin,
            self.parallel.data.size(),
            &history,
        );
    }

    /// [`Self::evaluate`] during training, shown as such in the live state.
    fn evaluate_phase<E: BatchSource<Batch = M::Batch>>(&self, eval: &E) -> Result<EvalOutput> {
        self.reporters.phase(Phase::Evaluating);
        let out = self.evaluate(eval);
        self.reporters.phase(Phase::Training);
        out
    }

    /// Evaluates the current model (no dropout, no gradients) on `eval`. Under data parallelism
    /// each rank evaluates its share and the results are gathered, so every rank computes the
    /// metrics over the whole eval set.
    pub fn evaluate<E: BatchSource<Batch = M::Batch>>(&self, eval: &E) -> Result<EvalOutput> {
        evaluate(
            &self.model().valid(),
            eval,
            self.args.per_device_eval_batch_size,
            &self.loss,
            self.metrics.reported(),
            &self.parallel.data,
        )
    }
}

/// What a run counts as it goes, besides the trainer state transformers saves.
struct Counters {
    /// The loss of the last optimizer step (averaged over ranks), as the MNIST sample prints it.
    last_step_loss: f64,
    /// Steps skipped so far for a non-finite loss or gradient norm (`--skip-nonfinite-steps`).
    skipped_nonfinite: u64,
    /// The resumed checkpoint's sum of step losses since step 1 (`None`: a checkpoint that did
    /// not record it, or no resume — then 0 at step 0).
    resumed_loss_sum: Option<f64>,
    /// Non-embedding parameters of the whole model (all tensor-parallel shards), and this rank's
    /// floating-point operations since they were last added to `state.total_flos`.
    flos_params: f64,
    current_flos: f64,
    /// Under pipeline parallelism: the seconds this stage waited for its neighbours, and the
    /// seconds its share of the steps took.
    pipeline_seconds: (f64, f64),
}

impl Default for Counters {
    fn default() -> Self {
        Self {
            last_step_loss: f64::NAN,
            skipped_nonfinite: 0,
            resumed_loss_sum: None,
            flos_params: 0.0,
            current_flos: 0.0,
            pipeline_seconds: (0.0, 0.0),
        }
    }
}

/// What one optimizer step did.
pub(super) struct StepOutcome {
    /// The step's loss, averaged over micro-batches and ranks.
    loss: f64,
    grad_norm: f64,
    /// The rate this update used (what transformers logs for it).
    lr: f64,
    finite: bool,
    /// Examples trained on, over all ranks.
    samples: usize,
    /// This rank's examples and (padded) input tokens.
    rank_samples: usize,
    tokens: usize,
    /// The step's wall time, and the part spent in collectives (gradient sync).
    seconds: f64,
    collective_seconds: f64,
}

/// The running sums of one `train` call.
struct RunProgress {
    start: Instant,
    start_step: u64,
    samples: usize,
    /// Sum of the finite step losses of the whole call (from step 1 when `counts_from_step_1`),
    /// and of the current logging window.
    loss_sum: f64,
    counts_from_step_1: bool,
    log_loss_sum: f64,
    log_steps: u64,
    /// The last evaluation's metrics, for the next checkpoint's best-model tracking.
    pending_eval: Option<BTreeMap<String, f64>>,
    bar: ProgressBar,
}

impl RunProgress {
    fn new(start_step: u64, bar: ProgressBar) -> Self {
        Self {
            start: Instant::now(),
            start_step,
            samples: 0,
            loss_sum: 0.0,
            counts_from_step_1: false,
            log_loss_sum: 0.0,
            log_steps: 0,
            pending_eval: None,
            bar,
        }
    }

    fn record(&mut self, step: &StepOutcome) {
        self.samples += step.samples;
        // As transformers' logging_nan_inf_filter: a skipped step's loss stays out of the logged
        // averages.
        if step.finite {
            self.loss_sum += step.loss;
            self.log_loss_sum += step.loss;
            self.log_steps += 1;
        }
    }
}

/// `name = value` pairs on one line, for logs.
/// What a pipeline cuts `model` by, read from the built model.
fn model_outline<B: Backend, M: Model<B>>(model: &M) -> ModelOutline {
    let shapes = module_shapes(model);
    ModelOutline {
        layers: model.segments().map(|s| s.num_layers()),
        embedding: model.embedding_parameters(),
        // A decoder's head has a parameter of its own (`lm_head.weight`) unless it is tied.
        tied: !shapes.keys().any(|p| p.ends_with("lm_head.weight")),
        shapes,
    }
}

pub fn format_metrics(m: &BTreeMap<String, f64>) -> String {
    m.iter()
        .map(|(k, v)| format!("{k} = {v:.4}"))
        .collect::<Vec<_>>()
        .join(", ")
}

pub fn write_json<T: serde::Serialize>(path: &Path, v: &T) -> Result<()> {
    crate::io::atomic_write(path, &serde_json::to_vec_pretty(v).expect("json"))
}
/// AdamW's settings from the arguments (Lion takes the betas, every optimizer the weight decay).
fn adamw_config(a: &TrainingArguments) -> AdamWConfig {
    AdamWConfig {
        beta1: a.adam_beta1,
        beta2: a.adam_beta2,
        eps: a.adam_epsilon,
        weight_decay: a.weight_decay,
    }
}
