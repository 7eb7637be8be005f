//! Model architectures, one file each, with Hugging Face parameter names.

pub mod bert;
pub mod layers;
pub mod llama;
pub mod mlp;
