//! RoBERTa (also XLM-RoBERTa, CamemBERT): BERT's config and layers, its own embeddings' positions
//! and head.

mod model;

pub use model::*;
