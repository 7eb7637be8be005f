//! The attention core on the GPU, forward and backward, reading q, k and v where the projections
//! left them: three `[B, T, H]` tensors, or one `[B, T, 3H]` when one Linear made them side by
//! side. Burn's composed chain split the heads out with a copy per operand and per gradient
//! (`[B, T, heads, d]` → `[B, heads, T, d]`, 194 copies and 26 ms of a BERT-base bf16 128×128
//! step on an H200) and took about ten launches per layer; these kernels take one forward and two
//! backward, and write the output and the gradients back in the projections' layout.
//!
//! The algorithm is the CPU kernel's (`ops::cpu::attention`): the softmax probabilities
//! `[B, heads, T, T]` are kept for the backward (0 outside the window), dropout is the CPU's counter
//! hash over their flat index, regenerated in the backward. One cube takes one query row (forward,
//! and the first backward kernel: the score gradients and dq) or one key row (the second: dk and
//! dv), one unit per output column; keys are taken a cube's width at a time, their scores shared.
//! The forward finds the row's maximum and sum in one pass over the keys (an online softmax) and
//! writes the normalised probabilities in a second. Keys outside a query's window are never
//! computed.
//!
//! These are scalar kernels (no tensor cores), the same source on CUDA and on wgpu (lavapipe in
//! CI, checked against the CPU). Head dimensions above [`MAX_HEAD_DIM`], and calls of more than
//! [`FUSED_MAX_PROBS`] probabilities (where the scalar kernels lose to cuBLAS), take the composed
//! chain.

use burn::tensor::Shape;
use burn_cubecl::cubecl;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{CubeRuntime, FloatElement};
use cubecl::prelude::*;

use super::dropout::kept;
use super::grid::{tree_reduce, MAX_GRID};
use crate::ops::AttentionSpec;

/// The largest head dimension the kernels take: one unit per output column, at most 256 units.
const MAX_HEAD_DIM: usize = 256;

/// `x · row` over `d` values, `row` read from `own` (or, for q, k and v in one tensor, from `qkv`)
/// at `base`.
#[cube]
fn dot<F: Float>(
    x: &SharedMemory<F>,
    own: &Tensor<F>,
    qkv: &Tensor<F>,
    base: usize,
    #[comptime] d: usize,
    #[comptime] fused: bool,
) -> F {
    let mut s = F::new(0.0);
    let mut c = 0;
    while c < d {
        if fused {
            s += x[c] * qkv[base + c];
        } else {
            s += x[c] * own[base + c];
        }
        c += 1;
    }
    s
}

/// `acc + Σ_x chunk[x] · src[base + x·stride]` over the first `n` values of a chunk, in order:
/// one output column over a chunk's rows of `own` (or, for q, k and v in one tensor, of `qkv`).
#[cube]
#[allow(clippy::too_many_arguments)]
fn chunk_dot<F: Float>(
    acc: F,
    chunk: &SharedMemory<F>,
    own: &Tensor<F>,
    qkv: &Tensor<F>,
    base: usize,
    stride: usize,
    n: usize,
    #[comptime] fused: bool,
) -> F {
    let mut sum = acc;
    let mut x = 0;
    while x < n {
        if fused {
            sum += chunk[x] * qkv[base + x * stride];
        } else {
            sum += chunk[x] * own[base + x * stride];
        }
        x += 1;
    }
    sum
}

