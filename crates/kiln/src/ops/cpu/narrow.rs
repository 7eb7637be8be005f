//! f32 products with a side of at most 16: a rank-16 LoRA adapter's (x·Aᵀ, dy·B, and the weight
//! gradients dA and dB), a classifier head's. The `gemm` crate packs for wide tiles and ran these
//! at 4–25 GFLOP/s on an AVX-512 Xeon (`examples/thin_products`). Here each row of C is one
//! 16-lane register: a block of rows of C is held in registers while K streams past, every step
//! one row of B (packed once, zero past `n`) against one value of A broadcast per row: one load
//! per multiply-add, no packing of A.

use super::*;

/// The widest C this kernel takes: one 16-lane row per register.
pub(super) const NARROW: usize = 16;

/// C = A·B (+ C when `beta` is 1) (+ `bias` on every row) for row-major C `[m, n]` with
/// `n ≤ NARROW`, A and B given by (row stride, column stride). Each element is summed over K in
/// order, so the bits do not depend on the thread count.
///
/// # Panics
/// When `n > NARROW` or an operand is shorter than its strides address.
pub(super) fn narrow_gemm(
    (m, k, n): (usize, usize, usize),
    a: Strided<&[f32]>,
    b: Strided<&[f32]>,
    beta: f32,
    bias: Option<&[f32]>,
    c: &mut [f32],
) {
    assert!(n <= NARROW);
    if m == 0 || n == 0 {
        return;
    }
    assert!(a.covers(m, k) && b.covers(k, n));
    assert!(c.len() >= m * n && bias.is_none_or(|b| b.len() >= n));
    let Strided {
        data: b,
        rs: rsb,
        cs: csb,
    } = b;
    // B as [k][NARROW], zero past column n.
    let mut bp = vec![0f32; k * NARROW];
    for (p, row) in bp.chunks_mut(NARROW).enumerate() {
        for (j, v) in row[..n].iter_mut().enumerate() {
            *v = b[p * rsb + j * csb];
        }
    }
    // Tasks of whole blocks of rows, each at least GEMM_TASK_MIN multiply-adds.
    let tasks = (m * n * k / GEMM_TASK_MIN).clamp(1, rayon::current_num_threads().max(1));
    let rows = m.div_ceil(tasks).div_ceil(BLOCK) * BLOCK;
    let run =
        |(t, cpart): (usize, &mut [f32])| rows_from(t * rows, cpart, (k, n), a, &bp, beta, bias);
    let c = &mut c[..m * n];
    if tasks == 1 {
        run((0, c));
    } else {
        c.par_chunks_mut(rows * n).enumerate().for_each(run);
    }
}

/// Rows per task boundary: a multiple of every register block below.
const BLOCK: usize = 24;

/// Rows `i0..` of C (as many as `c` holds, row stride `n`), a register block of rows at a time
/// on the widest kernel this CPU runs. Every kernel sums each element over K in order with fused
/// multiply-adds, so all give the same bits.
fn rows_from(
    i0: usize,
    c: &mut [f32],
    (k, n): (usize, usize),
    a: Strided<&[f32]>,
    bp: &[f32],
    beta: f32,
    bias: Option<&[f32]>,
) {
    let Strided {
        data: a,
        rs: rsa,
        cs: csa,
    } = a;
    let m = c.len() / n;
    #[cfg(target_arch = "x86_64")]
    let block = match crate::ops::isa::cpu_isa().level {
        crate::ops::isa::IsaLevel::Avx512 => 12,
        crate::ops::isa::IsaLevel::Avx2 => 6,
        crate::ops::isa::IsaLevel::Portable => 4,
    };
    #[cfg(not(target_arch = "x86_64"))]
    let block = 4;
    let mut sums = [[0f32; NARROW]; 12];
    for r0 in (0..m).step_by(block) {
        let live = block.min(m - r0);
        // Rows past the last repeat it (their sums are not stored), so a block is always whole.
        // SAFETY (of every `add` below): `narrow_gemm` asserted that A holds rows up to m − 1
        // at stride `rsa`, each K long at stride `csa`, and `bp` holds K packed rows.
        let row_at = |r: usize| unsafe { a.as_ptr().add((i0 + r0 + r.min(live - 1)) * rsa) };
        #[cfg(target_arch = "x86_64")]
        match block {
            // SAFETY: the level says the CPU has these features; pointers as above.
            12 => unsafe {
                x86::block_avx512(&std::array::from_fn(row_at), csa, bp.as_ptr(), k, &mut sums)
            },
            // SAFETY: as above.
            6 => unsafe {
                x86::block_avx2(&std::array::from_fn(row_at), csa, bp.as_ptr(), k, &mut sums)
            },
            _ => block_portable(&std::array::from_fn(row_at), csa, bp, k, &mut sums),
        }
        #[cfg(not(target_arch = "x86_64"))]
        block_portable(&std::array::from_fn(row_at), csa, bp, k, &mut sums);
        for (r, row) in sums.iter().enumerate().take(live) {
            let out = &mut c[(r0 + r) * n..][..n];
            for (j, (o, &s)) in out.iter_mut().zip(row).enumerate() {
                let base = if beta != 0.0 { *o } else { 0.0 };
                *o = base + s + bias.map_or(0.0, |b| b[j]);
            }
        }
    }
}

