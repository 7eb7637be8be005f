//! The attention core on CUDA for the sizes the scalar kernels ([`super::attention`]) lose at:
//! the composed algorithm (scores, masked softmax, dropout, product with v; the same four
//! products backward), with every product a cuBLAS call that reads q, k, v and the output
//! gradient where the projections left them and writes the output and the gradients in the
//! projections' layout.
//!
//! Burn's composed chain split the heads out first: `[B, T, heads, D]` → `[B, heads, T, D]`, a
//! copy per operand, per gradient and for the output (`IntoContiguousKernel`: 194 launches and
//! 29 % of the CubeCL time of a BERT-base bf16 128×128 step on an H100, the largest share). A
//! head of a `[B, T, H]` tensor is a matrix with rows `H` apart, and over the batch the heads lie
//! one stride apart, so one strided-batched GEMM per head reads it in place
//! ([`crate::ops::blas_layout::per_head_calls`], whose layout is checked on the host). Grouped-
//! query heads read their key/value head, and their key and value gradients add into it in head
//! order (β = 1), so keys and values are never repeated.
//!
//! The products run in f32 (TF32 under `--tf32`), as the composed chain's do; the softmax, its
//! backward and the dropout are the backend's kernels, so probabilities and masks equal the other
//! paths'. A window (causal, sliding) is the composed chain's band mask added to the scores.

use burn::tensor::{DType, Shape};
use burn_cubecl::cubecl::cuda::CudaRuntime;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_dtype;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};

use super::attention::{layout, Layout, Qkv};
use super::cublas::{as_cuda, batched_calls, from_cuda};
use crate::ops::blas_layout::{per_head_calls, HeadOf, HeadOperand};
use crate::ops::{AttentionSpec, KilnBackend};

/// Where q, k and v lie: their buffers (one, bound three times, when fused) and each one's head
/// layout.
struct Operands {
    q: CubeTensor<CudaRuntime>,
    k: CubeTensor<CudaRuntime>,
    v: CubeTensor<CudaRuntime>,
    /// `(q, k, v)` heads; k and v not transposed (each product says how it reads them).
    heads: [HeadOperand; 3],
}

/// A head of a `[B, T, row]` tensor starting at column `offset`.
fn head(l: &Layout, offset: usize, row: usize) -> HeadOperand {
    HeadOperand {
        offset,
        batch_stride: l.t * row,
        head_stride: l.d(),
        ld: row,
        trans: false,
    }
}

/// One `(b, head)` matrix of a `[B, heads, T, T]` tensor (scores, probabilities, their gradients).
fn square(l: &Layout) -> HeadOperand {
    HeadOperand {
        offset: 0,
        batch_stride: l.heads * l.t * l.t,
        head_stride: l.t * l.t,
        ld: l.t,
        trans: false,
    }
}

fn transposed(o: HeadOperand) -> HeadOperand {
    HeadOperand { trans: true, ..o }
}

/// Whether this path takes a call over `[B, T, H]` with `heads` heads: CUDA with cuBLAS, f32
/// operands, and a size the per-head products win at ([`super::attention::blas_wanted`]).
pub fn takes<R: CubeRuntime>(x: &[&CubeTensor<R>], [b, t, _]: [usize; 3], heads: usize) -> bool {
    let probs = b.saturating_mul(heads).saturating_mul(t).saturating_mul(t);
    super::attention::blas_wanted(probs)
        && super::is_cuda::<R>()
        && x.iter().all(|t| t.dtype == DType::F32)
        && super::cublas::ready()
}

