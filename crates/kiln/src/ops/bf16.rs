//! bf16 matrix products for mixed precision (`--bf16`) on the CPU.
//!
//! Both operands are rounded to bf16 (round to nearest, ties to even, as PyTorch's casts) and the
//! products are summed in f32: the numerics of a bf16 autocast GEMM with f32 accumulation. On CPUs
//! with AVX512-BF16 (`vdpbf16ps`: 32 bf16 multiply-adds per instruction, twice the f32 FMA rate) the
//! operands are packed as bf16 pairs and multiplied by the kernel below; elsewhere they are rounded
//! into f32 copies and multiplied by the f32 GEMM, which gives the same products (a product of two
//! bf16 values is exact in f32), so every machine trains with the same numerics.

use rayon::prelude::*;

/// `x` rounded to bf16, as its 16 bits (NaN stays a quiet NaN).
#[inline(always)]
pub fn bf16_bits(x: f32) -> u16 {
    let b = x.to_bits();
    if x.is_nan() {
        return ((b >> 16) | 0x40) as u16;
    }
    // Adding 0x7FFF plus the lowest kept bit rounds to nearest, ties to even; overflow carries into
    // the exponent (up to infinity), as it should.
    (b.wrapping_add(0x7FFF + ((b >> 16) & 1)) >> 16) as u16
}

/// `x` rounded to the nearest bf16 value, as an f32.
#[inline(always)]
pub fn round_bf16(x: f32) -> f32 {
    f32::from_bits(u32::from(bf16_bits(x)) << 16)
}

/// Whether the bf16 dot-product instruction the packed kernel needs may be used: the CPU has
/// AVX512-BF16 and `KILN_CPU_ISA` does not cap it away ([`super::isa`]).
pub fn has_bf16_dot() -> bool {
    super::isa::cpu_isa().bf16_dot
}

/// Rows of C per micro-kernel call.
const MR: usize = 12;
/// Columns of C per micro-kernel call: two 16-lane vectors.
const NR: usize = 32;
/// K pairs per cache block.
const KCP: usize = 128;

/// The two bf16 values `(lo, hi)` in one 32-bit lane, `lo` in the low half (what `vdpbf16ps` pairs).
#[inline(always)]
fn pair(lo: f32, hi: f32) -> u32 {
    u32::from(bf16_bits(lo)) | (u32::from(bf16_bits(hi)) << 16)
}

/// `out[i] = pair(lo[i], hi[i])`, vectorised (packing is a sizeable share of a GEMM's time when K
/// is long, as in the weight gradient).
///
/// # Safety
/// The CPU must have AVX-512 F/BW (every CPU with AVX512-BF16 has).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn pack_pairs(lo: &[f32], hi: &[f32], out: &mut [u32]) {
    for ((o, &l), &h) in out.iter_mut().zip(lo).zip(hi) {
        *o = pair(l, h);
    }
}

/// C[m×n] (row stride `n`) = A·B + β·C with A and B rounded to bf16 and f32 accumulation. Operands
/// are given by (row, column) element strides, as for the f32 GEMM; `f32_gemm` multiplies row-major
/// rounded copies where the CPU has no bf16 instructions.
#[allow(clippy::too_many_arguments)]
pub fn gemm_bf16(
    mkn: (usize, usize, usize),
    a: &[f32],
    a_strides: (usize, usize),
    b: &[f32],
    b_strides: (usize, usize),
    beta: f32,
    c: &mut [f32],
    f32_gemm: impl Fn(usize, usize, usize, &[f32], &[f32], f32, &mut [f32]),
) {
    let packed = has_bf16_dot();
    gemm_bf16_with(packed, mkn, a, a_strides, b, b_strides, beta, c, f32_gemm)
}

