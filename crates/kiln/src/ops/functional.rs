//! The functional ops models call, as `torch.nn.functional` is to PyTorch's modules: Linear (with
//! a bf16-held weight), GELU, LayerNorm, RMSNorm, SwiGLU, rotary embedding, cross-entropy, softmax,
//! attention (padding-masked, causal, windowed) and dropout, each on the backend's fused kernel.

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Int, Tensor};

use super::*;

/// A Linear's `(dx, dw, db)`, each present where it was wanted ([`LinearGrads`]).
pub type LinearBackward<B> = (
    Option<FloatTensor<B>>,
    Option<FloatTensor<B>>,
    Option<FloatTensor<B>>,
);

/// [`KilnBackend::kiln_linear_cross_entropy`]'s result: each row's loss, and the gradients of
/// their sum (every row's upstream gradient 1) where they were asked for.
pub struct LinearCrossEntropy<B: KilnBackend> {
    pub losses: FloatTensor<B>,
    /// Each row's log-sum-exp of its logits.
    pub lse: FloatTensor<B>,
    pub input_grad: Option<FloatTensor<B>>,
    pub weight_grad: Option<FloatTensor<B>>,
    /// Each row's statistics, for [`ChunkedRows::Scored`] rows.
    pub statistics: Option<TokenStatistics<B>>,
}

/// What the rows of a chunked head's loss are for ([`KilnBackend::kiln_linear_cross_entropy`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChunkedRows {
    /// Their losses are summed or averaged alike, as every causal-LM loss takes them: the
    /// weight's gradient is computed with the losses, for an upstream gradient of one per row.
    Uniform,
    /// They are a sequence's scored tokens, whose sum a preference loss weighs by its own factor:
    /// each row's [`TokenStatistics`] too, and the weight's gradient waits for the backward,
    /// which knows the factors.
    Scored,
}

/// How a chunked head takes its loss ([`KilnBackend::kiln_linear_cross_entropy`]).
#[derive(Debug, Clone)]
pub struct ChunkedHeadLoss {
    /// The target of rows without one.
    pub ignore: i64,
    /// At most this many rows of logits at once.
    pub chunk: usize,
    pub rows: ChunkedRows,
    /// Under tensor parallelism, this rank's columns of the vocabulary: the head's weight holds
    /// their rows, and each row's loss is the whole row's (equal on every rank); the input's
    /// gradient is this rank's part of the sum over the group.
    pub slice: Option<VocabSlice>,
}

impl ChunkedHeadLoss {
    /// A chunk's losses and log-sum-exps from its logits (this rank's columns of them).
    pub(crate) fn cross_entropy<B: KilnBackend>(
        &self,
        logits: FloatTensor<B>,
        targets: Tensor<B, 1, Int>,
    ) -> (Tensor<B, 1>, Tensor<B, 1>) {
        match &self.slice {
            None => {
                let (l, lse) = B::kiln_cross_entropy(logits, targets.into_primitive(), self.ignore);
                (t(l), t(lse))
            }
            Some(s) => s.cross_entropy(t(logits), targets, self.ignore),
        }
    }

    /// The gradient of a chunk's logits for each row's upstream gradient `g`, from the rows'
    /// log-sum-exps.
    pub(crate) fn logits_grad<B: KilnBackend>(
        &self,
        logits: FloatTensor<B>,
        targets: Tensor<B, 1, Int>,
        lse: Tensor<B, 1>,
        g: Tensor<B, 1>,
    ) -> FloatTensor<B> {
        match &self.slice {
            None => B::kiln_cross_entropy_backward(
                logits,
                targets.into_primitive(),
                self.ignore,
                p(lse),
                p(g),
            ),
            Some(s) => p(s.cross_entropy_grad(t(logits), targets, self.ignore, lse, g)),
        }
    }
}

/// `n` rows in chunks of at most `chunk`, all of one size but the last: as few chunks as
/// `chunk` allows, split evenly (`(start, len)` of each).
pub fn balanced_chunks(n: usize, chunk: usize) -> Vec<(usize, usize)> {
    let count = n.div_ceil(chunk.max(1)).max(1);
    let size = n.div_ceil(count).max(1);
    (0..n).step_by(size).map(|s| (s, size.min(n - s))).collect()
}

/// Which gradients a Linear's backward computes ([`KilnBackend::kiln_linear_backward`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LinearGrads {
    pub input: bool,
    pub weight: bool,
    pub bias: bool,
}

/// Whether `w` is a weight held in bf16 by [`to_bf16_store`] (the CPU keeps its bits as u16).
pub fn is_bf16_store<B: Backend, const D: usize>(w: &Tensor<B, D>) -> bool {
    matches!(
        w.dtype(),
        burn::tensor::DType::U16 | burn::tensor::DType::BF16
    )
}

