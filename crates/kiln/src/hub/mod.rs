//! The Hugging Face Hub: kiln's client ([`client`]) and Hub ids resolved wherever a model folder, a
//! tokenizer, a config or a dataset is asked for ([`remote`]), into the cache layout Python's
//! `huggingface_hub` uses.

pub mod client;
pub mod remote;