#[allow(clippy::too_many_arguments)]
fn gemm_bf16_with(
    packed: bool,
    (m, k, n): (usize, usize, usize),
    a: &[f32],
    (rsa, csa): (usize, usize),
    b: &[f32],
    (rsb, csb): (usize, usize),
    beta: f32,
    c: &mut [f32],
    f32_gemm: impl Fn(usize, usize, usize, &[f32], &[f32], f32, &mut [f32]),
) {
    if m == 0 || n == 0 {
        return;
    }
    assert!(k == 0 || a.len() > (m - 1) * rsa + (k - 1) * csa);
    assert!(k == 0 || b.len() > (k - 1) * rsb + (n - 1) * csb);
    assert!(c.len() >= m * n);
    if !packed {
        // Same products through the f32 GEMM on rounded, row-major copies.
        let ar: Vec<f32> = (0..m * k)
            .into_par_iter()
            .map(|i| round_bf16(a[(i / k) * rsa + (i % k) * csa]))
            .collect();
        let br: Vec<f32> = (0..k * n)
            .into_par_iter()
            .map(|i| round_bf16(b[(i / n) * rsb + (i % n) * csb]))
            .collect();
        f32_gemm(m, k, n, &ar, &br, beta, c);
        return;
    }
    #[cfg(target_arch = "x86_64")]
    {
        let kp = k.div_ceil(2);
        let at = |row: usize, kk: usize| if kk < k { a[row * rsa + kk * csa] } else { 0.0 };
        let bt = |kk: usize, col: usize| {
            if kk < k && col < n {
                b[kk * rsb + col * csb]
            } else {
                0.0
            }
        };
        // B packed once, shared by every task: panel j holds columns j·NR.. as [kp][NR] pairs.
        let panels = n.div_ceil(NR);
        let mut bp = vec![0u32; panels * kp * NR];
        let zeros = [0f32; NR];
        bp.par_chunks_mut(kp * NR)
            .enumerate()
            .for_each(|(j, panel)| {
                for (p, lanes) in panel.chunks_mut(NR).enumerate() {
                    let col = j * NR;
                    if csb == 1 && col + NR <= n {
                        // Row-major B: two contiguous row pieces per pair of k.
                        let row = |kk: usize| {
                            if kk < k {
                                &b[kk * rsb + col..][..NR]
                            } else {
                                &zeros[..]
                            }
                        };
                        // SAFETY: packed path only on CPUs with AVX-512 (see `has_bf16_dot`).
                        unsafe { pack_pairs(row(2 * p), row(2 * p + 1), lanes) };
                    } else {
                        for (l, v) in lanes.iter_mut().enumerate() {
                            *v = pair(bt(2 * p, col + l), bt(2 * p + 1, col + l));
                        }
                    }
                }
            });
        let parts = rayon::current_num_threads().max(1);
        let rows = m.div_ceil(parts).div_ceil(MR) * MR;
        c[..m * n]
            .par_chunks_mut(rows * n)
            .enumerate()
            .for_each(|(i, cpart)| {
                let r0 = i * rows;
                let mrows = cpart.len() / n;
                let mut ap = vec![0u32; KCP * MR];
                // K in blocks of KCP pairs, so the A block stays in L1 and the B block (all panels,
                // KCP pairs each) in L2 while every row block of this task streams past it.
                for kb in (0..kp).step_by(KCP) {
                    let kc = KCP.min(kp - kb);
                    let beta = if kb == 0 { beta } else { 1.0 };
                    for rb in (0..mrows).step_by(MR) {
                        let live = MR.min(mrows - rb);
                        // A's rows rb.., pairs kb.. as [kc][MR] (rows past the end are zero).
                        for (p, lanes) in ap.chunks_mut(MR).take(kc).enumerate() {
                            let kk = 2 * (kb + p);
                            let row0 = r0 + rb;
                            if rsa == 1 && live == MR {
                                // Column-major A (the weight gradient's dyᵀ): rows are contiguous.
                                let col = |kk: usize| {
                                    if kk < k {
                                        &a[kk * csa + row0..][..MR]
                                    } else {
                                        &zeros[..MR]
                                    }
                                };
                                // SAFETY: as above.
                                unsafe { pack_pairs(col(kk), col(kk + 1), lanes) };
                                continue;
                            }
                            for (r, v) in lanes.iter_mut().enumerate() {
                                *v = if r < live {
                                    pair(at(row0 + r, kk), at(row0 + r, kk + 1))
                                } else {
                                    0
                                };
                            }
                        }
                        for j in 0..panels {
                            let cols = NR.min(n - j * NR);
                            // SAFETY: the CPU has AVX512-BF16 (checked by the caller); `ap` holds
                            // kc·MR values and panel j from pair kb holds kc·NR; the tile written
                            // is rows rb..rb+live, columns j·NR..j·NR+cols of this task's part of C.
                            unsafe {
                                kernel(
                                    kc,
                                    ap.as_ptr(),
                                    bp.as_ptr().add((j * kp + kb) * NR),
                                    cpart.as_mut_ptr().add(rb * n + j * NR),
                                    n,
                                    beta,
                                    live,
                                    cols,
                                );
                            }
                        }
                    }
                }
            });
    }
}

