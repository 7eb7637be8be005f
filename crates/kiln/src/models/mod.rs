//! Model architectures, one file each, with Hugging Face parameter names.

pub mod bert;
pub mod classifier;
pub mod distilbert;
pub mod layers;
pub mod llama;
pub mod mlp;
pub mod modernbert;
pub mod roberta;
