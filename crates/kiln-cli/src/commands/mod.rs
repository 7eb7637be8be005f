//! One module per `kiln` command: its arguments (clap) and its `run`. `data_opts` holds the data
//! options `train` and `eval` share. `main.rs` resolves the Hub ids their arguments name.

pub mod bench;
pub mod cache;
pub mod convert;
pub mod data_opts;
pub mod dpo_opts;
pub mod eval;
pub mod generate;
pub mod launch;
pub mod lora_opts;
pub mod merge;
pub mod plot;
pub mod precompile;
pub mod predict;
pub mod sft_opts;
pub mod top;
pub mod train;
