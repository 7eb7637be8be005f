//! Fused operations with hand-written backward passes: Linear (GEMM with the transpose folded into
//! strides, bias fused), exact GELU, LayerNorm, scaled+masked softmax, and dropout masks.
//!
//! [`KilnBackend`]'s default methods compose plain Burn tensor ops, so every backend works (CUDA uses
//! them as they are); the CPU backend overrides them with fused, multi-threaded kernels
//! ([`cpu`]); `Autodiff<B>` records one graph node per fused op and calls `B`'s backward kernels
//! ([`autodiff`]). Tests check fused == composed, values and gradients.

pub(crate) mod amx;
mod autodiff;
pub mod bf16;
mod bf16_pack;
pub mod blas_layout;
mod cpu;
pub mod isa;
pub mod profile;
mod split;
mod strided;
pub use strided::Strided;

use burn::tensor::backend::Backend;
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{Distribution, Int, Shape, Tensor, TensorPrimitive};

fn t<B: Backend, const D: usize>(p: FloatTensor<B>) -> Tensor<B, D> {
    Tensor::from_primitive(TensorPrimitive::Float(p))
}
fn p<B: Backend, const D: usize>(t: Tensor<B, D>) -> FloatTensor<B> {
    t.into_primitive().tensor()
}
use p as p_;

mod precision;
pub use precision::*;
mod composed;
pub use composed::*;
mod attention;
pub use attention::*;
mod functional;
pub use functional::*;
mod token_statistics;
pub use token_statistics::{token_statistics, TokenStatistics};
mod vocab_slice;
pub use vocab_slice::{row_cross_entropy, VocabSlice};
mod runtime;
pub use runtime::*;

/// Set by the normalisation kernels (LayerNorm, RMSNorm) when a row's variance is not finite: the
/// activations overflowed f32 (or hold NaN) and the layer's output collapsed to zeros or NaN. PyTorch's own
/// kernels collapse the same way without a word; the trainer turns this into a non-finite step.
/// Process-wide: the kernels run on the thread pool's threads.
static ACTIVATION_OVERFLOW: std::sync::atomic::AtomicBool =
    std::sync::atomic::AtomicBool::new(false);

pub(crate) fn note_activation_overflow() {
    ACTIVATION_OVERFLOW.store(true, std::sync::atomic::Ordering::Relaxed);
}

/// Whether any normalisation saw overflowed activations since the last call (and clears it).
pub fn take_activation_overflow() -> bool {
    ACTIVATION_OVERFLOW.swap(false, std::sync::atomic::Ordering::Relaxed)
}

/// The one collective the tensor-parallel ops need: an element-wise sum over the ranks of a
/// tensor-parallel group, of host values (activations are on the host on CPU; a CUDA build copies
/// them). `parallel` implements it over any engine; ops never depend on `parallel`. A failed sum
/// ends the worker (it runs inside backward, which cannot return an error; the engines' watchdog
/// names the missing peer first).
pub trait TpReduce: Send + Sync + std::fmt::Debug {
    fn sum(&self, values: Vec<f32>) -> Vec<f32>;
    /// Element-wise max (a shift that keeps a vocab-parallel softmax finite; no gradient).
    fn max(&self, values: Vec<f32>) -> Vec<f32>;
    /// This rank's index in the group, and the group's size.
    fn rank(&self) -> usize;
    fn size(&self) -> usize;
}

/// A tensor-parallel group's communicator, as the ops and the models hold it.
pub type TpComm = std::sync::Arc<dyn TpReduce>;

/// `1/x`, element-wise, as a true division. Not Burn's `recip`: burn-ndarray computes that with the
/// CPU's approximate reciprocal instruction (12 bits on AVX2, 14 on AVX-512) on the vector-aligned
/// middle of the buffer and exactly on its ends, so its result depended on the CPU kind and on the
/// address the allocator gave the buffer — it made Adafactor differ from run to run.
/// (`clippy.toml` disallows `recip`.)
pub fn recip_exact<B: Backend, const D: usize>(x: Tensor<B, D>) -> Tensor<B, D> {
    Tensor::ones_like(&x) / x
}

/// The part of `0..n` that chunk `i` of `parts` near-equal chunks covers (the first `n % parts`
/// chunks hold one more), as Megatron and NxD split uneven dimensions: how every tensor-parallel
/// shard and ZeRO-1 partition is cut.
pub fn chunk_range(n: usize, parts: usize, i: usize) -> std::ops::Range<usize> {
    let (base, extra) = (n / parts, n % parts);
    let start = i * base + i.min(extra);
    start..start + base + usize::from(i < extra)
}

