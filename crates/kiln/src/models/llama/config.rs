//! Hugging Face `config.json` of a model built on Llama's layers: Llama itself, and the families
//! that change only which layers slide their attention window and whether q/k/v have biases
//! (Mistral, Qwen2: their folders set [`LayerRules`]). Both spellings of the rotary settings are
//! read: `rope_theta` + `rope_scaling` and transformers 5's `rope_parameters`. Unknown fields are
//! kept and written back.

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
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_key_value_heads: Option<usize>,
    /// Written only when set: transformers 5 takes a `null` as the head size itself.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub head_dim: Option<usize>,
    #[serde(default = "d_act")]
    pub hidden_act: String,
    #[serde(default = "d_max_pos")]
    pub max_position_embeddings: usize,
    #[serde(default = "d_eps")]
    pub rms_norm_eps: f64,
    /// The rotary base; see [`LlamaConfig::theta`] for where transformers 5 keeps it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_theta: Option<f64>,
    /// `{"rope_type": "linear" | "llama3" | "default", "factor": …, …}` as transformers writes it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_scaling: Option<serde_json::Value>,
    /// transformers 5: `{"rope_theta": …, "rope_type": …, "factor": …, …}` in one object.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_parameters: Option<serde_json::Value>,
    /// Qwen2's: whether `sliding_window` applies (to the layers from `max_window_layers` on).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub use_sliding_window: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_window_layers: Option<usize>,
    /// `"full_attention"` or `"sliding_attention"` per layer (transformers 5).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layer_types: Option<Vec<String>>,
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
    /// How the family that read this config builds its layers (Llama's unless a family's reader
    /// set its own).
    #[serde(skip)]
    pub rules: LayerRules,
}

/// What a family built on Llama's layers changes in them: set by that family's config reader
/// (`models/mistral`, `models/qwen2`). The default is Llama's.
#[derive(Clone, Copy)]
pub struct LayerRules {
    /// Whether q, k and v have biases.
    pub qkv_bias: fn(&LlamaConfig) -> bool,
    /// Without `layer_types`: whether layer `i` attends through `sliding_window` (when the config
    /// has one).
    pub sliding: fn(&LlamaConfig, usize) -> bool,
}

impl LayerRules {
    /// Llama: q/k/v biases when `attention_bias`, no sliding window.
    pub const LLAMA: Self = Self {
        qkv_bias: |c| c.attention_bias,
        sliding: |_, _| false,
    };

    /// Mistral (`models/mistral`): q/k/v biases only with `attention_bias`; every layer slides.
    pub const MISTRAL: Self = Self {
        qkv_bias: |c| c.attention_bias,
        sliding: |_, _| true,
    };

    /// Qwen2 (`models/qwen2`): q/k/v biases always; the layers from `max_window_layers` on
    /// slide when `use_sliding_window`. These rules are here rather than in their families so
    /// that the GGUF conversion, which writes Mistral and Qwen2 beside Llama, imports no other
    /// family.
    pub const QWEN2: Self = Self {
        qkv_bias: |_| true,
        sliding: |c, i| c.use_sliding_window == Some(true) && i >= c.max_window_layers.unwrap_or(0),
    };
}

impl Default for LayerRules {
    fn default() -> Self {
        Self::LLAMA
    }
}

impl std::fmt::Debug for LayerRules {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("LayerRules")
    }
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

/// The unscaled rotary frequencies `θ^(−2i/d)` for `i < d/2` of heads of `d`.
pub fn rope_base_freqs(theta: f64, d: usize) -> Vec<f64> {
    (0..d / 2)
        .map(|i| 1.0 / theta.powf(2.0 * i as f64 / d as f64))
        .collect()
}

impl RopeScaling {
    /// Llama 3.1's divisor of the rotary frequency `f`: 1 where its wavelength is shorter than
    /// `original / high_freq_factor`, `factor` where it is longer than `original /
    /// low_freq_factor`, a smooth blend between (1 for any other scaling).
    pub fn llama3_factor(&self, f: f64) -> f64 {
        let RopeScaling::Llama3 {
            factor,
            low_freq_factor: low,
            high_freq_factor: high,
            original_max_position_embeddings: old,
        } = *self
        else {
            return 1.0;
        };
        let wavelen = 2.0 * std::f64::consts::PI / f;
        if wavelen < old / high {
            1.0
        } else if wavelen > old / low {
            factor
        } else {
            let smooth = (old / wavelen - low) / (high - low);
            1.0 / ((1.0 - smooth) / factor + smooth)
        }
    }
}

