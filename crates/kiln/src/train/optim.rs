//! AdamW exactly as `torch.optim.AdamW`, with the two Hugging Face Trainer conventions Burn's optimizer
//! lacks: weight decay is skipped for biases and LayerNorm weights, and gradients are clipped by one
//! global L2 norm over all parameters (`max_grad_norm`), not per tensor.
//!
//! State is keyed by parameter path, so it saves to and resumes from safetensors exactly.

use std::collections::BTreeMap;
use std::ops::Range;

use burn::module::{AutodiffModule, ModuleVisitor, Param};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::ops::FloatTensor;
use burn::tensor::{ElementConversion, Shape, Tensor, TensorData, TensorMetadata, TensorPrimitive};

use crate::ops::{AdamWStep, KilnBackend};

use super::optimizers::{Rule, RuleOptimizer};
use crate::formats::safetensors::HostTensor;
use crate::models::params::{map_params, ParamInfo, PathTracker};
use crate::parallel::zero::{OwnedSegment, ZeroPartition};

/// Gradients summed over the micro-batches of one optimizer step, flattened, keyed by path.
pub struct GradAccumulator<B: Backend> {
    pub grads: BTreeMap<String, Tensor<B, 1>>,
    /// Pending multiplier of every gradient (clipping), applied inside the optimizer's fused step.
    pub factor: f64,
}

impl<B: Backend> Default for GradAccumulator<B> {
    fn default() -> Self {
        Self {
            grads: BTreeMap::new(),
            factor: 1.0,
        }
    }
}

struct GradVisit<'a, AB: AutodiffBackend> {
    tracker: PathTracker,
    grads: &'a AB::Gradients,
    acc: &'a mut GradAccumulator<AB::InnerBackend>,
}

impl<AB: AutodiffBackend<InnerBackend: KilnBackend>> ModuleVisitor<AB> for GradVisit<'_, AB> {
    fn enter_module(&mut self, name: &str, container: &str) {
        self.tracker.enter(name, container);
    }
    fn exit_module(&mut self, _: &str, _: &str) {
        self.tracker.exit();
    }
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<AB, D>>) {
        let Some(g) = param.val().grad(self.grads) else {
            return;
        };
        let n = g.shape().num_elements();
        let g = crate::ops::reshape(g, [n]);
        let path = self.tracker.path();
        let entry = match self.acc.grads.remove(&path) {
            Some(prev) => prev + g,
            None => g,
        };
        self.acc.grads.insert(path, entry);
    }
}

impl<B: KilnBackend> GradAccumulator<B> {
    /// Adds the gradients of `model`'s parameters found in `grads`.
    pub fn accumulate<AB, M>(&mut self, model: &M, grads: &AB::Gradients)
    where
        AB: AutodiffBackend<InnerBackend = B>,
        M: AutodiffModule<AB>,
    {
        self.accumulate_at::<AB, M>("", model, grads);
    }

    /// Adds another accumulator's gradients (same paths are summed).
    pub fn merge(&mut self, other: GradAccumulator<B>) {
        for (path, g) in other.grads {
            let entry = match self.grads.remove(&path) {
                Some(prev) => prev + g,
                None => g,
            };
            self.grads.insert(path, entry);
        }
    }

    /// [`accumulate`](Self::accumulate) for a part of a model: `module` sits at path `prefix`
    /// (`model.layers.3`) of the whole model, and its gradients are keyed under it.
    pub fn accumulate_at<AB, M>(&mut self, prefix: &str, module: &M, grads: &AB::Gradients)
    where
        AB: AutodiffBackend<InnerBackend = B>,
        M: AutodiffModule<AB>,
    {
        let mut tracker = PathTracker::default();
        for part in prefix.split('.').filter(|p| !p.is_empty()) {
            tracker.enter(part, "");
        }
        let mut v = GradVisit::<AB> {
            tracker,
            grads,
            acc: self,
        };
        module.visit(&mut v);
    }

    /// Replaces every gradient (and `value`, the step's loss) by what `reduce` makes of them, all
    /// in one flat buffer: the data-parallel average is one collective per step, not one per
    /// tensor.
    pub fn reduce_flat(
        &mut self,
        value: f64,
        device: &B::Device,
        reduce: impl FnOnce(Tensor<B, 1>) -> crate::Result<Tensor<B, 1>>,
    ) -> crate::Result<f64> {
        let sizes: Vec<usize> = self.grads.values().map(|g| g.dims()[0]).collect();
        let mut parts: Vec<Tensor<B, 1>> = self.grads.values().cloned().collect();
        parts.push(Tensor::from_data(
            TensorData::new(vec![value as f32], [1]),
            device,
        ));
        let reduced = reduce(Tensor::cat(parts, 0))?;
        let mut start = 0;
        for (g, n) in self.grads.values_mut().zip(sizes) {
            *g = reduced.clone().narrow(0, start, n);
            start += n;
        }
        let out: f32 = reduced.narrow(0, start, 1).into_scalar().elem();
        Ok(out as f64)
    }

