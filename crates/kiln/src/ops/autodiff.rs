//! Autodiff for the fused ops: each records one graph node whose backward calls the inner backend's
//! backward kernel, keeping only what that kernel needs (inputs, or the softmax output).

use burn::backend::Autodiff;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{Shape, TensorMetadata};
use burn_autodiff::checkpoint::{base::Checkpointer, strategy::CheckpointStrategy};
use burn_autodiff::grads::Gradients;
use burn_autodiff::ops::{Backward, Ops, OpsKind};
use burn_autodiff::NodeId;

use super::{ChunkedHeadLoss, ChunkedRows, KilnBackend, LinearCrossEntropy, LinearGrads, TpComm};

/// Hands `grad` to `parent` if it takes part in the graph.
fn give<B: KilnBackend>(
    grads: &mut Gradients,
    parent: Option<NodeId>,
    grad: Option<FloatTensor<B>>,
) {
    if let (Some(id), Some(g)) = (parent, grad) {
        grads.register::<B>(id, g);
    }
}

/// The parents' node ids (`None` for inputs outside the graph).
macro_rules! ids {
    ($ops:expr) => {
        $ops.parents.each_ref().map(|p| p.as_ref().map(|n| n.id))
    };
}

#[derive(Debug)]
struct LinearBias;
impl<B: KilnBackend> Backward<B, 3> for LinearBias {
    type State = (FloatTensor<B>, FloatTensor<B>);
    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let dy = grads.consume::<B>(&ops.node);
        let (x, w) = ops.state;
        let [px, pw, pb] = ids!(ops);
        let wants = LinearGrads {
            input: px.is_some(),
            weight: pw.is_some(),
            bias: pb.is_some(),
        };
        let (dx, dw, db) = B::kiln_linear_backward(x, w, dy, wants);
        give::<B>(grads, px, dx);
        give::<B>(grads, pw, dw);
        give::<B>(grads, pb, db);
    }
}

#[derive(Debug)]
struct LinearNoBias;
impl<B: KilnBackend> Backward<B, 2> for LinearNoBias {
    type State = (FloatTensor<B>, FloatTensor<B>);
    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let dy = grads.consume::<B>(&ops.node);
        let (x, w) = ops.state;
        let [px, pw] = ids!(ops);
        let wants = LinearGrads {
            input: px.is_some(),
            weight: pw.is_some(),
            bias: false,
        };
        let (dx, dw, _) = B::kiln_linear_backward(x, w, dy, wants);
        give::<B>(grads, px, dx);
        give::<B>(grads, pw, dw);
    }
}

/// Megatron's `f`: identity forward, gradient summed over the tensor-parallel group.
#[derive(Debug)]
struct TpEnter;
impl<B: KilnBackend> Backward<B, 1> for TpEnter {
    type State = TpComm;
    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let dy = grads.consume::<B>(&ops.node);
        let [px] = ids!(ops);
        give::<B>(grads, px, Some(B::kiln_tp_sum(dy, &ops.state)));
    }
}

/// Megatron's `g`: summed forward, identity backward.
#[derive(Debug)]
struct TpSum;
impl<B: KilnBackend> Backward<B, 1> for TpSum {
    type State = ();
    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let dy = grads.consume::<B>(&ops.node);
        let [px] = ids!(ops);
        give::<B>(grads, px, Some(dy));
    }
}

/// `x · mask(seed)`: the gradient is the same op on `dy`; only the seed is kept.
#[derive(Debug)]
struct DropoutApply;
impl<B: KilnBackend> Backward<B, 1> for DropoutApply {
    /// keep probability, seed.
    type State = (f64, u64);
    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let dy = grads.consume::<B>(&ops.node);
        let [px] = ids!(ops);
        let (keep, seed) = ops.state;
        give::<B>(grads, px, Some(B::kiln_dropout_apply(dy, keep, seed)));
    }
}

#[derive(Debug)]
struct Gelu;
impl<B: KilnBackend> Backward<B, 1> for Gelu {
    type State = FloatTensor<B>;
    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let dy = grads.consume::<B>(&ops.node);
        let [px] = ids!(ops);
        give::<B>(grads, px, Some(B::kiln_gelu_backward(ops.state, dy)));
    }
}

