//! Model architectures with Hugging Face parameter names: one file per encoder family (what they
//! share in `encoder.rs`, the family dispatch in `classifier.rs`) and a folder for Llama.

pub mod auto;
pub mod bert;
pub mod classifier;
pub mod distilbert;
pub mod encoder;
pub mod layers;
pub mod llama;
pub mod mlp;
pub mod modernbert;
pub mod params;
pub mod roberta;