impl LlamaConfig {
    /// Reads and validates a Llama `config.json` (sizes, ranges, model type, and whether the
    /// parameters can fit in memory at all), naming the file in every error. Another family's
    /// config is read by that family (`models::auto::read_causal_lm_config`).
    pub fn from_file(path: &Path) -> Result<Self> {
        let bytes = crate::io::files::read_regular(path, "JSON file")?;
        let cfg = Self::from_bytes(path, &bytes, LayerRules::LLAMA)?;
        crate::io::limits::model_type(cfg.model_type.as_deref(), &["llama"])
            .map_err(|m| KilnError::Config(format!("{}: {m}", path.display())))?;
        Ok(cfg)
    }

    /// The `config.json` text `bytes` (read from `path`) as a config whose family builds its
    /// layers by `rules`, validated; every error names `path`.
    pub fn from_bytes(path: &Path, bytes: &[u8], rules: LayerRules) -> Result<Self> {
        let mut cfg: Self = crate::io::parse_json(path, bytes)?;
        cfg.rules = rules;
        cfg.validate()
            .map_err(|m| KilnError::Config(format!("{}: {m}", path.display())))?;
        crate::io::limits::ensure_params_fit(path, cfg.param_count())?;
        Ok(cfg)
    }

    /// Ranges as transformers and torch enforce them (and what kiln's Llama supports).
    pub fn validate(&self) -> std::result::Result<(), String> {
        use crate::io::limits::{non_negative, positive};
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
        if let Some(kv) = self.num_key_value_heads {
            positive("num_key_value_heads", kv)?;
        }
        if let Some(d) = self.head_dim {
            positive("head_dim", d)?;
        }
        if !self.num_attention_heads.is_multiple_of(self.kv_heads()) {
            return Err(format!(
                "num_attention_heads {} is not a multiple of num_key_value_heads {}",
                self.num_attention_heads,
                self.kv_heads()
            ));
        }
        if self.head_dim.is_none() && !self.hidden_size.is_multiple_of(self.num_attention_heads) {
            return Err(format!(
                "hidden_size {} is not a multiple of num_attention_heads {} (and no head_dim is set)",
                self.hidden_size, self.num_attention_heads
            ));
        }
        if self.head_size() == 0 || !self.head_size().is_multiple_of(2) {
            return Err(format!(
                "head_dim {} must be even and at least 2 for RoPE",
                self.head_size()
            ));
        }
        if self.hidden_act != "silu" {
            return Err(format!(
                "hidden_act {:?} is not supported (only \"silu\")",
                self.hidden_act
            ));
        }
        // kiln's Llama has no dropout (released Llama-family configs all set 0.0): a config
        // that asks for it is refused rather than trained without it.
        if let Some(p) = self.extra.get("attention_dropout") {
            if p.as_f64() != Some(0.0) {
                return Err(format!(
                    "attention_dropout {p} is not supported (kiln's Llama has no dropout; set it to 0.0)"
                ));
            }
        }
        non_negative("rms_norm_eps", self.rms_norm_eps, true)?;
        non_negative("rope_theta", self.theta(), true)?;
        match self.extra.get("sliding_window") {
            None | Some(serde_json::Value::Null) => {}
            Some(v) => match v.as_u64() {
                Some(w) if w >= 1 => {}
                _ => {
                    return Err(format!(
                        "sliding_window must be a positive integer or null, got {v}"
                    ))
                }
            },
        }
        crate::io::limits::layer_types(self.layer_types.as_deref(), self.num_hidden_layers)?;
        let sliding_layers = self
            .layer_types
            .iter()
            .flatten()
            .any(|t| t == "sliding_attention");
        if sliding_layers && self.sliding_window().is_none() {
            return Err(
                "layer_types has sliding_attention layers but sliding_window is null".into(),
            );
        }
        non_negative("initializer_range", self.initializer_range, false)?;
        let eos: Vec<u64> = match &self.eos_token_id {
            None => Vec::new(),
            Some(serde_json::Value::Number(n)) => n.as_u64().into_iter().collect(),
            Some(serde_json::Value::Array(a)) if a.iter().all(|v| v.as_u64().is_some()) => {
                a.iter().filter_map(|v| v.as_u64()).collect()
            }
            Some(other) => {
                return Err(format!(
                    "eos_token_id must be a token id or a list of token ids, got {other}"
                ))
            }
        };
        let ids = [
            ("bos_token_id", self.bos_token_id.map(u64::from)),
            ("pad_token_id", self.pad_token_id.map(u64::from)),
        ];
        for (name, id) in ids
            .into_iter()
            .chain(eos.iter().map(|&e| ("eos_token_id", Some(e))))
        {
            if let Some(id) = id.filter(|&i| i >= self.vocab_size as u64) {
                return Err(format!(
                    "{name} {id} is outside the vocabulary (vocab_size {})",
                    self.vocab_size
                ));
            }
        }
        match self.rope()? {
            RopeScaling::None => {}
            RopeScaling::Linear(f) => non_negative("rope_scaling.factor", f, true)?,
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => {
                non_negative("rope_scaling.factor", factor, true)?;
                non_negative("rope_scaling.low_freq_factor", low_freq_factor, true)?;
                non_negative("rope_scaling.high_freq_factor", high_freq_factor, true)?;
                non_negative(
                    "rope_scaling.original_max_position_embeddings",
                    original_max_position_embeddings,
                    true,
                )?;
                if high_freq_factor <= low_freq_factor {
                    return Err(format!(
                        "rope_scaling.high_freq_factor {high_freq_factor} must be above low_freq_factor {low_freq_factor}"
                    ));
                }
            }
        }
        Ok(())
    }