#[derive(Debug)]
struct RmsNormOp;
impl<B: KilnBackend> Backward<B, 2> for RmsNormOp {
    /// x, w, 1/rms.
    type State = (FloatTensor<B>, FloatTensor<B>, FloatTensor<B>);
    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let dy = grads.consume::<B>(&ops.node);
        let (x, w, rinv) = ops.state;
        let (dx, dw) = B::kiln_rms_norm_backward(x, w, rinv, dy);
        let [px, pw] = ids!(ops);
        give::<B>(grads, px, Some(dx));
        give::<B>(grads, pw, Some(dw));
    }
}

#[derive(Debug)]
struct SwigluOp;
impl<B: KilnBackend> Backward<B, 2> for SwigluOp {
    type State = (FloatTensor<B>, FloatTensor<B>);
    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let dy = grads.consume::<B>(&ops.node);
        let (g, u) = ops.state;
        let (dg, du) = B::kiln_swiglu_backward(g, u, dy);
        let [pg, pu] = ids!(ops);
        give::<B>(grads, pg, Some(dg));
        give::<B>(grads, pu, Some(du));
    }
}

#[derive(Debug)]
struct LayerNormOp;
impl<B: KilnBackend> Backward<B, 3> for LayerNormOp {
    /// x, w, mean, 1/σ.
    type State = (
        FloatTensor<B>,
        FloatTensor<B>,
        FloatTensor<B>,
        FloatTensor<B>,
    );
    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let dy = grads.consume::<B>(&ops.node);
        let (x, w, mean, rstd) = ops.state;
        let (dx, dw, db) = B::kiln_layer_norm_backward(x, w, mean, rstd, dy);
        let [px, pw, pb] = ids!(ops);
        give::<B>(grads, px, Some(dx));
        give::<B>(grads, pw, Some(dw));
        give::<B>(grads, pb, Some(db));
    }
}

#[derive(Debug)]
struct ResidualLayerNorm;
impl<B: KilnBackend> Backward<B, 4> for ResidualLayerNorm {
    /// z (the normalised input), w, mean, 1/σ, and the dropout.
    type State = (
        FloatTensor<B>,
        FloatTensor<B>,
        FloatTensor<B>,
        FloatTensor<B>,
        super::Dropout,
    );
    fn backward(self, ops: Ops<Self::State, 4>, grads: &mut Gradients, _: &mut Checkpointer) {
        let dy = grads.consume::<B>(&ops.node);
        let (z, w, mean, rstd, dropout) = ops.state;
        let (dz, dw, db) = B::kiln_layer_norm_backward(z, w, mean, rstd, dy);
        let [px, pr, pw, pb] = ids!(ops);
        if px.is_some() {
            give::<B>(
                grads,
                px,
                Some(B::kiln_dropout_backward(dz.clone(), dropout)),
            );
        }
        give::<B>(grads, pr, Some(dz));
        give::<B>(grads, pw, Some(dw));
        give::<B>(grads, pb, Some(db));
    }
}

#[derive(Debug)]
struct MaskedSoftmax;
impl<B: KilnBackend> Backward<B, 1> for MaskedSoftmax {
    /// The softmax output and the scale.
    type State = (FloatTensor<B>, f64);
    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let dy = grads.consume::<B>(&ops.node);
        let (y, scale) = ops.state;
        let [px] = ids!(ops);
        give::<B>(
            grads,
            px,
            Some(B::kiln_masked_softmax_backward(y, dy, scale)),
        );
    }
}

#[derive(Debug)]
struct Rope;
impl<B: KilnBackend> Backward<B, 1> for Rope {
    /// The cos and sin tables (constants).
    type State = (FloatTensor<B>, FloatTensor<B>);
    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let dy = grads.consume::<B>(&ops.node);
        let (cos, sin) = ops.state;
        let [px] = ids!(ops);
        give::<B>(grads, px, Some(B::kiln_rope(dy, cos, sin, true)));
    }
}

#[derive(Debug)]
struct CrossEntropyOp;
impl<B: KilnBackend> Backward<B, 1> for CrossEntropyOp {
    /// The logits, the targets, the ignored target and each row's log-sum-exp.
    type State = (FloatTensor<B>, IntTensor<B>, i64, FloatTensor<B>);
    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let dloss = grads.consume::<B>(&ops.node);
        let (x, targets, ignore, lse) = ops.state;
        let [px] = ids!(ops);
        let dx = B::kiln_cross_entropy_backward(x, targets, ignore, lse, dloss);
        give::<B>(grads, px, Some(dx));
    }
}

