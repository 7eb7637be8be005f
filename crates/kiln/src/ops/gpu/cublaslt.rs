//! A Linear layer's forward with its bias as one cuBLASLt call (the `BIAS` epilogue adds the bias
//! while the GEMM writes its result), where cuBLAS's GEMM and a broadcast add took two launches and
//! an extra pass over the output. On with `KILN_CUBLASLT=1` until a GPU run has measured it and
//! checked it against the CPU (`scripts/gpu-checks` runs the Linear cases and a bench row with it);
//! any call it cannot take goes back to cuBLAS's GEMM and the add.
//!
//! Only the bias epilogue is used: cuBLASLt's GELU epilogue is the tanh approximation, where BERT,
//! RoBERTa and their kin use the exact erf GELU, so it would train a different model.
//!
//! The operand layouts come from [`row_major_gemm_strided`] and [`GemmCall::lt_layouts`], both
//! unit-tested on the host against cuBLASLt's documented semantics (`ops/blas_layout.rs`). Calls
//! are queued on the CUDA stream CubeCL runs this thread's kernels on, as in [`super::cublas`].

#![allow(clippy::result_large_err)] // The `Err` hands the operands back by value.

use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::c_void;

use burn::tensor::{DType, Shape};
use burn_cubecl::cubecl::cuda::CudaRuntime;
use burn_cubecl::ops::numeric::empty_device_dtype;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeRuntime;
use cudarc::cublaslt::{result as lt, sys};

use super::cublas::{as_cuda, count_call, from_cuda, operand_or_contiguous};
use crate::ops::blas_layout::{row_major_gemm_strided, GemmCall, Op, StoredLayout};

/// The workspace cuBLASLt may use per call (PyTorch gives it 1 MiB by default, 32 MiB on Hopper
/// and later; 4 MiB opens the split-K kernels for the skinny shapes of small batches).
const WORKSPACE_BYTES: usize = 4 << 20;

/// Whether the bias epilogue is on; the caller asks before [`matmul_bias`].
pub(super) fn enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("KILN_CUBLASLT").is_ok_and(|v| v == "1"))
}

/// What a heuristic answer depends on: the call's sizes, transposes and types.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct AlgoKey {
    call: GemmCall,
    bf16: bool,
    tf32: bool,
}

struct Handle {
    raw: sys::cublasLtHandle_t,
    /// The algorithm cuBLASLt's heuristic picked for each call shape (asked once per shape).
    algos: HashMap<AlgoKey, sys::cublasLtMatmulAlgo_t>,
}

impl Drop for Handle {
    fn drop(&mut self) {
        // SAFETY: made by `create_handle` and used by this thread only.
        let _ = unsafe { lt::destroy_handle(self.raw) };
    }
}

thread_local! {
    static HANDLE: RefCell<Option<Option<Handle>>> = const { RefCell::new(None) };
}

fn with_handle<T>(f: impl FnOnce(&mut Handle) -> T) -> Option<T> {
    HANDLE.with(|cell| {
        let mut slot = cell.borrow_mut();
        let handle = slot.get_or_insert_with(|| {
            // SAFETY: only asks the dynamic loader whether the library is there.
            if !unsafe { sys::is_culib_present() } {
                tracing::warn!("cuBLASLt (libcublasLt.so) was not found: Linear biases are added after the GEMM");
                return None;
            }
            match lt::create_handle() {
                Ok(raw) => Some(Handle {
                    raw,
                    algos: HashMap::new(),
                }),
                Err(e) => {
                    tracing::warn!("cuBLASLt did not start ({e:?}): Linear biases are added after the GEMM");
                    None
                }
            }
        });
        handle.as_mut().map(f)
    })
}

/// The descriptors of one call, destroyed together when it is dropped.
struct Descriptors {
    matmul: sys::cublasLtMatmulDesc_t,
    layouts: Vec<sys::cublasLtMatrixLayout_t>,
    pref: Option<sys::cublasLtMatmulPreference_t>,
}

