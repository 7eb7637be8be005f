//! Fused CPU kernels for the ndarray backend: contiguous f32 slices, rayon over rows, and
//! the `gemm` crate called with strides so no operand is ever transposed in memory.

use burn::backend::ndarray::{NdArray, NdArrayTensor};
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{Shape, TensorMetadata};
use ndarray::{ArcArray, IxDyn};
use rayon::prelude::*;

use super::split::{gemm_grid, GEMM_TASK_MIN};
use super::{KilnBackend, Strided};

mod attention;
pub(super) mod gemm;
mod gemm_avx2;
pub(crate) use gemm_avx2::L2_BYTES;
mod narrow;
mod panels;
mod row_kernels;
mod vector;
use attention::Attn;
use gemm::*;
use narrow::*;
use row_kernels::*;
use vector::*;

mod host;
use host::*;

// SAFETY: only used where every task writes rows/columns no other task touches.
unsafe impl Send for SharedMut {}
unsafe impl Sync for SharedMut {}

type Cpu = NdArray<f32>;

impl KilnBackend for Cpu {
    fn kiln_bf16_is_native() -> bool {
        super::bf16::has_bf16_dot()
    }

    fn kiln_from_host(data: Vec<f32>, shape: Shape, _: &Self::Device) -> FloatTensor<Self> {
        tensor(&shape.dims, data)
    }

    fn kiln_into_owned(x: FloatTensor<Self>) -> FloatTensor<Self> {
        NdArrayTensor::from(dense(x))
    }

    fn kiln_bf16_store(w: FloatTensor<Self>) -> Option<FloatTensor<Self>> {
        let w = dense(w);
        let bits: Vec<u16> = slice(&w)
            .par_iter()
            .map(|&v| super::bf16::bf16_bits(v))
            .collect();
        let a = ArcArray::from_shape_vec(IxDyn(w.shape()), bits).expect("shape matches data");
        Some(NdArrayTensor::from(a))
    }

    fn kiln_bf16_load(w: FloatTensor<Self>) -> FloatTensor<Self> {
        let Some(b) = bf16_bits(&w) else {
            return w;
        };
        let mut out = vec![0f32; b.len()];
        out.par_chunks_mut(16_384)
            .zip(bits(&b).par_chunks(16_384))
            .for_each(|(o, b)| widen_bf16(b, o));
        tensor(b.shape(), out)
    }

    fn kiln_embedding(w: FloatTensor<Self>, ids: IntTensor<Self>) -> FloatTensor<Self> {
        use burn::tensor::ops::FloatTensorOps;
        let Some(table) = bf16_bits(&w) else {
            return Self::float_select(w, 0, ids);
        };
        let (vocab, h) = (table.shape()[0], table.shape()[1]);
        let ids: Vec<usize> = match ids {
            NdArrayTensor::I64(s) => s.into_shared().iter().map(|&v| v as usize).collect(),
            NdArrayTensor::I32(s) => s.into_shared().iter().map(|&v| v as usize).collect(),
            other => panic!("embedding ids must be integers, got {:?}", other.dtype()),
        };
        let table = bits(&table);
        let mut out = vec![0f32; ids.len() * h];
        out.par_chunks_mut(h).zip(&ids).for_each(|(row, &id)| {
            assert!(
                id < vocab,
                "token id {id} is outside the {vocab}-row embedding table"
            );
            widen_bf16(&table[id * h..(id + 1) * h], row);
        });
        tensor(&[ids.len(), h], out)
    }

    fn kiln_reshape(x: FloatTensor<Self>, shape: Shape) -> FloatTensor<Self> {
        let a = dense(x);
        NdArrayTensor::from(
            a.into_shape_with_order(IxDyn(&shape.dims))
                .expect("reshape keeps the element count"),
        )
    }

    fn kiln_linear(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        b: Option<FloatTensor<Self>>,
    ) -> FloatTensor<Self> {
        if let Some(w) = bf16_bits(&w) {
            let _p = super::profile::scope("linear_fwd");
            let x = dense(x);
            let (m, k, n) = (x.shape()[0], x.shape()[1], w.shape()[0]);
            let b = b.map(dense);
            let y = linear_forward_bf16((m, k, n), slice(&x), bits(&w), b.as_ref().map(slice));
            return tensor(&[m, n], y);
        }
        linear_forward(x, w, b, false)
    }

    fn kiln_inference_layout(w: FloatTensor<Self>) -> FloatTensor<Self> {
        let (n, k) = (w.shape()[0], w.shape()[1]);
        if bf16_bits(&w).is_none() && panels::packs(k, n) {
            let w = dense(w);
            return tensor(
                &[n / panels::PANEL * k, panels::PANEL],
                panels::pack(slice(&w), n, k),
            );
        }
        Self::kiln_into_owned(<Self as burn::tensor::ops::FloatTensorOps<Self>>::float_transpose(w))
    }

