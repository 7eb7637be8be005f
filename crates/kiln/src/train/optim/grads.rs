//! A step's gradients: summed over its micro-batches, flattened and keyed by parameter path, and
//! clipped by one global L2 norm over every parameter (`max_grad_norm`), as the Hugging Face Trainer
//! clips them (not per tensor).

use std::collections::BTreeMap;

use burn::module::{AutodiffModule, ModuleVisitor, Param};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{ElementConversion, Tensor, TensorData};

use crate::ops::KilnBackend;

use crate::models::params::PathTracker;

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
