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

/// Whether `--bf16` has bf16 arithmetic to run on: AVX512-BF16 dot products (and AMX tiles,
/// which come with them), unless `KILN_CPU_ISA` caps them away ([`super::isa`]).
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
/// Columns of C per micro-kernel call (and per packed panel of B): two 16-lane vectors.
const NR: usize = 32;
/// K pairs per cache block.
const KCP: usize = 128;

/// The two bf16 values `(lo, hi)` in one 32-bit lane, `lo` in the low half (what `vdpbf16ps` pairs).
#[inline(always)]
fn pair(lo: f32, hi: f32) -> u32 {
    u32::from(bf16_bits(lo)) | (u32::from(bf16_bits(hi)) << 16)
}

/// B's values as the kernels read them: f32 (rounded to bf16 as they are packed) or bf16 bits
/// held as they are (a frozen base under `--base-dtype bf16`), so a held weight is never widened.
#[derive(Clone, Copy)]
pub enum Values<'a> {
    F32(&'a [f32]),
    Bf16(&'a [u16]),
}

impl Values<'_> {
    fn len(&self) -> usize {
        match self {
            Self::F32(v) => v.len(),
            Self::Bf16(b) => b.len(),
        }
    }

    /// Element `i` as bf16 bits (rounded from f32 as [`bf16_bits`]).
    #[inline(always)]
    fn bits(&self, i: usize) -> u16 {
        match self {
            Self::F32(v) => bf16_bits(v[i]),
            Self::Bf16(b) => b[i],
        }
    }

    /// `out[p]` = the pair of elements `start + 2p` and `start + 2p + 1`, for the `len` elements
    /// from `start` (zero past them): [`pairs_of`] for f32 values.
    ///
    /// # Safety
    /// The CPU must have AVX-512 F/BW and AVX512-BF16.
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn pairs_from(&self, start: usize, len: usize, out: &mut [u32]) {
        match self {
            // SAFETY: the caller's CPU has AVX512-BF16.
            Self::F32(v) => unsafe { pairs_of(&v[start..][..len], out) },
            Self::Bf16(b) => {
                let b = &b[start..][..len.min(2 * out.len())];
                let (whole, rest) = out.split_at_mut(b.len() / 2);
                // Two consecutive bf16 values are one pair, the first in the low half.
                let pairs = b
                    .chunks_exact(2)
                    .map(|p| u32::from(p[0]) | (u32::from(p[1]) << 16));
                whole.iter_mut().zip(pairs).for_each(|(o, p)| *o = p);
                rest.fill(0);
                if b.len() % 2 == 1 {
                    rest[0] = u32::from(b[b.len() - 1]);
                }
            }
        }
    }

    /// `out[i]` = the pair of elements `lo + i` and `hi + i` (two rows of B): [`pack_pairs`] for
    /// f32 values.
    ///
    /// # Safety
    /// The CPU must have AVX-512 F/BW and AVX512-BF16.
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn pairs_across(&self, lo: usize, hi: usize, out: &mut [u32]) {
        let len = out.len();
        match self {
            // SAFETY: the caller's CPU has AVX512-BF16.
            Self::F32(v) => unsafe { pack_pairs(&v[lo..][..len], &v[hi..][..len], out) },
            // SAFETY: the caller's CPU has AVX-512 F/BW.
            Self::Bf16(b) => unsafe { interleave_bits(&b[lo..][..len], &b[hi..][..len], out) },
        }
    }
}

/// `out[i]` = `lo[i]` in the low half and `hi[i]` in the high half: two rows of held bf16 bits
/// as the pairs a row of B holds, 16 at a time.
///
/// # Safety
/// The CPU must have AVX-512 F/BW.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn interleave_bits(lo: &[u16], hi: &[u16], out: &mut [u32]) {
    use std::arch::x86_64::*;
    let len = out.len().min(lo.len()).min(hi.len());
    let whole = len / 16;
    for i in 0..whole {
        let l = _mm512_cvtepu16_epi32(_mm256_loadu_si256(lo.as_ptr().add(16 * i).cast()));
        let h = _mm512_cvtepu16_epi32(_mm256_loadu_si256(hi.as_ptr().add(16 * i).cast()));
        let pairs = _mm512_or_si512(l, _mm512_slli_epi32::<16>(h));
        _mm512_storeu_si512(out.as_mut_ptr().add(16 * i).cast(), pairs);
    }
    let rest = 16 * whole..len;
    for ((o, &l), &h) in out[rest.clone()]
        .iter_mut()
        .zip(&lo[rest.clone()])
        .zip(&hi[rest])
    {
        *o = u32::from(l) | (u32::from(h) << 16);
    }
}

