//! Every Burn backend type kiln uses lives here, so changing or adding a backend is a one-file change.

use burn::tensor::backend::Backend;

/// The CPU backend: pure-Rust ndarray, multi-threaded GEMM with SIMD kernels.
pub type Cpu = burn::backend::NdArray<f32>;
/// The CPU backend with reverse-mode autodiff, for training.
pub type CpuTrain = burn::backend::Autodiff<Cpu>;
pub type CpuDevice = burn::backend::ndarray::NdArrayDevice;

/// NVIDIA GPUs through CubeCL's CUDA runtime (kernels compiled at run time; no toolkit to build).
#[cfg(feature = "cuda")]
pub type Cuda = burn::backend::Cuda<f32, i32>;
#[cfg(feature = "cuda")]
pub type CudaTrain = burn::backend::Autodiff<Cuda>;

/// Seeds the backend's random generator (initialisation, dropout).
pub fn seed<B: Backend>(device: &B::Device, seed: u64) {
    B::seed(device, seed);
}
