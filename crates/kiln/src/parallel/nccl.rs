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

    /// Reduces `t` (an f32 CUDA tensor) in place across all ranks.
    pub(super) fn all_reduce<B: Backend>(
        &self,
        t: FloatTensor<B>,
        op: ReduceOperation,
    ) -> Result<FloatTensor<B>> {
        let op = match op {
            ReduceOperation::Sum => sys::ncclRedOp_t::ncclSum,
            ReduceOperation::Mean => sys::ncclRedOp_t::ncclAvg,
        };
        self.reduce::<B>(t, op)
    }

    /// Element-wise max across all ranks, in place.
    pub(super) fn all_reduce_max<B: Backend>(&self, t: FloatTensor<B>) -> Result<FloatTensor<B>> {
        self.reduce::<B>(t, sys::ncclRedOp_t::ncclMax)
    }

    fn reduce<B: Backend>(
        &self,
        t: FloatTensor<B>,
        op: sys::ncclRedOp_t,
    ) -> Result<FloatTensor<B>> {
        let (tensor, ptr, count) = device_buffer::<B>(t, "all-reduce")?;
        self.launch("ncclAllReduce", |stream| {
            // SAFETY: `ptr` is the tensor's live device buffer of `count` f32; nothing else uses
            // it until the stream is synchronised.
            unsafe { nccl::all_reduce(ptr, ptr, count, F32, op, self.comm, stream) }
        })?;
        Ok(back::<B>(tensor))
    }

    /// `root`'s `t` on every rank, in place.
    pub(super) fn broadcast<B: Backend>(
        &self,
        t: FloatTensor<B>,
        root: usize,
    ) -> Result<FloatTensor<B>> {
        let (tensor, ptr, count) = device_buffer::<B>(t, "broadcast")?;
        self.launch("ncclBroadcast", |stream| {
            // SAFETY: as in `reduce`; every rank passes a buffer of `count` f32.
            unsafe { nccl::broadcast(ptr, ptr, count, F32, root as i32, self.comm, stream) }
        })?;
        Ok(back::<B>(tensor))
    }

    /// Every rank's `t` (all of one length) concatenated in rank order into `out` (`world ×` that
    /// length, allocated by the caller on the same device).
    pub(super) fn all_gather<B: Backend>(
        &self,
        t: FloatTensor<B>,
        out: FloatTensor<B>,
    ) -> Result<FloatTensor<B>> {
        let (send, send_ptr, count) = device_buffer::<B>(t, "all-gather")?;
        let (recv, recv_ptr, _) = device_buffer::<B>(out, "all-gather")?;
        self.launch("ncclAllGather", |stream| {
            // SAFETY: `send_ptr` holds `count` f32, `recv_ptr` `world × count` (the caller's
            // allocation); both live until the stream is synchronised.
            unsafe { nccl::all_gather(send_ptr, recv_ptr, count, F32, self.comm, stream) }
        })?;
        drop(send);
        Ok(back::<B>(recv))
    }

    /// The sum over ranks of `t` (`world ×` the chunk length), of which this rank receives its
    /// chunk into `out` (allocated by the caller).
    pub(super) fn reduce_scatter<B: Backend>(
        &self,
        t: FloatTensor<B>,
        out: FloatTensor<B>,
    ) -> Result<FloatTensor<B>> {
        let (send, send_ptr, _) = device_buffer::<B>(t, "reduce-scatter")?;
        let (recv, recv_ptr, count) = device_buffer::<B>(out, "reduce-scatter")?;
        self.launch("ncclReduceScatter", |stream| {
            // SAFETY: `send_ptr` holds `world × count` f32, `recv_ptr` `count`; both live until
            // the stream is synchronised.
            unsafe {
                nccl::reduce_scatter(
                    send_ptr,
                    recv_ptr,
                    count,
                    F32,
                    sys::ncclRedOp_t::ncclSum,
                    self.comm,
                    stream,
                )
            }
        })?;
        drop(send);
        Ok(back::<B>(recv))
    }

    /// Runs one NCCL call on this communicator's stream and waits for it.
    fn launch<T, E: std::fmt::Debug>(
        &self,
        what: &str,
        call: impl FnOnce(sys::cudaStream_t) -> std::result::Result<T, E>,
    ) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| err("CUDA context", e))?;
        call(self.stream.cu_stream() as sys::cudaStream_t).map_err(|e| err(what, e))?;
        self.stream
            .synchronize()
            .map_err(|e| err(&format!("waiting for {what}"), e))
    }
}

const F32: sys::ncclDataType_t = sys::ncclDataType_t::ncclFloat32;

/// A contiguous f32 CUDA tensor whose producing kernels have finished, its device pointer and
/// its length.
fn device_buffer<B: Backend>(
    t: FloatTensor<B>,
    what: &str,
) -> Result<(CubeTensor<CudaRuntime>, *mut std::ffi::c_void, usize)> {
    let boxed: Box<dyn Any> = Box::new(t);
    let tensor = boxed
        .downcast::<CubeTensor<CudaRuntime>>()
        .map_err(|_| err(what, "not a CUDA tensor"))?;
    let tensor = if tensor.is_contiguous() {
        *tensor
    } else {
        burn_cubecl::kernel::into_contiguous(*tensor)
    };
    if tensor.dtype != burn::tensor::DType::F32 {
        return Err(err(what, format!("dtype {:?}", tensor.dtype)));
    }
    let count = tensor.shape.num_elements();
    // The kernels that produced the tensor run on CubeCL's own stream: wait for them.
    burn_cubecl::cubecl::future::block_on(tensor.client.sync())
        .map_err(|e| err("waiting for the kernels before a collective", e))?;
    let resource = tensor.client.get_resource(tensor.handle.clone().binding());
    let ptr = resource.resource().ptr as *mut std::ffi::c_void;
    Ok((tensor, ptr, count))
}

fn back<B: Backend>(tensor: CubeTensor<CudaRuntime>) -> FloatTensor<B> {
    let back: Box<dyn Any> = Box::new(tensor);
    *back
        .downcast::<FloatTensor<B>>()
        .expect("the same type it came in as")
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
