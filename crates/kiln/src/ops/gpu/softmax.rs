//! Attention's masked softmax on the GPU, forward and backward, one cube per row of scores
//! (`[B, heads, T, S]` read as `B·heads·T` rows of `S`): where Burn's composed softmax takes a
//! scale, a mask add, a max, a subtraction, an exp, a sum and a division (7 launches), this is
//! one. Row maxima and sums are tree reductions in shared memory in a fixed order.

use burn_cubecl::cubecl;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{CubeRuntime, FloatElement};
use cubecl::prelude::*;

use super::grid::{row_grid, tree_reduce, ROW_UNITS};

#[cube(launch)]
fn masked_softmax_forward_kernel<F: Float>(
    x: &Tensor<F>,
    mask: &Tensor<F>,
    y: &mut Tensor<F>,
    rows_per_batch: u32,
    scale: f32,
    #[comptime] units: usize,
) {
    let s = mask.shape(1);
    let rows = y.len() / s;
    let mut partial = SharedMemory::<F>::new(units);
    let mut row = CUBE_POS_X as usize;
    while row < rows {
        // Every unit has read the last row's reductions before the buffer is reused.
        sync_cube();
        let base = row * s;
        let mbase = (row / rows_per_batch as usize) * s;
        let mut m = F::min_value();
        let mut i = UNIT_POS as usize;
        while i < s {
            m = F::max(m, x[base + i] * F::cast_from(scale) + mask[mbase + i]);
            i += units;
        }
        partial[UNIT_POS as usize] = m;
        let row_max = tree_reduce::<F>(&mut partial, true);
        sync_cube();
        let mut acc = F::new(0.0);
        let mut j = UNIT_POS as usize;
        while j < s {
            let e = F::exp(x[base + j] * F::cast_from(scale) + mask[mbase + j] - row_max);
            y[base + j] = e;
            acc += e;
            j += units;
        }
        partial[UNIT_POS as usize] = acc;
        let total = tree_reduce::<F>(&mut partial, false);
        let mut k = UNIT_POS as usize;
        while k < s {
            y[base + k] = y[base + k] / total;
            k += units;
        }
        row += CUBE_COUNT_X as usize;
    }
}

/// `dx = (dy − Σ dy·y)·y·scale` per row.
#[cube(launch)]
fn masked_softmax_backward_kernel<F: Float>(
    y: &Tensor<F>,
    dy: &Tensor<F>,
    dx: &mut Tensor<F>,
    s: u32,
    scale: f32,
    #[comptime] units: usize,
) {
    let s = s as usize;
    let rows = dx.len() / s;
    let mut partial = SharedMemory::<F>::new(units);
    let mut row = CUBE_POS_X as usize;
    while row < rows {
        sync_cube();
        let base = row * s;
        let mut acc = F::new(0.0);
        let mut i = UNIT_POS as usize;
        while i < s {
            acc += dy[base + i] * y[base + i];
            i += units;
        }
        partial[UNIT_POS as usize] = acc;
        let dot = tree_reduce::<F>(&mut partial, false);
        let mut j = UNIT_POS as usize;
        while j < s {
            dx[base + j] = (dy[base + j] - dot) * y[base + j] * F::cast_from(scale);
            j += units;
        }
        row += CUBE_COUNT_X as usize;
    }
}

/// `softmax(x·scale + mask[b, s])` over the last dimension of `x [B, H, T, S]`, `mask [B, S]`.
pub fn masked_softmax<R: CubeRuntime, F: FloatElement>(
    x: CubeTensor<R>,
    mask: CubeTensor<R>,
    scale: f64,
) -> CubeTensor<R> {
    let (x, mask) = (into_contiguous(x), into_contiguous(mask));
    let [_, h, t, s] = x.shape.dims::<4>();
    let y = empty_device::<R, F>(x.client.clone(), x.device.clone(), x.shape.clone());
    let rows = x.shape.num_elements() / s.max(1);
    let (row_count, row_dim) = row_grid(rows);
    masked_softmax_forward_kernel::launch::<F, R>(
        &x.client,
        row_count,
        row_dim,
        x.as_tensor_arg(1),
        mask.as_tensor_arg(1),
        y.as_tensor_arg(1),
        ScalarArg::new((h * t) as u32),
        ScalarArg::new(scale as f32),
        ROW_UNITS as usize,
    )
    .expect("masked_softmax_forward launches");
    y
}

/// The gradient of [`masked_softmax`]'s input from its output `y` and output gradient `dy`.
pub fn masked_softmax_backward<R: CubeRuntime, F: FloatElement>(
    y: CubeTensor<R>,
    dy: CubeTensor<R>,
    scale: f64,
) -> CubeTensor<R> {
    let (y, dy) = (into_contiguous(y), into_contiguous(dy));
    let s = *y.shape.dims.last().expect("a 4-D tensor");
    let dx = empty_device::<R, F>(y.client.clone(), y.device.clone(), y.shape.clone());
    let rows = y.shape.num_elements() / s.max(1);
    let (row_count, row_dim) = row_grid(rows);
    masked_softmax_backward_kernel::launch::<F, R>(
        &y.client,
        row_count,
        row_dim,
        y.as_tensor_arg(1),
        dy.as_tensor_arg(1),
        dx.as_tensor_arg(1),
        ScalarArg::new(s as u32),
        ScalarArg::new(scale as f32),
        ROW_UNITS as usize,
    )
    .expect("masked_softmax_backward launches");
    dx
}