/// `a · b` of 2-D tensors in the current [`MatmulPrecision`]: under bf16 both operands are cast
/// to bf16 and the product back to f32 (backends with bf16 matmuls accumulate in f32).
fn matmul_2d<B: Backend>(a: Tensor<B, 2>, b: Tensor<B, 2>) -> Tensor<B, 2> {
    use burn::tensor::DType;
    match matmul_precision() {
        MatmulPrecision::F32 => a.matmul(b),
        MatmulPrecision::Bf16 => a
            .cast(DType::BF16)
            .matmul(b.cast(DType::BF16))
            .cast(DType::F32),
    }
}

/// The scalars of one SGD step for one parameter (torch.optim.SGD's).
#[derive(Debug, Clone, Copy)]
pub struct SgdStep {
    pub lr: f64,
    /// 0 for parameters exempt from decay; torch adds `weight_decay·p` to the gradient.
    pub weight_decay: f64,
    pub momentum: f64,
    pub dampening: f64,
    pub nesterov: bool,
    /// Multiplies the gradient first (gradient clipping's coefficient).
    pub grad_scale: f64,
}

/// The scalars of one AdamW step for one parameter.
#[derive(Debug, Clone, Copy)]
pub struct AdamWStep {
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    /// 0 for parameters exempt from decay.
    pub weight_decay: f64,
    /// 1 − β₁ᵗ.
    pub bias_correction1: f64,
    /// √(1 − β₂ᵗ).
    pub bias_correction2_sqrt: f64,
    /// Multiplies the gradient first (gradient clipping's coefficient).
    pub grad_scale: f64,
}

/// A GPU's running counts, read before and after timed steps by the bench.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct DeviceCounters {
    /// Kernels launched by this process so far, library calls (cuBLAS) counted once each; `None`
    /// where the runtime keeps no count (wgpu).
    pub launches: Option<u64>,
    /// Bytes the allocator holds from the device (its pools), as `torch.cuda.memory_reserved`.
    pub reserved_bytes: u64,
    /// Bytes of live tensors, as `torch.cuda.memory_allocated`.
    pub in_use_bytes: u64,
}

/// What [`KilnBackend::kiln_residual_layer_norm`] returns: the output `y`, the normalised input
/// `z = dropout(x) + r` and the per-row `mean` and `rstd` its backward reads.
pub struct ResidualNorm<B: Backend> {
    pub y: FloatTensor<B>,
    pub z: FloatTensor<B>,
    pub mean: FloatTensor<B>,
    pub rstd: FloatTensor<B>,
}

/// Backend operations kiln fuses. Shapes: `x [M, K]`, `w [N, K]` (PyTorch layout), `b [N]` for linear;
/// `x [R, H]` for layer norm; `x [B, H, T, S]` with `mask [B, S]` (additive) for softmax.
pub trait KilnBackend: Backend {
    /// `x` viewed with another shape of the same size. Burn's ndarray reshape always copies; the CPU
    /// kernel only relabels a contiguous buffer, which matters because every fused op below flattens
    /// its input to rows and back.
    fn kiln_reshape(x: FloatTensor<Self>, shape: Shape) -> FloatTensor<Self> {
        Self::float_reshape(x, shape)
    }

    /// A tensor of host values. Burn's ndarray backend keeps a tensor made from `TensorData` as a
    /// borrowed view and copies it on *every* later use; the CPU kernel moves the `Vec` into an owned
    /// buffer once. Model weights must be made this way (or through [`Self::kiln_into_owned`]).
    fn kiln_from_host(data: Vec<f32>, shape: Shape, device: &Self::Device) -> FloatTensor<Self> {
        let data = burn::tensor::TensorData::new(data, shape).convert::<Self::FloatElem>();
        Self::float_from_data(data, device)
    }

    /// `x` with a buffer of its own (see [`Self::kiln_from_host`]); a no-op elsewhere.
    fn kiln_into_owned(x: FloatTensor<Self>) -> FloatTensor<Self> {
        x
    }

    /// `x wᵀ + b`.
    fn kiln_linear(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        b: Option<FloatTensor<Self>>,
    ) -> FloatTensor<Self> {
        Self::kiln_linear_in_out(x, p(t::<Self, 2>(w).transpose()), b)
    }

    /// `w [N, K]` (PyTorch's layout) as this backend's inference products read it
    /// (`Linear::into_inference_layout`): `wᵀ [K, N]` in a buffer of its own by default. The CPU
    /// packs it into panels where its inference GEMM reads them (`ops/cpu/panels.rs`); only
    /// [`Self::kiln_linear_in_out`] reads the result.
    fn kiln_inference_layout(w: FloatTensor<Self>) -> FloatTensor<Self> {
        Self::kiln_into_owned(p(t::<Self, 2>(w).transpose()))
    }

