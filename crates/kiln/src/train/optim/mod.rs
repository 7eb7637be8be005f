//! The trainer's optimizers, one per file, as transformers' Trainer builds them for `optim`: AdamW
//! (the default, one fused kernel; [`adamw`]) and the per-parameter rules [`sgd`], [`lion`] and
//! [`adafactor`], driven by [`rules`]. Every optimizer keeps its state by parameter path, so it saves
//! to and resumes from safetensors exactly; [`grads`] is the step's gradients and their clipping.

mod adafactor;
pub mod adamw;
pub mod grads;
mod lion;
pub mod rules;
mod sgd;
mod slots;

use std::collections::BTreeMap;
use std::ops::Range;

use burn::module::AutodiffModule;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Shape, Tensor, TensorMetadata, TensorPrimitive};

use crate::ops::KilnBackend;

use crate::formats::safetensors::HostTensor;
use crate::models::params::{map_params, ParamInfo};
use crate::parallel::zero::ZeroPartition;

pub use adamw::AdamW;
pub use grads::{clip_coefficient, GradAccumulator};
use rules::{Rule, RuleOptimizer};

#[derive(Debug, Clone, Copy, serde::Serialize, serde::Deserialize)]
pub struct AdamWConfig {
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
}

/// Hugging Face's `optim` names for the optimizers kiln has.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Default,
    serde::Serialize,
    serde::Deserialize,
    clap::ValueEnum,
)]
#[serde(rename_all = "snake_case")]
#[value(rename_all = "snake_case")]
pub enum OptimizerType {
    /// `adamw_torch`, or transformers 5.x's default `adamw_torch_fused` (the same update; kiln's
    /// AdamW is one fused kernel anyway).
    #[default]
    #[serde(alias = "adamw_torch_fused")]
    #[value(alias = "adamw_torch_fused")]
    AdamwTorch,
    /// `torch.optim.SGD`; momentum, dampening and nesterov from `optim_args`.
    Sgd,
    /// transformers' Adafactor as the Trainer builds it (no relative step, no parameter scaling).
    Adafactor,
    /// Lion with betas (adam_beta1, adam_beta2), as bitsandbytes' Lion32bit (`lion` also reads).
    #[serde(rename = "lion_32bit", alias = "lion")]
    #[value(name = "lion_32bit", alias = "lion")]
    Lion32bit,
}

/// The trainer's optimizer: AdamW (one fused kernel), or one of the rules in
/// [`super::optimizers`].
pub enum Optimizer<B: KilnBackend> {
    AdamW(AdamW<B>),
    Rule(RuleOptimizer<B>),
}

impl<B: KilnBackend> Optimizer<B> {
    /// `kind` with AdamW's settings `cfg` (Lion takes its betas, every rule the weight decay);
    /// SGD's options come from `optim_args` (transformers' `key=value,...` string).
    pub fn new(kind: OptimizerType, cfg: AdamWConfig) -> Self {
        Self::with_optim_args(kind, cfg, None).expect("no optim_args to read")
    }

    pub fn with_optim_args(
        kind: OptimizerType,
        cfg: AdamWConfig,
        optim_args: Option<&str>,
    ) -> crate::Result<Self> {
        if kind != OptimizerType::Sgd && optim_args.is_some_and(|s| !s.trim().is_empty()) {
            tracing::warn!(
                "optim_args has no effect on {kind:?} (as in transformers, which reads it for sgd, adagrad, rmsprop and a few others)"
            );
        }
        let rule = match kind {
            OptimizerType::AdamwTorch => return Ok(Self::AdamW(AdamW::new(cfg))),
            OptimizerType::Sgd => Rule::sgd_from_optim_args(optim_args)?,
            OptimizerType::Adafactor => Rule::Adafactor { beta1: None },
            OptimizerType::Lion32bit => Rule::Lion {
                beta1: cfg.beta1,
                beta2: cfg.beta2,
            },
        };
        Ok(Self::Rule(RuleOptimizer::new(rule, cfg.weight_decay)))
    }

    /// Optimizer steps taken.
    pub fn steps(&self) -> u64 {
        match self {
            Self::AdamW(a) => a.step,
            Self::Rule(r) => r.step,
        }
    }