    fn kiln_linear_in_out(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        b: Option<FloatTensor<Self>>,
    ) -> FloatTensor<Self> {
        let (m, k) = (x.shape()[0], x.shape()[1]);
        let Some(n) = panels::packed_outputs(&w.shape(), k) else {
            return linear_forward(x, w, b, true);
        };
        if m > panels::MAX_ROWS {
            let w = tensor(&[k, n], panels::unpack(slice(&dense(w)), k, n));
            return linear_forward(x, w, b, true);
        }
        let _p = super::profile::scope("linear_fwd");
        let (x, w, b) = (dense(x), dense(w), b.map(dense));
        let w = panels::Weight::Panels(slice(&w));
        let y = panels::linear((m, k, n), slice(&x), w, b.as_ref().map(slice));
        tensor(&[m, n], y)
    }

    fn kiln_linear_backward(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        dy: FloatTensor<Self>,
        wants: super::LinearGrads,
    ) -> super::LinearBackward<Self> {
        let _p = super::profile::scope("linear_bwd");
        if let Some(w) = bf16_bits(&w) {
            assert!(
                !wants.weight,
                "a weight held in bf16 is frozen: it has no gradient"
            );
            let dy = dense(dy);
            let (m, k, n) = (dy.shape()[0], w.shape()[1], w.shape()[0]);
            let dx = wants
                .input
                .then(|| tensor(&[m, k], linear_dx_bf16((m, k, n), slice(&dy), bits(&w))));
            let db = wants.bias.then(|| column_sums(slice(&dy), n));
            return (dx, None, db);
        }
        let (x, w, dy) = (dense(x), dense(w), dense(dy));
        let (m, k, n) = (x.shape()[0], x.shape()[1], w.shape()[0]);
        let (xs, ws, dys) = (slice(&x), slice(&w), slice(&dy));
        let dx = wants.input.then(|| {
            let (dy, w) = (Strided::rows(dys, n), Strided::rows(ws, k));
            tensor(&[m, k], matmul_new((m, n, k), dy, w, None)) // dy · w
        });
        let dw = wants.weight.then(|| {
            let (dyt, x) = (Strided::rows(dys, n).t(), Strided::rows(xs, k));
            tensor(&[n, k], matmul_new((n, m, k), dyt, x, None)) // dyᵀ · x
        });
        let db = wants.bias.then(|| column_sums(dys, n));
        (dx, dw, db)
    }

    fn kiln_gelu(x: FloatTensor<Self>) -> FloatTensor<Self> {
        let _p = super::profile::scope("gelu_fwd");
        let x = dense(x);
        let shape = x.shape().to_vec();
        let y = par_map(
            slice(&x),
            #[inline(always)]
            |v| v * 0.5 * (1.0 + erf_and_gauss(v * INV_SQRT2).0),
        );
        tensor(&shape, y)
    }

    fn kiln_gelu_backward(x: FloatTensor<Self>, dy: FloatTensor<Self>) -> FloatTensor<Self> {
        let _p = super::profile::scope("gelu_bwd");
        let (x, dy) = (dense(x), dense(dy));
        let shape = x.shape().to_vec();
        let mut dx = into_vec(dy);
        dx.par_chunks_mut(16_384)
            .zip(slice(&x).par_chunks(16_384))
            .for_each(|(d, xs)| {
                simd(
                    #[inline(always)]
                    || {
                        for (g, &v) in d.iter_mut().zip(xs) {
                            // e^{-(v/√2)²} = e^{-v²/2}: the same exponential gives Φ and φ.
                            let (e, gauss) = erf_and_gauss(v * INV_SQRT2);
                            *g *= 0.5 * (1.0 + e) + v * INV_SQRT_2PI * gauss;
                        }
                    },
                )
            });
        tensor(&shape, dx)
    }

    fn kiln_rms_norm(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        eps: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let _p = super::profile::scope("rms_norm_fwd");
        let (x, w) = (dense(x), dense(w));
        let (r, h) = (x.shape()[0], x.shape()[1]);
        let ws = slice(&w);
        let mut y = vec![0f32; r * h];
        let mut rinv = vec![0f32; r];
        let task = rows_per_task(h);
        y.par_chunks_mut(task * h)
            .zip(rinv.par_chunks_mut(task))
            .zip(slice(&x).par_chunks(task * h))
            .for_each(|((yc, rc), xc)| {
                for ((yr, ri), xr) in yc.chunks_mut(h).zip(rc.iter_mut()).zip(xc.chunks(h)) {
                    simd(
                        #[inline(always)]
                        || {
                            let ms = sum_map(xr, |x| x * x) / h as f32;
                            if !ms.is_finite() {
                                super::note_activation_overflow();
                            }
                            let inv = 1.0 / (ms + eps as f32).sqrt();
                            *ri = inv;
                            for ((y, &x), &w) in yr.iter_mut().zip(xr).zip(ws) {
                                *y = x * inv * w;
                            }
                        },
                    );
                }
            });
        (tensor(&[r, h], y), tensor(&[r], rinv))
    }