/// `out[i] = pair(lo[i], hi[i])`: two rows of values as the pairs a row of B (or a transposed
/// A) holds, 16 at a time by `vcvtne2ps2bf16` and one 16-bit interleave (packing is a sizeable
/// share of a GEMM's time when K is long, as in the weight gradient). Rounds as [`pairs_of`].
///
/// # Safety
/// The CPU must have AVX-512 F/BW and AVX512-BF16.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
pub(super) unsafe fn pack_pairs(lo: &[f32], hi: &[f32], out: &mut [u32]) {
    use std::arch::x86_64::*;
    let len = out.len().min(lo.len()).min(hi.len());
    // Word i of the result takes word i/2 of `lo`'s half (low 256 bits) or of `hi`'s (high).
    let interleave = _mm512_set_epi16(
        31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6, 21, 5, 20, 4,
        19, 3, 18, 2, 17, 1, 16, 0,
    );
    let whole = len / 16;
    for i in 0..whole {
        let l = _mm512_loadu_ps(lo.as_ptr().add(16 * i));
        let h = _mm512_loadu_ps(hi.as_ptr().add(16 * i));
        // The low 16 words are `l` rounded, the high 16 `h`.
        let both: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(h, l));
        let pairs = _mm512_permutexvar_epi16(interleave, both);
        _mm512_storeu_si512(out.as_mut_ptr().add(16 * i).cast(), pairs);
    }
    let rest = 16 * whole..len;
    for ((o, &l), &h) in out[rest.clone()]
        .iter_mut()
        .zip(&lo[rest.clone()])
        .zip(&hi[rest])
    {
        *o = pair(l, h);
    }
}

/// `out[p] = pair(src[2p], src[2p + 1])` for consecutive values (zero past the end of `src`):
/// a row of A, or a column of a transposed B, as the bf16 pairs a tile row holds. Converted 32
/// values at a time by `vcvtne2ps2bf16`, which rounds as [`bf16_bits`] does (nearest, ties to
/// even) except that it flushes subnormal inputs to zero, as the tile and dot-product instructions
/// themselves treat them.
///
/// # Safety
/// The CPU must have AVX-512 F/BW and AVX512-BF16.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
pub(super) unsafe fn pairs_of(src: &[f32], out: &mut [u32]) {
    use std::arch::x86_64::*;
    let whole = (src.len() / 32).min(out.len() / 16);
    for i in 0..whole {
        let lo = _mm512_loadu_ps(src.as_ptr().add(32 * i));
        let hi = _mm512_loadu_ps(src.as_ptr().add(32 * i + 16));
        let v: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(hi, lo));
        _mm512_storeu_si512(out.as_mut_ptr().add(16 * i).cast(), v);
    }
    let at = |i: usize| src.get(i).copied().unwrap_or(0.0);
    for (p, o) in out.iter_mut().enumerate().skip(16 * whole) {
        *o = pair(at(2 * p), at(2 * p + 1));
    }
}