fn operands<R: CubeRuntime>(x: Qkv<R>, l: &Layout) -> Operands {
    let cuda = |t: CubeTensor<R>| {
        as_cuda(into_contiguous(t)).unwrap_or_else(|_| unreachable!("checked by takes"))
    };
    match x {
        Qkv::Separate([q, k, v]) => Operands {
            q: cuda(q),
            k: cuda(k),
            v: cuda(v),
            heads: [head(l, 0, l.h), head(l, 0, l.krs), head(l, 0, l.krs)],
        },
        Qkv::Fused(qkv) => {
            let qkv = cuda(qkv);
            Operands {
                q: qkv.clone(),
                k: qkv.clone(),
                v: qkv,
                heads: [head(l, 0, l.rs), head(l, l.h, l.rs), head(l, 2 * l.h, l.rs)],
            }
        }
    }
}

fn empty(like: &CubeTensor<CudaRuntime>, dims: &[usize]) -> CubeTensor<CudaRuntime> {
    empty_device_dtype(
        like.client.clone(),
        like.device.clone(),
        Shape::from(dims.to_vec()),
        DType::F32,
    )
}

/// Runs `C(b, h) = op(L(b, h)) · op(R(b, h))` over every batch and head (see [`per_head_calls`]).
fn products(
    l: &Layout,
    (m, n, k): (usize, usize, usize),
    (lt, lo): (&CubeTensor<CudaRuntime>, (HeadOperand, HeadOf)),
    (rt, ro): (&CubeTensor<CudaRuntime>, (HeadOperand, HeadOf)),
    (ct, co): (&CubeTensor<CudaRuntime>, (HeadOperand, HeadOf)),
) {
    let calls = per_head_calls((m, n, k), (l.b, l.heads, l.group()), lo, ro, co);
    // BLAS's A is R's buffer, its B is L's.
    let queued = batched_calls(rt, lt, ct, &calls, crate::ops::tf32_allowed());
    assert!(
        queued,
        "cuBLAS took attention's first product but not this one"
    );
}

type Be<R, F, I, BT> = CubeBackend<R, F, I, BT>;

/// `(out [B, T, H], probs [B, heads, T, T] if with_probs)`, as [`super::attention::forward`].
/// Callers check [`takes`] first.
pub fn forward<R, F, I, BT>(
    x: Qkv<R>,
    mask: CubeTensor<R>,
    spec: AttentionSpec,
    with_probs: bool,
) -> (CubeTensor<R>, Option<CubeTensor<R>>)
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    let AttentionSpec {
        heads,
        window,
        scale,
        dropout,
    } = spec;
    let l = layout(&x, heads);
    let o = operands(x, &l);
    let [qh, kh, vh] = o.heads;
    let sq = square(&l);
    let (q, kv) = (HeadOf::Query, HeadOf::KeyValue);
    let scores = empty(&o.q, &[l.b, heads, l.t, l.t]);
    products(
        &l,
        (l.t, l.t, l.d()),
        (&o.q, (qh, q)),
        (&o.k, (transposed(kh), kv)),
        (&scores, (sq, q)),
    );
    let scores = if window.covers(l.t) {
        from_cuda(scores)
    } else {
        let band = window.band::<Be<R, F, I, BT>>(l.t, &mask.device);
        let scores = crate::ops::t::<Be<R, F, I, BT>, 4>(from_cuda(scores));
        crate::ops::p(scores + band.unsqueeze::<4>())
    };
    let probs = Be::<R, F, I, BT>::kiln_masked_softmax(scores, mask, scale);
    let dropped = crate::ops::attention_dropout::<Be<R, F, I, BT>>(
        crate::ops::t::<Be<R, F, I, BT>, 4>(probs.clone()),
        dropout,
    );
    let dropped = as_cuda(into_contiguous(crate::ops::p::<Be<R, F, I, BT>, 4>(
        dropped,
    )))
    .unwrap_or_else(|_| unreachable!("a CUDA tensor"));
    let out = empty(&o.q, &[l.b, l.t, l.h]);
    products(
        &l,
        (l.t, l.d(), l.t),
        (&dropped, (sq, q)),
        (&o.v, (vh, kv)),
        (&out, (head(&l, 0, l.h), q)),
    );
    (from_cuda(out), with_probs.then_some(probs))
}