/// One cube per query row `(b, head, i)`: its probabilities over the keys `lo..hi` of its window
/// and its output `Σ_j dropout(p_j) v_j`.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn attention_forward_kernel<F: Float>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    v: &Tensor<F>,
    mask: &Tensor<F>,
    out: &mut Tensor<F>,
    probs: &mut Tensor<F>,
    t: u32,
    heads: u32,
    rs: u32,
    krs: u32,
    group: u32,
    k_off: u32,
    v_off: u32,
    before: u32,
    after: u32,
    scale: f32,
    keep: f32,
    inv_keep: f32,
    seed_hi: u32,
    seed_lo: u32,
    #[comptime] d: usize,
    #[comptime] units: usize,
    #[comptime] fused: bool,
    #[comptime] with_probs: bool,
    #[comptime] dropout: bool,
) {
    let (t, heads, rs, krs) = (t as usize, heads as usize, rs as usize, krs as usize);
    let (before, after) = (before as usize, after as usize);
    let (k_off, v_off) = (k_off as usize, v_off as usize);
    let h = heads * d;
    let rows = out.len() / d;
    let u = UNIT_POS as usize;
    let scale = F::cast_from(scale);
    let mut qs = SharedMemory::<F>::new(d);
    let mut part = SharedMemory::<F>::new(units);
    let mut chunk = SharedMemory::<F>::new(units);
    let mut row = CUBE_POS_X as usize;
    while row < rows {
        // Every unit is done with the last row's shared values before they are overwritten.
        sync_cube();
        let (bh, i) = (row / t, row % t);
        let seq = (bh / heads) * t;
        let col = (bh % heads) * d;
        // The key/value head this query head reads (grouped-query attention).
        let kcol = ((bh % heads) / group as usize) * d;
        if u < d {
            qs[u] = q[(seq + i) * rs + col + u];
        }
        sync_cube();
        let lo = i - select(i > before, before, i);
        let end = i + after + 1;
        let hi = select(end < t, end, t);
        // Pass 1: each unit's running maximum and sum over its keys, then the row's.
        let mut m = F::min_value();
        let mut l = F::new(0.0);
        let mut j = lo + u;
        while j < hi {
            let s = dot::<F>(&qs, k, q, (seq + j) * krs + k_off + kcol, d, fused) * scale
                + mask[seq + j];
            let mn = F::max(m, s);
            l = l * F::exp(m - mn) + F::exp(s - mn);
            m = mn;
            j += units;
        }
        part[u] = m;
        let mx = tree_reduce::<F>(&mut part, true);
        sync_cube();
        part[u] = l * F::exp(m - mx);
        let inv = F::new(1.0) / tree_reduce::<F>(&mut part, false);
        let prow = row * t;
        if with_probs {
            let mut z = u;
            while z < lo {
                probs[prow + z] = F::new(0.0);
                z += units;
            }
            let mut z2 = hi + u;
            while z2 < t {
                probs[prow + z2] = F::new(0.0);
                z2 += units;
            }
        }
        // Pass 2: a cube's width of keys at a time, their (dropped) probabilities shared, then
        // each unit's output column.
        let mut acc = F::new(0.0);
        let mut js = lo;
        while js < hi {
            let jj = js + u;
            let mut pd = F::new(0.0);
            if jj < hi {
                let s = dot::<F>(&qs, k, q, (seq + jj) * krs + k_off + kcol, d, fused) * scale
                    + mask[seq + jj];
                let pr = F::exp(s - mx) * inv;
                if with_probs {
                    probs[prow + jj] = pr;
                }
                pd = pr;
                if dropout {
                    pd = pr * kept::<F>(prow + jj, seed_hi, seed_lo, keep, inv_keep);
                }
            }
            chunk[u] = pd;
            sync_cube();
            if u < d {
                let n = select(hi - js < units, hi - js, units);
                let vb = (seq + js) * krs + v_off + kcol + u;
                acc = chunk_dot::<F>(acc, &chunk, v, q, vb, krs, n, fused);
            }
            sync_cube();
            js += units;
        }
        if u < d {
            out[(seq + i) * h + col + u] = acc;
        }
        row += CUBE_COUNT_X as usize;
    }
}

