//! `BertForSequenceClassification`, following transformers' `modeling_bert.py` module for module, with
//! the same parameter names (`bert.embeddings.*`, `bert.encoder.layer.N.*`, `bert.pooler.*`,
//! `classifier.*`) so checkpoints move between kiln and transformers unchanged.
// `LayerNorm` fields carry Hugging Face's parameter name; the derive re-emits it in generated code.
#![allow(non_snake_case)]

use burn::module::Module;
use burn::tensor::{backend::Backend, Int, Tensor};

use super::layers::{Embedding, LayerNorm, Linear};
use crate::data::batch::TextBatch;
use crate::hub::config::BertConfig;
use crate::ops::{attention, dropout, gelu, KilnBackend};
use crate::train::task::Classifier;

/// One tokenized, padded batch. Masks are 1 for real tokens and 0 for padding.
#[derive(Debug, Clone)]
pub struct BertInput<B: Backend> {
    pub input_ids: Tensor<B, 2, Int>,
    pub attention_mask: Tensor<B, 2, Int>,
    pub token_type_ids: Tensor<B, 2, Int>,
}

impl<B: Backend> BertInput<B> {
    pub fn from_batch(b: &TextBatch, device: &B::Device) -> Self {
        let t = |v: &Vec<i64>| {
            Tensor::<B, 2, Int>::from_data(
                burn::tensor::TensorData::new(v.clone(), [b.batch, b.seq]),
                device,
            )
        };
        Self {
            input_ids: t(&b.input_ids),
            attention_mask: t(&b.attention_mask),
            token_type_ids: t(&b.token_type_ids),
        }
    }
}

#[derive(Module, Debug)]
pub struct BertEmbeddings<B: Backend> {
    pub word_embeddings: Embedding<B>,
    pub position_embeddings: Embedding<B>,
    pub token_type_embeddings: Embedding<B>,
    pub LayerNorm: LayerNorm<B>,
    pub dropout: f64,
}

impl<B: KilnBackend> BertEmbeddings<B> {
    fn new(c: &BertConfig, device: &B::Device) -> Self {
        let std = c.initializer_range;
        Self {
            word_embeddings: Embedding::new(c.vocab_size, c.hidden_size, std, device),
            position_embeddings: Embedding::new(
                c.max_position_embeddings,
                c.hidden_size,
                std,
                device,
            ),
            token_type_embeddings: Embedding::new(c.type_vocab_size, c.hidden_size, std, device),
            LayerNorm: LayerNorm::new(c.hidden_size, c.layer_norm_eps, device),
            dropout: c.hidden_dropout_prob,
        }
    }

    fn forward(&self, input: &BertInput<B>) -> Tensor<B, 3> {
        let [b, t] = input.input_ids.dims();
        let device = input.input_ids.device();
        let positions = Tensor::<B, 1, Int>::arange(0..t as i64, &device)
            .unsqueeze::<2>()
            .expand([b, t]);
        let x = self.word_embeddings.forward(input.input_ids.clone())
            + self.position_embeddings.forward(positions)
            + self
                .token_type_embeddings
                .forward(input.token_type_ids.clone());
        dropout(self.LayerNorm.forward(x), self.dropout)
    }
}

#[derive(Module, Debug)]
pub struct BertSelfAttention<B: Backend> {
    pub query: Linear<B>,
    pub key: Linear<B>,
    pub value: Linear<B>,
    pub num_heads: usize,
    pub dropout: f64,
}

#[derive(Module, Debug)]
pub struct BertSelfOutput<B: Backend> {
    pub dense: Linear<B>,
    pub LayerNorm: LayerNorm<B>,
    pub dropout: f64,
}

#[derive(Module, Debug)]
pub struct BertAttention<B: Backend> {
    /// `self` in Hugging Face names (a Rust keyword: a trailing `_` is dropped from parameter paths).
    pub self_: BertSelfAttention<B>,
    pub output: BertSelfOutput<B>,
}

#[derive(Module, Debug)]
pub struct BertIntermediate<B: Backend> {
    pub dense: Linear<B>,
}

#[derive(Module, Debug)]
pub struct BertOutput<B: Backend> {
    pub dense: Linear<B>,
    pub LayerNorm: LayerNorm<B>,
    pub dropout: f64,
}

#[derive(Module, Debug)]
pub struct BertLayer<B: Backend> {
    pub attention: BertAttention<B>,
    pub intermediate: BertIntermediate<B>,
    pub output: BertOutput<B>,
}

#[derive(Module, Debug)]
pub struct BertEncoder<B: Backend> {
    pub layer: Vec<BertLayer<B>>,
}

#[derive(Module, Debug)]
pub struct BertPooler<B: Backend> {
    pub dense: Linear<B>,
}

