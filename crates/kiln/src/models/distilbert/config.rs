//! Hugging Face `config.json` for DistilBERT (`DistilBertConfig`, its own field names: `dim`,
//! `n_layers`, ...). Unknown fields are kept and written back.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{KilnError, Result};
use crate::models::bert::config::ClassifierFields;

fn d_vocab() -> usize {
    30522
}
fn d_max_pos() -> usize {
    512
}
fn d_layers() -> usize {
    6
}
fn d_heads() -> usize {
    12
}
fn d_dim() -> usize {
    768
}
fn d_hidden() -> usize {
    4 * 768
}
fn d_dropout() -> f64 {
    0.1
}
fn d_seq_dropout() -> f64 {
    0.2
}
fn d_act() -> String {
    "gelu".into()
}
fn d_init_range() -> f64 {
    0.02
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct DistilBertConfig {
    #[serde(default = "d_vocab")]
    pub vocab_size: usize,
    #[serde(default = "d_max_pos")]
    pub max_position_embeddings: usize,
    #[serde(default)]
    pub sinusoidal_pos_embds: bool,
    #[serde(default = "d_layers")]
    pub n_layers: usize,
    #[serde(default = "d_heads")]
    pub n_heads: usize,
    #[serde(default = "d_dim")]
    pub dim: usize,
    #[serde(default = "d_hidden")]
    pub hidden_dim: usize,
    #[serde(default = "d_dropout")]
    pub dropout: f64,
    #[serde(default = "d_dropout")]
    pub attention_dropout: f64,
    #[serde(default = "d_act")]
    pub activation: String,
    #[serde(default = "d_init_range")]
    pub initializer_range: f64,
    #[serde(default = "d_seq_dropout")]
    pub seq_classif_dropout: f64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pad_token_id: Option<usize>,
    #[serde(flatten)]
    pub head: ClassifierFields,
    /// Every other field, preserved verbatim.
    #[serde(flatten)]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

impl DistilBertConfig {
    pub fn from_file(path: &Path) -> Result<Self> {
        let cfg: Self = crate::io::read_json(path)?;
        cfg.validate()
            .map_err(|m| KilnError::Config(format!("{}: {m}", path.display())))?;
        crate::io::limits::ensure_params_fit(path, cfg.param_count(2))?;
        Ok(cfg)
    }

    pub fn validate(&self) -> std::result::Result<(), String> {
        use crate::io::limits::{model_type, non_negative, positive, probability};
        model_type(self.head.model_type.as_deref(), &["distilbert"])?;
        for (name, v) in [
            ("vocab_size", self.vocab_size),
            ("max_position_embeddings", self.max_position_embeddings),
            ("n_layers", self.n_layers),
            ("n_heads", self.n_heads),
            ("dim", self.dim),
            ("hidden_dim", self.hidden_dim),
        ] {
            positive(name, v)?;
        }
        if !self.dim.is_multiple_of(self.n_heads) {
            return Err(format!(
                "dim {} is not a multiple of n_heads {}",
                self.dim, self.n_heads
            ));
        }
        if !["gelu", "relu"].contains(&self.activation.as_str()) {
            return Err(format!(
                "activation {:?} is not supported (\"gelu\" or \"relu\")",
                self.activation
            ));
        }
        if self.sinusoidal_pos_embds {
            return Err(
                "sinusoidal_pos_embds true is not supported (kiln trains learned positions)".into(),
            );
        }
        probability("dropout", self.dropout)?;
        probability("attention_dropout", self.attention_dropout)?;
        probability("seq_classif_dropout", self.seq_classif_dropout)?;
        non_negative("initializer_range", self.initializer_range, false)?;
        crate::io::limits::token_in_vocab("pad_token_id", self.pad_token_id, self.vocab_size)?;
        Ok(())
    }

    /// Parameters of `DistilBertForSequenceClassification` with `num_labels` classes.
    pub fn param_count(&self, num_labels: usize) -> f64 {
        let [v, h, l, i, p, c] = [
            self.vocab_size,
            self.dim,
            self.n_layers,
            self.hidden_dim,
            self.max_position_embeddings,
            num_labels,
        ]
        .map(|x| x as f64);
        let layer = 4.0 * (h * h + h) + 2.0 * (h * i) + i + h + 4.0 * h;
        (v + p) * h + 2.0 * h + l * layer + (h * h + h) + (h * c + c)
    }
}
