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

/// How Linear layers (and, on the CPU, attention's products) multiply: in f32, or with bf16
/// operands and f32 accumulation (`--bf16`: the numerics of PyTorch's bf16 autocast for matmuls).
/// Everything else — LayerNorm, softmax, GELU, the loss, master weights, optimizer state — stays
/// f32 either way.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MatmulPrecision {
    #[default]
    F32,
    Bf16,
}

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

thread_local! {
    static MATMUL_PRECISION: std::cell::Cell<MatmulPrecision> = const {
        std::cell::Cell::new(MatmulPrecision::F32)
    };
}

/// Sets the [`MatmulPrecision`] of the ops this thread runs (like `torch.autocast` around a whole
/// run; forward and backward run on the thread that calls them). Thread-local, so concurrent runs
/// in one process (tests) do not see each other's setting.
pub fn set_matmul_precision(p: MatmulPrecision) {
    MATMUL_PRECISION.with(|c| c.set(p));
}

pub fn matmul_precision() -> MatmulPrecision {
    MATMUL_PRECISION.with(|c| c.get())
}

/// This thread's [`MatmulPrecision`] set for as long as the scope lives, and the one before put
/// back when it is dropped (as leaving a `with torch.autocast(...)` block does), so a benchmark
/// row or a test that asks for bf16 cannot leave it set for whatever runs next on the thread.
#[must_use = "the precision goes back when the scope is dropped"]
pub struct MatmulPrecisionScope {
    previous: MatmulPrecision,
}

impl MatmulPrecisionScope {
    pub fn set(p: MatmulPrecision) -> Self {
        let previous = matmul_precision();
        set_matmul_precision(p);
        Self { previous }
    }
}

impl Drop for MatmulPrecisionScope {
    fn drop(&mut self) {
        set_matmul_precision(self.previous);
    }
}

/// The precision `--bf16` (`bf16`) gives Linear layers on backend `B`: bf16 where it has bf16
/// arithmetic that is faster than f32; f32 where rounding operands to bf16 would only cost time
/// (a CPU without AVX512-BF16, or one `KILN_CPU_ISA` caps below it), as issue 36 chose: never
/// slower than f32, and no less accurate. See [`KilnBackend::kiln_bf16_is_native`].
pub fn mixed_precision<B: KilnBackend>(bf16: bool) -> MatmulPrecision {
    if bf16 && B::kiln_bf16_is_native() {
        MatmulPrecision::Bf16
    } else {
        MatmulPrecision::F32
    }
}

