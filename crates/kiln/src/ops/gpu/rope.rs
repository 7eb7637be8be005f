//! Rotary position embedding on the GPU: one element-wise launch (Burn's composed rotation takes
//! two slices, a negation, a concatenation and three products), forward and its transpose (the
//! gradient), the CPU kernel's arithmetic.

use burn_cubecl::cubecl;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{CubeRuntime, FloatElement};
use cubecl::prelude::*;

use super::grid::flat_grid;

/// `y = x·cos + rotate_half(x)·sin` over `x [B, T, heads, D]` and tables `[T, D]`, or with
/// `transpose` the rotation undone: `y = x·cos + rotate_halfᵀ(x·sin)`.
#[cube(launch)]
fn rope_kernel<F: Float>(
    x: &Tensor<F>,
    cos: &Tensor<F>,
    sin: &Tensor<F>,
    y: &mut Tensor<F>,
    row: u32,
    #[comptime] d: usize,
    #[comptime] transpose: bool,
) {
    let n = y.len();
    let (row, t) = (row as usize, cos.len() / d);
    let half = d / 2;
    let stride = CUBE_COUNT * CUBE_DIM as usize;
    let mut i = ABSOLUTE_POS;
    while i < n {
        let c = i % d;
        let at = ((i / row) % t) * d;
        let lower = c < half;
        // The partner in the other half of the head: c + D/2 below, c − D/2 above.
        let (pi, pc) = (
            select(lower, i + half, i - select(lower, 0, half)),
            select(lower, c + half, c - select(lower, 0, half)),
        );
        let sign = select(lower, F::new(-1.0), F::new(1.0));
        let turned = if transpose {
            -sign * x[pi] * sin[at + pc]
        } else {
            sign * x[pi] * sin[at + c]
        };
        y[i] = x[i] * cos[at + c] + turned;
        i += stride;
    }
}

/// [`rope_kernel`] over `x [B, T, heads, D]` with `cos`, `sin` `[T, D]`.
pub fn rope<R: CubeRuntime, F: FloatElement>(
    x: CubeTensor<R>,
    cos: CubeTensor<R>,
    sin: CubeTensor<R>,
    transpose: bool,
) -> CubeTensor<R> {
    let (x, cos, sin) = (
        into_contiguous(x),
        into_contiguous(cos),
        into_contiguous(sin),
    );
    let [_, _, heads, d] = x.shape.dims::<4>();
    let y = empty_device::<R, F>(x.client.clone(), x.device.clone(), x.shape.clone());
    let (count, dim) = flat_grid(x.shape.num_elements());
    rope_kernel::launch::<F, R>(
        &x.client,
        count,
        dim,
        x.as_tensor_arg(1),
        cos.as_tensor_arg(1),
        sin.as_tensor_arg(1),
        y.as_tensor_arg(1),
        ScalarArg::new((heads * d) as u32),
        d,
        transpose,
    )
    .expect("rope launches");
    y
}