    /// `x w + b` for a weight laid out `[in, out]` (`[K, N]`), or as
    /// [`Self::kiln_inference_layout`] made it: inference's copy (see
    /// `Linear::into_inference_layout`). Composed of Burn ops by default, so it also differentiates.
    fn kiln_linear_in_out(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        b: Option<FloatTensor<Self>>,
    ) -> FloatTensor<Self> {
        let y = matmul_2d(t::<Self, 2>(x), t::<Self, 2>(w));
        p(match b {
            Some(b) => y + t::<Self, 1>(b).unsqueeze_dim(0),
            None => y,
        })
    }

    /// The operands `x [M, K]` and `w` of a Linear in the form its products read them, made once
    /// for the forward product and kept for the backward's two: as they are by default; under
    /// `--bf16` on a GPU, bf16 copies (as autocast keeps its cast operands: half the memory, and
    /// no second cast per product).
    fn kiln_linear_operands(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        (x, w)
    }

    /// `(dx, dw, db)` of [`Self::kiln_linear`] for output gradient `dy [M, N]`, each only where
    /// it is wanted: `dx` when `wants.input` (a model's first layer reads data, whose gradient
    /// nobody wants — for the MNIST MLP that product is a third of the backward's work), `dw` when
    /// `wants.weight` (a frozen base weight under LoRA: the largest product of the backward,
    /// skipped), `db` when `wants.bias`.
    fn kiln_linear_backward(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        dy: FloatTensor<Self>,
        wants: LinearGrads,
    ) -> LinearBackward<Self> {
        let dy = t::<Self, 2>(dy);
        let n = dy.dims()[1];
        let dx = wants
            .input
            .then(|| p(matmul_2d(dy.clone(), t::<Self, 2>(w))));
        let dw = wants
            .weight
            .then(|| p(matmul_2d(dy.clone().transpose(), t::<Self, 2>(x))));
        let db = wants.bias.then(|| p(dy.sum_dim(0).reshape([n])));
        (dx, dw, db)
    }

    /// Exact GELU `x·Φ(x)` (any shape).
    fn kiln_gelu(x: FloatTensor<Self>) -> FloatTensor<Self> {
        let x = t::<Self, 1>(x);
        p((x.clone() * std::f64::consts::FRAC_1_SQRT_2)
            .erf()
            .add_scalar(1.0)
            * x
            * 0.5)
    }

    /// `dy · (Φ(x) + x·φ(x))`.
    fn kiln_gelu_backward(x: FloatTensor<Self>, dy: FloatTensor<Self>) -> FloatTensor<Self> {
        let x = t::<Self, 1>(x);
        let cdf = (x.clone() * std::f64::consts::FRAC_1_SQRT_2)
            .erf()
            .add_scalar(1.0)
            * 0.5;
        let pdf =
            (x.clone().powi_scalar(2) * -0.5).exp() * (1.0 / (2.0 * std::f64::consts::PI).sqrt());
        p(t::<Self, 1>(dy) * (cdf + x * pdf))
    }

    /// RMS norm of the rows of `x [R, H]` (Llama's `RMSNorm`): `x / sqrt(mean(x²) + eps) · w`; also
    /// returns each row's `1 / rms` for the backward.
    fn kiln_rms_norm(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        eps: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let x = t::<Self, 2>(x);
        let r = x.dims()[0];
        let rinv = recip_exact(x.clone().powi_scalar(2).mean_dim(1).add_scalar(eps).sqrt());
        let y = x * rinv.clone() * t::<Self, 1>(w).unsqueeze_dim(0);
        (p(y), p(rinv.reshape([r])))
    }

    /// `(dx, dw)` of [`Self::kiln_rms_norm`]: with `x̂ = x/rms` and `g = dy·w`,
    /// `dx = (g − x̂·mean(g·x̂)) / rms` and `dw = Σ_rows dy·x̂`.
    fn kiln_rms_norm_backward(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        rinv: FloatTensor<Self>,
        dy: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let (x, dy) = (t::<Self, 2>(x), t::<Self, 2>(dy));
        let [r, h] = x.dims();
        let rinv = t::<Self, 1>(rinv).reshape([r, 1]);
        let xhat = x * rinv.clone();
        let dw = (dy.clone() * xhat.clone()).sum_dim(0).reshape([h]);
        let g = dy * t::<Self, 1>(w).unsqueeze_dim(0);
        let c = (g.clone() * xhat.clone()).mean_dim(1);
        (p((g - xhat * c) * rinv), p(dw))
    }

    /// SwiGLU's gate: `silu(g) · u`, element-wise over flat tensors.
    fn kiln_swiglu(g: FloatTensor<Self>, u: FloatTensor<Self>) -> FloatTensor<Self> {
        let g = t::<Self, 1>(g);
        p(burn::tensor::activation::silu(g) * t::<Self, 1>(u))
    }