    /// Every parameter's shape of the whole `LlamaForCausalLM` (Hugging Face names, Linear
    /// weights `[out, in]`), worked out without building it: a pipeline cuts the model into
    /// stages from these before any stage builds or reads a weight.
    pub fn param_shapes(&self) -> std::collections::BTreeMap<String, Vec<usize>> {
        let (v, h, i) = (self.vocab_size, self.hidden_size, self.intermediate_size);
        let (q, kv) = (
            self.num_attention_heads * self.head_size(),
            self.kv_heads() * self.head_size(),
        );
        let mut out = std::collections::BTreeMap::new();
        let mut linear = |name: String, inp: usize, o: usize, bias: bool| {
            if bias {
                out.insert(format!("{name}.bias"), vec![o]);
            }
            out.insert(format!("{name}.weight"), vec![o, inp]);
        };
        let qkv_bias = self.qkv_bias();
        for l in 0..self.num_hidden_layers {
            let at = |part: &str| format!("model.layers.{l}.{part}");
            linear(at("self_attn.q_proj"), h, q, qkv_bias);
            linear(at("self_attn.k_proj"), h, kv, qkv_bias);
            linear(at("self_attn.v_proj"), h, kv, qkv_bias);
            linear(at("self_attn.o_proj"), q, h, self.attention_bias);
            linear(at("mlp.gate_proj"), h, i, self.mlp_bias);
            linear(at("mlp.up_proj"), h, i, self.mlp_bias);
            linear(at("mlp.down_proj"), i, h, self.mlp_bias);
        }
        match self.sequence_classifier_labels() {
            Some(labels) => linear("score".into(), h, labels, false),
            None if !self.tie_word_embeddings => linear("lm_head".into(), h, v, false),
            None => {}
        }
        for l in 0..self.num_hidden_layers {
            for norm in ["input_layernorm", "post_attention_layernorm"] {
                out.insert(format!("model.layers.{l}.{norm}.weight"), vec![h]);
            }
        }
        out.insert("model.norm.weight".into(), vec![h]);
        out.insert("model.embed_tokens.weight".into(), vec![v, h]);
        out
    }

    /// Parameters of `LlamaForCausalLM`, as a float: the sizes come from a file and their product
    /// may exceed any integer type.
    pub fn param_count(&self) -> f64 {
        let (v, h, i, l) = (
            self.vocab_size as f64,
            self.hidden_size as f64,
            self.intermediate_size as f64,
            self.num_hidden_layers as f64,
        );
        let q = (self.num_attention_heads as f64) * self.head_size() as f64;
        let kv = (self.kv_heads() as f64) * self.head_size() as f64;
        let bias = if self.qkv_bias() { q + 2.0 * kv } else { 0.0 }
            + if self.attention_bias { h } else { 0.0 };
        let mlp_bias = if self.mlp_bias { 2.0 * i + h } else { 0.0 };
        let layer = h * q + 2.0 * h * kv + q * h + bias + 3.0 * h * i + mlp_bias + 2.0 * h;
        let head = match self.sequence_classifier_labels() {
            Some(labels) => labels as f64 * h,
            None if self.tie_word_embeddings => 0.0,
            None => v * h,
        };
        v * h + l * layer + h + head
    }

