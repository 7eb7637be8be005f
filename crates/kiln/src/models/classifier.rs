//! A sequence classifier of whichever encoder family a folder holds, like transformers'
//! `AutoModelForSequenceClassification`: one type for the trainer, the family's own parameter
//! names inside (an enum variant adds nothing to a parameter's path).

use burn::module::Module;
use burn::tensor::{backend::Backend, Tensor};

use super::bert::BertForSequenceClassification;
use super::distilbert::DistilBertForSequenceClassification;
use super::encoder::{encoder_model, BertInput, EncoderClassifier};
use super::modernbert::ModernBertForSequenceClassification;
use super::roberta::RobertaForSequenceClassification;
use crate::data::batch::TextBatch;
use crate::models::auto::EncoderConfig;
use crate::ops::KilnBackend;

#[derive(Module, Debug)]
pub enum SequenceClassifier<B: Backend> {
    Bert(BertForSequenceClassification<B>),
    Roberta(RobertaForSequenceClassification<B>),
    DistilBert(DistilBertForSequenceClassification<B>),
    ModernBert(ModernBertForSequenceClassification<B>),
}

/// `$body` with `$m` bound to the variant's model, whichever it is.
macro_rules! each {
    ($self:expr, $m:ident => $body:expr) => {
        match $self {
            SequenceClassifier::Bert($m) => $body,
            SequenceClassifier::Roberta($m) => $body,
            SequenceClassifier::DistilBert($m) => $body,
            SequenceClassifier::ModernBert($m) => $body,
        }
    };
}

impl<B: Backend> crate::models::lora::LoraTarget<B> for SequenceClassifier<B> {
    fn linears_mut(&mut self) -> Vec<(String, &mut crate::models::layers::Linear<B>)> {
        each!(self, m => m.linears_mut())
    }

    /// The classification head's last layer(s), which `modules_to_save` trains whole.
    fn output_layers(&self) -> Vec<String> {
        match self {
            Self::Roberta(_) => vec!["classifier.dense".into(), "classifier.out_proj".into()],
            _ => vec!["classifier".into()],
        }
    }

    fn default_target_modules(&self) -> &'static [&'static str] {
        match self {
            Self::Bert(_) | Self::Roberta(_) => &["query", "value"],
            Self::DistilBert(_) => &["q_lin", "v_lin"],
            Self::ModernBert(_) => &["Wqkv"],
        }
    }

    fn peft_task_type(&self) -> &'static str {
        "SEQ_CLS"
    }

    fn task_modules_to_save(&self) -> Vec<String> {
        vec!["classifier".into(), "score".into()]
    }
}

impl<B: KilnBackend> SequenceClassifier<B> {
    /// A freshly initialised classifier of `config`'s family with `num_labels` classes.
    pub fn new(config: &EncoderConfig, num_labels: usize, device: &B::Device) -> Self {
        match config {
            EncoderConfig::Bert(c) if c.is_roberta() => {
                Self::Roberta(RobertaForSequenceClassification::new(c, num_labels, device))
            }
            EncoderConfig::Bert(c) => {
                Self::Bert(BertForSequenceClassification::new(c, num_labels, device))
            }
            EncoderConfig::DistilBert(c) => Self::DistilBert(
                DistilBertForSequenceClassification::new(c, num_labels, device),
            ),
            EncoderConfig::ModernBert(c) => Self::ModernBert(
                ModernBertForSequenceClassification::new(c, num_labels, device),
            ),
        }
    }
}

impl<B: KilnBackend> EncoderClassifier<B> for SequenceClassifier<B> {
    fn num_labels(&self) -> usize {
        each!(self, m => m.num_labels())
    }

    fn input(&self, batch: &TextBatch) -> BertInput<B> {
        each!(self, m => m.input(batch))
    }

    fn embed(&self, input: &BertInput<B>) -> Tensor<B, 3> {
        each!(self, m => m.embed(input))
    }

    fn num_layers(&self) -> usize {
        each!(self, m => EncoderClassifier::num_layers(m))
    }

    fn layer(&self, i: usize, x: Tensor<B, 3>, input: &BertInput<B>) -> Tensor<B, 3> {
        each!(self, m => m.layer(i, x, input))
    }

    fn head(&self, x: Tensor<B, 3>, input: &BertInput<B>) -> Tensor<B, 2> {
        each!(self, m => m.head(x, input))
    }

    fn embedding_parameters(&self) -> Vec<String> {
        each!(self, m => EncoderClassifier::embedding_parameters(m))
    }
}

encoder_model!(SequenceClassifier);