impl Drop for Descriptors {
    fn drop(&mut self) {
        // SAFETY: each was created once below and is destroyed once, here.
        unsafe {
            for l in &self.layouts {
                let _ = lt::destroy_matrix_layout(*l);
            }
            if let Some(p) = self.pref {
                let _ = lt::destroy_matmul_pref(p);
            }
            let _ = lt::destroy_matmul_desc(self.matmul);
        }
    }
}

fn set_desc<T>(
    desc: sys::cublasLtMatmulDesc_t,
    attr: sys::cublasLtMatmulDescAttributes_t,
    value: &T,
) -> Result<(), cudarc::cublaslt::result::CublasError> {
    // SAFETY: `value` is the attribute's documented type, read before the call returns.
    unsafe {
        lt::set_matmul_desc_attribute(
            desc,
            attr,
            (value as *const T).cast(),
            std::mem::size_of::<T>(),
        )
    }
}

/// The matmul descriptor (transposes, bias epilogue) and the layouts of A, B and C (= D).
fn describe(
    call: &GemmCall,
    in_type: sys::cudaDataType,
    tf32: bool,
    bias: *const c_void,
) -> Result<Descriptors, cudarc::cublaslt::result::CublasError> {
    use sys::cublasLtMatmulDescAttributes_t as A;
    let compute = if tf32 && in_type == sys::cudaDataType::CUDA_R_32F {
        sys::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32
    } else {
        sys::cublasComputeType_t::CUBLAS_COMPUTE_32F
    };
    let mut d = Descriptors {
        matmul: lt::create_matmul_desc(compute, sys::cudaDataType::CUDA_R_32F)?,
        layouts: Vec::with_capacity(3),
        pref: None,
    };
    let trans = |o: Op| -> i32 { i32::from(o == Op::T) };
    set_desc(
        d.matmul,
        A::CUBLASLT_MATMUL_DESC_TRANSA,
        &trans(call.transa),
    )?;
    set_desc(
        d.matmul,
        A::CUBLASLT_MATMUL_DESC_TRANSB,
        &trans(call.transb),
    )?;
    let epilogue = sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BIAS;
    set_desc(d.matmul, A::CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue)?;
    set_desc(d.matmul, A::CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias)?;
    // The bias is f32 (the parameter) even when the operands are bf16.
    let bias_type = sys::cudaDataType::CUDA_R_32F;
    set_desc(d.matmul, A::CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_type)?;
    let [la, lb, lc] = call.lt_layouts();
    for (l, ty) in [
        (la, in_type),
        (lb, in_type),
        (lc, sys::cudaDataType::CUDA_R_32F),
    ] {
        let StoredLayout { rows, cols, ld } = l;
        d.layouts.push(lt::create_matrix_layout(
            ty,
            rows as u64,
            cols as u64,
            ld as i64,
        )?);
    }
    Ok(d)
}

/// `x`, `w` and `bias`, handed back.
type Operands<R> = (CubeTensor<R>, CubeTensor<R>, CubeTensor<R>);

