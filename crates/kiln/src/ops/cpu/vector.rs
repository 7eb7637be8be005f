//! Element-wise and reduction helpers every CPU kernel uses: parallel maps, row chunking, a
//! vectorisable exp, the AVX-512 dispatch, and partial sums in independent lanes.

use super::*;

/// `f(x) ` element by element into a fresh vector, in parallel chunks, without zeroing or copying
/// the output first (which would double the memory traffic of a cheap element-wise op).
pub(super) fn par_map(x: &[f32], f: impl Fn(f32) -> f32 + Sync) -> Vec<f32> {
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

/// Rows per parallel task: enough work per task to amortise scheduling.
pub(super) fn rows_per_task(row_len: usize) -> usize {
    (16_384 / row_len.max(1)).max(1)
}

/// e^x to about 2 ulp without a libm call, so loops over it vectorise (Cephes `expf`: x = n·ln2 + r,
/// a degree-6 polynomial for e^r, 2^n from the exponent bits). Exactly 0 below −87.3 (masked scores).
#[inline(always)]
pub(super) fn exp_fast(x: f32) -> f32 {
    const LOG2_E: f32 = std::f32::consts::LOG2_E;
    let xc = x.clamp(-87.3, 88.7);
    let n = (xc * LOG2_E + 0.5).floor();
    // Fused multiply-adds (`mul_add`): every caller runs inside [`simd`], where they are one
    // instruction each (AVX2+FMA, AVX-512, NEON); written as `a * b + c` they stay a multiply and
    // an add, which made GELU's erf latency-bound on AVX2.
    let r = n.mul_add(2.121_944_4e-4, n.mul_add(-0.693_359_4, xc));
    let mut p = 1.987_569_1e-4_f32;
    p = p.mul_add(r, 1.398_199_9e-3);
    p = p.mul_add(r, 8.333_452e-3);
    p = p.mul_add(r, 4.166_579_6e-2);
    p = p.mul_add(r, 1.666_666_5e-1);
    p = p.mul_add(r, 0.5);
    let y = (p * r).mul_add(r, r) + 1.0;
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

/// Runs `f` compiled for the widest vector unit kiln may use ([`crate::ops::isa`]): AVX-512 (16 lanes,
/// and 64-bit integer multiplies for the dropout hash), else AVX2+FMA (8 lanes), else the portable
/// build. `f` and the `#[inline(always)]` helpers it calls are compiled inside the feature-enabled
/// function.
#[inline(always)]
pub(super) fn simd<R>(f: impl FnOnce() -> R) -> R {
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
        match crate::ops::isa::cpu_isa().level {
            // SAFETY: `isa` detected these features on this CPU (the cap only lowers the level).
            crate::ops::isa::IsaLevel::Avx512 => return unsafe { avx512(f) },
            // SAFETY: as above.
            crate::ops::isa::IsaLevel::Avx2 => return unsafe { avx2(f) },
            crate::ops::isa::IsaLevel::Portable => {}
        }
    }
    f()
}

/// Whether [`simd`] runs AVX-512 code: 32 vector registers of 16 lanes (else 16 of 8 at most).
pub(super) fn has_avx512() -> bool {
    crate::ops::isa::cpu_isa().level == crate::ops::isa::IsaLevel::Avx512
}

/// Lanes of the partial reductions below: one running f32 sum is a serial dependency the compiler
/// may not reorder (float addition is not associative), so a plain `iter().sum()` stays scalar.
pub(super) const LANES: usize = 16;

/// Σ f(a[i], b[i], c[i]) over equal-length slices, with `LANES` independent partial sums so the
/// loop vectorises. The reductions below take slices, not an index closure: indexing kept a bounds
/// check per element and with it the loop scalar (LayerNorm backward ran at ≈3 ns per element).
#[inline(always)]
pub(super) fn sum_zip3(a: &[f32], b: &[f32], c: &[f32], f: impl Fn(f32, f32, f32) -> f32) -> f32 {
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
pub(super) fn sum_zip2(a: &[f32], b: &[f32], f: impl Fn(f32, f32) -> f32) -> f32 {
    sum_zip3(a, b, b, |x, y, _| f(x, y))
}

/// Σ f(a[i]) (see [`sum_zip3`]).
#[inline(always)]
pub(super) fn sum_map(a: &[f32], f: impl Fn(f32) -> f32) -> f32 {
    sum_zip3(a, a, a, |x, _, _| f(x))
}

/// max of a slice, lane-wise like [`sum_zip3`].
#[inline(always)]
pub(super) fn max_of(x: &[f32]) -> f32 {
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
