//! The attention core on the CPU: forward on kiln's register tiles (or `gemm` per head), backward
//! on `gemm`, dropout regenerated from a seed.

use rayon::prelude::*;

use super::{
    exp_row, has_avx512, scale_by, simd, small_gemm, softmax_backward_row, uniform, SharedMut,
};
use crate::ops::Window;

/// One multi-head attention call on the CPU: `[B, T, H]` activations whose q, k and v rows lie `rs`
/// floats apart — `H` when they are three tensors, `3H` when one Linear made them side by side.
pub(super) struct Attn {
    b: usize,
    t: usize,
    h: usize,
    heads: usize,
    /// Row stride of q, k and v.
    rs: usize,
    window: Window,
    scale: f32,
    keep: f32,
    seed: u64,
}

impl Attn {
    #[allow(clippy::too_many_arguments)]
    pub(super) fn new(
        (b, t, h): (usize, usize, usize),
        rs: usize,
        heads: usize,
        window: Window,
        scale: f64,
        dropout: f64,
        seed: u64,
    ) -> Self {
        let (scale, keep) = (scale as f32, (1.0 - dropout) as f32);
        Self {
            b,
            t,
            h,
            heads,
            rs,
            window,
            scale,
            keep,
            seed,
        }
    }

    /// The additive key mask of head `bh`'s batch row.
    fn key_mask<'a>(&self, mask: &'a [f32], bh: usize) -> &'a [f32] {
        let bi = bh / self.heads;
        &mask[bi * self.t..(bi + 1) * self.t]
    }

    /// In place: row `i` of a head's scores becomes its probabilities (`row` holds at least the
    /// keys query `i` sees). Keys outside the window get probability 0, and so no gradient: the
    /// backward needs no mask of its own.
    fn softmax(&self, row: &mut [f32], i: usize, m: &[f32]) {
        let inv = 1.0 / self.softmax_unnormalised(row, i, m);
        scale_by(&mut row[self.window.keys(i, self.t)], inv);
    }

    /// [`Self::softmax`] without the division by the sum, which it returns: e^{s − max} for the
    /// keys query `i` sees, 0 for the others.
    fn softmax_unnormalised(&self, row: &mut [f32], i: usize, m: &[f32]) -> f32 {
        let seen = self.window.keys(i, self.t);
        let sum = exp_row(&mut row[seen.clone()], &m[seen.clone()], self.scale);
        row[..seen.start].fill(0.0);
        row[seen.end..].fill(0.0);
        sum
    }

    /// Keys `0..end` hold every key a query of `rows` sees (the tiles compute scores from 0).
    fn keys_end(&self, rows: std::ops::Range<usize>) -> usize {
        self.window.keys(rows.end - 1, self.t).end
    }

    /// `(row 0, column 0)` of head `bh`'s block in q/k/v (row stride `rs`) and in `[B, T, H]`.
    fn offsets(&self, bh: usize) -> (usize, usize) {
        let (bi, hi) = (bh / self.heads, bh % self.heads);
        let d = self.h / self.heads;
        (
            bi * self.t * self.rs + hi * d,
            bi * self.t * self.h + hi * d,
        )
    }

    /// `(out [B, T, H], probs [B, heads, T, T])` for `[q, k, v]`, each slice starting at its
    /// tensor's (row 0, column 0); the probabilities only `with_probs` (a backward will need them).
    ///
    /// Head dimensions that are multiples of [`NR`] (32, 64, 128: BERT, MiniLM, Llama) run on
    /// kiln's own register tiles, a block of query rows at a time, so a block's scores stay in L1
    /// between the two products and a block skips the keys after its window (causal: after its
    /// last row). Others call `gemm`
    /// twice per head.
    pub(super) fn forward(
        &self,
        qkv: [&[f32]; 3],
        mask: &[f32],
        with_probs: bool,
    ) -> (Vec<f32>, Option<Vec<f32>>) {
        let d = self.h / self.heads;
        let tiles = Tiles::detect().filter(|_| d.is_multiple_of(NR));
        self.forward_on(tiles, qkv, mask, with_probs)
    }

    /// [`Self::forward`] on the given tiles (`None`: `gemm` per head), so tests can run each kind
    /// the CPU has.
    fn forward_on(
        &self,
        tiles: Option<Tiles>,
        qkv: [&[f32]; 3],
        mask: &[f32],
        with_probs: bool,
    ) -> (Vec<f32>, Option<Vec<f32>>) {
        let Self {
            b,
            t,
            h,
            heads,
            rs,
            keep,
            ..
        } = *self;
        let d = h / heads;
        assert!(tiles.is_none() || d.is_multiple_of(NR));
        assert!(qkv.iter().all(|x| x.len() >= (b * t - 1) * rs + h));
        assert!(mask.len() >= b * t);
        let mut out = vec![0f32; b * t * h];
        let mut probs = with_probs.then(|| vec![0f32; b * heads * t * t]);
        let out_ptr = SharedMut(out.as_mut_ptr());
        let probs_ptr = probs.as_mut().map(|p| SharedMut(p.as_mut_ptr()));
        // Tasks are (head, block of query rows): whole heads when there are enough of them to
        // share out, else 32-row blocks (SmolLM2's prefill has 9 heads for 2 threads).
        let rows_per_task = if tiles.is_none() || b * heads >= 8 * rayon::current_num_threads() {
            t
        } else {
            32
        };
        let blocks = t.div_ceil(rows_per_task);
        let tp = t.div_ceil(NR) * NR;
        (0..b * heads * blocks).into_par_iter().for_each_init(
            // Scores of one tile of rows, Kᵀ and V packed for the tiles; for `gemm`, one head's
            // probabilities and, under dropout, their dropped copy.
            || match tiles {
                Some(tiles) => (
                    vec![0f32; tiles.rows() * tp],
                    vec![0f32; d * tp],
                    vec![0f32; t * d],
                ),
                None => (
                    vec![0f32; t * t],
                    vec![0f32; if keep < 1.0 { t * t } else { 0 }],
                    vec![],
                ),
            },
            |(scratch, kt, vp), task| {
                let (bh, blk) = (task / blocks, task % blocks);
                let rows = blk * rows_per_task..((blk + 1) * rows_per_task).min(t);
                // SAFETY: rows `rows` of head `bh`'s probabilities belong to this task alone.
                let p = probs_ptr.map(|pp| unsafe {
                    std::slice::from_raw_parts_mut(pp.at((bh * t + rows.start) * t), rows.len() * t)
                });
                if let Some(tiles) = tiles {
                    let scratch = (&mut scratch[..], &mut kt[..], &mut vp[..]);
                    self.head_tiled(tiles, bh, rows, qkv, mask, out_ptr, p, scratch);
                } else {
                    let scratch = (&mut scratch[..], &mut kt[..]);
                    self.head_gemm(bh, qkv, mask, out_ptr, p, scratch);
                }
            },
        );
        (out, probs)
    }

    /// Query rows `rows` of head `bh` on kiln's register tiles: Kᵀ and V packed once (the keys
    /// these rows see), then per tile of rows the scores, their softmax (stored to `probs` if given:
    /// these rows' probabilities, T per row; and dropped out), and those rows' output, written to
    /// `out`. Without `probs` or dropout (inference) the probabilities stay unnormalised and each
    /// output row is divided by its sum instead: d divisions per row rather than T.
    #[allow(clippy::too_many_arguments)]
    fn head_tiled(
        &self,
        tiles: Tiles,
        bh: usize,
        rows: std::ops::Range<usize>,
        [qs, ks, vs]: [&[f32]; 3],
        mask: &[f32],
        out: SharedMut,
        mut probs: Option<&mut [f32]>,
        (s, kt, vp): (&mut [f32], &mut [f32], &mut [f32]),
    ) {
        let Self {
            t,
            h,
            heads,
            rs,
            keep,
            seed,
            ..
        } = *self;
        let d = h / heads;
        let tp = t.div_ceil(NR) * NR;
        let (off, out_off) = self.offsets(bh);
        let m = self.key_mask(mask, bh);
        let keys = self.keys_end(rows.clone());
        // Kᵀ as d rows of `tp` keys (the padding stays 0 from the allocation), and V as `keys`
        // rows of d: read a head's block in place, V's rows lie 3H floats apart, a stride that
        // folds them onto a few L1 sets, and every tile of rows reads all of them again.
        pack_transposed(&ks[off..], rs, (keys, d), kt, tp);
        simd(
            #[inline(always)]
            || {
                // An element loop, not `copy_from_slice`: a `memcpy` call per 128-byte row cost
                // more than the copy.
                for (j, row) in vp[..keys * d].chunks_exact_mut(d).enumerate() {
                    let src = &vs[off + j * rs..off + j * rs + d];
                    row.iter_mut().zip(src).for_each(|(o, &v)| *o = v);
                }
            },
        );
        let mr = tiles.rows();
        let normalise_later = probs.is_none() && keep >= 1.0;
        let mut sums = [0f32; MAX_TILE_ROWS];
        // The tiles below write through raw pointers: these bound every address they form.
        assert!(s.len() >= mr * tp && kt.len() >= d * tp && vp.len() >= keys * d && rows.end <= t);
        for i0 in rows.clone().step_by(mr) {
            let n = mr.min(rows.end - i0);
            let kend = self.keys_end(i0..i0 + n);
            // SAFETY: q rows i0..i0+n and the head's d columns are inside `qs` (asserted in
            // `forward`); Kᵀ holds d rows of `tp` ≥ kend.div_ceil(NR)·NR columns; `s` holds
            // mr rows of `tp`.
            unsafe {
                for jb in (0..kend).step_by(NR) {
                    tiles.run(
                        d,
                        (qs.as_ptr().add(off + i0 * rs), rs, n),
                        (kt.as_ptr().add(jb), tp),
                        (s.as_mut_ptr().add(jb), tp),
                    );
                }
            }
            for r in 0..n {
                let i = i0 + r;
                let row = &mut s[r * tp..r * tp + kend];
                if normalise_later {
                    sums[r] = self.softmax_unnormalised(row, i, m);
                    continue;
                }
                self.softmax(row, i, m);
                if let Some(p) = probs.as_deref_mut() {
                    let pr = &mut p[(i - rows.start) * t..(i - rows.start + 1) * t];
                    pr[..kend].copy_from_slice(row);
                    pr[kend..].fill(0.0);
                }
                if keep < 1.0 {
                    dropout_row(row, ((bh * t + i) * t) as u64, keep, seed);
                }
            }
            // SAFETY: P rows live in `s` (stride tp, kend ≤ tp columns); V's kend ≤ keys rows lie
            // packed in `vp`; output rows i0..i0+n, columns of head `hi`, are this task's.
            unsafe {
                for cb in (0..d).step_by(NR) {
                    tiles.run(
                        kend,
                        (s.as_ptr(), tp, n),
                        (vp.as_ptr().add(cb), d),
                        (out.at(out_off + i0 * h + cb), h),
                    );
                }
                if normalise_later {
                    for (r, &sum) in sums[..n].iter().enumerate() {
                        let o = std::slice::from_raw_parts_mut(out.at(out_off + (i0 + r) * h), d);
                        scale_by(o, 1.0 / sum);
                    }
                }
            }
        }
    }

    /// All of head `bh` through two `gemm` calls (head dimensions the tiles do not cover).
    fn head_gemm(
        &self,
        bh: usize,
        [qs, ks, vs]: [&[f32]; 3],
        mask: &[f32],
        out: SharedMut,
        probs: Option<&mut [f32]>,
        (scratch, dropped): (&mut [f32], &mut [f32]),
    ) {
        let Self {
            t,
            h,
            heads,
            rs,
            keep,
            seed,
            ..
        } = *self;
        let d = h / heads;
        let (off, out_off) = self.offsets(bh);
        let m = self.key_mask(mask, bh);
        let p = match probs {
            Some(p) => p,
            None => &mut scratch[..t * t],
        };
        // SAFETY: q/k/v reads stay inside this head's rows and columns (asserted in `forward`);
        // the output block (rows of batch `bi`, columns of head `hi`) belongs to this task alone.
        unsafe {
            small_gemm(
                (t, t, d),
                p.as_mut_ptr(),
                (t, 1),
                qs[off..].as_ptr(),
                (rs, 1),
                ks[off..].as_ptr(),
                (1, rs),
                false,
            );
        }
        for (i, row) in p.chunks_mut(t).enumerate() {
            self.softmax(row, i, m);
        }
        let pd: &[f32] = if keep < 1.0 {
            let dropped = &mut dropped[..t * t];
            dropped.copy_from_slice(p);
            dropout_block(dropped, bh, t, keep, seed);
            dropped
        } else {
            p
        };
        unsafe {
            small_gemm(
                (t, d, t),
                out.at(out_off),
                (h, 1),
                pd.as_ptr(),
                (t, 1),
                vs[off..].as_ptr(),
                (rs, 1),
                false,
            );
        }
    }

    /// Writes dq, dk and dv through `grads` (each at its (row 0, column 0); row stride `gs`) for
    /// the output gradient `dout [B, T, H]` and the forward's `probs`.
    pub(super) fn backward(
        &self,
        [qs, ks, vs]: [&[f32]; 3],
        probs: &[f32],
        dout: &[f32],
        [dq, dk, dv]: [SharedMut; 3],
        gs: usize,
    ) {
        let Self {
            b,
            t,
            h,
            heads,
            rs,
            scale,
            keep,
            seed,
            ..
        } = *self;
        let d = h / heads;
        assert!(qs.len().min(ks.len()).min(vs.len()) >= (b * t - 1) * rs + h);
        assert!(probs.len() >= b * heads * t * t && dout.len() >= b * t * h);
        (0..b * heads).into_par_iter().for_each_init(
            || (vec![0f32; t * t], vec![0f32; t * t]),
            |(pd, dp), bh| {
                let (off, out_off) = self.offsets(bh);
                let g_off = (bh / heads) * t * gs + (bh % heads) * d;
                let p = &probs[bh * t * t..(bh + 1) * t * t];
                // The dropped probabilities, regenerated from the seed.
                pd.copy_from_slice(p);
                dropout_block(pd, bh, t, keep, seed);
                // SAFETY: as in the forward: this task reads and writes only head `hi` of batch
                // `bi`; the callers' gradient buffers hold B·T rows of stride `gs`.
                unsafe {
                    // dV = P_dropᵀ · dO
                    small_gemm(
                        (t, d, t),
                        dv.at(g_off),
                        (gs, 1),
                        pd.as_ptr(),
                        (1, t),
                        dout[out_off..].as_ptr(),
                        (h, 1),
                        false,
                    );
                    // dP_drop = dO · Vᵀ
                    small_gemm(
                        (t, t, d),
                        dp.as_mut_ptr(),
                        (t, 1),
                        dout[out_off..].as_ptr(),
                        (h, 1),
                        vs[off..].as_ptr(),
                        (1, rs),
                        false,
                    );
                }
                dropout_block(dp, bh, t, keep, seed);
                for (dr, pr) in dp.chunks_mut(t).zip(p.chunks(t)) {
                    softmax_backward_row(dr, pr, scale);
                }
                unsafe {
                    // dQ = dS · K,  dK = dSᵀ · Q
                    small_gemm(
                        (t, d, t),
                        dq.at(g_off),
                        (gs, 1),
                        dp.as_ptr(),
                        (t, 1),
                        ks[off..].as_ptr(),
                        (rs, 1),
                        false,
                    );
                    small_gemm(
                        (t, d, t),
                        dk.at(g_off),
                        (gs, 1),
                        dp.as_ptr(),
                        (1, t),
                        qs[off..].as_ptr(),
                        (rs, 1),
                        false,
                    );
                }
            },
        );
    }
}

