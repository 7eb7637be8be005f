//! A model folder's special tokens (`bos_token`, `eos_token`, ...) as templates see them, read from
//! `tokenizer_config.json` and `special_tokens_map.json` as transformers reads them.

use serde_json::{Map, Value as Json};
use std::path::Path;

use super::*;

/// The special tokens transformers passes to every template (`special_tokens_map`).
pub(crate) const SPECIAL_TOKENS: [&str; 7] = [
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
];

/// The special tokens of a model folder (`bos_token`, `eos_token`, `unk_token`, `pad_token`, …),
/// from `tokenizer_config.json`, else `special_tokens_map.json`; each a string or an `AddedToken`
/// object (`{"content": …}`).
pub fn special_tokens(dir: &Path) -> Result<BTreeMap<String, String>, ChatTemplateError> {
    let mut out = BTreeMap::new();
    for file in ["special_tokens_map.json", "tokenizer_config.json"] {
        let path = dir.join(file);
        let Some(config) = read_json_object(&path)? else {
            continue;
        };
        for name in SPECIAL_TOKENS {
            match config.get(name) {
                Some(Json::String(s)) => {
                    out.insert(name.to_string(), s.clone());
                }
                Some(Json::Object(o)) => match o.get("content") {
                    Some(Json::String(s)) => {
                        out.insert(name.to_string(), s.clone());
                    }
                    _ => {
                        return Err(ChatTemplateError::File {
                            path,
                            message: format!(
                                "\"{name}\" is an object without a \"content\" string"
                            ),
                        })
                    }
                },
                _ => {}
            }
        }
    }
    Ok(out)
}

pub(crate) fn read_json_object(
    path: &Path,
) -> Result<Option<Map<String, Json>>, ChatTemplateError> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => {
            return Err(ChatTemplateError::File {
                path: path.to_path_buf(),
                message: format!("cannot read it: {e}"),
            })
        }
    };
    match serde_json::from_str(&text) {
        Ok(Json::Object(o)) => Ok(Some(o)),
        Ok(_) => Err(ChatTemplateError::File {
            path: path.to_path_buf(),
            message: "it is not a JSON object".into(),
        }),
        Err(e) => Err(ChatTemplateError::File {
            path: path.to_path_buf(),
            message: format!("it is not valid JSON: {e}"),
        }),
    }
}

pub(crate) fn default_of_named(list: &[Json], path: &Path) -> Result<String, ChatTemplateError> {
    let mut names = Vec::new();
    for item in list {
        match (item.get("name"), item.get("template")) {
            (Some(Json::String(name)), Some(Json::String(t))) => {
                if name == "default" {
                    return Ok(t.clone());
                }
                names.push(name.clone());
            }
            _ => {
                return Err(ChatTemplateError::File {
                    path: path.to_path_buf(),
                    message: "each entry of the \"chat_template\" list must be {\"name\": …, \
                              \"template\": …} with two strings"
                        .into(),
                })
            }
        }
    }
    Err(ChatTemplateError::File {
        path: path.to_path_buf(),
        message: format!(
            "the model has several chat templates ({}) but none named \"default\"",
            names.join(", ")
        ),
    })
}