/// One cube per query row `(b, head, i)`: the score gradients
/// `ds_j = scale · p_j · (dp_j − Σ p·dp)` with `dp_j = dropout(dout_i · v_j)` (written to `ds`),
/// and `dq_i = Σ_j ds_j k_j`.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn attention_backward_rows_kernel<F: Float>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    v: &Tensor<F>,
    probs: &Tensor<F>,
    dout: &Tensor<F>,
    ds: &mut Tensor<F>,
    dq: &mut Tensor<F>,
    t: u32,
    heads: u32,
    krs: u32,
    group: u32,
    k_off: u32,
    v_off: u32,
    dq_rs: u32,
    scale: f32,
    keep: f32,
    inv_keep: f32,
    seed_hi: u32,
    seed_lo: u32,
    #[comptime] d: usize,
    #[comptime] units: usize,
    #[comptime] fused: bool,
    #[comptime] dropout: bool,
) {
    let (t, heads, dq_rs) = (t as usize, heads as usize, dq_rs as usize);
    let krs = krs as usize;
    let (k_off, v_off) = (k_off as usize, v_off as usize);
    let h = heads * d;
    let rows = probs.len() / t;
    let u = UNIT_POS as usize;
    let scale = F::cast_from(scale);
    let mut dos = SharedMemory::<F>::new(d);
    let mut part = SharedMemory::<F>::new(units);
    let mut chunk = SharedMemory::<F>::new(units);
    let mut row = CUBE_POS_X as usize;
    while row < rows {
        sync_cube();
        let (bh, i) = (row / t, row % t);
        let seq = (bh / heads) * t;
        let col = (bh % heads) * d;
        let kcol = ((bh % heads) / group as usize) * d;
        if u < d {
            dos[u] = dout[(seq + i) * h + col + u];
        }
        sync_cube();
        let prow = row * t;
        // Σ_j p_j dp_j: keys with p = 0 (outside the window) add nothing and are skipped.
        let mut acc = F::new(0.0);
        let mut j = u;
        while j < t {
            let p = probs[prow + j];
            if p != F::new(0.0) {
                let mut dp = dot::<F>(&dos, v, q, (seq + j) * krs + v_off + kcol, d, fused);
                if dropout {
                    dp *= kept::<F>(prow + j, seed_hi, seed_lo, keep, inv_keep);
                }
                acc += p * dp;
            }
            j += units;
        }
        part[u] = acc;
        let pdp = tree_reduce::<F>(&mut part, false);
        sync_cube();
        let mut dqa = F::new(0.0);
        let mut js = 0;
        while js < t {
            let jj = js + u;
            let mut g = F::new(0.0);
            if jj < t {
                let p = probs[prow + jj];
                if p != F::new(0.0) {
                    let mut dp = dot::<F>(&dos, v, q, (seq + jj) * krs + v_off + kcol, d, fused);
                    if dropout {
                        dp *= kept::<F>(prow + jj, seed_hi, seed_lo, keep, inv_keep);
                    }
                    g = scale * p * (dp - pdp);
                }
                ds[prow + jj] = g;
            }
            chunk[u] = g;
            sync_cube();
            if u < d {
                let n = select(t - js < units, t - js, units);
                let kb = (seq + js) * krs + k_off + kcol + u;
                dqa = chunk_dot::<F>(dqa, &chunk, k, q, kb, krs, n, fused);
            }
            sync_cube();
            js += units;
        }
        if u < d {
            dq[(seq + i) * dq_rs + col + u] = dqa;
        }
        row += CUBE_COUNT_X as usize;
    }
}