#[derive(Debug)]
struct LinearCrossEntropyOp;
impl<B: KilnBackend> Backward<B, 2> for LinearCrossEntropyOp {
    /// The input gradient of the rows' summed losses, computed with the losses; the weight's;
    /// and what recomputing the weight's needs where the rows' upstream gradients differ (the
    /// head's input and weight, the targets, the ignored target, the chunk, each row's
    /// log-sum-exp).
    type State = (Option<FloatTensor<B>>, HeadWeightGrad<B>, ChunkedHead<B>);
    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let dloss = grads.consume::<B>(&ops.node);
        let (dx, dw, head) = ops.state;
        let [px, pw] = ids!(ops);
        let g = burn::tensor::Tensor::<B, 1>::from_primitive(burn::tensor::TensorPrimitive::Float(
            dloss,
        ));
        // Row r's input gradient is its upstream gradient times its unit one.
        let dx = dx.map(|d| {
            let d = burn::tensor::Tensor::<B, 2>::from_primitive(
                burn::tensor::TensorPrimitive::Float(d),
            );
            let n = d.dims()[0];
            (d * g.clone().reshape([n, 1])).into_primitive().tensor()
        });
        // The weight's sums every row's: one factor where the rows' upstream gradients are one
        // (a mean or sum of the losses, as every causal-LM loss takes them; ignored rows add
        // nothing whatever their factor).
        let recompute = || head.weight_grad(g.clone().into_primitive().tensor());
        let dw = match dw {
            HeadWeightGrad::NotWanted => None,
            HeadWeightGrad::Deferred => Some(recompute()),
            HeadWeightGrad::ForUnitRows(d) => {
                let values: Vec<f32> = g
                    .clone()
                    .into_data()
                    .convert::<f32>()
                    .into_vec()
                    .expect("f32 upstream gradients");
                let first = values.first().copied().unwrap_or(0.0);
                Some(match values.iter().all(|&v| v == first) {
                    true => {
                        let d = burn::tensor::Tensor::<B, 2>::from_primitive(
                            burn::tensor::TensorPrimitive::Float(d),
                        );
                        (d * f64::from(first)).into_primitive().tensor()
                    }
                    false => recompute(),
                })
            }
        };
        give::<B>(grads, px, dx);
        give::<B>(grads, pw, dw);
    }
}

/// A chunked head's weight gradient as its forward left it.
#[derive(Debug, Clone)]
enum HeadWeightGrad<B: KilnBackend> {
    /// The weight is frozen.
    NotWanted,
    /// Computed with the losses, for an upstream gradient of one per row.
    ForUnitRows(FloatTensor<B>),
    /// Left for the backward ([`ChunkedRows::Scored`] rows).
    Deferred,
}

/// What recomputing a chunked head's weight gradient needs.
#[derive(Debug, Clone)]
struct ChunkedHead<B: KilnBackend> {
    x: FloatTensor<B>,
    w: FloatTensor<B>,
    targets: IntTensor<B>,
    head: ChunkedHeadLoss,
    lse: FloatTensor<B>,
}

impl<B: KilnBackend> ChunkedHead<B> {
    /// `dw` for per-row upstream gradients `g [N]`: each chunk's logits recomputed, turned into
    /// their gradient and multiplied out.
    fn weight_grad(self, g: FloatTensor<B>) -> FloatTensor<B> {
        use burn::tensor::{Int, Tensor, TensorPrimitive};
        let f = |t: FloatTensor<B>| TensorPrimitive::Float(t);
        let x = Tensor::<B, 2>::from_primitive(f(self.x));
        let (lse, g) = (
            Tensor::<B, 1>::from_primitive(f(self.lse)),
            Tensor::<B, 1>::from_primitive(f(g)),
        );
        let targets = Tensor::<B, 1, Int>::from_primitive(self.targets);
        let wants = LinearGrads {
            input: false,
            weight: true,
            bias: false,
        };
        let mut dw: Option<Tensor<B, 2>> = None;
        for (start, len) in super::balanced_chunks(x.dims()[0], self.head.chunk) {
            let xc = x.clone().narrow(0, start, len).into_primitive().tensor();
            let logits = B::kiln_linear(xc.clone(), self.w.clone(), None);
            let dlogits = self.head.logits_grad::<B>(
                logits,
                targets.clone().narrow(0, start, len),
                lse.clone().narrow(0, start, len),
                g.clone().narrow(0, start, len),
            );
            let (_, d, _) = B::kiln_linear_backward(xc, self.w.clone(), dlogits, wants);
            let d = Tensor::<B, 2>::from_primitive(f(d.expect("asked for")));
            dw = Some(match dw {
                Some(sum) => sum + d,
                None => d,
            });
        }
        dw.expect("at least one chunk").into_primitive().tensor()
    }
}

