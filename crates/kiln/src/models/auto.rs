//! Which family a model folder holds, read from `config.json`'s `model_type` (else
//! `architectures`) the way transformers' `AutoModelFor…` classes decide: the encoder families
//! kiln classifies with ([`EncoderConfig`]) and the causal-LM families ([`with_causal_lm`]).

use std::collections::BTreeMap;
use std::path::Path;

use super::bert::config::{BertConfig, ClassifierFields};
use super::decoder::{DecoderArchitecture, DecoderFamily, DecoderVisitor};
use super::distilbert::config::DistilBertConfig;
use super::modernbert::config::ModernBertConfig;
use crate::contract::ParamSplit;
use crate::error::{KilnError, Result};
use crate::ops::KilnBackend;

/// The `model_type`s kiln classifies with, for error messages.
pub const CLASSIFIER_TYPES: &str = "bert, roberta, xlm-roberta, camembert, distilbert, modernbert";

/// Every causal-LM family, by its `FAMILY`: a new family is its folder and one line here. Gives
/// [`causal_lms`] (model types and class-name prefixes) and [`with_causal_lm`].
macro_rules! causal_lm_families {
    ($($family:expr),+ $(,)?) => {
        /// The causal-LM families' `(model_type, class-name prefix)`.
        pub fn causal_lms() -> Vec<(&'static str, &'static str)> {
            vec![$(($family.model_type, $family.class_prefix)),+]
        }

        /// Runs `v` with the family of the causal LM whose `config.json` is `path`, and the
        /// config as that family reads it (the file is read once). The family is the declared
        /// `model_type`, else the one `architectures` names, else `llama` (as kiln always read
        /// such configs); one that is no causal LM is one sentence.
        pub fn with_causal_lm<V: DecoderVisitor>(path: &Path, v: V) -> Result<V::Output> {
            let bytes = crate::io::files::read_regular(path, "JSON file")?;
            let json: serde_json::Value = crate::io::parse_json(path, &bytes)?;
            let t = declared_model_type(&json).unwrap_or_else(|| "llama".into());
            $(if t == $family.model_type {
                let config = ($family.read_config)(path, &bytes)?;
                return Ok(v.visit(&$family, config));
            })+
            let types: Vec<_> = causal_lms().iter().map(|(t, _)| *t).collect();
            let refused = crate::io::limits::model_type(Some(&t), &types).unwrap_err();
            Err(KilnError::Config(format!("{}: {refused}", path.display())))
        }
    };
}

causal_lm_families! {
    super::llama::FAMILY,
    super::mistral::FAMILY,
    super::qwen2::FAMILY,
}

/// The `model_type`s kiln trains as causal LMs (`--task causal-lm`), for messages:
/// `llama, mistral, qwen2`.
pub fn causal_lm_types() -> String {
    let types: Vec<_> = causal_lms().iter().map(|(t, _)| *t).collect();
    types.join(", ")
}

/// The causal LM's `config.json` at `path`, read as the family it names, which must be built on
/// architecture `A`.
pub fn read_causal_lm_config<A: DecoderArchitecture>(path: &Path) -> Result<A::Config> {
    struct Read<A>(std::marker::PhantomData<A>);
    impl<A: DecoderArchitecture> DecoderVisitor for Read<A> {
        type Output = std::result::Result<A::Config, &'static str>;
        fn visit<F: DecoderArchitecture>(
            self,
            family: &'static DecoderFamily<F>,
            config: F::Config,
        ) -> Self::Output {
            let config: Box<dyn std::any::Any> = Box::new(config);
            config.downcast().map(|c| *c).map_err(|_| family.model_type)
        }
    }
    with_causal_lm(path, Read::<A>(Default::default()))?.map_err(|t| {
        KilnError::Config(format!(
            "{}: model_type {t:?} is not built on {}",
            path.display(),
            std::any::type_name::<A>()
        ))
    })
}

/// Every rank's cut of the parameters `names` of the causal LM whose `config.json` is
/// `config_path`, over `n` tensor-parallel ranks, as its family cuts them in training
/// (`kiln convert --to-tp`; see [`DecoderArchitecture::splits_for`]).
pub fn tensor_parallel_splits(
    config_path: &Path,
    names: &[&str],
    n: usize,
    kv_heads_read: bool,
) -> Result<Vec<BTreeMap<String, ParamSplit>>> {
    struct Splits<'a>(&'a [&'a str], usize, bool);
    impl DecoderVisitor for Splits<'_> {
        type Output = Result<Vec<BTreeMap<String, ParamSplit>>>;
        fn visit<A: DecoderArchitecture>(
            self,
            _: &'static DecoderFamily<A>,
            config: A::Config,
        ) -> Self::Output {
            A::splits_for(&config, self.0, self.1, self.2)
        }
    }
    with_causal_lm(config_path, Splits(names, n, kv_heads_read))?
}

