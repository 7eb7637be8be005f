//! Linear layers' GEMMs through cuBLAS on CUDA (loaded at run time by cudarc, so the build needs no
//! CUDA toolkit). CubeCL's own matmul reached 16 TFLOP/s at 1024³ on an H100 where cuBLAS reached
//! 34 (fp32, no TF32), and its tensor-core paths are cuBLAS's to pick.
//!
//! Each call is queued on the CUDA stream CubeCL runs this thread's kernels on (the patched
//! `GpuResource::stream`, third_party/cubecl-cuda/PATCHES.md), so nothing waits on the host: the
//! GEMM runs after the kernels that wrote its operands and before the ones that read its result.
//!
//! Precision: fp32 operands compute in IEEE fp32 (`CUBLAS_COMPUTE_32F`) unless TF32 is allowed
//! (`--tf32`); bf16 operands (`--bf16`, cast by the caller) go to the tensor cores and accumulate
//! into an fp32 result, as autocast does. `KILN_CUBLAS=0` keeps CubeCL's matmul (for A/B timing).
//!
//! CubeCL's matmul is not a fallback for f32 on NVIDIA tensor-core GPUs: it silently computes f32
//! products in TF32 there (`cubek-matmul`'s `adjust_dtypes`), 3-5e-4 off IEEE f32 on the op tests,
//! where PyTorch's default is IEEE f32. cuBLAS with `CUBLAS_COMPUTE_32F` is IEEE f32.

#![allow(clippy::result_large_err)] // The `Err` hands the operands back by value, without a box per GEMM.

use std::any::Any;
use std::cell::RefCell;
use std::ffi::c_void;

use burn::tensor::{DType, Shape};
use burn_cubecl::cubecl::cuda::CudaRuntime;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_dtype;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeRuntime;
use cudarc::cublas::{result as blas, sys};

use crate::ops::blas_layout::{row_major_gemm_strided, BatchedCall, Op};

/// One cuBLAS handle per thread (a handle must not be used by two threads at once); `None` when
/// cuBLAS could not be loaded, after one warning.
struct Handle(sys::cublasHandle_t);

impl Drop for Handle {
    fn drop(&mut self) {
        // SAFETY: made by `create_handle` and used by this thread only.
        let _ = unsafe { blas::destroy_handle(self.0) };
    }
}

thread_local! {
    static HANDLE: RefCell<Option<Option<Handle>>> = const { RefCell::new(None) };
}

/// cuBLAS calls made by this process (each counted as one launch in the bench's launches/step).
static CALLS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

pub(super) fn calls() -> u64 {
    CALLS.load(std::sync::atomic::Ordering::Relaxed)
}

/// Counts one library call (a GEMM here or in [`super::cublaslt`]).
pub(super) fn count_call() {
    CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
}

fn enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("KILN_CUBLAS").map_or(true, |v| v != "0"))
}

/// Runs `f` with this thread's handle, made on first use; `None` when cuBLAS is off or missing.
fn with_handle<T>(f: impl FnOnce(sys::cublasHandle_t) -> T) -> Option<T> {
    if !enabled() {
        return None;
    }
    HANDLE.with(|cell| {
        let mut slot = cell.borrow_mut();
        let handle = slot.get_or_insert_with(|| {
            // SAFETY: only asks the dynamic loader whether the library is there.
            if !unsafe { sys::is_culib_present() } {
                tracing::warn!(
                    "cuBLAS (libcublas.so) was not found: Linear layers use CubeCL's matmul"
                );
                return None;
            }
            match blas::create_handle() {
                Ok(h) => Some(Handle(h)),
                Err(e) => {
                    tracing::warn!(
                        "cuBLAS did not start ({e:?}): Linear layers use CubeCL's matmul"
                    );
                    None
                }
            }
        });
        handle.as_ref().map(|h| f(h.0))
    })
}

/// Whether cuBLAS is on and loaded (made this thread's handle).
pub(super) fn ready() -> bool {
    with_handle(|_| ()).is_some()
}

