//! What the trainer writes: checkpoints through the [`Checkpointer`], the model at the end (whole,
//! from every rank's shard or stage), and the end of a run (its metrics, the best model loaded back).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use burn::module::AutodiffModule;
use serde_json::{json, Map, Value};
use tracing::info;

use super::*;
use crate::contract::{Loss, Model};
use crate::error::Result;
use crate::models::params::{load_into, module_tensors, module_tensors_where};
use crate::ops::TrainBackend;
use crate::report::live::Phase;
use crate::train::checkpoint::{ensure_finite, put_model_files, SchedulerState, Snapshot};
use crate::train::evaluate::{round3, round4};

impl<B, M, L> Trainer<B, M, L>
where
    B: TrainBackend,
    M: AutodiffModule<B> + Model<B> + Clone,
    M::InnerModule: Model<B::InnerBackend, Batch = M::Batch>,
    L: Loss,
{
    /// The run's summary metrics, the best model when asked for it, and the final model folder.
    pub(super) fn finish(&mut self, run: RunProgress) -> Result<TrainOutput> {
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

    /// Checkpoint-`global_step`, with the evaluation it goes with (for the best model), through
    /// the [`Checkpointer`].
    pub(super) fn save_checkpoint(
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
    pub(super) fn check_tied_copies(&self) -> Result<()> {
        match self.parallel.pipeline() {
            Some(p) => p.check_tied_copies::<B, M>(self.model(), self.state.global_step),
            None => Ok(()),
        }
    }

    /// Under pipeline parallelism, gives every stage the layers the others trained, so each rank
    /// holds the whole current model (before an evaluation or the final save).
    pub(super) fn gather_stages(&mut self) -> Result<()> {
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
    pub(super) fn whole_model_tensors(
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
    pub(super) fn saved_tensors(
        &self,
    ) -> BTreeMap<String, crate::formats::safetensors::HostTensor> {
        match &self.files.adapter {
            Some(a) => module_tensors_where(self.model(), |path| a.adapter.owns(path)),
            None => module_tensors(self.model()),
        }
    }

    pub(super) fn write_model(
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
}