/// A 16×16 block of 32-bit values transposed: row `r` of `dst` (rows `dst_stride` apart) is
/// column `r` of `src` (rows `src_stride` apart). Packing an operand whose K values run down its
/// columns (a transposed weight, the weight gradient's dyᵀ) is a transpose of bf16 pairs; done
/// one value at a time it took as long as the tile products it fed.
///
/// # Safety
/// The CPU must have AVX-512 F; `src` and `dst` must address 16 rows of 16 values.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn transpose16(
    src: *const u32,
    src_stride: usize,
    dst: *mut u32,
    dst_stride: usize,
) {
    use std::arch::x86_64::*;
    let r: [__m512i; 16] =
        std::array::from_fn(|i| _mm512_loadu_si512(src.add(i * src_stride).cast()));
    // Within each 128-bit lane: pairs of rows interleaved by 32 bits, then by 64 bits, so lane L
    // of u[4i + j] holds column 4L + j of rows 4i..4i + 4.
    let t: [__m512i; 16] = std::array::from_fn(|i| {
        let (x, y) = (r[i & !1], r[i | 1]);
        if i % 2 == 0 {
            _mm512_unpacklo_epi32(x, y)
        } else {
            _mm512_unpackhi_epi32(x, y)
        }
    });
    let u: [__m512i; 16] = std::array::from_fn(|i| {
        let (g, j) = (i & !3, i % 4);
        let (x, y) = (t[g + (j >> 1)], t[g + 2 + (j >> 1)]);
        if j % 2 == 0 {
            _mm512_unpacklo_epi64(x, y)
        } else {
            _mm512_unpackhi_epi64(x, y)
        }
    });
    // Then the four lanes L of u[j], u[4 + j], u[8 + j], u[12 + j] make row 4L + j.
    for j in 0..4 {
        let w0 = _mm512_shuffle_i32x4::<0x88>(u[j], u[4 + j]);
        let w1 = _mm512_shuffle_i32x4::<0xDD>(u[j], u[4 + j]);
        let w2 = _mm512_shuffle_i32x4::<0x88>(u[8 + j], u[12 + j]);
        let w3 = _mm512_shuffle_i32x4::<0xDD>(u[8 + j], u[12 + j]);
        let rows = [
            _mm512_shuffle_i32x4::<0x88>(w0, w2),
            _mm512_shuffle_i32x4::<0x88>(w1, w3),
            _mm512_shuffle_i32x4::<0xDD>(w0, w2),
            _mm512_shuffle_i32x4::<0xDD>(w1, w3),
        ];
        for (l, row) in rows.into_iter().enumerate() {
            _mm512_storeu_si512(dst.add((4 * l + j) * dst_stride).cast(), row);
        }
    }
}

/// B (`k×n`, element `(kk, col)` at `kk·rsb + col·csb`) as bf16 (f32 values rounded, held bits
/// as they are) packed as panels of
/// [`NR`] columns, each `[kp_pad][NR]` pairs of consecutive K values (the layout both the
/// `vdpbf16ps` kernel and AMX's B tiles read); pairs past K and columns past `n` are zero.
///
/// # Safety
/// The CPU must have AVX-512 F/BW and AVX512-BF16.
#[cfg(target_arch = "x86_64")]
pub(super) unsafe fn pack_b(
    (k, n): (usize, usize),
    b: Values,
    (rsb, csb): (usize, usize),
    kp_pad: usize,
) -> PackedB {
    let len = n.div_ceil(NR) * kp_pad * NR;
    let mut bp = PACKED_B.with(|kept| std::mem::take(&mut *kept.borrow_mut()));
    if bp.len() >= len {
        bp.truncate(len);
        // Every element is written below unless K or the columns leave padding, which is zero.
        if kp_pad != k.div_ceil(2) || n % NR != 0 {
            bp.fill(0);
        }
    } else {
        bp.fill(0);
        bp.resize(len, 0);
    }
    // A transposed B (the forward's wᵀ): each column's K values are contiguous.
    let by_columns = rsb == 1 && csb != 1;
    bp.par_chunks_mut(kp_pad * NR)
        .enumerate()
        .for_each(|(j, panel)| {
            let col = j * NR;
            let pairs = k.div_ceil(2);
            if by_columns {
                // 16 columns × 16 pairs at a time: each column's 32 K values converted into a row
                // of `block`, then the block transposed into the panel's [pair][column] layout.
                let live = NR.min(n - col);
                let mut block = [0u32; 256];
                for l0 in (0..live).step_by(16) {
                    for p0 in (0..pairs).step_by(16) {
                        let width = 16.min(live - l0);
                        for (l, row) in block.chunks_mut(16).enumerate() {
                            if l < width {
                                let start = (col + l0 + l) * csb + 2 * p0;
                                // SAFETY: the caller's CPU has AVX512-BF16.
                                unsafe { b.pairs_from(start, (k - 2 * p0).min(32), row) };
                            } else {
                                row.fill(0);
                            }
                        }
                        if p0 + 16 <= kp_pad {
                            // SAFETY: as above; the panel holds kp_pad rows of NR pairs.
                            unsafe {
                                transpose16(
                                    block.as_ptr(),
                                    16,
                                    panel.as_mut_ptr().add(p0 * NR + l0),
                                    NR,
                                )
                            };
                        } else {
                            // The last rows of a panel whose pair count is no multiple of 16.
                            for p in p0..kp_pad {
                                for l in 0..16 {
                                    panel[p * NR + l0 + l] = block[l * 16 + p - p0];
                                }
                            }
                        }
                    }
                }
                return;
            }
            // Pairs from k on are K's zero padding.
            for (p, lanes) in panel.chunks_mut(NR).take(pairs).enumerate() {
                // SAFETY: the caller's CPU has AVX-512 F/BW and AVX512-BF16.
                unsafe { pack_pair_row((k, n), b, (rsb, csb), 2 * p, col, lanes) };
            }
        });
    PackedB(bp)
}

