//! The dropout mask made on the GPU, bit for bit the CPU's (`ops::cpu::uniform`: SplitMix64's
//! finaliser over the element's index), so a GPU run drops the units the CPU run drops. WGSL has no
//! 64-bit integers, so the 64-bit state is two `u32` halves and each 64-bit product is built from
//! 16-bit pieces: the same source then runs on CUDA and on wgpu (checked on lavapipe in CI).
//!
//! `dropout_apply` multiplies by the mask as it makes it (one pass; the backward makes it again from
//! the seed, so no mask is kept for it).
//!
//! Before this kernel the mask was hashed on the host and uploaded: on an H100 that made a MiniLM
//! training step 3× slower (37 M mask values per step at 16×128, every one crossing PCIe).

use burn::tensor::Shape;
use burn_cubecl::cubecl;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{CubeRuntime, FloatElement};
use cubecl::prelude::*;

use super::grid::flat_grid;

/// The high 32 bits of the 64-bit product `a·b`, from 16-bit pieces (no partial sum overflows).
#[cube]
fn mul_hi(a: u32, b: u32) -> u32 {
    let (a0, a1) = (a & 0xFFFF, a >> 16);
    let (b0, b1) = (b & 0xFFFF, b >> 16);
    let (p00, p01, p10, p11) = (a0 * b0, a0 * b1, a1 * b0, a1 * b1);
    let mid = (p00 >> 16) + (p01 & 0xFFFF) + (p10 & 0xFFFF);
    p11 + (p01 >> 16) + (p10 >> 16) + (mid >> 16)
}

/// The high half of the low 64 bits of `(ah:al)·(bh:bl)` (the low half is `al·bl`, wrapping).
#[cube]
fn mul64_hi(ah: u32, al: u32, bh: u32, bl: u32) -> u32 {
    mul_hi(al, bl) + ah * bl + al * bh
}

/// The element's uniform in [0, 1): the top 24 bits of SplitMix64's finaliser over
/// `seed + i·0x9E3779B97F4A7C15` (`i < 2³²`, checked by the callers).
#[cube]
fn uniform(i: usize, seed_hi: u32, seed_lo: u32) -> f32 {
    let idx = i as u32;
    let pl = idx * 0x7F4A_7C15u32;
    let ph = mul_hi(idx, 0x7F4A_7C15u32) + idx * 0x9E37_79B9u32;
    let mut zl = seed_lo + pl;
    let carry = select(zl < seed_lo, 1u32, 0u32);
    let mut zh = seed_hi + ph + carry;
    // z = (z ^ (z >> 30)) · 0xBF58476D1CE4E5B9
    let xl = zl ^ ((zl >> 30) | (zh << 2));
    let xh = zh ^ (zh >> 30);
    zh = mul64_hi(xh, xl, 0xBF58_476Du32, 0x1CE4_E5B9u32);
    zl = xl * 0x1CE4_E5B9u32;
    // z = (z ^ (z >> 27)) · 0x94D049BB133111EB
    let yl = zl ^ ((zl >> 27) | (zh << 5));
    let yh = zh ^ (zh >> 27);
    zh = mul64_hi(yh, yl, 0x94D0_49BBu32, 0x1331_11EBu32);
    // z ^= z >> 31; the uniform is the top 24 bits, z >> 40 = zh >> 8 (the low half of the
    // product and of this last shift do not reach them).
    zh ^= zh >> 31;
    f32::cast_from(zh >> 8) * (1.0 / 16_777_216.0)
}

/// The dropout factor of element `i`: `1/keep` (`inv_keep`) where its uniform is below `keep`,
/// else 0 — the CPU mask's value. Every kernel that drops units makes its mask with this.
#[cube]
pub(super) fn kept<F: Float>(i: usize, seed_hi: u32, seed_lo: u32, keep: f32, inv_keep: f32) -> F {
    select(
        uniform(i, seed_hi, seed_lo) < keep,
        F::cast_from(inv_keep),
        F::new(0.0),
    )
}

/// `out = x · mask`, the mask made in place (the CPU's `x · mask`, the same bits).
#[cube(launch)]
fn dropout_apply_kernel<F: Float>(
    x: &Tensor<F>,
    out: &mut Tensor<F>,
    seed_hi: u32,
    seed_lo: u32,
    keep: f32,
    scale: f32,
) {
    let n = out.len();
    let stride = CUBE_COUNT * CUBE_DIM as usize;
    let mut i = ABSOLUTE_POS;
    while i < n {
        out[i] = x[i] * kept::<F>(i, seed_hi, seed_lo, keep, scale);
        i += stride;
    }
}

/// A flat mask of `n` values: `1/keep` where the counter hash of the index under `seed` is below
/// `keep`, else 0 (`ops::cpu::dropout_mask_values`): [`dropout_apply`] on ones. Training never
/// makes a mask on its own (the multiply makes it); this is for callers that want the mask.
pub fn dropout_mask<R: CubeRuntime, F: FloatElement>(
    n: usize,
    keep: f64,
    seed: u64,
    device: &R::Device,
) -> CubeTensor<R> {
    let ones = burn_cubecl::ops::numeric::ones::<R>(device.clone(), Shape::new([n]), F::dtype());
    dropout_apply::<R, F>(ones, keep, seed)
}

/// `x · mask` for the counter-hash mask of `seed`, in one pass.
pub fn dropout_apply<R: CubeRuntime, F: FloatElement>(
    x: CubeTensor<R>,
    keep: f64,
    seed: u64,
) -> CubeTensor<R> {
    let x = into_contiguous(x);
    let n = x.shape.num_elements();
    assert!(
        n <= u32::MAX as usize,
        "dropout over {n} elements (at most 2³²)"
    );
    let out = empty_device::<R, F>(x.client.clone(), x.device.clone(), x.shape.clone());
    let (count, dim) = flat_grid(n);
    dropout_apply_kernel::launch::<F, R>(
        &x.client,
        count,
        dim,
        x.as_tensor_arg(1),
        out.as_tensor_arg(1),
        ScalarArg::new((seed >> 32) as u32),
        ScalarArg::new(seed as u32),
        ScalarArg::new(keep as f32),
        ScalarArg::new((1.0 / keep) as f32),
    )
    .expect("dropout_apply launches");
    out
}