/// Scales a row of attention probabilities by the dropout mask of element indices `base..`.
#[inline]
fn dropout_row(row: &mut [f32], base: u64, keep: f32, seed: u64) {
    let value = 1.0 / keep;
    simd(
        #[inline(always)]
        || {
            for (j, v) in row.iter_mut().enumerate() {
                *v *= if uniform(seed, base + j as u64) < keep {
                    value
                } else {
                    0.0
                };
            }
        },
    )
}

/// Applies the dropout mask of attention block `bh` (`t` rows of `t` probabilities) in place; the
/// forward and both backward uses index the hash identically, so they agree on the mask.
fn dropout_block(block: &mut [f32], bh: usize, t: usize, keep: f32, seed: u64) {
    if keep >= 1.0 {
        return;
    }
    for (i, row) in block.chunks_mut(t).enumerate() {
        dropout_row(row, ((bh * t + i) * t) as u64, keep, seed);
    }
}

/// Columns of a register tile: two AVX-512 registers, four AVX2 ones.
const NR: usize = 32;

/// The most query rows a register tile holds ([`Tiles::rows`]).
const MAX_TILE_ROWS: usize = 8;

/// `dst[c·drs + j] = src[j·srs + c]` for `j < rows`, `c < cols`: `rows` rows of `cols` floats
/// (lying `srs` apart) written as `cols` rows of `rows` (lying `drs` apart), Kᵀ for the tiles.
/// 8 × 8 blocks go through AVX2 registers; a scalar copy, a strided store per element, took a
/// sixth of MiniLM's attention.
fn pack_transposed(
    src: &[f32],
    srs: usize,
    (rows, cols): (usize, usize),
    dst: &mut [f32],
    drs: usize,
) {
    assert!(rows == 0 || src.len() >= (rows - 1) * srs + cols);
    assert!(cols == 0 || dst.len() >= (cols - 1) * drs + rows);
    let (mut r8, mut c8) = (0, 0);
    #[cfg(target_arch = "x86_64")]
    if crate::ops::isa::cpu_isa().level >= crate::ops::isa::IsaLevel::Avx2 {
        (r8, c8) = (rows / 8 * 8, cols / 8 * 8);
        for j in (0..r8).step_by(8) {
            for c in (0..c8).step_by(8) {
                // SAFETY: rows j..j+8 ≤ rows and columns c..c+8 ≤ cols of both sides are inside
                // the slices (asserted above); the CPU has AVX2 (checked above).
                unsafe {
                    x86::transpose8(
                        src.as_ptr().add(j * srs + c),
                        srs,
                        dst.as_mut_ptr().add(c * drs + j),
                        drs,
                    )
                };
            }
        }
    }
    // What the blocks left: the last columns of every row, then the last rows.
    for j in 0..rows {
        let from = if j < r8 { c8 } else { 0 };
        for c in from..cols {
            dst[c * drs + j] = src[j * srs + c];
        }
    }
}

