//! Hugging Face model folders (`config.json`, `model.safetensors`, `tokenizer.json`) and GGUF files.

pub mod config;
pub mod convert;
pub mod gguf;
pub mod llama_config;
pub mod weights;

use std::path::Path;

use crate::error::{KilnError, Result};

/// Writes `bytes` to `path` through a temporary file in the same folder and a rename, so a reader
/// (or a crash) never sees a half-written file.
pub fn atomic_write(path: &Path, bytes: &[u8]) -> Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).map_err(|e| KilnError::io(dir, e))?;
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("out");
    let tmp = dir.join(format!(".{name}.tmp-{}", std::process::id()));
    std::fs::write(&tmp, bytes).map_err(|e| KilnError::io(&tmp, e))?;
    std::fs::rename(&tmp, path).map_err(|e| KilnError::io(path, e))
}

/// A JSON file parsed as `T`; a syntax or schema error names the file and line.
pub fn read_json<T: serde::de::DeserializeOwned>(path: &Path) -> Result<T> {
    let text = std::fs::read_to_string(path).map_err(|e| KilnError::io(path, e))?;
    serde_json::from_str(&text).map_err(|e| KilnError::Parse {
        path: path.to_path_buf(),
        line: e.line(),
        msg: e.to_string(),
    })
}