/// `w` held in bf16 (see [`KilnBackend::kiln_bf16_store`]); `None` where the backend cannot.
pub fn to_bf16_store<B: KilnBackend, const D: usize>(w: Tensor<B, D>) -> Option<Tensor<B, D>> {
    B::kiln_bf16_store(p(w)).map(t)
}

/// The f32 values of `w`, which may be held in bf16.
pub fn from_bf16_store<B: KilnBackend, const D: usize>(w: Tensor<B, D>) -> Tensor<B, D> {
    if is_bf16_store(&w) {
        t(B::kiln_bf16_load(p(w)))
    } else {
        w
    }
}

/// `x wᵀ + b` over the last dimension of `x` (PyTorch's `F.linear`).
pub fn linear<B: KilnBackend, const D: usize>(
    x: Tensor<B, D>,
    w: Tensor<B, 2>,
    b: Option<Tensor<B, 1>>,
) -> Tensor<B, D> {
    over_rows(x, |x| B::kiln_linear(x, p(w), b.map(p)))
}

/// `x w + b` over the last dimension for a weight laid out `[in, out]`, or as
/// [`inference_layout`] made it (see [`KilnBackend::kiln_linear_in_out`]).
pub fn linear_in_out<B: KilnBackend, const D: usize>(
    x: Tensor<B, D>,
    w: Tensor<B, 2>,
    b: Option<Tensor<B, 1>>,
) -> Tensor<B, D> {
    over_rows(x, |x| B::kiln_linear_in_out(x, p(w), b.map(p)))
}

/// `w [out, in]` as this backend's inference products read it ([`linear_in_out`]): `[in, out]`,
/// or panels on an AVX-512 CPU (see [`KilnBackend::kiln_inference_layout`]).
pub fn inference_layout<B: KilnBackend>(w: Tensor<B, 2>) -> Tensor<B, 2> {
    t(B::kiln_inference_layout(p(w)))
}

/// `f` over `x`'s rows (all leading dimensions flattened to `[M, K]`), its `[M, n]` result put
/// back under the leading dimensions.
pub(crate) fn over_rows<B: KilnBackend, const D: usize>(
    x: Tensor<B, D>,
    f: impl FnOnce(FloatTensor<B>) -> FloatTensor<B>,
) -> Tensor<B, D> {
    let mut dims = x.dims();
    let k = dims[D - 1];
    let m: usize = dims[..D - 1].iter().product();
    let y = t::<B, 2>(f(p(reshape(x, [m, k]))));
    dims[D - 1] = y.dims()[1];
    reshape(y, dims)
}

/// Exact GELU, transformers' `"gelu"`.
pub fn gelu<B: KilnBackend, const D: usize>(x: Tensor<B, D>) -> Tensor<B, D> {
    let dims = x.dims();
    let n: usize = dims.iter().product();
    reshape(t::<B, 1>(B::kiln_gelu(p(reshape(x, [n])))), dims)
}

/// Layer norm over the last dimension.
pub fn layer_norm<B: KilnBackend, const D: usize>(
    x: Tensor<B, D>,
    w: Tensor<B, 1>,
    b: Tensor<B, 1>,
    eps: f64,
) -> Tensor<B, D> {
    let dims = x.dims();
    let h = dims[D - 1];
    let r: usize = dims[..D - 1].iter().product();
    let (y, _, _) = B::kiln_layer_norm(p(reshape(x, [r, h])), p(w), p(b), eps);
    reshape(t::<B, 2>(y), dims)
}

/// RMS norm over the last dimension (Llama's `RMSNorm`).
pub fn rms_norm<B: KilnBackend, const D: usize>(
    x: Tensor<B, D>,
    w: Tensor<B, 1>,
    eps: f64,
) -> Tensor<B, D> {
    let dims = x.dims();
    let h = dims[D - 1];
    let r: usize = dims[..D - 1].iter().product();
    let (y, _) = B::kiln_rms_norm(p(reshape(x, [r, h])), p(w), eps);
    reshape(t::<B, 2>(y), dims)
}

/// `silu(gate) · up` (the SwiGLU MLP's gate), element-wise.
pub fn swiglu<B: KilnBackend, const D: usize>(
    gate: Tensor<B, D>,
    up: Tensor<B, D>,
) -> Tensor<B, D> {
    let dims = gate.dims();
    let n: usize = dims.iter().product();
    let y = B::kiln_swiglu(p(reshape(gate, [n])), p(reshape(up, [n])));
    reshape(t::<B, 1>(y), dims)
}

/// Entering a tensor-parallel region: see [`KilnBackend::kiln_tp_enter`].
pub fn tp_enter<B: KilnBackend, const D: usize>(x: Tensor<B, D>, tp: &TpComm) -> Tensor<B, D> {
    t(B::kiln_tp_enter(p(x), tp))
}