thread_local! {
    static TF32: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Allows f32 GEMMs on TF32 tensor cores (HF's `--tf32`, PyTorch's
/// `torch.backends.cuda.matmul.allow_tf32`): 10-bit mantissas in the products, f32 accumulation.
/// Only CUDA has them ([`KilnBackend::kiln_has_tf32`]); thread-local like the precision.
pub fn set_tf32(allowed: bool) {
    TF32.with(|c| c.set(allowed));
}

pub fn tf32_allowed() -> bool {
    TF32.with(|c| c.get())
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

/// Backend operations kiln fuses. Shapes: `x [M, K]`, `w [N, K]` (PyTorch layout), `b [N]` for linear;
/// `x [R, H]` for layer norm; `x [B, H, T, S]` with `mask [B, S]` (additive) for softmax.
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

    /// `x w + b` for a weight already laid out `[in, out]` (`[K, N]`): inference's copy (see
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

    /// `layer_norm(dropout(x) + r)` over the last dimension of `[R, H]` inputs — a transformer block's
    /// "dropout, residual add, norm" in one pass. Returns `(y, z, mean, rstd)` where `z` is the
    /// normalised input, kept for the backward; the dropout mask is a function of `seed`.
    #[allow(clippy::too_many_arguments, clippy::type_complexity)]
    fn kiln_residual_layer_norm(
        x: FloatTensor<Self>,
        r: FloatTensor<Self>,
        w: FloatTensor<Self>,
        b: FloatTensor<Self>,
        eps: f64,
        dropout: f64,
        seed: u64,
    ) -> (
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
    ) {
        let x = t::<Self, 2>(x);
        let x = if dropout > 0.0 {
            t(Self::kiln_dropout_apply(p(x), 1.0 - dropout, seed))
        } else {
            x
        };
        let z = x + t::<Self, 2>(r);
        let (y, mean, rstd) = Self::kiln_layer_norm(p(z.clone()), w, b, eps);
        (y, p(z), mean, rstd)
    }

    /// `dropout(dz)` with [`Self::kiln_residual_layer_norm`]'s mask: the gradient reaching `x`.
    fn kiln_dropout_backward(dz: FloatTensor<Self>, dropout: f64, seed: u64) -> FloatTensor<Self> {
        if dropout <= 0.0 {
            return dz;
        }
        Self::kiln_dropout_apply(dz, 1.0 - dropout, seed)
    }

    /// Multi-head attention core for `q, k, v [B, T, H]` (heads side by side in H) and an additive key
    /// mask `[B, T]` (`k` and `v` may hold fewer heads, `[B, T, kv_heads·d]`: grouped-query
    /// attention, query head `i` reading key/value head `i / (heads / kv_heads)`; their gradients
    /// come back in that shape): `dropout(softmax(q kᵀ·scale + mask)) v`, back in `[B, T, H]`; query `i` sees
    /// only the keys of its `window` ([`Window::CAUSAL`]: `0..=i`, decoders; a sliding window:
    /// Mistral, ModernBERT's local layers). Also returns the softmax probabilities
    /// `[B, heads, T, T]` (before dropout; exactly 0 where masked) when `with_probs`, for the
    /// backward, which therefore needs no mask of its own; without it a kernel need not write them
    /// (25 MB per MiniLM layer at 32×128). The dropout mask is a function of `seed`, so the
    /// backward regenerates it instead of storing it.
    #[allow(clippy::too_many_arguments)]
    fn kiln_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        mask: FloatTensor<Self>,
        heads: usize,
        window: Window,
        scale: f64,
        dropout: f64,
        seed: u64,
        with_probs: bool,
    ) -> (FloatTensor<Self>, Option<FloatTensor<Self>>) {
        composed_attention::<Self>(
            q, k, v, mask, heads, window, scale, dropout, seed, with_probs,
        )
    }

    /// `(dq, dk, dv)` of [`Self::kiln_attention`] for the output gradient `dout [B, T, H]`.
    #[allow(clippy::too_many_arguments)]
    fn kiln_attention_backward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        probs: FloatTensor<Self>,
        dout: FloatTensor<Self>,
        heads: usize,
        scale: f64,
        dropout: f64,
        seed: u64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        composed_attention_backward::<Self>(q, k, v, probs, dout, heads, scale, dropout, seed)
    }

    /// [`Self::kiln_attention`] (not causal) with q, k and v side by side in one `[B, T, 3H]`
    /// tensor, as one Linear with the three weights stacked makes them: one GEMM instead of three
    /// forward, and one gradient tensor backward instead of three summed into the input's.
    fn kiln_attention_qkv(
        qkv: FloatTensor<Self>,
        mask: FloatTensor<Self>,
        heads: usize,
        scale: f64,
        dropout: f64,
        seed: u64,
        with_probs: bool,
    ) -> (FloatTensor<Self>, Option<FloatTensor<Self>>) {
        let [q, k, v] = split_qkv::<Self>(qkv);
        Self::kiln_attention(
            q,
            k,
            v,
            mask,
            heads,
            Window::FULL,
            scale,
            dropout,
            seed,
            with_probs,
        )
    }

    /// The `[B, T, 3H]` gradient of [`Self::kiln_attention_qkv`]'s input.
    #[allow(clippy::too_many_arguments)]
    fn kiln_attention_qkv_backward(
        qkv: FloatTensor<Self>,
        probs: FloatTensor<Self>,
        dout: FloatTensor<Self>,
        heads: usize,
        scale: f64,
        dropout: f64,
        seed: u64,
    ) -> FloatTensor<Self> {
        let [q, k, v] = split_qkv::<Self>(qkv);
        let (dq, dk, dv) =
            Self::kiln_attention_backward(q, k, v, probs, dout, heads, scale, dropout, seed);
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

/// `a · b` over the last two dimensions ([`KilnBackend::kiln_batched_matmul`]).
pub fn bmm<B: KilnBackend, const D: usize>(a: Tensor<B, D>, b: Tensor<B, D>) -> Tensor<B, D> {
    t(B::kiln_batched_matmul(p(a), p(b)))
}

/// [`KilnBackend::kiln_attention`] composed of Burn's ops and the backend's softmax and dropout
/// (the default; a backend's own kernel may fall back to it for shapes it does not take).
#[allow(clippy::too_many_arguments)]
pub(crate) fn composed_attention<B: KilnBackend>(
    q: FloatTensor<B>,
    k: FloatTensor<B>,
    v: FloatTensor<B>,
    mask: FloatTensor<B>,
    heads: usize,
    window: Window,
    scale: f64,
    dropout: f64,
    seed: u64,
    with_probs: bool,
) -> (FloatTensor<B>, Option<FloatTensor<B>>) {
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
    let dropped = attention_dropout::<B>(probs.clone(), dropout, seed);
    let out = bmm(dropped, split(v)).swap_dims(1, 2).reshape([b, tq, h]);
    (p(out), with_probs.then(|| p(probs)))
}

/// [`KilnBackend::kiln_attention_backward`] composed of Burn's ops (the default).
#[allow(clippy::too_many_arguments)]
pub(crate) fn composed_attention_backward<B: KilnBackend>(
    q: FloatTensor<B>,
    k: FloatTensor<B>,
    v: FloatTensor<B>,
    probs: FloatTensor<B>,
    dout: FloatTensor<B>,
    heads: usize,
    scale: f64,
    dropout: f64,
    seed: u64,
) -> (FloatTensor<B>, FloatTensor<B>, FloatTensor<B>) {
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
    let dropped = attention_dropout::<B>(probs.clone(), dropout, seed);
    let dv = bmm(dropped.swap_dims(2, 3), dout.clone());
    let dprobs = attention_dropout::<B>(bmm(dout, split(v).swap_dims(2, 3)), dropout, seed);
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

/// `x · dropout_mask(seed)` ([`KilnBackend::kiln_dropout_apply`]; identity at p = 0).
fn attention_dropout<B: KilnBackend>(x: Tensor<B, 4>, prob: f64, seed: u64) -> Tensor<B, 4> {
    if prob <= 0.0 {
        return x;
    }
    t(B::kiln_dropout_apply(p(x), 1.0 - prob, seed))
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

/// A Linear's `(dx, dw, db)`, each present where it was wanted ([`LinearGrads`]).
pub type LinearBackward<B> = (
    Option<FloatTensor<B>>,
    Option<FloatTensor<B>>,
    Option<FloatTensor<B>>,
);

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
    let n = w.dims()[0];
    over_rows(x, n, |x| B::kiln_linear(x, p(w), b.map(p)))
}

/// `x w + b` over the last dimension for a weight laid out `[in, out]` (see
/// [`KilnBackend::kiln_linear_in_out`]).
pub fn linear_in_out<B: KilnBackend, const D: usize>(
    x: Tensor<B, D>,
    w: Tensor<B, 2>,
    b: Option<Tensor<B, 1>>,
) -> Tensor<B, D> {
    let n = w.dims()[1];
    over_rows(x, n, |x| B::kiln_linear_in_out(x, p(w), b.map(p)))
}

/// `f` over `x`'s rows (all leading dimensions flattened to `[M, K]`), its `[M, n]` result put
/// back under the leading dimensions.
fn over_rows<B: KilnBackend, const D: usize>(
    x: Tensor<B, D>,
    n: usize,
    f: impl FnOnce(FloatTensor<B>) -> FloatTensor<B>,
) -> Tensor<B, D> {
    let mut dims = x.dims();
    let k = dims[D - 1];
    let m: usize = dims[..D - 1].iter().product();
    let y = f(p(reshape(x, [m, k])));
    dims[D - 1] = n;
    reshape(t::<B, 2>(y), dims)
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
    let (dropout, seed) = training_dropout::<B>(dropout);
    let (y, _, _, _) = B::kiln_residual_layer_norm(
        p(reshape(x, [r, h])),
        p(reshape(residual, [r, h])),
        p(w),
        p(b),
        eps,
        dropout,
        seed,
    );
    reshape(t::<B, 2>(y), dims)
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

/// Sets the CPU worker threads: one rayon pool runs every kernel, and matrixmultiply's own pool is
/// turned off (kernels split GEMMs across rayon instead), so two pools never fight over the cores.
/// Call once, before any tensor work; later calls have no effect.
pub fn init_threads(threads: Option<usize>) {
    // SAFETY (set_var): called at start-up, before other threads exist.
    std::env::set_var("MATMUL_NUM_THREADS", "1");
    let mut pool = rayon::ThreadPoolBuilder::new().stack_size(WORKER_STACK);
    if let Some(n) = threads {
        pool = pool.num_threads(n);
    }
    let _ = pool.build_global();
}

/// Stack of each pool thread: [`on_pool`] runs the whole command on one, which must hold as much as
/// the main thread's 8 MiB.
const WORKER_STACK: usize = 8 << 20;

/// Runs `f` on a thread of the kernel pool (the caller waits). A kernel that splits its work from
/// there hands half to the other threads through the pool's own queues, and a kernel too small to
/// split runs in place; from a thread outside the pool every parallel call is a round trip through
/// the pool's injector and a sleeping latch (≈ 10–30 µs), which is most of a small model's step.
///
/// Not with a one-thread pool: `f` would then hold the pool's only thread, and a thread outside
/// it that hands the pool work while `f` waits on that thread (Burn's collectives sum tensors on
/// their own threads) would wait forever.
pub fn on_pool<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    if rayon::current_thread_index().is_some() || rayon::current_num_threads() < 2 {
        return f();
    }
    rayon::scope(|_| f())
}

/// Runs `f` right after seeding the backend's random generator, holding a process-wide lock: the
/// backend RNG is global, so without the lock two trainers in one process would interleave draws and
/// a seed would no longer determine the initial weights.
pub fn with_seeded_rng<B: Backend, T>(device: &B::Device, seed: u64, f: impl FnOnce() -> T) -> T {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _guard = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    B::seed(device, seed);
    f()
}

thread_local! {
    /// Per thread: a model's forward runs on its trainer's thread, so trainers running side by side
    /// in one process (tests, several jobs) never draw from each other's stream.
    static DROPOUT_STREAM: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Restarts this thread's dropout random stream: the trainer calls it before every optimizer step
/// with a seed derived from (run seed, step), which makes dropout — and so resuming — reproducible.
pub fn reseed_dropout(seed: u64) {
    DROPOUT_STREAM.with(|s| s.set(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15)));
}

/// Where this thread's dropout stream stands: with [`set_dropout_position`], activation
/// checkpointing recomputes a segment with the very masks its first forward pass drew.
pub fn dropout_position() -> u64 {
    DROPOUT_STREAM.with(|s| s.get())
}

/// Puts this thread's dropout stream back where [`dropout_position`] found it.
pub fn set_dropout_position(position: u64) {
    DROPOUT_STREAM.with(|s| s.set(position));
}

/// The seed of the next dropout mask on this thread.
fn next_dropout_seed() -> u64 {
    DROPOUT_STREAM.with(|s| {
        let v = s.get();
        s.set(v.wrapping_add(1));
        v
    })
}

/// `(probability, seed)` for a fused kernel's dropout: a fresh seed from the dropout stream in
/// training, `(0, 0)` (no dropout, no draw from the stream) otherwise.
fn training_dropout<B: Backend>(prob: f64) -> (f64, u64) {
    if B::ad_enabled() && prob > 0.0 {
        (prob, next_dropout_seed())
    } else {
        (0.0, 0)
    }
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
    let scale = 1.0 / ((qkv.dims()[2] / 3 / heads) as f64).sqrt();
    let (dropout, seed) = training_dropout::<B>(dropout);
    let (out, _) = B::kiln_attention_qkv(p(qkv), p(mask), heads, scale, dropout, seed, false);
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
    let scale = 1.0 / ((h / heads) as f64).sqrt();
    let mask = Tensor::<B, 2>::zeros([b, tq], &q.device());
    let (out, _) = B::kiln_attention(
        p(q),
        p(k),
        p(v),
        p(mask),
        heads,
        Window::CAUSAL,
        scale,
        0.0,
        0,
        false,
    );
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

/// Which keys a query sees, beside the padding mask: those at most `before` positions earlier
/// and `after` later (a sliding window: Mistral, ModernBERT's local layers). [`Window::FULL`]
/// sees every key, [`Window::CAUSAL`] the query and the ones before it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Window {
    pub before: usize,
    pub after: usize,
}

impl Window {
    pub const FULL: Self = Self {
        before: usize::MAX,
        after: usize::MAX,
    };
    pub const CAUSAL: Self = Self {
        before: usize::MAX,
        after: 0,
    };

    /// The keys query `i` of a `t`-token sequence sees.
    pub fn keys(&self, i: usize, t: usize) -> std::ops::Range<usize> {
        i.saturating_sub(self.before)..i.saturating_add(self.after).saturating_add(1).min(t)
    }

    /// Whether every query of a `t`-token sequence sees every key.
    pub fn covers(&self, t: usize) -> bool {
        let last = t.saturating_sub(1);
        self.before >= last && self.after >= last
    }

    /// The additive `[T, T]` mask of the window: 0 inside, a large finite negative outside (not
    /// -inf: it is scaled before the softmax, and a padding query whose keys are all hidden must
    /// stay finite). Made once per window, length, backend and device on a thread and then shared
    /// ([`BANDS`]): every layer of a step asks for the same one.
    pub fn band<B: Backend>(&self, t: usize, device: &B::Device) -> Tensor<B, 2> {
        let key = (std::any::TypeId::of::<B>(), *self, t);
        let cached = BANDS.with(|bands| {
            bands.borrow().iter().find_map(|(k, band)| {
                let band = band.downcast_ref::<Tensor<B, 2>>()?;
                (*k == key && band.device() == *device).then(|| band.clone())
            })
        });
        if let Some(band) = cached {
            return band;
        }
        let values: Vec<f32> = (0..t)
            .flat_map(|i| {
                let seen = self.keys(i, t);
                (0..t).map(move |j| if seen.contains(&j) { 0.0 } else { -1e30 })
            })
            .collect();
        let band = Tensor::<B, 2>::from_data(burn::tensor::TensorData::new(values, [t, t]), device);
        BANDS.with(|bands| {
            let mut bands = bands.borrow_mut();
            if bands.len() == BANDS_KEPT {
                bands.remove(0);
            }
            bands.push((key, Box::new(band.clone())));
        });
        band
    }
}

/// How many bands [`BANDS`] keeps: a few lengths (dynamic padding) of a model's one or two windows.
const BANDS_KEPT: usize = 8;

thread_local! {
    /// The bands [`Window::band`] made last on this thread, oldest first, keyed by backend, window
    /// and length (the tensor holds its device). A host profile of a SmolLM2 step on an H200 found
    /// a quarter of the step's host time building the causal band again for each of its 30 layers
    /// (and each uploaded 1 MiB). A shared tensor is never changed in place: Burn writes in place
    /// only into a tensor nothing else holds.
    static BANDS: std::cell::RefCell<Vec<BandEntry>> = const { std::cell::RefCell::new(Vec::new()) };
}

type BandEntry = ((std::any::TypeId, Window, usize), Box<dyn std::any::Any>);

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
    let scale = 1.0 / ((q.dims()[2] / heads) as f64).sqrt();
    let (dropout, seed) = training_dropout::<B>(dropout);
    let (out, _) = B::kiln_attention(
        p(q),
        p(k),
        p(v),
        p(mask),
        heads,
        window,
        scale,
        dropout,
        seed,
        false,
    );
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
