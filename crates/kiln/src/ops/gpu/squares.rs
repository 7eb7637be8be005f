//! The global gradient norm's Σ x² over many tensors on the GPU: one launch per tensor, each cube
//! summing a chunk of it (a tree sum in shared memory) into its slot of one buffer shared by all
//! the tensors, then one read-back, summed in f64 on the host. Burn's ops took a multiply, a
//! reduction and a slice of a concatenation per tensor.

use burn::tensor::Shape;
use burn_cubecl::cubecl;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{CubeRuntime, FloatElement};
use cubecl::prelude::*;

use super::grid::{tree_reduce, MAX_GRID};

/// Units per cube.
const UNITS: usize = 256;

/// `partials[offset + c] = Σ x²` over chunk `c` (grid x) of the flat `x`.
#[cube(launch)]
fn sum_squares_partial<F: Float>(
    x: &Tensor<F>,
    partials: &mut Tensor<F>,
    offset: u32,
    chunk: u32,
    #[comptime] units: usize,
) {
    let n = x.len();
    let start = CUBE_POS_X as usize * chunk as usize;
    let end = select(start + (chunk as usize) < n, start + chunk as usize, n);
    let u = UNIT_POS as usize;
    let mut partial = SharedMemory::<F>::new(units);
    let mut acc = F::new(0.0);
    let mut i = start + u;
    while i < end {
        let v = x[i];
        acc += v * v;
        i += units;
    }
    partial[u] = acc;
    let total = tree_reduce::<F>(&mut partial, false);
    if u == 0 {
        partials[offset as usize + CUBE_POS_X as usize] = total;
    }
}

/// Elements per cube for a tensor of `n`: at least 4,096, and few enough cubes for one grid
/// dimension.
fn chunk(n: usize) -> usize {
    n.div_ceil(MAX_GRID).max(4096)
}

/// Per-chunk f32 partial sums of `Σ x²` over every tensor of `xs` (not empty), for the caller to
/// read back once and sum in f64.
pub fn sum_squares_partials<R: CubeRuntime, F: FloatElement>(
    xs: Vec<CubeTensor<R>>,
) -> CubeTensor<R> {
    let first = xs.first().expect("at least one tensor");
    let (client, device) = (first.client.clone(), first.device.clone());
    let cubes = |n: usize| n.div_ceil(chunk(n)).max(1);
    let slots: usize = xs.iter().map(|x| cubes(x.shape.num_elements())).sum();
    let partials = empty_device::<R, F>(client.clone(), device, Shape::new([slots]));
    let mut offset = 0;
    for x in xs {
        let x = into_contiguous(x);
        let n = x.shape.num_elements();
        let c = cubes(n);
        sum_squares_partial::launch::<F, R>(
            &client,
            CubeCount::Static(c as u32, 1, 1),
            CubeDim::new_1d(UNITS as u32),
            x.as_tensor_arg(1),
            partials.as_tensor_arg(1),
            ScalarArg::new(offset as u32),
            ScalarArg::new(chunk(n) as u32),
            UNITS,
        )
        .expect("sum_squares_partial launches");
        offset += c;
    }
    partials
}
