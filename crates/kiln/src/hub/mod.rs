//! File formats and the Hub: model folders' files (`config.json` reading, `model.safetensors`,
//! sharded layouts, `tokenizer.json`), GGUF files, the Hub client. Each family's own config and
//! conversions live with its model (`models/<family>/`).

pub mod client;
pub mod files;
pub mod gguf;
pub mod limits;
pub mod model_weights;
pub mod remote;
pub mod sharded;
pub mod weights;

use std::path::Path;

use crate::error::{KilnError, Result};

pub use files::atomic_write;

/// A JSON file parsed as `T`; a syntax or schema error names the file, the line and the field.
pub fn read_json<T: serde::de::DeserializeOwned>(path: &Path) -> Result<T> {
    parse_json(path, &files::read_regular(path, "JSON file")?)
}

/// The JSON text `bytes`, read from `path`, parsed as `T`, with [`read_json`]'s errors (for a file
/// parsed twice: once to see which type it is, once as that type).
pub fn parse_json<T: serde::de::DeserializeOwned>(path: &Path, bytes: &[u8]) -> Result<T> {
    let mut de = serde_json::Deserializer::from_slice(bytes);
    serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let field = e.path().to_string();
        let inner = e.into_inner();
        KilnError::Parse {
            path: path.to_path_buf(),
            line: inner.line(),
            msg: if field == "." {
                inner.to_string()
            } else {
                format!("field `{field}`: {inner}")
            },
        }
    })
}
