//! bf16 matrix products for mixed precision (`--bf16`) on the CPU.
//!
//! Both operands are rounded to bf16 (round to nearest, ties to even, as PyTorch's casts) and the
//! products are summed in f32: the numerics of a bf16 autocast GEMM with f32 accumulation. On CPUs
//! with AMX (Intel Sapphire Rapids on) the operands are packed for tiles and multiplied by
//! [`super::amx`]; on CPUs with AVX512-BF16 only (AMD Zen 4 / Zen 5; `vdpbf16ps`: 32 bf16
//! multiply-adds per instruction) they are packed as bf16 pairs and multiplied by the kernel below;
//! elsewhere they are rounded into f32 copies and multiplied by the f32 GEMM, which gives the same
//! products (a product of two bf16 values is exact in f32), so every machine trains with the same
//! numerics up to the order of the f32 sums. [`Bf16Kernel`] names the three.

pub use super::bf16_pack::{bf16_bits, round_bf16, widen_bf16_bits, Values};
use super::bf16_pack::{pack_b, pack_b_chunk, pack_pairs, pack_panel, pair, pairs_of, NR};
use super::Strided;
use rayon::prelude::*;

/// Whether `--bf16` has bf16 arithmetic to run on that outruns f32: AVX512-BF16 dot products where
/// they are faster than the FMAs (AMD), AMX tiles, unless `KILN_CPU_ISA` caps them away
/// ([`super::isa`]).
pub fn has_bf16_dot() -> bool {
    super::isa::cpu_isa().bf16_dot
}

/// Which kernel multiplies bf16 operands, narrowest first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Bf16Kernel {
    /// Operands rounded into f32 copies and multiplied by the f32 GEMM (no bf16 arithmetic).
    Rounded,
    /// AVX512-BF16 `vdpbf16ps` register tiles.
    Dot,
    /// AMX tiles ([`super::amx`]).
    Amx,
}

impl Bf16Kernel {
    /// The fastest kernel this process may use ([`super::isa`]).
    pub fn best() -> Self {
        let isa = super::isa::cpu_isa();
        if isa.amx {
            Self::Amx
        } else if isa.bf16_dot {
            Self::Dot
        } else {
            Self::Rounded
        }
    }

    /// Every kernel this process may use, narrowest first (what the tests compare).
    pub fn available() -> Vec<Self> {
        let best = Self::best();
        [Self::Rounded, Self::Dot, Self::Amx]
            .into_iter()
            .filter(|k| *k <= best)
            .collect()
    }
}

/// Rows of C per micro-kernel call.
const MR: usize = 12;
/// K pairs per cache block.
const KCP: usize = 128;

/// C[m×n] (row stride `n`) = A·B + β·C (β 0 or 1) with A and B rounded to bf16 and f32
/// accumulation, on [`Bf16Kernel::best`]. Operands are read through their strides, as for the
/// f32 GEMM; `f32_gemm` multiplies row-major rounded copies where the CPU has no bf16
/// instructions.
pub fn gemm_bf16(
    mkn: (usize, usize, usize),
    a: Strided<&[f32]>,
    b: Strided<&[f32]>,
    beta: f32,
    c: &mut [f32],
    f32_gemm: impl Fn(usize, usize, usize, &[f32], &[f32], f32, &mut [f32]),
) {
    gemm_bf16_with(Bf16Kernel::best(), mkn, a, b, beta, c, f32_gemm)
}

/// [`gemm_bf16`] on the given kernel, one of [`Bf16Kernel::available`].
pub fn gemm_bf16_with(
    kernel: Bf16Kernel,
    mkn: (usize, usize, usize),
    a: Strided<&[f32]>,
    b: Strided<&[f32]>,
    beta: f32,
    c: &mut [f32],
    f32_gemm: impl Fn(usize, usize, usize, &[f32], &[f32], f32, &mut [f32]),
) {
    gemm_values(kernel, mkn, a, b.map(Values::F32), beta, c, f32_gemm)
}