/// The tensor as CUDA's, or `None` on another runtime.
pub(super) fn as_cuda<R: CubeRuntime>(
    t: CubeTensor<R>,
) -> Result<CubeTensor<CudaRuntime>, CubeTensor<R>> {
    let boxed: Box<dyn Any> = Box::new(t);
    match boxed.downcast::<CubeTensor<CudaRuntime>>() {
        Ok(t) => Ok(*t),
        Err(b) => Err(*b
            .downcast::<CubeTensor<R>>()
            .expect("the type it came in as")),
    }
}

pub(super) fn from_cuda<R: CubeRuntime>(t: CubeTensor<CudaRuntime>) -> CubeTensor<R> {
    let boxed: Box<dyn Any> = Box::new(t);
    *boxed
        .downcast::<CubeTensor<R>>()
        .expect("R is CudaRuntime here")
}

fn cuda_type(dtype: DType) -> Option<sys::cudaDataType> {
    match dtype {
        DType::F32 => Some(sys::cudaDataType::CUDA_R_32F),
        DType::BF16 => Some(sys::cudaDataType::CUDA_R_16BF),
        _ => None,
    }
}

fn op(o: Op) -> sys::cublasOperation_t {
    match o {
        Op::N => sys::cublasOperation_t::CUBLAS_OP_N,
        Op::T => sys::cublasOperation_t::CUBLAS_OP_T,
    }
}

/// How cuBLAS reads one operand: stored transposed or not, the distance between its stored rows,
/// and between consecutive matrices of the batch.
#[derive(Debug, Clone, Copy)]
pub(super) struct Operand {
    pub trans: bool,
    pub ld: usize,
    pub batch_stride: usize,
}

/// The operand view of `t` (`[..batch, rows, cols]`), or `None` when its strides are not one
/// cuBLAS can read (then it is made contiguous first).
fn operand(t: &CubeTensor<CudaRuntime>) -> Option<Operand> {
    let (d, s) = (&t.shape.dims, &t.strides);
    let r = d.len();
    let (rows, cols) = (d[r - 2], d[r - 1]);
    let (trans, ld) = if s[r - 1] == 1 && s[r - 2] >= cols.max(1) {
        (false, s[r - 2])
    } else if s[r - 2] == 1 && s[r - 1] >= rows.max(1) {
        (true, s[r - 1])
    } else {
        return None;
    };
    // The batch dimensions must fold into one stride (size-1 dimensions do not count).
    let (mut stride, mut size) = (0, 1);
    for i in (0..r - 2).rev() {
        if d[i] == 1 {
            continue;
        }
        if size == 1 {
            (stride, size) = (s[i], d[i]);
        } else if s[i] == stride * size {
            size *= d[i];
        } else {
            return None;
        }
    }
    Some(Operand {
        trans,
        ld,
        batch_stride: stride,
    })
}

pub(super) fn operand_or_contiguous(
    t: CubeTensor<CudaRuntime>,
) -> (CubeTensor<CudaRuntime>, Operand) {
    match operand(&t) {
        Some(o) => (t, o),
        None => {
            let t = into_contiguous(t);
            let o = operand(&t).expect("a contiguous tensor is a plain operand");
            (t, o)
        }
    }
}

