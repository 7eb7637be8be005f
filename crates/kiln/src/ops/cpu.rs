//! Fused CPU kernels for the ndarray backend: contiguous f32 slices, rayon over rows, and
//! the `gemm` crate called with strides so no operand is ever transposed in memory.

use burn::backend::ndarray::{NdArray, NdArrayTensor};
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{Shape, TensorMetadata};
use ndarray::{ArcArray, IxDyn};
use rayon::prelude::*;

use super::KilnBackend;

mod attention;
use attention::Attn;

type Cpu = NdArray<f32>;

/// The tensor as a contiguous row-major f32 array (a copy only if it is a strided view).
fn dense(t: NdArrayTensor) -> ArcArray<f32, IxDyn> {
    match t {
        NdArrayTensor::F32(s) => {
            let a = s.into_shared();
            if a.is_standard_layout() {
                a
            } else {
                a.as_standard_layout().into_owned().into_shared()
            }
        }
        other => panic!("kiln CPU kernels take f32 tensors, got {:?}", other.dtype()),
    }
}

/// The elements of `a` (standard layout) as a vector to overwrite with a result of the same shape:
/// `a`'s own buffer when nothing else holds it — the gradient a backward kernel receives usually
/// is not kept anywhere else — and a copy otherwise. Saves an allocation and a pass over memory.
fn into_vec(a: ArcArray<f32, IxDyn>) -> Vec<f32> {
    let n = a.len();
    let (v, offset) = a.into_owned().into_raw_vec_and_offset();
    match offset {
        Some(0) if v.len() == n => v,
        Some(o) => v[o..o + n].to_vec(),
        None => Vec::new(), // no elements
    }
}

/// `f(x) ` element by element into a fresh vector, in parallel chunks, without zeroing or copying
/// the output first (which would double the memory traffic of a cheap element-wise op).
fn par_map(x: &[f32], f: impl Fn(f32) -> f32 + Sync) -> Vec<f32> {
    let n = x.len();
    let mut y = Vec::with_capacity(n);
    y.spare_capacity_mut()[..n]
        .par_chunks_mut(16_384)
        .zip(x.par_chunks(16_384))
        .for_each(|(yc, xc)| {
            simd(
                #[inline(always)]
                || {
                    for (y, &v) in yc.iter_mut().zip(xc) {
                        y.write(f(v));
                    }
                },
            )
        });
    // SAFETY: the loop above wrote all n elements (the chunks of `y` and `x` pair up one to one).
    unsafe { y.set_len(n) };
    y
}

fn tensor(shape: &[usize], v: Vec<f32>) -> NdArrayTensor {
    NdArrayTensor::from(ArcArray::from_shape_vec(IxDyn(shape), v).expect("shape matches data"))
}

fn slice(a: &ArcArray<f32, IxDyn>) -> &[f32] {
    a.as_slice().expect("standard layout")
}

/// C = A·B (+ C when `beta` is 1) (+ `bias` on every row) for row-major C `[m, n]`; A and B are given by
/// (row stride, column stride) so either may be read transposed. Runs on the `gemm` crate's kernels
/// (AVX-512 where the CPU has it — the `x86-v4` feature — else AVX2/FMA); matrixmultiply, used
/// before, has no AVX-512 kernel and is 1.2–2.1× slower on AVX-512 machines (docs/DESIGN.md "CPU
/// GEMM", `examples/gemm_crates.rs`).
///
/// kiln splits C into one tile per thread itself, each tile a single-threaded `gemm` call with the
/// bias added in the same task, instead of `gemm`'s own rayon split: on 2 threads that was as fast
/// or faster on every model shape measured (+24 % on MiniLM's weight gradient, 3× on the MNIST
/// MLP's first layer, where `gemm`'s split costs more than it saves), and products too small to
/// pay for a second thread run on the caller's.
#[allow(clippy::too_many_arguments)]
fn sgemm(
    m: usize,
    k: usize,
    n: usize,
    a: &[f32],
    (rsa, csa): (usize, usize),
    b: &[f32],
    (rsb, csb): (usize, usize),
    beta: f32,
    bias: Option<&[f32]>,
    c: &mut [f32],
) {
    if m == 0 || n == 0 {
        return;
    }
    assert!(k == 0 || a.len() > (m - 1) * rsa + (k - 1) * csa);
    assert!(k == 0 || b.len() > (k - 1) * rsb + (n - 1) * csb);
    assert!(c.len() >= m * n);
    assert!(bias.is_none_or(|b| b.len() >= n));
    assert!(
        beta == 0.0 || beta == 1.0,
        "β is 0 (overwrite C) or 1 (add to C)"
    );
    let (tm, tn) = gemm_grid(m, n, k, rayon::current_num_threads());
    // Tile edges: rows in multiples of 8, columns in multiples of 16 (one AVX-512 register).
    let (rows, cols) = (
        m.div_ceil(tm).div_ceil(8) * 8,
        n.div_ceil(tn).div_ceil(16) * 16,
    );
    let (cp, ap, bp) = (
        SharedMut(c.as_mut_ptr()),
        a.as_ptr() as usize,
        b.as_ptr() as usize,
    );
    let tile = |t: usize| {
        let (i0, j0) = ((t / tn) * rows, (t % tn) * cols);
        if i0 >= m || j0 >= n {
            return;
        }
        let (mr, nr) = (rows.min(m - i0), cols.min(n - j0));
        let (a, b) = (ap as *const f32, bp as *const f32);
        // SAFETY: the asserts above keep every element addressed by this tile of A, B and C in
        // bounds, and tiles are disjoint, so no two tasks write the same element of C.
        unsafe {
            let dst = cp.at(i0 * n + j0);
            small_gemm(
                (mr, nr, k),
                dst,
                (n, 1),
                a.add(i0 * rsa),
                (rsa, csa),
                b.add(j0 * csb),
                (rsb, csb),
                beta != 0.0,
            );
            if let Some(bias) = bias {
                for i in 0..mr {
                    let row = std::slice::from_raw_parts_mut(dst.add(i * n), nr);
                    add_into(row, &bias[j0..j0 + nr]);
                }
            }
        }
    };
    match tm * tn {
        1 => tile(0),
        tasks => (0..tasks).into_par_iter().for_each(tile),
    }
}

/// How many tiles (rows × columns of tiles) an `m×k·k×n` product is split into for `threads`
/// threads: at most one per thread, each at least [`GEMM_TASK_MIN`] multiply-adds, shaped as close
/// to square as the divisors allow (a thin tile packs its shared operand for little work).
pub(super) fn gemm_grid(m: usize, n: usize, k: usize, threads: usize) -> (usize, usize) {
    let tasks = (m * n * k / GEMM_TASK_MIN).clamp(1, threads.max(1));
    (1..=tasks)
        .filter(|tn| tasks.is_multiple_of(*tn))
        .map(|tn| (tasks / tn, tn))
        .max_by_key(|&(tm, tn)| (m / tm).min(n / tn))
        .unwrap_or((1, 1))
}

/// Multiply-adds below which a second thread costs more than it saves. Alone, the MNIST MLP's
/// 32×784×120 (3·2²⁰) runs faster as two tiles (`examples/gemm_crates.rs`), but the whole MNIST
/// step is 12 % faster with it on one thread (2²⁰ against 2²², four paired `kiln bench` runs):
/// the second thread's wake-up and cold caches cost more than the half product it takes.
const GEMM_TASK_MIN: usize = 1 << 22;