    /// `(dg, du)` of [`Self::kiln_swiglu`]: `dg = dy·u·σ(g)(1 + g(1 − σ(g)))`, `du = dy·silu(g)`.
    fn kiln_swiglu_backward(
        g: FloatTensor<Self>,
        u: FloatTensor<Self>,
        dy: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let (g, u, dy) = (t::<Self, 1>(g), t::<Self, 1>(u), t::<Self, 1>(dy));
        let s = burn::tensor::activation::sigmoid(g.clone());
        let silu = g.clone() * s.clone();
        let dsilu = s.clone() * ((g * (s.neg() + 1.0)) + 1.0);
        (p(dy.clone() * u * dsilu), p(dy * silu))
    }

    /// Layer norm over the last dimension; also returns each row's mean and 1/σ for the backward.
    fn kiln_layer_norm(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        b: FloatTensor<Self>,
        eps: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let x = t::<Self, 2>(x);
        let r = x.dims()[0];
        let (var, mean) = x.clone().var_mean_bias(1);
        let rstd = recip_exact((var + eps).sqrt());
        let y = (x - mean.clone()) * rstd.clone() * t::<Self, 1>(w).unsqueeze_dim(0)
            + t::<Self, 1>(b).unsqueeze_dim(0);
        (p(y), p(mean.reshape([r])), p(rstd.reshape([r])))
    }

    /// `(dx, dw, db)` of [`Self::kiln_layer_norm`].
    fn kiln_layer_norm_backward(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        mean: FloatTensor<Self>,
        rstd: FloatTensor<Self>,
        dy: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let (x, dy) = (t::<Self, 2>(x), t::<Self, 2>(dy));
        let [r, h] = x.dims();
        let mean = t::<Self, 1>(mean).reshape([r, 1]);
        let rstd = t::<Self, 1>(rstd).reshape([r, 1]);
        let xhat = (x - mean) * rstd.clone();
        let g = dy.clone() * t::<Self, 1>(w).unsqueeze_dim(0);
        let c1 = g.clone().mean_dim(1);
        let c2 = (g.clone() * xhat.clone()).mean_dim(1);
        let dx = (g - c1 - xhat.clone() * c2) * rstd;
        let dw = (dy.clone() * xhat).sum_dim(0).reshape([h]);
        let db = dy.sum_dim(0).reshape([h]);
        (p(dx), p(dw), p(db))
    }

    /// `softmax(x·scale + mask[b, s])` over the last dimension.
    fn kiln_masked_softmax(
        x: FloatTensor<Self>,
        mask: FloatTensor<Self>,
        scale: f64,
    ) -> FloatTensor<Self> {
        let x = t::<Self, 4>(x);
        let [b, _, _, s] = x.dims();
        let z = x * scale + t::<Self, 2>(mask).reshape([b, 1, 1, s]);
        p(burn::tensor::activation::softmax(z, 3))
    }

    /// `dx = scale · y · (dy − Σ dy·y)` from the softmax output `y`.
    fn kiln_masked_softmax_backward(
        y: FloatTensor<Self>,
        dy: FloatTensor<Self>,
        scale: f64,
    ) -> FloatTensor<Self> {
        let (y, dy) = (t::<Self, 4>(y), t::<Self, 4>(dy));
        let dot = (dy.clone() * y.clone()).sum_dim(3);
        p((dy - dot) * y * scale)
    }

    /// Rotary position embedding of `x [B, T, heads, D]` with tables `cos`, `sin` `[T, D]`:
    /// `x·cos + rotate_half(x)·sin`, `rotate_half([a, b]) = [−b, a]` (transformers'
    /// `apply_rotary_pos_emb`). With `transpose` the rotation is undone instead — its own gradient:
    /// `dx = dy·cos + rotate_halfᵀ(dy·sin)`, `rotate_halfᵀ([a, b]) = [b, −a]`.
    fn kiln_rope(
        x: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        transpose: bool,
    ) -> FloatTensor<Self> {
        let x = t::<Self, 4>(x);
        let [b, n, h, d] = x.dims();
        let cos = t::<Self, 2>(cos).reshape([1, n, 1, d]);
        let sin = t::<Self, 2>(sin).reshape([1, n, 1, d]);
        let half = |x: Tensor<Self, 4>, r: std::ops::Range<usize>| x.slice([0..b, 0..n, 0..h, r]);
        if transpose {
            let xs = x.clone() * sin;
            let turned = Tensor::cat(
                vec![half(xs.clone(), d / 2..d), half(xs, 0..d / 2).neg()],
                3,
            );
            p(x * cos + turned)
        } else {
            let turned = Tensor::cat(
                vec![half(x.clone(), d / 2..d).neg(), half(x.clone(), 0..d / 2)],
                3,
            );
            p(x * cos + turned * sin)
        }
    }