#[derive(Debug)]
struct EmbeddingOp;
impl<B: KilnBackend> Backward<B, 1> for EmbeddingOp {
    /// The looked-up ids and the table's rows.
    type State = (IntTensor<B>, usize);
    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let dy = grads.consume::<B>(&ops.node);
        let (ids, vocab) = ops.state;
        let [pw] = ids!(ops);
        give::<B>(grads, pw, Some(B::kiln_embedding_backward(dy, ids, vocab)));
    }
}

#[derive(Debug)]
struct Reshape;
impl<B: KilnBackend> Backward<B, 1> for Reshape {
    /// The input's shape.
    type State = Shape;
    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let dy = grads.consume::<B>(&ops.node);
        let [px] = ids!(ops);
        give::<B>(grads, px, Some(B::kiln_reshape(dy, ops.state)));
    }
}

#[derive(Debug)]
struct Attention;
impl<B: KilnBackend> Backward<B, 3> for Attention {
    /// q, k, v, probabilities, and the forward's spec.
    type State = (
        FloatTensor<B>,
        FloatTensor<B>,
        FloatTensor<B>,
        FloatTensor<B>,
        super::AttentionSpec,
    );
    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let dout = grads.consume::<B>(&ops.node);
        let (q, k, v, probs, spec) = ops.state;
        let (dq, dk, dv) = B::kiln_attention_backward(q, k, v, probs, dout, spec);
        let [pq, pk, pv] = ids!(ops);
        give::<B>(grads, pq, Some(dq));
        give::<B>(grads, pk, Some(dk));
        give::<B>(grads, pv, Some(dv));
    }
}

#[derive(Debug)]
struct AttentionQkv;
impl<B: KilnBackend> Backward<B, 1> for AttentionQkv {
    /// qkv, probabilities, and the forward's spec.
    type State = (FloatTensor<B>, FloatTensor<B>, super::AttentionSpec);
    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let dout = grads.consume::<B>(&ops.node);
        let (qkv, probs, spec) = ops.state;
        let dqkv = B::kiln_attention_qkv_backward(qkv, probs, dout, spec);
        let [px] = ids!(ops);
        give::<B>(grads, px, Some(dqkv));
    }
}

impl<B: KilnBackend, C: CheckpointStrategy> KilnBackend for Autodiff<B, C> {
    fn kiln_has_tf32() -> bool {
        B::kiln_has_tf32()
    }

    fn kiln_has_bf16() -> bool {
        B::kiln_has_bf16()
    }

    fn kiln_bf16_is_native() -> bool {
        B::kiln_bf16_is_native()
    }

    // A weight held in bf16 is frozen: a constant of the graph, never differentiated.
    fn kiln_bf16_store(w: FloatTensor<Self>) -> Option<FloatTensor<Self>> {
        B::kiln_bf16_store(Self::inner(w)).map(Self::from_inner)
    }

    fn kiln_bf16_load(w: FloatTensor<Self>) -> FloatTensor<Self> {
        Self::from_inner(B::kiln_bf16_load(Self::inner(w)))
    }

    fn kiln_device_counters(device: &Self::Device) -> Option<super::DeviceCounters> {
        B::kiln_device_counters(device)
    }

    /// Through [`KilnBackend::kiln_linear`] on the weight's transposed view, so the product and
    /// its gradients are the backend's Linear GEMMs (cuBLAS on CUDA), not Burn's matmul.
    fn kiln_linear_in_out(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        b: Option<FloatTensor<Self>>,
    ) -> FloatTensor<Self> {
        let w = <Self as burn::tensor::ops::FloatTensorOps<Self>>::float_transpose(w);
        Self::kiln_linear(x, w, b)
    }

