//! kiln's ops on GPUs: one implementation for every CubeCL runtime (CUDA on NVIDIA GPUs, wgpu on
//! Vulkan / Metal / DX12 and on Mesa's software Vulkan in CI), so a kernel checked on lavapipe
//! against the CPU path is the kernel an H100 runs.
//!
//! Ops without a GPU kernel yet take the composed defaults of [`KilnBackend`] (Burn's CubeCL
//! kernels, one launch per primitive).

use burn::tensor::ops::FloatTensor;
use burn::tensor::{Shape, TensorData};
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};

use super::KilnBackend;

mod norm;

impl<R, F, I, BT> KilnBackend for CubeBackend<R, F, I, BT>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    fn kiln_rms_norm(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        eps: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        norm::rms_norm::<R, F>(x, w, eps)
    }

    /// The CPU's counter-hash mask, made on the host and uploaded: the same units drop on every
    /// device, so a GPU run follows the CPU run step for step. (WGSL has no 64-bit integers for
    /// the hash; a kernel would emulate them.)
    fn kiln_dropout_mask(
        shape: Shape,
        keep: f64,
        seed: u64,
        device: &Self::Device,
    ) -> FloatTensor<Self> {
        let n = shape.num_elements();
        let values = super::cpu::dropout_mask_values(n, keep, seed);
        <Self as burn::tensor::ops::FloatTensorOps<Self>>::float_from_data(
            TensorData::new(values, [n]).convert::<F>(),
            device,
        )
    }
}
