//! The attention core on the CPU: forward on kiln's register tiles (or `gemm` per head), backward
//! on `gemm`, dropout regenerated from a seed. Under `--bf16` ([`MatmulPrecision::Bf16`], which
//! only CPUs with bf16 instructions get) its four kinds of product run on the bf16 kernels instead,
//! as PyTorch's autocast runs attention on bf16 q, k and v; softmax and its backward stay f32.

use rayon::prelude::*;

use super::{
    exp_row, has_avx512, scale_by, scale_by_dropout, simd, small_gemm, softmax_backward_row,
    unfilled, SharedMut,
};
use crate::ops::bf16::{gemm_bf16_with, Bf16Kernel};
use crate::ops::{AttentionSpec, MatmulPrecision, Strided, Window};

/// One multi-head attention call on the CPU: `[B, T, H]` activations whose q, k and v rows lie `rs`
/// floats apart — `H` when they are three tensors, `3H` when one Linear made them side by side.
#[derive(Clone)]
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
    /// The kernel the products run on in bf16 (operands rounded to bf16, f32 sums), or `None`
    /// for f32.
    bf16: Option<Bf16Kernel>,
}

/// What every task of one forward reads and writes: q, k and v (each at its row 0, column 0),
/// the additive key mask `[B, T]`, and the output `[B, T, H]`, whose rows and head columns the
/// tasks share out.
struct ForwardIo<'a> {
    qkv: [&'a [f32]; 3],
    mask: &'a [f32],
    out: SharedMut,
}

/// Where a backward writes dq, dk and dv: each at its (row 0, column 0), rows `stride` floats
/// apart (`H` for three tensors, `3H` for one `[B, T, 3H]` gradient).
#[derive(Clone, Copy)]
pub(super) struct GradsOut {
    pub(super) at: [SharedMut; 3],
    pub(super) stride: usize,
}

impl Attn {
    pub(super) fn new((b, t, h): (usize, usize, usize), rs: usize, spec: AttentionSpec) -> Self {
        let (scale, keep) = (spec.scale as f32, spec.dropout.keep() as f32);
        Self {
            b,
            t,
            h,
            heads: spec.heads,
            rs,
            window: spec.window,
            scale,
            keep,
            seed: spec.dropout.seed,
            // Read on the calling thread: the precision is the thread's, as for Linear layers.
            bf16: (crate::ops::matmul_precision() == MatmulPrecision::Bf16).then(Bf16Kernel::best),
        }
    }