    fn kiln_from_host(data: Vec<f32>, shape: Shape, device: &Self::Device) -> FloatTensor<Self> {
        Self::from_inner(B::kiln_from_host(data, shape, device))
    }

    fn kiln_into_owned(x: FloatTensor<Self>) -> FloatTensor<Self> {
        Self::from_inner(B::kiln_into_owned(Self::inner(x)))
    }

    fn kiln_reshape(x: FloatTensor<Self>, shape: Shape) -> FloatTensor<Self> {
        match Reshape
            .prepare::<C>([x.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let from = x.primitive.shape();
                prep.finish(from, B::kiln_reshape(x.primitive, shape))
            }
            OpsKind::UnTracked(prep) => prep.finish(B::kiln_reshape(x.primitive, shape)),
        }
    }

    fn kiln_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        mask: FloatTensor<Self>,
        spec: super::AttentionSpec,
        with_probs: bool,
    ) -> (FloatTensor<Self>, Option<FloatTensor<Self>>) {
        let inner = |with_probs| {
            B::kiln_attention(
                q.primitive.clone(),
                k.primitive.clone(),
                v.primitive.clone(),
                mask.primitive.clone(),
                spec,
                with_probs,
            )
        };
        // Known before the kernel runs, so an untracked call (inference) skips the probabilities.
        match Attention
            .prepare::<C>([q.node.clone(), k.node.clone(), v.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let (out, probs) = inner(true);
                let probs = probs.expect("asked for the probabilities");
                let probs_out = with_probs.then(|| Self::from_inner(probs.clone()));
                let state = (
                    q.primitive.clone(),
                    k.primitive.clone(),
                    v.primitive.clone(),
                    probs,
                    spec,
                );
                (prep.finish(state, out), probs_out)
            }
            OpsKind::UnTracked(prep) => {
                let (out, probs) = inner(with_probs);
                (prep.finish(out), probs.map(Self::from_inner))
            }
        }
    }

    fn kiln_attention_qkv(
        qkv: FloatTensor<Self>,
        mask: FloatTensor<Self>,
        spec: super::AttentionSpec,
        with_probs: bool,
    ) -> (FloatTensor<Self>, Option<FloatTensor<Self>>) {
        let inner = |with_probs| {
            B::kiln_attention_qkv(
                qkv.primitive.clone(),
                mask.primitive.clone(),
                spec,
                with_probs,
            )
        };
        match AttentionQkv
            .prepare::<C>([qkv.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let (out, probs) = inner(true);
                let probs = probs.expect("asked for the probabilities");
                let probs_out = with_probs.then(|| Self::from_inner(probs.clone()));
                let state = (qkv.primitive.clone(), probs, spec);
                (prep.finish(state, out), probs_out)
            }
            OpsKind::UnTracked(prep) => {
                let (out, probs) = inner(with_probs);
                (prep.finish(out), probs.map(Self::from_inner))
            }
        }
    }

    fn kiln_linear(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        b: Option<FloatTensor<Self>>,
    ) -> FloatTensor<Self> {
        match b {
            Some(b) => match LinearBias
                .prepare::<C>([x.node.clone(), w.node.clone(), b.node.clone()])
                .compute_bound()
                .stateful()
            {
                OpsKind::Tracked(prep) => {
                    // The backward keeps the operands in the form the products read them.
                    let (x, w) = B::kiln_linear_operands(x.primitive, w.primitive);
                    let y = B::kiln_linear(x.clone(), w.clone(), Some(b.primitive));
                    prep.finish((x, w), y)
                }
                OpsKind::UnTracked(prep) => {
                    prep.finish(B::kiln_linear(x.primitive, w.primitive, Some(b.primitive)))
                }
            },
            None => match LinearNoBias
                .prepare::<C>([x.node.clone(), w.node.clone()])
                .compute_bound()
                .stateful()
            {
                OpsKind::Tracked(prep) => {
                    let (x, w) = B::kiln_linear_operands(x.primitive, w.primitive);
                    let y = B::kiln_linear(x.clone(), w.clone(), None);
                    prep.finish((x, w), y)
                }
                OpsKind::UnTracked(prep) => {
                    prep.finish(B::kiln_linear(x.primitive, w.primitive, None))
                }
            },
        }
    }

    fn kiln_gelu(x: FloatTensor<Self>) -> FloatTensor<Self> {
        match Gelu
            .prepare::<C>([x.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let y = B::kiln_gelu(x.primitive.clone());
                prep.finish(x.primitive, y)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::kiln_gelu(x.primitive)),
        }
    }

    fn kiln_rms_norm(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        eps: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let (y, rinv) = B::kiln_rms_norm(x.primitive.clone(), w.primitive.clone(), eps);
        let rinv_out = Self::from_inner(rinv.clone());
        let out = match RmsNormOp
            .prepare::<C>([x.node.clone(), w.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish((x.primitive, w.primitive, rinv), y),
            OpsKind::UnTracked(prep) => prep.finish(y),
        };
        (out, rinv_out)
    }

    fn kiln_tp_enter(x: FloatTensor<Self>, tp: &TpComm) -> FloatTensor<Self> {
        match TpEnter
            .prepare::<C>([x.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish(tp.clone(), x.primitive),
            OpsKind::UnTracked(prep) => prep.finish(x.primitive),
        }
    }

    fn kiln_tp_sum(x: FloatTensor<Self>, tp: &TpComm) -> FloatTensor<Self> {
        let y = B::kiln_tp_sum(x.primitive.clone(), tp);
        TpSum
            .prepare::<C>([x.node.clone()])
            .compute_bound()
            .stateless(y)
    }

    fn kiln_swiglu(g: FloatTensor<Self>, u: FloatTensor<Self>) -> FloatTensor<Self> {
        let y = B::kiln_swiglu(g.primitive.clone(), u.primitive.clone());
        match SwigluOp
            .prepare::<C>([g.node.clone(), u.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish((g.primitive, u.primitive), y),
            OpsKind::UnTracked(prep) => prep.finish(y),
        }
    }

    fn kiln_layer_norm(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        b: FloatTensor<Self>,
        eps: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let (y, mean, rstd) =
            B::kiln_layer_norm(x.primitive.clone(), w.primitive.clone(), b.primitive, eps);
        let stats = (
            Self::from_inner(mean.clone()),
            Self::from_inner(rstd.clone()),
        );
        let out = match LayerNormOp
            .prepare::<C>([x.node.clone(), w.node.clone(), b.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish((x.primitive, w.primitive, mean, rstd), y),
            OpsKind::UnTracked(prep) => prep.finish(y),
        };
        (out, stats.0, stats.1)
    }

    fn kiln_residual_layer_norm(
        x: FloatTensor<Self>,
        r: FloatTensor<Self>,
        w: FloatTensor<Self>,
        b: FloatTensor<Self>,
        eps: f64,
        dropout: super::Dropout,
    ) -> super::ResidualNorm<Self> {
        let super::ResidualNorm { y, z, mean, rstd } = B::kiln_residual_layer_norm(
            x.primitive,
            r.primitive,
            w.primitive.clone(),
            b.primitive,
            eps,
            dropout,
        );
        let aux = (
            Self::from_inner(z.clone()),
            Self::from_inner(mean.clone()),
            Self::from_inner(rstd.clone()),
        );
        let out = match ResidualLayerNorm
            .prepare::<C>([
                x.node.clone(),
                r.node.clone(),
                w.node.clone(),
                b.node.clone(),
            ])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish((z, w.primitive, mean, rstd, dropout), y),
            OpsKind::UnTracked(prep) => prep.finish(y),
        };
        super::ResidualNorm {
            y: out,
            z: aux.0,
            mean: aux.1,
            rstd: aux.2,
        }
    }

    fn kiln_dropout_backward(dz: FloatTensor<Self>, dropout: super::Dropout) -> FloatTensor<Self> {
        Self::from_inner(B::kiln_dropout_backward(dz.primitive, dropout))
    }

    fn kiln_masked_softmax(
        x: FloatTensor<Self>,
        mask: FloatTensor<Self>,
        scale: f64,
    ) -> FloatTensor<Self> {
        // The mask is a constant: only the scores are differentiated.
        let y = B::kiln_masked_softmax(x.primitive, mask.primitive, scale);
        match MaskedSoftmax
            .prepare::<C>([x.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish((y.clone(), scale), y),
            OpsKind::UnTracked(prep) => prep.finish(y),
        }
    }

    fn kiln_rope(
        x: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        transpose: bool,
    ) -> FloatTensor<Self> {
        // The tables are constants: only `x` is differentiated.
        let (cos, sin) = (Self::inner(cos), Self::inner(sin));
        let y = B::kiln_rope(x.primitive, cos.clone(), sin.clone(), transpose);
        match Rope
            .prepare::<C>([x.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish((cos, sin), y),
            OpsKind::UnTracked(prep) => prep.finish(y),
        }
    }

    fn kiln_cross_entropy(
        logits: FloatTensor<Self>,
        targets: IntTensor<Self>,
        ignore: i64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let (losses, lse) =
            B::kiln_cross_entropy(logits.primitive.clone(), targets.clone(), ignore);
        let lse_out = Self::from_inner(lse.clone());
        // The targets are integers: only the logits are differentiated.
        let out = match CrossEntropyOp
            .prepare::<C>([logits.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish((logits.primitive, targets, ignore, lse), losses),
            OpsKind::UnTracked(prep) => prep.finish(losses),
        };
        (out, lse_out)
    }

    fn kiln_linear_cross_entropy(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        targets: IntTensor<Self>,
        head: &ChunkedHeadLoss,
        _: LinearGrads,
    ) -> LinearCrossEntropy<Self> {
        let weight_wanted = !w.node.requirement.is_none();
        // Scored rows' factors differ: their weight gradient is the backward's to compute.
        let wants = LinearGrads {
            input: !x.node.requirement.is_none(),
            weight: weight_wanted && head.rows == ChunkedRows::Uniform,
            bias: false,
        };
        let out = B::kiln_linear_cross_entropy(
            x.primitive.clone(),
            w.primitive.clone(),
            targets.clone(),
            head,
            wants,
        );
        let lse = out.lse.clone();
        let statistics = out.statistics.map(|s| {
            s.map(|v| {
                burn::tensor::Tensor::from_primitive(burn::tensor::TensorPrimitive::Float(
                    Self::from_inner(v.into_primitive().tensor()),
                ))
            })
        });
        let weight_grad = match (out.weight_grad, weight_wanted) {
            (Some(d), _) => HeadWeightGrad::ForUnitRows(d),
            (None, true) => HeadWeightGrad::Deferred,
            (None, false) => HeadWeightGrad::NotWanted,
        };
        let losses = match LinearCrossEntropyOp
            .prepare::<C>([x.node.clone(), w.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let recompute = ChunkedHead {
                    x: x.primitive,
                    w: w.primitive,
                    targets,
                    head: head.clone(),
                    lse: out.lse,
                };
                prep.finish((out.input_grad, weight_grad, recompute), out.losses)
            }
            OpsKind::UnTracked(prep) => prep.finish(out.losses),
        };
        LinearCrossEntropy {
            losses,
            lse: Self::from_inner(lse),
            input_grad: None,
            weight_grad: None,
            statistics,
        }
    }

    fn kiln_embedding(w: FloatTensor<Self>, ids: IntTensor<Self>) -> FloatTensor<Self> {
        let vocab = w.primitive.shape().dims[0];
        let out = B::kiln_embedding(w.primitive.clone(), ids.clone());
        // The ids are integers: only the table is differentiated.
        match EmbeddingOp
            .prepare::<C>([w.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish((ids, vocab), out),
            OpsKind::UnTracked(prep) => prep.finish(out),
        }
    }

    fn kiln_dropout_mask(
        shape: Shape,
        keep: f64,
        seed: u64,
        device: &Self::Device,
    ) -> FloatTensor<Self> {
        Self::from_inner(B::kiln_dropout_mask(shape, keep, seed, device))
    }

    fn kiln_dropout_apply(x: FloatTensor<Self>, keep: f64, seed: u64) -> FloatTensor<Self> {
        match DropoutApply
            .prepare::<C>([x.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let y = B::kiln_dropout_apply(x.primitive, keep, seed);
                prep.finish((keep, seed), y)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::kiln_dropout_apply(x.primitive, keep, seed)),
        }
    }
}