    pub fn kv_heads(&self) -> usize {
        self.num_key_value_heads
            .unwrap_or(self.num_attention_heads)
            .max(1)
    }

    pub fn head_size(&self) -> usize {
        self.head_dim
            .unwrap_or(self.hidden_size / self.num_attention_heads.max(1))
    }

    /// The end-of-sequence ids (the config may hold one or a list).
    pub fn eos_ids(&self) -> Vec<u32> {
        match &self.eos_token_id {
            Some(serde_json::Value::Number(n)) => n
                .as_u64()
                .and_then(|v| u32::try_from(v).ok())
                .into_iter()
                .collect(),
            Some(serde_json::Value::Array(a)) => a
                .iter()
                .filter_map(|v| v.as_u64().and_then(|v| u32::try_from(v).ok()))
                .collect(),
            _ => Vec::new(),
        }
    }

    /// The rotary base: `rope_parameters.rope_theta`, else `rope_theta`, else 10000.
    pub fn theta(&self) -> f64 {
        self.rope_parameters
            .as_ref()
            .and_then(|p| p.get("rope_theta")?.as_f64())
            .or(self.rope_theta)
            .unwrap_or_else(d_theta)
    }

    /// Mistral (and Qwen2 with `use_sliding_window`): how many positions a token attends to,
    /// itself included. Kept among the unknown fields, so that an explicit `null` (Mistral v0.2
    /// on) is written back as `null`, not dropped: transformers' default is 4096.
    pub fn sliding_window(&self) -> Option<usize> {
        self.extra
            .get("sliding_window")?
            .as_u64()
            .and_then(|w| usize::try_from(w).ok())
    }

    /// Whether q, k and v have biases, by the family's rule.
    pub fn qkv_bias(&self) -> bool {
        (self.rules.qkv_bias)(self)
    }

    /// The attention window of layer `i` (positions seen, itself included), or `None` for the
    /// whole past: `layer_types` where the config has it, else the family's rule.
    pub fn window(&self, i: usize) -> Option<usize> {
        let w = self.sliding_window()?;
        let sliding = match &self.layer_types {
            Some(types) => types[i] == "sliding_attention",
            None => (self.rules.sliding)(self, i),
        };
        sliding.then_some(w)
    }

