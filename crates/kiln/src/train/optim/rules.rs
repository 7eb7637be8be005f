//! The optimizers besides AdamW as one [`Rule`] each — SGD (momentum, dampening, Nesterov), Lion
//! and Adafactor, as transformers' Trainer builds them for `optim` = `sgd` (+ `optim_args`),
//! `lion_32bit` and `adafactor` — and the [`RuleOptimizer`] that drives them. Each rule's step is
//! its own file ([`super::sgd`], [`super::lion`], [`super::adafactor`]); every rule works on one
//! parameter at a time, flat, with its state kept under `<parameter path>.<slot>` (torch's state
//! names), so it saves and resumes exactly.
//!
//! Weight decay follows the Trainer's two parameter groups (none for biases and LayerNorm
//! weights) and each optimizer's own convention: SGD adds `wd·p` to the gradient (torch), Lion and
//! Adafactor shrink the weights by `lr·wd` (bitsandbytes, transformers).

use std::collections::BTreeMap;

use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};

use crate::error::Result;
use crate::formats::safetensors::HostTensor;
use crate::ops::{KilnBackend, SgdStep};

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

impl Rule {
    /// SGD's options from transformers' `optim_args` string (`momentum=0.9,nesterov=True`), as
    /// its `_get_sgd` reads them; any other key is an error naming it.
    pub fn sgd_from_optim_args(optim_args: Option<&str>) -> Result<Self> {
        let (momentum, dampening, nesterov) = super::sgd::options_from(optim_args)?;
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
            Self::Adafactor { beta1 } => super::adafactor::state_len(dims, beta1),
        }
    }
}

/// The state of a [`Rule`] for every parameter.
pub struct RuleOptimizer<B: Backend> {
    pub rule: Rule,
    pub weight_decay: f64,
    /// Optimizer steps taken.
    pub step: u64,
    state: BTreeMap<String, Tensor<B, 1>>,
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
        let _n = g.dims()[0];
        // SGD's fused kernel scales the gradient as it reads it; the other rules take it first.
        let g = match self.rule {
            Rule::Sgd { .. } if grad_scale != 1.0 => g,
            _ if grad_scale != 1.0 => g * grad_scale,
            _ => g,
        };
        let mut slots = super::slots::Slots {
            state: &mut self.state,
            path,
        };
        let at = super::slots::At {
            lr,
            weight_decay: wd,
        };
        match self.rule {
            Rule::Sgd {
                momentum,
                dampening,
                nesterov,
            } => {
                let h = SgdStep {
                    lr,
                    weight_decay: wd,
                    momentum,
                    dampening,
                    nesterov,
                    grad_scale,
                };
                super::sgd::step(&mut slots, p, g, h)
            }
            Rule::Lion { beta1, beta2 } => super::lion::step(&mut slots, p, g, at, (beta1, beta2)),
            Rule::Adafactor { beta1 } => {
                super::adafactor::step(&mut slots, dims, p, g, at, (beta1, self.step))
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