    fn kiln_rms_norm_backward(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        rinv: FloatTensor<Self>,
        dy: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let _p = super::profile::scope("rms_norm_bwd");
        let (x, w, rinv, dy) = (dense(x), dense(w), dense(rinv), dense(dy));
        let (r, h) = (x.shape()[0], x.shape()[1]);
        let (ws, rs) = (slice(&w), slice(&rinv));
        let mut dx = vec![0f32; r * h];
        let task = rows_per_task(h);
        // dx per row; dw as per-task partial sums, added up afterwards.
        let partials: Vec<Vec<f32>> = dx
            .par_chunks_mut(task * h)
            .zip(slice(&x).par_chunks(task * h))
            .zip(slice(&dy).par_chunks(task * h))
            .enumerate()
            .map(|(t, ((dxc, xc), dyc))| {
                let mut dw = vec![0f32; h];
                let mut xhat = vec![0f32; h];
                for (j, ((dxr, xr), dyr)) in dxc
                    .chunks_mut(h)
                    .zip(xc.chunks(h))
                    .zip(dyc.chunks(h))
                    .enumerate()
                {
                    let inv = rs[t * task + j];
                    simd(
                        #[inline(always)]
                        || {
                            for (((xh, dw), &x), &dy) in
                                xhat.iter_mut().zip(dw.iter_mut()).zip(xr).zip(dyr)
                            {
                                *xh = x * inv;
                                *dw += dy * *xh;
                            }
                            let c = sum_zip3(dyr, ws, &xhat, |d, w, x| d * w * x) / h as f32;
                            for (((dx, &dy), &w), &xh) in
                                dxr.iter_mut().zip(dyr).zip(ws).zip(xhat.iter())
                            {
                                *dx = inv * (dy * w - xh * c);
                            }
                        },
                    );
                }
                dw
            })
            .collect();
        let mut dw = vec![0f32; h];
        for pw in partials {
            for (a, b) in dw.iter_mut().zip(pw) {
                *a += b;
            }
        }
        (tensor(&[r, h], dx), tensor(&[h], dw))
    }

    fn kiln_swiglu(g: FloatTensor<Self>, u: FloatTensor<Self>) -> FloatTensor<Self> {
        let _p = super::profile::scope("swiglu_fwd");
        let (g, u) = (dense(g), dense(u));
        let shape = g.shape().to_vec();
        let mut y = slice(&g).to_vec();
        y.par_chunks_mut(16_384)
            .zip(slice(&u).par_chunks(16_384))
            .for_each(|(yc, uc)| {
                simd(
                    #[inline(always)]
                    || {
                        for (v, &uv) in yc.iter_mut().zip(uc) {
                            *v = *v / (1.0 + exp_fast(-*v)) * uv;
                        }
                    },
                )
            });
        tensor(&shape, y)
    }

    fn kiln_swiglu_backward(
        g: FloatTensor<Self>,
        u: FloatTensor<Self>,
        dy: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let _p = super::profile::scope("swiglu_bwd");
        let (g, u, dy) = (dense(g), dense(u), dense(dy));
        let shape = g.shape().to_vec();
        let mut dg = slice(&g).to_vec();
        let mut du = slice(&dy).to_vec();
        dg.par_chunks_mut(16_384)
            .zip(du.par_chunks_mut(16_384))
            .zip(slice(&u).par_chunks(16_384))
            .zip(slice(&dy).par_chunks(16_384))
            .for_each(|(((gc, duc), uc), dyc)| {
                simd(
                    #[inline(always)]
                    || {
                        for (((g, du), &u), &dy) in
                            gc.iter_mut().zip(duc.iter_mut()).zip(uc).zip(dyc)
                        {
                            let x = *g;
                            let s = 1.0 / (1.0 + exp_fast(-x));
                            *g = dy * u * s * (1.0 + x * (1.0 - s));
                            *du = dy * x * s;
                        }
                    },
                )
            });
        (tensor(&shape, dg), tensor(&shape, du))
    }

