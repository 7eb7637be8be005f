//! What ops share at run time: the thread pool (its size, its workers' stacks) and the stream of
//! dropout seeds, reproducible from a run's seed and the step it resumes at.

use burn::tensor::backend::Backend;

/// Sets the CPU worker threads: one rayon pool runs every kernel, and matrixmultiply's own pool is
/// turned off (kernels split GEMMs across rayon instead), so two pools never fight over the cores.
/// Call once, before any tensor work; later calls have no effect.
pub fn init_threads(threads: Option<usize>) {
    // SAFETY (set_var): called at start-up, before other threads exist.
    std::env::set_var("MATMUL_NUM_THREADS", "1");
    let mut pool = rayon::ThreadPoolBuilder::new().stack_size(WORKER_STACK);
    if let Some(n) = threads {
        pool = pool.num_threads(n);
    }
    let _ = pool.build_global();
}

/// Stack of each pool thread: [`on_pool`] runs the whole command on one, which must hold as much as
/// the main thread's 8 MiB.
pub(crate) const WORKER_STACK: usize = 8 << 20;

/// Runs `f` on a thread of the kernel pool (the caller waits). A kernel that splits its work from
/// there hands half to the other threads through the pool's own queues, and a kernel too small to
/// split runs in place; from a thread outside the pool every parallel call is a round trip through
/// the pool's injector and a sleeping latch (≈ 10–30 µs), which is most of a small model's step.
///
/// Not with a one-thread pool: `f` would then hold the pool's only thread, and a thread outside
/// it that hands the pool work while `f` waits on that thread (Burn's collectives sum tensors on
/// their own threads) would wait forever.
pub fn on_pool<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    if rayon::current_thread_index().is_some() || rayon::current_num_threads() < 2 {
        return f();
    }
    rayon::scope(|_| f())
}

/// Runs `f` right after seeding the backend's random generator, holding a process-wide lock: the
/// backend RNG is global, so without the lock two trainers in one process would interleave draws and
/// a seed would no longer determine the initial weights.
pub fn with_seeded_rng<B: Backend, T>(device: &B::Device, seed: u64, f: impl FnOnce() -> T) -> T {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _guard = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    B::seed(device, seed);
    f()
}

thread_local! {
    /// Per thread: a model's forward runs on its trainer's thread, so trainers running side by side
    /// in one process (tests, several jobs) never draw from each other's stream.
    static DROPOUT_STREAM: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Restarts this thread's dropout random stream: the trainer calls it before every optimizer step
/// with a seed derived from (run seed, step), which makes dropout — and so resuming — reproducible.
pub fn reseed_dropout(seed: u64) {
    DROPOUT_STREAM.with(|s| s.set(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15)));
}

/// Where this thread's dropout stream stands: with [`set_dropout_position`], activation
/// checkpointing recomputes a segment with the very masks its first forward pass drew.
pub fn dropout_position() -> u64 {
    DROPOUT_STREAM.with(|s| s.get())
}

/// Puts this thread's dropout stream back where [`dropout_position`] found it.
pub fn set_dropout_position(position: u64) {
    DROPOUT_STREAM.with(|s| s.set(position));
}

/// The seed of the next dropout mask on this thread.
pub(crate) fn next_dropout_seed() -> u64 {
    DROPOUT_STREAM.with(|s| {
        let v = s.get();
        s.set(v.wrapping_add(1));
        v
    })
}

/// A fused kernel's dropout: each element is zeroed with probability `rate` (and the kept ones
/// scaled by `1 / (1 - rate)`), the mask a function of `seed` alone, so a backward regenerates it
/// instead of storing it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Dropout {
    pub rate: f64,
    pub seed: u64,
}

impl Dropout {
    /// No dropout (inference, or a rate of 0).
    pub const NONE: Self = Self { rate: 0.0, seed: 0 };

    /// Whether any element is dropped.
    pub fn is_active(&self) -> bool {
        self.rate > 0.0
    }

    /// The probability an element is kept.
    pub fn keep(&self) -> f64 {
        1.0 - self.rate
    }
}

/// A fused kernel's dropout at `rate`: a fresh seed from the dropout stream in training,
/// [`Dropout::NONE`] (and no draw from the stream) otherwise.
pub(crate) fn training_dropout<B: Backend>(rate: f64) -> Dropout {
    if B::ad_enabled() && rate > 0.0 {
        Dropout {
            rate,
            seed: next_dropout_seed(),
        }
    } else {
        Dropout::NONE
    }
}
