//! A sequence classifier of whichever encoder family a folder holds, like transformers'
//! `AutoModelForSequenceClassification`: one type for the trainer, the family's own parameter
//! names inside (an enum variant adds nothing to a parameter's path).

use burn::module::Module;
use burn::tensor::{backend::Backend, Tensor};

use super::bert::{BertForSequenceClassification, BertInput};
use super::distilbert::DistilBertForSequenceClassification;
use super::modernbert::ModernBertForSequenceClassification;
use super::roberta::RobertaForSequenceClassification;
use crate::data::batch::TextBatch;
use crate::hub::encoder_config::EncoderConfig;
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

/// An encoder with a classification head, as a chain of segments: batch → input tensors →
/// embeddings → layers → head. Each family implements this; [`encoder_model!`] derives kiln's
/// `Model` and `Segments` from it (activation checkpointing recomputes the segments one at a
/// time; each call rebuilds the batch's small index tensors, which keeps them stateless).
pub trait EncoderClassifier<B: KilnBackend> {
    fn num_labels(&self) -> usize;
    /// The batch as tensors (positions, the unpadded layout of a right-padded batch).
    fn input(&self, batch: &TextBatch) -> BertInput<B>;
    /// The embeddings' output, packed to the real tokens when the batch is right-padded.
    fn embed(&self, input: &BertInput<B>) -> Tensor<B, 3>;
    fn num_layers(&self) -> usize;
    /// Encoder layer `i` (0-based).
    fn layer(&self, i: usize, x: Tensor<B, 3>, input: &BertInput<B>) -> Tensor<B, 3>;
    /// The last layer's output → logits `[B, num_labels]`.
    fn head(&self, x: Tensor<B, 3>, input: &BertInput<B>) -> Tensor<B, 2>;
    /// The embedding tables, which `total_flos` leaves out.
    fn embedding_parameters(&self) -> Vec<String>;

    /// Logits `[B, num_labels]`: the segments one after the other.
    fn forward(&self, input: &BertInput<B>) -> Tensor<B, 2> {
        let mut x = self.embed(input);
        for i in 0..self.num_layers() {
            x = self.layer(i, x, input);
        }
        self.head(x, input)
    }
}

/// kiln's `Model` and `Segments` for a type that is an [`EncoderClassifier`].
macro_rules! encoder_model {
    ($ty:ident) => {
        impl<B: $crate::ops::KilnBackend> $crate::task::Segments<B, $crate::data::batch::TextBatch>
            for $ty<B>
        {
            fn num_layers(&self) -> usize {
                $crate::models::classifier::EncoderClassifier::num_layers(self)
            }

            fn embed(&self, batch: &$crate::data::batch::TextBatch) -> burn::tensor::Tensor<B, 3> {
                use $crate::models::classifier::EncoderClassifier as E;
                E::embed(self, &E::input(self, batch))
            }

            fn layer(
                &self,
                i: usize,
                x: burn::tensor::Tensor<B, 3>,
                batch: &$crate::data::batch::TextBatch,
            ) -> burn::tensor::Tensor<B, 3> {
                use $crate::models::classifier::EncoderClassifier as E;
                E::layer(self, i, x, &E::input(self, batch))
            }

            fn head(
                &self,
                h: burn::tensor::Tensor<B, 3>,
                batch: &$crate::data::batch::TextBatch,
            ) -> burn::tensor::Tensor<B, 2> {
                use $crate::models::classifier::EncoderClassifier as E;
                E::head(self, h, &E::input(self, batch))
            }
        }

        impl<B: $crate::ops::KilnBackend> $crate::task::Model<B> for $ty<B> {
            type Batch = $crate::data::batch::TextBatch;

            fn logits(&self, batch: &Self::Batch) -> burn::tensor::Tensor<B, 2> {
                use $crate::models::classifier::EncoderClassifier as E;
                E::forward(self, &E::input(self, batch))
            }

            fn segments(&self) -> Option<&dyn $crate::task::Segments<B, Self::Batch>> {
                Some(self)
            }

            fn input_ids_numel(&self, batch: &Self::Batch) -> usize {
                batch.batch * batch.seq
            }

            fn embedding_parameters(&self) -> Vec<String> {
                $crate::models::classifier::EncoderClassifier::embedding_parameters(self)
            }
        }
    };
}
pub(crate) use encoder_model;

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