    pub fn rope(&self) -> std::result::Result<RopeScaling, String> {
        let Some(s) = self.rope_scaling.as_ref().or(self.rope_parameters.as_ref()) else {
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

    /// Inverse rotary frequencies `θ^(−2i/d)` for `i < d/2`, with the config's scaling applied
    /// (each divided by its [`Self::rope_freq_factors`]).
    pub fn inv_freq(&self) -> Vec<f32> {
        self.base_freqs()
            .iter()
            .zip(self.rope_freq_factors())
            .map(|(f, factor)| (f / factor) as f32)
            .collect()
    }

    /// The unscaled rotary frequencies ([`rope_base_freqs`]).
    pub fn base_freqs(&self) -> Vec<f64> {
        rope_base_freqs(self.theta(), self.head_size())
    }

    /// What the config's scaling divides each rotary frequency by: 1 without scaling, `factor`
    /// under linear scaling, and Llama 3.1's wavelength-dependent factors (1 for short
    /// wavelengths, `factor` for long ones, a smooth blend between) — the values llama.cpp keeps
    /// in a GGUF's `rope_freqs.weight`.
    pub fn rope_freq_factors(&self) -> Vec<f64> {
        let base = self.base_freqs();
        match self.rope().unwrap_or(RopeScaling::None) {
            RopeScaling::None => vec![1.0; base.len()],
            RopeScaling::Linear(f) => vec![f; base.len()],
            scaling @ RopeScaling::Llama3 { .. } => {
                base.iter().map(|&f| scaling.llama3_factor(f)).collect()
            }
        }
    }

    /// The number of labels of the `score` head where `architectures` names a sequence
    /// classifier (`LlamaForSequenceClassification`: transformers' reward models); `None` for a
    /// causal LM. transformers stores the count as `id2label`'s size (`num_labels` is not saved),
    /// 2 where neither is given.
    pub fn sequence_classifier_labels(&self) -> Option<usize> {
        let class = self.architectures.as_ref()?.first()?;
        if !class.ends_with("ForSequenceClassification") {
            return None;
        }
        let from_labels = self
            .extra
            .get("id2label")
            .and_then(|m| m.as_object())
            .map(|m| m.len())
            .filter(|&n| n > 0);
        let given = self
            .extra
            .get("num_labels")
            .and_then(|n| n.as_u64())
            .map(|n| n as usize);
        Some(from_labels.or(given).unwrap_or(2))
    }

    /// This config as the `{class_prefix}ForSequenceClassification` of `num_labels` labels that
    /// transformers' `AutoModelForSequenceClassification.from_pretrained(…, num_labels=…)` makes
    /// of it (the labels named `LABEL_i`, as transformers names them).
    pub fn into_sequence_classifier(mut self, class_prefix: &str, num_labels: usize) -> Self {
        self.architectures = Some(vec![format!("{class_prefix}ForSequenceClassification")]);
        let names = (0..num_labels).map(|i| (i.to_string(), format!("LABEL_{i}")));
        self.extra.insert(
            "id2label".into(),
            names
                .clone()
                .map(|(i, n)| (i, serde_json::Value::from(n)))
                .collect::<serde_json::Map<_, _>>()
                .into(),
        );
        self.extra.insert(
            "label2id".into(),
            names
                .map(|(i, n)| (n, serde_json::Value::from(i.parse::<u64>().unwrap_or(0))))
                .collect::<serde_json::Map<_, _>>()
                .into(),
        );
        self.extra.remove("num_labels");
        self
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
        // transformers 5 keeps the base and the scaling in one object.
        let c = cfg(
            r#", "rope_parameters": {"rope_theta": 100.0, "rope_type": "linear", "factor": 2.0}"#,
        );
        assert_eq!(c.inv_freq(), vec![0.5, 0.05]);
        let c = cfg(r#", "rope_scaling": {"rope_type": "yarn", "factor": 2.0}"#);
        assert!(c.validate().unwrap_err().contains("yarn"));
        let c = cfg(r#", "eos_token_id": [2, 5]"#);
        assert_eq!(c.eos_ids(), vec![2, 5]);
        assert!(c.validate().is_ok());
    }

    #[test]
    fn llama_has_no_window() {
        let c: LlamaConfig = serde_json::from_value({
            let mut v: serde_json::Value = serde_json::to_value(cfg("")).unwrap();
            v["num_hidden_layers"] = 2.into();
            v["sliding_window"] = 6.into();
            v
        })
        .unwrap();
        assert_eq!(c.window(1), None, "llama has no window");
    }

    #[test]
    fn attention_dropout_is_refused_unless_zero() {
        assert!(cfg(r#", "attention_dropout": 0.0"#).validate().is_ok());
        let err = cfg(r#", "attention_dropout": 0.1"#).validate().unwrap_err();
        assert!(
            err.contains("attention_dropout 0.1 is not supported"),
            "{err}"
        );
    }

    /// The shapes worked out from the config are the built model's, name for name: biases by
    /// each flag and by Qwen2's rule, grouped-query heads, a tied or an own head.
    #[test]
    fn param_shapes_are_the_built_models() {
        use crate::backend::{Cpu, CpuDevice};
        let cases = [
            (cfg(""), LayerRules::LLAMA, 1),
            (
                cfg(r#", "tie_word_embeddings": false, "mlp_bias": true"#),
                LayerRules::LLAMA,
                2,
            ),
            (
                cfg(r#", "attention_bias": true, "head_dim": 6"#),
                LayerRules::LLAMA,
                1,
            ),
            (cfg(""), crate::models::qwen2::RULES, 2),
        ];
        for (mut c, rules, kv_heads) in cases {
            c.rules = rules;
            c.num_hidden_layers = 2;
            c.num_key_value_heads = Some(kv_heads);
            let model = super::super::LlamaForCausalLM::<Cpu>::new(&c, &CpuDevice::default());
            assert_eq!(
                c.param_shapes(),
                crate::models::params::module_shapes(&model),
                "{c:?}"
            );
        }
    }
}
