//! Normalisation on the GPU: RMSNorm and LayerNorm, forward and backward. Row kernels take one
//! cube per row, their sums a tree sum in shared memory in a fixed order (the same input gives the
//! same bits); the weight and bias gradients are column sums over chunks of rows, then over the
//! chunks. The same source runs on CUDA and on wgpu (lavapipe in CI), checked against the CPU's
//! fused ops and, over 70,000 rows, against f64.
//!
//! Every loop stays under 65,536 trips: lavapipe (llvmpipe) ends longer loops there without a
//! word. That cap, not Burn, was why RMSNorm's weight gradient over 70,000 rows came out 0.22 off
//! on wgpu (Burn's composed reductions loop over all rows in one unit too).

use burn::tensor::Shape;
use burn_cubecl::cubecl;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{CubeRuntime, FloatElement};
use cubecl::prelude::*;

use super::columns::{chunks, column_grid, lane_rows, lane_step, sum_lanes, sum_rows, LANE_CELLS};
use super::dropout::kept;
use super::grid::{row_grid, tree_reduce, ROW_UNITS};
use crate::ops::Dropout;

#[cube(launch)]
fn rms_norm_forward<F: Float>(
    x: &Tensor<F>,
    w: &Tensor<F>,
    y: &mut Tensor<F>,
    rinv: &mut Tensor<F>,
    eps: f32,
    #[comptime] units: usize,
) {
    let rows = rinv.len();
    let mut partial = SharedMemory::<F>::new(units);
    // At most 65,535 cubes (wgpu's limit for one grid dimension), each striding over the rows.
    let mut row = CUBE_POS_X as usize;
    while row < rows {
        // Every unit is done with the last row's shared sums before they are overwritten.
        sync_cube();
        let h = x.shape(1);
        let base = row * h;
        let mut acc = F::new(0.0);
        let mut i = UNIT_POS as usize;
        while i < h {
            let v = x[base + i];
            acc += v * v;
            i += units;
        }
        partial[UNIT_POS as usize] = acc;
        let total = tree_reduce::<F>(&mut partial, false);
        let inv = F::new(1.0) / F::sqrt(total / F::cast_from(h) + F::cast_from(eps));
        if UNIT_POS == 0 {
            rinv[row] = inv;
        }
        let mut j = UNIT_POS as usize;
        while j < h {
            y[base + j] = x[base + j] * inv * w[j];
            j += units;
        }
        row += CUBE_COUNT_X as usize;
    }
}

/// `(y, 1/rms)` of the rows of `x [R, H]` scaled by `w [H]`.
pub fn rms_norm<R: CubeRuntime, F: FloatElement>(
    x: CubeTensor<R>,
    w: CubeTensor<R>,
    eps: f64,
) -> (CubeTensor<R>, CubeTensor<R>) {
    let (x, w) = (into_contiguous(x), into_contiguous(w));
    let (rows, h) = (x.shape.dims[0], x.shape.dims[1]);
    let (client, device) = (x.client.clone(), x.device.clone());
    let y = empty_device::<R, F>(client.clone(), device.clone(), Shape::new([rows, h]));
    let rinv = empty_device::<R, F>(client.clone(), device, Shape::new([rows]));
    let (row_count, row_dim) = row_grid(rows);
    rms_norm_forward::launch::<F, R>(
        &client,
        row_count,
        row_dim,
        x.as_tensor_arg(1),
        w.as_tensor_arg(1),
        y.as_tensor_arg(1),
        rinv.as_tensor_arg(1),
        ScalarArg::new(eps as f32),
        ROW_UNITS as usize,
    )
    .expect("rms_norm_forward launches");
    (y, rinv)
}

#[cube(launch)]
fn layer_norm_forward<F: Float>(
    x: &Tensor<F>,
    w: &Tensor<F>,
    b: &Tensor<F>,
    y: &mut Tensor<F>,
    mean: &mut Tensor<F>,
    rstd: &mut Tensor<F>,
    eps: f32,
    #[comptime] units: usize,
) {
    let rows = rstd.len();
    let mut partial = SharedMemory::<F>::new(units);
    // At most 65,535 cubes (wgpu's limit for one grid dimension), each striding over the rows.
    let mut row = CUBE_POS_X as usize;
    while row < rows {
        // Every unit is done with the last row's shared sums before they are overwritten.
        sync_cube();
        let h = x.shape(1);
        let base = row * h;
        let mut acc = F::new(0.0);
        let mut i = UNIT_POS as usize;
        while i < h {
            acc += x[base + i];
            i += units;
        }
        normalize_row::<F>(x, w, b, y, mean, rstd, &mut partial, acc, row, eps, units);
        row += CUBE_COUNT_X as usize;
    }
}