/// The f32 product `l · r` over the last two dimensions (both `[..batch, _, _]` with the same
/// batch dimensions; f32 or bf16, both alike), read through their strides (a transposed view
/// costs no copy). `Err` gives the operands back when cuBLAS cannot take them (another runtime or
/// dtype, different batch dimensions, cuBLAS off or missing, sizes past `i32`).
pub(super) fn matmul<R: CubeRuntime>(
    l: CubeTensor<R>,
    r: CubeTensor<R>,
    tf32: bool,
) -> Result<CubeTensor<R>, (CubeTensor<R>, CubeTensor<R>)> {
    let (l, r) = match (as_cuda(l), as_cuda(r)) {
        (Ok(l), Ok(r)) => (l, r),
        (l, r) => {
            return Err((
                l.map_or_else(|t| t, from_cuda),
                r.map_or_else(|t| t, from_cuda),
            ))
        }
    };
    let give_back = |l, r| Err((from_cuda(l), from_cuda(r)));
    let rank = l.shape.num_dims();
    let (Some(in_type), true, true) = (
        cuda_type(l.dtype),
        l.dtype == r.dtype,
        rank >= 2
            && r.shape.num_dims() == rank
            && l.shape.dims[..rank - 2] == r.shape.dims[..rank - 2],
    ) else {
        return give_back(l, r);
    };
    let (m, k) = (l.shape.dims[rank - 2], l.shape.dims[rank - 1]);
    let (k2, n) = (r.shape.dims[rank - 2], r.shape.dims[rank - 1]);
    assert_eq!(k, k2, "matmul of [.., {m}, {k}] by [.., {k2}, {n}]");
    let batch: usize = l.shape.dims[..rank - 2].iter().product();
    let (l, lo) = operand_or_contiguous(l);
    let (r, ro) = operand_or_contiguous(r);
    let call = row_major_gemm_strided(m, n, k, (lo.trans, lo.ld), (ro.trans, ro.ld));
    let strides_fit = [lo.batch_stride, ro.batch_stride, m * n, batch]
        .iter()
        .all(|&v| i64::try_from(v).is_ok());
    if !call.fits_i32() || !strides_fit || i32::try_from(batch).is_err() || m * n * batch == 0 {
        return give_back(l, r);
    }
    let mut out_dims = l.shape.dims.clone();
    out_dims[rank - 1] = n;
    let out = empty_device_dtype(
        l.client.clone(),
        l.device.clone(),
        Shape::from(out_dims),
        DType::F32,
    );
    let compute = if in_type == sys::cudaDataType::CUDA_R_32F && tf32 {
        sys::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32
    } else {
        sys::cublasComputeType_t::CUBLAS_COMPUTE_32F
    };
    // The resources name the stream this thread's kernels run on, already made to wait for the
    // streams that wrote them; the bindings keep the buffers alive while the call is queued.
    let lres = l.client.get_resource(l.handle.clone().binding());
    let rres = r.client.get_resource(r.handle.clone().binding());
    let ores = out.client.get_resource(out.handle.clone().binding());
    let stream = ores.resource().stream;
    let (alpha, beta) = (1.0f32, 0.0f32);
    let (a, b, c) = (
        rres.resource().ptr as *const c_void,
        lres.resource().ptr as *const c_void,
        ores.resource().ptr as *mut c_void,
    );
    let (alpha, beta) = (
        (&alpha as *const f32).cast::<c_void>(),
        (&beta as *const f32).cast::<c_void>(),
    );
    let (transa, transb) = (op(call.transa), op(call.transb));
    let (cm, cn, ck) = (call.m as i32, call.n as i32, call.k as i32);
    let (lda, ldb, ldc) = (call.lda as i32, call.ldb as i32, call.ldc as i32);
    let f32_out = sys::cudaDataType::CUDA_R_32F;
    let algo = sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT;
    let done = with_handle(|h| {
        // SAFETY: the three pointers are live device buffers holding every element `call` and
        // the batch strides address (shapes and strides checked above; the output is a fresh
        // contiguous buffer); the call is queued on the stream that orders them, and `alpha` /
        // `beta` are host scalars read before the call returns.
        unsafe {
            blas::set_stream(h, stream as sys::cudaStream_t)?;
            if batch == 1 {
                blas::gemm_ex(
                    h, transa, transb, cm, cn, ck, alpha, a, in_type, lda, b, in_type, ldb, beta,
                    c, f32_out, ldc, compute, algo,
                )
            } else {
                blas::gemm_strided_batched_ex(
                    h,
                    transa,
                    transb,
                    cm,
                    cn,
                    ck,
                    alpha,
                    a,
                    in_type,
                    lda,
                    ro.batch_stride as i64,
                    b,
                    in_type,
                    ldb,
                    lo.batch_stride as i64,
                    beta,
                    c,
                    f32_out,
                    ldc,
                    (m * n) as i64,
                    batch as i32,
                    compute,
                    algo,
                )
            }
        }
    });
    match done {
        Some(Ok(())) => {
            count_call();
            Ok(from_cuda(out))
        }
        Some(Err(e)) => panic!("cuBLAS gemm of [{batch}× {m}, {k}] by [{k}, {n}] failed: {e:?}"),
        None => give_back(l, r),
    }
}

