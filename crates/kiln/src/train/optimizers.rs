//! SGD (momentum, dampening, Nesterov), Lion and Adafactor, each as transformers' Trainer builds
//! it for `optim` = `sgd` (+ `optim_args`), `lion_32bit` and `adafactor`; AdamW, the default, is
//! `optim.rs`'s fused kernel. Every rule works on one parameter at a time, flat, with its state
//! kept under `<parameter path>.<slot>` (torch's state names), so it saves and resumes exactly.
//!
//! Weight decay follows the Trainer's two parameter groups (none for biases and LayerNorm
//! weights) and each optimizer's own convention: SGD adds `wd·p` to the gradient (torch), Lion and
//! Adafactor shrink the weights by `lr·wd` (bitsandbytes, transformers).

use std::collections::BTreeMap;

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Tensor, TensorData, TensorPrimitive};

use crate::error::{KilnError, Result};
use crate::formats::safetensors::HostTensor;
use crate::ops::{recip_exact, KilnBackend, SgdStep};

/// An update rule besides AdamW, with its hyper-parameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Rule {
    /// `torch.optim.SGD`.
    Sgd {
        momentum: f64,
        dampening: f64,
        nesterov: bool,
    },
    /// Lion (Chen et al. 2023) as bitsandbytes' `Lion32bit`, with the Trainer's
    /// `betas = (adam_beta1, adam_beta2)`.
    Lion { beta1: f64, beta2: f64 },
    /// transformers' `Adafactor(scale_parameter=False, relative_step=False)` with its defaults
    /// (eps 1e-30, clip_threshold 1, decay_rate −0.8); `beta1` is `None` under the Trainer.
    Adafactor { beta1: Option<f64> },
}

/// Adafactor's defaults in transformers.
const ADAFACTOR_EPS: f64 = 1e-30;
const ADAFACTOR_CLIP: f64 = 1.0;
const ADAFACTOR_DECAY_RATE: f64 = -0.8;

impl Rule {
    /// SGD's options from transformers' `optim_args` string (`momentum=0.9,nesterov=True`), as
    /// its `_get_sgd` reads them; any other key is an error naming it.
    pub fn sgd_from_optim_args(optim_args: Option<&str>) -> Result<Self> {
        let (mut momentum, mut dampening, mut nesterov) = (0.0, 0.0, false);
        for pair in optim_args
            .unwrap_or("")
            .split(',')
            .map(|p| p.replace(' ', ""))
            .filter(|p| !p.is_empty())
        {
            let bad = |why: &str| KilnError::Config(format!("optim_args {pair:?}: {why}"));
            let (key, value) = pair
                .split_once('=')
                .ok_or_else(|| bad("write key=value pairs separated by commas"))?;
            let number = || -> Result<f64> {
                value
                    .parse::<f64>()
                    .ok()
                    .filter(|v| v.is_finite() && *v >= 0.0)
                    .ok_or_else(|| bad("not a non-negative number"))
            };
            match key {
                "momentum" => momentum = number()?,
                "dampening" => dampening = number()?,
                "nesterov" => {
                    nesterov = crate::train::hf_values::hf_bool(value).map_err(|e| bad(&e))?
                }
                "weight_decay" => {
                    return Err(bad(
                        "the Trainer's parameter groups set the weight decay (use --weight-decay)",
                    ))
                }
                other => {
                    return Err(bad(&format!(
                        "sgd takes momentum, dampening and nesterov, not `{other}`"
                    )))
                }
            }
        }
        if nesterov && (momentum <= 0.0 || dampening != 0.0) {
            return Err(KilnError::Config(
                "optim_args: Nesterov momentum needs momentum above 0 and dampening 0 (as torch.optim.SGD)"
                    .into(),
            ));
        }
        Ok(Self::Sgd {
            momentum,
            dampening,
            nesterov,
        })
    }

    /// Whether the rule keeps state between steps (all but plain SGD).
    pub fn keeps_state(&self) -> bool {
        !matches!(self, Self::Sgd { momentum, .. } if *momentum == 0.0)
    }