/// A layer norm's row `row` of `x` once each unit holds the sum `acc` of the values it read (every
/// `units`-th from its position): the mean; the variance as the mean of the squared deviations (two
/// passes, as the CPU kernel computes it); `mean`, `rstd` and `y`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn normalize_row<F: Float>(
    x: &Tensor<F>,
    w: &Tensor<F>,
    b: &Tensor<F>,
    y: &mut Tensor<F>,
    mean: &mut Tensor<F>,
    rstd: &mut Tensor<F>,
    partial: &mut SharedMemory<F>,
    acc: F,
    row: usize,
    eps: f32,
    #[comptime] units: usize,
) {
    let h = x.shape(1);
    let base = row * h;
    partial[UNIT_POS as usize] = acc;
    let mu = tree_reduce::<F>(partial, false) / F::cast_from(h);
    // Every unit has read the sum before the buffer is reused.
    sync_cube();
    let mut acc2 = F::new(0.0);
    let mut j = UNIT_POS as usize;
    while j < h {
        let d = x[base + j] - mu;
        acc2 += d * d;
        j += units;
    }
    partial[UNIT_POS as usize] = acc2;
    let var = tree_reduce::<F>(partial, false) / F::cast_from(h);
    let inv = F::new(1.0) / F::sqrt(var + F::cast_from(eps));
    if UNIT_POS == 0 {
        mean[row] = mu;
        rstd[row] = inv;
    }
    let mut k = UNIT_POS as usize;
    while k < h {
        y[base + k] = (x[base + k] - mu) * inv * w[k] + b[k];
        k += units;
    }
}

/// A transformer block's "dropout, residual add, norm" in one pass per row: `z = dropout(x) + r`
/// (the CPU's counter-hash mask over the flat index), written for the backward, then the layer
/// norm of `z`. Each unit reads back only the `z` it wrote itself.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn residual_layer_norm_forward<F: Float>(
    x: &Tensor<F>,
    r: &Tensor<F>,
    w: &Tensor<F>,
    b: &Tensor<F>,
    y: &mut Tensor<F>,
    z: &mut Tensor<F>,
    mean: &mut Tensor<F>,
    rstd: &mut Tensor<F>,
    eps: f32,
    keep: f32,
    inv_keep: f32,
    seed_hi: u32,
    seed_lo: u32,
    #[comptime] units: usize,
    #[comptime] dropout: bool,
) {
    let rows = rstd.len();
    let mut partial = SharedMemory::<F>::new(units);
    let mut row = CUBE_POS_X as usize;
    while row < rows {
        sync_cube();
        let h = x.shape(1);
        let base = row * h;
        let mut acc = F::new(0.0);
        let mut i = UNIT_POS as usize;
        while i < h {
            let mut xi = x[base + i];
            if dropout {
                xi *= kept::<F>(base + i, seed_hi, seed_lo, keep, inv_keep);
            }
            let zi = xi + r[base + i];
            z[base + i] = zi;
            acc += zi;
            i += units;
        }
        normalize_row::<F>(z, w, b, y, mean, rstd, &mut partial, acc, row, eps, units);
        row += CUBE_COUNT_X as usize;
    }
}

