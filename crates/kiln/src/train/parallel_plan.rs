//! The run's parallelism as one value the trainer calls. Tasks build it before the trainer
//! (`ParallelPlan::new(DataParallel::join(..))`, like `init_process_group` at the top of a
//! script) and hand it to [`super::TrainerBuilder::parallel`]; training settles the rest from the model and
//! the arguments. It holds:
//! - the data-parallel strategy: this rank's share of the data, the initial broadcast, rank 0's
//!   writes, the evaluation gather (a world of one when run alone);
//! - the model's tensor-parallel layout, if it is sharded;
//! - ZeRO-1 over the data-parallel group (`--zero-1` with more than one data-parallel rank).
//!
//! A step's gradients go through it twice: [`ParallelPlan::sync_and_clip`] averages and clips
//! them (whole, or this rank's ZeRO-1 chunk), and [`ParallelPlan::update`] applies them. The
//! pipeline-parallel part (`--pipeline-parallel-size`) makes each rank one stage: its step runs
//! the stage's share of the micro-batches (`super::pipeline`), the step's loss comes from
//! the last stage and the global norm counts every stage's gradients, a tied weight once.

use std::collections::BTreeMap;

use burn::module::AutodiffModule;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::Shape;

use super::args::{PipelineOptions, TrainingArguments};
use super::grad_sync::{
    sync_and_clip, sync_and_clip_zero1, NormParts, StageNorm, Synced, SyncedGrads,
};
use super::optim::{GradAccumulator, Optimizer};
use super::pipeline::PipelinePlan;
use crate::contract::TensorParallelLayout;
use crate::models::params::{empty_where, module_bf16_params, module_shapes};
use crate::ops::KilnBackend;
use crate::parallel::broadcast_module;
use crate::parallel::pipeline::{owner_stage, MicroBatches};
use crate::parallel::{DataParallel, SharedCollectives, Zero1};
use crate::Result;

pub struct ParallelPlan<B: KilnBackend> {
    pub data: DataParallel<B>,
    tensor: Option<TensorParallelLayout>,
    zero: Option<Zero1<B>>,
    pipeline: Option<PipelinePlan<B>>,
}

/// What a pipeline cuts a model by: its decoder layers (`None`: not split into layers), every
/// parameter's whole shape (to weigh the stages), the embedding's parameters and whether the
/// head is tied to them. A task gives it from the config before building the model; otherwise
/// the trainer takes it from the model.
pub struct ModelOutline {
    pub layers: Option<usize>,
    pub shapes: BTreeMap<String, Vec<usize>>,
    pub embedding: Vec<String>,
    pub tied: bool,
}

impl ModelOutline {
    /// The outline of a model of `layers` decoder layers and these parameter `shapes`, whose
    /// embedding is `embedding`. Its head is tied to the embedding unless it has a parameter of
    /// its own: a causal LM's `lm_head.weight`, a sequence classifier's `score.weight`.
    pub fn new(
        layers: Option<usize>,
        shapes: BTreeMap<String, Vec<usize>>,
        embedding: Vec<String>,
    ) -> Self {
        let own_head = |p: &String| p.ends_with("lm_head.weight") || p.ends_with("score.weight");
        Self {
            layers,
            tied: !shapes.keys().any(own_head),
            shapes,
            embedding,
        }
    }
}

impl<B: KilnBackend> ParallelPlan<B> {
    /// A plan over `data`'s group; tensor parallelism and ZeRO-1 are settled when training starts.
    pub fn new(data: DataParallel<B>) -> Self {
        Self {
            data,
            tensor: None,
            zero: None,
            pipeline: None,
        }
    }

    /// The plan with this rank's pipeline `group` (from `DataParallel::join_mesh_pp`) and the
    /// run's pipeline options; the cut is settled when training starts.
    pub fn with_pipeline(
        mut self,
        group: Option<SharedCollectives<B>>,
        options: Option<PipelineOptions>,
    ) -> Self {
        self.pipeline = group
            .zip(options)
            .map(|(group, options)| PipelinePlan::new(group, options));
        self
    }

