pub(crate) mod command;
pub(crate) mod context;
pub(crate) mod io;
pub(crate) mod storage;
pub(crate) mod stream;
pub(crate) mod sync;

mod server;

pub use server::*;

/// Counts `execute_task`'s kernel launches (kiln's patch; read by `crate::kernel_launches`).
pub(crate) static KERNEL_LAUNCHES: core::sync::atomic::AtomicU64 =
    core::sync::atomic::AtomicU64::new(0);
/// Kernels compiled by NVRTC, and kernels loaded from the PTX cache instead (kiln's patch).
pub(crate) static KERNELS_COMPILED: core::sync::atomic::AtomicU64 =
    core::sync::atomic::AtomicU64::new(0);
pub(crate) static PTX_CACHE_HITS: core::sync::atomic::AtomicU64 =
    core::sync::atomic::AtomicU64::new(0);

#[allow(clippy::uninit_vec)]
/// Initialize a vector without any values written in it.
pub fn uninit_vec<I>(len: usize) -> Vec<I> {
    let mut data = Vec::with_capacity(len);

    unsafe {
        data.set_len(len);
    };

    data
}