/// `(y, z, mean, rstd)` of `layer_norm(dropout(x) + r)` over the rows of `[R, H]` inputs
/// (`ops::KilnBackend::kiln_residual_layer_norm`'s contract), in one launch.
pub fn residual_layer_norm<R: CubeRuntime, F: FloatElement>(
    [x, r]: [CubeTensor<R>; 2],
    [w, b]: [CubeTensor<R>; 2],
    eps: f64,
    dropout: Dropout,
) -> (CubeTensor<R>, CubeTensor<R>, CubeTensor<R>, CubeTensor<R>) {
    let seed = dropout.seed;
    let (x, r) = (into_contiguous(x), into_contiguous(r));
    let (w, b) = (into_contiguous(w), into_contiguous(b));
    let (rows, h) = (x.shape.dims[0], x.shape.dims[1]);
    assert!(
        rows * h <= u32::MAX as usize,
        "dropout over {} elements (at most 2³²)",
        rows * h
    );
    let (client, device) = (x.client.clone(), x.device.clone());
    let new = |dims: &[usize]| empty_device::<R, F>(client.clone(), device.clone(), dims.into());
    let (y, z) = (new(&[rows, h]), new(&[rows, h]));
    let (mean, rstd) = (new(&[rows]), new(&[rows]));
    let keep = dropout.keep();
    let (row_count, row_dim) = row_grid(rows);
    residual_layer_norm_forward::launch::<F, R>(
        &client,
        row_count,
        row_dim,
        x.as_tensor_arg(1),
        r.as_tensor_arg(1),
        w.as_tensor_arg(1),
        b.as_tensor_arg(1),
        y.as_tensor_arg(1),
        z.as_tensor_arg(1),
        mean.as_tensor_arg(1),
        rstd.as_tensor_arg(1),
        ScalarArg::new(eps as f32),
        ScalarArg::new(keep as f32),
        ScalarArg::new((1.0 / keep) as f32),
        ScalarArg::new((seed >> 32) as u32),
        ScalarArg::new(seed as u32),
        ROW_UNITS as usize,
        dropout.is_active(),
    )
    .expect("residual_layer_norm_forward launches");
    (y, z, mean, rstd)
}

/// `dx` of the layer norm, one cube per row: with `x̂ = (x − μ)·rstd` and `g = dy·w`,
/// `dx = (g − mean(g) − x̂·mean(g·x̂))·rstd`.
#[cube(launch)]
fn layer_norm_backward_dx<F: Float>(
    x: &Tensor<F>,
    w: &Tensor<F>,
    mean: &Tensor<F>,
    rstd: &Tensor<F>,
    dy: &Tensor<F>,
    dx: &mut Tensor<F>,
    #[comptime] units: usize,
) {
    let rows = rstd.len();
    let mut sum_g = SharedMemory::<F>::new(units);
    let mut sum_gx = SharedMemory::<F>::new(units);
    // At most 65,535 cubes (wgpu's limit for one grid dimension), each striding over the rows.
    let mut row = CUBE_POS_X as usize;
    while row < rows {
        // Every unit is done with the last row's shared sums before they are overwritten.
        sync_cube();
        let h = x.shape(1);
        let base = row * h;
        let (mu, inv) = (mean[row], rstd[row]);
        let mut a = F::new(0.0);
        let mut c = F::new(0.0);
        let mut i = UNIT_POS as usize;
        while i < h {
            let g = dy[base + i] * w[i];
            a += g;
            c += g * (x[base + i] - mu) * inv;
            i += units;
        }
        sum_g[UNIT_POS as usize] = a;
        sum_gx[UNIT_POS as usize] = c;
        let c1 = tree_reduce::<F>(&mut sum_g, false) / F::cast_from(h);
        let c2 = tree_reduce::<F>(&mut sum_gx, false) / F::cast_from(h);
        let mut j = UNIT_POS as usize;
        while j < h {
            let xhat = (x[base + j] - mu) * inv;
            dx[base + j] = (dy[base + j] * w[j] - c1 - xhat * c2) * inv;
            j += units;
        }
        row += CUBE_COUNT_X as usize;
    }
}

/// Partial column sums of the layer norm's parameter gradients over one chunk of rows (grid y):
/// `dw += dy·x̂`, `db += dy`, a unit per column and row lane, as [`super::columns`] sums. The chunk
/// partials are summed after ([`sum_rows`]).
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn layer_norm_params_partial<F: Float>(
    x: &Tensor<F>,
    mean: &Tensor<F>,
    rstd: &Tensor<F>,
    dy: &Tensor<F>,
    pw: &mut Tensor<F>,
    pb: &mut Tensor<F>,
    chunk: u32,
    #[comptime] cells: usize,
) {
    let col = ABSOLUTE_POS_X as usize;
    let h = x.shape(1);
    let mut sw = F::new(0.0);
    let mut sb = F::new(0.0);
    if col < h {
        let (mut r, end) = lane_rows(rstd.len(), chunk);
        while r < end {
            let d = dy[r * h + col];
            sw += d * (x[r * h + col] - mean[r]) * rstd[r];
            sb += d;
            r += lane_step();
        }
    }
    let mut lanes_w = SharedMemory::<F>::new(cells);
    let mut lanes_b = SharedMemory::<F>::new(cells);
    let (tw, tb) = (
        sum_lanes::<F>(sw, &mut lanes_w),
        sum_lanes::<F>(sb, &mut lanes_b),
    );
    if col < h && UNIT_POS_Y == 0 {
        let c = CUBE_POS_Y as usize;
        pw[c * h + col] = tw;
        pb[c * h + col] = tb;
    }
}

