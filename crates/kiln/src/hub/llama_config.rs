//! Hugging Face `config.json` for Llama-family causal LMs (`LlamaConfig`). Unknown fields are kept
//! and written back.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{KilnError, Result};

fn d_act() -> String {
    "silu".into()
}
fn d_eps() -> f64 {
    1e-6
}
fn d_theta() -> f64 {
    10000.0
}
fn d_init_range() -> f64 {
    0.02
}
fn d_max_pos() -> usize {
    2048
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LlamaConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    /// Grouped-query attention: fewer key/value heads than query heads (defaults to all).
    #[serde(default)]
    pub num_key_value_heads: Option<usize>,
    #[serde(default)]
    pub head_dim: Option<usize>,
    #[serde(default = "d_act")]
    pub hidden_act: String,
    #[serde(default = "d_max_pos")]
    pub max_position_embeddings: usize,
    #[serde(default = "d_eps")]
    pub rms_norm_eps: f64,
    #[serde(default = "d_theta")]
    pub rope_theta: f64,
    /// `{"rope_type": "linear" | "llama3" | "default", "factor": …, …}` as transformers writes it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_scaling: Option<serde_json::Value>,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    #[serde(default)]
    pub attention_bias: bool,
    #[serde(default)]
    pub mlp_bias: bool,
    #[serde(default = "d_init_range")]
    pub initializer_range: f64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bos_token_id: Option<u32>,
    /// A number or a list of numbers in transformers' configs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eos_token_id: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pad_token_id: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub architectures: Option<Vec<String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_type: Option<String>,
    #[serde(flatten)]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

/// How rotary frequencies are stretched for long contexts.
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    None,
    /// Positions divided by `factor` (all frequencies scaled alike).
    Linear(f64),
    /// Llama 3.1's wavelength-dependent scaling.
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: f64,
    },
}

impl LlamaConfig {
    pub fn from_file(path: &Path) -> Result<Self> {
        let cfg: Self = super::read_json(path)?;
        cfg.validate()
            .map_err(|m| KilnError::Config(format!("{}: {m}", path.display())))?;
        Ok(cfg)
    }

    pub fn validate(&self) -> std::result::Result<(), String> {
        if !self.num_attention_heads.is_multiple_of(self.kv_heads()) {
            return Err(format!(
                "num_attention_heads {} is not a multiple of num_key_value_heads {}",
                self.num_attention_heads,
                self.kv_heads()
            ));
        }
        if !self.head_size().is_multiple_of(2) {
            return Err(format!(
                "head_dim {} must be even for RoPE",
                self.head_size()
            ));
        }
        if self.hidden_act != "silu" {
            return Err(format!(
                "hidden_act {:?} is not supported (only \"silu\")",
                self.hidden_act
            ));
        }
        self.rope()?;
        Ok(())
    }

    pub fn kv_heads(&self) -> usize {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }

    pub fn head_size(&self) -> usize {
        self.head_dim
            .unwrap_or(self.hidden_size / self.num_attention_heads)
    }

    /// The end-of-sequence ids (the config may hold one or a list).
    pub fn eos_ids(&self) -> Vec<u32> {
        match &self.eos_token_id {
            Some(serde_json::Value::Number(n)) => {
                n.as_u64().map(|v| v as u32).into_iter().collect()
            }
            Some(serde_json::Value::Array(a)) => a
                .iter()
                .filter_map(|v| v.as_u64().map(|v| v as u32))
                .collect(),
            _ => Vec::new(),
        }
    }

    pub fn rope(&self) -> std::result::Result<RopeScaling, String> {
        let Some(s) = &self.rope_scaling else {
            return Ok(RopeScaling::None);
        };
        let kind = s
            .get("rope_type")
            .or_else(|| s.get("type"))
            .and_then(|v| v.as_str())
            .unwrap_or("default");
        let num = |k: &str| {
            s.get(k)
                .and_then(|v| v.as_f64())
                .ok_or_else(|| format!("rope_scaling.{k} is missing"))
        };
        match kind {
            "default" => Ok(RopeScaling::None),
            "linear" => Ok(RopeScaling::Linear(num("factor")?)),
            "llama3" => Ok(RopeScaling::Llama3 {
                factor: num("factor")?,
                low_freq_factor: num("low_freq_factor")?,
                high_freq_factor: num("high_freq_factor")?,
                original_max_position_embeddings: num("original_max_position_embeddings")?,
            }),
            other => Err(format!(
                "rope_scaling type {other:?} is not supported (default, linear, llama3)"
            )),
        }
    }

    /// Inverse rotary frequencies `θ^(−2i/d)` for `i < d/2`, with the config's scaling applied.
    pub fn inv_freq(&self) -> Vec<f32> {
        let d = self.head_size();
        let base: Vec<f64> = (0..d / 2)
            .map(|i| 1.0 / self.rope_theta.powf(2.0 * i as f64 / d as f64))
            .collect();
        let scaled: Vec<f64> = match self.rope().unwrap_or(RopeScaling::None) {
            RopeScaling::None => base,
            RopeScaling::Linear(f) => base.iter().map(|x| x / f).collect(),
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings: old,
            } => {
                let low_wavelen = old / low_freq_factor;
                let high_wavelen = old / high_freq_factor;
                base.iter()
                    .map(|&f| {
                        let wavelen = 2.0 * std::f64::consts::PI / f;
                        if wavelen < high_wavelen {
                            f
                        } else if wavelen > low_wavelen {
                            f / factor
                        } else {
                            let smooth = (old / wavelen - low_freq_factor)
                                / (high_freq_factor - low_freq_factor);
                            (1.0 - smooth) * f / factor + smooth * f
                        }
                    })
                    .collect()
            }
        };
        scaled.into_iter().map(|x| x as f32).collect()
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("config serialises")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(extra: &str) -> LlamaConfig {
        serde_json::from_str(&format!(
            r#"{{"vocab_size": 10, "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1,
                "num_attention_heads": 2, "num_key_value_heads": 1 {extra}}}"#
        ))
        .unwrap()
    }

    #[test]
    fn rope_frequencies_and_scaling() {
        let c = cfg(r#", "rope_theta": 100.0"#);
        // head_dim 4: θ^0, θ^(-1/2)
        assert_eq!(c.inv_freq(), vec![1.0, 0.1]);
        let c = cfg(r#", "rope_theta": 100.0, "rope_scaling": {"type": "linear", "factor": 2.0}"#);
        assert_eq!(c.inv_freq(), vec![0.5, 0.05]);
        let c = cfg(r#", "rope_scaling": {"rope_type": "yarn", "factor": 2.0}"#);
        assert!(c.validate().unwrap_err().contains("yarn"));
        let c = cfg(r#", "eos_token_id": [2, 5]"#);
        assert_eq!(c.eos_ids(), vec![2, 5]);
        assert!(c.validate().is_ok());
    }
}
