//! kiln's ops on GPUs: one implementation for every CubeCL runtime (CUDA on NVIDIA GPUs, wgpu on
//! Vulkan / Metal / DX12 and on Mesa's software Vulkan in CI), so a kernel checked on lavapipe
//! against the CPU path is the kernel an H100 runs.
//!
//! Linear layers' GEMMs go to cuBLAS on CUDA ([`cublas`]) and to CubeCL's matmul elsewhere. Ops
//! without a GPU kernel yet take the composed defaults of [`KilnBackend`] (Burn's CubeCL kernels,
//! one launch per primitive).

use burn::tensor::ops::{FloatTensor, FloatTensorOps, IntTensor};
use burn::tensor::{FloatDType, Shape};
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};

use super::{KilnBackend, MatmulPrecision};

mod attention;
#[cfg(feature = "cuda")]
mod attention_blas;
mod columns;
#[cfg(feature = "cuda")]
mod cublas;
#[cfg(feature = "cuda")]
mod cublaslt;
mod dropout;
mod elementwise;
mod embedding;
mod grid;
mod loss;
mod norm;
mod rope;
mod softmax;
mod squares;

/// `op(l) · op(r)` over the last two dimensions (`t*`: that operand used transposed, as a view) in
/// the thread's [`MatmulPrecision`] for 2-D (Linear) products: bf16 operands with an f32 result
/// under `--bf16`; attention's batched products stay f32, as on the CPU. cuBLAS on CUDA; CubeCL's
/// matmul on other runtimes (or with cuBLAS off).
fn product<R, F, I, BT>(l: CubeTensor<R>, tl: bool, r: CubeTensor<R>, tr: bool) -> CubeTensor<R>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    product_bias::<R, F, I, BT>(l, tl, r, tr, None)
}

/// [`product`] plus a bias `[N]` broadcast over its rows: one cuBLASLt call with the bias
/// epilogue where it is on (`KILN_CUBLASLT=1`, [`cublaslt`]), else the product and an add.
fn product_bias<R, F, I, BT>(
    l: CubeTensor<R>,
    tl: bool,
    r: CubeTensor<R>,
    tr: bool,
    bias: Option<CubeTensor<R>>,
) -> CubeTensor<R>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    type B<R, F, I, BT> = CubeBackend<R, F, I, BT>;
    let l = if tl {
        B::<R, F, I, BT>::float_transpose(l)
    } else {
        l
    };
    let r = if tr {
        B::<R, F, I, BT>::float_transpose(r)
    } else {
        r
    };
    let bf16 = l.shape.num_dims() == 2 && super::matmul_precision() == MatmulPrecision::Bf16;
    let (l, r) = if bf16 {
        (
            B::<R, F, I, BT>::float_cast(l, FloatDType::BF16),
            B::<R, F, I, BT>::float_cast(r, FloatDType::BF16),
        )
    } else {
        (l, r)
    };
    #[cfg(feature = "cuda")]
    let (l, r, bias) = match bias {
        Some(b) if cublaslt::enabled() => {
            match cublaslt::matmul_bias(l, r, b, super::tf32_allowed()) {
                Ok(y) => return y,
                Err((l, r, b)) => (l, r, Some(b)),
            }
        }
        other => (l, r, other),
    };
    #[cfg(feature = "cuda")]
    let (l, r) = match cublas::matmul(l, r, super::tf32_allowed()) {
        Ok(y) => return with_bias::<R, F, I, BT>(y, bias),
        Err(operands) => operands,
    };
    let y = B::<R, F, I, BT>::float_matmul(l, r);
    let y = if bf16 {
        B::<R, F, I, BT>::float_cast(y, F::dtype().into())
    } else {
        y
    };
    with_bias::<R, F, I, BT>(y, bias)
}

