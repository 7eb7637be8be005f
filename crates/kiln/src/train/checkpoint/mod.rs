//! Checkpoints: the [`Checkpointer`] that decides when one is due, saves it (whole, or every rank
//! its shard), rotates old ones and tracks the best metric; the folder layout transformers' Trainer
//! writes and its crash-safe life ([`folder`]); the sharded layout of tensor-parallel, pipeline and
//! ZeRO-1 runs ([`sharded`]).

mod checkpointer;
pub mod folder;
pub mod sharded;

pub use checkpointer::{Checkpointer, Snapshot};
pub use folder::*;