/// Which register tile this CPU runs, if any: 8 rows × 32 columns in 16 AVX-512 accumulators, or
/// 6 rows × 16 columns (twice) in 12 AVX2 ones. Without either, heads go through `gemm`.
#[derive(Clone, Copy, PartialEq, Debug)]
enum Tiles {
    Avx512,
    Avx2,
}

impl Tiles {
    fn detect() -> Option<Self> {
        #[cfg(target_arch = "x86_64")]
        {
            if has_avx512() {
                return Some(Self::Avx512);
            }
            if crate::ops::isa::cpu_isa().level >= crate::ops::isa::IsaLevel::Avx2 {
                return Some(Self::Avx2);
            }
        }
        None
    }

    /// Query rows per tile.
    fn rows(self) -> usize {
        match self {
            Self::Avx512 => 8,
            // Six rows keep 12 of the 16 AVX2 registers summing: with four (8 accumulators), two
            // FMA units with a 4-cycle latency had no slack (Zen 3/4).
            Self::Avx2 => 6,
        }
    }

    /// `C[r][0..NR] = Σ_p A[r][p] · B[p][0..NR]` for rows `r < n ≤ self.rows()`: A given by
    /// (pointer, row stride, rows n; its elements contiguous), B by (pointer, row stride; NR
    /// contiguous columns), C by (pointer, row stride). The sums stay in registers through all `kk`
    /// steps; rows past `n` repeat A's last row and are not stored.
    ///
    /// # Safety
    /// A's rows `0..n` × columns `0..kk`, B's rows `0..kk` × columns `0..NR` and C's rows `0..n` ×
    /// columns `0..NR` lie inside their buffers; nothing else writes those elements of C meanwhile;
    /// `self` came from [`Tiles::detect`] on this CPU.
    #[inline]
    unsafe fn run(
        self,
        kk: usize,
        a: (*const f32, usize, usize),
        b: (*const f32, usize),
        c: (*mut f32, usize),
    ) {
        #[cfg(target_arch = "x86_64")]
        unsafe {
            match self {
                Self::Avx512 => x86::tile_avx512(kk, a, b, c),
                Self::Avx2 => x86::tile_avx2(kk, a, b, c),
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        unreachable!("no register tiles off x86-64 ({self:?}, {kk}, {a:?}, {b:?}, {c:?})")
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// [`super::Tiles::run`] on AVX-512: 8 rows × 2 registers.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn tile_avx512(
        kk: usize,
        (a, ars, n): (*const f32, usize, usize),
        (b, brs): (*const f32, usize),
        (c, crs): (*mut f32, usize),
    ) {
        const R: usize = 8;
        unsafe {
            let rows: [*const f32; R] = std::array::from_fn(|r| a.add(r.min(n - 1) * ars));
            let mut acc = [[_mm512_setzero_ps(); 2]; R];
            for p in 0..kk {
                let bp = b.add(p * brs);
                let (b0, b1) = (_mm512_loadu_ps(bp), _mm512_loadu_ps(bp.add(16)));
                for r in 0..R {
                    let av = _mm512_set1_ps(*rows[r].add(p));
                    acc[r][0] = _mm512_fmadd_ps(av, b0, acc[r][0]);
                    acc[r][1] = _mm512_fmadd_ps(av, b1, acc[r][1]);
                }
            }
            // A test per row rather than `take(n)`: the loop unrolls, the accumulators stay in
            // registers.
            for (r, [a0, a1]) in acc.into_iter().enumerate() {
                if r < n {
                    _mm512_storeu_ps(c.add(r * crs), a0);
                    _mm512_storeu_ps(c.add(r * crs + 16), a1);
                }
            }
        }
    }

    /// [`super::pack_transposed`]'s 8 × 8 block: `dst[c·drs + r] = src[r·srs + c]`.
    ///
    /// # Safety
    /// The 8 rows of 8 floats at `src` (`srs` apart) and at `dst` (`drs` apart) lie inside their
    /// buffers; the CPU has AVX2.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn transpose8(src: *const f32, srs: usize, dst: *mut f32, drs: usize) {
        unsafe {
            let r: [__m256; 8] = std::array::from_fn(|i| _mm256_loadu_ps(src.add(i * srs)));
            // Pairs of rows interleaved, then pairs of pairs: each 128-bit half then holds four
            // rows of one column (columns c and c + 4 share a register).
            let lo = |a, b| _mm256_unpacklo_ps(a, b);
            let hi = |a, b| _mm256_unpackhi_ps(a, b);
            let t = [
                lo(r[0], r[1]),
                hi(r[0], r[1]),
                lo(r[2], r[3]),
                hi(r[2], r[3]),
                lo(r[4], r[5]),
                hi(r[4], r[5]),
                lo(r[6], r[7]),
                hi(r[6], r[7]),
            ];
            let q = [
                _mm256_shuffle_ps::<0x44>(t[0], t[2]),
                _mm256_shuffle_ps::<0xEE>(t[0], t[2]),
                _mm256_shuffle_ps::<0x44>(t[1], t[3]),
                _mm256_shuffle_ps::<0xEE>(t[1], t[3]),
                _mm256_shuffle_ps::<0x44>(t[4], t[6]),
                _mm256_shuffle_ps::<0xEE>(t[4], t[6]),
                _mm256_shuffle_ps::<0x44>(t[5], t[7]),
                _mm256_shuffle_ps::<0xEE>(t[5], t[7]),
            ];
            for c in 0..4 {
                _mm256_storeu_ps(
                    dst.add(c * drs),
                    _mm256_permute2f128_ps::<0x20>(q[c], q[c + 4]),
                );
                _mm256_storeu_ps(
                    dst.add((c + 4) * drs),
                    _mm256_permute2f128_ps::<0x31>(q[c], q[c + 4]),
                );
            }
        }
    }

    /// [`super::Tiles::run`] on AVX2: 6 rows × 2 registers, for each half of the 32 columns.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn tile_avx2(
        kk: usize,
        (a, ars, n): (*const f32, usize, usize),
        (b, brs): (*const f32, usize),
        (c, crs): (*mut f32, usize),
    ) {
        const R: usize = 6;
        unsafe {
            let rows: [*const f32; R] = std::array::from_fn(|r| a.add(r.min(n - 1) * ars));
            for half in [0, 16] {
                let mut acc = [[_mm256_setzero_ps(); 2]; R];
                for p in 0..kk {
                    let bp = b.add(p * brs + half);
                    let (b0, b1) = (_mm256_loadu_ps(bp), _mm256_loadu_ps(bp.add(8)));
                    for r in 0..R {
                        let av = _mm256_set1_ps(*rows[r].add(p));
                        acc[r][0] = _mm256_fmadd_ps(av, b0, acc[r][0]);
                        acc[r][1] = _mm256_fmadd_ps(av, b1, acc[r][1]);
                    }
                }
                for (r, [a0, a1]) in acc.into_iter().enumerate() {
                    if r < n {
                        _mm256_storeu_ps(c.add(r * crs + half), a0);
                        _mm256_storeu_ps(c.add(r * crs + half + 8), a1);
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The whole forward on each tile kind this CPU runs (AVX2 on AVX-512 machines too, so the
    /// 4-row stepping of AVX2-only CPUs such as Zen 3 is exercised) against `gemm` per head:
    /// outputs and probabilities, whole, causal or within a sliding window, with dropout, tasks of
    /// whole heads and of row blocks, rows that do not fill a tile.
    #[test]
    fn every_tile_kind_matches_gemm_per_head() {
        let mut kinds = vec![];
        #[cfg(target_arch = "x86_64")]
        {
            if has_avx512() {
                kinds.push(Tiles::Avx512);
            }
            if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
                kinds.push(Tiles::Avx2);
            }
        }
        let val = |i: usize| ((i * 7919 % 2000) as f32 - 1000.0) / 1000.0;
        for (b, t, h, heads) in [(1, 45, 128, 2), (4, 19, 128, 4), (2, 6, 64, 1)] {
            let qkv: Vec<f32> = (0..b * t * 3 * h).map(val).collect();
            let mut mask = vec![0f32; b * t];
            mask[b * t - 2] = f32::MIN;
            let x = [&qkv[..], &qkv[h..], &qkv[2 * h..]];
            let band = Window {
                before: 3,
                after: 2,
            };
            let sliding = Window {
                before: 4,
                after: 0,
            };
            for (window, dropout) in [
                (Window::FULL, 0.0),
                (Window::CAUSAL, 0.0),
                (Window::FULL, 0.2),
                (Window::CAUSAL, 0.2),
                (band, 0.0),
                (sliding, 0.2),
            ] {
                let a = Attn::new((b, t, h), 3 * h, heads, window, 0.2, dropout, 9);
                let (want, want_p) = a.forward_on(None, x, &mask, true);
                for &tiles in &kinds {
                    let (got, got_p) = a.forward_on(Some(tiles), x, &mask, true);
                    // Without probabilities to keep (inference), the tiles divide each output
                    // row by its sum instead of normalising the probabilities.
                    let (inferred, none) = a.forward_on(Some(tiles), x, &mask, false);
                    assert!(none.is_none());
                    let what = format!("{tiles:?} {b}x{t}x{h}/{heads} {window:?} p={dropout}");
                    for (name, g, w) in [
                        ("out", &got, &want),
                        ("out without probs", &inferred, &want),
                        ("probs", got_p.as_ref().unwrap(), want_p.as_ref().unwrap()),
                    ] {
                        let err = g
                            .iter()
                            .zip(w)
                            .map(|(x, y)| (x - y).abs())
                            .fold(0f32, f32::max);
                        assert!(err < 1e-5, "{what} {name}: max |Δ| {err}");
                    }
                }
            }
        }
    }

    /// Every tile this CPU can run (AVX2 on AVX-512 machines too) against sums in f64: each row
    /// count, strided A and B, and C's rows past `n` left untouched.
    #[test]
    fn register_tiles_match_f64_sums() {
        let mut kinds = vec![];
        #[cfg(target_arch = "x86_64")]
        {
            if has_avx512() {
                kinds.push(Tiles::Avx512);
            }
            if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
                kinds.push(Tiles::Avx2);
            }
        }
        let (kk, ars, brs, crs) = (37, 41, 35, 33);
        let val = |i: usize| ((i * 7919 % 1000) as f32 - 500.0) / 250.0;
        let a: Vec<f32> = (0..8 * ars).map(val).collect();
        let b: Vec<f32> = (0..kk * brs).map(|i| val(i + 17)).collect();
        for tiles in kinds {
            for n in 1..=tiles.rows() {
                let mut c = vec![f32::NAN; 8 * crs];
                // SAFETY: A holds 8 rows of `ars` ≥ kk, B kk rows of `brs` ≥ NR, C 8 rows of
                // `crs` ≥ NR; `tiles` was detected on this CPU.
                unsafe {
                    tiles.run(
                        kk,
                        (a.as_ptr(), ars, n),
                        (b.as_ptr(), brs),
                        (c.as_mut_ptr(), crs),
                    )
                };
                for r in 0..8 {
                    for j in 0..NR {
                        let got = c[r * crs + j];
                        if r >= n {
                            assert!(got.is_nan(), "{tiles:?} wrote row {r} of {n}");
                            continue;
                        }
                        let want: f64 = (0..kk)
                            .map(|p| a[r * ars + p] as f64 * b[p * brs + j] as f64)
                            .sum();
                        assert!(
                            (got as f64 - want).abs() < 1e-4 * (1.0 + want.abs()),
                            "{tiles:?} n={n} C[{r}][{j}] = {got}, want {want}"
                        );
                    }
                }
            }
        }
    }
}