    /// Rows `ids [N]` of the table `w [V, H]`: `[N, H]` (an embedding lookup).
    fn kiln_embedding(w: FloatTensor<Self>, ids: IntTensor<Self>) -> FloatTensor<Self> {
        Self::float_select(w, 0, ids)
    }

    /// The table's gradient of [`Self::kiln_embedding`]: the rows of `dy [N, H]` summed into rows
    /// `ids` of a `[vocab, H]` table of zeros.
    fn kiln_embedding_backward(
        dy: FloatTensor<Self>,
        ids: IntTensor<Self>,
        vocab: usize,
    ) -> FloatTensor<Self> {
        let dy = t::<Self, 2>(dy);
        let h = dy.dims()[1];
        let zeros = Tensor::<Self, 2>::zeros([vocab, h], &dy.device());
        Self::float_select_add(p(zeros), 0, ids, p(dy))
    }

    /// Cross-entropy of each row of `logits [N, C]` against its class in `targets [N]`:
    /// `lse − logits[target]` with `lse = log Σ exp(logits)`, and 0 for rows whose target is
    /// `ignore` (PyTorch's `ignore_index`). Returns `(losses [N], lse [N])`; `lse` is kept for the
    /// backward. The CPU kernel reads the logits once, where log-softmax + gather through Burn's
    /// ops make six passes and as many `[N, C]` buffers (a causal LM's are 100 MB each).
    fn kiln_cross_entropy(
        logits: FloatTensor<Self>,
        targets: IntTensor<Self>,
        ignore: i64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let x = t::<Self, 2>(logits);
        let [n, _] = x.dims();
        let (keep, safe) = kept_targets(Tensor::from_primitive(targets), ignore);
        let max = x.clone().max_dim(1);
        let lse = (x.clone() - max.clone()).exp().sum_dim(1).log() + max;
        let picked = x.gather(1, safe.reshape([n, 1]));
        let losses = (lse.clone() - picked).reshape([n]) * keep;
        (p(losses), p(lse.reshape([n])))
    }

    /// `dlogits = dloss[r] · (softmax(logits[r]) − onehot(target[r]))`, zero on ignored rows.
    fn kiln_cross_entropy_backward(
        logits: FloatTensor<Self>,
        targets: IntTensor<Self>,
        ignore: i64,
        lse: FloatTensor<Self>,
        dloss: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        let x = t::<Self, 2>(logits);
        let [n, c] = x.dims();
        let (keep, safe) = kept_targets(Tensor::from_primitive(targets), ignore);
        let g = (t::<Self, 1>(dloss) * keep).reshape([n, 1]);
        let probs = (x - t::<Self, 1>(lse).reshape([n, 1])).exp();
        p((probs - safe.one_hot::<2>(c).float()) * g)
    }

    /// Per-row cross-entropy of the logits `x wᵀ` (`x [N, H]`, `w [V, H]`, the output head's
    /// weight) against `targets [N]` (0 where the target is `ignore`), a chunk of at most `chunk`
    /// rows at a time, so that no more than `[chunk, V]` logits exist at once (Liger's fused
    /// linear cross-entropy; TRL's `nll`, which never materialises the logits). The gradients are
    /// computed in the same pass, each chunk's logits turned into their gradient at once, for
    /// every row's upstream gradient 1 (`wants`: of `x`, `[N, H]`, and of `w`, `[V, H]`): a
    /// backward then only scales them, and the head's products are the whole logits' (its
    /// forward and input-gradient products, a chunk at a time), not one more. Chunks are of
    /// equal size (the rows split into as few as `chunk` allows). Rows that are
    /// [`ChunkedRows::Scored`] also get their [`TokenStatistics`]. Under a [`VocabSlice`], `w`
    /// holds this rank's rows of the head, each row's loss is the whole row's, and the input's
    /// gradient is this rank's part of the group's sum.
    fn kiln_linear_cross_entropy(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        targets: IntTensor<Self>,
        head: &ChunkedHeadLoss,
        wants: LinearGrads,
    ) -> LinearCrossEntropy<Self> {
        let x = t::<Self, 2>(x);
        let targets = Tensor::<Self, 1, Int>::from_primitive(targets);
        let n = x.dims()[0];
        let device = x.device();
        let (mut losses, mut lses) = (Vec::new(), Vec::new());
        let (mut dx, mut dw) = (Vec::new(), None::<Tensor<Self, 2>>);
        let mut statistics = Vec::new();
        for (start, len) in balanced_chunks(n, head.chunk) {
            let xc = p(x.clone().narrow(0, start, len));
            let tc = targets.clone().narrow(0, start, len);
            let logits = Self::kiln_linear(xc.clone(), w.clone(), None);
            if head.rows == ChunkedRows::Scored {
                statistics.push(token_statistics(
                    t(logits.clone()),
                    tc.clone(),
                    head.ignore,
                    head.slice.as_ref(),
                ));
            }
            let (l, lse) = head.cross_entropy::<Self>(logits.clone(), tc.clone());
            losses.push(l);
            lses.push(lse.clone());
            if !(wants.input || wants.weight) {
                continue;
            }
            let ones = Tensor::<Self, 1>::ones([len], &device);
            let dlogits = head.logits_grad::<Self>(logits, tc, lse, ones);
            let (dxc, dwc, _) = Self::kiln_linear_backward(xc, w.clone(), dlogits, wants);
            dx.extend(dxc.map(t::<Self, 2>));
            if let Some(d) = dwc {
                let d = t::<Self, 2>(d);
                dw = Some(match dw {
                    Some(sum) => sum + d,
                    None => d,
                });
            }
        }
        let whole = |parts: Vec<Tensor<Self, 1>>| match parts.is_empty() {
            true => Tensor::<Self, 1>::zeros([0], &device),
            false => Tensor::cat(parts, 0),
        };
        LinearCrossEntropy {
            losses: p(whole(losses)),
            lse: p(whole(lses)),
            input_grad: (!dx.is_empty()).then(|| p(Tensor::cat(dx, 0))),
            weight_grad: dw.map(p),
            statistics: (!statistics.is_empty()).then(|| TokenStatistics::cat(statistics)),
        }
    }

