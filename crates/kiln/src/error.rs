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

/// `s` with every control character (escape sequences, NUL, line breaks) and bidirectional
/// override written as an escape (`\u{1b}`), for printing text that came from data, files or the
/// network: a label name or a host name must not drive the terminal.
pub fn escape_for_terminal(s: &str) -> String {
    let unsafe_char = |c: char| {
        c.is_control()
            || ('\u{202a}'..='\u{202e}').contains(&c)
            || ('\u{2066}'..='\u{2069}').contains(&c)
    };
    if !s.chars().any(unsafe_char) {
        return s.to_string();
    }
    s.chars()
        .map(|c| {
            if unsafe_char(c) {
                c.escape_unicode().to_string()
            } else {
                c.to_string()
            }
        })
        .collect()
}

/// What a JSON value is, for messages ("expected a string, not an array"), in JSON's own names:
/// one spelling for every file kiln reads (configs, chat data, `trainer_state.json`).
pub(crate) fn json_kind(v: &serde_json::Value) -> &'static str {
    match v {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::Object(_) => "an object",
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn control_characters_are_escaped_for_the_terminal() {
        assert_eq!(super::escape_for_terminal("pos"), "pos");
        assert_eq!(
            super::escape_for_terminal("a\u{1b}[2Jb\0c\u{202e}"),
            "a\\u{1b}[2Jb\\u{0}c\\u{202e}"
        );
    }
}
