/// Autotune config module.
pub mod autotune;
/// Cache config module.
#[cfg(std_io)]
pub mod cache;
/// Compilation config module.
pub mod compilation;
/// Memory config module.
pub mod memory;
/// Profiling config module.
pub mod profiling;
/// Streaming config module.
pub mod streaming;

mod base;
mod logger;

pub use base::*;
pub use logger::Logger;
