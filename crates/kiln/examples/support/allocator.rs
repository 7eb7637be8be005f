//! The allocator the `kiln` binary runs on (crates/kiln-cli/src/main.rs), set up the same way, so
//! an example's timings are the binary's. On the system allocator each output over its mmap
//! threshold (MiniLM's 4096 × 1536 product is 25 MB) is a fresh mapping whose pages the kernel
//! zeroes on first touch: `clear_page_erms` took 16 % of `f32_products`' samples, time a training
//! or inference step does not spend.

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// mimalloc's `mi_option_purge_delay`, as the binary sets it.
const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

/// Keeps freed memory committed, as the binary does (its `keep_freed_memory`), unless
/// `MIMALLOC_PURGE_DELAY` asks for another delay.
pub fn keep_freed_memory() {
    if std::env::var_os("MIMALLOC_PURGE_DELAY").is_none() {
        // SAFETY: sets a process-wide allocator option; valid at any time.
        unsafe { libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, -1) };
    }
}
