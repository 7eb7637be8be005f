//! `kiln cache`: the on-disk cache of compiled GPU kernels and autotune results.

use anyhow::Result;
use clap::Subcommand;

#[derive(Subcommand)]
pub enum CacheAction {
    /// Where the cache is and how much it holds.
    Info,
    /// Delete the compiled kernels and autotune results kiln cached (only kiln's own folders).
    Clean,
    /// Remove lock files left by killed runs (older than --older-than seconds), which make later
    /// runs wait.
    ClearLocks {
        /// Keep locks younger than this many seconds: a running job may hold them.
        #[arg(long, value_name = "SECONDS", default_value_t = 30)]
        older_than: u64,
    },
}

pub fn run(action: CacheAction) -> Result<()> {
    let dir = kiln::backend::kernel_cache_dir();
    if let CacheAction::ClearLocks { older_than } = action {
        let age = std::time::Duration::from_secs(older_than);
        let (removed, kept) = kiln::backend::clear_kernel_cache_locks(age)?;
        println!(
            "{}: removed {removed} lock files, kept {kept} younger than {older_than} s",
            dir.display()
        );
        return Ok(());
    }
    if let CacheAction::Clean = action {
        let done = kiln::backend::clean_kernel_cache()?;
        println!(
            "{}: removed {} files, {:.1} MiB of compiled kernels and autotune results",
            dir.display(),
            done.files,
            done.bytes as f64 / (1 << 20) as f64
        );
        if !done.kept.is_empty() {
            tracing::info!(
                "kept what kiln did not write there: {}",
                done.kept.join(", ")
            );
        }
        return Ok(());
    }
    let (bytes, files) = kiln::backend::kernel_cache_usage();
    println!(
        "{}: holds {files} files, {:.1} MiB",
        dir.display(),
        bytes as f64 / (1 << 20) as f64
    );
    Ok(())
}