/// Leaving a tensor-parallel region: see [`KilnBackend::kiln_tp_sum`].
pub fn tp_sum<B: KilnBackend, const D: usize>(x: Tensor<B, D>, tp: &TpComm) -> Tensor<B, D> {
    t(B::kiln_tp_sum(p(x), tp))
}

/// `layer_norm(dropout(x) + residual)` over the last dimension (dropout only in training).
pub fn residual_layer_norm<B: KilnBackend, const D: usize>(
    x: Tensor<B, D>,
    residual: Tensor<B, D>,
    w: Tensor<B, 1>,
    b: Tensor<B, 1>,
    eps: f64,
    dropout: f64,
) -> Tensor<B, D> {
    let dims = x.dims();
    let h = dims[D - 1];
    let r: usize = dims[..D - 1].iter().product();
    let out = B::kiln_residual_layer_norm(
        p(reshape(x, [r, h])),
        p(reshape(residual, [r, h])),
        p(w),
        p(b),
        eps,
        training_dropout::<B>(dropout),
    );
    reshape(t::<B, 2>(out.y), dims)
}

/// `softmax(scores·scale + mask)` for attention scores `[B, H, T, S]` and an additive key mask `[B, S]`.
pub fn masked_softmax<B: KilnBackend>(
    scores: Tensor<B, 4>,
    mask: Tensor<B, 2>,
    scale: f64,
) -> Tensor<B, 4> {
    t(B::kiln_masked_softmax(p(scores), p(mask), scale))
}

/// Rotary position embedding of `x [B, T, heads, D]` (see [`KilnBackend::kiln_rope`]).
pub fn rope<B: KilnBackend>(
    x: Tensor<B, 4>,
    cos: &Tensor<B, 2>,
    sin: &Tensor<B, 2>,
) -> Tensor<B, 4> {
    t(B::kiln_rope(p(x), p(cos.clone()), p(sin.clone()), false))
}

/// 1.0 where a target counts (is not `ignore`), else 0.0; and the targets with ignored ones set to
/// class 0, so that gathering by them stays in range.
pub(crate) fn kept_targets<B: Backend>(
    targets: Tensor<B, 1, Int>,
    ignore: i64,
) -> (Tensor<B, 1>, Tensor<B, 1, Int>) {
    let keep = targets.clone().not_equal_elem(ignore);
    let safe = targets.mask_fill(keep.clone().bool_not(), 0);
    (keep.float(), safe)
}

/// Rows `ids [N]` of the table `w [V, H]` (see [`KilnBackend::kiln_embedding`]).
pub fn embedding<B: KilnBackend>(w: Tensor<B, 2>, ids: Tensor<B, 1, Int>) -> Tensor<B, 2> {
    t(B::kiln_embedding(p(w), ids.into_primitive()))
}

/// Per-row cross-entropy of `logits [N, C]` against `targets [N]` (0 where the target is `ignore`),
/// with its gradient from one fused kernel on the CPU.
pub fn cross_entropy<B: KilnBackend>(
    logits: Tensor<B, 2>,
    targets: Tensor<B, 1, Int>,
    ignore: i64,
) -> Tensor<B, 1> {
    t(B::kiln_cross_entropy(p(logits), targets.into_primitive(), ignore).0)
}

/// Per-row cross-entropy of the logits `x wᵀ` against `targets` (0 where the target is
/// `ignore`), `chunk` rows of logits at a time, forward and backward (see
/// [`KilnBackend::kiln_linear_cross_entropy`]): the head's product and the loss without the
/// whole `[N, V]` logits or their gradient. Under `slice`, `w` holds this rank's rows of a
/// vocabulary-parallel head, and the losses are the whole rows' on every rank.
pub fn linear_cross_entropy<B: KilnBackend>(
    x: Tensor<B, 2>,
    w: Tensor<B, 2>,
    targets: Tensor<B, 1, Int>,
    ignore: i64,
    chunk: usize,
    slice: Option<VocabSlice>,
) -> Tensor<B, 1> {
    let head = ChunkedHeadLoss {
        ignore,
        chunk,
        rows: ChunkedRows::Uniform,
        slice,
    };
    t(chunked_head_loss(x, w, targets, head).losses)
}

/// [`linear_cross_entropy`] for a sequence's scored tokens ([`ChunkedRows::Scored`]): each
/// row's cross-entropy and its [`TokenStatistics`] (without gradient), a chunk of rows at a
/// time.
pub fn scored_linear_cross_entropy<B: KilnBackend>(
    x: Tensor<B, 2>,
    w: Tensor<B, 2>,
    targets: Tensor<B, 1, Int>,
    ignore: i64,
    chunk: usize,
    slice: Option<VocabSlice>,
) -> (Tensor<B, 1>, TokenStatistics<B>) {
    let head = ChunkedHeadLoss {
        ignore,
        chunk,
        rows: ChunkedRows::Scored,
        slice,
    };
    let out = chunked_head_loss(x, w, targets, head);
    let statistics = out.statistics.expect("scored rows have statistics");
    (t(out.losses), statistics)
}

