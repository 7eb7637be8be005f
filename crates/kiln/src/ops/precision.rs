//! The precision of matrix products, per thread: f32, or bf16 operands with f32 sums under
//! `--bf16` (like `torch.autocast`), a scope that puts the previous one back, and TF32 on CUDA.

use super::*;

/// How Linear layers (and, on the CPU, attention's products) multiply: in f32, or with bf16
/// operands and f32 accumulation (`--bf16`: the numerics of PyTorch's bf16 autocast for matmuls).
/// Everything else — LayerNorm, softmax, GELU, the loss, master weights, optimizer state — stays
/// f32 either way.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MatmulPrecision {
    #[default]
    F32,
    Bf16,
}

thread_local! {
    static MATMUL_PRECISION: std::cell::Cell<MatmulPrecision> = const {
        std::cell::Cell::new(MatmulPrecision::F32)
    };
}

/// Sets the [`MatmulPrecision`] of the ops this thread runs (like `torch.autocast` around a whole
/// run; forward and backward run on the thread that calls them). Thread-local, so concurrent runs
/// in one process (tests) do not see each other's setting.
pub fn set_matmul_precision(p: MatmulPrecision) {
    MATMUL_PRECISION.with(|c| c.set(p));
}

pub fn matmul_precision() -> MatmulPrecision {
    MATMUL_PRECISION.with(|c| c.get())
}

/// This thread's [`MatmulPrecision`] set for as long as the scope lives, and the one before put
/// back when it is dropped (as leaving a `with torch.autocast(...)` block does), so a benchmark
/// row or a test that asks for bf16 cannot leave it set for whatever runs next on the thread.
#[must_use = "the precision goes back when the scope is dropped"]
pub struct MatmulPrecisionScope {
    previous: MatmulPrecision,
}

impl MatmulPrecisionScope {
    pub fn set(p: MatmulPrecision) -> Self {
        let previous = matmul_precision();
        set_matmul_precision(p);
        Self { previous }
    }
}

impl Drop for MatmulPrecisionScope {
    fn drop(&mut self) {
        set_matmul_precision(self.previous);
    }
}

/// The precision `--bf16` (`bf16`) gives Linear layers on backend `B`: bf16 where it has bf16
/// arithmetic that is faster than f32; f32 where rounding operands to bf16 would only cost time
/// (a CPU without AVX512-BF16, an Intel one without AMX tiles, whose `vdpbf16ps` is slower than its
/// FMAs, or one `KILN_CPU_ISA` caps below it), as issue 36 chose: never
/// slower than f32, and no less accurate. See [`KilnBackend::kiln_bf16_is_native`].
pub fn mixed_precision<B: KilnBackend>(bf16: bool) -> MatmulPrecision {
    if bf16 && B::kiln_bf16_is_native() {
        MatmulPrecision::Bf16
    } else {
        MatmulPrecision::F32
    }
}

/// Allows f32 GEMMs on TF32 tensor cores (HF's `--tf32`, PyTorch's
/// `torch.backends.cuda.matmul.allow_tf32`): 10-bit mantissas in the products, f32 accumulation.
/// Only CUDA has them ([`KilnBackend::kiln_has_tf32`]); thread-local like the precision.
pub fn set_tf32(allowed: bool) {
    TF32.with(|c| c.set(allowed));
}

pub fn tf32_allowed() -> bool {
    TF32.with(|c| c.get())
}

thread_local! {
    static TF32: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}
