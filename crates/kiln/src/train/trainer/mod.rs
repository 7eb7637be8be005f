//! The training loop: Hugging Face `Trainer` semantics (accumulation, global-norm clipping, AdamW,
//! warmup schedules, step/epoch evaluation and saving, best-model tracking, exact resume).

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Instant;

use burn::module::AutodiffModule;
use burn::tensor::backend::Backend;
use indicatif::ProgressBar;
use serde_json::{json, Map, Value};
use tracing::info;

use super::args::TrainingArguments;
use super::checkpoint::sharded::ShardedRank;
use super::checkpoint::{Checkpointer, ModelFiles, SchedulerState, TrainerState};
pub use super::evaluate::{evaluate, EvalOutput, MetricFn, Reported, TokenMetrics};
use super::evaluate::{round4, EvalMetrics};
use super::optim::{AdamWConfig, Optimizer};
use super::parallel_plan::{ModelOutline, ParallelPlan};
use super::reporters::{write_run_summary, Reporters, Reporting};
use super::run_sizes::RunSizes;
use super::schedule::Plateau;
use crate::contract::{BatchSource, CrossEntropy, Loss, Model, ParamSplit};
use crate::data::batch::epoch_order;
use crate::error::{KilnError, Result};
use crate::models::params::module_shapes;
use crate::ops::TrainBackend;
use crate::parallel::mesh::{Coords, Mesh};
use crate::report::live::{Phase, StepReport};

mod builder;
mod save;
mod start;
mod step;
pub use builder::TrainerBuilder;

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
    device: B::Device,
    pub(crate) loss: L,
    /// What evaluations report besides the loss (class names, the user's metrics).
    pub(crate) metrics: EvalMetrics,
    files: ModelFiles,
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
    reporting: Reporting,
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
    /// A trainer of `model` on `device` under `args`; the builder's setters add the rest.
    pub fn builder(args: TrainingArguments, model: M, device: B::Device) -> TrainerBuilder<B, M> {
        TrainerBuilder::new(args, model, device)
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

    /// Trains on `train`, evaluating on `eval` as the arguments say; saves the final model in
    /// `output_dir`. One optimizer step at a time ([`Self::optimizer_step`]), then logging,
    /// evaluation and saving when they are due.
    pub fn train<S, E>(&mut self, train: &S, eval: Option<&E>) -> Result<TrainOutput>
    where
        S: BatchSource<Batch = M::Batch>,
        E: BatchSource<Batch = M::Batch>,
    {
        if self.args.precompile_shapes {
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
                    if self.metrics.num_tokens {
                        sched.num_tokens = self.tokens_so_far()?;
                    }
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
        for (name, value) in self.train_metric_values()? {
            entry[name] = json!(value);
        }
        if self.metrics.num_tokens {
            entry["num_tokens"] = json!(self.tokens_so_far()? as f64);
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

    /// Every data-parallel rank's tokens (padding aside) since step 1, this log's included.
    fn tokens_so_far(&mut self) -> Result<u64> {
        let mine = std::mem::take(&mut self.counters.tokens_since_log);
        self.counters.num_tokens += self.parallel.data.sum_exact(&[mine])?[0];
        Ok(self.counters.num_tokens)
    }

    /// The training metric's values over the micro-batches since the last log, summed over the
    /// data-parallel ranks (every rank logs at the same steps); its sums start again.
    fn train_metric_values(&mut self) -> Result<Vec<(String, f64)>> {
        let Some(metric) = &self.metrics.train_metrics else {
            return Ok(Vec::new());
        };
        let mut sums = std::mem::take(&mut self.counters.train_metric_sums);
        if sums.is_empty() {
            sums = metric.batch(&[], 0, &[]);
        }
        if self.parallel.data.size() > 1 {
            let summed = self
                .parallel
                .data
                .sum_host(sums.iter().map(|&v| v as f32).collect())?;
            sums = summed.into_iter().map(f64::from).collect();
        }
        Ok(metric.finish(&sums))
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
            num_tokens: self.counters.num_tokens,
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
        if self.args.precompile_shapes {
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
        let mut out = evaluate(
            &self.model().valid(),
            eval,
            self.args.per_device_eval_batch_size,
            &self.loss,
            self.metrics.reported(),
            &self.parallel.data,
        )?;
        if self.metrics.num_tokens {
            // TRL's evaluation logs the tokens trained on so far.
            let unlogged = self
                .parallel
                .data
                .sum_exact(&[self.counters.tokens_since_log])?[0];
            let total = self.counters.num_tokens + unlogged;
            out.metrics.insert("eval_num_tokens".into(), total as f64);
        }
        Ok(out)
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
    /// The training metric's sums over the micro-batches since the last log
    /// ([`EvalMetrics::train_metrics`]); empty when there is none.
    train_metric_sums: Vec<f64>,
    /// This rank's tokens (padding aside) since the last log, and every rank's since step 1
    /// ([`EvalMetrics::num_tokens`]).
    tokens_since_log: u64,
    num_tokens: u64,
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
            train_metric_sums: Vec::new(),
            tokens_since_log: 0,
            num_tokens: 0,
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
    ModelOutline::new(
        model.segments().map(|s| s.num_layers()),
        module_shapes(model),
        model.embedding_parameters(),
    )
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