/// One row of a panel: the pairs of B's values `(kk, col + l)` and `(kk + 1, col + l)` for the
/// panel's [`NR`] columns `l`, zero past K and past `n` — two contiguous row pieces where B is
/// row-major and the panel is whole, else value by value.
///
/// # Safety
/// The CPU must have AVX-512 F/BW and AVX512-BF16; `lanes` holds NR values.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn pack_pair_row(
    (k, n): (usize, usize),
    b: Values,
    (rsb, csb): (usize, usize),
    kk: usize,
    col: usize,
    lanes: &mut [u32],
) {
    if csb == 1 && col + NR <= n && kk + 1 < k {
        // SAFETY: the caller's CPU has AVX-512 F/BW and AVX512-BF16.
        unsafe { b.pairs_across(kk * rsb + col, (kk + 1) * rsb + col, lanes) };
        return;
    }
    let bits = |kk: usize, col: usize| {
        if kk < k && col < n {
            u32::from(b.bits(kk * rsb + col * csb))
        } else {
            0
        }
    };
    for (l, v) in lanes.iter_mut().enumerate() {
        *v = bits(kk, col + l) | (bits(kk + 1, col + l) << 16);
    }
}

/// Pairs `p0..p0 + steps·16` of a row-major B's columns `c0..c0 + cols` (`k×n`, element
/// `(kk, col)` at `kk·rsb + col`) packed into `out` as [`pack_b`]'s panels, each `steps·16`
/// pairs long (`cols` a multiple of [`NR`]): one block of K of one chunk of columns, as a task of
/// the AMX GEMM packs B just before its tiles read it. Every element of `out`'s panels is
/// written: zero past K and past `n`.
///
/// A pair of rows at a time, across every panel (the chunk is in L2, so writes across it are
/// cheap), with the rows [`PREFETCH_PAIRS`] pairs on prefetched: each row is read for 1–2 KB
/// only, too short a run for the hardware's prefetchers, and a held weight comes from memory.
///
/// # Safety
/// The CPU must have AVX-512 F/BW and AVX512-BF16; `out` holds `cols · steps · 16` values.
#[cfg(target_arch = "x86_64")]
pub(super) unsafe fn pack_b_chunk(
    (k, n): (usize, usize),
    b: Values,
    rsb: usize,
    (p0, steps): (usize, usize),
    (c0, cols): (usize, usize),
    out: &mut [u32],
) {
    let rows = steps * 16;
    assert!(cols % NR == 0 && out.len() >= cols * rows);
    let (base, bytes) = match b {
        Values::F32(v) => (v.as_ptr().cast::<u8>(), 4),
        Values::Bf16(v) => (v.as_ptr().cast::<u8>(), 2),
    };
    // Bytes of a row this chunk reads.
    let live = n.saturating_sub(c0).min(cols) * bytes;
    for p in 0..rows {
        let kk = 2 * (p0 + p);
        // The two rows PREFETCH_PAIRS pairs on, this chunk's columns, a line at a time.
        let ahead = kk + 2 * PREFETCH_PAIRS;
        for r in [ahead, ahead + 1].into_iter().filter(|&r| r < k) {
            let row = base.wrapping_add((r * rsb + c0) * bytes);
            for off in (0..live).step_by(64) {
                // SAFETY: a prefetch of an address inside B's row r; it never faults.
                unsafe {
                    std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                        row.wrapping_add(off).cast(),
                    )
                };
            }
        }
        for (j, panel) in out.chunks_mut(rows * NR).take(cols / NR).enumerate() {
            // SAFETY: the caller's CPU has AVX-512 F/BW and AVX512-BF16.
            unsafe {
                pack_pair_row(
                    (k, n),
                    b,
                    (rsb, 1),
                    kk,
                    c0 + j * NR,
                    &mut panel[p * NR..][..NR],
                )
            };
        }
    }
}

