//! `torch.optim.SGD` (momentum, dampening, Nesterov) as transformers' Trainer builds it for
//! `optim` = `sgd`, its options read from `optim_args`. One fused kernel does the update.

use burn::tensor::Tensor;

use super::slots::{prim, tensor, Slots};
use crate::error::{KilnError, Result};
use crate::ops::{KilnBackend, SgdStep};

/// SGD's momentum, dampening and Nesterov flag from transformers' `optim_args` string, as
/// its `_get_sgd` reads them; any other key is an error naming it.
pub(super) fn options_from(optim_args: Option<&str>) -> Result<(f64, f64, bool)> {
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
    Ok((momentum, dampening, nesterov))
}

/// One SGD update of a parameter (flat values `p`, gradient `g`, scaled by `h.grad_scale` as the
/// kernel reads it); the momentum buffer is slot `momentum_buffer`.
pub(super) fn step<B: KilnBackend>(
    slots: &mut Slots<B>,
    p: Tensor<B, 1>,
    g: Tensor<B, 1>,
    h: SgdStep,
) -> Tensor<B, 1> {
    let buf = slots.remove("momentum_buffer");
    let (p, buf) = B::kiln_sgd(prim(p), prim(g), buf.map(prim), h);
    if let Some(buf) = buf {
        slots.put("momentum_buffer", tensor(buf));
    }
    tensor(p)
}
