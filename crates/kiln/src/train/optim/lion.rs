//! Lion (Chen et al. 2023) as bitsandbytes' `Lion32bit`, which transformers' Trainer builds for
//! `optim` = `lion_32bit` with `betas = (adam_beta1, adam_beta2)`; weight decay shrinks the weights
//! by `lr·wd` first.

use burn::tensor::Tensor;

use super::slots::{At, Slots};
use crate::ops::KilnBackend;

/// One Lion update of a parameter (flat values `p`, gradient `g`); the momentum is slot `exp_avg`.
pub(super) fn step<B: KilnBackend>(
    slots: &mut Slots<B>,
    p: Tensor<B, 1>,
    g: Tensor<B, 1>,
    at: At,
    (beta1, beta2): (f64, f64),
) -> Tensor<B, 1> {
    let n = g.dims()[0];
    let p = if at.weight_decay != 0.0 {
        p * (1.0 - at.lr * at.weight_decay)
    } else {
        p
    };
    let m = slots.take("exp_avg", n, &g);
    let c = m.clone() * beta1 + g.clone() * (1.0 - beta1);
    let p = p - c.sign() * at.lr;
    slots.put("exp_avg", m * beta2 + g * (1.0 - beta2));
    p
}
