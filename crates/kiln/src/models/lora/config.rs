//! PEFT's `LoraConfig`: rank, alpha, dropout, `target_modules` (names, suffixes or `all-linear`),
//! `modules_to_save`, read from and written to `adapter_config.json` as PEFT writes it.

use crate::error::{KilnError, Result};
use serde_json::Value;
use std::path::Path;

/// The adapter files' names in a PEFT folder.
pub const ADAPTER_CONFIG: &str = "adapter_config.json";

/// The `task_type`s of the models kiln adapts (PEFT's `TaskType` names; `null` is a bare model).
pub(crate) const KNOWN_TASK_TYPES: [&str; 3] = ["CAUSAL_LM", "SEQ_CLS", "FEATURE_EXTRACTION"];

/// The largest LoRA rank kiln accepts (adapters use 4–256).
pub(crate) const MAX_RANK: usize = 65_536;

/// Which Linear layers get an adapter (PEFT's `target_modules`).
#[derive(Debug, Clone, PartialEq)]
pub enum TargetModules {
    /// The model type's default, as PEFT's table of defaults has it (Llama's `q_proj, v_proj`).
    ModelDefault,
    /// Every Linear but the output layer (PEFT's `"all-linear"`).
    AllLinear,
    /// Layers whose path is one of these names or ends with `.<name>`.
    Names(Vec<String>),
}

impl TargetModules {
    /// `--lora-target-modules`: `all-linear`, or names separated by commas.
    pub fn parse(s: &str) -> Self {
        if s.trim() == "all-linear" {
            return Self::AllLinear;
        }
        Self::Names(
            s.split(',')
                .map(|n| n.trim().to_string())
                .filter(|n| !n.is_empty())
                .collect(),
        )
    }

    pub(crate) fn matches(&self, path: &str, output_layer: bool, default: &[&str]) -> bool {
        match self {
            Self::ModelDefault => default.iter().any(|n| suffix_match(path, n)),
            Self::AllLinear => !output_layer,
            Self::Names(names) => names.iter().any(|n| suffix_match(path, n)),
        }
    }
}

/// `path` is `name` or ends with `.name` (PEFT's rule for a list of module names).
pub(crate) fn suffix_match(path: &str, name: &str) -> bool {
    path == name || path.ends_with(&format!(".{name}"))
}

/// A LoRA adapter's settings, under PEFT's `LoraConfig` names.
#[derive(Debug, Clone, PartialEq)]
pub struct LoraConfig {
    pub r: usize,
    pub alpha: f64,
    pub dropout: f64,
    pub target_modules: TargetModules,
    /// Scale by `alpha / √r` instead of `alpha / r` (rsLoRA).
    pub use_rslora: bool,
    /// Modules trained whole beside the adapters (a classification head).
    pub modules_to_save: Vec<String>,
}

impl LoraConfig {
    /// What multiplies `B A x`.
    pub fn scaling(&self) -> f64 {
        if self.use_rslora {
            self.alpha / (self.r as f64).sqrt()
        } else {
            self.alpha / self.r as f64
        }
    }

