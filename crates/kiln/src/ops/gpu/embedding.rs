//! An embedding table's gradient on the GPU: `dw[id] += dy[token]` over the tokens, in token order
//! (the same input gives the same bits; no atomics, which WGSL lacks for floats). Each cube owns
//! [`ROWS`] rows of the table and one block of columns: it scans every token's id and adds the
//! rows whose id it owns into a tile in shared memory, one column per unit, then writes the tile.
//! The ids are read by every cube (from cache, the same address across a cube's units); each `dy`
//! value is read once. Burn's `select_add` gave one unit a column over every token: 12 ms of a
//! BERT-base bf16 128×128 step on an H200, for 3 launches.
//!
//! A small table has few cubes (BERT's token types: 2 rows, 6 cubes; its positions: 96), each
//! scanning every token: 10.6 and 2.2 ms of that step on an H200, where the 30,522-row word table
//! took 5.3. So the tokens are also cut into slices, one per grid layer, until the launch has
//! about [`TARGET_CUBES`] cubes: each slice sums its tokens into a partial table of its own, and a
//! second kernel adds the partial tables in slice order (still the same bits for the same input).

use burn::tensor::Shape;
use burn_cubecl::cubecl;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{CubeRuntime, FloatElement, IntElement};
use cubecl::prelude::*;

use super::grid::{flat_grid, MAX_GRID};

/// Table rows per cube.
const ROWS: usize = 32;
/// Units per cube: one column each.
const UNITS: usize = 128;
/// Tokens per inner loop (lavapipe ends loops past 65,535 trips without a word).
const TOKEN_BLOCK: usize = 32_768;
/// Cubes a launch is given, where slicing the tokens can: enough to fill a large GPU (an H200 has
/// 132 multiprocessors).
const TARGET_CUBES: usize = 2048;
/// The fewest tokens a slice scans.
const MIN_SLICE_TOKENS: usize = 256;
/// The most floats the slices' partial tables take together (32 MiB).
const MAX_PARTIAL: usize = 8 << 20;

/// How many tokens each slice scans, for a `[vocab, h]` table and `n` tokens: all of them (one
/// slice) when the table alone gives enough cubes.
fn slice_tokens(vocab: usize, h: usize, n: usize) -> usize {
    let cubes = vocab.div_ceil(ROWS).clamp(1, MAX_GRID) * h.div_ceil(UNITS).max(1);
    let wanted = TARGET_CUBES.div_ceil(cubes);
    let most = (n / MIN_SLICE_TOKENS).min(MAX_PARTIAL / (vocab * h).max(1));
    n.div_ceil(wanted.min(most).max(1)).max(1)
}

#[cube(launch)]
fn embedding_backward_kernel<F: Float, I: Int>(
    dy: &Tensor<F>,
    ids: &Tensor<I>,
    tables: &mut Tensor<F>,
    vocab: u32,
    slice_len: u32,
    #[comptime] rows: usize,
    #[comptime] units: usize,
    #[comptime] block: usize,
) {
    let h = dy.shape(1);
    // This grid layer's slice of the tokens, and its own `[vocab, h]` table in `tables` (the
    // gradient itself when there is one slice).
    let first = CUBE_POS_Z as usize * slice_len as usize;
    let n = select(
        first + (slice_len as usize) < ids.len(),
        first + slice_len as usize,
        ids.len(),
    );
    let v = vocab as usize;
    let table = CUBE_POS_Z as usize * v * h;
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
            let mut t0 = first;
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
                    tables[table + (start + w) * h + col] = tile[w * units + u];
                }
                w += 1;
            }
        }
        chunk += CUBE_COUNT_X as usize;
    }
}

/// `partial [slices, len]` summed over its slices, in slice order, into `out [len]`.
#[cube(launch)]
fn sum_slices_kernel<F: Float>(partial: &Tensor<F>, out: &mut Tensor<F>, slices: u32) {
    let len = out.len();
    let stride = CUBE_COUNT * CUBE_DIM as usize;
    let mut i = ABSOLUTE_POS;
    while i < len {
        let mut acc = F::new(0.0);
        let mut s = 0;
        while s < slices as usize {
            acc += partial[s * len + i];
            s += 1;
        }
        out[i] = acc;
        i += stride;
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
    let n = ids.shape.num_elements();
    let slice_len = slice_tokens(vocab, h, n);
    let slices = n.div_ceil(slice_len).max(1);
    // One `[vocab, H]` table per slice of the tokens, summed below when there is more than one.
    let tables = empty_device::<R, F>(
        dy.client.clone(),
        dy.device.clone(),
        Shape::new([slices * vocab, h]),
    );
    let count = CubeCount::Static(
        vocab.div_ceil(ROWS).clamp(1, MAX_GRID) as u32,
        h.div_ceil(UNITS).max(1) as u32,
        slices as u32,
    );
    embedding_backward_kernel::launch::<F, I, R>(
        &dy.client,
        count,
        CubeDim::new_1d(UNITS as u32),
        dy.as_tensor_arg(1),
        ids.as_tensor_arg(1),
        tables.as_tensor_arg(1),
        ScalarArg::new(vocab as u32),
        ScalarArg::new(slice_len as u32),
        ROWS,
        UNITS,
        TOKEN_BLOCK,
    )
    .expect("embedding_backward launches");
    if slices == 1 {
        return tables;
    }
    let out = empty_device::<R, F>(dy.client.clone(), dy.device.clone(), Shape::new([vocab, h]));
    let (count, dim) = flat_grid(vocab * h);
    sum_slices_kernel::launch::<F, R>(
        &dy.client,
        count,
        dim,
        tables.as_tensor_arg(1),
        out.as_tensor_arg(1),
        ScalarArg::new(slices as u32),
    )
    .expect("embedding_backward's slice sum launches");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// BERT-base at 128 × 128 tokens: the word table keeps one slice; the position and
    /// token-type tables are cut until the launch has about [`TARGET_CUBES`] cubes, within
    /// the partial tables' memory; a few tokens stay one slice.
    #[test]
    fn small_tables_cut_the_tokens_into_slices() {
        let n = 128 * 128;
        assert_eq!(slice_tokens(30_522, 768, n), n);
        let positions = n.div_ceil(slice_tokens(512, 768, n));
        assert_eq!(
            positions, 21,
            "8 M floats / (512 × 768) bounds it below 2048 / 96"
        );
        assert_eq!(
            n.div_ceil(slice_tokens(2, 768, n)),
            64,
            "256 tokens a slice at least"
        );
        assert_eq!(slice_tokens(70, 150, 49), 49);
        assert_eq!(1000usize.div_ceil(slice_tokens(2, 150, 1000)), 3);
    }
}
