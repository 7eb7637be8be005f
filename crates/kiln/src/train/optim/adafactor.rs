//! Adafactor as transformers' Trainer builds it for `optim` = `adafactor`
//! (`Adafactor(scale_parameter=False, relative_step=False)`, its defaults: eps 1e-30,
//! clip_threshold 1, decay_rate −0.8): second moments factored into row and column means for
//! parameters of two or more dimensions, the update's RMS clipped, weight decay by `lr·wd`.

use burn::tensor::Tensor;

use super::slots::{At, Slots};
use crate::ops::{recip_exact, KilnBackend};

/// Adafactor's defaults in transformers.
const ADAFACTOR_EPS: f64 = 1e-30;
const ADAFACTOR_CLIP: f64 = 1.0;
const ADAFACTOR_DECAY_RATE: f64 = -0.8;

/// A parameter of 2 or more dimensions as Adafactor factors it: (leading, rows, columns).
fn factored(dims: &[usize]) -> Option<(usize, usize, usize)> {
    let k = dims.len();
    (k >= 2).then(|| (dims[..k - 2].iter().product(), dims[k - 2], dims[k - 1]))
}

/// f32 values of state Adafactor keeps for a parameter of shape `dims`.
pub(super) fn state_len(dims: &[usize], beta1: Option<f64>) -> usize {
    let n: usize = dims.iter().product();
    let second = match factored(dims) {
        Some((l, r, c)) => l * (r + c),
        None => n,
    };
    second + usize::from(beta1.is_some()) * n
}

/// One Adafactor update of a parameter of shape `dims` (flat values `p`, gradient `g`) at
/// optimizer step `step`; the slots are transformers' (`exp_avg_sq_row`, `exp_avg_sq_col`,
/// `exp_avg_sq`, `exp_avg` with a `beta1`).
pub(super) fn step<B: KilnBackend>(
    slots: &mut Slots<B>,
    dims: &[usize],
    p: Tensor<B, 1>,
    g: Tensor<B, 1>,
    at: At,
    (beta1, step): (Option<f64>, u64),
) -> Tensor<B, 1> {
    let n = g.dims()[0];
    let beta2t = 1.0 - (step as f64).powf(ADAFACTOR_DECAY_RATE);
    let sq = g.clone() * g.clone() + ADAFACTOR_EPS;
    let update = match factored(dims) {
        Some((l, r, c)) => {
            let sq = sq.reshape([l, r, c]);
            let row = slots.take("exp_avg_sq_row", l * r, &g) * beta2t
                + sq.clone().mean_dim(2).reshape([l * r]) * (1.0 - beta2t);
            let col = slots.take("exp_avg_sq_col", l * c, &g) * beta2t
                + sq.mean_dim(1).reshape([l * c]) * (1.0 - beta2t);
            let row3 = row.clone().reshape([l, r, 1]);
            // 1/√x as torch's rsqrt rounds it (a root, then a true division).
            let r_factor = recip_exact((row3.clone() / row3.mean_dim(1)).sqrt());
            let c_factor = recip_exact(col.clone().reshape([l, 1, c]).sqrt());
            slots.put("exp_avg_sq_row", row);
            slots.put("exp_avg_sq_col", col);
            (r_factor * c_factor * g.reshape([l, r, c])).reshape([n])
        }
        None => {
            let v = slots.take("exp_avg_sq", n, &g) * beta2t + sq * (1.0 - beta2t);
            slots.put("exp_avg_sq", v.clone());
            recip_exact(v.sqrt()) * g
        }
    };
    // Clip the update's RMS to clip_threshold, on the device (no host round trip).
    let rms = (update.clone() * update.clone()).mean().sqrt();
    let update = update / (rms / ADAFACTOR_CLIP).clamp_min(1.0) * at.lr;
    let update = match beta1 {
        Some(b1) => {
            let m = slots.take("exp_avg", n, &update) * b1 + update * (1.0 - b1);
            slots.put("exp_avg", m.clone());
            m
        }
        None => update,
    };
    let p = if at.weight_decay != 0.0 {
        p.clone() + p * (-at.weight_decay * at.lr)
    } else {
        p
    };
    p - update
}