    /// Reads a PEFT folder's `adapter_config.json` (a LoRA one).
    pub fn from_adapter_dir(dir: &Path) -> Result<Self> {
        let path = dir.join(ADAPTER_CONFIG);
        let bytes = crate::io::files::read_regular(&path, "adapter config")?;
        let v: Value = crate::io::parse_json(&path, &bytes)?;
        let bad = |field: &str, why: &str| {
            KilnError::Config(format!("{}: field `{field}` {why}", path.display()))
        };
        match v["peft_type"].as_str() {
            Some("LORA") => {}
            other => {
                return Err(bad(
                    "peft_type",
                    &format!("is {other:?}; kiln reads LoRA adapters (\"LORA\") only"),
                ))
            }
        }
        for (field, off) in [("use_dora", false), ("fan_in_fan_out", false)] {
            if v[field].as_bool().unwrap_or(off) != off {
                return Err(bad(field, "is true, which kiln does not support"));
            }
        }
        if v["bias"].as_str().unwrap_or("none") != "none" {
            return Err(bad("bias", "is not \"none\", which kiln does not support"));
        }
        for field in ["rank_pattern", "alpha_pattern"] {
            if v[field].as_object().is_some_and(|m| !m.is_empty()) {
                return Err(bad(field, "is not empty, which kiln does not support"));
            }
        }
        // Fields that change which layers are adapted, or how, beyond what kiln builds: PEFT
        // would build another model from them, so they are refused rather than ignored (and
        // dropped when training writes the adapter back).
        for (field, what) in [
            ("layers_to_transform", "adapts only some layers' modules"),
            (
                "layers_pattern",
                "names the layers that layers_to_transform counts",
            ),
            ("layer_replication", "repeats layers of the base"),
            ("exclude_modules", "leaves modules out of target_modules"),
            ("target_parameters", "adapts parameters rather than modules"),
            ("trainable_token_indices", "trains some embedding rows"),
        ] {
            let set = match &v[field] {
                Value::Null => false,
                Value::Array(a) => !a.is_empty(),
                Value::Object(m) => !m.is_empty(),
                Value::String(s) => !s.is_empty(),
                _ => true,
            };
            if set {
                return Err(bad(
                    field,
                    &format!(
                        "is {}, which {what}; kiln does not implement it and would build a \
                         different model than PEFT does",
                        v[field]
                    ),
                ));
            }
        }
        for field in ["lora_bias", "use_qalora"] {
            if v[field].as_bool().unwrap_or(false) {
                return Err(bad(field, "is true, which kiln does not support"));
            }
        }
        match &v["task_type"] {
            Value::Null => {}
            Value::String(t) if KNOWN_TASK_TYPES.contains(&t.as_str()) => {}
            other => {
                return Err(bad(
                    "task_type",
                    &format!(
                        "is {other}; kiln reads adapters of {}",
                        KNOWN_TASK_TYPES.join(", ")
                    ),
                ))
            }
        }
        let dropout = match &v["lora_dropout"] {
            Value::Null => 0.0,
            d => d
                .as_f64()
                .filter(|d| (0.0..1.0).contains(d))
                .ok_or_else(|| {
                    bad(
                        "lora_dropout",
                        &format!("is {d}; it must be at least 0 and below 1"),
                    )
                })?,
        };
        let r = v["r"]
            .as_u64()
            .filter(|&r| r > 0)
            .ok_or_else(|| bad("r", "must be a positive integer"))? as usize;
        let target_modules = match &v["target_modules"] {
            Value::String(s) if s == "all-linear" => TargetModules::AllLinear,
            Value::String(s) => {
                return Err(bad(
                    "target_modules",
                    &format!("is the regular expression {s:?}; kiln reads a list of names"),
                ))
            }
            Value::Array(a) => TargetModules::Names(
                a.iter()
                    .map(|n| n.as_str().map(str::to_string))
                    .collect::<Option<Vec<_>>>()
                    .ok_or_else(|| bad("target_modules", "must be a list of strings"))?,
            ),
            _ => return Err(bad("target_modules", "must be a list of module names")),
        };
        let modules_to_save = match &v["modules_to_save"] {
            Value::Null => Vec::new(),
            Value::Array(a) => a
                .iter()
                .map(|n| n.as_str().map(str::to_string))
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| bad("modules_to_save", "must be a list of strings"))?,
            _ => return Err(bad("modules_to_save", "must be a list of module names")),
        };
        Ok(Self {
            r,
            alpha: v["lora_alpha"]
                .as_f64()
                .ok_or_else(|| bad("lora_alpha", "must be a number"))?,
            dropout,
            target_modules,
            use_rslora: v["use_rslora"].as_bool().unwrap_or(false),
            modules_to_save,
        })
    }
}