/// The model and config of the causal-LM folder `dir` (whole, on one device), of a family built
/// on architecture `A`.
pub fn load_causal_lm<A: DecoderArchitecture, B: KilnBackend>(
    dir: &Path,
    device: &B::Device,
) -> Result<(A::Model<B>, A::Config)> {
    let config = read_causal_lm_config::<A>(&dir.join("config.json"))?;
    let model = A::load(dir, &config, device, None, &crate::models::params::keep_all)?;
    Ok((model, config))
}

/// A sequence classifier's config, one variant per architecture.
#[derive(Debug, Clone)]
pub enum EncoderConfig {
    /// BERT, and the RoBERTa architecture (RoBERTa, XLM-RoBERTa, CamemBERT), whose config has the
    /// same fields.
    Bert(BertConfig),
    DistilBert(DistilBertConfig),
    ModernBert(ModernBertConfig),
}

/// `model_type` from `config.json`, else guessed from `architectures[0]` (as transformers does for
/// old configs), else `None`.
pub fn declared_model_type(json: &serde_json::Value) -> Option<String> {
    if let Some(t) = json.get("model_type").and_then(|t| t.as_str()) {
        return Some(t.to_string());
    }
    let arch = json.get("architectures")?.get(0)?.as_str()?;
    let encoders = [
        ("XLMRoberta", "xlm-roberta"),
        ("Camembert", "camembert"),
        ("Roberta", "roberta"),
        ("DistilBert", "distilbert"),
        ("ModernBert", "modernbert"),
        ("Bert", "bert"),
    ];
    let decoders = causal_lms().into_iter().map(|(t, prefix)| (prefix, t));
    encoders
        .into_iter()
        .chain(decoders)
        .find(|(prefix, _)| arch.starts_with(prefix))
        .map(|(_, t)| t.to_string())
}

impl EncoderConfig {
    /// Reads `config.json` as the family its `model_type` names (a config with neither
    /// `model_type` nor `architectures` is read as BERT, as kiln always has).
    pub fn from_file(path: &Path) -> Result<Self> {
        let json: serde_json::Value = crate::io::read_json(path)?;
        let t = declared_model_type(&json).unwrap_or_else(|| "bert".into());
        match t.as_str() {
            "bert" | "roberta" | "xlm-roberta" | "camembert" => {
                let mut c = BertConfig::from_file(path)?;
                // A type known from `architectures` only: checked again as that type.
                c.head.model_type = Some(t);
                c.validate()
                    .map_err(|m| KilnError::Config(format!("{}: {m}", path.display())))?;
                Ok(Self::Bert(c))
            }
            "distilbert" => Ok(Self::DistilBert(DistilBertConfig::from_file(path)?)),
            "modernbert" => Ok(Self::ModernBert(ModernBertConfig::from_file(path)?)),
            t if causal_lms().iter().any(|(lm, _)| *lm == t) => Err(KilnError::Config(format!(
                "{}: model_type {t:?} is a causal LM: train it with --task causal-lm \
                 (sequence classification reads {CLASSIFIER_TYPES})",
                path.display()
            ))),
            other => Err(KilnError::Config(format!(
                "{}: model_type {other:?} is not supported; kiln reads {CLASSIFIER_TYPES} \
                 (sequence classification) and {} (causal LM)",
                path.display(),
                causal_lm_types()
            ))),
        }
    }

    /// The `model_type` (`roberta`, `distilbert`, ...).
    pub fn model_type(&self) -> &str {
        match self {
            Self::Bert(c) => c.head.model_type.as_deref().unwrap_or("bert"),
            Self::DistilBert(_) => "distilbert",
            Self::ModernBert(_) => "modernbert",
        }
    }