    fn kiln_layer_norm(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        b: FloatTensor<Self>,
        eps: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let _p = super::profile::scope("layer_norm_fwd");
        let (x, w, b) = (dense(x), dense(w), dense(b));
        let (r, h) = (x.shape()[0], x.shape()[1]);
        let (ws, bs) = (slice(&w), slice(&b));
        // SAFETY: `normalize_row` writes every row of `y` below, and nothing reads it before.
        let mut y = unsafe { unfilled(r * h) };
        let mut stats = vec![(0f32, 0f32); r];
        let task = rows_per_task(h);
        y.par_chunks_mut(task * h)
            .zip(slice(&x).par_chunks(task * h))
            .zip(stats.par_chunks_mut(task))
            .for_each(|((yc, xc), sc)| {
                for ((yr, xr), s) in yc.chunks_mut(h).zip(xc.chunks(h)).zip(sc) {
                    *s = normalize_row(xr, yr, ws, bs, eps as f32);
                }
            });
        let (mean, rstd): (Vec<f32>, Vec<f32>) = stats.into_iter().unzip();
        (tensor(&[r, h], y), tensor(&[r], mean), tensor(&[r], rstd))
    }

    fn kiln_residual_layer_norm(
        x: FloatTensor<Self>,
        r: FloatTensor<Self>,
        w: FloatTensor<Self>,
        b: FloatTensor<Self>,
        eps: f64,
        dropout: super::Dropout,
    ) -> super::ResidualNorm<Self> {
        let _p = super::profile::scope("residual_layer_norm_fwd");
        let (x, r, w, b) = (dense(x), dense(r), dense(w), dense(b));
        let (rows, h) = (x.shape()[0], x.shape()[1]);
        let (ws, bs) = (slice(&w), slice(&b));
        let (keep, seed) = (dropout.keep() as f32, dropout.seed);
        // SAFETY: each row of `z` is written (the residual sum) and then each row of `y`
        // (`normalize_row`) below, each before anything reads it.
        let (mut z, mut y) = unsafe { (unfilled(rows * h), unfilled(rows * h)) };
        let mut stats = vec![(0f32, 0f32); rows];
        let task = rows_per_task(h);
        z.par_chunks_mut(task * h)
            .zip(y.par_chunks_mut(task * h))
            .zip(
                slice(&x)
                    .par_chunks(task * h)
                    .zip(slice(&r).par_chunks(task * h)),
            )
            .zip(stats.par_chunks_mut(task))
            .enumerate()
            .for_each(|(c, (((zc, yc), (xc, rc)), sc))| {
                for (j, ((zr, yr), ((xr, rr), s))) in zc
                    .chunks_mut(h)
                    .zip(yc.chunks_mut(h))
                    .zip(xc.chunks(h).zip(rc.chunks(h)).zip(sc))
                    .enumerate()
                {
                    simd(
                        #[inline(always)]
                        || {
                            let sum = zr.iter_mut().zip(xr.iter().zip(rr));
                            if keep < 1.0 {
                                let base = ((c * task + j) * h) as u64;
                                for (i, (z, (&x, &r))) in sum.enumerate() {
                                    let m = if uniform(seed, base + i as u64) < keep {
                                        1.0 / keep
                                    } else {
                                        0.0
                                    };
                                    *z = r + x * m;
                                }
                            } else {
                                sum.for_each(|(z, (&x, &r))| *z = r + x);
                            }
                        },
                    );
                    *s = normalize_row(zr, yr, ws, bs, eps as f32);
                }
            });
        let (mean, rstd): (Vec<f32>, Vec<f32>) = stats.into_iter().unzip();
        super::ResidualNorm {
            y: tensor(&[rows, h], y),
            z: tensor(&[rows, h], z),
            mean: tensor(&[rows], mean),
            rstd: tensor(&[rows], rstd),
        }
    }

    fn kiln_dropout_backward(dz: FloatTensor<Self>, dropout: super::Dropout) -> FloatTensor<Self> {
        if !dropout.is_active() {
            return dz;
        }
        let dz = dense(dz);
        let shape = dz.shape().to_vec();
        let (keep, seed) = (dropout.keep() as f32, dropout.seed);
        let mut dx = into_vec(dz);
        dx.par_chunks_mut(16_384)
            .enumerate()
            .for_each(|(c, chunk)| {
                simd(
                    #[inline(always)]
                    || scale_by_dropout(chunk, (c * 16_384) as u64, seed, (keep, 1.0 / keep)),
                )
            });
        tensor(&shape, dx)
    }

