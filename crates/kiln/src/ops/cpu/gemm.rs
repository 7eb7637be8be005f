//! The CPU's products: strided sgemm on the `gemm` crate's kernels split into one tile per
//! thread, dot-product kernels for a few rows (decoding), and Linear's forward on them.

use super::*;

/// C = A·B (+ C when `beta` is 1) (+ `bias` on every row) for row-major C `[m, n]`; A and B are given by
/// (row stride, column stride) so either may be read transposed. A side of at most 16 runs on
/// [`narrow_gemm`]; the rest on the `gemm` crate's kernels
/// (AVX-512 where the CPU has it — the `x86-v4` feature — else AVX2/FMA); matrixmultiply, used
/// before, has no AVX-512 kernel and is 1.2–2.1× slower on AVX-512 machines (docs/DESIGN.md "CPU
/// GEMM", `examples/gemm_crates.rs`).
///
/// kiln splits C into one tile per thread itself, each tile a single-threaded `gemm` call with the
/// bias added in the same task, instead of `gemm`'s own rayon split: on 2 threads that was as fast
/// or faster on every model shape measured (+24 % on MiniLM's weight gradient, 3× on the MNIST
/// MLP's first layer, where `gemm`'s split costs more than it saves), and products too small to
/// pay for a second thread run on the caller's.
pub(super) fn sgemm(
    (m, k, n): (usize, usize, usize),
    a: Strided<&[f32]>,
    b: Strided<&[f32]>,
    beta: f32,
    bias: Option<&[f32]>,
    c: &mut [f32],
) {
    if m == 0 || n == 0 {
        return;
    }
    assert!(a.covers(m, k) && b.covers(k, n));
    assert!(c.len() >= m * n);
    assert!(bias.is_none_or(|b| b.len() >= n));
    assert!(
        beta == 0.0 || beta == 1.0,
        "β is 0 (overwrite C) or 1 (add to C)"
    );
    // A side of at most 16 (LoRA's rank, a classifier's labels): the narrow kernel, on C or Cᵀ.
    if n <= NARROW {
        return narrow_gemm((m, k, n), a, b, beta, bias, c);
    }
    if m <= NARROW && bias.is_none() {
        // Cᵀ = Bᵀ·Aᵀ: n rows of m columns, through a transposed copy of C.
        let mut ct = vec![0f32; n * m];
        if beta != 0.0 {
            for (i, row) in c[..m * n].chunks(n).enumerate() {
                row.iter().enumerate().for_each(|(j, &v)| ct[j * m + i] = v);
            }
        }
        narrow_gemm((n, k, m), b.t(), a.t(), beta, None, &mut ct);
        for (i, row) in c[..m * n].chunks_mut(n).enumerate() {
            row.iter_mut()
                .enumerate()
                .for_each(|(j, v)| *v = ct[j * m + i]);
        }
        return;
    }
    let (tm, tn) = gemm_grid(m, n, k, rayon::current_num_threads());
    // Tile edges: rows in multiples of 8, columns in multiples of 16 (one AVX-512 register).
    let (rows, cols) = (
        m.div_ceil(tm).div_ceil(8) * 8,
        n.div_ceil(tn).div_ceil(16) * 16,
    );
    let cp = SharedMut(c.as_mut_ptr());
    let (a_rs, b_cs) = (a.rs, b.cs);
    let tile = |t: usize| {
        let (i0, j0) = ((t / tn) * rows, (t % tn) * cols);
        if i0 >= m || j0 >= n {
            return;
        }
        let (mr, nr) = (rows.min(m - i0), cols.min(n - j0));
        // SAFETY: the asserts above keep every element addressed by this tile of A, B and C in
        // bounds, and tiles are disjoint, so no two tasks write the same element of C.
        unsafe {
            let dst = cp.at(i0 * n + j0);
            let (a, b) = (
                a.map(|a| a.as_ptr().add(i0 * a_rs)),
                b.map(|b| b.as_ptr().add(j0 * b_cs)),
            );
            #[cfg(target_arch = "x86_64")]
            if super::gemm_avx2::takes_here(mr, k, nr) {
                let bias = bias.map(|b| b.as_ptr().add(j0));
                return super::gemm_avx2::gemm_avx2((mr, k, nr), a, b, beta != 0.0, bias, dst, n);
            }
            small_gemm((mr, k, nr), a, b, beta != 0.0, Strided::new(dst, (n, 1)));
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

/// `dst += src`, element-wise.
#[inline]
pub(super) fn add_into(dst: &mut [f32], src: &[f32]) {
    simd(
        #[inline(always)]
        || dst.iter_mut().zip(src).for_each(|(d, s)| *d += s),
    )
}

/// C = A·B (+ `bias` on every row) through [`sgemm`], or its bf16 counterpart under
/// [`crate::ops::MatmulPrecision::Bf16`]: the products of Linear layers (forward and both backward GEMMs).
pub(super) fn matmul(
    (m, k, n): (usize, usize, usize),
    a: Strided<&[f32]>,
    b: Strided<&[f32]>,
    bias: Option<&[f32]>,
    c: &mut [f32],
) {
    match crate::ops::matmul_precision() {
        crate::ops::MatmulPrecision::F32 => sgemm((m, k, n), a, b, 0.0, bias, c),
        crate::ops::MatmulPrecision::Bf16 => {
            let _p = crate::ops::profile::scope("part: bf16 GEMMs (inside linear_*)");
            // The bf16 kernel accumulates into C (β = 1) on top of the broadcast bias.
            let beta = bias_as_start(&mut c[..m * n], bias);
            crate::ops::bf16::gemm_bf16((m, k, n), a, b, beta, c, rounded_sgemm)
        }
    }
}

/// A·B (+ `bias` on every row) through [`matmul`], as a new row-major `[m, n]` buffer. Under f32
/// the buffer is not zero-filled first ([`unfilled`]): that pass of writes cost 4–5 % of a MiniLM
/// inference step, and [`sgemm`] with β = 0 overwrites every element. The bf16 kernels get zeros.
pub(super) fn matmul_new(
    (m, k, n): (usize, usize, usize),
    a: Strided<&[f32]>,
    b: Strided<&[f32]>,
    bias: Option<&[f32]>,
) -> Vec<f32> {
    let mut c = match crate::ops::matmul_precision() {
        // SAFETY: `sgemm` with β = 0 writes each of C's m·n elements before it reads any: its
        // kernels (the narrow one, the transposed copy, kiln's AVX2 tile, the `gemm` crate's with
        // `read_dst` false) store their first sum over K, and the bias is added after.
        crate::ops::MatmulPrecision::F32 => unsafe { unfilled(m * n) },
        crate::ops::MatmulPrecision::Bf16 => vec![0f32; m * n],
    };
    matmul((m, k, n), a, b, bias, &mut c);
    c
}

/// The β for a bf16 kernel that adds onto C: with a bias, C's rows (`bias.len()` wide) start as
/// the bias and the kernel accumulates (1); without one, it overwrites (0).
fn bias_as_start(c: &mut [f32], bias: Option<&[f32]>) -> f32 {
    let Some(bias) = bias else { return 0.0 };
    let n = bias.len();
    c.par_chunks_mut(rows_per_task(n) * n)
        .for_each(|rows| rows.chunks_mut(n).for_each(|r| r.copy_from_slice(bias)));
    1.0
}

/// `x · w` for two equal-length slices, in 16 independent lanes (so it vectorises).
#[inline]
pub(super) fn dot(a: &[f32], b: &[f32]) -> f32 {
    sum_zip2(a, b, |x, y| x * y)
}

/// Rows of `x` at or below which a Linear runs as dot products (token-by-token decoding).
pub(super) const GEMV_MAX_ROWS: usize = 4;

/// `y = x wᵀ (+ beta·y)` for a few rows `x [m, k]` and a PyTorch-layout weight `w [n, k]`: every
/// output is a contiguous dot product, so the weight streams through memory once, split across
/// threads by output. A GEMM would first pack the whole weight — for one row, that copy costs more
/// than the multiplication.
pub(super) fn gemv_rows(
    m: usize,
    k: usize,
    n: usize,
    x: &[f32],
    w: &[f32],
    beta: f32,
    y: &mut [f32],
) {
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
pub(super) fn gemv_rows_in_out(
    (m, k, n): (usize, usize, usize),
    x: &[f32],
    w: &[f32],
    y: &mut [f32],
) {
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
pub(super) const GEMV_BANDS: usize = 8;

/// C[m×n] = A[m×k]·B[k×n] (+ C if `accumulate`) on the calling thread, every operand given by
/// pointer and strides.
///
/// # Safety
/// Every element addressed by the sizes and strides must lie inside the pointed-to buffers, and no
/// other thread may write the elements of `c` concurrently.
pub(super) unsafe fn small_gemm(
    (m, k, n): (usize, usize, usize),
    a: Strided<*const f32>,
    b: Strided<*const f32>,
    accumulate: bool,
    c: Strided<*mut f32>,
) {
    let (dst, drs, dcs) = (c.data, c.rs, c.cs);
    let (lhs, lrs, lcs) = (a.data, a.rs, a.cs);
    let (rhs, rrs, rcs) = (b.data, b.rs, b.cs);
    // `gemm` picks its kernels on its first product: `KILN_CPU_ISA` must have capped them by then.
    crate::ops::isa::cpu_isa();
    ::gemm::gemm(
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
        ::gemm::Parallelism::None,
    );
}

/// `x wᵀ + b` for a PyTorch-layout weight `[out, in]`, or `x w + b` for one laid out `[in, out]`
/// (`in_out`, inference's layout): the few-rows kernel of that layout (decoding), else the GEMM
/// with the weight read through strides.
pub(super) fn linear_forward(
    x: NdArrayTensor,
    w: NdArrayTensor,
    b: Option<NdArrayTensor>,
    in_out: bool,
) -> NdArrayTensor {
    let _p = crate::ops::profile::scope("linear_fwd");
    let (x, w) = (dense(x), dense(w));
    let (m, k) = (x.shape()[0], x.shape()[1]);
    let n = if in_out { w.shape()[1] } else { w.shape()[0] };
    let (xs, ws) = (slice(&x), slice(&w));
    let b = b.map(dense);
    let bias = b.as_ref().map(slice);
    if m > GEMV_MAX_ROWS || crate::ops::matmul_precision() != crate::ops::MatmulPrecision::F32 {
        // `[out, in]` read as wᵀ without a transpose: element (k, n) of wᵀ is w[n·K + k].
        let w_strides = if in_out { (n, 1) } else { (1, k) };
        let w = Strided::new(ws, w_strides);
        return tensor(
            &[m, n],
            matmul_new((m, k, n), Strided::rows(xs, k), w, bias),
        );
    }
    // Both few-rows kernels add onto `y`: the bias, or zeros.
    let mut y = vec![0f32; m * n];
    if let Some(bias) = bias {
        y.chunks_mut(n).for_each(|row| row.copy_from_slice(bias));
    }
    if in_out {
        gemv_rows_in_out((m, k, n), xs, ws, &mut y);
    } else {
        gemv_rows(m, k, n, xs, ws, f32::from(bias.is_some()), &mut y);
    }
    tensor(&[m, n], y)
}

/// Rows (forward) or columns (input gradient) of a bf16-held weight widened to f32 per product:
/// a panel of at most 512 × K floats (4 MB at K = 2048) instead of the whole weight, so a frozen
/// base held in bf16 never has an f32 copy of a layer, the tied output layer's included.
const BF16_PANEL: usize = 512;

/// `bits` (bf16 values) as f32, in place of `out`.
#[inline]
pub(super) fn widen_bf16(bits: &[u16], out: &mut [f32]) {
    out.iter_mut()
        .zip(bits)
        .for_each(|(o, &b)| *o = crate::ops::bf16::widen_bf16_bits(b));
}

/// Rows of a held weight per bf16 product under `--bf16` ([`held_forward`], [`held_dx`]): packed,
/// a piece is at most 4096 × K bf16 pairs' worth (4.7 MB at K = 576), so no product packs a whole
/// 150k-row output layer at once.
const HELD_PIECE: usize = 4096;

/// The f32 GEMM the bf16 kernels fall back on for row-major rounded copies (CPUs without bf16
/// instructions; under `--bf16` those run in f32 anyway, see [`crate::ops::mixed_precision`]).
fn rounded_sgemm(m: usize, k: usize, n: usize, a: &[f32], b: &[f32], beta: f32, c: &mut [f32]) {
    sgemm(
        (m, k, n),
        Strided::rows(a, k),
        Strided::rows(b, n),
        beta,
        None,
        c,
    )
}

/// `x wᵀ + b` for `x [m, k]` and a weight `w [n, k]` held as bf16 bits. Under `--bf16` the bits
/// are read as they are by the bf16 kernels ([`held_forward`]: x rounded to bf16, as PyTorch
/// multiplies a bf16 base). Otherwise the products of the f32 path on the same (rounded) weight:
/// on AVX-512, up to 192 rows, the panel kernel widening 32 of `w`'s rows at a time as it reaches
/// them ([`super::panels::Weight::HeldOutIn`]); elsewhere [`matmul`] on f32 copies of 512 of
/// `w`'s rows at a time, each copy's columns of `y` copied into place.
pub(super) fn linear_forward_bf16(
    (m, k, n): (usize, usize, usize),
    x: &[f32],
    w: &[u16],
    bias: Option<&[f32]>,
) -> Vec<f32> {
    if crate::ops::matmul_precision() == crate::ops::MatmulPrecision::Bf16 {
        return held_forward((m, k, n), x, w, bias);
    }
    if super::panels::takes_held(m, n) {
        return super::panels::linear((m, k, n), x, super::panels::Weight::HeldOutIn(w), bias);
    }
    let mut y = vec![0f32; m * n];
    let nb_max = BF16_PANEL.min(n);
    let (mut panel, mut part) = (vec![0f32; nb_max * k], vec![0f32; m * nb_max]);
    for j0 in (0..n).step_by(BF16_PANEL) {
        let nb = BF16_PANEL.min(n - j0);
        panel[..nb * k]
            .par_chunks_mut(k)
            .zip(w[j0 * k..(j0 + nb) * k].par_chunks(k))
            .for_each(|(out, bits)| widen_bf16(bits, out));
        let b = bias.map(|b| &b[j0..j0 + nb]);
        let wt = Strided::rows(&panel[..], k).t();
        matmul((m, k, nb), Strided::rows(x, k), wt, b, &mut part[..m * nb]);
        y.par_chunks_mut(n)
            .zip(part[..m * nb].par_chunks(nb))
            .for_each(|(row, p)| row[j0..j0 + nb].copy_from_slice(p));
    }
    y
}

/// `x wᵀ + b` on the bf16 kernels, the held bits read as they are: pieces of [`HELD_PIECE`] rows
/// of `w` (all of them at once where AMX reads them in place), each piece's columns of `y` copied
/// into place when there is more than one.
fn held_forward(
    (m, k, n): (usize, usize, usize),
    x: &[f32],
    w: &[u16],
    bias: Option<&[f32]>,
) -> Vec<f32> {
    let _p = crate::ops::profile::scope("part: bf16 GEMMs, held base (inside linear_*)");
    let kernel = crate::ops::bf16::Bf16Kernel::best();
    let mut y = vec![0f32; m * n];
    // AMX reads a weight in whole tiles where it lies (no piece of it is packed): all of it at once.
    let whole = kernel == crate::ops::bf16::Bf16Kernel::Amx && k % 32 == 0 && n % 32 == 0;
    let piece = if whole { n } else { HELD_PIECE.min(n) };
    let mut part = vec![0f32; if piece < n { m * piece } else { 0 }];
    for j0 in (0..n).step_by(piece) {
        let nb = piece.min(n - j0);
        let out = if nb == n {
            &mut y[..]
        } else {
            &mut part[..m * nb]
        };
        // The kernel accumulates onto the broadcast bias (β = 1).
        let beta = bias_as_start(out, bias.map(|b| &b[j0..j0 + nb]));
        let wt = Strided::rows(&w[j0 * k..(j0 + nb) * k], k).t();
        let x = Strided::rows(x, k);
        crate::ops::bf16::gemm_bf16_held_b(kernel, (m, k, nb), x, wt, beta, out, rounded_sgemm);
        if nb < n {
            y.par_chunks_mut(n)
                .zip(part[..m * nb].par_chunks(nb))
                .for_each(|(row, p)| row[j0..j0 + nb].copy_from_slice(p));
        }
    }
    y
}

/// `dy · w` on the bf16 kernels, the held bits read as they are: `w`'s rows (the sum's index) in
/// pieces of [`HELD_PIECE`], each added onto the last.
fn held_dx((m, k, n): (usize, usize, usize), dy: &[f32], w: &[u16]) -> Vec<f32> {
    let _p = crate::ops::profile::scope("part: bf16 GEMMs, held base (inside linear_*)");
    let kernel = crate::ops::bf16::Bf16Kernel::best();
    let mut dx = vec![0f32; m * k];
    for r0 in (0..n).step_by(HELD_PIECE) {
        let rb = HELD_PIECE.min(n - r0);
        let (dy, w) = (
            Strided::rows(&dy[r0..], n),
            Strided::rows(&w[r0 * k..(r0 + rb) * k], k),
        );
        let beta = if r0 == 0 { 0.0 } else { 1.0 };
        crate::ops::bf16::gemm_bf16_held_b(kernel, (m, rb, k), dy, w, beta, &mut dx, rounded_sgemm);
    }
    dx
}

/// `dy · w` (`[m, k]`) for `dy [m, n]` and a weight `w [n, k]` held as bf16 bits. Under `--bf16`
/// on the bf16 kernels ([`held_dx`]); otherwise on `w`'s columns widened to f32 (32 at a time by
/// the panel kernel on AVX-512 up to 192 rows, [`super::panels::Weight::HeldInOut`], else 512 at
/// a time for [`matmul`]), so each output element is summed over all of `n`, as on the f32 path.
pub(super) fn linear_dx_bf16((m, k, n): (usize, usize, usize), dy: &[f32], w: &[u16]) -> Vec<f32> {
    if crate::ops::matmul_precision() == crate::ops::MatmulPrecision::Bf16 {
        return held_dx((m, k, n), dy, w);
    }
    if super::panels::takes_held(m, k) {
        return super::panels::linear((m, n, k), dy, super::panels::Weight::HeldInOut(w), None);
    }
    let mut dx = vec![0f32; m * k];
    let kb_max = BF16_PANEL.min(k);
    let (mut panel, mut part) = (vec![0f32; n * kb_max], vec![0f32; m * kb_max]);
    for c0 in (0..k).step_by(BF16_PANEL) {
        let kb = BF16_PANEL.min(k - c0);
        panel[..n * kb]
            .par_chunks_mut(kb)
            .enumerate()
            .for_each(|(row, out)| widen_bf16(&w[row * k + c0..][..kb], out));
        let (dy, panel) = (Strided::rows(dy, n), Strided::rows(&panel[..], kb));
        matmul((m, n, kb), dy, panel, None, &mut part[..m * kb]);
        dx.par_chunks_mut(k)
            .zip(part[..m * kb].par_chunks(kb))
            .for_each(|(row, p)| row[c0..c0 + kb].copy_from_slice(p));
    }
    dx
}

/// A product under test: C = A·B (+ C when β is 1) (+ the bias on every row), as [`sgemm`].
#[cfg(test)]
pub(super) type Product = dyn Fn(
    (usize, usize, usize),
    Strided<&[f32]>,
    Strided<&[f32]>,
    f32,
    Option<&[f32]>,
    &mut [f32],
);

/// `product` at each shape against an f64 reference, within f32 summation's bound ((K + 2)·2⁻²⁴
/// times the sum of the products' magnitudes), both layouts of each operand, β 0 and 1, with and
/// without a bias, C starting as NaN under β = 0 (it must be written, never read). The control
/// (the last K term dropped) must break the bound.
#[cfg(test)]
pub(super) fn assert_products_within_f32_bound(
    shapes: &[(usize, usize, usize)],
    product: &Product,
) {
    for &(m, k, n) in shapes {
        let a: Vec<f32> = (0..m * k)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 17.0)
            .collect();
        let b: Vec<f32> = (0..k * n)
            .map(|i| ((i * 53 % 97) as f32 - 48.0) / 23.0)
            .collect();
        let at: Vec<f32> = (0..k * m).map(|i| a[(i % m) * k + i / m]).collect();
        let bt: Vec<f32> = (0..n * k).map(|i| b[(i % k) * n + i / k]).collect();
        let init: Vec<f32> = (0..m * n).map(|i| (i % 5) as f32 - 2.0).collect();
        let bias: Vec<f32> = (0..n).map(|j| j as f32 * 0.25 - 1.0).collect();
        let (mut want, mut mag) = (vec![0f64; m * n], vec![0f64; m * n]);
        for i in 0..m {
            for j in 0..n {
                for p in 0..k {
                    let x = f64::from(a[i * k + p]) * f64::from(b[p * n + j]);
                    want[i * n + j] += x;
                    mag[i * n + j] += x.abs();
                }
            }
        }
        for beta in [0.0, 1.0] {
            for with_bias in [false, true] {
                for (a_op, sa, b_op, sb) in [
                    (&a, (k, 1), &b, (n, 1)),
                    (&at, (1, m), &b, (n, 1)),
                    (&a, (k, 1), &bt, (1, k)),
                    (&at, (1, m), &bt, (1, k)),
                ] {
                    // With β = 0, C starts as NaN: a kernel that read it (even as 0·C) would
                    // leave NaN, and [`matmul_new`] hands `sgemm` a buffer it never filled.
                    let mut c = if beta == 0.0 {
                        vec![f32::NAN; m * n]
                    } else {
                        init.clone()
                    };
                    let bias = with_bias.then_some(&bias[..]);
                    let (a_in, b_in) = (Strided::new(&a_op[..], sa), Strided::new(&b_op[..], sb));
                    product((m, k, n), a_in, b_in, beta, bias, &mut c);
                    for (i, &got) in c.iter().enumerate() {
                        let (start, b) = (
                            f64::from(beta * init[i]),
                            bias.map_or(0.0, |b| f64::from(b[i % n])),
                        );
                        let w = want[i] + start + b;
                        // Magnitudes, not their sum: C and the bias may cancel.
                        let bound = (k as f64 + 2.0) * f64::from(f32::EPSILON) / 2.0
                            * (mag[i] + start.abs() + b.abs());
                        assert!(
                            (f64::from(got) - w).abs() <= bound,
                            "{m}x{k}x{n} A{sa:?} B{sb:?} β={beta} bias={with_bias} [{i}]: \
                             {got} vs {w} (bound {bound})"
                        );
                    }
                }
            }
        }
        // The control: the product without its last K term breaks the bound.
        let mut short = vec![0f32; m * n];
        let b_short = &b[..(k - 1) * n];
        if k > 1 {
            let (a_in, b_in) = (Strided::rows(&a[..], k), Strided::rows(b_short, n));
            product((m, k - 1, n), a_in, b_in, 0.0, None, &mut short);
            assert!(
                short.iter().enumerate().any(|(i, &x)| {
                    (f64::from(x) - want[i]).abs()
                        > (k as f64 + 2.0) * f64::from(f32::EPSILON) / 2.0 * mag[i]
                }),
                "{m}x{k}x{n}: the control is within the bound"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `sgemm` past the narrow sizes — the tiles split between threads, each on kiln's AVX2 tile
    /// or the `gemm` crate's kernels as the dispatch level decides — against the f64 reference:
    /// edges that are not multiples of a register tile or a thread's tile, K from 1 to past a
    /// block. Under β = 0 the checker starts C as NaN, the state [`matmul_new`]'s buffer may be in.
    #[test]
    fn products_match_an_f64_reference() {
        let shapes = [
            (17, 1, 17),
            (33, 40, 65),
            (130, 300, 70),
            (64, 513, 96),
            (200, 64, 129),
        ];
        assert_products_within_f32_bound(&shapes, &sgemm);
    }
}
