//! NCCL for CUDA workers (`--features cuda`). Burn's collective layer reads CUDA tensors back to the
//! host and sends them over WebSocket; NCCL reduces them in GPU memory over NVLink / PCIe /
//! InfiniBand, as PyTorch's DDP does. The rendezvous stays Burn's: rank 0 makes the NCCL id and
//! the process group broadcasts it; afterwards every gradient all-reduce of a CUDA job is one
//! `ncclAllReduce` on the tensor's own device buffer.
//!
//! NCCL is loaded at run time (cudarc's dynamic loading), so this builds without CUDA or NCCL
//! installed; `KILN_NCCL=0` keeps CUDA jobs on Burn's layer.

use std::any::Any;
use std::sync::Arc;

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn_collective::ReduceOperation;
use burn_cubecl::cubecl::cuda::{CudaDevice, CudaRuntime};
use burn_cubecl::tensor::CubeTensor;
use cudarc::driver::{CudaContext, CudaStream};
use cudarc::nccl::{result as nccl, sys};

use crate::{KilnError, Result};

/// One NCCL communicator of this worker, on its CUDA device.
pub(super) struct NcclComm {
    comm: sys::ncclComm_t,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
}

// SAFETY: the communicator is only used through `&self` by the worker's training thread, one call
// at a time (the trainer's collectives are sequential); NCCL allows a communicator to move
// between threads as long as calls on it do not overlap.
unsafe impl Send for NcclComm {}
unsafe impl Sync for NcclComm {}

fn err(what: &str, e: impl std::fmt::Debug) -> KilnError {
    KilnError::Distributed(format!("NCCL: {what}: {e:?}"))
}

/// Whether `B` is the CUDA backend (the only one NCCL serves) and NCCL is not turned off.
pub(super) fn wanted<B: Backend>() -> bool {
    std::any::TypeId::of::<FloatTensor<B>>() == std::any::TypeId::of::<CubeTensor<CudaRuntime>>()
        && std::env::var("KILN_NCCL").map_or(true, |v| v != "0")
}

impl NcclComm {
    /// Joins rank `rank` of `world` to the communicator named by `id` (128 bytes; rank 0 made it
    /// with [`new_id`]), on `device`.
    pub(super) fn init<B: Backend>(
        device: &B::Device,
        rank: usize,
        world: usize,
        id: &[u8; 128],
    ) -> Result<Self> {
        let index = (device as &dyn Any)
            .downcast_ref::<CudaDevice>()
            .map(|d| d.index)
            .ok_or_else(|| err("device", "not a CUDA device"))?;
        let ctx = CudaContext::new(index).map_err(|e| err("CUDA context", e))?;
        let stream = ctx.new_stream().map_err(|e| err("CUDA stream", e))?;
        let mut unique = sys::ncclUniqueId { internal: [0; 128] };
        for (dst, src) in unique.internal.iter_mut().zip(id) {
            *dst = *src as _;
        }
        let mut comm = std::ptr::null_mut();
        // SAFETY: `comm` is written by NCCL; every rank passes the same id and world size.
        unsafe { nccl::comm_init_rank(&mut comm, world as i32, unique, rank as i32) }
            .map_err(|e| err("ncclCommInitRank", e))?;
        Ok(Self { comm, ctx, stream })
    }

    /// Reduces `t` (a contiguous f32 CUDA tensor) in place across all ranks.
    pub(super) fn all_reduce<B: Backend>(
        &self,
        t: FloatTensor<B>,
        op: ReduceOperation,
    ) -> Result<FloatTensor<B>> {
        let boxed: Box<dyn Any> = Box::new(t);
        let tensor = boxed
            .downcast::<CubeTensor<CudaRuntime>>()
            .map_err(|_| err("all-reduce", "not a CUDA tensor"))?;
        let tensor = if tensor.is_contiguous() {
            *tensor
        } else {
            burn_cubecl::kernel::into_contiguous(*tensor)
        };
        if tensor.dtype != burn::tensor::DType::F32 {
            return Err(err("all-reduce", format!("dtype {:?}", tensor.dtype)));
        }
        let count = tensor.shape.num_elements();
        // The kernels that produced the tensor run on CubeCL's own stream: wait for them.
        burn_cubecl::cubecl::future::block_on(tensor.client.sync())
            .map_err(|e| err("waiting for the gradient kernels", e))?;
        let resource = tensor.client.get_resource(tensor.handle.clone().binding());
        let ptr = resource.resource().ptr as *mut std::ffi::c_void;
        let op = match op {
            ReduceOperation::Sum => sys::ncclRedOp_t::ncclSum,
            ReduceOperation::Mean => sys::ncclRedOp_t::ncclAvg,
        };
        self.ctx
            .bind_to_thread()
            .map_err(|e| err("CUDA context", e))?;
        // SAFETY: `ptr` is the tensor's live device buffer of `count` f32 (contiguous, checked
        // above), nothing else uses it until the stream is synchronised below.
        unsafe {
            nccl::all_reduce(
                ptr,
                ptr,
                count,
                sys::ncclDataType_t::ncclFloat32,
                op,
                self.comm,
                self.stream.cu_stream() as sys::cudaStream_t,
            )
        }
        .map_err(|e| err("ncclAllReduce", e))?;
        self.stream
            .synchronize()
            .map_err(|e| err("waiting for ncclAllReduce", e))?;
        let back: Box<dyn Any> = Box::new(tensor);
        Ok(*back
            .downcast::<FloatTensor<B>>()
            .expect("the same type it came in as"))
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        // SAFETY: the communicator was created by `init` and is not used after this.
        let _ = unsafe { nccl::comm_destroy(self.comm) };
    }
}

/// A new NCCL id (rank 0 makes it; the others receive it through the process group).
pub(super) fn new_id() -> Result<[u8; 128]> {
    let id = nccl::get_uniqueid().map_err(|e| err("ncclGetUniqueId", e))?;
    let mut out = [0u8; 128];
    for (dst, src) in out.iter_mut().zip(id.internal) {
        *dst = src as u8;
    }
    Ok(out)
}