/// One cube per key row `(b, kv head, j)`: `dk_j = Σ_h Σ_i ds_hij q_hi` and
/// `dv_j = Σ_h Σ_i dropout(p_hij) dout_hi` over the query heads `h` of its group. With q, k and v
/// in one tensor both land in `dk`'s buffer (`dv` is then unused).
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn attention_backward_keys_kernel<F: Float>(
    q: &Tensor<F>,
    probs: &Tensor<F>,
    ds: &Tensor<F>,
    dout: &Tensor<F>,
    dk: &mut Tensor<F>,
    dv: &mut Tensor<F>,
    t: u32,
    heads: u32,
    group: u32,
    rs: u32,
    kv_rs: u32,
    dk_off: u32,
    dv_off: u32,
    keep: f32,
    inv_keep: f32,
    seed_hi: u32,
    seed_lo: u32,
    #[comptime] d: usize,
    #[comptime] units: usize,
    #[comptime] fused: bool,
    #[comptime] dropout: bool,
) {
    let (t, heads, group) = (t as usize, heads as usize, group as usize);
    let (rs, kv_rs) = (rs as usize, kv_rs as usize);
    let (dk_off, dv_off) = (dk_off as usize, dv_off as usize);
    let h = heads * d;
    let kv_heads = heads / group;
    let rows = (probs.len() / t) / group;
    let u = UNIT_POS as usize;
    let mut pc = SharedMemory::<F>::new(units);
    let mut gc = SharedMemory::<F>::new(units);
    let mut row = CUBE_POS_X as usize;
    while row < rows {
        let (bkv, j) = (row / t, row % t);
        let b = bkv / kv_heads;
        let seq = b * t;
        let kvh = bkv % kv_heads;
        let mut dka = F::new(0.0);
        let mut dva = F::new(0.0);
        let mut g = 0;
        while g < group {
            let head = kvh * group + g;
            let bh = b * heads + head;
            let col = head * d;
            let mut is = 0;
            while is < t {
                // Every unit is done with the last chunk before it is overwritten.
                sync_cube();
                let ii = is + u;
                let mut pd = F::new(0.0);
                let mut gr = F::new(0.0);
                if ii < t {
                    let idx = (bh * t + ii) * t + j;
                    pd = probs[idx];
                    if dropout {
                        pd *= kept::<F>(idx, seed_hi, seed_lo, keep, inv_keep);
                    }
                    gr = ds[idx];
                }
                pc[u] = pd;
                gc[u] = gr;
                sync_cube();
                if u < d {
                    let n = select(t - is < units, t - is, units);
                    let mut x = 0;
                    while x < n {
                        let tok = seq + is + x;
                        dva += pc[x] * dout[tok * h + col + u];
                        dka += gc[x] * q[tok * rs + col + u];
                        x += 1;
                    }
                }
                is += units;
            }
            g += 1;
        }
        if u < d {
            let at = (seq + j) * kv_rs + kvh * d + u;
            dk[at + dk_off] = dka;
            if fused {
                dk[at + dv_off] = dva;
            } else {
                dv[at + dv_off] = dva;
            }
        }
        row += CUBE_COUNT_X as usize;
    }
}

/// q, k and v: three `[B, T, H]` tensors, or one `[B, T, 3H]` (q, k, v side by side).
#[allow(clippy::large_enum_variant)] // made once per call and taken apart at once
pub enum Qkv<R: CubeRuntime> {
    Separate([CubeTensor<R>; 3]),
    Fused(CubeTensor<R>),
}

/// The sizes one call runs on.
pub(super) struct Layout {
    pub b: usize,
    pub t: usize,
    pub h: usize,
    pub heads: usize,
    /// Row stride of q (and of k and v when fused): `H`, or `3H` fused.
    pub rs: usize,
    /// Key/value heads (grouped-query attention: fewer than `heads`), and their row stride.
    pub kv_heads: usize,
    pub krs: usize,
    pub fused: bool,
}

impl Layout {
    pub fn d(&self) -> usize {
        self.h / self.heads
    }

    /// Query heads per key/value head.
    pub fn group(&self) -> usize {
        self.heads / self.kv_heads
    }

    /// Units per cube: the head dimension rounded up to a power of two (the tree reductions
    /// halve it), at least 32.
    fn units(&self) -> usize {
        self.d().next_power_of_two().max(32)
    }

    /// One cube per row of `B·heads·T` queries (or `B·kv_heads·T` keys), each striding past
    /// wgpu's grid limit.
    fn grid(&self, heads: usize) -> (CubeCount, CubeDim) {
        let rows = self.b * heads * self.t;
        (
            CubeCount::Static(rows.clamp(1, MAX_GRID) as u32, 1, 1),
            CubeDim::new_1d(self.units() as u32),
        )
    }
}

/// Above this many probabilities per call (`B · heads · T²`) cuBLAS's products (on CUDA
/// [`super::attention_blas`], elsewhere Burn's composed chain) are faster than these scalar kernels, which read every
/// key from global memory once per query row. Measured on an H100 (BENCHMARKS.md, issue 32's
/// fourth step), kernels against chain, ms per step: MiniLM training 16×128 (3.1 M) 21.4 / 25.3;
/// BERT-base bf16 8×128 (1.6 M) 43.1 / 43.5 (medians); 32×128 (6.3 M) 106.6 / 58.7; 128×128
/// (25 M) 398 / 107; MiniLM inference 32×128 (6.3 M) 13.9 / 4.9.
const FUSED_MAX_PROBS: usize = 1 << 22;