#[derive(Module, Debug)]
pub struct BertModel<B: Backend> {
    pub embeddings: BertEmbeddings<B>,
    pub encoder: BertEncoder<B>,
    pub pooler: BertPooler<B>,
}

#[derive(Module, Debug)]
pub struct BertForSequenceClassification<B: Backend> {
    pub bert: BertModel<B>,
    pub classifier: Linear<B>,
    pub classifier_dropout: f64,
}

impl<B: KilnBackend> BertSelfAttention<B> {
    /// `x [B, T, H]`, `mask_bias [B, T]` (0 for tokens, the most negative float for padding).
    fn forward(&self, x: Tensor<B, 3>, mask_bias: Tensor<B, 2>) -> Tensor<B, 3> {
        let q = self.query.forward(x.clone());
        let k = self.key.forward(x.clone());
        let v = self.value.forward(x);
        attention(q, k, v, mask_bias, self.num_heads, self.dropout)
    }
}

impl<B: KilnBackend> BertLayer<B> {
    fn new(c: &BertConfig, device: &B::Device) -> Self {
        let (h, i, std) = (c.hidden_size, c.intermediate_size, c.initializer_range);
        Self {
            attention: BertAttention {
                self_: BertSelfAttention {
                    query: Linear::new(h, h, true, std, device),
                    key: Linear::new(h, h, true, std, device),
                    value: Linear::new(h, h, true, std, device),
                    num_heads: c.num_attention_heads,
                    dropout: c.attention_probs_dropout_prob,
                },
                output: BertSelfOutput {
                    dense: Linear::new(h, h, true, std, device),
                    LayerNorm: LayerNorm::new(h, c.layer_norm_eps, device),
                    dropout: c.hidden_dropout_prob,
                },
            },
            intermediate: BertIntermediate {
                dense: Linear::new(h, i, true, std, device),
            },
            output: BertOutput {
                dense: Linear::new(i, h, true, std, device),
                LayerNorm: LayerNorm::new(h, c.layer_norm_eps, device),
                dropout: c.hidden_dropout_prob,
            },
        }
    }

    fn forward(&self, x: Tensor<B, 3>, mask_bias: Tensor<B, 2>) -> Tensor<B, 3> {
        let att = &self.attention;
        let a = att.self_.forward(x.clone(), mask_bias);
        let x = att.output.LayerNorm.forward_residual(
            att.output.dense.forward(a),
            x,
            att.output.dropout,
        );
        let i = gelu(self.intermediate.dense.forward(x.clone()));
        self.output
            .LayerNorm
            .forward_residual(self.output.dense.forward(i), x, self.output.dropout)
    }
}

impl<B: KilnBackend> BertForSequenceClassification<B> {
    /// A model with every weight freshly initialised (transformers' `_init_weights` scheme).
    pub fn new(c: &BertConfig, num_labels: usize, device: &B::Device) -> Self {
        let std = c.initializer_range;
        Self {
            bert: BertModel {
                embeddings: BertEmbeddings::new(c, device),
                encoder: BertEncoder {
                    layer: (0..c.num_hidden_layers)
                        .map(|_| BertLayer::new(c, device))
                        .collect(),
                },
                pooler: BertPooler {
                    dense: Linear::new(c.hidden_size, c.hidden_size, true, std, device),
                },
            },
            classifier: Linear::new(c.hidden_size, num_labels, true, std, device),
            classifier_dropout: c.classifier_dropout_prob(),
        }
    }

    pub fn num_labels(&self) -> usize {
        self.classifier.weight.dims()[0]
    }

    /// Logits `[B, num_labels]`.
    pub fn forward(&self, input: &BertInput<B>) -> Tensor<B, 2> {
        let b = input.input_ids.dims()[0];
        // Additive mask: 0 where attended, the most negative float where padded (as transformers).
        let mask_bias = (input.attention_mask.clone().float().neg() + 1.0).mul_scalar(f32::MIN);
        let mut x = self.bert.embeddings.forward(input);
        for layer in &self.bert.encoder.layer {
            x = layer.forward(x, mask_bias.clone());
        }
        let h = x.dims()[2];
        let cls = x.slice([0..b, 0..1, 0..h]).reshape([b, h]);
        let pooled = self.bert.pooler.dense.forward(cls).tanh();
        self.classifier
            .forward(dropout(pooled, self.classifier_dropout))
    }
}

impl<B: KilnBackend> Classifier<B> for BertForSequenceClassification<B> {
    type Batch = TextBatch;

    fn logits(&self, batch: &TextBatch) -> Tensor<B, 2> {
        let device = self.classifier.weight.device();
        self.forward(&BertInput::from_batch(batch, &device))
    }
}