    /// The global L2 norm of all gradients (after any pending scale).
    pub fn global_norm(&self) -> f64 {
        self.sum_squares(|_| true).sqrt() * self.factor.abs()
    }

    /// The sum of the squares of the gradients whose names `pick` (before any pending scale).
    pub fn sum_squares(&self, pick: impl Fn(&str) -> bool) -> f64 {
        B::kiln_sum_squares_all(
            self.grads
                .iter()
                .filter(|(name, _)| pick(name))
                .map(|(_, g)| g.clone().into_primitive().tensor())
                .collect(),
        )
    }

    /// Multiplies every gradient by `factor` (lazily: the optimizer applies it).
    pub fn scale(&mut self, factor: f64) {
        self.factor *= factor;
    }

    /// Clips to `max_norm` like `torch.nn.utils.clip_grad_norm_`; returns the norm before clipping.
    pub fn clip_global_norm(&mut self, max_norm: f64) -> f64 {
        let norm = self.global_norm();
        self.clip_norm(norm, max_norm);
        norm
    }

    /// Clips gradients whose global norm is `norm` (computed by the caller: under tensor
    /// parallelism it spans every rank's shards) to `max_norm`.
    pub fn clip_norm(&mut self, norm: f64, max_norm: f64) {
        self.scale(clip_coefficient(norm, max_norm));
    }
}

/// The factor `torch.nn.utils.clip_grad_norm_` multiplies gradients of global norm `norm` by
/// (1 when they are within `max_norm`, or `max_norm` is 0).
pub fn clip_coefficient(norm: f64, max_norm: f64) -> f64 {
    if max_norm > 0.0 {
        (max_norm / (norm + 1e-6)).min(1.0)
    } else {
        1.0
    }
}

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

/// AdamW moments for every parameter, on the inner (non-autodiff) backend.
pub struct AdamW<B: KilnBackend> {
    pub cfg: AdamWConfig,
    /// Number of optimizer steps taken (torch's per-parameter `step`; equal for all parameters).
    pub step: u64,
    moments: BTreeMap<String, (Tensor<B, 1>, Tensor<B, 1>)>,
    /// Which of each parameter's flat values its moments cover (all, or a ZeRO-1 rank's part).
    covers: BTreeMap<String, Range<usize>>,
}

impl<B: KilnBackend> AdamW<B> {
    pub fn new(cfg: AdamWConfig) -> Self {
        Self {
            cfg,
            step: 0,
            moments: BTreeMap::new(),
            covers: BTreeMap::new(),
        }
    }

    /// One update of every parameter that has a gradient, at learning rate `lr`.
    pub fn step<AB, M>(&mut self, model: M, lr: f64, mut grads: GradAccumulator<B>) -> M
    where
        AB: AutodiffBackend<InnerBackend = B>,
        M: AutodiffModule<AB>,
    {
        self.step += 1;
        let factor = grads.factor;
        map_params(model, |info, value: FloatTensor<AB>| {
            let Some(g) = grads.grads.remove(info.path) else {
                return value;
            };
            let h = self.hyper(lr, factor, decays(info));
            self.covers.insert(info.path.to_string(), 0..g.dims()[0]);
            update_flat::<AB>(value, |flat| self.update(info.path, flat, g, h))
        })
    }

