//! AdamW exactly as `torch.optim.AdamW`, with the two Hugging Face Trainer conventions Burn's optimizer
//! lacks: weight decay is skipped for biases and LayerNorm weights, and gradients are clipped by one
//! global L2 norm over all parameters (`max_grad_norm`), not per tensor.
//!
//! State is keyed by parameter path, so it saves to and resumes from safetensors exactly.

use std::collections::BTreeMap;
use std::ops::Range;

use burn::module::AutodiffModule;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Shape, Tensor, TensorData, TensorMetadata, TensorPrimitive};

use crate::ops::{AdamWStep, KilnBackend};

use crate::formats::safetensors::HostTensor;
use crate::models::params::map_params;
use crate::parallel::zero::{OwnedSegment, ZeroPartition};

use super::{decays, update_flat, AdamWConfig, GradAccumulator};

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