    fn kiln_layer_norm_backward(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        mean: FloatTensor<Self>,
        rstd: FloatTensor<Self>,
        dy: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let _p = super::profile::scope("layer_norm_bwd");
        let (x, w, mean, rstd, dy) = (dense(x), dense(w), dense(mean), dense(rstd), dense(dy));
        let (r, h) = (x.shape()[0], x.shape()[1]);
        let (ws, ms, rs) = (slice(&w), slice(&mean), slice(&rstd));
        let mut dx = vec![0f32; r * h];
        let task = rows_per_task(h);
        // dx per row; dw/db as per-task partial sums, added up afterwards.
        let partials: Vec<(Vec<f32>, Vec<f32>)> = dx
            .par_chunks_mut(task * h)
            .zip(slice(&x).par_chunks(task * h))
            .zip(slice(&dy).par_chunks(task * h))
            .enumerate()
            .map(|(t, ((dxc, xc), dyc))| {
                let (mut dw, mut db) = (vec![0f32; h], vec![0f32; h]);
                let mut xhat = vec![0f32; h];
                for (j, ((dxr, xr), dyr)) in dxc
                    .chunks_mut(h)
                    .zip(xc.chunks(h))
                    .zip(dyc.chunks(h))
                    .enumerate()
                {
                    let row = t * task + j;
                    let (mu, rstd) = (ms[row], rs[row]);
                    simd(
                        #[inline(always)]
                        || {
                            for ((((xh, dw), db), &x), &dy) in xhat
                                .iter_mut()
                                .zip(dw.iter_mut())
                                .zip(db.iter_mut())
                                .zip(xr)
                                .zip(dyr)
                            {
                                *xh = (x - mu) * rstd;
                                *dw += dy * *xh;
                                *db += dy;
                            }
                            let c1 = sum_zip2(dyr, ws, |d, w| d * w) / h as f32;
                            let c2 = sum_zip3(dyr, ws, &xhat, |d, w, x| d * w * x) / h as f32;
                            for (((dx, &dy), &w), &xh) in
                                dxr.iter_mut().zip(dyr).zip(ws).zip(xhat.iter())
                            {
                                *dx = rstd * (dy * w - c1 - xh * c2);
                            }
                        },
                    );
                }
                (dw, db)
            })
            .collect();
        let (mut dw, mut db) = (vec![0f32; h], vec![0f32; h]);
        for (pw, pb) in partials {
            dw.iter_mut().zip(&pw).for_each(|(a, b)| *a += b);
            db.iter_mut().zip(&pb).for_each(|(a, b)| *a += b);
        }
        (tensor(&[r, h], dx), tensor(&[h], dw), tensor(&[h], db))
    }

    fn kiln_masked_softmax(
        x: FloatTensor<Self>,
        mask: FloatTensor<Self>,
        scale: f64,
    ) -> FloatTensor<Self> {
        let _p = super::profile::scope("softmax_fwd");
        let (x, mask) = (dense(x), dense(mask));
        let shape = x.shape().to_vec();
        let (heads, t, s) = (shape[1], shape[2], shape[3]);
        let ms = slice(&mask);
        let scale = scale as f32;
        let mut y = slice(&x).to_vec();
        // One task per (batch, head): rows of a task share the key mask of their batch.
        y.par_chunks_mut(t * s).enumerate().for_each(|(bh, block)| {
            let m = &ms[(bh / heads) * s..(bh / heads + 1) * s];
            for row in block.chunks_mut(s) {
                softmax_row(row, m, scale);
            }
        });
        tensor(&shape, y)
    }

    fn kiln_masked_softmax_backward(
        y: FloatTensor<Self>,
        dy: FloatTensor<Self>,
        scale: f64,
    ) -> FloatTensor<Self> {
        let _p = super::profile::scope("softmax_bwd");
        let (y, dy) = (dense(y), dense(dy));
        let shape = y.shape().to_vec();
        let s = shape[3];
        let scale = scale as f32;
        let mut dx = into_vec(dy);
        dx.par_chunks_mut(rows_per_task(s) * s)
            .zip(slice(&y).par_chunks(rows_per_task(s) * s))
            .for_each(|(dc, yc)| {
                for (dr, yr) in dc.chunks_mut(s).zip(yc.chunks(s)) {
                    softmax_backward_row(dr, yr, scale);
                }
            });
        tensor(&shape, dx)
    }

    fn kiln_rope(
        x: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        transpose: bool,
    ) -> FloatTensor<Self> {
        let _p = super::profile::scope(if transpose { "rope_bwd" } else { "rope_fwd" });
        let (x, cos, sin) = (dense(x), dense(cos), dense(sin));
        let shape = x.shape().to_vec();
        let (t, d) = (shape[1], shape[3]);
        let row = shape[2] * d;
        let (cos, sin) = (slice(&cos), slice(&sin));
        assert!(
            cos.len() == t * d && sin.len() == t * d,
            "rope tables must be [positions, head_dim]"
        );
        let mut y = into_vec(x);
        let rows = rows_per_task(row);
        y.par_chunks_mut(rows * row)
            .enumerate()
            .for_each(|(task, chunk)| {
                simd(
                    #[inline(always)]
                    || {
                        for (i, r) in chunk.chunks_mut(row).enumerate() {
                            // Row (b, position) of the flattened [B·T, heads·D].
                            let pos = (task * rows + i) % t;
                            let (c, s) = (&cos[pos * d..][..d], &sin[pos * d..][..d]);
                            for head in r.chunks_mut(d) {
                                rope_head(head, c, s, transpose);
                            }
                        }
                    },
                )
            });
        tensor(&shape, y)
    }

