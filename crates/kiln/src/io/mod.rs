//! Reading and writing files safely: crash-safe writes and folders ([`files`]), sizes checked before
//! anything is allocated ([`limits`]), and JSON read with errors that name the file, the line and the
//! field. Used by every layer that touches the disk (data, models, train, report).

pub mod files;
pub mod limits;

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

/// `v` as indented JSON with every object's keys sorted, as Python's
/// `json.dumps(v, indent=2, sort_keys=True)` orders them. transformers (`config.json`) and PEFT
/// (`adapter_config.json`) write their files this way. kiln's JSON objects keep the order their keys
/// were written or read in (serde_json's `preserve_order`; chat templates print tool schemas in
/// their given order), so a file meant to match Python's needs its keys sorted here.
pub fn to_sorted_json_pretty(v: &serde_json::Value) -> String {
    serde_json::to_string_pretty(&sorted_keys(v)).expect("a JSON value serialises")
}

fn sorted_keys(v: &serde_json::Value) -> serde_json::Value {
    use serde_json::Value;
    match v {
        Value::Object(m) => {
            let mut pairs: Vec<_> = m.iter().collect();
            pairs.sort_by(|a, b| a.0.cmp(b.0));
            Value::Object(
                pairs
                    .into_iter()
                    .map(|(k, v)| (k.clone(), sorted_keys(v)))
                    .collect(),
            )
        }
        Value::Array(a) => Value::Array(a.iter().map(sorted_keys).collect()),
        other => other.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sorted_json_orders_keys_at_every_depth_as_python_sort_keys() {
        let v: serde_json::Value =
            serde_json::from_str(r#"{"b": [{"z": 1, "a": {"y": 2, "x": 3}}], "a": null}"#).unwrap();
        // Read in the given order (preserve_order), written sorted.
        assert_eq!(v.as_object().unwrap().keys().next().unwrap(), "b");
        assert_eq!(
            to_sorted_json_pretty(&v),
            "{\n  \"a\": null,\n  \"b\": [\n    {\n      \"a\": {\n        \"x\": 3,\n        \
             \"y\": 2\n      },\n      \"z\": 1\n    }\n  ]\n}"
        );
    }
}
