//! Softmax cross-entropy on the GPU with PyTorch's `ignore_index`: the forward is one cube per row
//! (the row's maximum and Σ exp as tree reductions, `lse − logit[target]`), the backward one
//! element-wise pass, `dloss·(softmax − onehot)`. Burn's composed chain takes ten launches and as
//! many `[N, C]` buffers (a causal LM's are hundreds of MB).
//!
//! A target outside `0..C` that is not the ignored one has no logit: its loss is NaN (a GPU kernel
//! cannot stop the run to name it; the trainer stops on the non-finite loss). The CPU kernel
//! names it.

use burn::tensor::Shape;
use burn_cubecl::cubecl;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{CubeRuntime, FloatElement, IntElement};
use cubecl::prelude::*;

use super::grid::{flat_grid, row_grid, tree_reduce, ROW_UNITS};

#[cube(launch)]
fn cross_entropy_kernel<F: Float, I: Int>(
    x: &Tensor<F>,
    targets: &Tensor<I>,
    losses: &mut Tensor<F>,
    lse: &mut Tensor<F>,
    classes: u32,
    ignore: i32,
    #[comptime] units: usize,
) {
    let c = classes as usize;
    let rows = lse.len();
    let u = UNIT_POS as usize;
    let mut partial = SharedMemory::<F>::new(units);
    let mut row = CUBE_POS_X as usize;
    while row < rows {
        sync_cube();
        let base = row * c;
        let mut m = F::min_value();
        let mut j = u;
        while j < c {
            m = F::max(m, x[base + j]);
            j += units;
        }
        partial[u] = m;
        let mx = tree_reduce::<F>(&mut partial, true);
        sync_cube();
        let mut acc = F::new(0.0);
        let mut k = u;
        while k < c {
            acc += F::exp(x[base + k] - mx);
            k += units;
        }
        partial[u] = acc;
        let e = F::ln(tree_reduce::<F>(&mut partial, false)) + mx;
        if u == 0 {
            let target = i32::cast_from(targets[row]);
            let mut loss = F::new(0.0);
            if target != ignore {
                if target >= 0 && (target as u32) < classes {
                    loss = e - x[base + target as usize];
                } else {
                    // NaN, √−1 made at run time: WGSL has no NaN literal.
                    loss = F::sqrt(F::min(e, F::new(0.0)) * F::new(0.0) - F::new(1.0));
                }
            }
            losses[row] = loss;
            lse[row] = e;
        }
        row += CUBE_COUNT_X as usize;
    }
}

#[cube(launch)]
fn cross_entropy_backward_kernel<F: Float, I: Int>(
    x: &Tensor<F>,
    targets: &Tensor<I>,
    lse: &Tensor<F>,
    dloss: &Tensor<F>,
    dx: &mut Tensor<F>,
    classes: u32,
    ignore: i32,
) {
    let n = dx.len();
    let c = classes as usize;
    let stride = CUBE_COUNT * CUBE_DIM as usize;
    let mut i = ABSOLUTE_POS;
    while i < n {
        let row = i / c;
        let target = i32::cast_from(targets[row]);
        let mut g = F::new(0.0);
        if target != ignore {
            let hit = select(target as u32 == (i % c) as u32, F::new(1.0), F::new(0.0));
            g = dloss[row] * (F::exp(x[i] - lse[row]) - hit);
        }
        dx[i] = g;
        i += stride;
    }
}

/// The ignored class as the kernels compare it (targets are read as i32; PyTorch's −100 fits).
fn ignore_i32(ignore: i64) -> i32 {
    ignore.clamp(i32::MIN as i64, i32::MAX as i64) as i32
}

/// `(losses [N], lse [N])` of `logits [N, C]` against `targets [N]`.
pub fn cross_entropy<R: CubeRuntime, F: FloatElement, I: IntElement>(
    logits: CubeTensor<R>,
    targets: CubeTensor<R>,
    ignore: i64,
) -> (CubeTensor<R>, CubeTensor<R>) {
    let (x, targets) = (into_contiguous(logits), into_contiguous(targets));
    let [n, c] = x.shape.dims::<2>();
    let (client, device) = (x.client.clone(), x.device.clone());
    let losses = empty_device::<R, F>(client.clone(), device.clone(), Shape::new([n]));
    let lse = empty_device::<R, F>(client.clone(), device, Shape::new([n]));
    let (count, dim) = row_grid(n);
    cross_entropy_kernel::launch::<F, I, R>(
        &client,
        count,
        dim,
        x.as_tensor_arg(1),
        targets.as_tensor_arg(1),
        losses.as_tensor_arg(1),
        lse.as_tensor_arg(1),
        ScalarArg::new(c as u32),
        ScalarArg::new(ignore_i32(ignore)),
        ROW_UNITS as usize,
    )
    .expect("cross_entropy launches");
    (losses, lse)
}

/// `dlogits` of [`cross_entropy`] for the loss gradient `dloss [N]`.
pub fn cross_entropy_backward<R: CubeRuntime, F: FloatElement, I: IntElement>(
    logits: CubeTensor<R>,
    targets: CubeTensor<R>,
    ignore: i64,
    lse: CubeTensor<R>,
    dloss: CubeTensor<R>,
) -> CubeTensor<R> {
    let (x, targets) = (into_contiguous(logits), into_contiguous(targets));
    let (lse, dloss) = (into_contiguous(lse), into_contiguous(dloss));
    let c = x.shape.dims::<2>()[1];
    let dx = empty_device::<R, F>(x.client.clone(), x.device.clone(), x.shape.clone());
    let (count, dim) = flat_grid(x.shape.num_elements());
    cross_entropy_backward_kernel::launch::<F, I, R>(
        &x.client,
        count,
        dim,
        x.as_tensor_arg(1),
        targets.as_tensor_arg(1),
        lse.as_tensor_arg(1),
        dloss.as_tensor_arg(1),
        dx.as_tensor_arg(1),
        ScalarArg::new(c as u32),
        ScalarArg::new(ignore_i32(ignore)),
    )
    .expect("cross_entropy_backward launches");
    dx
}