    fn kiln_cross_entropy(
        logits: FloatTensor<Self>,
        targets: IntTensor<Self>,
        ignore: i64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let _p = super::profile::scope("cross_entropy_fwd");
        let x = dense(logits);
        let (n, c) = (x.shape()[0], x.shape()[1]);
        let targets = class_indices(targets, n, c, ignore);
        let (mut losses, mut lse) = (vec![0f32; n], vec![0f32; n]);
        let rows = rows_per_task(c);
        let x = slice(&x);
        if n <= rows {
            // One task's worth (a classifier's batch): no trip through the pool.
            cross_entropy_rows(x, &targets, &mut losses, &mut lse);
        } else {
            x.par_chunks(rows * c)
                .zip(targets.par_chunks(rows))
                .zip(losses.par_chunks_mut(rows).zip(lse.par_chunks_mut(rows)))
                .for_each(|((xs, ts), (ls, es))| cross_entropy_rows(xs, ts, ls, es));
        }
        (tensor(&[n], losses), tensor(&[n], lse))
    }

    fn kiln_cross_entropy_backward(
        logits: FloatTensor<Self>,
        targets: IntTensor<Self>,
        ignore: i64,
        lse: FloatTensor<Self>,
        dloss: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        let _p = super::profile::scope("cross_entropy_bwd");
        let (lse, dloss) = (dense(lse), dense(dloss));
        let x = dense(logits);
        let (n, c) = (x.shape()[0], x.shape()[1]);
        let targets = class_indices(targets, n, c, ignore);
        // The logits are usually held by this backward alone: their buffer becomes the gradient.
        let mut dx = into_vec(x);
        let rows = rows_per_task(c);
        let (lse, dloss) = (slice(&lse), slice(&dloss));
        if n <= rows {
            cross_entropy_grad_rows(&mut dx, &targets, lse, dloss);
        } else {
            dx.par_chunks_mut(rows * c)
                .zip(targets.par_chunks(rows))
                .zip(lse.par_chunks(rows).zip(dloss.par_chunks(rows)))
                .for_each(|((dc, ts), (es, gs))| cross_entropy_grad_rows(dc, ts, es, gs));
        }
        tensor(&[n, c], dx)
    }