/// [`gemm_bf16_with`] for a B given as bf16 bits (a weight held in bf16), read as they are: the
/// same packed panels, so the same products and sums, as for B's values widened to f32.
pub fn gemm_bf16_held_b(
    kernel: Bf16Kernel,
    mkn: (usize, usize, usize),
    a: Strided<&[f32]>,
    b: Strided<&[u16]>,
    beta: f32,
    c: &mut [f32],
    f32_gemm: impl Fn(usize, usize, usize, &[f32], &[f32], f32, &mut [f32]),
) {
    gemm_values(kernel, mkn, a, b.map(Values::Bf16), beta, c, f32_gemm)
}

fn gemm_values(
    kernel: Bf16Kernel,
    (m, k, n): (usize, usize, usize),
    a_op: Strided<&[f32]>,
    b_op: Strided<Values>,
    beta: f32,
    c: &mut [f32],
    f32_gemm: impl Fn(usize, usize, usize, &[f32], &[f32], f32, &mut [f32]),
) {
    let (a, rsa, csa) = (a_op.data, a_op.rs, a_op.cs);
    let (b, rsb, csb) = (b_op.data, b_op.rs, b_op.cs);
    if m == 0 || n == 0 {
        return;
    }
    assert!(a_op.covers(m, k));
    assert!(b_op.fits(b.len(), k, n));
    assert!(c.len() >= m * n);
    assert!(
        beta == 0.0 || beta == 1.0,
        "β is 0 (overwrite C) or 1 (add to C)"
    );
    assert!(
        kernel <= Bf16Kernel::best(),
        "{kernel:?} is not available on this CPU"
    );
    if k == 0 {
        c[..m * n].iter_mut().for_each(|v| *v *= beta);
        return;
    }
    if kernel == Bf16Kernel::Rounded {
        // Same products through the f32 GEMM on rounded, row-major copies.
        let ar: Vec<f32> = (0..m * k)
            .into_par_iter()
            .map(|i| round_bf16(a[(i / k) * rsa + (i % k) * csa]))
            .collect();
        let br: Vec<f32> = (0..k * n)
            .into_par_iter()
            .map(|i| widen_bf16_bits(b.bits((i / n) * rsb + (i % n) * csb)))
            .collect();
        f32_gemm(m, k, n, &ar, &br, beta, c);
        return;
    }
    #[cfg(target_arch = "x86_64")]
    {
        if kernel == Bf16Kernel::Amx {
            if let Values::Bf16(w) = b {
                if (rsa, csa) == (k, 1) && (rsb, csb) == (1, k) && k % 32 == 0 && n % 32 == 0 {
                    // A held weight's forward, x·Wᵀ in whole tiles: W's rows are A tiles where
                    // they lie, never packed.
                    // SAFETY: as below; the shapes are whole tiles and the asserts above bound
                    // x, W and C.
                    unsafe { super::amx::gemm_held_rows((m, k, n), a, w, beta, c) };
                    return;
                }
            }
            // SAFETY: AMX is available (asserted above), and with it AVX-512 F/BW; the asserts
            // above bound every element the strides address.
            unsafe { super::amx::gemm((m, k, n), a_op, b_op, beta, c) };
            return;
        }
        // SAFETY: kernel ≤ best() (asserted above) makes Dot available, so AVX512-BF16 and
        // AVX-512; the asserts above bound every element the strides address.
        unsafe { dot_gemm((m, k, n), a_op, b_op, beta, c) };
    }
}

