//! This rank's stage of a pipeline as the trainer holds it: its group, the run's pipeline
//! options, where the model is cut and what this stage holds and owns, how a step splits into
//! micro-batches, and the checks and sums that span the stages.

use burn::module::AutodiffModule;
use burn::tensor::backend::AutodiffBackend;

use super::stage::Stage;
use crate::models::params::module_tensors_where;
use crate::ops::KilnBackend;
use crate::parallel::pipeline::{
    cut_by_work, cut_stages, Balance, MicroBatches, ScheduleKind, StageCut, StageHolds, Work,
};
use crate::parallel::SharedCollectives;
use crate::train::args::PipelineOptions;
use crate::train::grad_sync::StageNorm;
use crate::train::parallel_plan::ModelOutline;
use crate::{KilnError, Result};

/// This rank's stage of a pipeline.
pub struct PipelinePlan<B: KilnBackend> {
    /// The ranks holding the stages of this rank's replica (and TP shard); stage `s` is rank `s`.
    pub(in crate::train) group: SharedCollectives<B>,
    pub(in crate::train) options: PipelineOptions,
    /// Every stage's cut and what this one holds (once cut: before the model is built when the
    /// task cuts it from its config, else when training starts).
    pub(in crate::train) holds: StageHolds,
    /// How a step splits into micro-batches, once training starts.
    pub(in crate::train) micro: MicroBatches,
}

impl<B: KilnBackend> PipelinePlan<B> {
    /// This rank's stage in `group` (stage `s` is rank `s`) under the run's pipeline `options`;
    /// cut and split into micro-batches when training starts.
    pub(in crate::train) fn new(group: SharedCollectives<B>, options: PipelineOptions) -> Self {
        Self {
            holds: StageHolds {
                index: group.rank(),
                cuts: Vec::new(),
                embedding: Vec::new(),
                tied: false,
            },
            group,
            options,
            micro: MicroBatches {
                micro_batches: 1,
                micro_batch_size: 1,
            },
        }
    }

    pub fn index(&self) -> usize {
        self.group.rank()
    }

    pub fn count(&self) -> usize {
        self.group.size()
    }

    pub fn schedule(&self) -> ScheduleKind {
        self.options.schedule
    }

    pub fn cuts(&self) -> &[StageCut] {
        &self.holds.cuts
    }

    /// This rank's stage, for the stage runner.
    pub fn stage(&self) -> Stage<'_, B> {
        Stage {
            index: self.index(),
            count: self.count(),
            cut: self.holds.cuts[self.index()].clone(),
            group: self.group.as_ref(),
        }
    }

    /// How a data-parallel rank's step splits into micro-batches.
    pub fn micro_batches(&self) -> MicroBatches {
        self.micro
    }

    /// Sums a count over the stages, exactly ([`Collectives::sum_exact`]).
    pub fn count_sum(&self, n: usize) -> Result<usize> {
        Ok(self.group.sum_exact(&[n as u64])?[0] as usize)
    }

    /// Sums a step's loss over the stages (only the last computes it).
    pub fn stage_sum(&self, v: f64) -> Result<f64> {
        Ok(self.stage_sums(&[v])?[0])
    }

    /// Sums values over the stages: the last stage's (a loss, a metric's sums), the others' 0,
    /// so every stage gets the last one's exactly.
    pub fn stage_sums(&self, values: &[f64]) -> Result<Vec<f64>> {
        let sent = values.iter().map(|&v| v as f32).collect();
        Ok(self
            .group
            .sum_host(sent)?
            .into_iter()
            .map(f64::from)
            .collect())
    }

    /// Whether this stage runs with parameter `path`: its layers', the embedding on stage 0,
    /// the norm and head on the last (with a tied embedding, the embedding too).
    pub fn holds(&self, path: &str) -> bool {
        self.holds.holds(path)
    }

    /// Whether this stage owns `path`: it saves it, and the others receive it from it. A tied
    /// embedding is stage 0's.
    pub fn owns(&self, path: &str) -> bool {
        self.holds.owns(path)
    }

    /// Cuts the model `outline` describes into this pipeline's stages (`--pipeline-cuts`, else
    /// `--pipeline-balance`); a model not split into layers is one sentence.
    pub(in crate::train) fn cut(&mut self, outline: &ModelOutline) -> Result<()> {
        let layers = outline.layers.ok_or_else(|| {
            KilnError::Config(
                "--pipeline-parallel-size cuts a model at its decoder layers, and this model \
                 is not split into layers"
                    .into(),
            )
        })?;
        self.holds.cuts = match (&self.options.cuts, self.options.balance) {
            (None, Balance::Compute) => {
                let work =
                    Work::of_shapes(&outline.shapes, layers, &outline.embedding, outline.tied);
                cut_by_work(&work, self.options.size)?
            }
            (cuts, _) => cut_stages(layers, self.options.size, cuts.as_deref())?,
        };
        self.holds.embedding = outline.embedding.clone();
        self.holds.tied = outline.tied;
        Ok(())
    }

    /// With a tied embedding, checks that the first and last stages hold it equal bit for bit
    /// (every stage of the group takes part): each puts a 32-bit hash of its copy into its slot
    /// of an exact sum over the group.
    pub(in crate::train) fn check_tied_copies<AB, M>(&self, model: &M, step: u64) -> Result<()>
    where
        AB: AutodiffBackend<InnerBackend = B> + KilnBackend,
        M: AutodiffModule<AB>,
    {
        if !self.holds.tied {
            return Ok(());
        }
        let last = self.count() - 1;
        let mut slots = [0u64; 2];
        if self.index() == 0 || self.index() == last {
            let copies = module_tensors_where(model, |p| self.is_embedding(p));
            let hash = copies
                .values()
                .flat_map(|t| &t.data)
                .fold(0x811c_9dc5u32, |h, v| {
                    (h ^ v.to_bits()).wrapping_mul(0x0100_0193)
                });
            slots[usize::from(self.index() != 0)] = u64::from(hash);
        }
        let all = self.group.sum_exact(&slots)?;
        if all[0] != all[1] {
            return Err(KilnError::Checkpoint(format!(
                "the tied embedding {} differs between pipeline stages 0 and {last} at step \
                 {step}: their summed gradients or updates went apart, so no checkpoint is written",
                self.holds.embedding.join(", ")
            )));
        }
        Ok(())
    }

    /// Whether another stage counts `name`'s gradient in the global norm: a tied embedding is
    /// counted on stage 0 only.
    pub(in crate::train) fn counted_elsewhere(&self, name: &str) -> bool {
        self.index() > 0 && self.is_embedding(name)
    }

    fn is_embedding(&self, path: &str) -> bool {
        self.holds.embedding.iter().any(|e| e == path)
    }
}

impl<B: KilnBackend> StageNorm for PipelinePlan<B> {
    fn counted_elsewhere(&self, name: &str) -> bool {
        PipelinePlan::counted_elsewhere(self, name)
    }
    fn stage_sum(&self, v: f64) -> Result<f64> {
        PipelinePlan::stage_sum(self, v)
    }
}