/// `dst += src`, element-wise.
#[inline]
fn add_into(dst: &mut [f32], src: &[f32]) {
    simd(
        #[inline(always)]
        || dst.iter_mut().zip(src).for_each(|(d, s)| *d += s),
    )
}

/// C = A·B (+ `bias` on every row) through [`sgemm`], or its bf16 counterpart under
/// [`super::MatmulPrecision::Bf16`]: the products of Linear layers (forward and both backward GEMMs).
#[allow(clippy::too_many_arguments)]
fn matmul(
    m: usize,
    k: usize,
    n: usize,
    a: &[f32],
    a_strides: (usize, usize),
    b: &[f32],
    b_strides: (usize, usize),
    bias: Option<&[f32]>,
    c: &mut [f32],
) {
    match super::matmul_precision() {
        super::MatmulPrecision::F32 => sgemm(m, k, n, a, a_strides, b, b_strides, 0.0, bias, c),
        super::MatmulPrecision::Bf16 => {
            let _p = super::profile::scope("part: bf16 GEMMs (inside linear_*)");
            // The bf16 kernel accumulates into C (β = 1) on top of the broadcast bias.
            let beta = match bias {
                Some(bias) => {
                    let chunk = rows_per_task(n) * n;
                    c[..m * n]
                        .par_chunks_mut(chunk)
                        .for_each(|rows| rows.chunks_mut(n).for_each(|r| r.copy_from_slice(bias)));
                    1.0
                }
                None => 0.0,
            };
            super::bf16::gemm_bf16(
                (m, k, n),
                a,
                a_strides,
                b,
                b_strides,
                beta,
                c,
                |m, k, n, a, b, beta, c| sgemm(m, k, n, a, (k, 1), b, (n, 1), beta, None, c),
            )
        }
    }
}

/// `x · w` for two equal-length slices, in 16 independent lanes (so it vectorises).
#[inline]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    sum_zip2(a, b, |x, y| x * y)
}

/// Rows of `x` at or below which a Linear runs as dot products (token-by-token decoding).
const GEMV_MAX_ROWS: usize = 4;

/// `y = x wᵀ (+ beta·y)` for a few rows `x [m, k]` and a PyTorch-layout weight `w [n, k]`: every
/// output is a contiguous dot product, so the weight streams through memory once, split across
/// threads by output. A GEMM would first pack the whole weight — for one row, that copy costs more
/// than the multiplication.
fn gemv_rows(m: usize, k: usize, n: usize, x: &[f32], w: &[f32], beta: f32, y: &mut [f32]) {
    const BLOCK: usize = 64;
    let parts: Vec<(usize, Vec<f32>)> = (0..n.div_ceil(BLOCK))
        .into_par_iter()
        .map(|bi| {
            let (j0, j1) = (bi * BLOCK, ((bi + 1) * BLOCK).min(n));
            let len = j1 - j0;
            let mut out = vec![0f32; m * len];
            for j in j0..j1 {
                let wj = &w[j * k..(j + 1) * k];
                for i in 0..m {
                    out[i * len + j - j0] = dot(&x[i * k..(i + 1) * k], wj);
                }
            }
            (j0, out)
        })
        .collect();
    for (j0, out) in parts {
        let len = out.len() / m;
        for i in 0..m {
            let row = &mut y[i * n + j0..i * n + j0 + len];
            for (o, v) in row.iter_mut().zip(&out[i * len..(i + 1) * len]) {
                *o = beta * *o + v;
            }
        }
    }
}

/// `y += x w` for a few rows `x [m, k]` and a weight laid out `[k, n]` (decoding). Each
/// task takes a contiguous band of weight rows, so the weight streams through memory in long
/// sequential runs, four rows per pass over the task's `m × n` partial sums, added up at the end.
/// Column blocks per task, tried first, read the weight in 1 KB pieces a row apart: 19 ms per
/// SmolLM2 token against 14 for the `[out, in]` dot products; bands take 13.5 (Zen 5). The bands
/// follow `k` only — [`GEMV_BANDS`] of them, not a multiple of the thread count — so the partial
/// sums, and the bits, are the same on any number of threads.
fn gemv_rows_in_out((m, k, n): (usize, usize, usize), x: &[f32], w: &[f32], y: &mut [f32]) {
    let band = k.div_ceil(GEMV_BANDS).max(16);
    let partials: Vec<Vec<f32>> = (0..k.div_ceil(band))
        .into_par_iter()
        .map(|b| {
            let (k0, k1) = (b * band, ((b + 1) * band).min(k));
            let mut acc = vec![0f32; m * n];
            let row = |r: usize| &w[r * n..(r + 1) * n];
            simd(
                #[inline(always)]
                || {
                    let mut r = k0;
                    while r + 4 <= k1 {
                        let (w0, w1, w2, w3) = (row(r), row(r + 1), row(r + 2), row(r + 3));
                        for (i, a) in acc.chunks_mut(n).enumerate() {
                            let xs = &x[i * k + r..i * k + r + 4];
                            let (x0, x1, x2, x3) = (xs[0], xs[1], xs[2], xs[3]);
                            for ((((a, &v0), &v1), &v2), &v3) in
                                a.iter_mut().zip(w0).zip(w1).zip(w2).zip(w3)
                            {
                                *a = x3.mul_add(
                                    v3,
                                    x2.mul_add(v2, x1.mul_add(v1, x0.mul_add(v0, *a))),
                                );
                            }
                        }
                        r += 4;
                    }
                    for r in r..k1 {
                        for (i, a) in acc.chunks_mut(n).enumerate() {
                            let xv = x[i * k + r];
                            a.iter_mut()
                                .zip(row(r))
                                .for_each(|(a, &v)| *a = xv.mul_add(v, *a));
                        }
                    }
                },
            );
            acc
        })
        .collect();
    y[..m * n]
        .par_chunks_mut(4096)
        .enumerate()
        .for_each(|(c, o)| {
            let at = c * 4096;
            for p in &partials {
                add_into(o, &p[at..at + o.len()]);
            }
        });
}

/// Weight bands of [`gemv_rows_in_out`]: the 4 per thread on 2 threads that the timings above
/// measured (more bands add more partial sums; 8 still keep up to 8 threads busy).
const GEMV_BANDS: usize = 8;

/// Rows per parallel task: enough work per task to amortise scheduling.
fn rows_per_task(row_len: usize) -> usize {
    (16_384 / row_len.max(1)).max(1)
}

/// e^x to about 2 ulp without a libm call, so loops over it vectorise (Cephes `expf`: x = n·ln2 + r,
/// a degree-6 polynomial for e^r, 2^n from the exponent bits). Exactly 0 below −87.3 (masked scores).
#[inline(always)]
fn exp_fast(x: f32) -> f32 {
    const LOG2_E: f32 = std::f32::consts::LOG2_E;
    let xc = x.clamp(-87.3, 88.7);
    let n = (xc * LOG2_E + 0.5).floor();
    let r = xc - n * 0.693_359_4 + n * 2.121_944_4e-4;
    let mut p = 1.987_569_1e-4_f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5;
    let y = p * r * r + r + 1.0;
    // 2^n from the exponent bits. Not `n as i32`: Rust's saturating float→int cast (NaN → 0)
    // compiles to a scalar compare-and-move per lane and kept this loop from vectorising (GELU ran
    // at ≈10 cycles per element). Adding 2^23 puts the integer n + 127 (in 1..=255 after the clamp)
    // in the low mantissa bits instead.
    let biased = (n + (127.0 + 8_388_608.0)).to_bits() & 0xFF;
    let scale = f32::from_bits(biased << 23);
    if x < -87.3 {
        0.0
    } else {
        y * scale
    }
}