    /// The same attention with its products on `kernel` (bf16) or in f32 (`None`), so tests
    /// can run each kind the CPU has.
    #[cfg(test)]
    fn with_bf16(self, kernel: Option<Bf16Kernel>) -> Self {
        Self {
            bf16: kernel,
            ..self
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
        if let Some(kernel) = self.bf16 {
            return self.forward_bf16(kernel, qkv, mask, with_probs);
        }
        let d = self.h / self.heads;
        let tiles = Tiles::detect().filter(|_| d.is_multiple_of(NR));
        self.forward_on(tiles, qkv, mask, with_probs)
    }

    /// [`Self::forward`] with bf16 products on `kernel`, a block of [`BF16_ROWS`] query rows a
    /// task: the block's scores (against the keys its rows see: causal blocks skip the rest),
    /// their softmax in f32, and the block's output.
    fn forward_bf16(
        &self,
        kernel: Bf16Kernel,
        qkv: [&[f32]; 3],
        mask: &[f32],
        with_probs: bool,
    ) -> (Vec<f32>, Option<Vec<f32>>) {
        let Self {
            b, t, h, heads, rs, ..
        } = *self;
        let d = h / heads;
        assert!(qkv.iter().all(|x| x.len() >= (b * t - 1) * rs + h));
        assert!(mask.len() >= b * t);
        let mut out = vec![0f32; b * t * h];
        let mut probs = with_probs.then(|| vec![0f32; b * heads * t * t]);
        let io = ForwardIo {
            qkv,
            mask,
            out: SharedMut(out.as_mut_ptr()),
        };
        let probs_ptr = probs.as_mut().map(|p| SharedMut(p.as_mut_ptr()));
        let blocks = t.div_ceil(BF16_ROWS);
        (0..b * heads * blocks).into_par_iter().for_each_init(
            || (vec![0f32; BF16_ROWS * t], vec![0f32; BF16_ROWS * d]),
            |(s, o), task| {
                let (bh, blk) = (task / blocks, task % blocks);
                let rows = blk * BF16_ROWS..((blk + 1) * BF16_ROWS).min(t);
                // SAFETY: rows `rows` of head `bh`'s probabilities belong to this task alone.
                let p = probs_ptr.map(|pp| unsafe {
                    std::slice::from_raw_parts_mut(pp.at((bh * t + rows.start) * t), rows.len() * t)
                });
                self.rows_bf16(kernel, &io, bh, rows, p, (s, o));
            },
        );
        (out, probs)
    }

    /// Query rows `rows` of head `bh` with bf16 products: S = Q·Kᵀ over the keys the rows see,
    /// softmax (stored to `probs`, T per row, if given; then dropped out), P·V written to `out`.
    fn rows_bf16(
        &self,
        kernel: Bf16Kernel,
        io: &ForwardIo,
        bh: usize,
        rows: std::ops::Range<usize>,
        mut probs: Option<&mut [f32]>,
        (s, o): (&mut [f32], &mut [f32]),
    ) {
        let ForwardIo {
            qkv: [qs, ks, vs],
            mask,
            out,
        } = *io;
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
        let (n, kend) = (rows.len(), self.keys_end(rows.clone()));
        let (s, o) = (&mut s[..n * kend], &mut o[..n * d]);
        // Kᵀ is K read with its strides swapped: (value, key) at key·rs + value.
        let q = &qs[off + rows.start * rs..];
        gemm_bf16_with(
            kernel,
            (n, d, kend),
            Strided::new(q, (rs, 1)),
            Strided::new(&ks[off..], (1, rs)),
            0.0,
            s,
            f32_gemm,
        );
        for (r, row) in s.chunks_mut(kend).enumerate() {
            let i = rows.start + r;
            self.softmax(row, i, m);
            if let Some(p) = probs.as_deref_mut() {
                // Keys past `kend` keep the allocation's zeros.
                p[r * t..r * t + kend].copy_from_slice(row);
            }
            if keep < 1.0 {
                dropout_row(row, ((bh * t + i) * t) as u64, keep, seed);
            }
        }
        gemm_bf16_with(
            kernel,
            (n, kend, d),
            Strided::new(s, (kend, 1)),
            Strided::new(&vs[off..], (rs, 1)),
            0.0,
            o,
            f32_gemm,
        );
        // SAFETY: output rows `rows`, columns of head `bh`, belong to this task alone.
        unsafe { store_rows(o, d, out.at(out_off + rows.start * h), h) };
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
        // SAFETY: the tasks below cover every (batch, head, query row), and each writes its rows'
        // d output columns by overwriting (the tiles' `run` and `small_gemm` without accumulating),
        // reading none of them before.
        let mut out = unsafe { unfilled(b * t * h) };
        let mut probs = with_probs.then(|| vec![0f32; b * heads * t * t]);
        let io = ForwardIo {
            qkv,
            mask,
            out: SharedMut(out.as_mut_ptr()),
        };
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
                    self.head_tiled(tiles, &io, bh, rows, p, scratch);
                } else {
                    let scratch = (&mut scratch[..], &mut kt[..]);
                    self.head_gemm(&io, bh, p, scratch);
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
    fn head_tiled(
        &self,
        tiles: Tiles,
        io: &ForwardIo,
        bh: usize,
        rows: std::ops::Range<usize>,
        mut probs: Option<&mut [f32]>,
        (s, kt, vp): (&mut [f32], &mut [f32], &mut [f32]),
    ) {
        let ForwardIo {
            qkv: [qs, ks, vs],
            mask,
            out,
        } = *io;
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
        io: &ForwardIo,
        bh: usize,
        probs: Option<&mut [f32]>,
        (scratch, dropped): (&mut [f32], &mut [f32]),
    ) {
        let ForwardIo {
            qkv: [qs, ks, vs],
            mask,
            out,
        } = *io;
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
                (t, d, t),
                Strided::new(qs[off..].as_ptr(), (rs, 1)),
                Strided::new(ks[off..].as_ptr(), (1, rs)),
                false,
                Strided::new(p.as_mut_ptr(), (t, 1)),
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
                (t, t, d),
                Strided::new(pd.as_ptr(), (t, 1)),
                Strided::new(vs[off..].as_ptr(), (rs, 1)),
                false,
                Strided::new(out.at(out_off), (h, 1)),
            );
        }
    }