/// The gradients of [`forward`]'s inputs for the output gradient `dout [B, T, H]`: `[dq, dk, dv]`
/// for separate inputs, `[dqkv]` for one fused tensor, as [`super::attention::backward`].
pub fn backward<R, F, I, BT>(
    x: Qkv<R>,
    probs: CubeTensor<R>,
    dout: CubeTensor<R>,
    spec: AttentionSpec,
) -> Vec<CubeTensor<R>>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    let AttentionSpec {
        heads,
        scale,
        dropout,
        ..
    } = spec;
    let l = layout(&x, heads);
    let fused = matches!(x, Qkv::Fused(_));
    let o = operands(x, &l);
    let [qh, kh, vh] = o.heads;
    let sq = square(&l);
    let (q, kv) = (HeadOf::Query, HeadOf::KeyValue);
    let cuda = |t: CubeTensor<R>| {
        as_cuda(into_contiguous(t)).unwrap_or_else(|_| unreachable!("a CUDA tensor"))
    };
    let probs = into_contiguous(probs);
    let dout = cuda(dout);
    let douth = head(&l, 0, l.h);
    // The gradients' buffers and where dq, dk and dv lie in them.
    let (grads, [dqh, dkh, dvh]) = if fused {
        let g = empty(&o.q, &[l.b, l.t, 3 * l.h]);
        let heads = [
            head(&l, 0, 3 * l.h),
            head(&l, l.h, 3 * l.h),
            head(&l, 2 * l.h, 3 * l.h),
        ];
        (vec![g], heads)
    } else {
        let g = vec![
            empty(&o.q, &[l.b, l.t, l.h]),
            empty(&o.q, &[l.b, l.t, l.krs]),
            empty(&o.q, &[l.b, l.t, l.krs]),
        ];
        (g, [douth, head(&l, 0, l.krs), head(&l, 0, l.krs)])
    };
    let (gq, gk, gv) = if fused {
        (&grads[0], &grads[0], &grads[0])
    } else {
        (&grads[0], &grads[1], &grads[2])
    };
    let dropped = crate::ops::attention_dropout::<Be<R, F, I, BT>>(
        crate::ops::t::<Be<R, F, I, BT>, 4>(probs.clone()),
        dropout,
    );
    let dropped = cuda(crate::ops::p::<Be<R, F, I, BT>, 4>(dropped));
    // dv(b, g) = Σ_group dropout(p)ᵀ · dout.
    products(
        &l,
        (l.t, l.d(), l.t),
        (&dropped, (transposed(sq), q)),
        (&dout, (douth, q)),
        (gv, (dvh, kv)),
    );
    // dprobs = dropout(dout · vᵀ), then the softmax's backward (scale included).
    let dprobs = empty(&o.q, &[l.b, heads, l.t, l.t]);
    products(
        &l,
        (l.t, l.t, l.d()),
        (&dout, (douth, q)),
        (&o.v, (transposed(vh), kv)),
        (&dprobs, (sq, q)),
    );
    let dprobs = crate::ops::attention_dropout::<Be<R, F, I, BT>>(
        crate::ops::t::<Be<R, F, I, BT>, 4>(from_cuda::<R>(dprobs)),
        dropout,
    );
    let ds = Be::<R, F, I, BT>::kiln_masked_softmax_backward(
        probs,
        crate::ops::p::<Be<R, F, I, BT>, 4>(dprobs),
        scale,
    );
    let ds = cuda(ds);
    // dq = ds · k, dk(b, g) = Σ_group dsᵀ · q.
    products(
        &l,
        (l.t, l.d(), l.t),
        (&ds, (sq, q)),
        (&o.k, (kh, kv)),
        (gq, (dqh, q)),
    );
    products(
        &l,
        (l.t, l.d(), l.t),
        (&ds, (transposed(sq), q)),
        (&o.q, (qh, q)),
        (gk, (dkh, kv)),
    );
    grads.into_iter().map(from_cuda).collect()
}