/// Runs `f` compiled for the widest vector unit kiln may use ([`super::isa`]): AVX-512 (16 lanes,
/// and 64-bit integer multiplies for the dropout hash), else AVX2+FMA (8 lanes), else the portable
/// build. `f` and the `#[inline(always)]` helpers it calls are compiled inside the feature-enabled
/// function.
#[inline(always)]
fn simd<R>(f: impl FnOnce() -> R) -> R {
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx512f,avx512dq,avx512bw,avx512vl,avx2,fma")]
        unsafe fn avx512<R>(f: impl FnOnce() -> R) -> R {
            f()
        }
        #[target_feature(enable = "avx2,fma")]
        unsafe fn avx2<R>(f: impl FnOnce() -> R) -> R {
            f()
        }
        match super::isa::cpu_isa().level {
            // SAFETY: `isa` detected these features on this CPU (the cap only lowers the level).
            super::isa::IsaLevel::Avx512 => return unsafe { avx512(f) },
            // SAFETY: as above.
            super::isa::IsaLevel::Avx2 => return unsafe { avx2(f) },
            super::isa::IsaLevel::Portable => {}
        }
    }
    f()
}

/// Whether [`simd`] runs AVX-512 code: 32 vector registers of 16 lanes (else 16 of 8 at most).
fn has_avx512() -> bool {
    super::isa::cpu_isa().level == super::isa::IsaLevel::Avx512
}

/// Lanes of the partial reductions below: one running f32 sum is a serial dependency the compiler
/// may not reorder (float addition is not associative), so a plain `iter().sum()` stays scalar.
const LANES: usize = 16;

/// Σ f(a[i], b[i], c[i]) over equal-length slices, with `LANES` independent partial sums so the
/// loop vectorises. The reductions below take slices, not an index closure: indexing kept a bounds
/// check per element and with it the loop scalar (LayerNorm backward ran at ≈3 ns per element).
#[inline(always)]
fn sum_zip3(a: &[f32], b: &[f32], c: &[f32], f: impl Fn(f32, f32, f32) -> f32) -> f32 {
    let n = a.len().min(b.len()).min(c.len());
    let (a, b, c) = (&a[..n], &b[..n], &c[..n]);
    let mut acc = [0f32; LANES];
    let full = n / LANES * LANES;
    for ((ca, cb), cc) in a[..full]
        .chunks_exact(LANES)
        .zip(b[..full].chunks_exact(LANES))
        .zip(c[..full].chunks_exact(LANES))
    {
        let (ca, cb, cc): (&[f32; LANES], &[f32; LANES], &[f32; LANES]) = (
            ca.try_into().expect("LANES"),
            cb.try_into().expect("LANES"),
            cc.try_into().expect("LANES"),
        );
        for l in 0..LANES {
            acc[l] += f(ca[l], cb[l], cc[l]);
        }
    }
    let tail: f32 = (full..n).map(|i| f(a[i], b[i], c[i])).sum();
    acc.iter().sum::<f32>() + tail
}

/// Σ f(a[i], b[i]) (see [`sum_zip3`]).
#[inline(always)]
fn sum_zip2(a: &[f32], b: &[f32], f: impl Fn(f32, f32) -> f32) -> f32 {
    sum_zip3(a, b, b, |x, y, _| f(x, y))
}

/// Σ f(a[i]) (see [`sum_zip3`]).
#[inline(always)]
fn sum_map(a: &[f32], f: impl Fn(f32) -> f32) -> f32 {
    sum_zip3(a, a, a, |x, _, _| f(x))
}

/// max of a slice, lane-wise like [`sum_zip3`].
#[inline(always)]
fn max_of(x: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; LANES];
    let chunks = x.chunks_exact(LANES);
    let tail = chunks
        .remainder()
        .iter()
        .fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    for c in chunks {
        for l in 0..LANES {
            acc[l] = if c[l] > acc[l] { c[l] } else { acc[l] };
        }
    }
    acc.iter().fold(tail, |m, &v| m.max(v))
}

/// In place: one head's rotary embedding (or, with `transpose`, its transpose) at one position.
/// Pairs `(i, i + D/2)` turn by the 2×2 matrix `[[c_i, −s_i], [s_j, c_j]]` (`j = i + D/2`).
#[inline(always)]
fn rope_head(x: &mut [f32], c: &[f32], s: &[f32], transpose: bool) {
    let h = x.len() / 2;
    let (a, b) = x.split_at_mut(h);
    let (c1, c2) = c.split_at(h);
    let (s1, s2) = s.split_at(h);
    simd(
        #[inline(always)]
        || {
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
        },
    )
}