/// How many pairs of rows ahead [`pack_b_chunk`] prefetches: 8 rows of 1–2 KB, about what
/// memory's latency covers while a pair is packed.
const PREFETCH_PAIRS: usize = 4;

thread_local! {
    /// The buffer of this thread's last packed B, for its next: a fresh one costs a page fault per
    /// 4 KB, and a held base's input gradient packs a 16 MB piece of weight per product
    /// (deepseek-1.3B's layers), thousands a step.
    static PACKED_B: std::cell::RefCell<Vec<u32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// B packed by [`pack_b`]; its buffer goes back to the thread's [`PACKED_B`] when dropped.
pub(super) struct PackedB(Vec<u32>);

impl std::ops::Deref for PackedB {
    type Target = [u32];
    fn deref(&self) -> &[u32] {
        &self.0
    }
}

impl Drop for PackedB {
    fn drop(&mut self) {
        let buf = std::mem::take(&mut self.0);
        // Kept if larger than what the thread keeps (a nested pack on the same thread).
        let _ = PACKED_B.try_with(|kept| {
            let mut kept = kept.borrow_mut();
            if buf.capacity() > kept.capacity() {
                *kept = buf;
            }
        });
    }
}

/// C[m×n] (row stride `n`) = A·B + β·C (β 0 or 1) with A and B rounded to bf16 and f32
/// accumulation, on [`Bf16Kernel::best`]. Operands are given by (row, column) element strides, as
/// for the f32 GEMM; `f32_gemm` multiplies row-major rounded copies where the CPU has no bf16
/// instructions.
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
    let kernel = Bf16Kernel::best();
    gemm_bf16_with(kernel, mkn, a, a_strides, b, b_strides, beta, c, f32_gemm)
}

/// [`gemm_bf16`] on the given kernel, one of [`Bf16Kernel::available`].
#[allow(clippy::too_many_arguments)]
pub fn gemm_bf16_with(
    kernel: Bf16Kernel,
    mkn: (usize, usize, usize),
    a: &[f32],
    a_strides: (usize, usize),
    b: &[f32],
    b_strides: (usize, usize),
    beta: f32,
    c: &mut [f32],
    f32_gemm: impl Fn(usize, usize, usize, &[f32], &[f32], f32, &mut [f32]),
) {
    let b = Values::F32(b);
    gemm_values(kernel, mkn, a, a_strides, b, b_strides, beta, c, f32_gemm)
}

/// [`gemm_bf16_with`] for a B given as bf16 bits (a weight held in bf16), read as they are: the
/// same packed panels, so the same products and sums, as for B's values widened to f32.
#[allow(clippy::too_many_arguments)]
pub fn gemm_bf16_held_b(
    kernel: Bf16Kernel,
    mkn: (usize, usize, usize),
    a: &[f32],
    a_strides: (usize, usize),
    b: &[u16],
    b_strides: (usize, usize),
    beta: f32,
    c: &mut [f32],
    f32_gemm: impl Fn(usize, usize, usize, &[f32], &[f32], f32, &mut [f32]),
) {
    let b = Values::Bf16(b);
    gemm_values(kernel, mkn, a, a_strides, b, b_strides, beta, c, f32_gemm)
}