/// Four rows' sums on any CPU, in the order (and so to the bits) of the vector kernels.
fn block_portable(
    rows: &[*const f32; 4],
    csa: usize,
    bp: &[f32],
    k: usize,
    sums: &mut [[f32; NARROW]; 12],
) {
    let mut acc = [[0f32; NARROW]; 4];
    for (p, bv) in bp.chunks_exact(NARROW).enumerate().take(k) {
        for (row, &at) in acc.iter_mut().zip(rows) {
            // SAFETY: see `rows_from`.
            let av = unsafe { *at.add(p * csa) };
            for (s, &bj) in row.iter_mut().zip(bv) {
                *s = av.mul_add(bj, *s);
            }
        }
    }
    sums[..4].copy_from_slice(&acc);
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::NARROW;
    use std::arch::x86_64::*;

    /// Twelve rows' sums, one 16-lane register each: twelve independent chains cover the
    /// fused multiply-add's latency on both ports; each step loads one row of packed B and
    /// broadcasts one value of A per row.
    ///
    /// # Safety
    /// The CPU has AVX-512 F; each row holds K values `csa` apart and `bp` K rows of 16.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn block_avx512(
        rows: &[*const f32; 12],
        csa: usize,
        bp: *const f32,
        k: usize,
        sums: &mut [[f32; NARROW]; 12],
    ) {
        unsafe {
            let mut acc = [_mm512_setzero_ps(); 12];
            for p in 0..k {
                let bv = _mm512_loadu_ps(bp.add(p * NARROW));
                for r in 0..12 {
                    let av = _mm512_set1_ps(*rows[r].add(p * csa));
                    acc[r] = _mm512_fmadd_ps(av, bv, acc[r]);
                }
            }
            for (s, v) in sums.iter_mut().zip(acc) {
                _mm512_storeu_ps(s.as_mut_ptr(), v);
            }
        }
    }

    /// Six rows' sums in pairs of 8-lane registers (12 of AVX2's 16 hold sums).
    ///
    /// # Safety
    /// The CPU has AVX2 and FMA; each row holds K values `csa` apart and `bp` K rows of 16.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn block_avx2(
        rows: &[*const f32; 6],
        csa: usize,
        bp: *const f32,
        k: usize,
        sums: &mut [[f32; NARROW]; 12],
    ) {
        unsafe {
            let mut acc = [[_mm256_setzero_ps(); 2]; 6];
            for p in 0..k {
                let at = bp.add(p * NARROW);
                let (b0, b1) = (_mm256_loadu_ps(at), _mm256_loadu_ps(at.add(8)));
                for r in 0..6 {
                    let av = _mm256_set1_ps(*rows[r].add(p * csa));
                    acc[r][0] = _mm256_fmadd_ps(av, b0, acc[r][0]);
                    acc[r][1] = _mm256_fmadd_ps(av, b1, acc[r][1]);
                }
            }
            for (s, [v0, v1]) in sums.iter_mut().zip(acc) {
                _mm256_storeu_ps(s.as_mut_ptr(), v0);
                _mm256_storeu_ps(s.as_mut_ptr().add(8), v1);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The portable kernel (CPUs without AVX2) and each vector kernel this CPU runs give the
    /// same bits: every one sums each element over K in order with fused multiply-adds.
    #[test]
    fn every_kernel_gives_the_portable_bits() {
        let (k, csa) = (37, 3);
        let a: Vec<f32> = (0..12 * 40 * csa)
            .map(|i| ((i * 29 % 89) as f32 - 44.0) / 13.0)
            .collect();
        let bp: Vec<f32> = (0..k * NARROW)
            .map(|i| ((i * 41 % 83) as f32 - 41.0) / 11.0)
            .collect();
        let rows: [*const f32; 12] = std::array::from_fn(|r| a[r * 40 * csa..].as_ptr());
        let mut want = [[0f32; NARROW]; 12];
        for r0 in [0, 4, 8] {
            let mut sums = [[0f32; NARROW]; 12];
            block_portable(
                &std::array::from_fn(|r| rows[r0 + r]),
                csa,
                &bp,
                k,
                &mut sums,
            );
            want[r0..r0 + 4].copy_from_slice(&sums[..4]);
        }
        #[cfg(target_arch = "x86_64")]
        {
            let mut got = [[0f32; NARROW]; 12];
            if std::arch::is_x86_feature_detected!("avx512f") {
                // SAFETY: detected just now; each row holds K values `csa` apart.
                unsafe { x86::block_avx512(&rows, csa, bp.as_ptr(), k, &mut got) };
                assert_eq!(got, want, "AVX-512");
            }
            if std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
            {
                for r0 in [0, 6] {
                    let mut sums = [[0f32; NARROW]; 12];
                    // SAFETY: as above.
                    unsafe {
                        x86::block_avx2(
                            &std::array::from_fn(|r| rows[r0 + r]),
                            csa,
                            bp.as_ptr(),
                            k,
                            &mut sums,
                        )
                    };
                    got[r0..r0 + 6].copy_from_slice(&sums[..6]);
                }
                assert_eq!(got, want, "AVX2");
            }
        }
    }

    /// Every product `sgemm` sends here — C narrow (n ≤ 16) or A short (m ≤ 16, through Cᵀ) —
    /// against an f64 reference ([`super::super::gemm::assert_products_within_f32_bound`]): rows
    /// below, at and past a register block (8) and a task, K from 1 to past a LoRA layer's.
    #[test]
    fn narrow_products_match_an_f64_reference() {
        let shapes = [
            (1, 1, 1),
            (7, 33, 5),
            (8, 16, 16),
            (9, 64, 16),
            (600, 576, 16),
            (37, 100, 3),
            (16, 512, 40),
            (3, 7, 100),
        ];
        super::super::gemm::assert_products_within_f32_bound(&shapes, &sgemm);
    }
}