    fn kiln_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        mask: FloatTensor<Self>,
        spec: super::AttentionSpec,
        with_probs: bool,
    ) -> (FloatTensor<Self>, Option<FloatTensor<Self>>) {
        let _p = super::profile::scope("attention_fwd");
        let heads = spec.heads;
        // Grouped-query keys and values are repeated to the query heads (transformers' repeat_kv).
        let k = super::repeat_kv_heads::<Self>(k, heads, &q);
        let v = super::repeat_kv_heads::<Self>(v, heads, &q);
        let (q, k, v, mask) = (dense(q), dense(k), dense(v), dense(mask));
        let (b, t, h) = (q.shape()[0], q.shape()[1], q.shape()[2]);
        let a = Attn::new((b, t, h), h, spec);
        let (out, probs) = a.forward([slice(&q), slice(&k), slice(&v)], slice(&mask), with_probs);
        (
            tensor(&[b, t, h], out),
            probs.map(|p| tensor(&[b, heads, t, t], p)),
        )
    }

    fn kiln_attention_backward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        probs: FloatTensor<Self>,
        dout: FloatTensor<Self>,
        spec: super::AttentionSpec,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let _p = super::profile::scope("attention_bwd");
        let heads = spec.heads;
        let kv = burn::tensor::TensorMetadata::shape(&k).dims[2];
        let k = super::repeat_kv_heads::<Self>(k, heads, &q);
        let v = super::repeat_kv_heads::<Self>(v, heads, &q);
        let (q, k, v, probs, dout) = (dense(q), dense(k), dense(v), dense(probs), dense(dout));
        let (b, t, h) = (q.shape()[0], q.shape()[1], q.shape()[2]);
        let a = Attn::new((b, t, h), h, spec);
        let mut grads = [
            vec![0f32; b * t * h],
            vec![0f32; b * t * h],
            vec![0f32; b * t * h],
        ];
        let [dq, dk, dv] = grads.each_mut().map(|g| SharedMut(g.as_mut_ptr()));
        let out = attention::GradsOut {
            at: [dq, dk, dv],
            stride: h,
        };
        a.backward(
            [slice(&q), slice(&k), slice(&v)],
            slice(&probs),
            slice(&dout),
            out,
        );
        let [dq, dk, dv] = grads.map(|g| tensor(&[b, t, h], g));
        let group = |g| super::sum_kv_groups::<Self>(g, kv, heads);
        (dq, group(dk), group(dv))
    }

    fn kiln_attention_qkv(
        qkv: FloatTensor<Self>,
        mask: FloatTensor<Self>,
        spec: super::AttentionSpec,
        with_probs: bool,
    ) -> (FloatTensor<Self>, Option<FloatTensor<Self>>) {
        let heads = spec.heads;
        let _p = super::profile::scope("attention_fwd");
        let (qkv, mask) = (dense(qkv), dense(mask));
        let (b, t, h) = (qkv.shape()[0], qkv.shape()[1], qkv.shape()[2] / 3);
        let a = Attn::new((b, t, h), 3 * h, spec);
        let x = slice(&qkv);
        let (out, probs) = a.forward([x, &x[h..], &x[2 * h..]], slice(&mask), with_probs);
        (
            tensor(&[b, t, h], out),
            probs.map(|p| tensor(&[b, heads, t, t], p)),
        )
    }

    fn kiln_attention_qkv_backward(
        qkv: FloatTensor<Self>,
        probs: FloatTensor<Self>,
        dout: FloatTensor<Self>,
        spec: super::AttentionSpec,
    ) -> FloatTensor<Self> {
        let _p = super::profile::scope("attention_bwd");
        let (qkv, probs, dout) = (dense(qkv), dense(probs), dense(dout));
        let (b, t, h) = (qkv.shape()[0], qkv.shape()[1], qkv.shape()[2] / 3);
        let a = Attn::new((b, t, h), 3 * h, spec);
        let x = slice(&qkv);
        let mut grad = vec![0f32; b * t * 3 * h];
        let g = SharedMut(grad.as_mut_ptr());
        let out = attention::GradsOut {
            at: [g, SharedMut(g.at(h)), SharedMut(g.at(2 * h))],
            stride: 3 * h,
        };
        a.backward([x, &x[h..], &x[2 * h..]], slice(&probs), slice(&dout), out);
        tensor(&[b, t, 3 * h], grad)
    }

    fn kiln_adamw(
        p: FloatTensor<Self>,
        g: FloatTensor<Self>,
        m: FloatTensor<Self>,
        v: FloatTensor<Self>,
        h: super::AdamWStep,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let _p = super::profile::scope("adamw");
        let (mut p, g, mut m, mut v) = (dense(p), dense(g), dense(m), dense(v));
        let decay = (1.0 - h.lr * h.weight_decay) as f32;
        // 1 − β in f64 first: in f32, 1 − 0.999 is off by 1.3e-5 relative (torch forms it in double).
        let (b1, b2, eps) = (h.beta1 as f32, h.beta2 as f32, h.eps as f32);
        let (one_b1, one_b2) = ((1.0 - h.beta1) as f32, (1.0 - h.beta2) as f32);
        let (step, bc2, gs) = (
            (h.lr / h.bias_correction1) as f32,
            h.bias_correction2_sqrt as f32,
            h.grad_scale as f32,
        );
        // ArcArray::as_slice_mut copies only if the buffer is shared; moments are the optimizer's own.
        let (ps, ms, vs) = (
            p.as_slice_mut().expect("standard layout"),
            m.as_slice_mut().expect("standard layout"),
            v.as_slice_mut().expect("standard layout"),
        );
        const CHUNK: usize = 32_768;
        ps.par_chunks_mut(CHUNK)
            .zip(ms.par_chunks_mut(CHUNK))
            .zip(vs.par_chunks_mut(CHUNK))
            .zip(slice(&g).par_chunks(CHUNK))
            .for_each(|(((pc, mc), vc), gc)| {
                simd(
                    #[inline(always)]
                    || {
                        for (((p, m), v), &g) in
                            pc.iter_mut().zip(mc.iter_mut()).zip(vc.iter_mut()).zip(gc)
                        {
                            let g = g * gs;
                            *m = *m * b1 + g * one_b1;
                            *v = *v * b2 + g * g * one_b2;
                            let denom = v.sqrt() / bc2 + eps;
                            *p = *p * decay - step * (*m / denom);
                        }
                    },
                )
            });
        (
            NdArrayTensor::from(p),
            NdArrayTensor::from(m),
            NdArrayTensor::from(v),
        )
    }

    fn kiln_sgd(
        p: FloatTensor<Self>,
        g: FloatTensor<Self>,
        buf: Option<FloatTensor<Self>>,
        h: super::SgdStep,
    ) -> (FloatTensor<Self>, Option<FloatTensor<Self>>) {
        let _p = super::profile::scope("sgd");
        let (mut p, g) = (dense(p), dense(g));
        let (lr, wd, gs) = (h.lr as f32, h.weight_decay as f32, h.grad_scale as f32);
        let (mu, damp) = (h.momentum as f32, (1.0 - h.dampening) as f32);
        let (first, nesterov) = (buf.is_none(), h.nesterov);
        // Without momentum there is no buffer; on the first step torch starts it at the gradient.
        let mut buf = (mu != 0.0).then(|| match buf {
            Some(b) => dense(b),
            None => ArcArray::zeros(IxDyn(&[g.len()])),
        });
        // ArcArray::as_slice_mut copies only if the buffer is shared.
        let ps = p.as_slice_mut().expect("standard layout");
        let bs = buf
            .as_mut()
            .map(|b| b.as_slice_mut().expect("standard layout"));
        const CHUNK: usize = 32_768;
        let update = |pc: &mut [f32], gc: &[f32], bc: Option<&mut [f32]>| {
            simd(
                #[inline(always)]
                || match bc {
                    None => pc.iter_mut().zip(gc).for_each(|(p, &g)| {
                        *p -= lr * (g * gs + wd * *p);
                    }),
                    Some(bc) => pc.iter_mut().zip(gc).zip(bc).for_each(|((p, &g), b)| {
                        let g = g * gs + wd * *p;
                        *b = if first { g } else { *b * mu + g * damp };
                        *p -= lr * if nesterov { g + mu * *b } else { *b };
                    }),
                },
            )
        };
        let gs_ = slice(&g);
        match bs {
            None => ps
                .par_chunks_mut(CHUNK)
                .zip(gs_.par_chunks(CHUNK))
                .for_each(|(pc, gc)| update(pc, gc, None)),
            Some(bs) => ps
                .par_chunks_mut(CHUNK)
                .zip(gs_.par_chunks(CHUNK))
                .zip(bs.par_chunks_mut(CHUNK))
                .for_each(|((pc, gc), bc)| update(pc, gc, Some(bc))),
        }
        (NdArrayTensor::from(p), buf.map(NdArrayTensor::from))
    }

    fn kiln_sum_squares(x: FloatTensor<Self>) -> f64 {
        let x = dense(x);
        // Chunk sums added in chunk order (not rayon's `sum`, whose pairing follows the stealing):
        // the gradient norm, and with it clipping, is the same bits on any thread count.
        let parts: Vec<f64> = slice(&x)
            .par_chunks(32_768)
            .map(|c| c.iter().map(|&v| (v as f64) * (v as f64)).sum::<f64>())
            .collect();
        parts.iter().sum()
    }

    fn kiln_dropout_mask(
        shape: Shape,
        keep: f64,
        seed: u64,
        _: &Self::Device,
    ) -> FloatTensor<Self> {
        let _p = super::profile::scope("dropout_mask");
        let n = shape.num_elements();
        tensor(&[n], dropout_mask_values(n, keep, seed))
    }
}