    /// f32 values of state this rule keeps for a parameter of shape `dims`.
    pub fn state_len(&self, dims: &[usize]) -> usize {
        let n: usize = dims.iter().product();
        match *self {
            Self::Sgd { momentum, .. } => usize::from(momentum != 0.0) * n,
            Self::Lion { .. } => n,
            Self::Adafactor { beta1 } => {
                let second = match factored(dims) {
                    Some((l, r, c)) => l * (r + c),
                    None => n,
                };
                second + usize::from(beta1.is_some()) * n
            }
        }
    }
}

/// A parameter of 2 or more dimensions as Adafactor factors it: (leading, rows, columns).
fn factored(dims: &[usize]) -> Option<(usize, usize, usize)> {
    let k = dims.len();
    (k >= 2).then(|| (dims[..k - 2].iter().product(), dims[k - 2], dims[k - 1]))
}

/// The state of a [`Rule`] for every parameter.
pub struct RuleOptimizer<B: Backend> {
    pub rule: Rule,
    pub weight_decay: f64,
    /// Optimizer steps taken.
    pub step: u64,
    state: BTreeMap<String, Tensor<B, 1>>,
}

/// The backend's float tensor inside `t`, for the fused kernels.
fn prim<B: Backend>(t: Tensor<B, 1>) -> FloatTensor<B> {
    t.into_primitive().tensor()
}

fn tensor<B: Backend>(p: FloatTensor<B>) -> Tensor<B, 1> {
    Tensor::from_primitive(TensorPrimitive::Float(p))
}

impl<B: KilnBackend> RuleOptimizer<B> {
    pub fn new(rule: Rule, weight_decay: f64) -> Self {
        Self {
            rule,
            weight_decay,
            step: 0,
            state: BTreeMap::new(),
        }
    }

    /// The state slot `slot` of parameter `path`, or zeros like `like`.
    fn take(&mut self, path: &str, slot: &str, len: usize, like: &Tensor<B, 1>) -> Tensor<B, 1> {
        match self.state.remove(&format!("{path}.{slot}")) {
            Some(t) => {
                assert_eq!(
                    t.dims()[0],
                    len,
                    "{path}.{slot} does not match its parameter"
                );
                t
            }
            None => Tensor::zeros([len], &like.device()),
        }
    }

    fn put(&mut self, path: &str, slot: &str, t: Tensor<B, 1>) {
        self.state.insert(format!("{path}.{slot}"), t);
    }

