//! Row kernels: rotary embedding, cross-entropy and its gradient, masked softmax forward and
//! backward, LayerNorm's normalisation, and the erf behind GELU.

use super::*;

/// In place: one head's rotary embedding (or, with `transpose`, its transpose) at one position.
/// Pairs `(i, i + D/2)` turn by the 2×2 matrix `[[c_i, −s_i], [s_j, c_j]]` (`j = i + D/2`).
/// Vectorised where its caller runs inside [`simd`] (a head is 32–64 pairs: a [`simd`] call per
/// head cost more than the head).
#[inline(always)]
pub(super) fn rope_head(x: &mut [f32], c: &[f32], s: &[f32], transpose: bool) {
    let h = x.len() / 2;
    let (a, b) = x.split_at_mut(h);
    let (c1, c2) = c.split_at(h);
    let (s1, s2) = s.split_at(h);
    for i in 0..h {
        let (u, v) = (a[i], b[i]);
        if transpose {
            a[i] = u * c1[i] + v * s2[i];
            b[i] = v * c2[i] - u * s1[i];
        } else {
            a[i] = u * c1[i] - v * s1[i];
            b[i] = v * c2[i] + u * s2[i];
        }
    }
}

/// Cross-entropy of the rows of `x` (as many as `targets`): each row's log-sum-exp into `lse` and
/// its loss into `losses`.
pub(super) fn cross_entropy_rows(
    x: &[f32],
    targets: &[Option<usize>],
    losses: &mut [f32],
    lse: &mut [f32],
) {
    if targets.is_empty() {
        return;
    }
    let c = x.len() / targets.len();
    for (((row, t), l), e) in x.chunks(c).zip(targets).zip(losses).zip(lse) {
        *e = log_sum_exp(row);
        *l = t.map_or(0.0, |t| *e - row[t]);
    }
}

/// In place: the logits rows `dx` become their cross-entropy gradient (upstream `dloss`).
pub(super) fn cross_entropy_grad_rows(
    dx: &mut [f32],
    targets: &[Option<usize>],
    lse: &[f32],
    dloss: &[f32],
) {
    if targets.is_empty() {
        return;
    }
    let c = dx.len() / targets.len();
    for (((row, t), &e), &g) in dx.chunks_mut(c).zip(targets).zip(lse).zip(dloss) {
        softmax_minus_onehot_row(row, *t, e, g);
    }
}

/// `log Σ exp(row)`, shifted by the row's maximum so no term overflows.
#[inline(always)]
pub(super) fn log_sum_exp(row: &[f32]) -> f32 {
    simd(
        #[inline(always)]
        || {
            let max = max_of(row);
            max + sum_map(row, |x| exp_fast(x - max)).ln()
        },
    )
}

/// In place: `row ← g · (exp(row − lse) − onehot(target))`, one row of cross-entropy's gradient
/// (all zeros for an ignored row).
#[inline(always)]
pub(super) fn softmax_minus_onehot_row(row: &mut [f32], target: Option<usize>, lse: f32, g: f32) {
    let Some(t) = target else {
        row.fill(0.0);
        return;
    };
    simd(
        #[inline(always)]
        || {
            for x in row.iter_mut() {
                *x = g * exp_fast(*x - lse);
            }
        },
    );
    row[t] -= g;
}

/// The class of each of the `n` targets (`None` for `ignore`). A target outside `0..classes` is a
/// bug upstream (data loading checks labels against the model), so it stops the step as torch does.
pub(super) fn class_indices(
    targets: NdArrayTensor,
    n: usize,
    classes: usize,
    ignore: i64,
) -> Vec<Option<usize>> {
    let values: Vec<i64> = match targets {
        NdArrayTensor::I64(s) => s.into_shared().iter().copied().collect(),
        NdArrayTensor::I32(s) => s.into_shared().iter().map(|&v| v as i64).collect(),
        other => panic!(
            "cross-entropy targets must be integers, got {:?}",
            other.dtype()
        ),
    };
    assert_eq!(values.len(), n, "one target per row of logits");
    values
        .into_iter()
        .map(|t| {
            if t == ignore {
                return None;
            }
            assert!(
                (0..classes as i64).contains(&t),
                "cross-entropy target {t} is outside the {classes} classes (and is not the ignored {ignore})"
            );
            Some(t as usize)
        })
        .collect()
}

