//! An embedding table's gradient on the GPU: `dw[id] += dy[token]` over the tokens, in token order
//! (the same input gives the same bits; no atomics, which WGSL lacks for floats). Each cube owns
//! [`ROWS`] rows of the table and one block of columns: it scans every token's id and adds the
//! rows whose id it owns into a tile in shared memory, one column per unit, then writes the tile.
//! The ids are read by every cube (from cache, the same address across a cube's units); each `dy`
//! value is read once. Burn's `select_add` gave one unit a column over every token: 12 ms of a
//! BERT-base bf16 128×128 step on an H200, for 3 launches.

use burn::tensor::Shape;
use burn_cubecl::cubecl;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{CubeRuntime, FloatElement, IntElement};
use cubecl::prelude::*;

use super::grid::MAX_GRID;

/// Table rows per cube.
const ROWS: usize = 32;
/// Units per cube: one column each.
const UNITS: usize = 128;
/// Tokens per inner loop (lavapipe ends loops past 65,535 trips without a word).
const TOKEN_BLOCK: usize = 32_768;

#[cube(launch)]
fn embedding_backward_kernel<F: Float, I: Int>(
    dy: &Tensor<F>,
    ids: &Tensor<I>,
    dw: &mut Tensor<F>,
    vocab: u32,
    #[comptime] rows: usize,
    #[comptime] units: usize,
    #[comptime] block: usize,
) {
    let h = dy.shape(1);
    let n = ids.len();
    let v = vocab as usize;
    let u = UNIT_POS as usize;
    let col = CUBE_POS_Y as usize * units + u;
    let chunks = v.div_ceil(rows);
    let mut tile = SharedMemory::<F>::new(rows * units);
    let mut chunk = CUBE_POS_X as usize;
    while chunk < chunks {
        let start = chunk * rows;
        let mut r = 0;
        while r < rows {
            tile[r * units + u] = F::new(0.0);
            r += 1;
        }
        if col < h {
            let mut t0 = 0;
            while t0 < n {
                let t1 = select(t0 + block < n, t0 + block, n);
                let mut tok = t0;
                while tok < t1 {
                    // A negative id wraps past the table and is skipped.
                    let id = u32::cast_from(ids[tok]) as usize;
                    if id >= start && id < start + rows {
                        tile[(id - start) * units + u] += dy[tok * h + col];
                    }
                    tok += 1;
                }
                t0 = t1;
            }
            let mut w = 0;
            while w < rows {
                if start + w < v {
                    dw[(start + w) * h + col] = tile[w * units + u];
                }
                w += 1;
            }
        }
        chunk += CUBE_COUNT_X as usize;
    }
}

/// `[vocab, H]`: the rows of `dy [N, H]` summed by their `ids [N]`.
pub fn embedding_backward<R: CubeRuntime, F: FloatElement, I: IntElement>(
    dy: CubeTensor<R>,
    ids: CubeTensor<R>,
    vocab: usize,
) -> CubeTensor<R> {
    let (dy, ids) = (into_contiguous(dy), into_contiguous(ids));
    let h = dy.shape.dims[1];
    let dw = empty_device::<R, F>(dy.client.clone(), dy.device.clone(), Shape::new([vocab, h]));
    let count = CubeCount::Static(
        vocab.div_ceil(ROWS).clamp(1, MAX_GRID) as u32,
        h.div_ceil(UNITS).max(1) as u32,
        1,
    );
    embedding_backward_kernel::launch::<F, I, R>(
        &dy.client,
        count,
        CubeDim::new_1d(UNITS as u32),
        dy.as_tensor_arg(1),
        ids.as_tensor_arg(1),
        dw.as_tensor_arg(1),
        ScalarArg::new(vocab as u32),
        ROWS,
        UNITS,
        TOKEN_BLOCK,
    )
    .expect("embedding_backward launches");
    dw
}
