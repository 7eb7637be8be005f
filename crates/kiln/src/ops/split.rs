//! How a matrix product is split into tasks across threads: the f32 GEMM's, the narrow products' and
//! AMX's tiles all take the same rule, so a second thread joins only when its share pays for waking it.

/// How many tiles (rows × columns of tiles) an `m×k·k×n` product is split into for `threads`
/// threads: at most one per thread, each at least [`GEMM_TASK_MIN`] multiply-adds, shaped as close
/// to square as the divisors allow (a thin tile packs its shared operand for little work).
pub(super) fn gemm_grid(m: usize, n: usize, k: usize, threads: usize) -> (usize, usize) {
    let tasks = (m * n * k / GEMM_TASK_MIN).clamp(1, threads.max(1));
    (1..=tasks)
        .filter(|tn| tasks.is_multiple_of(*tn))
        .map(|tn| (tasks / tn, tn))
        .max_by_key(|&(tm, tn)| (m / tm).min(n / tn))
        .unwrap_or((1, 1))
}

/// Multiply-adds below which a second thread costs more than it saves. Alone, the MNIST MLP's
/// 32×784×120 (3·2²⁰) runs faster as two tiles (`examples/gemm_crates.rs`), but the whole MNIST
/// step is 12 % faster with it on one thread (2²⁰ against 2²², four paired `kiln bench` runs):
/// the second thread's wake-up and cold caches cost more than the half product it takes.
pub(super) const GEMM_TASK_MIN: usize = 1 << 22;
