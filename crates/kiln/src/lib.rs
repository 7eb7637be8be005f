//! kiln: Hugging Face Transformers training in Rust.
//!
//! Data flows one way: [`data`] (files → tokenized examples → padded batches) → [`models`] →
//! [`train`] (optimizer, schedule, evaluation) → checkpoints in [`formats`], written through [`io`];
//! [`hub`] is the Hub client. [`contract`] is the
//! contract the three share; [`parallel`] is the one layer the trainer calls for multi-process
//! training; [`tasks`] wires an end-to-end job for the CLI.

pub mod backend;
pub mod bench;
pub mod contract;
pub mod data;
pub mod error;
pub mod formats;
pub mod hub;
pub mod io;
pub mod models;
pub mod ops;
pub mod parallel;
pub mod report;
pub mod tasks;
pub mod train;

pub use error::{KilnError, Result};
