//! Element-wise kernels, one launch each where Burn's composed ops take 3–14: exact GELU, SwiGLU's
//! gate and their gradients, and the AdamW and SGD updates (the CPU kernels' arithmetic, in their order). Every unit strides
//! over the flat tensor (`flat_grid`), so any length fits wgpu's grid limit.

use burn_cubecl::cubecl;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{CubeRuntime, FloatElement};
use cubecl::prelude::*;

use super::grid::flat_grid;
use crate::ops::{AdamWStep, SgdStep};

const FRAC_1_SQRT_2: f32 = std::f32::consts::FRAC_1_SQRT_2;
/// 1/√(2π).
const INV_SQRT_2PI: f32 = 0.398_942_3;

#[cube(launch)]
fn gelu_kernel<F: Float>(x: &Tensor<F>, y: &mut Tensor<F>) {
    let n = y.len();
    let stride = CUBE_COUNT * CUBE_DIM as usize;
    let mut i = ABSOLUTE_POS;
    while i < n {
        let v = x[i];
        y[i] = v * F::new(0.5) * (F::new(1.0) + F::erf(v * F::new(FRAC_1_SQRT_2)));
        i += stride;
    }
}

#[cube(launch)]
fn gelu_backward_kernel<F: Float>(x: &Tensor<F>, dy: &Tensor<F>, dx: &mut Tensor<F>) {
    let n = dx.len();
    let stride = CUBE_COUNT * CUBE_DIM as usize;
    let mut i = ABSOLUTE_POS;
    while i < n {
        let v = x[i];
        let cdf = F::new(0.5) * (F::new(1.0) + F::erf(v * F::new(FRAC_1_SQRT_2)));
        let pdf = F::exp(v * v * F::new(-0.5)) * F::new(INV_SQRT_2PI);
        dx[i] = dy[i] * (cdf + v * pdf);
        i += stride;
    }
}

/// `silu(g)·u` (SwiGLU's gate), the CPU's expression: `g / (1 + e^(−g)) · u`.
#[cube(launch)]
fn swiglu_kernel<F: Float>(g: &Tensor<F>, u: &Tensor<F>, y: &mut Tensor<F>) {
    let n = y.len();
    let stride = CUBE_COUNT * CUBE_DIM as usize;
    let mut i = ABSOLUTE_POS;
    while i < n {
        let v = g[i];
        y[i] = v / (F::new(1.0) + F::exp(-v)) * u[i];
        i += stride;
    }
}

/// `dg = dy·u·σ(g)(1 + g(1 − σ(g)))`, `du = dy·silu(g)`.
#[cube(launch)]
fn swiglu_backward_kernel<F: Float>(
    g: &Tensor<F>,
    u: &Tensor<F>,
    dy: &Tensor<F>,
    dg: &mut Tensor<F>,
    du: &mut Tensor<F>,
) {
    let n = dg.len();
    let stride = CUBE_COUNT * CUBE_DIM as usize;
    let mut i = ABSOLUTE_POS;
    while i < n {
        let x = g[i];
        let s = F::new(1.0) / (F::new(1.0) + F::exp(-x));
        let d = dy[i];
        dg[i] = d * u[i] * (s * (F::new(1.0) + x * (F::new(1.0) - s)));
        du[i] = d * (x * s);
        i += stride;
    }
}

/// One AdamW step, as `ops::cpu`'s kernel writes it (`torch.optim.AdamW`: decoupled decay, then
/// the bias-corrected step); the scalars come formed in f64 on the host and rounded once to f32,
/// as the CPU's do (1 − 0.999 formed in f32 is 1.3e-5 off).
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn adamw_kernel<F: Float>(
    p: &Tensor<F>,
    g: &Tensor<F>,
    m: &Tensor<F>,
    v: &Tensor<F>,
    p_out: &mut Tensor<F>,
    m_out: &mut Tensor<F>,
    v_out: &mut Tensor<F>,
    moments: &AdamScalars,
    step: &StepScalars,
) {
    let (b1, b2) = (F::cast_from(moments.b1), F::cast_from(moments.b2));
    let (one_b1, one_b2) = (F::cast_from(moments.one_b1), F::cast_from(moments.one_b2));
    let (decay, eps) = (F::cast_from(step.decay), F::cast_from(step.eps));
    let (lr, bc2, gs) = (
        F::cast_from(step.lr),
        F::cast_from(step.bc2),
        F::cast_from(step.gs),
    );
    let n = p_out.len();
    let stride = CUBE_COUNT * CUBE_DIM as usize;
    let mut i = ABSOLUTE_POS;
    while i < n {
        let gi = g[i] * gs;
        let mi = m[i] * b1 + gi * one_b1;
        let vi = v[i] * b2 + gi * gi * one_b2;
        let denom = F::sqrt(vi) / bc2 + eps;
        p_out[i] = p[i] * decay - lr * (mi / denom);
        m_out[i] = mi;
        v_out[i] = vi;
        i += stride;
    }
}