/// Above this many probabilities per call, CUDA runs attention as cuBLAS's per-head products
/// ([`super::attention_blas`]); between [`FUSED_MAX_PROBS`] and this, Burn's composed chain. The
/// per-head products remove the chain's head copies but make `heads` library calls per product,
/// and each costs host time: they win where the GPU's work decides and lose where the host's does.
/// Measured on an H100 in one run (BENCHMARKS.md, issue 32's fifth step), per-head products
/// against the chain, ms per step: BERT-base bf16 128×128 (25 M) 81.1 / 104.3; SmolLM2 bf16 8×512
/// (18.9 M) 114.2 / 131.6; BERT-base bf16 32×128 (6.3 M) 66.6 / 44.7; MiniLM inference 32×128
/// (6.3 M) 5.8 / 4.6.
#[cfg(feature = "cuda")]
const BLAS_MIN_PROBS: usize = 1 << 24;

/// An attention path forced by `KILN_GPU_ATTENTION`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Path {
    /// These kernels for every size they take (`fused`).
    Fused,
    /// cuBLAS's per-head products on CUDA for every size ([`super::attention_blas`], `blas`).
    Blas,
    /// Burn's composed chain, with its head copies (`composed`).
    Composed,
}

/// Which attention path runs: `KILN_GPU_ATTENTION=fused`, `blas` or `composed` forces one (the A/B
/// switch `scripts/gpu-checks` times them with, `GPU_ATTN_ROWS`); unset, the size rule above
/// decides between these kernels and, above it, cuBLAS's products on CUDA (the composed chain
/// elsewhere).
fn forced() -> Option<Path> {
    static CHOICE: std::sync::OnceLock<Option<Path>> = std::sync::OnceLock::new();
    *CHOICE.get_or_init(|| match std::env::var("KILN_GPU_ATTENTION").as_deref() {
        Ok("fused") => Some(Path::Fused),
        Ok("blas") => Some(Path::Blas),
        Ok("composed") => Some(Path::Composed),
        Ok(other) => {
            // Read inside a kernel dispatch, where no error can be returned: one sentence, then stop.
            eprintln!(
                "error: KILN_GPU_ATTENTION={other:?} is not an attention path (fused, blas or composed)"
            );
            std::process::exit(2)
        }
        Err(_) => None,
    })
}

/// Whether attention over `probs` probabilities per call (`B · heads · T²`) that the kernels do
/// not take runs as cuBLAS's per-head products (CUDA only): above [`BLAS_MIN_PROBS`], or always
/// under `KILN_GPU_ATTENTION=blas`, never under `composed`.
#[cfg(feature = "cuda")]
pub fn blas_wanted(probs: usize) -> bool {
    match forced() {
        Some(Path::Blas) => true,
        Some(Path::Composed) => false,
        _ => probs > BLAS_MIN_PROBS,
    }
}

/// Whether the kernels take attention over `[B, T, H]` with `heads` heads and keys/values of
/// width `kv` (`H`, or fewer heads that divide them): a head dimension up to [`MAX_HEAD_DIM`],
/// every probability's index within 32 bits (the dropout hash's counter), and, unless forced, at
/// most [`FUSED_MAX_PROBS`] probabilities. The forward and its backward see the same shapes, so
/// they take the same path.
pub fn takes([b, t, h]: [usize; 3], kv: usize, heads: usize) -> bool {
    if matches!(forced(), Some(Path::Composed | Path::Blas))
        || heads == 0
        || !h.is_multiple_of(heads)
    {
        return false;
    }
    let d = h / heads;
    let probs = b.saturating_mul(heads).saturating_mul(t).saturating_mul(t);
    (1..=MAX_HEAD_DIM).contains(&d)
        && kv > 0
        && kv.is_multiple_of(d)
        && heads.is_multiple_of(kv / d)
        && probs <= u32::MAX as usize
        && (forced() == Some(Path::Fused) || probs <= FUSED_MAX_PROBS)
}

