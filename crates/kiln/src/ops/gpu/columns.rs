//! Column sums of row-major `[rows, h]` matrices on the GPU: Linear's bias gradient and the
//! norms' weight and bias gradients. Burn's `sum_dim(0)` (cubek-reduce) took about 2 ms per
//! BERT-base bias gradient at 128×128 tokens on an H200, half of a step's GPU time; here each unit
//! sums one column over a chunk of rows (neighbouring units read neighbouring columns), then the
//! chunks' partial sums are summed the same way. The order is fixed, so the same input gives the
//! same bits.
//!
//! Chunks also keep every loop under 65,536 trips: lavapipe (llvmpipe) stops longer loops there
//! without a word.

use burn::tensor::Shape;
use burn_cubecl::cubecl;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{CubeRuntime, FloatElement};
use cubecl::prelude::*;

use super::grid::{MAX_GRID, ROW_UNITS};

/// Rows per chunk of a column sum, and the number of chunks: at least 256 rows, and few enough
/// chunks for one grid dimension.
pub(super) fn chunks(rows: usize) -> (usize, usize) {
    let chunk = rows.div_ceil(MAX_GRID).max(256);
    (chunk, rows.div_ceil(chunk).max(1))
}

/// The grid of a chunked column sum over `h` columns: x over the columns, y over the chunks.
pub(super) fn column_grid(h: usize, n_chunks: usize) -> (CubeCount, CubeDim) {
    (
        CubeCount::Static(
            h.div_ceil(ROW_UNITS as usize).max(1) as u32,
            n_chunks as u32,
            1,
        ),
        CubeDim::new_1d(ROW_UNITS),
    )
}

/// The rows `[start, end)` of chunk `CUBE_POS_Y` of `rows`.
#[cube]
pub(super) fn chunk_rows(rows: usize, chunk: u32) -> (usize, usize) {
    let start = CUBE_POS_Y as usize * chunk as usize;
    let mut end = start + chunk as usize;
    if end > rows {
        end = rows;
    }
    (start, end)
}

/// `partial[c, col] = Σ x[r, col]` over the rows `r` of chunk `c` (grid y), in row order.
#[cube(launch)]
fn column_sum_partial<F: Float>(x: &Tensor<F>, partial: &mut Tensor<F>, chunk: u32) {
    let col = ABSOLUTE_POS_X as usize;
    let h = x.shape(1);
    if col < h {
        let (start, end) = chunk_rows(x.shape(0), chunk);
        let mut s = F::new(0.0);
        for r in start..end {
            s += x[r * h + col];
        }
        partial[CUBE_POS_Y as usize * h + col] = s;
    }
}

/// `Σ_rows x` of `x [rows, h]`: `[h]`.
pub fn sum_rows<R: CubeRuntime, F: FloatElement>(x: CubeTensor<R>) -> CubeTensor<R> {
    let mut x = into_contiguous(x);
    let h = x.shape.dims[1];
    loop {
        let rows = x.shape.dims[0];
        let (chunk, n_chunks) = chunks(rows);
        let partial = empty_device::<R, F>(
            x.client.clone(),
            x.device.clone(),
            Shape::new([n_chunks, h]),
        );
        let (count, dim) = column_grid(h, n_chunks);
        column_sum_partial::launch::<F, R>(
            &x.client,
            count,
            dim,
            x.as_tensor_arg(1),
            partial.as_tensor_arg(1),
            ScalarArg::new(chunk as u32),
        )
        .expect("column_sum_partial launches");
        x = partial;
        if n_chunks == 1 {
            break;
        }
    }
    x.shape = Shape::new([h]);
    x.strides = vec![1];
    x
}
