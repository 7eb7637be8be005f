//! The [`Checkpointer`]: one component that decides when a checkpoint is due (`save_strategy`,
//! its interval, an improved evaluation, the last step under `load_best_model_at_end`), keeps the
//! best metric, writes the checkpoint (whole on rank 0, or every rank its shard) and rotates old
//! ones (`save_total_limit`), as transformers' Trainer does in `_save_checkpoint` and
//! `_rotate_checkpoints`. The trainer hands it a [`Snapshot`] of what to save and the run's
//! parallelism, and asks nothing else.

use std::collections::BTreeMap;
use std::ops::Range;
use std::path::{Path, PathBuf};

use tracing::info;

use super::folder::{
    checkpoint_dir, ensure_finite, publish, put_config_files, rotate_checkpoints, save_checkpoint,
    staging_dir, write_marker, Checkpoint, ModelFiles, SchedulerState, TrainerState,
};
use super::sharded::{write_layout, write_rank_files, ShardedRank};
use crate::formats::safetensors::HostTensor;
use crate::formats::sharded::LAYOUT_FILE;
use crate::io::files::{write_synced, TEMP_PREFIX};
use crate::ops::KilnBackend;
use crate::train::args::{IntervalStrategy, SaveStrategy, TrainingArguments};
use crate::train::output_dir::RunDir;
use crate::train::parallel_plan::ParallelPlan;
use crate::Result;

/// What one checkpoint holds, as this rank has it: its parameters and optimizer state (a sharded
/// run's shard of them), the files and state the trainer keeps.
pub struct Snapshot<'a> {
    pub model: BTreeMap<String, HostTensor>,
    pub optimizer: BTreeMap<String, HostTensor>,
    /// Which values of each parameter the optimizer state covers (a ZeRO-1 rank's part).
    pub covers: BTreeMap<String, Range<usize>>,
    pub files: &'a ModelFiles,
    pub state: &'a TrainerState,
    pub scheduler: &'a SchedulerState,
    pub training_args_json: String,
}

/// Saving, rotating and the best model, for one run; made when training starts, once the run's
/// total steps are known and rank 0 has claimed the output folder.
#[derive(Default)]
pub struct Checkpointer {
    output_dir: PathBuf,
    strategy: SaveStrategy,
    /// Steps between checkpoints under `save_strategy = steps`.
    every: u64,
    limit: Option<usize>,
    /// `save_only_model`: no optimizer state in checkpoints.
    model_only: bool,
    /// `load_best_model_at_end`: the last step is saved too, so that it can be the best.
    best_at_end: bool,
    /// `metric_for_best_model` (with its `eval_` prefix) and whether greater is better.
    best_metric: (String, bool),
    /// The run's id (every checkpoint's marker carries it; only its own are rotated) and, on
    /// rank 0, the lock on the output folder, held while the run lasts.
    run_id: String,
    _run: Option<RunDir>,
}

impl Checkpointer {
    /// The checkpointer of a run of `total` steps with arguments `a`; `run` is rank 0's claim on
    /// the output folder (`None` on the other ranks, which learn the run's id from no file).
    pub(crate) fn new(a: &TrainingArguments, total: u64, run: Option<RunDir>) -> Self {
        Self {
            output_dir: a.output_dir.clone(),
            strategy: a.save_strategy,
            every: a.save_interval(total),
            limit: a.save_total_limit,
            model_only: a.save_only_model,
            best_at_end: a.load_best_model_at_end,
            best_metric: a.best_metric(),
            run_id: run.as_ref().map(|r| r.run_id.clone()).unwrap_or_default(),
            _run: run,
        }
    }

    /// Whether evaluation `metrics` beat `best`, the best value so far (`metric_for_best_model`,
    /// `greater_is_better`); never when they lack the metric.
    pub fn improves(&self, metrics: &BTreeMap<String, f64>, best: Option<f64>) -> bool {
        let (name, greater) = &self.best_metric;
        match (metrics.get(name), best) {
            (None, _) => false,
            (Some(_), None) => true,
            (Some(&v), Some(b)) => (*greater && v > b) || (!*greater && v < b),
        }
    }

    /// Whether a checkpoint is due after optimizer step `step`: at its interval, at an epoch's
    /// end, or when `improved` (this step's evaluation beat the best), as `save_strategy` says;
    /// and on the `last` step under `load_best_model_at_end`.
    pub fn due(&self, step: u64, epoch_end: bool, improved: bool, last: bool) -> bool {
        let by_strategy = match self.strategy {
            SaveStrategy::No => false,
            SaveStrategy::Steps => IntervalStrategy::Steps.due(self.every, step, epoch_end),
            SaveStrategy::Epoch => epoch_end,
            SaveStrategy::Best => improved,
        };
        by_strategy || (last && self.best_at_end)
    }