    /// Writes dq, dk and dv through `grads` for the output gradient `dout [B, T, H]` and the
    /// forward's `probs`.
    pub(super) fn backward(
        &self,
        [qs, ks, vs]: [&[f32]; 3],
        probs: &[f32],
        dout: &[f32],
        grads: GradsOut,
    ) {
        let GradsOut {
            at: [dq, dk, dv],
            stride: gs,
        } = grads;
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
        if let Some(kernel) = self.bf16 {
            return self.backward_bf16(kernel, [qs, ks, vs], probs, dout, grads);
        }
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
                        (t, t, d),
                        Strided::new(pd.as_ptr(), (1, t)),
                        Strided::new(dout[out_off..].as_ptr(), (h, 1)),
                        false,
                        Strided::new(dv.at(g_off), (gs, 1)),
                    );
                    // dP_drop = dO · Vᵀ
                    small_gemm(
                        (t, d, t),
                        Strided::new(dout[out_off..].as_ptr(), (h, 1)),
                        Strided::new(vs[off..].as_ptr(), (1, rs)),
                        false,
                        Strided::new(dp.as_mut_ptr(), (t, 1)),
                    );
                }
                dropout_block(dp, bh, t, keep, seed);
                for (dr, pr) in dp.chunks_mut(t).zip(p.chunks(t)) {
                    softmax_backward_row(dr, pr, scale);
                }
                unsafe {
                    // dQ = dS · K,  dK = dSᵀ · Q
                    small_gemm(
                        (t, t, d),
                        Strided::new(dp.as_ptr(), (t, 1)),
                        Strided::new(ks[off..].as_ptr(), (rs, 1)),
                        false,
                        Strided::new(dq.at(g_off), (gs, 1)),
                    );
                    small_gemm(
                        (t, t, d),
                        Strided::new(dp.as_ptr(), (1, t)),
                        Strided::new(qs[off..].as_ptr(), (rs, 1)),
                        false,
                        Strided::new(dk.at(g_off), (gs, 1)),
                    );
                }
            },
        );
    }
    /// [`Self::backward`] with bf16 products on `kernel` (the checks are the caller's), per head a
    /// block of [`BF16_BACKWARD_ROWS`] query rows at a time against the keys up to the block's
    /// last nonzero probability: a key whose probability is 0 for every row of the block (after a
    /// causal block's last row, or a padded key) adds nothing to dV, dK or dQ, and its dP is
    /// never read, so causal heads do about half the products and half the element-wise passes.
    /// dQ's rows are stored per block; dK and dV are summed over the blocks.
    fn backward_bf16(
        &self,
        kernel: Bf16Kernel,
        [qs, ks, vs]: [&[f32]; 3],
        probs: &[f32],
        dout: &[f32],
        grads: GradsOut,
    ) {
        let GradsOut {
            at: [dq, dk, dv],
            stride: gs,
        } = grads;
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
        const R: usize = BF16_BACKWARD_ROWS;
        (0..b * heads).into_par_iter().for_each_init(
            || {
                // A block's dropped probabilities and dP (then dS), [R, keys]; dQ's block rows;
                // dK and dV summed over the blocks.
                let block = vec![0f32; R.min(t) * t];
                (
                    block.clone(),
                    block,
                    vec![0f32; R * d],
                    vec![0f32; 2 * t * d],
                )
            },
            |(dropped, dp, gq, gkv), bh| {
                let (off, out_off) = self.offsets(bh);
                let g_off = (bh / heads) * t * gs + (bh % heads) * d;
                let p = &probs[bh * t * t..(bh + 1) * t * t];
                let dout = &dout[out_off..];
                let (gk, gv) = gkv.split_at_mut(t * d);
                gk.fill(0.0);
                gv.fill(0.0);
                for i0 in (0..t).step_by(R) {
                    let n = R.min(t - i0);
                    let rows = &p[i0 * t..(i0 + n) * t];
                    // Keys 0..kend hold every nonzero probability of the block's rows.
                    let kend = rows
                        .chunks(t)
                        .map(|r| r.iter().rposition(|&v| v != 0.0).map_or(0, |j| j + 1))
                        .max()
                        .unwrap_or(0);
                    let (q_rows, dout_rows) = (&qs[off + i0 * rs..], &dout[i0 * h..]);
                    if kend == 0 {
                        // Every probability 0: no gradient reaches these rows' q.
                        gq[..n * d].fill(0.0);
                    } else {
                        // The dropped probabilities, regenerated from the seed.
                        let (pd, pd_rs): (&[f32], usize) = if keep < 1.0 {
                            let pd = &mut dropped[..n * kend];
                            for (r, row) in pd.chunks_mut(kend).enumerate() {
                                row.copy_from_slice(&rows[r * t..r * t + kend]);
                                let i = i0 + r;
                                dropout_row(row, ((bh * t + i) * t) as u64, keep, seed);
                            }
                            (pd, kend)
                        } else {
                            (rows, t)
                        };
                        // dV[..kend] += P_dropᵀ · dO (the block's rows)
                        let gv = &mut gv[..kend * d];
                        gemm_bf16_with(
                            kernel,
                            (kend, n, d),
                            Strided::new(pd, (1, pd_rs)),
                            Strided::new(dout_rows, (h, 1)),
                            1.0,
                            gv,
                            f32_gemm,
                        );
                        // dP_drop = dO · Vᵀ, then dS
                        let dp = &mut dp[..n * kend];
                        gemm_bf16_with(
                            kernel,
                            (n, d, kend),
                            Strided::new(dout_rows, (h, 1)),
                            Strided::new(&vs[off..], (1, rs)),
                            0.0,
                            dp,
                            f32_gemm,
                        );
                        for (r, (dr, pr)) in dp.chunks_mut(kend).zip(rows.chunks(t)).enumerate() {
                            if keep < 1.0 {
                                dropout_row(dr, ((bh * t + i0 + r) * t) as u64, keep, seed);
                            }
                            softmax_backward_row(dr, &pr[..kend], scale);
                        }
                        // dQ = dS · K,  dK[..kend] += dSᵀ · Q (the block's rows)
                        let gq = &mut gq[..n * d];
                        gemm_bf16_with(
                            kernel,
                            (n, kend, d),
                            Strided::new(dp, (kend, 1)),
                            Strided::new(&ks[off..], (rs, 1)),
                            0.0,
                            gq,
                            f32_gemm,
                        );
                        let gk = &mut gk[..kend * d];
                        gemm_bf16_with(
                            kernel,
                            (kend, n, d),
                            Strided::new(dp, (1, kend)),
                            Strided::new(q_rows, (rs, 1)),
                            1.0,
                            gk,
                            f32_gemm,
                        );
                    }
                    // SAFETY: this task writes only head `bh`'s rows and columns of the
                    // gradients, which hold B·T rows of stride `gs`.
                    unsafe { store_rows(&gq[..n * d], d, dq.at(g_off + i0 * gs), gs) };
                }
                // SAFETY: as above.
                unsafe {
                    store_rows(gk, d, dk.at(g_off), gs);
                    store_rows(gv, d, dv.at(g_off), gs);
                }
            },
        );
    }
}