/// `(y, mean, rstd)` of the layer norm of the rows of `x [R, H]`.
pub fn layer_norm<R: CubeRuntime, F: FloatElement>(
    x: CubeTensor<R>,
    w: CubeTensor<R>,
    b: CubeTensor<R>,
    eps: f64,
) -> (CubeTensor<R>, CubeTensor<R>, CubeTensor<R>) {
    let (x, w, b) = (into_contiguous(x), into_contiguous(w), into_contiguous(b));
    let (rows, h) = (x.shape.dims[0], x.shape.dims[1]);
    let (client, device) = (x.client.clone(), x.device.clone());
    let y = empty_device::<R, F>(client.clone(), device.clone(), Shape::new([rows, h]));
    let mean = empty_device::<R, F>(client.clone(), device.clone(), Shape::new([rows]));
    let rstd = empty_device::<R, F>(client.clone(), device, Shape::new([rows]));
    let (row_count, row_dim) = row_grid(rows);
    layer_norm_forward::launch::<F, R>(
        &client,
        row_count,
        row_dim,
        x.as_tensor_arg(1),
        w.as_tensor_arg(1),
        b.as_tensor_arg(1),
        y.as_tensor_arg(1),
        mean.as_tensor_arg(1),
        rstd.as_tensor_arg(1),
        ScalarArg::new(eps as f32),
        ROW_UNITS as usize,
    )
    .expect("layer_norm_forward launches");
    (y, mean, rstd)
}

/// `(dx, dw, db)` of [`layer_norm`] for the output gradient `dy [R, H]`.
pub fn layer_norm_backward<R: CubeRuntime, F: FloatElement>(
    x: CubeTensor<R>,
    w: CubeTensor<R>,
    mean: CubeTensor<R>,
    rstd: CubeTensor<R>,
    dy: CubeTensor<R>,
) -> (CubeTensor<R>, CubeTensor<R>, CubeTensor<R>) {
    let (x, w, dy) = (into_contiguous(x), into_contiguous(w), into_contiguous(dy));
    let (mean, rstd) = (into_contiguous(mean), into_contiguous(rstd));
    let (rows, h) = (x.shape.dims[0], x.shape.dims[1]);
    let (client, device) = (x.client.clone(), x.device.clone());
    let dx = empty_device::<R, F>(client.clone(), device.clone(), Shape::new([rows, h]));
    let (chunk, n_chunks) = chunks(rows);
    let pw = empty_device::<R, F>(client.clone(), device.clone(), Shape::new([n_chunks, h]));
    let pb = empty_device::<R, F>(client.clone(), device, Shape::new([n_chunks, h]));
    let (row_count, row_dim) = row_grid(rows);
    layer_norm_backward_dx::launch::<F, R>(
        &client,
        row_count,
        row_dim,
        x.as_tensor_arg(1),
        w.as_tensor_arg(1),
        mean.as_tensor_arg(1),
        rstd.as_tensor_arg(1),
        dy.as_tensor_arg(1),
        dx.as_tensor_arg(1),
        ROW_UNITS as usize,
    )
    .expect("layer_norm_backward_dx launches");
    let grid = column_grid(h, n_chunks);
    layer_norm_params_partial::launch::<F, R>(
        &client,
        grid.0,
        grid.1,
        x.as_tensor_arg(1),
        mean.as_tensor_arg(1),
        rstd.as_tensor_arg(1),
        dy.as_tensor_arg(1),
        pw.as_tensor_arg(1),
        pb.as_tensor_arg(1),
        ScalarArg::new(chunk as u32),
        LANE_CELLS,
    )
    .expect("layer_norm_params_partial launches");
    (dx, sum_rows::<R, F>(pw), sum_rows::<R, F>(pb))
}