/// β₁, β₂, 1 − β₁, 1 − β₂.
#[derive(CubeLaunch, CubeType)]
struct AdamScalars {
    b1: f32,
    b2: f32,
    one_b1: f32,
    one_b2: f32,
}

/// 1 − lr·decay, ε, lr / bias correction 1, √(bias correction 2), the gradient's scale.
#[derive(CubeLaunch, CubeType)]
struct StepScalars {
    decay: f32,
    eps: f32,
    lr: f32,
    bc2: f32,
    gs: f32,
}

/// One SGD step as `ops::cpu`'s kernel writes it (`torch.optim.SGD`): `g' = g·scale + wd·p`; with
/// momentum the buffer becomes `g'` on the first step, else `buf·μ + g'·(1 − dampening)`; the step is
/// the buffer (or `g' + μ·buf` with Nesterov), or `g'` without momentum.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn sgd_kernel<F: Float>(
    p: &Tensor<F>,
    g: &Tensor<F>,
    buf: &Tensor<F>,
    p_out: &mut Tensor<F>,
    buf_out: &mut Tensor<F>,
    h: &SgdScalars,
    #[comptime] momentum: bool,
    #[comptime] first: bool,
    #[comptime] nesterov: bool,
) {
    let (lr, wd, gs) = (F::cast_from(h.lr), F::cast_from(h.wd), F::cast_from(h.gs));
    let (mu, damp) = (F::cast_from(h.mu), F::cast_from(h.damp));
    let n = p_out.len();
    let stride = CUBE_COUNT * CUBE_DIM as usize;
    let mut i = ABSOLUTE_POS;
    while i < n {
        let pi = p[i];
        let gi = g[i] * gs + wd * pi;
        if momentum {
            let mut b = gi;
            if !first {
                b = buf[i] * mu + gi * damp;
            }
            buf_out[i] = b;
            if nesterov {
                p_out[i] = pi - lr * (gi + mu * b);
            } else {
                p_out[i] = pi - lr * b;
            }
        } else {
            p_out[i] = pi - lr * gi;
        }
        i += stride;
    }
}

/// lr, weight decay, the gradient's scale, momentum μ, 1 − dampening.
#[derive(CubeLaunch, CubeType)]
struct SgdScalars {
    lr: f32,
    wd: f32,
    gs: f32,
    mu: f32,
    damp: f32,
}

fn like<R: CubeRuntime, F: FloatElement>(x: &CubeTensor<R>) -> CubeTensor<R> {
    empty_device::<R, F>(x.client.clone(), x.device.clone(), x.shape.clone())
}

pub fn gelu<R: CubeRuntime, F: FloatElement>(x: CubeTensor<R>) -> CubeTensor<R> {
    let x = into_contiguous(x);
    let y = like::<R, F>(&x);
    let (count, dim) = flat_grid(x.shape.num_elements());
    gelu_kernel::launch::<F, R>(
        &x.client,
        count,
        dim,
        x.as_tensor_arg(1),
        y.as_tensor_arg(1),
    )
    .expect("gelu launches");
    y
}

pub fn gelu_backward<R: CubeRuntime, F: FloatElement>(
    x: CubeTensor<R>,
    dy: CubeTensor<R>,
) -> CubeTensor<R> {
    let (x, dy) = (into_contiguous(x), into_contiguous(dy));
    let dx = like::<R, F>(&x);
    let (count, dim) = flat_grid(x.shape.num_elements());
    gelu_backward_kernel::launch::<F, R>(
        &x.client,
        count,
        dim,
        x.as_tensor_arg(1),
        dy.as_tensor_arg(1),
        dx.as_tensor_arg(1),
    )
    .expect("gelu_backward launches");
    dx
}

/// `silu(g)·u` over flat tensors.
pub fn swiglu<R: CubeRuntime, F: FloatElement>(
    g: CubeTensor<R>,
    u: CubeTensor<R>,
) -> CubeTensor<R> {
    let (g, u) = (into_contiguous(g), into_contiguous(u));
    let y = like::<R, F>(&g);
    let (count, dim) = flat_grid(g.shape.num_elements());
    swiglu_kernel::launch::<F, R>(
        &g.client,
        count,
        dim,
        g.as_tensor_arg(1),
        u.as_tensor_arg(1),
        y.as_tensor_arg(1),
    )
    .expect("swiglu launches");
    y
}