pub(super) fn layout<R: CubeRuntime>(x: &Qkv<R>, heads: usize) -> Layout {
    match x {
        Qkv::Separate([q, k, _]) => {
            let [b, t, h] = q.shape.dims::<3>();
            let krs = k.shape.dims::<3>()[2];
            Layout {
                b,
                t,
                h,
                heads,
                rs: h,
                kv_heads: krs / (h / heads),
                krs,
                fused: false,
            }
        }
        Qkv::Fused(qkv) => {
            let [b, t, h3] = qkv.shape.dims::<3>();
            Layout {
                b,
                t,
                h: h3 / 3,
                heads,
                rs: h3,
                kv_heads: heads,
                krs: h3,
                fused: true,
            }
        }
    }
}

/// The three operand tensors a kernel binds: with q, k and v in one tensor, k and v are a
/// one-element placeholder (the kernel reads them from q's buffer; one buffer bound twice, once
/// for writing, is what wgpu refuses).
fn operands<R: CubeRuntime, F: FloatElement>(
    x: Qkv<R>,
) -> (CubeTensor<R>, CubeTensor<R>, CubeTensor<R>) {
    match x {
        Qkv::Separate([q, k, v]) => (into_contiguous(q), into_contiguous(k), into_contiguous(v)),
        Qkv::Fused(qkv) => {
            let qkv = into_contiguous(qkv);
            let (k, v) = (placeholder::<R, F>(&qkv), placeholder::<R, F>(&qkv));
            (qkv, k, v)
        }
    }
}

fn placeholder<R: CubeRuntime, F: FloatElement>(like: &CubeTensor<R>) -> CubeTensor<R> {
    empty_device::<R, F>(like.client.clone(), like.device.clone(), Shape::new([1]))
}

fn seed_args(seed: u64) -> (ScalarArg<u32>, ScalarArg<u32>) {
    (
        ScalarArg::new((seed >> 32) as u32),
        ScalarArg::new(seed as u32),
    )
}

/// `(out [B, T, H], probs [B, heads, T, T] if with_probs)`: `ops::KilnBackend::kiln_attention`'s
/// contract. Callers check [`takes`] first.
pub fn forward<R: CubeRuntime, F: FloatElement>(
    x: Qkv<R>,
    mask: CubeTensor<R>,
    spec: AttentionSpec,
    with_probs: bool,
) -> (CubeTensor<R>, Option<CubeTensor<R>>) {
    let AttentionSpec {
        heads,
        window,
        scale,
        dropout,
    } = spec;
    let l = layout(&x, heads);
    let (q, k, v) = operands::<R, F>(x);
    let mask = into_contiguous(mask);
    let (client, device) = (q.client.clone(), q.device.clone());
    let out = empty_device::<R, F>(client.clone(), device.clone(), Shape::new([l.b, l.t, l.h]));
    let probs = if with_probs {
        empty_device::<R, F>(client.clone(), device, Shape::new([l.b, heads, l.t, l.t]))
    } else {
        placeholder::<R, F>(&q)
    };
    let keep = dropout.keep();
    let (seed_hi, seed_lo) = seed_args(dropout.seed);
    let (count, dim) = l.grid(heads);
    let (k_off, v_off) = if l.fused { (l.h, 2 * l.h) } else { (0, 0) };
    attention_forward_kernel::launch::<F, R>(
        &client,
        count,
        dim,
        q.as_tensor_arg(1),
        k.as_tensor_arg(1),
        v.as_tensor_arg(1),
        mask.as_tensor_arg(1),
        out.as_tensor_arg(1),
        probs.as_tensor_arg(1),
        ScalarArg::new(l.t as u32),
        ScalarArg::new(heads as u32),
        ScalarArg::new(l.rs as u32),
        ScalarArg::new(l.krs as u32),
        ScalarArg::new(l.group() as u32),
        ScalarArg::new(k_off as u32),
        ScalarArg::new(v_off as u32),
        ScalarArg::new(window.before.min(l.t) as u32),
        ScalarArg::new(window.after.min(l.t) as u32),
        ScalarArg::new(scale as f32),
        ScalarArg::new(keep as f32),
        ScalarArg::new((1.0 / keep) as f32),
        seed_hi,
        seed_lo,
        l.d(),
        l.units(),
        l.fused,
        with_probs,
        dropout.is_active(),
    )
    .expect("attention_forward launches");
    (out, with_probs.then_some(probs))
}

