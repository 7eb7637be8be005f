//! The composed reference implementations [`super::KilnBackend`]'s defaults call: attention as
//! plain Burn ops (grouped key/value heads repeated and summed back), batched products, reshapes.

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Shape, Tensor};

use super::*;

/// `a · b` over the last two dimensions ([`KilnBackend::kiln_batched_matmul`]).
pub fn bmm<B: KilnBackend, const D: usize>(a: Tensor<B, D>, b: Tensor<B, D>) -> Tensor<B, D> {
    t(B::kiln_batched_matmul(p(a), p(b)))
}

/// [`KilnBackend::kiln_attention`] composed of Burn's ops and the backend's softmax and dropout
/// (the default; a backend's own kernel may fall back to it for shapes it does not take).
pub(crate) fn composed_attention<B: KilnBackend>(
    [q, k, v]: [FloatTensor<B>; 3],
    mask: FloatTensor<B>,
    spec: AttentionSpec,
    with_probs: bool,
) -> (FloatTensor<B>, Option<FloatTensor<B>>) {
    let AttentionSpec {
        heads,
        window,
        scale,
        dropout,
    } = spec;
    let (k, v) = (
        repeat_kv_heads::<B>(k, heads, &q),
        repeat_kv_heads::<B>(v, heads, &q),
    );
    let (q, k, v) = (t::<B, 3>(q), t::<B, 3>(k), t::<B, 3>(v));
    let [b, tq, h] = q.dims();
    let split = |x: Tensor<B, 3>| x.reshape([b, tq, heads, h / heads]).swap_dims(1, 2);
    let mut scores = bmm(split(q), split(k).swap_dims(2, 3));
    if !window.covers(tq) {
        let band = window.band::<B>(tq, &scores.device());
        scores = scores + band.unsqueeze::<4>();
    }
    let probs = t::<B, 4>(B::kiln_masked_softmax(p(scores), mask, scale));
    let dropped = attention_dropout::<B>(probs.clone(), dropout);
    let out = bmm(dropped, split(v)).swap_dims(1, 2).reshape([b, tq, h]);
    (p(out), with_probs.then(|| p(probs)))
}

/// [`KilnBackend::kiln_attention_backward`] composed of Burn's ops (the default).
pub(crate) fn composed_attention_backward<B: KilnBackend>(
    [q, k, v]: [FloatTensor<B>; 3],
    probs: FloatTensor<B>,
    dout: FloatTensor<B>,
    spec: AttentionSpec,
) -> (FloatTensor<B>, FloatTensor<B>, FloatTensor<B>) {
    let AttentionSpec {
        heads,
        scale,
        dropout,
        ..
    } = spec;
    let kv = burn::tensor::TensorMetadata::shape(&k).dims[2];
    let (k, v) = (
        repeat_kv_heads::<B>(k, heads, &q),
        repeat_kv_heads::<B>(v, heads, &q),
    );
    let (q, k, v) = (t::<B, 3>(q), t::<B, 3>(k), t::<B, 3>(v));
    let [b, tq, h] = q.dims();
    let split = |x: Tensor<B, 3>| x.reshape([b, tq, heads, h / heads]).swap_dims(1, 2);
    let merge = |x: Tensor<B, 4>| x.swap_dims(1, 2).reshape([b, tq, h]);
    let probs = t::<B, 4>(probs);
    let dout = split(t::<B, 3>(dout));
    let dropped = attention_dropout::<B>(probs.clone(), dropout);
    let dv = bmm(dropped.swap_dims(2, 3), dout.clone());
    let dprobs = attention_dropout::<B>(bmm(dout, split(v).swap_dims(2, 3)), dropout);
    let ds = t::<B, 4>(B::kiln_masked_softmax_backward(p(probs), p(dprobs), scale));
    let dq = bmm(ds.clone(), split(k));
    let dk = bmm(ds.swap_dims(2, 3), split(q));
    (
        p(merge(dq)),
        sum_kv_groups::<B>(p(merge(dk)), kv, heads),
        sum_kv_groups::<B>(p(merge(dv)), kv, heads),
    )
}

/// Keys or values `[B, T, kv]` of fewer heads than the queries `q [B, T, H]` (grouped-query
/// attention) repeated to `[B, T, H]`, query head `i` reading key/value head `i / (heads / kv
/// heads)` (transformers' `repeat_kv`); as they are when as wide as `q`.
pub(crate) fn repeat_kv_heads<B: Backend>(
    x: FloatTensor<B>,
    heads: usize,
    q: &FloatTensor<B>,
) -> FloatTensor<B> {
    let h = burn::tensor::TensorMetadata::shape(q).dims[2];
    let x = t::<B, 3>(x);
    let [b, s, kv] = x.dims();
    if kv == h {
        return p(x);
    }
    let d = h / heads;
    let (kvh, n) = (kv / d, heads / (kv / d));
    p(x.reshape([b, s, kvh, 1, d])
        .expand([b, s, kvh, n, d])
        .reshape([b, s, h]))
}

/// The transpose of [`repeat_kv_heads`]: `[B, T, H]` gradients summed over each key/value head's
/// group of query heads, to `[B, T, kv]`.
pub(crate) fn sum_kv_groups<B: Backend>(
    dx: FloatTensor<B>,
    kv: usize,
    heads: usize,
) -> FloatTensor<B> {
    let dx = t::<B, 3>(dx);
    let [b, s, h] = dx.dims();
    if kv == h {
        return p(dx);
    }
    let d = h / heads;
    let (kvh, n) = (kv / d, heads / (kv / d));
    p(dx.reshape([b, s, kvh, n, d]).sum_dim(3).reshape([b, s, kv]))
}

/// `x · dropout_mask(seed)` ([`KilnBackend::kiln_dropout_apply`]; identity without dropout).
pub(crate) fn attention_dropout<B: KilnBackend>(x: Tensor<B, 4>, dropout: Dropout) -> Tensor<B, 4> {
    if !dropout.is_active() {
        return x;
    }
    t(B::kiln_dropout_apply(p(x), dropout.keep(), dropout.seed))
}

/// [`Tensor::reshape`] through [`KilnBackend::kiln_reshape`]: free on the CPU backend when `x` is
/// contiguous (and differentiable under autodiff).
pub fn reshape<B: KilnBackend, const D: usize, const D2: usize>(
    x: Tensor<B, D>,
    dims: [usize; D2],
) -> Tensor<B, D2> {
    t(B::kiln_reshape(p(x), Shape::new(dims)))
}

/// `x` with a buffer of its own ([`KilnBackend::kiln_into_owned`]): for freshly initialised weights.
pub fn owned<B: KilnBackend, const D: usize>(x: Tensor<B, D>) -> Tensor<B, D> {
    t(B::kiln_into_owned(p(x)))
}