/// Cross-entropy of the rows of `x` (as many as `targets`): each row's log-sum-exp into `lse` and
/// its loss into `losses`.
fn cross_entropy_rows(x: &[f32], targets: &[Option<usize>], losses: &mut [f32], lse: &mut [f32]) {
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
fn cross_entropy_grad_rows(dx: &mut [f32], targets: &[Option<usize>], lse: &[f32], dloss: &[f32]) {
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
fn log_sum_exp(row: &[f32]) -> f32 {
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
fn softmax_minus_onehot_row(row: &mut [f32], target: Option<usize>, lse: f32, g: f32) {
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
fn class_indices(
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
fn softmax_row(row: &mut [f32], mask: &[f32], scale: f32) {
    simd(
        #[inline(always)]
        || {
            for (x, &mv) in row.iter_mut().zip(mask) {
                *x = *x * scale + mv;
            }
            let max = max_of(row);
            for x in row.iter_mut() {
                *x = exp_fast(*x - max);
            }
            let inv = 1.0 / sum_map(row, |x| x);
            row.iter_mut().for_each(|x| *x *= inv);
        },
    )
}

/// In place: `dy ← scale · p ⊙ (dy − ⟨dy, p⟩)`, the gradient of one [`softmax_row`] row (p its output).
#[inline(always)]
fn softmax_backward_row(dy: &mut [f32], p: &[f32], scale: f32) {
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
fn normalize_row(z: &[f32], y: &mut [f32], w: &[f32], b: &[f32], eps: f32) -> (f32, f32) {
    simd(
        #[inline(always)]
        || {
            let h = z.len() as f32;
            let mean = sum_map(z, |x| x) / h;
            let var = sum_map(z, |x| (x - mean) * (x - mean)) / h;
            if !var.is_finite() {
                super::note_activation_overflow();
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
fn erf_and_gauss(z: f32) -> (f32, f32) {
    let a = z.abs();
    let t = 1.0 / (1.0 + 0.327_591_1 * a);
    let poly = t
        * (0.254_829_6
            + t * (-0.284_496_74 + t * (1.421_413_7 + t * (-1.453_152_1 + t * 1.061_405_4))));
    let g = exp_fast(-a * a);
    let e = 1.0 - poly * g;
    (if z < 0.0 { -e } else { e }, g)
}

const INV_SQRT2: f32 = std::f32::consts::FRAC_1_SQRT_2;
const INV_SQRT_2PI: f32 = 0.398_942_3;

/// A counter-based hash (SplitMix64 finaliser) → uniform in [0, 1).
#[inline(always)]
pub(crate) fn uniform(seed: u64, i: u64) -> f32 {
    let mut z = seed.wrapping_add(i.wrapping_mul(0x9E37_79B9_7F4A_7C15));
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    (z >> 40) as f32 * (1.0 / (1u64 << 24) as f32)
}

/// The values of a flat dropout mask of `n` elements: `1/keep` where the counter hash of the
/// element's index is below `keep`, else 0. Every backend's mask is these values, so a run drops
/// the same units on the CPU and on a GPU.
pub(crate) fn dropout_mask_values(n: usize, keep: f64, seed: u64) -> Vec<f32> {
    let (keep, value) = (keep as f32, (1.0 / keep) as f32);
    let mut m = vec![0f32; n];
    m.par_chunks_mut(16_384).enumerate().for_each(|(c, chunk)| {
        for (i, v) in chunk.iter_mut().enumerate() {
            let u = uniform(seed, (c * 16_384 + i) as u64);
            *v = if u < keep { value } else { 0.0 };
        }
    });
    m
}

/// A pointer that rayon tasks may share because each writes a disjoint region (see call sites).
#[derive(Clone, Copy)]
struct SharedMut(*mut f32);
// SAFETY: only used where every task writes rows/columns no other task touches.
unsafe impl Send for SharedMut {}
unsafe impl Sync for SharedMut {}

impl SharedMut {
    /// A method (not `.0`) so closures capture the `Sync` wrapper rather than the raw field.
    fn at(self, offset: usize) -> *mut f32 {
        // SAFETY: callers stay inside the buffer (see each call site).
        unsafe { self.0.add(offset) }
    }
}

/// dst[m×n] = lhs[m×k]·rhs[k×n] (+ dst if `accumulate`) on the calling thread. Operands are given by
/// pointer and (row stride, column stride) in elements.
///
/// # Safety
/// Every element addressed by the sizes and strides must lie inside the pointed-to buffers, and no
/// other thread may write the `dst` elements concurrently.
#[allow(clippy::too_many_arguments)]
unsafe fn small_gemm(
    (m, n, k): (usize, usize, usize),
    dst: *mut f32,
    (drs, dcs): (usize, usize),
    lhs: *const f32,
    (lrs, lcs): (usize, usize),
    rhs: *const f32,
    (rrs, rcs): (usize, usize),
    accumulate: bool,
) {
    // `gemm` picks its kernels on its first product: `KILN_CPU_ISA` must have capped them by then.
    super::isa::cpu_isa();
    gemm::gemm(
        m,
        n,
        k,
        dst,
        dcs as isize,
        drs as isize,
        accumulate,
        lhs,
        lcs as isize,
        lrs as isize,
        rhs,
        rcs as isize,
        rrs as isize,
        if accumulate { 1.0 } else { 0.0 },
        1.0,
        false,
        false,
        false,
        gemm::Parallelism::None,
    );
}

/// `x wᵀ + b` for a PyTorch-layout weight `[out, in]`, or `x w + b` for one laid out `[in, out]`
/// (`in_out`, inference's layout): the few-rows kernel of that layout (decoding), else the GEMM
/// with the weight read through strides.
fn linear_forward(
    x: NdArrayTensor,
    w: NdArrayTensor,
    b: Option<NdArrayTensor>,
    in_out: bool,
) -> NdArrayTensor {
    let _p = super::profile::scope("linear_fwd");
    let (x, w) = (dense(x), dense(w));
    let (m, k) = (x.shape()[0], x.shape()[1]);
    let n = if in_out { w.shape()[1] } else { w.shape()[0] };
    let (xs, ws) = (slice(&x), slice(&w));
    let mut y = vec![0f32; m * n];
    let b = b.map(dense);
    let bias = b.as_ref().map(slice);
    if m <= GEMV_MAX_ROWS && super::matmul_precision() == super::MatmulPrecision::F32 {
        // Both few-rows kernels add onto `y`: the bias, or zeros.
        if let Some(bias) = bias {
            y.chunks_mut(n).for_each(|row| row.copy_from_slice(bias));
        }
        if in_out {
            gemv_rows_in_out((m, k, n), xs, ws, &mut y);
        } else {
            gemv_rows(m, k, n, xs, ws, f32::from(bias.is_some()), &mut y);
        }
    } else {
        // `[out, in]` read as wᵀ without a transpose: element (k, n) of wᵀ is w[n·K + k].
        let w_strides = if in_out { (n, 1) } else { (1, k) };
        matmul(m, k, n, xs, (k, 1), ws, w_strides, bias, &mut y);
    }
    tensor(&[m, n], y)
}

impl KilnBackend for Cpu {
    fn kiln_from_host(data: Vec<f32>, shape: Shape, _: &Self::Device) -> FloatTensor<Self> {
        tensor(&shape.dims, data)
    }

    fn kiln_into_owned(x: FloatTensor<Self>) -> FloatTensor<Self> {
        NdArrayTensor::from(dense(x))
    }

    fn kiln_reshape(x: FloatTensor<Self>, shape: Shape) -> FloatTensor<Self> {
        let a = dense(x);
        NdArrayTensor::from(
            a.into_shape_with_order(IxDyn(&shape.dims))
                .expect("reshape keeps the element count"),
        )
    }

    fn kiln_linear(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        b: Option<FloatTensor<Self>>,
    ) -> FloatTensor<Self> {
        linear_forward(x, w, b, false)
    }

    fn kiln_linear_in_out(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        b: Option<FloatTensor<Self>>,
    ) -> FloatTensor<Self> {
        linear_forward(x, w, b, true)
    }

    fn kiln_linear_backward(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        dy: FloatTensor<Self>,
        (input_grad, bias): (bool, bool),
    ) -> (
        Option<FloatTensor<Self>>,
        FloatTensor<Self>,
        Option<FloatTensor<Self>>,
    ) {
        let _p = super::profile::scope("linear_bwd");
        let (x, w, dy) = (dense(x), dense(w), dense(dy));
        let (m, k, n) = (x.shape()[0], x.shape()[1], w.shape()[0]);
        let (xs, ws, dys) = (slice(&x), slice(&w), slice(&dy));
        let dx = input_grad.then(|| {
            let mut dx = vec![0f32; m * k];
            matmul(m, n, k, dys, (n, 1), ws, (k, 1), None, &mut dx); // dy · w
            tensor(&[m, k], dx)
        });
        let mut dw = vec![0f32; n * k];
        matmul(n, m, k, dys, (1, n), xs, (k, 1), None, &mut dw); // dyᵀ · x
        let db = bias.then(|| {
            // Per-chunk partial sums added in chunk order: the chunks follow the shape only, so
            // the bits do not depend on the thread count or on which thread stole what (rayon's
            // `reduce` pairs partial sums in whatever tree the stealing made).
            let chunk = rows_per_task(n) * n;
            let partials: Vec<Vec<f32>> = dys
                .par_chunks(chunk)
                .map(|rows| {
                    let mut acc = vec![0f32; n];
                    for row in rows.chunks(n) {
                        acc.iter_mut().zip(row).for_each(|(a, v)| *a += v);
                    }
                    acc
                })
                .collect();
            let mut sum = vec![0f32; n];
            for part in &partials {
                sum.iter_mut().zip(part).for_each(|(x, y)| *x += y);
            }
            tensor(&[n], sum)
        });
        (dx, tensor(&[n, k], dw), db)
    }

    fn kiln_gelu(x: FloatTensor<Self>) -> FloatTensor<Self> {
        let _p = super::profile::scope("gelu_fwd");
        let x = dense(x);
        let shape = x.shape().to_vec();
        let y = par_map(
            slice(&x),
            #[inline(always)]
            |v| v * 0.5 * (1.0 + erf_and_gauss(v * INV_SQRT2).0),
        );
        tensor(&shape, y)
    }

    fn kiln_gelu_backward(x: FloatTensor<Self>, dy: FloatTensor<Self>) -> FloatTensor<Self> {
        let _p = super::profile::scope("gelu_bwd");
        let (x, dy) = (dense(x), dense(dy));
        let shape = x.shape().to_vec();
        let mut dx = into_vec(dy);
        dx.par_chunks_mut(16_384)
            .zip(slice(&x).par_chunks(16_384))
            .for_each(|(d, xs)| {
                simd(
                    #[inline(always)]
                    || {
                        for (g, &v) in d.iter_mut().zip(xs) {
                            // e^{-(v/√2)²} = e^{-v²/2}: the same exponential gives Φ and φ.
                            let (e, gauss) = erf_and_gauss(v * INV_SQRT2);
                            *g *= 0.5 * (1.0 + e) + v * INV_SQRT_2PI * gauss;
                        }
                    },
                )
            });
        tensor(&shape, dx)
    }

    fn kiln_rms_norm(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        eps: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let _p = super::profile::scope("rms_norm_fwd");
        let (x, w) = (dense(x), dense(w));
        let (r, h) = (x.shape()[0], x.shape()[1]);
        let ws = slice(&w);
        let mut y = vec![0f32; r * h];
        let mut rinv = vec![0f32; r];
        let task = rows_per_task(h);
        y.par_chunks_mut(task * h)
            .zip(rinv.par_chunks_mut(task))
            .zip(slice(&x).par_chunks(task * h))
            .for_each(|((yc, rc), xc)| {
                for ((yr, ri), xr) in yc.chunks_mut(h).zip(rc.iter_mut()).zip(xc.chunks(h)) {
                    simd(
                        #[inline(always)]
                        || {
                            let ms = sum_map(xr, |x| x * x) / h as f32;
                            if !ms.is_finite() {
                                super::note_activation_overflow();
                            }
                            let inv = 1.0 / (ms + eps as f32).sqrt();
                            *ri = inv;
                            for ((y, &x), &w) in yr.iter_mut().zip(xr).zip(ws) {
                                *y = x * inv * w;
                            }
                        },
                    );
                }
            });
        (tensor(&[r, h], y), tensor(&[r], rinv))
    }

    fn kiln_rms_norm_backward(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        rinv: FloatTensor<Self>,
        dy: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let _p = super::profile::scope("rms_norm_bwd");
        let (x, w, rinv, dy) = (dense(x), dense(w), dense(rinv), dense(dy));
        let (r, h) = (x.shape()[0], x.shape()[1]);
        let (ws, rs) = (slice(&w), slice(&rinv));
        let mut dx = vec![0f32; r * h];
        let task = rows_per_task(h);
        // dx per row; dw as per-task partial sums, added up afterwards.
        let partials: Vec<Vec<f32>> = dx
            .par_chunks_mut(task * h)
            .zip(slice(&x).par_chunks(task * h))
            .zip(slice(&dy).par_chunks(task * h))
            .enumerate()
            .map(|(t, ((dxc, xc), dyc))| {
                let mut dw = vec![0f32; h];
                let mut xhat = vec![0f32; h];
                for (j, ((dxr, xr), dyr)) in dxc
                    .chunks_mut(h)
                    .zip(xc.chunks(h))
                    .zip(dyc.chunks(h))
                    .enumerate()
                {
                    let inv = rs[t * task + j];
                    simd(
                        #[inline(always)]
                        || {
                            for (((xh, dw), &x), &dy) in
                                xhat.iter_mut().zip(dw.iter_mut()).zip(xr).zip(dyr)
                            {
                                *xh = x * inv;
                                *dw += dy * *xh;
                            }
                            let c = sum_zip3(dyr, ws, &xhat, |d, w, x| d * w * x) / h as f32;
                            for (((dx, &dy), &w), &xh) in
                                dxr.iter_mut().zip(dyr).zip(ws).zip(xhat.iter())
                            {
                                *dx = inv * (dy * w - xh * c);
                            }
                        },
                    );
                }
                dw
            })
            .collect();
        let mut dw = vec![0f32; h];
        for pw in partials {
            for (a, b) in dw.iter_mut().zip(pw) {
                *a += b;
            }
        }
        (tensor(&[r, h], dx), tensor(&[h], dw))
    }

    fn kiln_swiglu(g: FloatTensor<Self>, u: FloatTensor<Self>) -> FloatTensor<Self> {
        let _p = super::profile::scope("swiglu_fwd");
        let (g, u) = (dense(g), dense(u));
        let shape = g.shape().to_vec();
        let mut y = slice(&g).to_vec();
        y.par_chunks_mut(16_384)
            .zip(slice(&u).par_chunks(16_384))
            .for_each(|(yc, uc)| {
                simd(
                    #[inline(always)]
                    || {
                        for (v, &uv) in yc.iter_mut().zip(uc) {
                            *v = *v / (1.0 + exp_fast(-*v)) * uv;
                        }
                    },
                )
            });
        tensor(&shape, y)
    }

    fn kiln_swiglu_backward(
        g: FloatTensor<Self>,
        u: FloatTensor<Self>,
        dy: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let _p = super::profile::scope("swiglu_bwd");
        let (g, u, dy) = (dense(g), dense(u), dense(dy));
        let shape = g.shape().to_vec();
        let mut dg = slice(&g).to_vec();
        let mut du = slice(&dy).to_vec();
        dg.par_chunks_mut(16_384)
            .zip(du.par_chunks_mut(16_384))
            .zip(slice(&u).par_chunks(16_384))
            .zip(slice(&dy).par_chunks(16_384))
            .for_each(|(((gc, duc), uc), dyc)| {
                simd(
                    #[inline(always)]
                    || {
                        for (((g, du), &u), &dy) in
                            gc.iter_mut().zip(duc.iter_mut()).zip(uc).zip(dyc)
                        {
                            let x = *g;
                            let s = 1.0 / (1.0 + exp_fast(-x));
                            *g = dy * u * s * (1.0 + x * (1.0 - s));
                            *du = dy * x * s;
                        }
                    },
                )
            });
        (tensor(&shape, dg), tensor(&shape, du))
    }

    fn kiln_layer_norm(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        b: FloatTensor<Self>,
        eps: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let _p = super::profile::scope("layer_norm_fwd");
        let (x, w, b) = (dense(x), dense(w), dense(b));
        let (r, h) = (x.shape()[0], x.shape()[1]);
        let (ws, bs) = (slice(&w), slice(&b));
        let mut y = vec![0f32; r * h];
        let mut stats = vec![(0f32, 0f32); r];
        let task = rows_per_task(h);
        y.par_chunks_mut(task * h)
            .zip(slice(&x).par_chunks(task * h))
            .zip(stats.par_chunks_mut(task))
            .for_each(|((yc, xc), sc)| {
                for ((yr, xr), s) in yc.chunks_mut(h).zip(xc.chunks(h)).zip(sc) {
                    *s = normalize_row(xr, yr, ws, bs, eps as f32);
                }
            });
        let (mean, rstd): (Vec<f32>, Vec<f32>) = stats.into_iter().unzip();
        (tensor(&[r, h], y), tensor(&[r], mean), tensor(&[r], rstd))
    }

    fn kiln_residual_layer_norm(
        x: FloatTensor<Self>,
        r: FloatTensor<Self>,
        w: FloatTensor<Self>,
        b: FloatTensor<Self>,
        eps: f64,
        dropout: f64,
        seed: u64,
    ) -> (
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
    ) {
        let _p = super::profile::scope("residual_layer_norm_fwd");
        let (x, r, w, b) = (dense(x), dense(r), dense(w), dense(b));
        let (rows, h) = (x.shape()[0], x.shape()[1]);
        let (ws, bs) = (slice(&w), slice(&b));
        let keep = (1.0 - dropout) as f32;
        let mut z = slice(&r).to_vec();
        let mut y = vec![0f32; rows * h];
        let mut stats = vec![(0f32, 0f32); rows];
        let task = rows_per_task(h);
        z.par_chunks_mut(task * h)
            .zip(y.par_chunks_mut(task * h))
            .zip(slice(&x).par_chunks(task * h))
            .zip(stats.par_chunks_mut(task))
            .enumerate()
            .for_each(|(c, (((zc, yc), xc), sc))| {
                for (j, ((zr, yr), (xr, s))) in zc
                    .chunks_mut(h)
                    .zip(yc.chunks_mut(h))
                    .zip(xc.chunks(h).zip(sc))
                    .enumerate()
                {
                    simd(
                        #[inline(always)]
                        || {
                            if keep < 1.0 {
                                let base = ((c * task + j) * h) as u64;
                                for (i, (z, &x)) in zr.iter_mut().zip(xr).enumerate() {
                                    let m = if uniform(seed, base + i as u64) < keep {
                                        1.0 / keep
                                    } else {
                                        0.0
                                    };
                                    *z += x * m;
                                }
                            } else {
                                zr.iter_mut().zip(xr).for_each(|(z, x)| *z += x);
                            }
                        },
                    );
                    *s = normalize_row(zr, yr, ws, bs, eps as f32);
                }
            });
        let (mean, rstd): (Vec<f32>, Vec<f32>) = stats.into_iter().unzip();
        (
            tensor(&[rows, h], y),
            tensor(&[rows, h], z),
            tensor(&[rows], mean),
            tensor(&[rows], rstd),
        )
    }

    fn kiln_dropout_backward(dz: FloatTensor<Self>, dropout: f64, seed: u64) -> FloatTensor<Self> {
        if dropout <= 0.0 {
            return dz;
        }
        let dz = dense(dz);
        let shape = dz.shape().to_vec();
        let keep = (1.0 - dropout) as f32;
        let mut dx = into_vec(dz);
        dx.par_chunks_mut(16_384)
            .enumerate()
            .for_each(|(c, chunk)| {
                simd(
                    #[inline(always)]
                    || {
                        for (i, v) in chunk.iter_mut().enumerate() {
                            let u = uniform(seed, (c * 16_384 + i) as u64);
                            *v *= if u < keep { 1.0 / keep } else { 0.0 };
                        }
                    },
                )
            });
        tensor(&shape, dx)
    }

    fn kiln_layer_norm_backward(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        mean: FloatTensor<Self>,
        rstd: FloatTensor<Self>,
        dy: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let _p = super::profile::scope("layer_norm_bwd");
        let (x, w, mean, rstd, dy) = (dense(x), dense(w), dense(mean), dense(rstd), dense(dy));
        let (r, h) = (x.shape()[0], x.shape()[1]);
        let (ws, ms, rs) = (slice(&w), slice(&mean), slice(&rstd));
        let mut dx = vec![0f32; r * h];
        let task = rows_per_task(h);
        // dx per row; dw/db as per-task partial sums, added up afterwards.
        let partials: Vec<(Vec<f32>, Vec<f32>)> = dx
            .par_chunks_mut(task * h)
            .zip(slice(&x).par_chunks(task * h))
            .zip(slice(&dy).par_chunks(task * h))
            .enumerate()
            .map(|(t, ((dxc, xc), dyc))| {
                let (mut dw, mut db) = (vec![0f32; h], vec![0f32; h]);
                let mut xhat = vec![0f32; h];
                for (j, ((dxr, xr), dyr)) in dxc
                    .chunks_mut(h)
                    .zip(xc.chunks(h))
                    .zip(dyc.chunks(h))
                    .enumerate()
                {
                    let row = t * task + j;
                    let (mu, rstd) = (ms[row], rs[row]);
                    simd(
                        #[inline(always)]
                        || {
                            for ((((xh, dw), db), &x), &dy) in xhat
                                .iter_mut()
                                .zip(dw.iter_mut())
                                .zip(db.iter_mut())
                                .zip(xr)
                                .zip(dyr)
                            {
                                *xh = (x - mu) * rstd;
                                *dw += dy * *xh;
                                *db += dy;
                            }
                            let c1 = sum_zip2(dyr, ws, |d, w| d * w) / h as f32;
                            let c2 = sum_zip3(dyr, ws, &xhat, |d, w, x| d * w * x) / h as f32;
                            for (((dx, &dy), &w), &xh) in
                                dxr.iter_mut().zip(dyr).zip(ws).zip(xhat.iter())
                            {
                                *dx = rstd * (dy * w - c1 - xh * c2);
                            }
                        },
                    );
                }
                (dw, db)
            })
            .collect();
        let (mut dw, mut db) = (vec![0f32; h], vec![0f32; h]);
        for (pw, pb) in partials {
            dw.iter_mut().zip(&pw).for_each(|(a, b)| *a += b);
            db.iter_mut().zip(&pb).for_each(|(a, b)| *a += b);
        }
        (tensor(&[r, h], dx), tensor(&[h], dw), tensor(&[h], db))
    }

    fn kiln_masked_softmax(
        x: FloatTensor<Self>,
        mask: FloatTensor<Self>,
        scale: f64,
    ) -> FloatTensor<Self> {
        let _p = super::profile::scope("softmax_fwd");
        let (x, mask) = (dense(x), dense(mask));
        let shape = x.shape().to_vec();
        let (heads, t, s) = (shape[1], shape[2], shape[3]);
        let ms = slice(&mask);
        let scale = scale as f32;
        let mut y = slice(&x).to_vec();
        // One task per (batch, head): rows of a task share the key mask of their batch.
        y.par_chunks_mut(t * s).enumerate().for_each(|(bh, block)| {
            let m = &ms[(bh / heads) * s..(bh / heads + 1) * s];
            for row in block.chunks_mut(s) {
                softmax_row(row, m, scale);
            }
        });
        tensor(&shape, y)
    }

    fn kiln_masked_softmax_backward(
        y: FloatTensor<Self>,
        dy: FloatTensor<Self>,
        scale: f64,
    ) -> FloatTensor<Self> {
        let _p = super::profile::scope("softmax_bwd");
        let (y, dy) = (dense(y), dense(dy));
        let shape = y.shape().to_vec();
        let s = shape[3];
        let scale = scale as f32;
        let mut dx = into_vec(dy);
        dx.par_chunks_mut(rows_per_task(s) * s)
            .zip(slice(&y).par_chunks(rows_per_task(s) * s))
            .for_each(|(dc, yc)| {
                for (dr, yr) in dc.chunks_mut(s).zip(yc.chunks(s)) {
                    softmax_backward_row(dr, yr, scale);
                }
            });
        tensor(&shape, dx)
    }

    fn kiln_rope(
        x: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        transpose: bool,
    ) -> FloatTensor<Self> {
        let _p = super::profile::scope(if transpose { "rope_bwd" } else { "rope_fwd" });
        let (x, cos, sin) = (dense(x), dense(cos), dense(sin));
        let shape = x.shape().to_vec();
        let (t, d) = (shape[1], shape[3]);
        let row = shape[2] * d;
        let (cos, sin) = (slice(&cos), slice(&sin));
        assert!(
            cos.len() == t * d && sin.len() == t * d,
            "rope tables must be [positions, head_dim]"
        );
        let mut y = into_vec(x);
        let rows = rows_per_task(row);
        y.par_chunks_mut(rows * row)
            .enumerate()
            .for_each(|(task, chunk)| {
                for (i, r) in chunk.chunks_mut(row).enumerate() {
                    // Row (b, position) of the flattened [B·T, heads·D].
                    let pos = (task * rows + i) % t;
                    let (c, s) = (&cos[pos * d..][..d], &sin[pos * d..][..d]);
                    for head in r.chunks_mut(d) {
                        rope_head(head, c, s, transpose);
                    }
                }
            });
        tensor(&shape, y)
    }

    fn kiln_cross_entropy(
        logits: FloatTensor<Self>,
        targets: IntTensor<Self>,
        ignore: i64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let _p = super::profile::scope("cross_entropy_fwd");
        let x = dense(logits);
        let (n, c) = (x.shape()[0], x.shape()[1]);
        let targets = class_indices(targets, n, c, ignore);
        let (mut losses, mut lse) = (vec![0f32; n], vec![0f32; n]);
        let rows = rows_per_task(c);
        let x = slice(&x);
        if n <= rows {
            // One task's worth (a classifier's batch): no trip through the pool.
            cross_entropy_rows(x, &targets, &mut losses, &mut lse);
        } else {
            x.par_chunks(rows * c)
                .zip(targets.par_chunks(rows))
                .zip(losses.par_chunks_mut(rows).zip(lse.par_chunks_mut(rows)))
                .for_each(|((xs, ts), (ls, es))| cross_entropy_rows(xs, ts, ls, es));
        }
        (tensor(&[n], losses), tensor(&[n], lse))
    }

    fn kiln_cross_entropy_backward(
        logits: FloatTensor<Self>,
        targets: IntTensor<Self>,
        ignore: i64,
        lse: FloatTensor<Self>,
        dloss: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        let _p = super::profile::scope("cross_entropy_bwd");
        let (lse, dloss) = (dense(lse), dense(dloss));
        let x = dense(logits);
        let (n, c) = (x.shape()[0], x.shape()[1]);
        let targets = class_indices(targets, n, c, ignore);
        // The logits are usually held by this backward alone: their buffer becomes the gradient.
        let mut dx = into_vec(x);
        let rows = rows_per_task(c);
        let (lse, dloss) = (slice(&lse), slice(&dloss));
        if n <= rows {
            cross_entropy_grad_rows(&mut dx, &targets, lse, dloss);
        } else {
            dx.par_chunks_mut(rows * c)
                .zip(targets.par_chunks(rows))
                .zip(lse.par_chunks(rows).zip(dloss.par_chunks(rows)))
                .for_each(|((dc, ts), (es, gs))| cross_entropy_grad_rows(dc, ts, es, gs));
        }
        tensor(&[n, c], dx)
    }

    fn kiln_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        mask: FloatTensor<Self>,
        heads: usize,
        window: super::Window,
        scale: f64,
        dropout: f64,
        seed: u64,
        with_probs: bool,
    ) -> (FloatTensor<Self>, Option<FloatTensor<Self>>) {
        let _p = super::profile::scope("attention_fwd");
        // Grouped-query keys and values are repeated to the query heads (transformers' repeat_kv).
        let k = super::repeat_kv_heads::<Self>(k, heads, &q);
        let v = super::repeat_kv_heads::<Self>(v, heads, &q);
        let (q, k, v, mask) = (dense(q), dense(k), dense(v), dense(mask));
        let (b, t, h) = (q.shape()[0], q.shape()[1], q.shape()[2]);
        let a = Attn::new((b, t, h), h, heads, window, scale, dropout, seed);
        let (out, probs) = a.forward([slice(&q), slice(&k), slice(&v)], slice(&mask), with_probs);
        (
            tensor(&[b, t, h], out),
            probs.map(|p| tensor(&[b, heads, t, t], p)),
        )
    }

    fn kiln_attention_backward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        probs: FloatTensor<Self>,
        dout: FloatTensor<Self>,
        heads: usize,
        scale: f64,
        dropout: f64,
        seed: u64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let _p = super::profile::scope("attention_bwd");
        let kv = burn::tensor::TensorMetadata::shape(&k).dims[2];
        let k = super::repeat_kv_heads::<Self>(k, heads, &q);
        let v = super::repeat_kv_heads::<Self>(v, heads, &q);
        let (q, k, v, probs, dout) = (dense(q), dense(k), dense(v), dense(probs), dense(dout));
        let (b, t, h) = (q.shape()[0], q.shape()[1], q.shape()[2]);
        let a = Attn::new(
            (b, t, h),
            h,
            heads,
            super::Window::FULL,
            scale,
            dropout,
            seed,
        );
        let mut grads = [
            vec![0f32; b * t * h],
            vec![0f32; b * t * h],
            vec![0f32; b * t * h],
        ];
        let [dq, dk, dv] = grads.each_mut().map(|g| SharedMut(g.as_mut_ptr()));
        a.backward(
            [slice(&q), slice(&k), slice(&v)],
            slice(&probs),
            slice(&dout),
            [dq, dk, dv],
            h,
        );
        let [dq, dk, dv] = grads.map(|g| tensor(&[b, t, h], g));
        let group = |g| super::sum_kv_groups::<Self>(g, kv, heads);
        (dq, group(dk), group(dv))
    }

    fn kiln_attention_qkv(
        qkv: FloatTensor<Self>,
        mask: FloatTensor<Self>,
        heads: usize,
        scale: f64,
        dropout: f64,
        seed: u64,
        with_probs: bool,
    ) -> (FloatTensor<Self>, Option<FloatTensor<Self>>) {
        let _p = super::profile::scope("attention_fwd");
        let (qkv, mask) = (dense(qkv), dense(mask));
        let (b, t, h) = (qkv.shape()[0], qkv.shape()[1], qkv.shape()[2] / 3);
        let a = Attn::new(
            (b, t, h),
            3 * h,
            heads,
            super::Window::FULL,
            scale,
            dropout,
            seed,
        );
        let x = slice(&qkv);
        let (out, probs) = a.forward([x, &x[h..], &x[2 * h..]], slice(&mask), with_probs);
        (
            tensor(&[b, t, h], out),
            probs.map(|p| tensor(&[b, heads, t, t], p)),
        )
    }

    fn kiln_attention_qkv_backward(
        qkv: FloatTensor<Self>,
        probs: FloatTensor<Self>,
        dout: FloatTensor<Self>,
        heads: usize,
        scale: f64,
        dropout: f64,
        seed: u64,
    ) -> FloatTensor<Self> {
        let _p = super::profile::scope("attention_bwd");
        let (qkv, probs, dout) = (dense(qkv), dense(probs), dense(dout));
        let (b, t, h) = (qkv.shape()[0], qkv.shape()[1], qkv.shape()[2] / 3);
        let a = Attn::new(
            (b, t, h),
            3 * h,
            heads,
            super::Window::FULL,
            scale,
            dropout,
            seed,
        );
        let x = slice(&qkv);
        let mut grad = vec![0f32; b * t * 3 * h];
        let g = SharedMut(grad.as_mut_ptr());
        a.backward(
            [x, &x[h..], &x[2 * h..]],
            slice(&probs),
            slice(&dout),
            [g, SharedMut(g.at(h)), SharedMut(g.at(2 * h))],
            3 * h,
        );
        tensor(&[b, t, 3 * h], grad)
    }

    fn kiln_adamw(
        p: FloatTensor<Self>,
        g: FloatTensor<Self>,
        m: FloatTensor<Self>,
        v: FloatTensor<Self>,
        h: super::AdamWStep,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let _p = super::profile::scope("adamw");
        let (mut p, g, mut m, mut v) = (dense(p), dense(g), dense(m), dense(v));
        let decay = (1.0 - h.lr * h.weight_decay) as f32;
        // 1 − β in f64 first: in f32, 1 − 0.999 is off by 1.3e-5 relative (torch forms it in double).
        let (b1, b2, eps) = (h.beta1 as f32, h.beta2 as f32, h.eps as f32);
        let (one_b1, one_b2) = ((1.0 - h.beta1) as f32, (1.0 - h.beta2) as f32);
        let (step, bc2, gs) = (
            (h.lr / h.bias_correction1) as f32,
            h.bias_correction2_sqrt as f32,
            h.grad_scale as f32,
        );
        // ArcArray::as_slice_mut copies only if the buffer is shared; moments are the optimizer's own.
        let (ps, ms, vs) = (
            p.as_slice_mut().expect("standard layout"),
            m.as_slice_mut().expect("standard layout"),
            v.as_slice_mut().expect("standard layout"),
        );
        const CHUNK: usize = 32_768;
        ps.par_chunks_mut(CHUNK)
            .zip(ms.par_chunks_mut(CHUNK))
            .zip(vs.par_chunks_mut(CHUNK))
            .zip(slice(&g).par_chunks(CHUNK))
            .for_each(|(((pc, mc), vc), gc)| {
                simd(
                    #[inline(always)]
                    || {
                        for (((p, m), v), &g) in
                            pc.iter_mut().zip(mc.iter_mut()).zip(vc.iter_mut()).zip(gc)
                        {
                            let g = g * gs;
                            *m = *m * b1 + g * one_b1;
                            *v = *v * b2 + g * g * one_b2;
                            let denom = v.sqrt() / bc2 + eps;
                            *p = *p * decay - step * (*m / denom);
                        }
                    },
                )
            });
        (
            NdArrayTensor::from(p),
            NdArrayTensor::from(m),
            NdArrayTensor::from(v),
        )
    }

    fn kiln_sgd(
        p: FloatTensor<Self>,
        g: FloatTensor<Self>,
        buf: Option<FloatTensor<Self>>,
        h: super::SgdStep,
    ) -> (FloatTensor<Self>, Option<FloatTensor<Self>>) {
        let _p = super::profile::scope("sgd");
        let (mut p, g) = (dense(p), dense(g));
        let (lr, wd, gs) = (h.lr as f32, h.weight_decay as f32, h.grad_scale as f32);
        let (mu, damp) = (h.momentum as f32, (1.0 - h.dampening) as f32);
        let (first, nesterov) = (buf.is_none(), h.nesterov);
        // Without momentum there is no buffer; on the first step torch starts it at the gradient.
        let mut buf = (mu != 0.0).then(|| match buf {
            Some(b) => dense(b),
            None => ArcArray::zeros(IxDyn(&[g.len()])),
        });
        // ArcArray::as_slice_mut copies only if the buffer is shared.
        let ps = p.as_slice_mut().expect("standard layout");
        let bs = buf
            .as_mut()
            .map(|b| b.as_slice_mut().expect("standard layout"));
        const CHUNK: usize = 32_768;
        let update = |pc: &mut [f32], gc: &[f32], bc: Option<&mut [f32]>| {
            simd(
                #[inline(always)]
                || match bc {
                    None => pc.iter_mut().zip(gc).for_each(|(p, &g)| {
                        *p -= lr * (g * gs + wd * *p);
                    }),
                    Some(bc) => pc.iter_mut().zip(gc).zip(bc).for_each(|((p, &g), b)| {
                        let g = g * gs + wd * *p;
                        *b = if first { g } else { *b * mu + g * damp };
                        *p -= lr * if nesterov { g + mu * *b } else { *b };
                    }),
                },
            )
        };
        let gs_ = slice(&g);
        match bs {
            None => ps
                .par_chunks_mut(CHUNK)
                .zip(gs_.par_chunks(CHUNK))
                .for_each(|(pc, gc)| update(pc, gc, None)),
            Some(bs) => ps
                .par_chunks_mut(CHUNK)
                .zip(gs_.par_chunks(CHUNK))
                .zip(bs.par_chunks_mut(CHUNK))
                .for_each(|((pc, gc), bc)| update(pc, gc, Some(bc))),
        }
        (NdArrayTensor::from(p), buf.map(NdArrayTensor::from))
    }

    fn kiln_sum_squares(x: FloatTensor<Self>) -> f64 {
        let x = dense(x);
        // Chunk sums added in chunk order (not rayon's `sum`, whose pairing follows the stealing):
        // the gradient norm, and with it clipping, is the same bits on any thread count.
        let parts: Vec<f64> = slice(&x)
            .par_chunks(32_768)
            .map(|c| c.iter().map(|&v| (v as f64) * (v as f64)).sum::<f64>())
            .collect();
        parts.iter().sum()
    }

    fn kiln_dropout_mask(
        shape: Shape,
        keep: f64,
        seed: u64,
        _: &Self::Device,
    ) -> FloatTensor<Self> {
        let _p = super::profile::scope("dropout_mask");
        let n = shape.num_elements();
        tensor(&[n], dropout_mask_values(n, keep, seed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn erf_approximation_is_accurate() {
        // Reference values of erf from tables (Abramowitz & Stegun, table 7.1).
        for (z, want) in [
            (0.0, 0.0),
            (0.5, 0.520_499_9),
            (1.0, 0.842_700_8),
            (2.0, 0.995_322_3),
            (-1.0, -0.842_700_8),
        ] {
            let (e, _) = erf_and_gauss(z);
            assert!((e - want).abs() < 3e-7, "erf({z}) = {e}, want {want}");
        }
    }

    #[test]
    fn fast_exp_is_accurate() {
        for i in -2000..=2000 {
            let x = i as f32 * 0.04;
            let (a, b) = (exp_fast(x), x.exp());
            assert!(((a - b) / b).abs() < 4e-7, "exp({x}) = {a}, want {b}");
        }
        assert_eq!(exp_fast(f32::MIN), 0.0);
        assert_eq!(exp_fast(-100.0), 0.0);
    }

    #[test]
    fn uniform_hash_is_uniform_enough() {
        let n = 100_000;
        let mean = (0..n).map(|i| uniform(7, i) as f64).sum::<f64>() / n as f64;
        assert!((mean - 0.5).abs() < 0.01, "{mean}");
        let kept = (0..n).filter(|&i| uniform(7, i) < 0.9).count() as f64 / n as f64;
        assert!((kept - 0.9).abs() < 0.01, "{kept}");
    }
}
