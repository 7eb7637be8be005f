//! Hugging Face `config.json` for ModernBERT (`ModernBertConfig`). Both spellings transformers has
//! written are read: `layer_types` + `rope_parameters` (transformers 5) and
//! `global_attn_every_n_layers` + `global_rope_theta` / `local_rope_theta` (the Hub's
//! ModernBERT-base and -large). Unknown fields are kept and written back.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{KilnError, Result};
use crate::models::bert::config::ClassifierFields;

fn d_vocab() -> usize {
    50368
}
fn d_hidden() -> usize {
    768
}
fn d_inter() -> usize {
    1152
}
fn d_layers() -> usize {
    22
}
fn d_heads() -> usize {
    12
}
fn d_gelu() -> String {
    "gelu".into()
}
fn d_max_pos() -> usize {
    8192
}
fn d_init_range() -> f64 {
    0.02
}
fn d_eps() -> f64 {
    1e-5
}
fn d_local() -> usize {
    128
}
fn d_pooling() -> String {
    "cls".into()
}

/// transformers' defaults for the two kinds of layer.
const GLOBAL_THETA: f64 = 160_000.0;
const LOCAL_THETA: f64 = 10_000.0;
const GLOBAL_EVERY: usize = 3;

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ModernBertConfig {
    #[serde(default = "d_vocab")]
    pub vocab_size: usize,
    #[serde(default = "d_hidden")]
    pub hidden_size: usize,
    #[serde(default = "d_inter")]
    pub intermediate_size: usize,
    #[serde(default = "d_layers")]
    pub num_hidden_layers: usize,
    #[serde(default = "d_heads")]
    pub num_attention_heads: usize,
    #[serde(default = "d_gelu")]
    pub hidden_activation: String,
    #[serde(default = "d_max_pos")]
    pub max_position_embeddings: usize,
    #[serde(default = "d_init_range")]
    pub initializer_range: f64,
    #[serde(default = "d_eps")]
    pub norm_eps: f64,
    #[serde(default)]
    pub norm_bias: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pad_token_id: Option<usize>,
    #[serde(default)]
    pub attention_bias: bool,
    #[serde(default)]
    pub attention_dropout: f64,
    /// `"full_attention"` or `"sliding_attention"` per layer (transformers 5).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layer_types: Option<Vec<String>>,
    /// `{"full_attention": {"rope_type": "default", "rope_theta": …}, "sliding_attention": …}`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_parameters: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub global_attn_every_n_layers: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub global_rope_theta: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub local_rope_theta: Option<f64>,
    /// The whole window of a sliding layer: a token sees `local_attention / 2` on each side.
    #[serde(default = "d_local")]
    pub local_attention: usize,
    #[serde(default)]
    pub embedding_dropout: f64,
    #[serde(default)]
    pub mlp_bias: bool,
    #[serde(default)]
    pub mlp_dropout: f64,
    #[serde(default = "d_pooling")]
    pub classifier_pooling: String,
    #[serde(default)]
    pub classifier_dropout: f64,
    #[serde(default)]
    pub classifier_bias: bool,
    #[serde(default = "d_gelu")]
    pub classifier_activation: String,
    #[serde(flatten)]
    pub head: ClassifierFields,
    /// Every other field, preserved verbatim.
    #[serde(flatten)]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

impl ModernBertConfig {
    pub fn from_file(path: &Path) -> Result<Self> {
        let cfg: Self = crate::io::read_json(path)?;
        cfg.validate()
            .map_err(|m| KilnError::Config(format!("{}: {m}", path.display())))?;
        crate::io::limits::ensure_params_fit(path, cfg.param_count(2))?;
        Ok(cfg)
    }

    pub fn validate(&self) -> std::result::Result<(), String> {
        use crate::io::limits::{model_type, non_negative, positive, probability};
        model_type(self.head.model_type.as_deref(), &["modernbert"])?;
        for (name, v) in [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("max_position_embeddings", self.max_position_embeddings),
        ] {
            positive(name, v)?;
        }
        if !self.hidden_size.is_multiple_of(self.num_attention_heads) {
            return Err(format!(
                "hidden_size {} is not a multiple of num_attention_heads {}",
                self.hidden_size, self.num_attention_heads
            ));
        }
        if !self.head_dim().is_multiple_of(2) {
            return Err(format!(
                "the head size {} must be even for rotary embeddings",
                self.head_dim()
            ));
        }
        for (name, act) in [
            ("hidden_activation", &self.hidden_activation),
            ("classifier_activation", &self.classifier_activation),
        ] {
            if act != "gelu" {
                return Err(format!("{name} {act:?} is not supported (only \"gelu\")"));
            }
        }
        if !["cls", "mean"].contains(&self.classifier_pooling.as_str()) {
            return Err(format!(
                "classifier_pooling {:?} is not supported (\"cls\" or \"mean\")",
                self.classifier_pooling
            ));
        }
        crate::io::limits::layer_types(self.layer_types.as_deref(), self.num_hidden_layers)?;
        if let Some(n) = self.global_attn_every_n_layers {
            positive("global_attn_every_n_layers", n)?;
        }
        if let Some(rope) = &self.rope_parameters {
            for kind in ["full_attention", "sliding_attention"] {
                let Some(p) = rope.get(kind) else { continue };
                let t = p
                    .get("rope_type")
                    .and_then(|t| t.as_str())
                    .unwrap_or("default");
                if t != "default" {
                    return Err(format!(
                        "rope_parameters.{kind}.rope_type {t:?} is not supported (only \"default\")"
                    ));
                }
            }
        }
        for sliding in [false, true] {
            non_negative("rope_theta", self.rope_theta(sliding), true)?;
        }
        for (name, p) in [
            ("attention_dropout", self.attention_dropout),
            ("embedding_dropout", self.embedding_dropout),
            ("mlp_dropout", self.mlp_dropout),
            ("classifier_dropout", self.classifier_dropout),
        ] {
            probability(name, p)?;
        }
        non_negative("norm_eps", self.norm_eps, true)?;
        non_negative("initializer_range", self.initializer_range, false)?;
        crate::io::limits::token_in_vocab("pad_token_id", self.pad_token_id, self.vocab_size)?;
        Ok(())
    }

    pub fn head_dim(&self) -> usize {
        self.hidden_size / self.num_attention_heads
    }

    /// Whether layer `i` attends within a sliding window (else to the whole sequence).
    pub fn is_sliding(&self, i: usize) -> bool {
        match &self.layer_types {
            Some(types) => types[i] == "sliding_attention",
            None => !i.is_multiple_of(self.global_attn_every_n_layers.unwrap_or(GLOBAL_EVERY)),
        }
    }

    /// Keys on each side a sliding layer's token sees (transformers' `config.sliding_window`).
    pub fn half_window(&self) -> usize {
        self.local_attention / 2
    }

    /// The rotary base of the sliding (`true`) or global layers.
    pub fn rope_theta(&self, sliding: bool) -> f64 {
        let kind = if sliding {
            "sliding_attention"
        } else {
            "full_attention"
        };
        let from_params = self
            .rope_parameters
            .as_ref()
            .and_then(|r| r.get(kind)?.get("rope_theta")?.as_f64());
        let legacy = if sliding {
            self.local_rope_theta
        } else {
            self.global_rope_theta
        };
        from_params
            .or(legacy)
            .unwrap_or(if sliding { LOCAL_THETA } else { GLOBAL_THETA })
    }

    /// Parameters of `ModernBertForSequenceClassification` with `num_labels` classes.
    pub fn param_count(&self, num_labels: usize) -> f64 {
        let [v, h, l, i, c] = [
            self.vocab_size,
            self.hidden_size,
            self.num_hidden_layers,
            self.intermediate_size,
            num_labels,
        ]
        .map(|x| x as f64);
        let layer = 3.0 * h * h + h * h + 2.0 * h * i + h * i + 2.0 * h;
        v * h + h + l * layer + h + (h * h + h) + (h * c + c)
    }
}