#[cfg(test)]
mod tests {
    use super::host::*;
    use super::*;

    #[test]
    fn erf_approximation_is_accurate() {
        // Reference values of erf from tables (Abramowitz & Stegun, table 7.1).
        for (z, want) in [
            (0.0, 0.0),
            (0.5, 0.520_499_9),
            (1.0, 0.842_700_8),
            (2.0, 0.995_322_3),
            (-1.0, -0.842_700_8),
        ] {
            let (e, _) = erf_and_gauss(z);
            assert!((e - want).abs() < 3e-7, "erf({z}) = {e}, want {want}");
        }
    }

    #[test]
    fn fast_exp_is_accurate() {
        for i in -2000..=2000 {
            let x = i as f32 * 0.04;
            let (a, b) = (exp_fast(x), x.exp());
            assert!(((a - b) / b).abs() < 4e-7, "exp({x}) = {a}, want {b}");
        }
        assert_eq!(exp_fast(f32::MIN), 0.0);
        assert_eq!(exp_fast(-100.0), 0.0);
    }

    #[test]
    fn uniform_hash_is_uniform_enough() {
        let n = 100_000;
        let mean = (0..n).map(|i| uniform(7, i) as f64).sum::<f64>() / n as f64;
        assert!((mean - 0.5).abs() < 0.01, "{mean}");
        let kept = (0..n).filter(|&i| uniform(7, i) < 0.9).count() as f64 / n as f64;
        assert!((kept - 0.9).abs() < 0.01, "{kept}");
    }
}
