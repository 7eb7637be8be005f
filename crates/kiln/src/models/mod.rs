//! Model architectures with Hugging Face parameter names, one folder per family: the encoders
//! (bert, roberta, distilbert, modernbert; what they share in `encoder.rs`, the classifier head in
//! `classifier.rs`) and the causal LMs (llama; mistral and qwen2, built on Llama's layers; what the
//! task needs of any decoder in `decoder.rs`). `auto.rs` picks the family a `config.json` names.

pub mod auto;
pub mod bert;
pub mod classifier;
pub mod completion_scores;
pub mod decoder;
pub mod distilbert;
pub mod encoder;
pub mod layers;
pub mod llama;
pub mod lora;
pub mod mistral;
pub mod mlp;
pub mod modernbert;
pub mod params;
pub mod qwen2;
pub mod roberta;
