//! kiln: Hugging Face Transformers training in Rust.
//!
//! Data flows one way: [`data`] (files → tokenized examples → padded batches) → [`models`] →
//! [`train`] (optimizer, schedule, evaluation) → checkpoints through [`hub`].

pub mod backend;
pub mod bench;
pub mod error;
pub mod hub;
pub mod models;
pub mod ops;
pub mod task;

pub use error::{KilnError, Result};
pub mod data;
pub mod dist;
pub mod tasks;
pub mod train;