/// `dx` of RMSNorm, one cube per row: with `x̂ = x·rinv` and `g = dy·w`,
/// `dx = (g − x̂·mean(g·x̂))·rinv`.
#[cube(launch)]
fn rms_norm_backward_dx<F: Float>(
    x: &Tensor<F>,
    w: &Tensor<F>,
    rinv: &Tensor<F>,
    dy: &Tensor<F>,
    dx: &mut Tensor<F>,
    #[comptime] units: usize,
) {
    let rows = rinv.len();
    let mut partial = SharedMemory::<F>::new(units);
    // At most 65,535 cubes (wgpu's limit for one grid dimension), each striding over the rows.
    let mut row = CUBE_POS_X as usize;
    while row < rows {
        // Every unit is done with the last row's shared sums before they are overwritten.
        sync_cube();
        let h = x.shape(1);
        let base = row * h;
        let inv = rinv[row];
        let mut acc = F::new(0.0);
        let mut i = UNIT_POS as usize;
        while i < h {
            acc += dy[base + i] * w[i] * x[base + i] * inv;
            i += units;
        }
        partial[UNIT_POS as usize] = acc;
        let c = tree_reduce::<F>(&mut partial, false) / F::cast_from(h);
        let mut j = UNIT_POS as usize;
        while j < h {
            let xhat = x[base + j] * inv;
            dx[base + j] = (dy[base + j] * w[j] - xhat * c) * inv;
            j += units;
        }
        row += CUBE_COUNT_X as usize;
    }
}

/// Partial column sums of RMSNorm's weight gradient over one chunk of rows (grid y), as
/// [`layer_norm_params_partial`]: `dw += dy·x·rinv`.
#[cube(launch)]
fn rms_norm_params_partial<F: Float>(
    x: &Tensor<F>,
    rinv: &Tensor<F>,
    dy: &Tensor<F>,
    pw: &mut Tensor<F>,
    chunk: u32,
    #[comptime] cells: usize,
) {
    let col = ABSOLUTE_POS_X as usize;
    let h = x.shape(1);
    let mut s = F::new(0.0);
    if col < h {
        let (mut r, end) = lane_rows(rinv.len(), chunk);
        while r < end {
            s += dy[r * h + col] * x[r * h + col] * rinv[r];
            r += lane_step();
        }
    }
    let mut lanes = SharedMemory::<F>::new(cells);
    let total = sum_lanes::<F>(s, &mut lanes);
    if col < h && UNIT_POS_Y == 0 {
        pw[CUBE_POS_Y as usize * h + col] = total;
    }
}

/// `(dx, dw)` of [`rms_norm`] for the output gradient `dy [R, H]`.
pub fn rms_norm_backward<R: CubeRuntime, F: FloatElement>(
    x: CubeTensor<R>,
    w: CubeTensor<R>,
    rinv: CubeTensor<R>,
    dy: CubeTensor<R>,
) -> (CubeTensor<R>, CubeTensor<R>) {
    let (x, w, dy, rinv) = (
        into_contiguous(x),
        into_contiguous(w),
        into_contiguous(dy),
        into_contiguous(rinv),
    );
    let (rows, h) = (x.shape.dims[0], x.shape.dims[1]);
    let (client, device) = (x.client.clone(), x.device.clone());
    let dx = empty_device::<R, F>(client.clone(), device.clone(), Shape::new([rows, h]));
    let (chunk, n_chunks) = chunks(rows);
    let pw = empty_device::<R, F>(client.clone(), device, Shape::new([n_chunks, h]));
    let (row_count, row_dim) = row_grid(rows);
    rms_norm_backward_dx::launch::<F, R>(
        &client,
        row_count,
        row_dim,
        x.as_tensor_arg(1),
        w.as_tensor_arg(1),
        rinv.as_tensor_arg(1),
        dy.as_tensor_arg(1),
        dx.as_tensor_arg(1),
        ROW_UNITS as usize,
    )
    .expect("rms_norm_backward_dx launches");
    let grid = column_grid(h, n_chunks);
    rms_norm_params_partial::launch::<F, R>(
        &client,
        grid.0,
        grid.1,
        x.as_tensor_arg(1),
        rinv.as_tensor_arg(1),
        dy.as_tensor_arg(1),
        pw.as_tensor_arg(1),
        ScalarArg::new(chunk as u32),
        LANE_CELLS,
    )
    .expect("rms_norm_params_partial launches");
    (dx, sum_rows::<R, F>(pw))
}