impl<R, F, I, BT> KilnBackend for CubeBackend<R, F, I, BT>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    fn kiln_linear(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        b: Option<FloatTensor<Self>>,
    ) -> FloatTensor<Self> {
        product_bias::<R, F, I, BT>(x, false, w, true, b)
    }

    fn kiln_linear_in_out(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        b: Option<FloatTensor<Self>>,
    ) -> FloatTensor<Self> {
        product_bias::<R, F, I, BT>(x, false, w, false, b)
    }

    /// Under `--bf16`, bf16 copies of a Linear's operands, for its forward product and kept for
    /// its backward: the products' own casts then find bf16 and do nothing.
    fn kiln_linear_operands(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        if super::matmul_precision() == MatmulPrecision::Bf16 {
            (
                Self::float_cast(x, FloatDType::BF16),
                Self::float_cast(w, FloatDType::BF16),
            )
        } else {
            (x, w)
        }
    }

    fn kiln_linear_backward(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        dy: FloatTensor<Self>,
        wants: crate::ops::LinearGrads,
    ) -> crate::ops::LinearBackward<Self> {
        let n = dy.shape.dims::<2>()[1];
        // dx = dy · w, dw = dyᵀ · x (both [out, in] like PyTorch's), db = Σ_rows dy.
        let db = wants
            .bias
            .then(|| Self::float_reshape(columns::sum_rows::<R, F>(dy.clone()), Shape::new([n])));
        // Under --bf16 both products read dy in bf16: cast it once, not once per product.
        let dy = if super::matmul_precision() == MatmulPrecision::Bf16 {
            Self::float_cast(dy, FloatDType::BF16)
        } else {
            dy
        };
        let dx = wants
            .input
            .then(|| product::<R, F, I, BT>(dy.clone(), false, w, false));
        let dw = wants
            .weight
            .then(|| product::<R, F, I, BT>(dy, true, x, false));
        (dx, dw, db)
    }

    fn kiln_batched_matmul(a: FloatTensor<Self>, b: FloatTensor<Self>) -> FloatTensor<Self> {
        product::<R, F, I, BT>(a, false, b, false)
    }

    fn kiln_has_bf16() -> bool {
        is_cuda::<R>()
    }

    fn kiln_has_tf32() -> bool {
        is_cuda::<R>()
    }

    fn kiln_device_counters(device: &Self::Device) -> Option<super::DeviceCounters> {
        let usage = R::client(device).memory_usage();
        #[cfg(feature = "cuda")]
        let launches =
            is_cuda::<R>().then(|| burn_cubecl::cubecl::cuda::kernel_launches() + cublas::calls());
        #[cfg(not(feature = "cuda"))]
        let launches = None;
        Some(super::DeviceCounters {
            launches,
            reserved_bytes: usage.bytes_reserved,
            in_use_bytes: usage.bytes_in_use,
        })
    }

    fn kiln_gelu(x: FloatTensor<Self>) -> FloatTensor<Self> {
        elementwise::gelu::<R, F>(x)
    }

    fn kiln_gelu_backward(x: FloatTensor<Self>, dy: FloatTensor<Self>) -> FloatTensor<Self> {
        elementwise::gelu_backward::<R, F>(x, dy)
    }

    fn kiln_swiglu(g: FloatTensor<Self>, u: FloatTensor<Self>) -> FloatTensor<Self> {
        elementwise::swiglu::<R, F>(g, u)
    }

    fn kiln_swiglu_backward(
        g: FloatTensor<Self>,
        u: FloatTensor<Self>,
        dy: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        elementwise::swiglu_backward::<R, F>(g, u, dy)
    }

    fn kiln_rope(
        x: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        transpose: bool,
    ) -> FloatTensor<Self> {
        rope::rope::<R, F>(x, cos, sin, transpose)
    }

    fn kiln_embedding_backward(
        dy: FloatTensor<Self>,
        ids: IntTensor<Self>,
        vocab: usize,
    ) -> FloatTensor<Self> {
        embedding::embedding_backward::<R, F, I>(dy, ids, vocab)
    }

    fn kiln_cross_entropy(
        logits: FloatTensor<Self>,
        targets: IntTensor<Self>,
        ignore: i64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        loss::cross_entropy::<R, F, I>(logits, targets, ignore)
    }

    fn kiln_cross_entropy_backward(
        logits: FloatTensor<Self>,
        targets: IntTensor<Self>,
        ignore: i64,
        lse: FloatTensor<Self>,
        dloss: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        loss::cross_entropy_backward::<R, F, I>(logits, targets, ignore, lse, dloss)
    }

    fn kiln_sgd(
        p: FloatTensor<Self>,
        g: FloatTensor<Self>,
        buf: Option<FloatTensor<Self>>,
        h: super::SgdStep,
    ) -> (FloatTensor<Self>, Option<FloatTensor<Self>>) {
        elementwise::sgd::<R, F>(p, g, buf, h)
    }

    fn kiln_adamw(
        p: FloatTensor<Self>,
        g: FloatTensor<Self>,
        m: FloatTensor<Self>,
        v: FloatTensor<Self>,
        h: super::AdamWStep,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        elementwise::adamw::<R, F>(p, g, m, v, h)
    }

    /// Per-chunk partial sums of every tensor into one buffer on the device ([`squares`]); one
    /// read-back returns them all, summed in f64.
    fn kiln_sum_squares_all(xs: Vec<FloatTensor<Self>>) -> f64 {
        if xs.is_empty() {
            return 0.0;
        }
        let partials = burn::tensor::Tensor::<Self, 1>::from_primitive(
            burn::tensor::TensorPrimitive::Float(squares::sum_squares_partials::<R, F>(xs)),
        );
        partials
            .into_data()
            .convert::<f32>()
            .to_vec::<f32>()
            .expect("f32 sums")
            .iter()
            .map(|&v| v as f64)
            .sum()
    }

    fn kiln_layer_norm(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        b: FloatTensor<Self>,
        eps: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        norm::layer_norm::<R, F>(x, w, b, eps)
    }

    /// Dropout, residual add and layer norm in one launch ([`norm`]).
    fn kiln_residual_layer_norm(
        x: FloatTensor<Self>,
        r: FloatTensor<Self>,
        w: FloatTensor<Self>,
        b: FloatTensor<Self>,
        eps: f64,
        dropout: super::Dropout,
    ) -> super::ResidualNorm<Self> {
        let (y, z, mean, rstd) = norm::residual_layer_norm::<R, F>([x, r], [w, b], eps, dropout);
        super::ResidualNorm { y, z, mean, rstd }
    }

    fn kiln_layer_norm_backward(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        mean: FloatTensor<Self>,
        rstd: FloatTensor<Self>,
        dy: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        norm::layer_norm_backward::<R, F>(x, w, mean, rstd, dy)
    }

    fn kiln_rms_norm_backward(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        rinv: FloatTensor<Self>,
        dy: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        norm::rms_norm_backward::<R, F>(x, w, rinv, dy)
    }

    fn kiln_masked_softmax(
        x: FloatTensor<Self>,
        mask: FloatTensor<Self>,
        scale: f64,
    ) -> FloatTensor<Self> {
        softmax::masked_softmax::<R, F>(x, mask, scale)
    }

    fn kiln_masked_softmax_backward(
        y: FloatTensor<Self>,
        dy: FloatTensor<Self>,
        scale: f64,
    ) -> FloatTensor<Self> {
        softmax::masked_softmax_backward::<R, F>(y, dy, scale)
    }

    fn kiln_rms_norm(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        eps: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        norm::rms_norm::<R, F>(x, w, eps)
    }

    /// One launch per call, reading q, k and v in place ([`attention`]); head dimensions the
    /// kernel does not take fall back to the composed chain.
    fn kiln_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        mask: FloatTensor<Self>,
        spec: super::AttentionSpec,
        with_probs: bool,
    ) -> (FloatTensor<Self>, Option<FloatTensor<Self>>) {
        let heads = spec.heads;
        if !attention::takes(q.shape.dims::<3>(), k.shape.dims::<3>()[2], heads) {
            #[cfg(feature = "cuda")]
            if attention_blas::takes(&[&q, &k, &v], q.shape.dims::<3>(), heads) {
                let x = attention::Qkv::Separate([q, k, v]);
                return attention_blas::forward::<R, F, I, BT>(x, mask, spec, with_probs);
            }
            return super::composed_attention::<Self>([q, k, v], mask, spec, with_probs);
        }
        let x = attention::Qkv::Separate([q, k, v]);
        attention::forward::<R, F>(x, mask, spec, with_probs)
    }

    fn kiln_attention_backward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        probs: FloatTensor<Self>,
        dout: FloatTensor<Self>,
        spec: super::AttentionSpec,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let heads = spec.heads;
        if !attention::takes(q.shape.dims::<3>(), k.shape.dims::<3>()[2], heads) {
            #[cfg(feature = "cuda")]
            if attention_blas::takes(&[&q, &k, &v, &probs, &dout], q.shape.dims::<3>(), heads) {
                let x = attention::Qkv::Separate([q, k, v]);
                let [dq, dk, dv]: [_; 3] =
                    attention_blas::backward::<R, F, I, BT>(x, probs, dout, spec)
                        .try_into()
                        .expect("three gradients");
                return (dq, dk, dv);
            }
            return super::composed_attention_backward::<Self>([q, k, v], probs, dout, spec);
        }
        let x = attention::Qkv::Separate([q, k, v]);
        let [dq, dk, dv]: [_; 3] = attention::backward::<R, F>(x, probs, dout, spec)
            .try_into()
            .expect("three gradients");
        (dq, dk, dv)
    }

    fn kiln_attention_qkv(
        qkv: FloatTensor<Self>,
        mask: FloatTensor<Self>,
        spec: super::AttentionSpec,
        with_probs: bool,
    ) -> (FloatTensor<Self>, Option<FloatTensor<Self>>) {
        let [b, t, h3] = qkv.shape.dims::<3>();
        if !attention::takes([b, t, h3 / 3], h3 / 3, spec.heads) {
            #[cfg(feature = "cuda")]
            if attention_blas::takes(&[&qkv], [b, t, h3 / 3], spec.heads) {
                let x = attention::Qkv::Fused(qkv);
                return attention_blas::forward::<R, F, I, BT>(x, mask, spec, with_probs);
            }
            let qkv = super::split_qkv::<Self>(qkv);
            return super::composed_attention::<Self>(qkv, mask, spec, with_probs);
        }
        let x = attention::Qkv::Fused(qkv);
        attention::forward::<R, F>(x, mask, spec, with_probs)
    }

    fn kiln_attention_qkv_backward(
        qkv: FloatTensor<Self>,
        probs: FloatTensor<Self>,
        dout: FloatTensor<Self>,
        spec: super::AttentionSpec,
    ) -> FloatTensor<Self> {
        let [b, t, h3] = qkv.shape.dims::<3>();
        if !attention::takes([b, t, h3 / 3], h3 / 3, spec.heads) {
            #[cfg(feature = "cuda")]
            if attention_blas::takes(&[&qkv, &probs, &dout], [b, t, h3 / 3], spec.heads) {
                let x = attention::Qkv::Fused(qkv);
                let [dqkv]: [_; 1] = attention_blas::backward::<R, F, I, BT>(x, probs, dout, spec)
                    .try_into()
                    .expect("one gradient");
                return dqkv;
            }
            let qkv = super::split_qkv::<Self>(qkv);
            let (dq, dk, dv) = super::composed_attention_backward::<Self>(qkv, probs, dout, spec);
            return Self::float_cat(vec![dq, dk, dv], 2);
        }
        let x = attention::Qkv::Fused(qkv);
        let [dqkv]: [_; 1] = attention::backward::<R, F>(x, probs, dout, spec)
            .try_into()
            .expect("one gradient");
        dqkv
    }

    /// The CPU's counter-hash mask, made by a kernel ([`dropout`]): the same units drop on every
    /// device, so a GPU run follows the CPU run step for step.
    fn kiln_dropout_mask(
        shape: Shape,
        keep: f64,
        seed: u64,
        device: &Self::Device,
    ) -> FloatTensor<Self> {
        dropout::dropout_mask::<R, F>(shape.num_elements(), keep, seed, device)
    }

    /// The mask made inside the multiply: one launch, and no mask kept for the backward.
    fn kiln_dropout_apply(x: FloatTensor<Self>, keep: f64, seed: u64) -> FloatTensor<Self> {
        dropout::dropout_apply::<R, F>(x, keep, seed)
    }
}

/// Whether `R` is CUDA's runtime.
#[cfg_attr(not(feature = "cuda"), allow(clippy::extra_unused_type_parameters))]
fn is_cuda<R: CubeRuntime>() -> bool {
    #[cfg(feature = "cuda")]
    {
        std::any::TypeId::of::<R>()
            == std::any::TypeId::of::<burn_cubecl::cubecl::cuda::CudaRuntime>()
    }
    #[cfg(not(feature = "cuda"))]
    {
        false
    }
}

/// `y + b` with `b [N]` broadcast over the rows of `y [M, N]`.
fn with_bias<R, F, I, BT>(y: CubeTensor<R>, b: Option<CubeTensor<R>>) -> CubeTensor<R>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    match b {
        Some(b) => {
            let n = b.shape.num_elements();
            let b = CubeBackend::<R, F, I, BT>::float_reshape(b, Shape::new([1, n]));
            CubeBackend::<R, F, I, BT>::float_add(y, b)
        }
        None => y,
    }
}