/// Query rows per task of the bf16 forward: causal blocks skip the keys after their last row.
const BF16_ROWS: usize = 64;
/// Query rows per block of the bf16 backward: dK and dV sum a product of this many rows per
/// block, so more rows than the forward's (AMX loads and stores C once per product).
const BF16_BACKWARD_ROWS: usize = 128;

/// The f32 GEMM the bf16 products fall back on where the kernel is [`Bf16Kernel::Rounded`].
fn f32_gemm(m: usize, k: usize, n: usize, a: &[f32], b: &[f32], beta: f32, c: &mut [f32]) {
    super::gemm::sgemm(
        (m, k, n),
        Strided::rows(a, k),
        Strided::rows(b, n),
        beta,
        None,
        c,
    )
}

/// Copies the rows of `src` (`width` values each) to rows `dst_stride` apart from `dst`.
///
/// # Safety
/// `dst` must address `src.len() / width` rows of `width` values, `dst_stride` apart, that
/// nothing else reads or writes meanwhile.
unsafe fn store_rows(src: &[f32], width: usize, dst: *mut f32, dst_stride: usize) {
    for (r, row) in src.chunks_exact(width).enumerate() {
        std::slice::from_raw_parts_mut(dst.add(r * dst_stride), width).copy_from_slice(row);
    }
}

