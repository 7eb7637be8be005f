//! Watching a run: what a training job tells the people and tools looking at it.
//!
//! - [`live`]: each rank's live state, published to the run folder for `kiln top`;
//! - [`tensorboard`]: TensorBoard event files with Hugging Face's tag names;
//! - [`history`]: a run's logged entries read back (log.jsonl or trainer_state.json);
//! - [`plot`]: loss, learning-rate and evaluation curves of one or more runs (PNG or SVG);
//! - [`model_card`]: the README.md Hugging Face's Trainer writes beside a trained model.
//!
//! The trainer calls into this module; nothing here imports the trainer.

pub mod history;
pub mod live;
pub mod model_card;
pub mod plot;
pub mod tensorboard;

/// Lives in [`crate::error`], below the Hub client that escapes file and host names too.
pub use crate::error::escape_for_terminal;