    /// Updates parameter `path` (flat values `p` of shape `dims`, its gradient `g` times
    /// `grad_scale`, the pending clipping factor) at learning rate `lr`; `decay`: whether weight
    /// decay applies to it. Call once per parameter per step, after counting the step in
    /// [`Self::step`].
    pub fn update(
        &mut self,
        path: &str,
        dims: &[usize],
        p: Tensor<B, 1>,
        (g, grad_scale): (Tensor<B, 1>, f64),
        lr: f64,
        decay: bool,
    ) -> Tensor<B, 1> {
        let wd = if decay { self.weight_decay } else { 0.0 };
        let n = g.dims()[0];
        // SGD's fused kernel scales the gradient as it reads it; the other rules take it first.
        let g = match self.rule {
            Rule::Sgd { .. } if grad_scale != 1.0 => g,
            _ if grad_scale != 1.0 => g * grad_scale,
            _ => g,
        };
        match self.rule {
            Rule::Sgd {
                momentum,
                dampening,
                nesterov,
            } => {
                let buf = self.state.remove(&format!("{path}.momentum_buffer"));
                let h = SgdStep {
                    lr,
                    weight_decay: wd,
                    momentum,
                    dampening,
                    nesterov,
                    grad_scale,
                };
                let (p, buf) = B::kiln_sgd(prim(p), prim(g), buf.map(prim), h);
                if let Some(buf) = buf {
                    self.put(path, "momentum_buffer", tensor(buf));
                }
                tensor(p)
            }
            Rule::Lion { beta1, beta2 } => {
                let p = if wd != 0.0 { p * (1.0 - lr * wd) } else { p };
                let m = self.take(path, "exp_avg", n, &g);
                let c = m.clone() * beta1 + g.clone() * (1.0 - beta1);
                let p = p - c.sign() * lr;
                self.put(path, "exp_avg", m * beta2 + g * (1.0 - beta2));
                p
            }
            Rule::Adafactor { beta1 } => {
                let beta2t = 1.0 - (self.step as f64).powf(ADAFACTOR_DECAY_RATE);
                let sq = g.clone() * g.clone() + ADAFACTOR_EPS;
                let update = match factored(dims) {
                    Some((l, r, c)) => {
                        let sq = sq.reshape([l, r, c]);
                        let row = self.take(path, "exp_avg_sq_row", l * r, &g) * beta2t
                            + sq.clone().mean_dim(2).reshape([l * r]) * (1.0 - beta2t);
                        let col = self.take(path, "exp_avg_sq_col", l * c, &g) * beta2t
                            + sq.mean_dim(1).reshape([l * c]) * (1.0 - beta2t);
                        let row3 = row.clone().reshape([l, r, 1]);
                        // 1/√x as torch's rsqrt rounds it (a root, then a true division).
                        let r_factor = recip_exact((row3.clone() / row3.mean_dim(1)).sqrt());
                        let c_factor = recip_exact(col.clone().reshape([l, 1, c]).sqrt());
                        self.put(path, "exp_avg_sq_row", row);
                        self.put(path, "exp_avg_sq_col", col);
                        (r_factor * c_factor * g.reshape([l, r, c])).reshape([n])
                    }
                    None => {
                        let v = self.take(path, "exp_avg_sq", n, &g) * beta2t + sq * (1.0 - beta2t);
                        self.put(path, "exp_avg_sq", v.clone());
                        recip_exact(v.sqrt()) * g
                    }
                };
                // Clip the update's RMS to clip_threshold, on the device (no host round trip).
                let rms = (update.clone() * update.clone()).mean().sqrt();
                let update = update / (rms / ADAFACTOR_CLIP).clamp_min(1.0) * lr;
                let update = match beta1 {
                    Some(b1) => {
                        let m = self.take(path, "exp_avg", n, &update) * b1 + update * (1.0 - b1);
                        self.put(path, "exp_avg", m.clone());
                        m
                    }
                    None => update,
                };
                let p = if wd != 0.0 {
                    p.clone() + p * (-wd * lr)
                } else {
                    p
                };
                p - update
            }
        }
    }

    /// The state as host tensors, under torch's slot names.
    pub fn state_tensors(&self) -> BTreeMap<String, HostTensor> {
        self.state
            .iter()
            .map(|(k, t)| {
                let data = t
                    .to_data()
                    .convert::<f32>()
                    .into_vec::<f32>()
                    .expect("f32 data");
                (
                    k.clone(),
                    HostTensor {
                        shape: vec![data.len()],
                        data,
                    },
                )
            })
            .collect()
    }

    /// Restores what [`Self::state_tensors`] saved, at optimizer step `step`.
    pub fn load_state(
        &mut self,
        step: u64,
        tensors: &BTreeMap<String, HostTensor>,
        device: &B::Device,
    ) {
        self.step = step;
        self.state = tensors
            .iter()
            .map(|(k, t)| {
                let n = t.data.len();
                (
                    k.clone(),
                    Tensor::from_data(TensorData::new(t.data.clone(), [n]), device),
                )
            })
            .collect();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::NdArray;

    type B = NdArray<f32>;

    fn fixture() -> serde_json::Value {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../tests/fixtures/optimizers.json"
        );
        serde_json::from_str(&std::fs::read_to_string(path).expect("optimizers.json")).unwrap()
    }

