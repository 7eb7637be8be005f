//! What every kiln GPU kernel shares: the grid shapes (wgpu allows at most 65,535 cubes along one
//! grid dimension, so kernels stride past it) and the fixed-order tree reduction of row kernels.

use burn_cubecl::cubecl;
use cubecl::prelude::*;

/// Units per row cube: a power of two (the tree reduction halves it), small enough for every device.
pub(super) const ROW_UNITS: u32 = 64;
/// Units per cube of an element-wise kernel.
const FLAT_UNITS: u32 = 256;
/// Cubes along one grid dimension (wgpu's limit); past that each cube strides.
pub(super) const MAX_GRID: usize = 65_535;

/// The reduction of every unit's `partial[UNIT_POS]` (max when `max`, else sum), read by every
/// unit, in a fixed order (the same input gives the same bits).
#[cube]
pub(super) fn tree_reduce<F: Float>(partial: &mut SharedMemory<F>, #[comptime] max: bool) -> F {
    sync_cube();
    let mut active = CUBE_DIM;
    let mut jump = 1;
    while active > 1 {
        active /= 2;
        let dst = jump * 2 * UNIT_POS;
        let src = jump * (2 * UNIT_POS + 1);
        if UNIT_POS < active {
            let v = partial[src as usize];
            if max {
                partial[dst as usize] = F::max(partial[dst as usize], v);
            } else {
                partial[dst as usize] += v;
            }
        }
        jump *= 2;
        sync_cube();
    }
    partial[0]
}

/// Row cubes of [`ROW_UNITS`]: one per row up to [`MAX_GRID`], each striding over the rows past that.
pub(super) fn row_grid(rows: usize) -> (CubeCount, CubeDim) {
    (
        CubeCount::Static(rows.clamp(1, MAX_GRID) as u32, 1, 1),
        CubeDim::new_1d(ROW_UNITS),
    )
}

/// A 1-D grid for `n` elements, each unit striding by the grid's size.
pub(super) fn flat_grid(n: usize) -> (CubeCount, CubeDim) {
    let cubes = n.div_ceil(FLAT_UNITS as usize).clamp(1, MAX_GRID);
    (
        CubeCount::Static(cubes as u32, 1, 1),
        CubeDim::new_1d(FLAT_UNITS),
    )
}