    /// Cuts the model `outline` describes into the pipeline's stages before it is built, so
    /// that each stage builds and reads only what [`Self::keep`] accepts; a no-op without a
    /// pipeline.
    pub fn cut_before_building(&mut self, outline: &ModelOutline) -> Result<()> {
        match &mut self.pipeline {
            Some(p) => p.cut(outline),
            None => Ok(()),
        }
    }

    /// What this rank builds, reads and trains of the model: its stage's parameters once
    /// cut, else every one.
    pub fn keep(&self) -> impl Fn(&str) -> bool + Send + Sync + 'static {
        let stage = self
            .pipeline
            .as_ref()
            .filter(|p| !p.holds.cuts.is_empty())
            .map(|p| p.holds.clone());
        move |path: &str| stage.as_ref().is_none_or(|s| s.holds(path))
    }

    pub fn pipeline(&self) -> Option<&PipelinePlan<B>> {
        self.pipeline.as_ref()
    }

    /// One process alone.
    pub fn single() -> Self {
        Self::new(DataParallel::single())
    }

    /// Takes the model's tensor-parallel layout (if sharded) and, with `zero_1`, ZeRO-1 over the
    /// data-parallel group (none when that group is one rank).
    /// With a pipeline, cuts the model `outline` describes into its stages (unless the task cut
    /// it before building it: [`Self::cut_before_building`]) and splits a step into
    /// micro-batches.
    pub(super) fn settle(
        &mut self,
        tensor: Option<TensorParallelLayout>,
        a: &TrainingArguments,
        outline: impl FnOnce() -> ModelOutline,
    ) -> Result<()> {
        self.tensor = tensor;
        self.zero = if a.zero_1 { self.data.zero1() } else { None };
        if let Some(p) = &mut self.pipeline {
            if p.holds.cuts.is_empty() {
                p.cut(&outline())?;
            }
            p.micro = MicroBatches::settle(
                a.per_device_train_batch_size,
                a.gradient_accumulation_steps,
                p.options.num_microbatches,
            )?;
        }
        Ok(())
    }

    /// Gives every stage the parameters every other stage trained, so each rank holds the whole
    /// current model (for evaluation and the final save); a no-op without a pipeline. A stage
    /// holds the others' parameters as empty tensors: their shapes (and whether they are held
    /// in bf16) come from their owners first, in one small sum over the group.
    pub(super) fn gather_stages<AB, M>(&mut self, model: M) -> Result<M>
    where
        AB: AutodiffBackend<InnerBackend = B>,
        M: AutodiffModule<AB>,
    {
        let Some(p) = &self.pipeline else {
            return Ok(model);
        };
        let shapes = module_shapes(&model);
        let bf16 = module_bf16_params(&model);
        // Each dimension, and whether the owner holds it in bf16, in one exact sum.
        let mut slots = Vec::new();
        for (path, dims) in &shapes {
            let own = p.owns(path);
            slots.extend(dims.iter().map(|&d| if own { d as u64 } else { 0 }));
            slots.push(u64::from(own && bf16.contains(path)));
        }
        let summed = p.group.sum_exact(&slots)?;
        let mut at = 0;
        let mut released = BTreeMap::new();
        for (path, dims) in &shapes {
            let whole: Vec<usize> = summed[at..at + dims.len()]
                .iter()
                .map(|&d| d as usize)
                .collect();
            let held = summed[at + dims.len()] > 0;
            at += dims.len() + 1;
            if !p.holds(path) {
                released.insert(path.clone(), (Shape::from(whole), held));
            }
        }
        broadcast_module::<B, AB, M>(
            p.group.as_ref(),
            model,
            |path| owner_stage(path, &p.holds.cuts, &p.holds.embedding),
            |path| released.get(path).cloned(),
        )
    }

    /// Lets go of the parameters this stage does not run with (each kept as an empty tensor of
    /// its rank): a stage's memory holds its own layers. A model built for this stage
    /// ([`Self::keep`]) holds nothing else already; a gathered one lets the others go again.
    /// A no-op without a pipeline.
    pub(super) fn release_other_stages<AB, M>(&mut self, model: M) -> M
    where
        AB: AutodiffBackend<InnerBackend = B>,
        M: AutodiffModule<AB>,
    {
        let Some(p) = &self.pipeline else {
            return model;
        };
        let holds = p.holds.clone();
        empty_where(model, "", &move |path| holds.holds(path))
    }

    pub fn tensor(&self) -> Option<&TensorParallelLayout> {
        self.tensor.as_ref()
    }

    pub fn zero(&self) -> Option<&Zero1<B>> {
        self.zero.as_ref()
    }

    /// Whether checkpoints are written per rank (tensor or pipeline parallelism, ZeRO-1).
    pub fn sharded(&self) -> bool {
        self.tensor.is_some() || self.zero.is_some() || self.pipeline.is_some()
    }

    /// Whether this rank writes parameter `path` into a checkpoint: under a pipeline, only the
    /// parameters its stage owns; every one otherwise.
    pub fn saves(&self, path: &str) -> bool {
        self.pipeline.as_ref().is_none_or(|p| p.owns(path))
    }

    /// Whether the model is put together from several ranks' parts when saved (tensor or
    /// pipeline parallelism): every rank takes part, rank 0 writes.
    pub fn split_model(&self) -> bool {
        self.tensor.is_some() || self.pipeline.is_some()
    }

    /// Whether a step needs no peer at all (one data-parallel rank, no tensor parallelism).
    pub fn alone(&self) -> bool {
        self.data.size() == 1 && self.tensor.is_none() && self.pipeline.is_none()
    }

    /// A step's accumulated gradients (and its summed loss) averaged over the data-parallel
    /// ranks and clipped to `max_norm` by one global norm.
    pub(super) fn sync_and_clip(
        &self,
        acc: GradAccumulator<B>,
        loss_sum: f64,
        device: &B::Device,
        max_norm: f64,
    ) -> Result<Synced<B>> {
        let parts = NormParts {
            tp: self.tensor.as_ref(),
            stages: self.pipeline.as_ref().map(|p| p as &dyn StageNorm),
        };
        match &self.zero {
            Some(zero) => sync_and_clip_zero1(acc, loss_sum, zero, &parts, max_norm),
            None => sync_and_clip(acc, loss_sum, device, &self.data, &parts, max_norm),
        }
    }

    /// Applies synced gradients at learning rate `lr`: every parameter, or (ZeRO-1) this rank's
    /// chunk, whose updated values are then gathered from every rank.
    pub(super) fn update<AB, M>(
        &self,
        optimizer: &mut Optimizer<B>,
        model: M,
        lr: f64,
        grads: SyncedGrads<B>,
    ) -> Result<M>
    where
        AB: AutodiffBackend<InnerBackend = B>,
        M: AutodiffModule<AB>,
    {
        match grads {
            SyncedGrads::Whole(acc) => Ok(optimizer.step::<AB, M>(model, lr, acc)),
            SyncedGrads::Chunk {
                partition,
                chunk,
                factor,
                zero,
            } => optimizer.step_zero1::<AB, M>(model, lr, &partition, (chunk, factor), |c| {
                zero.gather(c, &partition)
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::backend::{Cpu, CpuDevice, CpuTrain};
    use crate::models::llama::config::LlamaConfig;
    use crate::models::llama::LlamaForCausalLM;
    use crate::models::params::{module_shapes, module_tensors};
    use crate::parallel::pipeline::{Balance, ScheduleKind};
    use crate::parallel::threads::ThreadComm;

    fn llama(tie: bool, seed: u64) -> LlamaForCausalLM<CpuTrain> {
        let c: LlamaConfig = serde_json::from_value(serde_json::json!({
            "vocab_size": 50, "hidden_size": 32, "intermediate_size": 48,
            "num_hidden_layers": 5, "num_attention_heads": 4, "num_key_value_heads": 2,
            "tie_word_embeddings": tie}))
        .unwrap();
        let d = CpuDevice::default();
        crate::ops::with_seeded_rng::<CpuTrain, _>(&d, seed, || {
            LlamaForCausalLM::<CpuTrain>::new(&c, &d)
        })
    }

    /// Each stage keeps only the parameters it runs with (its layers; the embedding on the first,
    /// the norm and head on the last, and a tied embedding on both), and gathering the stages
    /// gives both ranks the same whole model: every parameter from the stage that holds it.
    #[test]
    fn a_stage_holds_its_layers_and_gathering_restores_the_whole_model() {
        for tie in [true, false] {
            let comms = ThreadComm::<Cpu>::group(2, &CpuDevice::default());
            let got: Vec<_> = std::thread::scope(|s| {
                let handles: Vec<_> = comms
                    .into_iter()
                    .enumerate()
                    .map(|(stage, comm)| {
                        s.spawn(move || {
                            let options = PipelineOptions {
                                size: 2,
                                num_microbatches: None,
                                schedule: ScheduleKind::OneFOneB,
                                cuts: Some(vec![3]),
                                balance: Balance::Layers,
                            };
                            let mut plan = ParallelPlan::<Cpu>::single()
                                .with_pipeline(Some(Arc::new(comm)), Some(options));
                            let embedding = vec!["model.embed_tokens.weight".to_string()];
                            let a = TrainingArguments::default();
                            let outline = || ModelOutline {
                                layers: Some(5),
                                shapes: BTreeMap::new(),
                                embedding,
                                tied: tie,
                            };
                            plan.settle(None, &a, outline).unwrap();
                            // Different weights per stage, so where each came from shows.
                            let model = llama(tie, 10 + stage as u64);
                            let before = module_tensors(&model);
                            let model = plan.release_other_stages::<CpuTrain, _>(model);
                            let kept: Vec<String> = module_shapes(&model)
                                .into_iter()
                                .filter(|(_, s)| s.iter().product::<usize>() > 0)
                                .map(|(p, _)| p)
                                .collect();
                            let model = plan.gather_stages::<CpuTrain, _>(model).unwrap();
                            (before, kept, module_tensors(&model))
                        })
                    })
                    .collect();
                handles.into_iter().map(|h| h.join().unwrap()).collect()
            });
            let owner = |p: &str| {
                if p.contains("layers.") {
                    let i: usize = p.split('.').nth(2).unwrap().parse().unwrap();
                    usize::from(i >= 3)
                } else {
                    usize::from(p != "model.embed_tokens.weight")
                }
            };
            for (stage, (_, kept, _)) in got.iter().enumerate() {
                for p in kept {
                    let tied_here = tie && stage == 1 && p == "model.embed_tokens.weight";
                    assert!(owner(p) == stage || tied_here, "stage {stage} kept {p}");
                }
                let held = got[0].0.keys().filter(|p| owner(p) == stage).count();
                assert_eq!(
                    kept.len(),
                    held + usize::from(tie && stage == 1),
                    "tie {tie}"
                );
            }
            for (p, t) in &got[0].2 {
                let from = &got[owner(p)].0[p];
                assert_eq!(t.shape, from.shape, "{p}");
                assert_eq!(t.data, from.data, "tie {tie}: {p} on stage 0");
                assert_eq!(got[1].2[p].data, from.data, "tie {tie}: {p} on stage 1");
            }
            // The control: the stages started from different weights.
            assert_ne!(
                got[0].0["model.norm.weight"].data.len(),
                0,
                "the norm is a parameter"
            );
            assert_ne!(
                got[0].0["model.layers.4.mlp.up_proj.weight"].data,
                got[1].0["model.layers.4.mlp.up_proj.weight"].data
            );
        }
    }
}