/// `(dg, du)` of [`swiglu`] for the output gradient `dy`.
pub fn swiglu_backward<R: CubeRuntime, F: FloatElement>(
    g: CubeTensor<R>,
    u: CubeTensor<R>,
    dy: CubeTensor<R>,
) -> (CubeTensor<R>, CubeTensor<R>) {
    let (g, u, dy) = (into_contiguous(g), into_contiguous(u), into_contiguous(dy));
    let (dg, du) = (like::<R, F>(&g), like::<R, F>(&u));
    let (count, dim) = flat_grid(g.shape.num_elements());
    swiglu_backward_kernel::launch::<F, R>(
        &g.client,
        count,
        dim,
        g.as_tensor_arg(1),
        u.as_tensor_arg(1),
        dy.as_tensor_arg(1),
        dg.as_tensor_arg(1),
        du.as_tensor_arg(1),
    )
    .expect("swiglu_backward launches");
    (dg, du)
}

/// `(p, m, v)` after one AdamW step (new buffers; the old ones go back to the pool).
pub fn adamw<R: CubeRuntime, F: FloatElement>(
    p: CubeTensor<R>,
    g: CubeTensor<R>,
    m: CubeTensor<R>,
    v: CubeTensor<R>,
    h: AdamWStep,
) -> (CubeTensor<R>, CubeTensor<R>, CubeTensor<R>) {
    let (p, g, m, v) = (
        into_contiguous(p),
        into_contiguous(g),
        into_contiguous(m),
        into_contiguous(v),
    );
    let (po, mo, vo) = (like::<R, F>(&p), like::<R, F>(&m), like::<R, F>(&v));
    let (count, dim) = flat_grid(p.shape.num_elements());
    adamw_kernel::launch::<F, R>(
        &p.client,
        count,
        dim,
        p.as_tensor_arg(1),
        g.as_tensor_arg(1),
        m.as_tensor_arg(1),
        v.as_tensor_arg(1),
        po.as_tensor_arg(1),
        mo.as_tensor_arg(1),
        vo.as_tensor_arg(1),
        AdamScalarsLaunch::new(
            ScalarArg::new(h.beta1 as f32),
            ScalarArg::new(h.beta2 as f32),
            ScalarArg::new((1.0 - h.beta1) as f32),
            ScalarArg::new((1.0 - h.beta2) as f32),
        ),
        StepScalarsLaunch::new(
            ScalarArg::new((1.0 - h.lr * h.weight_decay) as f32),
            ScalarArg::new(h.eps as f32),
            ScalarArg::new((h.lr / h.bias_correction1) as f32),
            ScalarArg::new(h.bias_correction2_sqrt as f32),
            ScalarArg::new(h.grad_scale as f32),
        ),
    )
    .expect("adamw launches");
    (po, mo, vo)
}

/// `(p, buf)` after one SGD step (`buf` only with momentum; new buffers).
pub fn sgd<R: CubeRuntime, F: FloatElement>(
    p: CubeTensor<R>,
    g: CubeTensor<R>,
    buf: Option<CubeTensor<R>>,
    h: SgdStep,
) -> (CubeTensor<R>, Option<CubeTensor<R>>) {
    let (p, g) = (into_contiguous(p), into_contiguous(g));
    let momentum = h.momentum != 0.0;
    let first = buf.is_none();
    // Without a buffer to read (no momentum, or the first step) the gradient stands in: the
    // kernel never reads it then.
    let buf_in = buf.map(into_contiguous).unwrap_or_else(|| g.clone());
    let p_out = like::<R, F>(&p);
    // Without momentum nothing is written to the buffer: a one-element stand-in.
    let buf_out = if momentum {
        like::<R, F>(&p)
    } else {
        empty_device::<R, F>(
            p.client.clone(),
            p.device.clone(),
            burn::tensor::Shape::new([1]),
        )
    };
    let (count, dim) = flat_grid(p.shape.num_elements());
    sgd_kernel::launch::<F, R>(
        &p.client,
        count,
        dim,
        p.as_tensor_arg(1),
        g.as_tensor_arg(1),
        buf_in.as_tensor_arg(1),
        p_out.as_tensor_arg(1),
        buf_out.as_tensor_arg(1),
        SgdScalarsLaunch::new(
            ScalarArg::new(h.lr as f32),
            ScalarArg::new(h.weight_decay as f32),
            ScalarArg::new(h.grad_scale as f32),
            ScalarArg::new(h.momentum as f32),
            ScalarArg::new((1.0 - h.dampening) as f32),
        ),
        momentum,
        first,
        h.nesterov,
    )
    .expect("sgd launches");
    (p_out, momentum.then_some(buf_out))
}