/// The gradients of [`forward`]'s inputs for the output gradient `dout [B, T, H]`: `[dq, dk, dv]`
/// (each `[B, T, H]`) for separate inputs, `[dqkv]` (`[B, T, 3H]`) for one fused tensor.
pub fn backward<R: CubeRuntime, F: FloatElement>(
    x: Qkv<R>,
    probs: CubeTensor<R>,
    dout: CubeTensor<R>,
    spec: AttentionSpec,
) -> Vec<CubeTensor<R>> {
    let AttentionSpec {
        heads,
        scale,
        dropout,
        ..
    } = spec;
    let l = layout(&x, heads);
    let (q, k, v) = operands::<R, F>(x);
    let (probs, dout) = (into_contiguous(probs), into_contiguous(dout));
    let (client, device) = (q.client.clone(), q.device.clone());
    let new = |dims: &[usize]| empty_device::<R, F>(client.clone(), device.clone(), dims.into());
    let ds = new(&[l.b, heads, l.t, l.t]);
    // Fused: one [B, T, 3H] gradient, dq in its first third, dk and dv in the others.
    let grads: Vec<CubeTensor<R>> = if l.fused {
        vec![new(&[l.b, l.t, 3 * l.h])]
    } else {
        vec![
            new(&[l.b, l.t, l.h]),
            new(&[l.b, l.t, l.krs]),
            new(&[l.b, l.t, l.krs]),
        ]
    };
    let keep = dropout.keep();
    let (count, dim) = l.grid(heads);
    let (k_off, v_off) = if l.fused { (l.h, 2 * l.h) } else { (0, 0) };
    let (seed_hi, seed_lo) = seed_args(dropout.seed);
    attention_backward_rows_kernel::launch::<F, R>(
        &client,
        count,
        dim,
        q.as_tensor_arg(1),
        k.as_tensor_arg(1),
        v.as_tensor_arg(1),
        probs.as_tensor_arg(1),
        dout.as_tensor_arg(1),
        ds.as_tensor_arg(1),
        grads[0].as_tensor_arg(1),
        ScalarArg::new(l.t as u32),
        ScalarArg::new(heads as u32),
        ScalarArg::new(l.krs as u32),
        ScalarArg::new(l.group() as u32),
        ScalarArg::new(k_off as u32),
        ScalarArg::new(v_off as u32),
        ScalarArg::new(l.rs as u32),
        ScalarArg::new(scale as f32),
        ScalarArg::new(keep as f32),
        ScalarArg::new((1.0 / keep) as f32),
        seed_hi,
        seed_lo,
        l.d(),
        l.units(),
        l.fused,
        dropout.is_active(),
    )
    .expect("attention_backward_rows launches");
    let (seed_hi, seed_lo) = seed_args(dropout.seed);
    let (count, dim) = l.grid(l.kv_heads);
    let (dk, dv) = if l.fused {
        (&grads[0], placeholder::<R, F>(&q))
    } else {
        (&grads[1], grads[2].clone())
    };
    attention_backward_keys_kernel::launch::<F, R>(
        &client,
        count,
        dim,
        q.as_tensor_arg(1),
        probs.as_tensor_arg(1),
        ds.as_tensor_arg(1),
        dout.as_tensor_arg(1),
        dk.as_tensor_arg(1),
        dv.as_tensor_arg(1),
        ScalarArg::new(l.t as u32),
        ScalarArg::new(heads as u32),
        ScalarArg::new(l.group() as u32),
        ScalarArg::new(l.rs as u32),
        ScalarArg::new(l.krs as u32),
        ScalarArg::new(k_off as u32),
        ScalarArg::new(v_off as u32),
        ScalarArg::new(keep as f32),
        ScalarArg::new((1.0 / keep) as f32),
        seed_hi,
        seed_lo,
        l.d(),
        l.units(),
        l.fused,
        dropout.is_active(),
    )
    .expect("attention_backward_keys launches");
    grads
}
