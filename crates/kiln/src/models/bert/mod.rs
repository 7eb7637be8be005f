//! The bert family: its config (`config.rs`) and its model (`model.rs`).

pub mod config;
mod model;

pub use model::*;