/// Runs `calls` (f32 operands and result) over three buffers: BLAS's `A` operands in `a`, its `B`
/// operands in `b`, the results in `c`, each at the offsets and strides its call names, in order
/// on the stream that orders the three (so calls that add into one result see each other's sums).
/// `false` when cuBLAS cannot take them (off or missing, not f32, a size past `i32`); nothing was
/// queued then.
pub(super) fn batched_calls(
    a: &CubeTensor<CudaRuntime>,
    b: &CubeTensor<CudaRuntime>,
    c: &CubeTensor<CudaRuntime>,
    calls: &[BatchedCall],
    tf32: bool,
) -> bool {
    let f32s = [a, b, c].iter().all(|t| t.dtype == DType::F32);
    let fits = calls.iter().all(|x| {
        x.call.fits_i32()
            && i32::try_from(x.batch).is_ok()
            && [x.stride_a, x.stride_b, x.stride_c]
                .iter()
                .all(|&v| i64::try_from(v).is_ok())
    });
    if !f32s || !fits {
        return false;
    }
    let f32t = sys::cudaDataType::CUDA_R_32F;
    let compute = if tf32 {
        sys::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32
    } else {
        sys::cublasComputeType_t::CUBLAS_COMPUTE_32F
    };
    let ares = a.client.get_resource(a.handle.clone().binding());
    let bres = b.client.get_resource(b.handle.clone().binding());
    let cres = c.client.get_resource(c.handle.clone().binding());
    let stream = cres.resource().stream;
    let elem = std::mem::size_of::<f32>() as u64;
    let (pa, pb, pc) = (
        ares.resource().ptr,
        bres.resource().ptr,
        cres.resource().ptr,
    );
    let (one, zero) = (1.0f32, 0.0f32);
    let done = with_handle(|h| -> Result<(), blas::CublasError> {
        // SAFETY: the caller's calls address only elements inside the three live buffers (their
        // offsets, strides and leading dimensions are `ops::blas_layout::per_head_calls`'s,
        // checked on the host against the shapes); each call is queued on the stream that orders
        // the buffers, and α / β are host scalars read before each call returns.
        unsafe {
            blas::set_stream(h, stream as sys::cudaStream_t)?;
            for x in calls {
                let beta = if x.accumulate { &one } else { &zero };
                let cl = &x.call;
                blas::gemm_strided_batched_ex(
                    h,
                    op(cl.transa),
                    op(cl.transb),
                    cl.m as i32,
                    cl.n as i32,
                    cl.k as i32,
                    (&one as *const f32).cast::<c_void>(),
                    (pa + x.a_offset as u64 * elem) as *const c_void,
                    f32t,
                    cl.lda as i32,
                    x.stride_a as i64,
                    (pb + x.b_offset as u64 * elem) as *const c_void,
                    f32t,
                    cl.ldb as i32,
                    x.stride_b as i64,
                    (beta as *const f32).cast::<c_void>(),
                    (pc + x.c_offset as u64 * elem) as *mut c_void,
                    f32t,
                    cl.ldc as i32,
                    x.stride_c as i64,
                    x.batch as i32,
                    compute,
                    sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                )?;
                count_call();
            }
        }
        Ok(())
    });
    match done {
        Some(Ok(())) => true,
        Some(Err(e)) => panic!("cuBLAS per-head gemm failed: {e:?}"),
        None => false,
    }
}