/// [`gemm_values`] on the AVX512-BF16 dot-product kernel: B packed once into pairs of columns
/// shared by every task, each task a band of C's rows (or, for a wide B and few rows, of its
/// columns), K in cache blocks of [`KCP`] pairs and B's columns in L2 chunks.
///
/// # Safety
/// The CPU must have AVX-512 and AVX512-BF16, `k` must not be 0, `c` must hold m·n values, and
/// `a` and `b` every element their strides address for an m×k and a k×n matrix.
#[cfg(target_arch = "x86_64")]
unsafe fn dot_gemm(
    (m, k, n): (usize, usize, usize),
    a_op: Strided<&[f32]>,
    b_op: Strided<Values>,
    beta: f32,
    c: &mut [f32],
) {
    let (a, rsa, csa) = (a_op.data, a_op.rs, a_op.cs);
    let (b, rsb, csb) = (b_op.data, b_op.rs, b_op.cs);
    let kp = k.div_ceil(2);
    let at = |row: usize, kk: usize| if kk < k { a[row * rsa + kk * csa] } else { 0.0 };
    let zeros = [0f32; NR];
    let parts = rayon::current_num_threads().max(1);
    // Split rows, each task reads all of B and its rows of A; split columns, all of A and its
    // columns of B. A held weight's products at 1×128 tokens (deepseek-1.3B: 128 rows, 2048–5504
    // columns) read all 22 MB of packed weight in both tasks when split by rows.
    let (tm, tn) = if m < n && n.div_ceil(NR) >= parts {
        (1, parts)
    } else {
        (parts, 1)
    };
    let rows = m.div_ceil(tm).div_ceil(MR) * MR;
    let cols = n.div_ceil(tn).div_ceil(NR) * NR;
    // Panels per L2 chunk: half of L2 holds a chunk's block of K (KCP pairs of NR columns), which
    // every row block of the task then reads from L2. Sweeping all of a wide B's panels per row
    // block (5504 columns: 2.8 MB a block) read it from L3 once per twelve rows.
    let chunk_panels = (*crate::ops::cpu::L2_BYTES / 2 / (KCP * NR * 4)).max(1);
    // Tasks that split the rows share B, packed once: panel j holds columns j·NR.. as [kp][NR]
    // pairs. Tasks that split the columns pack their own, a block of K and an L2 chunk at a time,
    // just before their tiles read it: packed whole, a held weight went through memory twice more
    // (written, then read back), 16 MB a product at 1×128 tokens.
    // SAFETY: the dot-product kernel runs only where AVX-512 is (asserted above).
    let shared = (tn == 1).then(|| unsafe { pack_b((k, n), b, (rsb, csb), kp) });
    let cp = c.as_mut_ptr() as usize;
    (0..tm * tn).into_par_iter().for_each(|task| {
        let (r0, c0) = ((task / tn) * rows, (task % tn) * cols);
        if r0 >= m || c0 >= n {
            return;
        }
        let (mrows, ncols) = (rows.min(m - r0), cols.min(n - c0));
        let task_panels = ncols.div_ceil(NR);
        let mut ap = vec![0u32; KCP * MR];
        let mut row_pairs = [0u32; KCP];
        // Sized to this product: attention's small products come here thousands of times a step.
        let own_len = chunk_panels.min(task_panels) * KCP.min(kp.div_ceil(16) * 16) * NR;
        let mut own_b = vec![0u32; if shared.is_none() { own_len } else { 0 }];
        // K in blocks of KCP pairs and B's columns in L2 chunks: the A block stays in L1 and the
        // B chunk in L2 while every row block of this task streams past it.
        for kb in (0..kp).step_by(KCP) {
            let kc = KCP.min(kp - kb);
            // Own panels hold whole steps of 16 pairs (zero past K): the chunk packing's unit.
            let kc16 = kc.div_ceil(16) * 16;
            let beta = if kb == 0 { beta } else { 1.0 };
            for jc in (0..task_panels).step_by(chunk_panels) {
                let chunk = jc..task_panels.min(jc + chunk_panels);
                if shared.is_none() && csb == 1 {
                    // A row-major B (the input gradient's W): a pair of rows at a time across the
                    // chunk's panels, the rows ahead prefetched (a held weight comes from
                    // memory, and a panel reads each row for 64 bytes only).
                    // SAFETY: as above; own_b holds the chunk's panels of kc16 pairs.
                    unsafe {
                        pack_b_chunk(
                            (k, n),
                            b,
                            rsb,
                            (kb, kc16 / 16),
                            (c0 + jc * NR, chunk.len() * NR),
                            &mut own_b,
                        )
                    };
                } else if shared.is_none() {
                    for jl in chunk.clone() {
                        let out = &mut own_b[(jl - jc) * kc16 * NR..][..kc * NR];
                        if (c0 / NR + jl + 1) * NR > n {
                            // Columns past n: the packing leaves them, the tile reads zeros.
                            out.fill(0);
                        }
                        // SAFETY: as above; panel c0/NR + jl starts inside B's columns.
                        unsafe {
                            pack_panel((k, n), b, (rsb, csb), c0 / NR + jl, kb..kb + kc, out)
                        };
                    }
                }
                for rb in (0..mrows).step_by(MR) {
                    let live = MR.min(mrows - rb);
                    let row0 = r0 + rb;
                    if csa == 1 && live == MR {
                        // Row-major A (the forward's x, the input gradient's dy): each row's
                        // pairs are contiguous, converted 32 values at a time, then laid out
                        // as [kc][MR]. Gathered value by value, packing took a fifth of the
                        // products' time where B has few panels (768 columns).
                        let (lo, hi) = (2 * kb, (2 * (kb + kc)).min(k));
                        for r in 0..MR {
                            let row = &a[(row0 + r) * rsa..];
                            // SAFETY: as above.
                            unsafe { pairs_of(&row[lo..hi], &mut row_pairs[..kc]) };
                            for (p, &v) in row_pairs[..kc].iter().enumerate() {
                                ap[p * MR + r] = v;
                            }
                        }
                    } else {
                        // A's rows rb.., pairs kb.. as [kc][MR] (rows past the end are zero).
                        for (p, lanes) in ap.chunks_mut(MR).take(kc).enumerate() {
                            let kk = 2 * (kb + p);
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
                    }
                    for jl in chunk.clone() {
                        let j = c0 / NR + jl;
                        let cols = NR.min(c0 + ncols - j * NR);
                        // SAFETY: the CPU has AVX512-BF16 (checked by the caller); `ap` holds
                        // kc·MR values and panel j from pair kb holds kc·NR; the tile written
                        // is rows row0..row0+live, columns j·NR..j·NR+cols of this task's part
                        // of C, which no other task writes.
                        unsafe {
                            let tile = TileOfC {
                                at: (cp as *mut f32).add(row0 * n + j * NR),
                                ldc: n,
                                rows: live,
                                cols,
                            };
                            dot_tile(
                                kc,
                                ap.as_ptr(),
                                match &shared {
                                    Some(bp) => bp.as_ptr().add((j * kp + kb) * NR),
                                    None => own_b.as_ptr().add((jl - jc) * kc16 * NR),
                                },
                                tile,
                                beta,
                            );
                        }
                    }
                }
            }
        }
    });
}

/// Where one MR×NR tile of C lands: its first element, C's row stride, and how many of the tile's
/// rows and columns lie inside C (fewer at C's edges).
#[cfg(target_arch = "x86_64")]
struct TileOfC {
    at: *mut f32,
    ldc: usize,
    rows: usize,
    cols: usize,
}

/// One MR×NR tile of C: `kp` steps of 12 broadcast A pairs times two 16-lane B vectors, into 24
/// f32 accumulators held in registers.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn dot_tile(kp: usize, a: *const u32, b: *const u32, tile: TileOfC, beta: f32) {
    use std::arch::x86_64::*;
    let TileOfC {
        at: c,
        ldc,
        rows,
        cols,
    } = tile;
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

    /// f64 reference of the product of bf16-rounded operands (row-major), and the sum of the
    /// products' magnitudes that bounds an f32 summation's error.
    fn reference(m: usize, k: usize, n: usize, a: &[f32], b: &[f32]) -> (Vec<f64>, Vec<f64>) {
        let r = |v: f32| f64::from(half::bf16::from_f32(v).to_f32());
        let (mut c, mut mag) = (vec![0f64; m * n], vec![0f64; m * n]);
        for i in 0..m {
            for j in 0..n {
                for p in 0..k {
                    let t = r(a[i * k + p]) * r(b[p * n + j]);
                    c[i * n + j] += t;
                    mag[i * n + j] += t.abs();
                }
            }
        }
        (c, mag)
    }

    /// Every kernel this CPU runs (AMX, AVX512-BF16 dot products, rounded copies), named once
    /// when some are missing so a run on a narrower CPU says what it did not test.
    fn kernels() -> Vec<Bf16Kernel> {
        let kernels = Bf16Kernel::available();
        if !kernels.contains(&Bf16Kernel::Amx) {
            eprintln!(
                "no amx_bf16 on this CPU (or KILN_CPU_ISA caps it): the AMX kernel is not tested"
            );
        }
        if !kernels.contains(&Bf16Kernel::Dot) {
            eprintln!(
                "no avx512_bf16 on this CPU, or slower than its FMAs (Intel without AMX: \
                 KILN_CPU_ISA=avx512bf16 tests it), or KILN_CPU_ISA caps it: vdpbf16ps not tested"
            );
        }
        kernels
    }

    fn naive_f32(m: usize, k: usize, n: usize, a: &[f32], b: &[f32], beta: f32, c: &mut [f32]) {
        for i in 0..m {
            for j in 0..n {
                let s: f32 = (0..k).map(|p| a[i * k + p] * b[p * n + j]).sum();
                c[i * n + j] = s + beta * c[i * n + j];
            }
        }
    }

    /// Every shape class of the tiled kernels: rows and columns below, at and past a tile (16) and
    /// a block (32); K below, at and past a 32-value tile step and a 512-value K block, odd K; a
    /// product big enough to split across threads, and one past the AMX kernel's L2 chunks. Each operand read row-major and transposed
    /// (the backward products' layouts), β 0 and 1, on every kernel, B also as held bf16 bits; the error bound is f32
    /// summation's, (K + 2)·2⁻²⁴ times the products' magnitudes (the products of bf16 values are
    /// exact in f32).
    #[test]
    fn products_match_a_bf16_reference_at_every_shape_class() {
        let shapes = [
            (1, 1, 1),
            (13, 7, 33),
            (16, 32, 16),
            (29, 64, 70),
            (32, 33, 32),
            (50, 129, 96),
            (64, 512, 64),
            (33, 1100, 17),
            (100, 600, 150),
            // More rows per task and more columns than the AMX kernel's L2 chunks (512), with
            // edges in both.
            (1060, 40, 530),
            // Fewer rows than columns: the dot-product kernel's tasks split the columns, each
            // past one L2 chunk of panels (1024 columns on a 1 MB L2), with a ragged last panel.
            (30, 71, 2 * 1024 + 2 * 32 + 7),
        ];
        for &(m, k, n) in &shapes {
            let a: Vec<f32> = (0..m * k)
                .map(|i| ((i * 37 % 101) as f32 - 50.0) / 17.0)
                .collect();
            let b: Vec<f32> = (0..k * n)
                .map(|i| ((i * 53 % 97) as f32 - 48.0) / 23.0)
                .collect();
            // The same matrices stored transposed: Aᵀ as [k×m], Bᵀ as [n×k].
            let at: Vec<f32> = (0..k * m).map(|i| a[(i % m) * k + i / m]).collect();
            let bt: Vec<f32> = (0..n * k).map(|i| b[(i % k) * n + i / k]).collect();
            let init: Vec<f32> = (0..m * n).map(|i| (i % 5) as f32 - 2.0).collect();
            let (want, mag) = reference(m, k, n, &a, &b);
            let bound = |i: usize, beta: f32| {
                (k as f64 + 2.0) * f64::from(f32::EPSILON) / 2.0
                    * (mag[i] + f64::from(beta * init[i]).abs())
            };
            for kernel in kernels() {
                for beta in [0.0, 1.0] {
                    for (a_op, a_strides, b_op, b_strides) in [
                        (&a, (k, 1), &b, (n, 1)),
                        (&at, (1, m), &b, (n, 1)),
                        (&a, (k, 1), &bt, (1, k)),
                        (&at, (1, m), &bt, (1, k)),
                    ] {
                        let mut c = init.clone();
                        let mkn = (m, k, n);
                        let (a_in, b_in) = (
                            Strided::new(&a_op[..], a_strides),
                            Strided::new(&b_op[..], b_strides),
                        );
                        gemm_bf16_with(kernel, mkn, a_in, b_in, beta, &mut c, naive_f32);
                        // B held as bf16 bits (a frozen base) packs to the same pairs: the same
                        // products and sums, bit for bit.
                        let bits: Vec<u16> = b_op.iter().map(|&v| bf16_bits(v)).collect();
                        let mut held = init.clone();
                        let held_b = Strided::new(&bits[..], b_strides);
                        gemm_bf16_held_b(kernel, mkn, a_in, held_b, beta, &mut held, naive_f32);
                        assert!(
                            held.iter().zip(&c).all(|(h, c)| h.to_bits() == c.to_bits()),
                            "{kernel:?} {m}x{k}x{n} B{b_strides:?} β={beta}: held bits differ"
                        );
                        for (i, (&got, &w)) in c.iter().zip(&want).enumerate() {
                            let w = w + f64::from(beta * init[i]);
                            assert!(
                                (f64::from(got) - w).abs() <= bound(i, beta),
                                "{kernel:?} {m}x{k}x{n} A{a_strides:?} B{b_strides:?} β={beta} \
                                 [{i}]: {got} vs {w} (bound {})",
                                bound(i, beta)
                            );
                        }
                    }
                }
            }
            // The control: the f32 product of the unrounded operands breaks the bound, so a
            // kernel that skipped the rounding (or dropped a K term) would fail above.
            if k > 1 {
                let mut f = vec![0f32; m * n];
                naive_f32(m, k, n, &a, &b, 0.0, &mut f);
                assert!(
                    f.iter()
                        .zip(&want)
                        .enumerate()
                        .any(|(i, (&x, &w))| (f64::from(x) - w).abs() > bound(i, 0.0)),
                    "{m}x{k}x{n}: the control is within the bound"
                );
            }
        }
    }

    /// Values a training step meets besides ordinary numbers: zeros, infinities and NaN propagate
    /// as in the f32 product, and sums near f32's range do not lose it.
    #[test]
    fn special_values_propagate_on_every_kernel() {
        let (m, k, n) = (20, 40, 20);
        let mut a = vec![0.5f32; m * k];
        let b = vec![0.25f32; k * n];
        a[3 * k + 5] = f32::INFINITY;
        a[7 * k + 1] = f32::NAN;
        a[9 * k..10 * k].fill(1e30);
        for kernel in kernels() {
            let mut c = vec![0f32; m * n];
            let (a_in, b_in) = (Strided::rows(&a[..], k), Strided::rows(&b[..], n));
            gemm_bf16_with(kernel, (m, k, n), a_in, b_in, 0.0, &mut c, naive_f32);
            assert!(
                c[3 * n..4 * n].iter().all(|v| *v == f32::INFINITY),
                "{kernel:?}"
            );
            assert!(c[7 * n..8 * n].iter().all(|v| v.is_nan()), "{kernel:?}");
            let big = f64::from(round_bf16(1e30)) * 0.25 * k as f64;
            assert!(
                c[9 * n..10 * n]
                    .iter()
                    .all(|v| (f64::from(*v) - big).abs() < 1e-5 * big),
                "{kernel:?}: {}",
                c[9 * n]
            );
            assert!(
                c[0..n].iter().all(|v| *v == 0.5 * 0.25 * k as f32),
                "{kernel:?}"
            );
        }
    }
}