    /// A ZeRO-1 update: `chunk` is this rank's chunk (laid out by `partition`) of the averaged
    /// gradients, to be multiplied by `factor`. Only the values this rank owns are updated, with
    /// moments kept for them alone; `gather` puts every rank's updated chunk back together into
    /// the whole flat vector, which becomes the model's parameters.
    pub fn step_zero1<AB, M>(
        &mut self,
        model: M,
        lr: f64,
        partition: &ZeroPartition,
        (chunk, factor): (Tensor<B, 1>, f64),
        gather: impl FnOnce(Tensor<B, 1>) -> crate::Result<Tensor<B, 1>>,
    ) -> crate::Result<M>
    where
        AB: AutodiffBackend<InnerBackend = B>,
        M: AutodiffModule<AB>,
    {
        self.step += 1;
        let owned: BTreeMap<String, OwnedSegment> = partition
            .owned()
            .into_iter()
            .map(|s| (s.path.clone(), s))
            .collect();
        let mut updated: Vec<(usize, Tensor<B, 1>)> = Vec::with_capacity(owned.len());
        let model = map_params(model, |info, value: FloatTensor<AB>| {
            if let Some(seg) = owned.get(info.path) {
                let p = AB::inner(value.clone());
                let n = p.shape().num_elements();
                let flat = Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(B::kiln_reshape(
                    p,
                    Shape::new([n]),
                )));
                let p = flat.narrow(0, seg.within.start, seg.within.len());
                let g = chunk.clone().narrow(0, seg.at.start, seg.at.len());
                let h = self.hyper(lr, factor, decays(info));
                self.covers
                    .insert(info.path.to_string(), seg.within.clone());
                let p = self.update(info.path, p.into_primitive().tensor(), g, h);
                updated.push((
                    seg.at.start,
                    Tensor::from_primitive(TensorPrimitive::Float(p)),
                ));
            }
            value
        });
        updated.sort_by_key(|(at, _)| *at);
        let local = Tensor::cat(updated.into_iter().map(|(_, t)| t).collect(), 0);
        let full = gather(local)?;
        Ok(map_params(model, |info, value: FloatTensor<AB>| {
            let Some(r) = partition.range_of(info.path) else {
                return value;
            };
            let shape = value.shape();
            let part = full
                .clone()
                .narrow(0, r.start, r.len())
                .into_primitive()
                .tensor();
            AB::from_inner(B::kiln_reshape(part, shape))
        }))
    }

    /// The current step's hyper-parameters for a parameter that does or does not decay.
    fn hyper(&self, lr: f64, grad_scale: f64, decay: bool) -> AdamWStep {
        let c = self.cfg;
        let t = self.step as i32;
        AdamWStep {
            lr,
            beta1: c.beta1,
            beta2: c.beta2,
            eps: c.eps,
            weight_decay: if decay { c.weight_decay } else { 0.0 },
            bias_correction1: 1.0 - c.beta1.powi(t),
            bias_correction2_sqrt: (1.0 - c.beta2.powi(t)).sqrt(),
            grad_scale,
        }
    }

    /// Updates the flat values `p` with gradient `g` and the moments kept under `key`.
    fn update(
        &mut self,
        key: &str,
        p: FloatTensor<B>,
        g: Tensor<B, 1>,
        h: AdamWStep,
    ) -> FloatTensor<B> {
        let (m, v) = match self.moments.remove(key) {
            Some((m, v)) => {
                // Resumed moments are cut for this rank's layout; any other length is a bug.
                assert_eq!(
                    m.dims(),
                    g.dims(),
                    "AdamW moments of {key} do not match its gradient"
                );
                (m, v)
            }
            None => (g.zeros_like(), g.zeros_like()),
        };
        let prim = |t: Tensor<B, 1>| t.into_primitive().tensor();
        let (p, m, v) = B::kiln_adamw(p, prim(g), prim(m), prim(v), h);
        let back = |x| Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(x));
        self.moments.insert(key.to_string(), (back(m), back(v)));
        p
    }

    pub fn state_tensors(&self) -> BTreeMap<String, HostTensor> {
        let host = |t: &Tensor<B, 1>| HostTensor {
            shape: t.dims().to_vec(),
            data: t
                .to_data()
                .convert::<f32>()
                .into_vec::<f32>()
                .expect("f32 data"),
        };
        let mut out = BTreeMap::new();
        for (k, (m, v)) in &self.moments {
            out.insert(format!("{k}.exp_avg"), host(m));
            out.insert(format!("{k}.exp_avg_sq"), host(v));
        }
        out
    }

    /// Which values of each parameter's flat shard the moments cover.
    pub fn covers(&self) -> &BTreeMap<String, Range<usize>> {
        &self.covers
    }

    /// Restores moments saved by [`Self::state_tensors`]; `covers` says which values of each
    /// parameter they are of (all of them when `None`).
    pub fn load_state(
        &mut self,
        step: u64,
        tensors: &BTreeMap<String, HostTensor>,
        covers: Option<&BTreeMap<String, Range<usize>>>,
        device: &B::Device,
    ) {
        self.step = step;
        self.moments.clear();
        self.covers = match covers {
            Some(c) => c.clone(),
            None => tensors
                .iter()
                .filter_map(|(k, t)| {
                    Some((k.strip_suffix(".exp_avg")?.to_string(), 0..t.data.len()))
                })
                .collect(),
        };
        let dev = |t: &HostTensor| {
            Tensor::<B, 1>::from_data(TensorData::new(t.data.clone(), [t.data.len()]), device)
        };
        for (k, m) in tensors {
            if let Some(path) = k.strip_suffix(".exp_avg") {
                if let Some(v) = tensors.get(&format!("{path}.exp_avg_sq")) {
                    self.moments.insert(path.to_string(), (dev(m), dev(v)));
                }
            }
        }
    }
}
