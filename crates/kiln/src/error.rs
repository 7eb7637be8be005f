//! kiln's error type: every variant names the file (and line/field where there is one) it is about.

use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum KilnError {
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{}:{line}: {msg}", path.display())]
    Parse {
        path: PathBuf,
        line: usize,
        msg: String,
    },
    #[error("{0}")]
    Config(String),
    #[error("{0}")]
    Data(String),
    #[error("{0}")]
    Weights(String),
    #[error("{0}")]
    Checkpoint(String),
    /// A loss, gradient, logit or weight that is NaN or infinite (training diverged).
    #[error("{0}")]
    NonFinite(String),
    /// Launcher, rendezvous and collective failures (which rank, what happened).
    #[error("{0}")]
    Distributed(String),
}

impl KilnError {
    pub fn io(path: &Path, source: std::io::Error) -> Self {
        Self::Io {
            path: path.to_path_buf(),
            source,
        }
    }
}

pub type Result<T, E = KilnError> = std::result::Result<T, E>;