fn chunked_head_loss<B: KilnBackend>(
    x: Tensor<B, 2>,
    w: Tensor<B, 2>,
    targets: Tensor<B, 1, Int>,
    head: ChunkedHeadLoss,
) -> LinearCrossEntropy<B> {
    // Each rank's input gradient is its columns' part: the group sums them.
    let x = match &head.slice {
        Some(s) => tp_enter(x, &s.tp),
        None => x,
    };
    // Outside autodiff no gradient is asked for; the autodiff backend asks for its own.
    let none = LinearGrads {
        input: false,
        weight: false,
        bias: false,
    };
    let targets = targets.into_primitive();
    B::kiln_linear_cross_entropy(p(x), p(w), targets, &head, none)
}

/// `[q, k, v]`, each `[B, T, H]`, of a `[B, T, 3H]` tensor.
pub(crate) fn split_qkv<B: Backend>(qkv: FloatTensor<B>) -> [FloatTensor<B>; 3] {
    let qkv = t::<B, 3>(qkv);
    let h = qkv.dims()[2] / 3;
    [0, 1, 2].map(|i| p(qkv.clone().narrow(2, i * h, h)))
}

/// Multi-head self-attention core, `dropout(softmax(q kᵀ/√d + mask)) v`, for q, k and v side by
/// side in one `[B, T, 3H]` tensor (see [`KilnBackend::kiln_attention_qkv`]), `heads` heads each,
/// and an additive key mask `[B, T]`. Dropout applies only in training.
pub fn attention_qkv<B: KilnBackend>(
    qkv: Tensor<B, 3>,
    mask: Tensor<B, 2>,
    heads: usize,
    dropout: f64,
) -> Tensor<B, 3> {
    let spec = AttentionSpec::new(heads, qkv.dims()[2] / 3 / heads, Window::FULL)
        .with_dropout(training_dropout::<B>(dropout));
    let (out, _) = B::kiln_attention_qkv(p(qkv), p(mask), spec, false);
    t(out)
}

/// Causal multi-head self-attention for `q [B, T, H]` (`heads` heads side by side) and `k, v`
/// `[B, T, H]`, or of fewer heads for grouped-query attention (see [`KilnBackend::kiln_attention`]):
/// query `i` attends to keys `0..=i`.
pub fn causal_attention<B: KilnBackend>(
    q: Tensor<B, 3>,
    k: Tensor<B, 3>,
    v: Tensor<B, 3>,
    heads: usize,
) -> Tensor<B, 3> {
    let [b, tq, h] = q.dims();
    let spec = AttentionSpec::new(heads, h / heads, Window::CAUSAL);
    let mask = Tensor::<B, 2>::zeros([b, tq], &q.device());
    let (out, _) = B::kiln_attention(p(q), p(k), p(v), p(mask), spec, false);
    t(out)
}

/// Bidirectional multi-head self-attention for `q, k, v [B, T, H]` (`heads` heads side by side)
/// and an additive key mask `[B, T]`, on the fused kernel. Dropout applies only in training.
pub fn attention<B: KilnBackend>(
    q: Tensor<B, 3>,
    k: Tensor<B, 3>,
    v: Tensor<B, 3>,
    mask: Tensor<B, 2>,
    heads: usize,
    dropout: f64,
) -> Tensor<B, 3> {
    windowed_attention(q, k, v, mask, heads, Window::FULL, dropout)
}

/// Multi-head self-attention of `q, k, v [B, T, H]` within `window` under the additive key mask
/// `[B, T]`, on the fused kernel (dropout in training only).
pub fn windowed_attention<B: KilnBackend>(
    q: Tensor<B, 3>,
    k: Tensor<B, 3>,
    v: Tensor<B, 3>,
    mask: Tensor<B, 2>,
    heads: usize,
    window: Window,
    dropout: f64,
) -> Tensor<B, 3> {
    let spec = AttentionSpec::new(heads, q.dims()[2] / heads, window)
        .with_dropout(training_dropout::<B>(dropout));
    let (out, _) = B::kiln_attention(p(q), p(k), p(v), p(mask), spec, false);
    t(out)
}

/// Inverted dropout, active only when the backend records gradients (training).
pub fn dropout<B: KilnBackend, const D: usize>(x: Tensor<B, D>, prob: f64) -> Tensor<B, D> {
    if !B::ad_enabled() || prob <= 0.0 {
        return x;
    }
    let seed = next_dropout_seed();
    t(B::kiln_dropout_apply(p(x), 1.0 - prob, seed))
}
