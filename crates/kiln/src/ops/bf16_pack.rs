//! bf16 operands laid out for the bf16 kernels: rounding f32 to bf16 (as PyTorch's casts), pairs of
//! consecutive K values in one 32-bit lane (what `vdpbf16ps` and AMX's tile products multiply), and B
//! packed into panels of [`NR`] columns. Both [`super::bf16`]'s dot-product kernel and [`super::amx`]
//! read these layouts, so they live apart from either.

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

/// The f32 value of bf16 `bits` (exact: they become its high half).
#[inline(always)]
pub fn widen_bf16_bits(bits: u16) -> f32 {
    f32::from_bits(u32::from(bits) << 16)
}

/// `x` rounded to the nearest bf16 value, as an f32.
#[inline(always)]
pub fn round_bf16(x: f32) -> f32 {
    widen_bf16_bits(bf16_bits(x))
}

/// Columns of C per micro-kernel call (and per packed panel of B): two 16-lane vectors.
pub(super) const NR: usize = 32;

/// The two bf16 values `(lo, hi)` in one 32-bit lane, `lo` in the low half (what `vdpbf16ps` pairs).
#[inline(always)]
pub(super) fn pair(lo: f32, hi: f32) -> u32 {
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
    pub(super) fn len(&self) -> usize {
        match self {
            Self::F32(v) => v.len(),
            Self::Bf16(b) => b.len(),
        }
    }

    /// Element `i` as bf16 bits (rounded from f32 as [`bf16_bits`]).
    #[inline(always)]
    pub(super) fn bits(&self, i: usize) -> u16 {
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
    bp.par_chunks_mut(kp_pad * NR)
        .enumerate()
        // SAFETY: the caller's CPU has AVX-512 F/BW and AVX512-BF16; each panel holds kp_pad
        // rows of NR pairs.
        .for_each(|(j, panel)| unsafe { pack_panel((k, n), b, (rsb, csb), j, 0..kp_pad, panel) });
    PackedB(bp)
}

/// Pairs `pairs` of B's panel `j` (columns `j·NR..`) into `out`, `pairs.len()` rows of [`NR`], as
/// [`pack_b`] lays out a panel. Pairs past K and columns past `n` are left as they are: `out`
/// starts zeroed wherever B has such padding.
///
/// # Safety
/// The CPU must have AVX-512 F/BW and AVX512-BF16; `j·NR < n`; `pairs.start` is a multiple of 16;
/// `out` holds `pairs.len() · NR` values.
#[cfg(target_arch = "x86_64")]
pub(super) unsafe fn pack_panel(
    (k, n): (usize, usize),
    b: Values,
    (rsb, csb): (usize, usize),
    j: usize,
    pairs: std::ops::Range<usize>,
    out: &mut [u32],
) {
    let col = j * NR;
    let in_k = pairs.start..pairs.end.min(k.div_ceil(2));
    // A transposed B (the forward's wᵀ): each column's K values are contiguous.
    if rsb == 1 && csb != 1 {
        // 16 columns × 16 pairs at a time: each column's 32 K values converted into a row of
        // `block`, then the block transposed into the panel's [pair][column] layout.
        let live = NR.min(n - col);
        let mut block = [0u32; 256];
        for l0 in (0..live).step_by(16) {
            for p0 in in_k.clone().step_by(16) {
                let width = 16.min(live - l0);
                let at = (p0 - pairs.start) * NR + l0;
                if let Values::Bf16(w) = b {
                    if csb % 2 == 0 && width == 16 && 2 * (p0 + 16) <= k && p0 + 16 <= pairs.end {
                        // Held bf16 bits with whole pairs in place: 16 columns' 16 pairs are a
                        // 16×16 block of 32-bit values in W itself, transposed straight into the
                        // panel. Through `block` it cost a 64-byte copy per column (a libc call),
                        // 14 % of a held 1.3B model's step.
                        // SAFETY: as above; columns col + l0.. + 16 ≤ n and K values 2·p0.. + 32
                        // ≤ k lie inside W, whose rows are csb (even) values apart.
                        unsafe {
                            let src = w.as_ptr().add((col + l0) * csb + 2 * p0).cast::<u32>();
                            transpose16(src, csb / 2, out.as_mut_ptr().add(at), NR);
                        }
                        continue;
                    }
                }
                for (l, row) in block.chunks_mut(16).enumerate() {
                    if l < width {
                        let start = (col + l0 + l) * csb + 2 * p0;
                        // SAFETY: the caller's CPU has AVX512-BF16.
                        unsafe { b.pairs_from(start, (k - 2 * p0).min(32), row) };
                    } else {
                        row.fill(0);
                    }
                }
                if p0 + 16 <= pairs.end {
                    // SAFETY: as above; rows p0..p0 + 16 lie inside `out`.
                    unsafe { transpose16(block.as_ptr(), 16, out.as_mut_ptr().add(at), NR) };
                } else {
                    // The last rows of a range whose pair count is no multiple of 16.
                    for p in p0..pairs.end {
                        for l in 0..16 {
                            out[(p - pairs.start) * NR + l0 + l] = block[l * 16 + p - p0];
                        }
                    }
                }
            }
        }
        return;
    }
    for (p, lanes) in out.chunks_mut(NR).take(in_k.len()).enumerate() {
        // SAFETY: the caller's CPU has AVX-512 F/BW and AVX512-BF16.
        unsafe { pack_pair_row((k, n), b, (rsb, csb), 2 * (in_k.start + p), col, lanes) };
    }
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
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
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
                // A prefetch of an address inside B's row r; it never faults.
                std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                    row.wrapping_add(off).cast(),
                );
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
