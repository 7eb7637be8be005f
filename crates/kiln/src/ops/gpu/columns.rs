//! Column sums of row-major `[rows, h]` matrices on the GPU: Linear's bias gradient and the
//! norms' weight and bias gradients. Burn's `sum_dim(0)` (cubek-reduce) took about 2 ms per
//! BERT-base bias gradient at 128×128 tokens on an H200, half of a step's GPU time. Here a cube
//! takes 32 neighbouring columns (a warp reads one 128-byte line per row) over a chunk of rows,
//! split into eight row lanes that each sum every eighth row; the lanes are then summed in lane
//! order, and the chunks' partial sums are summed the same way. The order is fixed, so the same
//! input gives the same bits.
//!
//! Why lanes and short chunks: with one unit per column and 256-row chunks, a BERT-base bias
//! gradient at 128×128 tokens (16,384 × 768) ran 49,152 units, each waiting on one load at a time
//! — too few loads in flight to fill an H200's memory pipe (column sums took 4.7 ms of a 74 ms
//! step, four times what their bytes cost at the datasheet's bandwidth), and the second pass over
//! the partials ran 768 units. Now the first pass runs 786,432 units of 16 rows each, the
//! second 6,144.
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

use super::grid::MAX_GRID;

/// Columns per cube of a column sum: a warp of neighbouring columns reads one line per row.
const COLUMN_UNITS: u32 = 32;
/// Row lanes per cube: lane `l` sums the rows `l, l + 8, …` of the cube's chunk.
const ROW_LANES: u32 = 8;
/// Shared-memory cells of a lane sum: one per unit.
pub(super) const LANE_CELLS: usize = (COLUMN_UNITS * ROW_LANES) as usize;
/// The fewest rows per chunk: 16 per lane.
const CHUNK_ROWS: usize = 16 * ROW_LANES as usize;

/// Rows per chunk of a column sum, and the number of chunks: at least [`CHUNK_ROWS`], and few
/// enough chunks for one grid dimension.
pub(super) fn chunks(rows: usize) -> (usize, usize) {
    let chunk = rows.div_ceil(MAX_GRID).max(CHUNK_ROWS);
    (chunk, rows.div_ceil(chunk).max(1))
}

/// The grid of a chunked column sum over `h` columns: x over the columns, y over the chunks;
/// each cube is [`COLUMN_UNITS`] columns by [`ROW_LANES`] lanes.
pub(super) fn column_grid(h: usize, n_chunks: usize) -> (CubeCount, CubeDim) {
    (
        CubeCount::Static(
            h.div_ceil(COLUMN_UNITS as usize).max(1) as u32,
            n_chunks as u32,
            1,
        ),
        CubeDim::new_2d(COLUMN_UNITS, ROW_LANES),
    )
}

/// This unit's first row in chunk `CUBE_POS_Y` of `rows`, and the chunk's end: the unit sums the
/// rows from the first up to the end, [`lane_step`] apart.
#[cube]
pub(super) fn lane_rows(rows: usize, chunk: u32) -> (usize, usize) {
    let start = CUBE_POS_Y as usize * chunk as usize;
    let mut end = start + chunk as usize;
    if end > rows {
        end = rows;
    }
    (start + UNIT_POS_Y as usize, end)
}

/// Rows between one of a lane's rows and its next.
#[cube]
pub(super) fn lane_step() -> usize {
    CUBE_DIM_Y as usize
}

/// The sum of every lane's `s` for this unit's column, in lane order; meaningful in lane 0 only.
/// Every unit of the cube must call it (it waits for them all).
#[cube]
pub(super) fn sum_lanes<F: Float>(s: F, cells: &mut SharedMemory<F>) -> F {
    let (x, width) = (UNIT_POS_X as usize, CUBE_DIM_X as usize);
    cells[UNIT_POS_Y as usize * width + x] = s;
    sync_cube();
    let mut total = F::new(0.0);
    if UNIT_POS_Y == 0 {
        for lane in 0..CUBE_DIM_Y as usize {
            total += cells[lane * width + x];
        }
    }
    total
}

/// `partial[c, col] = Σ x[r, col]` over the rows `r` of chunk `c` (grid y), lane by lane.
#[cube(launch)]
fn column_sum_partial<F: Float>(
    x: &Tensor<F>,
    partial: &mut Tensor<F>,
    chunk: u32,
    #[comptime] cells: usize,
) {
    let col = ABSOLUTE_POS_X as usize;
    let h = x.shape(1);
    let mut s = F::new(0.0);
    if col < h {
        let (mut r, end) = lane_rows(x.shape(0), chunk);
        while r < end {
            s += x[r * h + col];
            r += lane_step();
        }
    }
    let mut lanes = SharedMemory::<F>::new(cells);
    let total = sum_lanes::<F>(s, &mut lanes);
    if col < h && UNIT_POS_Y == 0 {
        partial[CUBE_POS_Y as usize * h + col] = total;
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
            LANE_CELLS,
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
