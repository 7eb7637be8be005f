//! End-to-end tasks: each ties data, a model and the trainer together behind a few functions that
//! the CLI calls (the CLI itself only parses arguments).

pub mod adapter;
pub mod causal_lm;
pub mod merge;
pub mod mnist;
pub mod preference;
pub mod reward;
pub mod sft;
pub mod text_classification;