/// One MR×NR tile of C: `kp` steps of 12 broadcast A pairs times two 16-lane B vectors, into 24
/// f32 accumulators held in registers.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
#[allow(clippy::too_many_arguments)]
unsafe fn kernel(
    kp: usize,
    a: *const u32,
    b: *const u32,
    c: *mut f32,
    ldc: usize,
    beta: f32,
    rows: usize,
    cols: usize,
) {
    use std::arch::x86_64::*;
    let mut acc0 = [_mm512_setzero_ps(); MR];
    let mut acc1 = [_mm512_setzero_ps(); MR];
    for p in 0..kp {
        let b0: __m512bh = std::mem::transmute(_mm512_loadu_si512(b.add(p * NR).cast()));
        let b1: __m512bh = std::mem::transmute(_mm512_loadu_si512(b.add(p * NR + 16).cast()));
        for r in 0..MR {
            let av: __m512bh = std::mem::transmute(_mm512_set1_epi32(*a.add(p * MR + r) as i32));
            acc0[r] = _mm512_dpbf16_ps(acc0[r], av, b0);
            acc1[r] = _mm512_dpbf16_ps(acc1[r], av, b1);
        }
    }
    if rows == MR && cols == NR {
        let vb = _mm512_set1_ps(beta);
        for r in 0..MR {
            let dst = c.add(r * ldc);
            let (mut v0, mut v1) = (acc0[r], acc1[r]);
            if beta != 0.0 {
                v0 = _mm512_fmadd_ps(_mm512_loadu_ps(dst), vb, v0);
                v1 = _mm512_fmadd_ps(_mm512_loadu_ps(dst.add(16)), vb, v1);
            }
            _mm512_storeu_ps(dst, v0);
            _mm512_storeu_ps(dst.add(16), v1);
        }
    } else {
        let mut tile = [0f32; MR * NR];
        for r in 0..MR {
            _mm512_storeu_ps(tile.as_mut_ptr().add(r * NR), acc0[r]);
            _mm512_storeu_ps(tile.as_mut_ptr().add(r * NR + 16), acc1[r]);
        }
        for r in 0..rows {
            for col in 0..cols {
                let dst = c.add(r * ldc + col);
                let base = if beta != 0.0 { beta * *dst } else { 0.0 };
                *dst = base + tile[r * NR + col];
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounding_matches_the_half_crate() {
        // half's f32 → bf16 conversion is an independent round-to-nearest-even implementation.
        let mut x = 0x1234_5678u32;
        for _ in 0..200_000 {
            x = x.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            let v = f32::from_bits(x);
            let ours = bf16_bits(v);
            let theirs = half::bf16::from_f32(v).to_bits();
            if v.is_nan() {
                assert!(half::bf16::from_bits(ours).is_nan());
            } else {
                assert_eq!(ours, theirs, "{v:e}");
            }
        }
        // ties go to even
        assert_eq!(bf16_bits(f32::from_bits(0x3F80_8000)), 0x3F80);
        assert_eq!(bf16_bits(f32::from_bits(0x3F81_8000)), 0x3F82);
    }

    /// f64 reference of the product of bf16-rounded operands.
    fn reference(m: usize, k: usize, n: usize, a: &[f32], b: &[f32]) -> Vec<f64> {
        let mut c = vec![0f64; m * n];
        for i in 0..m {
            for j in 0..n {
                c[i * n + j] = (0..k)
                    .map(|p| {
                        f64::from(half::bf16::from_f32(a[i * k + p]).to_f32())
                            * f64::from(half::bf16::from_f32(b[p * n + j]).to_f32())
                    })
                    .sum();
            }
        }
        c
    }

    /// The rounded-copy path always; the packed kernel too where the CPU has it.
    fn paths() -> Vec<bool> {
        if has_bf16_dot() {
            vec![false, true]
        } else {
            eprintln!("no AVX512-BF16 on this CPU: only the rounded-copy path is tested");
            vec![false]
        }
    }

    fn naive_f32(m: usize, k: usize, n: usize, a: &[f32], b: &[f32], beta: f32, c: &mut [f32]) {
        for i in 0..m {
            for j in 0..n {
                let s: f32 = (0..k).map(|p| a[i * k + p] * b[p * n + j]).sum();
                c[i * n + j] = s + beta * c[i * n + j];
            }
        }
    }

    #[test]
    fn products_match_a_bf16_reference_at_awkward_sizes() {
        // Odd k, rows and columns that are not multiples of the tile, and β = 1.
        for &(m, k, n) in &[(1, 1, 1), (13, 7, 33), (29, 64, 70), (50, 129, 96)] {
            let a: Vec<f32> = (0..m * k)
                .map(|i| ((i * 37 % 101) as f32 - 50.0) / 17.0)
                .collect();
            let b: Vec<f32> = (0..k * n)
                .map(|i| ((i * 53 % 97) as f32 - 48.0) / 23.0)
                .collect();
            let init: Vec<f32> = (0..m * n).map(|i| (i % 5) as f32).collect();
            let want = reference(m, k, n, &a, &b);
            for (packed, beta) in paths().into_iter().flat_map(|p| [(p, 0.0), (p, 1.0)]) {
                let mut c = init.clone();
                let (ab, bb) = ((k, 1), (n, 1));
                gemm_bf16_with(packed, (m, k, n), &a, ab, &b, bb, beta, &mut c, naive_f32);
                for (i, (&got, &w)) in c.iter().zip(&want).enumerate() {
                    let w = w + f64::from(beta * init[i]);
                    let tol = 1e-5 * (1.0 + w.abs()) * (k as f64).sqrt();
                    assert!(
                        (f64::from(got) - w).abs() <= tol,
                        "{m}x{k}x{n} [{i}]: {got} vs {w}"
                    );
                }
                // Not the f32 product: the operands really were rounded.
                let mut f = init.clone();
                naive_f32(m, k, n, &a, &b, beta, &mut f);
                if k > 1 {
                    assert!(c.iter().zip(&f).any(|(x, y)| (x - y).abs() > 1e-4));
                }
            }
        }
    }

    #[test]
    fn transposed_operands_by_strides() {
        let (m, k, n) = (17, 40, 35);
        let a: Vec<f32> = (0..m * k).map(|i| (i as f32 * 0.37).sin()).collect();
        let b: Vec<f32> = (0..k * n).map(|i| (i as f32 * 0.11).cos()).collect();
        let want = reference(m, k, n, &a, &b);
        // The same matrices stored transposed: Aᵀ as [k×m], Bᵀ as [n×k].
        let at: Vec<f32> = (0..k * m).map(|i| a[(i % m) * k + i / m]).collect();
        let bt: Vec<f32> = (0..n * k).map(|i| b[(i % k) * n + i / k]).collect();
        for packed in paths() {
            let mut c = vec![0f32; m * n];
            gemm_bf16_with(
                packed,
                (m, k, n),
                &at,
                (1, m),
                &bt,
                (1, k),
                0.0,
                &mut c,
                naive_f32,
            );
            for (&got, &w) in c.iter().zip(&want) {
                assert!((f64::from(got) - w).abs() < 1e-4, "{got} vs {w}");
            }
        }
    }
}