/// The f32 `x · w + bias` (`x [M, K]`, `w [K, N]`, either a transposed view; both f32 or both
/// bf16; `bias` f32 `[N]`), or the three operands back when cuBLASLt cannot take them.
pub(super) fn matmul_bias<R: CubeRuntime>(
    x: CubeTensor<R>,
    w: CubeTensor<R>,
    bias: CubeTensor<R>,
    tf32: bool,
) -> Result<CubeTensor<R>, Operands<R>> {
    let (x, w, bias) = match (as_cuda(x), as_cuda(w), as_cuda(bias)) {
        (Ok(x), Ok(w), Ok(b)) => (x, w, b),
        (x, w, b) => {
            let back =
                |t: Result<CubeTensor<CudaRuntime>, CubeTensor<R>>| t.map_or_else(|t| t, from_cuda);
            return Err((back(x), back(w), back(b)));
        }
    };
    let give_back = |x, w, b| Err((from_cuda(x), from_cuda(w), from_cuda(b)));
    let in_type = match x.dtype {
        DType::F32 => sys::cudaDataType::CUDA_R_32F,
        DType::BF16 => sys::cudaDataType::CUDA_R_16BF,
        _ => return give_back(x, w, bias),
    };
    if x.dtype != w.dtype || x.shape.num_dims() != 2 || w.shape.num_dims() != 2 {
        return give_back(x, w, bias);
    }
    let ([m, k], [k2, n]) = (x.shape.dims::<2>(), w.shape.dims::<2>());
    let bias_plain = bias.dtype == DType::F32
        && bias.shape.num_elements() == n
        && bias.strides.last().is_none_or(|&s| s == 1);
    if k2 != k || !bias_plain || m * n == 0 {
        return give_back(x, w, bias);
    }
    let (x, xo) = operand_or_contiguous(x);
    let (w, wo) = operand_or_contiguous(w);
    let call = row_major_gemm_strided(m, n, k, (xo.trans, xo.ld), (wo.trans, wo.ld));
    if !call.fits_i32() {
        return give_back(x, w, bias);
    }
    let out = empty_device_dtype(
        x.client.clone(),
        x.device.clone(),
        Shape::new([m, n]),
        DType::F32,
    );
    let workspace = empty_device_dtype(
        x.client.clone(),
        x.device.clone(),
        Shape::new([WORKSPACE_BYTES / 4]),
        DType::F32,
    );
    // The resources name the stream this thread's kernels run on; the bindings keep the buffers
    // alive while the call is queued.
    let res = |t: &CubeTensor<CudaRuntime>| t.client.get_resource(t.handle.clone().binding());
    let (xr, wr, br, or, sr) = (res(&x), res(&w), res(&bias), res(&out), res(&workspace));
    let stream = or.resource().stream as sys::cudaStream_t;
    let (a, b) = (
        wr.resource().ptr as *const c_void,
        xr.resource().ptr as *const c_void,
    );
    let (d_ptr, bias_ptr, ws) = (
        or.resource().ptr as *mut c_void,
        br.resource().ptr as *const c_void,
        sr.resource().ptr as *mut c_void,
    );
    let key = AlgoKey {
        call,
        bf16: in_type == sys::cudaDataType::CUDA_R_16BF,
        tf32,
    };
    let done = with_handle(|h| -> Result<(), cudarc::cublaslt::result::CublasError> {
        let mut d = describe(&call, in_type, tf32, bias_ptr)?;
        let [la, lb, lc] = [d.layouts[0], d.layouts[1], d.layouts[2]];
        let algo = match h.algos.get(&key) {
            Some(a) => *a,
            None => {
                let pref = lt::create_matmul_pref()?;
                d.pref = Some(pref);
                // SAFETY: every descriptor is live (owned by `d`); the attribute is a usize.
                let found = unsafe {
                    lt::set_matmul_pref_attribute(
                        pref,
                        sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                        (&WORKSPACE_BYTES as *const usize).cast(),
                        std::mem::size_of::<usize>(),
                    )?;
                    lt::get_matmul_algo_heuristic(h.raw, d.matmul, la, lb, lc, lc, pref)?
                };
                h.algos.insert(key, found.algo);
                found.algo
            }
        };
        let (alpha, beta) = (1.0f32, 0.0f32);
        // SAFETY: the pointers are live device buffers holding every element the layouts
        // address (shapes and strides checked above; the output and workspace are fresh), the
        // call is queued on the stream that orders them, and the host scalars are read before
        // it returns.
        unsafe {
            lt::matmul(
                h.raw,
                d.matmul,
                (&alpha as *const f32).cast(),
                (&beta as *const f32).cast(),
                a,
                la,
                b,
                lb,
                d_ptr,
                lc,
                d_ptr,
                lc,
                &algo,
                ws,
                WORKSPACE_BYTES,
                stream,
            )
        }
    });
    match done {
        Some(Ok(())) => {
            count_call();
            Ok(from_cuda(out))
        }
        Some(Err(e)) => {
            // Nothing was queued: the GEMM and the add do the same work.
            static WARNED: std::sync::Once = std::sync::Once::new();
            WARNED.call_once(|| {
                tracing::warn!(
                    "cuBLASLt refused a Linear of [{m}, {k}] by [{k}, {n}] ({e:?}): such biases are added after the GEMM"
                )
            });
            give_back(x, w, bias)
        }
        None => give_back(x, w, bias),
    }
}