    fn floats(v: &serde_json::Value) -> Vec<f32> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap() as f32)
            .collect()
    }

    fn rule_of(case: &serde_json::Value) -> Rule {
        let beta = |k: &str| case[k].as_f64();
        match case["optim"].as_str().unwrap() {
            "sgd" => Rule::sgd_from_optim_args(case["optim_args"].as_str()).unwrap(),
            "lion_32bit" => Rule::Lion {
                beta1: beta("beta1").unwrap(),
                beta2: beta("beta2").unwrap(),
            },
            "adafactor" => Rule::Adafactor {
                beta1: beta("beta1"),
            },
            other => panic!("unknown optimizer {other}"),
        }
    }

    /// Six steps of every rule, three parameters each (a matrix, a bias that does not decay, a
    /// 3-d tensor Adafactor factors per leading index), against torch / transformers /
    /// the Lion reference written by `gen_optimizers.py`, including the state saved and resumed
    /// half-way.
    #[test]
    fn every_rule_matches_its_reference_step_by_step() {
        let f = fixture();
        let lrs: Vec<f64> = f["lrs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect();
        let device = Default::default();
        for case in f["cases"].as_array().unwrap() {
            let name = case["name"].as_str().unwrap();
            let mut opt =
                RuleOptimizer::<B>::new(rule_of(case), case["weight_decay"].as_f64().unwrap());
            let params = case["params"].as_array().unwrap();
            let mut values: Vec<Tensor<B, 1>> = params
                .iter()
                .map(|p| {
                    let v = floats(&p["init"]);
                    let n = v.len();
                    Tensor::from_data(TensorData::new(v, [n]), &device)
                })
                .collect();
            let mut worst = 0f32;
            for (step, lr) in lrs.iter().enumerate() {
                if step == 3 {
                    // Save and resume half-way: the rest must not notice.
                    let saved = opt.state_tensors();
                    let rule = opt.rule;
                    let wd = opt.weight_decay;
                    let at = opt.step;
                    opt = RuleOptimizer::new(rule, wd);
                    opt.load_state(at, &saved, &device);
                }
                opt.step += 1;
                for (i, p) in params.iter().enumerate() {
                    let dims: Vec<usize> = p["shape"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .map(|d| d.as_u64().unwrap() as usize)
                        .collect();
                    let g = floats(&p["grads"][step]);
                    let n = g.len();
                    // Half the gradient with a pending factor of 2 (both exact in binary): the
                    // clipping factor must reach every rule exactly once.
                    let half: Vec<f32> = g.iter().map(|x| x * 0.5).collect();
                    let g = Tensor::from_data(TensorData::new(half, [n]), &device);
                    let path = p["name"].as_str().unwrap();
                    let decay = p["decay"].as_bool().unwrap();
                    values[i] = opt.update(path, &dims, values[i].clone(), (g, 2.0), *lr, decay);
                    let got = values[i].to_data().into_vec::<f32>().unwrap();
                    let want = floats(&p["after"][step]);
                    for (a, b) in got.iter().zip(&want) {
                        let err = (a - b).abs() / b.abs().max(1e-3);
                        worst = worst.max(err);
                        assert!(
                            err < 1e-5,
                            "{name}: {path} after step {}: {a} vs {b}",
                            step + 1
                        );
                    }
                }
            }
            eprintln!("{name}: worst relative error {worst:e}");
        }
    }

    #[test]
    fn sgd_options_are_read_as_transformers_reads_them() {
        assert_eq!(
            Rule::sgd_from_optim_args(Some("momentum=0.9, nesterov=True")).unwrap(),
            Rule::Sgd {
                momentum: 0.9,
                dampening: 0.0,
                nesterov: true
            }
        );
        let err = |s: &str| Rule::sgd_from_optim_args(Some(s)).unwrap_err().to_string();
        assert!(err("momentum=0.9,betas=2").contains("not `betas`"));
        assert!(err("weight_decay=0.1").contains("--weight-decay"));
        assert!(err("momentum").contains("key=value"));
        assert!(err("nesterov=True").contains("Nesterov"));
    }
}