/// Scales a row of attention probabilities by the dropout mask of element indices `base..`.
#[inline]
fn dropout_row(row: &mut [f32], base: u64, keep: f32, seed: u64) {
    simd(
        #[inline(always)]
        || scale_by_dropout(row, base, seed, (keep, 1.0 / keep)),
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
    use crate::ops::Dropout;

    /// The tests' attention: scale 0.2, dropout at `rate` from seed 9.
    fn test_spec(heads: usize, window: Window, rate: f64) -> AttentionSpec {
        AttentionSpec {
            heads,
            window,
            scale: 0.2,
            dropout: Dropout { rate, seed: 9 },
        }
    }

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
                let a = Attn::new((b, t, h), 3 * h, test_spec(heads, window, dropout));
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

    /// bf16's unit roundoff (8 significant bits), and the relative error of a product of two
    /// rounded operands: (1 + u)² − 1, with room for the f32 sums.
    const U: f64 = 1.0 / 256.0;
    const PRODUCT: f64 = 2.0 * U + U * U + 1e-4;

    /// Q, K, V and dO of head `bh` as f64 rows of d values: q/k/v rows `rs` apart, dO's `h`.
    fn head_f64(a: &Attn, bh: usize, x: [&[f32]; 3], dout: &[f32]) -> [Vec<Vec<f64>>; 4] {
        let d = a.h / a.heads;
        let (off, out_off) = a.offsets(bh);
        let rows = |src: &[f32], start: usize, stride: usize| -> Vec<Vec<f64>> {
            (0..a.t)
                .map(|i| (0..d).map(|c| src[start + i * stride + c] as f64).collect())
                .collect()
        };
        [
            rows(x[0], off, a.rs),
            rows(x[1], off, a.rs),
            rows(x[2], off, a.rs),
            rows(dout, out_off, a.h),
        ]
    }

    /// Indices `(bh, i, c)` where bf16 attention (forward and backward, on `kernel`) differs
    /// from the f32 attention by more than bf16 rounding explains: a bound derived, per element,
    /// from the operands' magnitudes and bf16's unit roundoff ([`U`]): the scores' error moves
    /// each probability by at most a factor e^{±2E} (E the row's largest score error), the
    /// rounded P, V, dO, dS, K and Q add [`PRODUCT`] per product.
    /// `bf16_x` is what the bf16 side is fed (`x` but for the control).
    // Indices, as the bound is written: rows i, keys j, values c.
    #[allow(clippy::needless_range_loop)]
    fn bf16_violations(
        a: &Attn,
        kernel: Bf16Kernel,
        x: [&[f32]; 3],
        bf16_x: [&[f32]; 3],
        mask: &[f32],
    ) -> usize {
        let (b, t, h, heads) = (a.b, a.t, a.h, a.heads);
        let d = h / heads;
        let f32_attn = a.clone().with_bf16(None);
        let bf16_attn = a.clone().with_bf16(Some(kernel));
        let (want, want_p) = f32_attn.forward(x, mask, true);
        let (got, got_p) = bf16_attn.forward(bf16_x, mask, true);
        let (want_p, got_p) = (want_p.unwrap(), got_p.unwrap());
        let dout: Vec<f32> = (0..b * t * h)
            .map(|i| ((i * 4099 % 1000) as f32 - 500.0) / 500.0)
            .collect();
        let backward = |attn: &Attn, x: [&[f32]; 3]| {
            let mut grads = [
                vec![0f32; b * t * h],
                vec![0f32; b * t * h],
                vec![0f32; b * t * h],
            ];
            let ptrs = grads.each_mut().map(|g| SharedMut(g.as_mut_ptr()));
            // The f32 probabilities for both, so only the backward's own products differ.
            attn.backward(
                x,
                &want_p,
                &dout,
                GradsOut {
                    at: ptrs,
                    stride: h,
                },
            );
            grads
        };
        let (want_g, got_g) = (backward(&f32_attn, x), backward(&bf16_attn, bf16_x));
        let keep = a.keep as f64;
        let mut bad = 0;
        let mut check = |got: f32, want: f32, bound: f64| {
            if (got as f64 - want as f64).abs() > bound + 1e-6 {
                bad += 1;
            }
        };
        let dot = |x: &[f64], y: &[f64]| x.iter().zip(y).map(|(p, q)| (p * q).abs()).sum::<f64>();
        for bh in 0..b * heads {
            let [q, k, v, dof] = head_f64(a, bh, x, &dout);
            let (_, out_off) = a.offsets(bh);
            let g_off = (bh / heads) * t * h + (bh % heads) * d;
            let p = |i: usize, j: usize| want_p[(bh * t + i) * t + j] as f64;
            // Forward: scores' error E per row, then probabilities and output.
            for i in 0..t {
                let seen = a.window.keys(i, t);
                let e = seen
                    .clone()
                    .map(|j| a.scale as f64 * PRODUCT * dot(&q[i], &k[j]))
                    .fold(0f64, f64::max);
                let factor = (2.0 * e).exp() * (1.0 + U) - 1.0;
                for j in 0..t {
                    let at = (bh * t + i) * t + j;
                    check(got_p[at], want_p[at], factor * p(i, j));
                }
                for c in 0..d {
                    let mag: f64 = seen.clone().map(|j| p(i, j) / keep * v[j][c].abs()).sum();
                    let at = out_off + i * h + c;
                    check(
                        got[at],
                        want[at],
                        ((1.0 + factor) * (1.0 + PRODUCT) - 1.0) * mag,
                    );
                }
            }
            // Backward: dP = dO·Vᵀ (|dP| ≤ a/keep), dS = scale·P∘(dP − Σ P dP), then dQ, dK, dV.
            let mag_dp: Vec<Vec<f64>> = (0..t)
                .map(|i| (0..t).map(|j| dot(&dof[i], &v[j]) / keep).collect())
                .collect();
            let mut err_ds = vec![vec![0f64; t]; t];
            let mut mag_ds = vec![vec![0f64; t]; t];
            for i in 0..t {
                let row_err: f64 = (0..t).map(|l| p(i, l) * PRODUCT * mag_dp[i][l]).sum();
                let row_mag: f64 = (0..t).map(|l| p(i, l) * mag_dp[i][l]).sum();
                for j in 0..t {
                    let s = a.scale as f64 * p(i, j);
                    err_ds[i][j] = s * (PRODUCT * mag_dp[i][j] + row_err);
                    mag_ds[i][j] = s * (mag_dp[i][j] + row_mag);
                }
            }
            let [dq, dk, dv] = [0, 1, 2].map(|n| (&got_g[n], &want_g[n]));
            for r in 0..t {
                for c in 0..d {
                    let at = g_off + r * h + c;
                    let ds =
                        |i: usize, j: usize| err_ds[i][j] + PRODUCT * (mag_ds[i][j] + err_ds[i][j]);
                    let bq: f64 = (0..t).map(|j| ds(r, j) * k[j][c].abs()).sum();
                    let bk: f64 = (0..t).map(|i| ds(i, r) * q[i][c].abs()).sum();
                    let bv: f64 = (0..t)
                        .map(|i| PRODUCT * p(i, r) / keep * dof[i][c].abs())
                        .sum();
                    check(dq.0[at], dq.1[at], bq);
                    check(dk.0[at], dk.1[at], bk);
                    check(dv.0[at], dv.1[at], bv);
                }
            }
        }
        bad
    }

    /// Under `--bf16` the products run on every bf16 kernel this CPU has (the rounded-copy one
    /// on every CPU): forward and backward within bf16 rounding of the f32 attention — whole,
    /// causal and windowed, with dropout, q/k/v side by side and apart, head sizes that are no
    /// multiple of 32 and sequences that end inside a row block. The control: the same kernel
    /// fed heads whose last two values (one bf16 pair: a kernel dropping K's last pair) are
    /// zero fails the bound.
    #[test]
    fn bf16_products_within_rounding_of_f32() {
        let val = |i: usize| ((i * 7919 % 2000) as f32 - 1000.0) / 1000.0;
        let band = Window {
            before: 5,
            after: 3,
        };
        for kernel in Bf16Kernel::available() {
            for (b, t, h, heads, window, dropout, packed) in [
                (2, 70, 96, 2, Window::CAUSAL, 0.0, true),
                (1, 130, 128, 2, Window::FULL, 0.0, false),
                (1, 70, 64, 1, band, 0.2, true),
                (2, 33, 96, 3, Window::CAUSAL, 0.1, false),
                (1, 200, 64, 1, Window::CAUSAL, 0.1, true),
            ] {
                let rs = if packed { 3 * h } else { h };
                let parts: Vec<Vec<f32>> = if packed {
                    vec![(0..b * t * 3 * h).map(val).collect()]
                } else {
                    (0..3)
                        .map(|n| (0..b * t * h).map(|i| val(i + n * 7)).collect())
                        .collect()
                };
                let x: [&[f32]; 3] = if packed {
                    [&parts[0][..], &parts[0][h..], &parts[0][2 * h..]]
                } else {
                    [&parts[0][..], &parts[1][..], &parts[2][..]]
                };
                // The last two keys padded: their probabilities are 0 for every query.
                let mut mask = vec![0f32; b * t];
                mask[b * t - 2..].fill(f32::MIN);
                let a = Attn::new((b, t, h), rs, test_spec(heads, window, dropout));
                let what = format!("{kernel:?} {b}x{t}x{h}/{heads} {window:?} p={dropout}");
                let bad = bf16_violations(&a, kernel, x, x, &mask);
                assert_eq!(
                    bad, 0,
                    "{what}: {bad} values outside the bf16 rounding bound"
                );
                if !packed {
                    continue;
                }
                // Control: every head's last pair of values zeroed in what bf16 sees.
                let d = h / heads;
                let mut cut = parts[0].clone();
                for (i, v) in cut.iter_mut().enumerate() {
                    if (i % h) % d >= d - 2 {
                        *v = 0.0;
                    }
                }
                let cut_x = [&cut[..], &cut[h..], &cut[2 * h..]];
                let bad = bf16_violations(&a, kernel, x, cut_x, &mask);
                assert!(bad > 0, "{what}: the control stayed inside the bound");
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
