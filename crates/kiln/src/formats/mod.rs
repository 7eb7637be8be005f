//! The file formats model weights are kept in: safetensors ([`safetensors`]), a model folder's
//! weights in whichever layout it has ([`model_weights`]), kiln's sharded tensor-parallel layout
//! ([`sharded`]) and llama.cpp's GGUF ([`gguf`]). Each family's own config and conversions live with
//! its model (`models/<family>/`).

pub mod gguf;
pub mod gguf_writer;
pub mod model_weights;
pub mod safetensors;
pub mod sharded;