#[allow(clippy::too_many_arguments)]
fn gemm_values(
    kernel: Bf16Kernel,
    (m, k, n): (usize, usize, usize),
    a: &[f32],
    (rsa, csa): (usize, usize),
    b: Values,
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
            .map(|i| f32::from_bits(u32::from(b.bits((i / n) * rsb + (i % n) * csb)) << 16))
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
            unsafe { super::amx::gemm((m, k, n), a, (rsa, csa), b, (rsb, csb), beta, c) };
            return;
        }
        let kp = k.div_ceil(2);
        let at = |row: usize, kk: usize| if kk < k { a[row * rsa + kk * csa] } else { 0.0 };
        let zeros = [0f32; NR];
        // B packed once, shared by every task: panel j holds columns j·NR.. as [kp][NR] pairs.
        // SAFETY: the dot-product kernel runs only where AVX-512 is (asserted above).
        let bp = unsafe { pack_b((k, n), b, (rsb, csb), kp) };
        let panels = n.div_ceil(NR);
        let parts = rayon::current_num_threads().max(1);
        let rows = m.div_ceil(parts).div_ceil(MR) * MR;
        c[..m * n]
            .par_chunks_mut(rows * n)
            .enumerate()
            .for_each(|(i, cpart)| {
                let r0 = i * rows;
                let mrows = cpart.len() / n;
                let mut ap = vec![0u32; KCP * MR];
                let mut row_pairs = [0u32; KCP];
                // K in blocks of KCP pairs, so the A block stays in L1 and the B block (all panels,
                // KCP pairs each) in L2 while every row block of this task streams past it.
                for kb in (0..kp).step_by(KCP) {
                    let kc = KCP.min(kp - kb);
                    let beta = if kb == 0 { beta } else { 1.0 };
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
                        for j in 0..panels {
                            let cols = NR.min(n - j * NR);
                            // SAFETY: the CPU has AVX512-BF16 (checked by the caller); `ap` holds
                            // kc·MR values and panel j from pair kb holds kc·NR; the tile written
                            // is rows rb..rb+live, columns j·NR..j·NR+cols of this task's part of C.
                            unsafe {
                                dot_tile(
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
unsafe fn dot_tile(
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
            eprintln!("no avx512_bf16 on this CPU (or KILN_CPU_ISA caps it): vdpbf16ps not tested");
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
                        gemm_bf16_with(
                            kernel, mkn, a_op, a_strides, b_op, b_strides, beta, &mut c, naive_f32,
                        );
                        // B held as bf16 bits (a frozen base) packs to the same pairs: the same
                        // products and sums, bit for bit.
                        let bits: Vec<u16> = b_op.iter().map(|&v| bf16_bits(v)).collect();
                        let mut held = init.clone();
                        gemm_bf16_held_b(
                            kernel, mkn, a_op, a_strides, &bits, b_strides, beta, &mut held,
                            naive_f32,
                        );
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

    /// The 16×16 transpose of 32-bit values that packs transposed operands, against the
    /// definition, between rows of different strides.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn transpose16_transposes() {
        if !std::arch::is_x86_feature_detected!("avx512f") {
            eprintln!("no avx512f on this CPU: transpose16 not tested");
            return;
        }
        let src: Vec<u32> = (0..16 * 21u32)
            .map(|i| i.wrapping_mul(2_654_435_761))
            .collect();
        let mut dst = vec![7u32; 16 * 37];
        // SAFETY: AVX-512 F is present; 16 rows of 21 and of 37 values hold each block.
        unsafe { transpose16(src.as_ptr().add(3), 21, dst.as_mut_ptr().add(5), 37) };
        for r in 0..16 {
            for c in 0..37 {
                let want = if (5..21).contains(&c) {
                    src[(c - 5) * 21 + 3 + r]
                } else {
                    7
                };
                assert_eq!(dst[r * 37 + c], want, "row {r} column {c}");
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
            gemm_bf16_with(
                kernel,
                (m, k, n),
                &a,
                (k, 1),
                &b,
                (n, 1),
                0.0,
                &mut c,
                naive_f32,
            );
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