    /// f32 values of optimizer state for parameters of these shapes.
    pub fn state_len<'a>(&self, shapes: impl Iterator<Item = &'a Vec<usize>>) -> usize {
        match self {
            Self::AdamW(_) => shapes.map(|s| 2 * s.iter().product::<usize>()).sum(),
            Self::Rule(r) => shapes.map(|s| r.rule.state_len(s)).sum(),
        }
    }

    pub fn step<AB, M>(&mut self, model: M, lr: f64, grads: GradAccumulator<B>) -> M
    where
        AB: AutodiffBackend<InnerBackend = B>,
        M: AutodiffModule<AB>,
    {
        match self {
            Self::AdamW(a) => a.step::<AB, M>(model, lr, grads),
            Self::Rule(r) => {
                r.step += 1;
                let GradAccumulator { mut grads, factor } = grads;
                map_params(model, |info, value: FloatTensor<AB>| {
                    let Some(g) = grads.remove(info.path) else {
                        return value;
                    };
                    let dims = value.shape().dims.clone();
                    update_flat::<AB>(value, |p| {
                        let p = Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(p));
                        r.update(info.path, &dims, p, (g, factor), lr, decays(info))
                            .into_primitive()
                            .tensor()
                    })
                })
            }
        }
    }

    /// [`AdamW::step_zero1`]; the other rules are not sharded (the trainer refuses the pair first).
    pub fn step_zero1<AB, M>(
        &mut self,
        model: M,
        lr: f64,
        partition: &ZeroPartition,
        chunk: (Tensor<B, 1>, f64),
        gather: impl FnOnce(Tensor<B, 1>) -> crate::Result<Tensor<B, 1>>,
    ) -> crate::Result<M>
    where
        AB: AutodiffBackend<InnerBackend = B>,
        M: AutodiffModule<AB>,
    {
        match self {
            Self::AdamW(a) => a.step_zero1::<AB, M>(model, lr, partition, chunk, gather),
            Self::Rule(_) => Err(crate::KilnError::Config(
                "--zero-1 shards AdamW's state only; use --optim adamw_torch".into(),
            )),
        }
    }

    /// Which values of each parameter the saved state covers (AdamW's; the rules save whole
    /// parameters only).
    pub fn covers(&self) -> BTreeMap<String, Range<usize>> {
        match self {
            Self::AdamW(a) => a.covers().clone(),
            Self::Rule(_) => BTreeMap::new(),
        }
    }

    /// Saved state (AdamW moments, or the rule's slots).
    pub fn state_tensors(&self) -> BTreeMap<String, HostTensor> {
        match self {
            Self::AdamW(a) => a.state_tensors(),
            Self::Rule(r) => r.state_tensors(),
        }
    }

    pub fn load_state(
        &mut self,
        step: u64,
        tensors: &BTreeMap<String, HostTensor>,
        covers: Option<&BTreeMap<String, Range<usize>>>,
        device: &B::Device,
    ) {
        match self {
            Self::AdamW(a) => a.load_state(step, tensors, covers, device),
            Self::Rule(r) => r.load_state(step, tensors, device),
        }
    }
}

/// Applies `update` to a parameter as one flat inner-backend tensor (gradients and optimizer state
/// are flat) and gives it back in its own shape; on the CPU backend neither reshape copies.
fn update_flat<AB: AutodiffBackend<InnerBackend: KilnBackend>>(
    value: FloatTensor<AB>,
    update: impl FnOnce(FloatTensor<AB::InnerBackend>) -> FloatTensor<AB::InnerBackend>,
) -> FloatTensor<AB> {
    let p = AB::inner(value);
    let shape = p.shape();
    let flat = AB::InnerBackend::kiln_reshape(p, Shape::new([shape.num_elements()]));
    AB::from_inner(AB::InnerBackend::kiln_reshape(update(flat), shape))
}

/// Whether decoupled weight decay applies: not to biases nor normalisation weights (transformers'
/// `get_decay_parameter_names`).
pub fn decays(info: &ParamInfo) -> bool {
    !(info.path.ends_with("bias") || info.owner.contains("Norm"))
}