/// In place: `row ← softmax(row·scale + mask)` (one attention row; `mask` is additive, per key).
#[inline(always)]
pub(super) fn softmax_row(row: &mut [f32], mask: &[f32], scale: f32) {
    let inv = 1.0 / exp_row(row, mask, scale);
    scale_by(row, inv);
}

/// `x ← x · f`, element-wise.
#[inline]
pub(super) fn scale_by(x: &mut [f32], f: f32) {
    simd(
        #[inline(always)]
        || x.iter_mut().for_each(|v| *v *= f),
    )
}

/// In place: `row ← e^{row·scale + mask − max}`, returning the sum ([`softmax_row`] before its
/// division). The exponentials are summed as they are made, in the lanes of [`sum_map`] and in
/// its order, so the sum is the one a separate pass would give.
#[inline(always)]
pub(super) fn exp_row(row: &mut [f32], mask: &[f32], scale: f32) -> f32 {
    simd(
        #[inline(always)]
        || {
            for (x, &mv) in row.iter_mut().zip(mask) {
                *x = *x * scale + mv;
            }
            let max = max_of(row);
            let mut acc = [0f32; LANES];
            let mut chunks = row.chunks_exact_mut(LANES);
            for c in &mut chunks {
                let c: &mut [f32; LANES] = c.try_into().expect("LANES");
                for l in 0..LANES {
                    c[l] = exp_fast(c[l] - max);
                    acc[l] += c[l];
                }
            }
            let mut tail = 0.0;
            for x in chunks.into_remainder() {
                *x = exp_fast(*x - max);
                tail += *x;
            }
            acc.iter().sum::<f32>() + tail
        },
    )
}

/// In place: `dy ← scale · p ⊙ (dy − ⟨dy, p⟩)`, the gradient of one [`softmax_row`] row (p its output).
#[inline(always)]
pub(super) fn softmax_backward_row(dy: &mut [f32], p: &[f32], scale: f32) {
    simd(
        #[inline(always)]
        || {
            let dot = sum_zip2(dy, p, |d, p| d * p);
            for (d, &pv) in dy.iter_mut().zip(p) {
                *d = scale * pv * (*d - dot);
            }
        },
    )
}

/// `y = (z − mean)/σ · w + b` for one row; returns (mean, 1/σ).
#[inline(always)]
pub(super) fn normalize_row(
    z: &[f32],
    y: &mut [f32],
    w: &[f32],
    b: &[f32],
    eps: f32,
) -> (f32, f32) {
    simd(
        #[inline(always)]
        || {
            let h = z.len() as f32;
            let mean = sum_map(z, |x| x) / h;
            let var = sum_map(z, |x| (x - mean) * (x - mean)) / h;
            if !var.is_finite() {
                crate::ops::note_activation_overflow();
            }
            let rstd = 1.0 / (var + eps).sqrt();
            for (((y, &z), &w), &b) in y.iter_mut().zip(z).zip(w).zip(b) {
                *y = (z - mean) * rstd * w + b;
            }
            (mean, rstd)
        },
    )
}

/// erf with |error| < 1.5e-7 (Abramowitz & Stegun 7.1.26); returns (erf(z), e^{-z²}).
#[inline(always)]
pub(super) fn erf_and_gauss(z: f32) -> (f32, f32) {
    let a = z.abs();
    let t = 1.0 / 0.327_591_1f32.mul_add(a, 1.0);
    // Horner's rule in fused multiply-adds, as in [`exp_fast`].
    let mut poly = 1.061_405_4f32;
    poly = poly.mul_add(t, -1.453_152_1);
    poly = poly.mul_add(t, 1.421_413_7);
    poly = poly.mul_add(t, -0.284_496_74);
    poly = poly.mul_add(t, 0.254_829_6);
    poly *= t;
    let g = exp_fast(-a * a);
    let e = (-poly).mul_add(g, 1.0);
    (if z < 0.0 { -e } else { e }, g)
}

pub(super) const INV_SQRT2: f32 = std::f32::consts::FRAC_1_SQRT_2;
pub(super) const INV_SQRT_2PI: f32 = 0.398_942_3;