    /// `layer_norm(dropout(x) + r)` over the last dimension of `[R, H]` inputs — a transformer block's
    /// "dropout, residual add, norm" in one pass; the normalised input `z` and the row statistics
    /// come back for the backward ([`ResidualNorm`]).
    fn kiln_residual_layer_norm(
        x: FloatTensor<Self>,
        r: FloatTensor<Self>,
        w: FloatTensor<Self>,
        b: FloatTensor<Self>,
        eps: f64,
        dropout: Dropout,
    ) -> ResidualNorm<Self> {
        let x = t::<Self, 2>(x);
        let x = if dropout.is_active() {
            t(Self::kiln_dropout_apply(p(x), dropout.keep(), dropout.seed))
        } else {
            x
        };
        let z = x + t::<Self, 2>(r);
        let (y, mean, rstd) = Self::kiln_layer_norm(p(z.clone()), w, b, eps);
        ResidualNorm {
            y,
            z: p(z),
            mean,
            rstd,
        }
    }

    /// `dropout(dz)` with [`Self::kiln_residual_layer_norm`]'s mask: the gradient reaching `x`.
    fn kiln_dropout_backward(dz: FloatTensor<Self>, dropout: Dropout) -> FloatTensor<Self> {
        if !dropout.is_active() {
            return dz;
        }
        Self::kiln_dropout_apply(dz, dropout.keep(), dropout.seed)
    }

