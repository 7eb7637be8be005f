//! Hugging Face `config.json` for BERT-family models. Unknown fields are kept and written back, so a
//! checkpoint saved by kiln carries everything `transformers.AutoConfig` expects.

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{KilnError, Result};

fn d_act() -> String {
    "gelu".into()
}
fn d_dropout() -> f64 {
    0.1
}
fn d_init_range() -> f64 {
    0.02
}
fn d_ln_eps() -> f64 {
    1e-12
}
fn d_type_vocab() -> usize {
    2
}
fn d_max_pos() -> usize {
    512
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BertConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub intermediate_size: usize,
    #[serde(default = "d_act")]
    pub hidden_act: String,
    #[serde(default = "d_dropout")]
    pub hidden_dropout_prob: f64,
    #[serde(default = "d_dropout")]
    pub attention_probs_dropout_prob: f64,
    #[serde(default = "d_max_pos")]
    pub max_position_embeddings: usize,
    #[serde(default = "d_type_vocab")]
    pub type_vocab_size: usize,
    #[serde(default = "d_init_range")]
    pub initializer_range: f64,
    #[serde(default = "d_ln_eps")]
    pub layer_norm_eps: f64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub classifier_dropout: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pad_token_id: Option<usize>,
    #[serde(flatten)]
    pub head: ClassifierFields,
    /// Every other field (torch_dtype, transformers_version, ...), preserved verbatim.
    #[serde(flatten)]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

/// What every sequence-classification config holds beside its architecture (transformers'
/// `PretrainedConfig`): the label names and what the model is.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ClassifierFields {
    /// `{"0": "negative", ...}` — JSON object keys are strings in HF configs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id2label: Option<BTreeMap<String, String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub label2id: Option<BTreeMap<String, usize>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub architectures: Option<Vec<String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_type: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub problem_type: Option<String>,
}

impl ClassifierFields {
    /// Label names in id order, if `id2label` is complete.
    pub fn labels(&self) -> Option<Vec<String>> {
        let map = self.id2label.as_ref()?;
        (0..map.len())
            .map(|i| map.get(&i.to_string()).cloned())
            .collect()
    }

    /// Records the label set (id order) and the architecture the way transformers does.
    pub fn set_labels(&mut self, labels: &[String], architecture: &str) {
        self.id2label = Some(
            labels
                .iter()
                .enumerate()
                .map(|(i, l)| (i.to_string(), l.clone()))
                .collect(),
        );
        self.label2id = Some(
            labels
                .iter()
                .enumerate()
                .map(|(i, l)| (l.clone(), i))
                .collect(),
        );
        self.architectures = Some(vec![architecture.into()]);
        self.problem_type = Some("single_label_classification".into());
    }
}

impl BertConfig {
    /// Reads and validates a `config.json` (sizes, ranges, model type, and whether the parameters
    /// can fit in memory at all), naming the file in every error.
    pub fn from_file(path: &Path) -> Result<Self> {
        let cfg: Self = crate::io::read_json(path)?;
        cfg.validate()
            .map_err(|m| KilnError::Config(format!("{}: {m}", path.display())))?;
        crate::io::limits::ensure_params_fit(path, cfg.param_count(2))?;
        Ok(cfg)
    }

    /// Ranges as transformers and torch enforce them (and what kiln's BERT supports).
    pub fn validate(&self) -> std::result::Result<(), String> {
        use crate::io::limits::{model_type, non_negative, positive, probability};
        model_type(
            self.head.model_type.as_deref(),
            &["bert", "roberta", "xlm-roberta", "camembert"],
        )?;
        for (name, v) in [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("intermediate_size", self.intermediate_size),
            ("max_position_embeddings", self.max_position_embeddings),
            ("type_vocab_size", self.type_vocab_size),
        ] {
            positive(name, v)?;
        }
        if !self.hidden_size.is_multiple_of(self.num_attention_heads) {
            return Err(format!(
                "hidden_size {} is not a multiple of num_attention_heads {}",
                self.hidden_size, self.num_attention_heads
            ));
        }
        if self.hidden_act != "gelu" {
            return Err(format!(
                "hidden_act {:?} is not supported (only \"gelu\")",
                self.hidden_act
            ));
        }
        probability("hidden_dropout_prob", self.hidden_dropout_prob)?;
        probability(
            "attention_probs_dropout_prob",
            self.attention_probs_dropout_prob,
        )?;
        if let Some(p) = self.classifier_dropout {
            probability("classifier_dropout", p)?;
        }
        non_negative("layer_norm_eps", self.layer_norm_eps, true)?;
        non_negative("initializer_range", self.initializer_range, false)?;
        crate::io::limits::token_in_vocab("pad_token_id", self.pad_token_id, self.vocab_size)?;
        // RoBERTa's positions start after the padding id's row: the table needs rows beyond it.
        if self.is_roberta() && self.max_length() == 0 {
            return Err(format!(
                "max_position_embeddings {} leaves no positions after pad_token_id {} (RoBERTa \
                 counts positions from pad_token_id + 1)",
                self.max_position_embeddings,
                self.pad_token_id.unwrap_or(1)
            ));
        }
        Ok(())
    }

    /// Parameters of `BertForSequenceClassification` with `num_labels` classes, as a float: the
    /// sizes come from a file and their product may exceed any integer type.
    pub fn param_count(&self, num_labels: usize) -> f64 {
        let [v, h, l, i, p, t, c] = [
            self.vocab_size,
            self.hidden_size,
            self.num_hidden_layers,
            self.intermediate_size,
            self.max_position_embeddings,
            self.type_vocab_size,
            num_labels,
        ]
        .map(|x| x as f64);
        let embeddings = (v + p + t) * h + 2.0 * h;
        let layer = 4.0 * (h * h + h) + 2.0 * (h * i) + i + h + 4.0 * h;
        embeddings + l * layer + (h * h + h) + (h * c + c)
    }

    /// Whether this is a RoBERTa-architecture config (RoBERTa, XLM-RoBERTa, CamemBERT): BERT's
    /// layers with positions counted from `pad_token_id + 1` and a two-layer classification head.
    pub fn is_roberta(&self) -> bool {
        self.head.model_type.as_deref().is_some_and(|t| t != "bert")
    }

    /// The longest input the position table allows (RoBERTa's first `pad_token_id + 1` rows are
    /// never used).
    pub fn max_length(&self) -> usize {
        if self.is_roberta() {
            self.max_position_embeddings
                .saturating_sub(self.pad_token_id.unwrap_or(1) + 1)
        } else {
            self.max_position_embeddings
        }
    }

    pub fn classifier_dropout_prob(&self) -> f64 {
        self.classifier_dropout.unwrap_or(self.hidden_dropout_prob)
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("config serialises")
    }
}