    /// transformers' class for this family's sequence classifier.
    pub fn architecture(&self) -> &'static str {
        match self.model_type() {
            "roberta" => "RobertaForSequenceClassification",
            "xlm-roberta" => "XLMRobertaForSequenceClassification",
            "camembert" => "CamembertForSequenceClassification",
            "distilbert" => "DistilBertForSequenceClassification",
            "modernbert" => "ModernBertForSequenceClassification",
            _ => "BertForSequenceClassification",
        }
    }

    /// The encoder's prefix in a classifier's parameter names (transformers' `base_model_prefix`),
    /// which a checkpoint of the bare encoder lacks.
    pub fn base_prefix(&self) -> &'static str {
        match self {
            Self::Bert(c) if c.is_roberta() => "roberta",
            Self::Bert(_) => "bert",
            Self::DistilBert(_) => "distilbert",
            Self::ModernBert(_) => "model",
        }
    }

    /// Parameter-name prefixes a pretrained encoder's checkpoint may lack: the classification
    /// head, which is freshly initialised (and BERT's pooler, which transformers initialises too
    /// for encoders saved without it).
    pub fn head_prefixes(&self) -> &'static [&'static str] {
        match self {
            Self::Bert(c) if c.is_roberta() => &["classifier."],
            Self::Bert(_) => &["classifier.", "bert.pooler."],
            Self::DistilBert(_) => &["pre_classifier.", "classifier."],
            Self::ModernBert(_) => &["head.", "classifier."],
        }
    }

    pub fn fields(&self) -> &ClassifierFields {
        match self {
            Self::Bert(c) => &c.head,
            Self::DistilBert(c) => &c.head,
            Self::ModernBert(c) => &c.head,
        }
    }

    fn fields_mut(&mut self) -> &mut ClassifierFields {
        match self {
            Self::Bert(c) => &mut c.head,
            Self::DistilBert(c) => &mut c.head,
            Self::ModernBert(c) => &mut c.head,
        }
    }

    /// Label names in id order, if the config has a complete `id2label`.
    pub fn labels(&self) -> Option<Vec<String>> {
        self.fields().labels()
    }

    /// Records the label set (id order), the architecture and the model type as transformers does.
    pub fn set_labels(&mut self, labels: &[String]) {
        let (arch, t) = (self.architecture(), self.model_type().to_string());
        let f = self.fields_mut();
        f.set_labels(labels, arch);
        f.model_type = Some(t);
    }

    pub fn vocab_size(&self) -> usize {
        match self {
            Self::Bert(c) => c.vocab_size,
            Self::DistilBert(c) => c.vocab_size,
            Self::ModernBert(c) => c.vocab_size,
        }
    }

    /// The longest input the model's positions allow.
    pub fn max_length(&self) -> usize {
        match self {
            Self::Bert(c) => c.max_length(),
            Self::DistilBert(c) => c.max_position_embeddings,
            Self::ModernBert(c) => c.max_position_embeddings,
        }
    }

    /// Token types the model tells apart (a text pair needs 2, unless the model has no token
    /// types at all and separates the pair by its separator token alone).
    pub fn token_types(&self) -> Option<usize> {
        match self {
            Self::Bert(c) if !c.is_roberta() => Some(c.type_vocab_size),
            _ => None,
        }
    }

    /// Parameters of the classifier with `num_labels` classes.
    pub fn param_count(&self, num_labels: usize) -> f64 {
        match self {
            Self::Bert(c) => c.param_count(num_labels),
            Self::DistilBert(c) => c.param_count(num_labels),
            Self::ModernBert(c) => c.param_count(num_labels),
        }
    }

    pub fn to_json(&self) -> String {
        match self {
            Self::Bert(c) => serde_json::to_string_pretty(c),
            Self::DistilBert(c) => serde_json::to_string_pretty(c),
            Self::ModernBert(c) => serde_json::to_string_pretty(c),
        }
        .expect("config serialises")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(json: serde_json::Value) -> Result<EncoderConfig> {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("config.json");
        std::fs::write(&path, json.to_string()).unwrap();
        EncoderConfig::from_file(&path)
    }

    fn small() -> serde_json::Value {
        serde_json::json!({"vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 1,
            "num_attention_heads": 2, "intermediate_size": 16})
    }

    #[test]
    fn the_family_comes_from_model_type_else_architectures() {
        let mut j = small();
        j["architectures"] = serde_json::json!(["XLMRobertaForMaskedLM"]);
        let c = read(j).unwrap();
        assert_eq!(c.model_type(), "xlm-roberta");
        assert_eq!(c.base_prefix(), "roberta");
        assert_eq!(c.architecture(), "XLMRobertaForSequenceClassification");
        // Neither: BERT, as kiln always read such folders.
        assert_eq!(read(small()).unwrap().model_type(), "bert");
    }

    #[test]
    fn roberta_positions_need_rows_after_the_padding_id() {
        let mut j = small();
        j["architectures"] = serde_json::json!(["RobertaForSequenceClassification"]);
        j["max_position_embeddings"] = 2.into();
        let e = read(j).unwrap_err().to_string();
        assert!(
            e.contains("leaves no positions after pad_token_id 1"),
            "{e}"
        );
    }

    #[test]
    fn other_model_types_are_one_sentence_naming_the_supported_ones() {
        let mut j = small();
        j["model_type"] = "gpt2".into();
        let e = read(j).unwrap_err().to_string();
        assert!(
            e.contains("model_type \"gpt2\" is not supported; kiln reads bert, roberta")
                && e.contains("llama, mistral, qwen2 (causal LM)"),
            "{e}"
        );
        let mut j = small();
        j["model_type"] = "mistral".into();
        let e = read(j).unwrap_err().to_string();
        assert!(
            e.contains("is a causal LM: train it with --task causal-lm"),
            "{e}"
        );
    }
}