    /// Multi-head attention core for `q, k, v [B, T, H]` (`spec.heads` heads side by side in H) and
    /// an additive key mask `[B, T]` (`k` and `v` may hold fewer heads, `[B, T, kv_heads·d]`:
    /// grouped-query attention, query head `i` reading key/value head `i / (heads / kv_heads)`;
    /// their gradients come back in that shape): `dropout(softmax(q kᵀ·scale + mask)) v`, back in
    /// `[B, T, H]`; query `i` sees only the keys of `spec.window` ([`Window::CAUSAL`]: `0..=i`,
    /// decoders; a sliding window: Mistral, ModernBERT's local layers). Also returns the softmax
    /// probabilities `[B, heads, T, T]` (before dropout; exactly 0 where masked) when `with_probs`,
    /// for the backward, which therefore needs no mask of its own; without it a kernel need not
    /// write them (25 MB per MiniLM layer at 32×128). The dropout mask is a function of its seed,
    /// so the backward regenerates it instead of storing it.
    fn kiln_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        mask: FloatTensor<Self>,
        spec: AttentionSpec,
        with_probs: bool,
    ) -> (FloatTensor<Self>, Option<FloatTensor<Self>>) {
        composed_attention::<Self>([q, k, v], mask, spec, with_probs)
    }

    /// `(dq, dk, dv)` of [`Self::kiln_attention`] for the output gradient `dout [B, T, H]`, given
    /// the forward's `spec` and probabilities.
    fn kiln_attention_backward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        probs: FloatTensor<Self>,
        dout: FloatTensor<Self>,
        spec: AttentionSpec,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        composed_attention_backward::<Self>([q, k, v], probs, dout, spec)
    }

    /// [`Self::kiln_attention`] with q, k and v side by side in one `[B, T, 3H]` tensor, as one
    /// Linear with the three weights stacked makes them: one GEMM instead of three forward, and
    /// one gradient tensor backward instead of three summed into the input's.
    fn kiln_attention_qkv(
        qkv: FloatTensor<Self>,
        mask: FloatTensor<Self>,
        spec: AttentionSpec,
        with_probs: bool,
    ) -> (FloatTensor<Self>, Option<FloatTensor<Self>>) {
        let [q, k, v] = split_qkv::<Self>(qkv);
        Self::kiln_attention(q, k, v, mask, spec, with_probs)
    }

    /// The `[B, T, 3H]` gradient of [`Self::kiln_attention_qkv`]'s input.
    fn kiln_attention_qkv_backward(
        qkv: FloatTensor<Self>,
        probs: FloatTensor<Self>,
        dout: FloatTensor<Self>,
        spec: AttentionSpec,
    ) -> FloatTensor<Self> {
        let [q, k, v] = split_qkv::<Self>(qkv);
        let (dq, dk, dv) = Self::kiln_attention_backward(q, k, v, probs, dout, spec);
        p(Tensor::cat(
            vec![t::<Self, 3>(dq), t::<Self, 3>(dk), t::<Self, 3>(dv)],
            2,
        ))
    }

    /// One SGD update of a flat parameter `p` with gradient `g·grad_scale`, exactly as
    /// `torch.optim.SGD`: with momentum, `buf` is the momentum buffer (`None` on the first step,
    /// where torch starts it at the gradient) and the new one is returned. The CPU kernel is one
    /// pass, in place: through Burn's ops the update is 2–6 passes and as many allocations, most
    /// of a small model's optimizer step.
    fn kiln_sgd(
        p: FloatTensor<Self>,
        g: FloatTensor<Self>,
        buf: Option<FloatTensor<Self>>,
        h: SgdStep,
    ) -> (FloatTensor<Self>, Option<FloatTensor<Self>>) {
        let mut g = t::<Self, 1>(g);
        if h.grad_scale != 1.0 {
            g = g * h.grad_scale;
        }
        let pt = t::<Self, 1>(p);
        if h.weight_decay != 0.0 {
            g = g + pt.clone() * h.weight_decay;
        }
        if h.momentum == 0.0 {
            return (p_(pt - g * h.lr), None);
        }
        let buf = match buf {
            Some(b) => t::<Self, 1>(b) * h.momentum + g.clone() * (1.0 - h.dampening),
            None => g.clone(),
        };
        let step = if h.nesterov {
            g + buf.clone() * h.momentum
        } else {
            buf.clone()
        };
        (p_(pt - step * h.lr), Some(p_(buf)))
    }

    /// One AdamW update of a flat parameter `p` with gradient `g·grad_scale` and moments `m`, `v`, exactly
    /// as `torch.optim.AdamW` (decoupled decay first, then the bias-corrected Adam step). Returns
    /// `(p, m, v)`; the CPU kernel updates in place.
    fn kiln_adamw(
        p: FloatTensor<Self>,
        g: FloatTensor<Self>,
        m: FloatTensor<Self>,
        v: FloatTensor<Self>,
        h: AdamWStep,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let g = t::<Self, 1>(g) * h.grad_scale;
        let mut pt = t::<Self, 1>(p);
        if h.weight_decay != 0.0 {
            pt = pt * (1.0 - h.lr * h.weight_decay);
        }
        let m = t::<Self, 1>(m) * h.beta1 + g.clone() * (1.0 - h.beta1);
        let v = t::<Self, 1>(v) * h.beta2 + g.powi_scalar(2) * (1.0 - h.beta2);
        let denom = v.clone().sqrt() / h.bias_correction2_sqrt + h.eps;
        let pt = pt - (m.clone() / denom) * (h.lr / h.bias_correction1);
        (p_(pt), p_(m), p_(v))
    }

    /// Σ x² of a flat tensor, on the host.
    /// Entering a tensor-parallel region (Megatron's `f`): the identity forward; under autodiff the
    /// backward sums the gradient over the group, since every rank's shard used the same input.
    fn kiln_tp_enter(x: FloatTensor<Self>, _tp: &TpComm) -> FloatTensor<Self> {
        x
    }

    /// Leaving a tensor-parallel region (Megatron's `g`): the sum of every rank's partial result;
    /// under autodiff the backward is the identity (each rank's partial result had weight one).
    fn kiln_tp_sum(x: FloatTensor<Self>, tp: &TpComm) -> FloatTensor<Self> {
        use burn::tensor::TensorMetadata;
        let shape = x.shape();
        let flat = t::<Self, 1>(Self::float_reshape(x, Shape::new([shape.num_elements()])));
        let device = flat.device();
        let values = flat
            .into_data()
            .convert::<f32>()
            .into_vec::<f32>()
            .expect("f32");
        Self::kiln_from_host(tp.sum(values), shape, &device)
    }

    fn kiln_sum_squares(x: FloatTensor<Self>) -> f64 {
        use burn::tensor::ElementConversion;
        t::<Self, 1>(x)
            .powi_scalar(2)
            .sum()
            .into_scalar()
            .elem::<f64>()
    }

    /// Σ x² over every tensor of `xs`, on the host. A GPU backend reads all the sums back at once
    /// (one wait for the device per call, where one per tensor stalled every step's clipping).
    fn kiln_sum_squares_all(xs: Vec<FloatTensor<Self>>) -> f64 {
        xs.into_iter().map(Self::kiln_sum_squares).sum()
    }

    /// `a · b` over the last two dimensions of tensors with the same leading (batch) dimensions:
    /// attention's products. A library GEMM where the backend has one (cuBLAS on CUDA, in IEEE
    /// f32: CubeCL's own matmul computes f32 in TF32 on tensor-core GPUs).
    fn kiln_batched_matmul(a: FloatTensor<Self>, b: FloatTensor<Self>) -> FloatTensor<Self> {
        Self::float_matmul(a, b)
    }

    /// A frozen weight held in bf16 (`--base-dtype bf16`: a LoRA run's base at half the memory),
    /// read only by [`Self::kiln_linear`], its backward's `dx` and [`Self::kiln_embedding`], which
    /// widen it to f32 a panel at a time; `None` where the backend has no such storage yet. Its
    /// values are `w` rounded to the nearest bf16, as PyTorch's `.to(torch.bfloat16)`.
    fn kiln_bf16_store(_w: FloatTensor<Self>) -> Option<FloatTensor<Self>> {
        None
    }

    /// The f32 values of a weight made by [`Self::kiln_bf16_store`] (exact: every bf16 value is
    /// an f32 one).
    fn kiln_bf16_load(w: FloatTensor<Self>) -> FloatTensor<Self> {
        w
    }

    /// Whether Linear layers can multiply bf16 operands ([`MatmulPrecision::Bf16`]): not on wgpu
    /// (WGSL has no bf16).
    fn kiln_has_bf16() -> bool {
        true
    }

    /// Whether bf16 products run on bf16 instructions here (and so pay): the CPU without
    /// AVX512-BF16 only emulates them, rounding f32 operands (same numerics, slower than f32).
    fn kiln_bf16_is_native() -> bool {
        Self::kiln_has_bf16()
    }

    /// Whether f32 GEMMs can run on TF32 tensor cores ([`set_tf32`]): CUDA only.
    fn kiln_has_tf32() -> bool {
        false
    }

    /// What a GPU has done so far in this process (launches, memory), for the bench; `None` on
    /// the CPU.
    fn kiln_device_counters(_device: &Self::Device) -> Option<DeviceCounters> {
        None
    }

    /// A flat dropout mask of `shape`'s size: each element `1/keep` with probability `keep`, else 0.
    /// Deterministic in `seed`.
    fn kiln_dropout_mask(
        shape: Shape,
        keep: f64,
        seed: u64,
        device: &Self::Device,
    ) -> FloatTensor<Self> {
        Self::seed(device, seed);
        let m = Tensor::<Self, 1>::random(
            [shape.num_elements()],
            Distribution::Bernoulli(keep),
            device,
        );
        p(m * (1.0 / keep))
    }

    /// `x · mask` with the mask of [`Self::kiln_dropout_mask`] for `seed` (any shape). Its gradient
    /// is the same op on `dy`, so training keeps a seed where it kept a mask. A GPU makes the mask
    /// inside the multiply: one pass, no mask in memory.
    fn kiln_dropout_apply(x: FloatTensor<Self>, keep: f64, seed: u64) -> FloatTensor<Self> {
        let shape = burn::tensor::TensorMetadata::shape(&x);
        let mask = Self::kiln_dropout_mask(shape.clone(), keep, seed, &Self::float_device(&x));
        Self::float_mul(x, Self::float_reshape(mask, shape))
    }
}

#[cfg(any(feature = "cuda", feature = "wgpu"))]
mod gpu;

/// A training backend: autodiff over a backend that has kiln's fused ops, with the ops themselves.
pub trait TrainBackend:
    burn::tensor::backend::AutodiffBackend<InnerBackend: KilnBackend> + KilnBackend
{
}
impl<B> TrainBackend for B where
    B: burn::tensor::backend::AutodiffBackend<InnerBackend: KilnBackend> + KilnBackend
{
}

#[cfg(test)]
mod tests;