    /// Records the evaluation a checkpoint of `state`'s step goes with: when it beats the best,
    /// `state` names that checkpoint as the best model.
    pub fn record_best(&self, state: &mut TrainerState, metrics: Option<&BTreeMap<String, f64>>) {
        let Some(m) = metrics else { return };
        let name = &self.best_metric.0;
        match m.get(name) {
            Some(&v) if self.improves(m, state.best_metric) => {
                state.best_metric = Some(v);
                let dir = checkpoint_dir(&self.output_dir, state.global_step);
                state.best_model_checkpoint = Some(dir.display().to_string());
            }
            Some(_) => {}
            None => tracing::warn!("metric_for_best_model {name} is not among the eval metrics"),
        }
    }

    /// Saves checkpoint-`step`, then rotates old ones; every rank returns once it is in place.
    /// A sharded run (tensor or pipeline parallelism, ZeRO-1) writes every rank's shard at
    /// `place`; otherwise rank 0 writes the whole checkpoint. `snapshot` is taken only on the
    /// ranks that write.
    pub fn save<'a, B: KilnBackend>(
        &self,
        step: u64,
        parallel: &ParallelPlan<B>,
        place: ShardedRank,
        snapshot: impl FnOnce() -> Result<Snapshot<'a>>,
    ) -> Result<()> {
        if parallel.sharded() {
            return self.save_sharded(step, parallel, place, snapshot);
        }
        if !parallel.data.is_main() {
            // Rank 0 writes; the others wait so that nobody reads a half-written checkpoint.
            return parallel.data.barrier();
        }
        let snap = snapshot()?;
        ensure_finite(&snap.model, &format!("saving checkpoint-{step}"))?;
        let path = save_checkpoint(
            &self.output_dir,
            &Checkpoint {
                model: &snap.model,
                files: snap.files,
                optimizer: (!self.model_only).then_some(&snap.optimizer),
                state: snap.state,
                scheduler: snap.scheduler,
                training_args_json: &snap.training_args_json,
            },
            &self.run_id,
        )?;
        info!("saved {}", path.display());
        self.rotate(snap.state)?;
        parallel.data.barrier()
    }

    /// A checkpoint of a sharded run: every rank writes its shard into the staging folder, then
    /// rank 0 adds the shared files, the layout and the marker, and moves it into place.
    fn save_sharded<'a, B: KilnBackend>(
        &self,
        step: u64,
        parallel: &ParallelPlan<B>,
        place: ShardedRank,
        snapshot: impl FnOnce() -> Result<Snapshot<'a>>,
    ) -> Result<()> {
        let out = &self.output_dir;
        let tmp = out.join(format!("{TEMP_PREFIX}checkpoint-{step}"));
        let main = parallel.data.is_main();
        if main {
            staging_dir(out, step)?;
        }
        parallel.data.barrier()?;
        let mut snap = snapshot()?;
        // Under a pipeline each stage writes what it owns: a tied embedding once, from stage 0.
        let saves_slot = |key: &String| {
            let path = key.rsplit_once('.').map_or(key.as_str(), |(p, _)| p);
            parallel.saves(path)
        };
        snap.model.retain(|k, _| parallel.saves(k));
        snap.optimizer.retain(|k, _| saves_slot(k));
        snap.covers.retain(|k, _| parallel.saves(k));
        write_rank_files(
            &tmp,
            place,
            &snap.model,
            parallel.tensor().map(|l| &l.splits),
            &snap.optimizer,
            &snap.covers,
        )?;
        parallel.data.barrier()?;
        if main {
            let mut put = |name: &str, bytes: &[u8]| write_synced(&tmp.join(name), bytes);
            put_config_files(snap.files, &mut put)?;
            put(
                "trainer_state.json",
                &serde_json::to_vec_pretty(snap.state).expect("json"),
            )?;
            put(
                "scheduler.json",
                &serde_json::to_vec_pretty(snap.scheduler).expect("json"),
            )?;
            put("training_args.json", snap.training_args_json.as_bytes())?;
            write_layout(&tmp, place)?;
            write_marker(&tmp, &self.run_id, step)?;
            let path = publish(out, &tmp, step)?;
            info!("saved {} (sharded: {LAYOUT_FILE})", path.display());
            self.rotate(snap.state)?;
        }
        parallel.data.barrier()
    }

    /// Deletes this run's oldest checkpoints past `save_total_limit`, never the best model's.
    fn rotate(&self, state: &TrainerState) -> Result<()> {
        if let Some(limit) = self.limit {
            let best = state.best_model_checkpoint.as_deref().map(Path::new);
            rotate_checkpoints(&self.output_dir, limit, best, &self.run_id)?;
        }
        Ok(())
    }
}
