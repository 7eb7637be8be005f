//! The Llama family (also Mistral's sliding window and Qwen2's q/k/v biases, options of it):
//! its config (`config.rs`), the model (`model.rs`), its tensor-parallel cut and resharding
//! splits (`parallel.rs`), loading a folder or a fresh model (`load.rs`), and the GGUF → Hugging
//! Face conversion (`gguf.rs`).

pub mod config;
pub mod gguf;
pub mod load;
mod model;
pub mod parallel;

pub use model::*;
