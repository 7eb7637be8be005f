//! `DistilBertForSequenceClassification`, following transformers' `modeling_distilbert.py` with its
//! parameter names (`distilbert.embeddings.*`, `distilbert.transformer.layer.N.attention.{q,k,v,
//! out}_lin`, `sa_layer_norm`, `ffn.lin1/lin2`, `output_layer_norm`, `pre_classifier`,
//! `classifier`): BERT's post-norm layers without token types or a pooler, and a head
//! `pre_classifier` → ReLU → `classifier` on the first token.
#![allow(non_snake_case)]

use burn::module::Module;
use burn::tensor::activation::relu;
use burn::tensor::{backend::Backend, Int, Tensor};

use crate::data::batch::TextBatch;
use crate::models::bert::self_attention;
use crate::models::distilbert::config::DistilBertConfig;
use crate::models::encoder::EncoderClassifier;
use crate::models::encoder::{first_tokens, mask_bias, BertInput, Unpadded};
use crate::models::layers::{Embedding, LayerNorm, Linear};
use crate::ops::{dropout, gelu, KilnBackend};

/// DistilBERT's LayerNorm epsilon (fixed in transformers, not in the config).
const LN_EPS: f64 = 1e-12;

#[derive(Module, Debug)]
pub struct DistilBertEmbeddings<B: Backend> {
    pub word_embeddings: Embedding<B>,
    pub position_embeddings: Embedding<B>,
    pub LayerNorm: LayerNorm<B>,
    pub dropout: f64,
}

#[derive(Module, Debug)]
pub struct DistilBertAttention<B: Backend> {
    pub q_lin: Linear<B>,
    pub k_lin: Linear<B>,
    pub v_lin: Linear<B>,
    pub out_lin: Linear<B>,
    pub n_heads: usize,
    pub dropout: f64,
}

#[derive(Module, Debug)]
pub struct DistilBertFfn<B: Backend> {
    pub lin1: Linear<B>,
    pub lin2: Linear<B>,
    pub relu: bool,
    pub dropout: f64,
}

#[derive(Module, Debug)]
pub struct TransformerBlock<B: Backend> {
    pub attention: DistilBertAttention<B>,
    pub sa_layer_norm: LayerNorm<B>,
    pub ffn: DistilBertFfn<B>,
    pub output_layer_norm: LayerNorm<B>,
}

#[derive(Module, Debug)]
pub struct DistilBertTransformer<B: Backend> {
    pub layer: Vec<TransformerBlock<B>>,
}

#[derive(Module, Debug)]
pub struct DistilBertModel<B: Backend> {
    pub embeddings: DistilBertEmbeddings<B>,
    pub transformer: DistilBertTransformer<B>,
}

#[derive(Module, Debug)]
pub struct DistilBertForSequenceClassification<B: Backend> {
    pub distilbert: DistilBertModel<B>,
    pub pre_classifier: Linear<B>,
    pub classifier: Linear<B>,
    pub seq_classif_dropout: f64,
}

impl<B: KilnBackend> TransformerBlock<B> {
    fn new(c: &DistilBertConfig, device: &B::Device) -> Self {
        let (h, i, std) = (c.dim, c.hidden_dim, c.initializer_range);
        let lin = |a, b| Linear::new(a, b, true, std, device);
        Self {
            attention: DistilBertAttention {
                q_lin: lin(h, h),
                k_lin: lin(h, h),
                v_lin: lin(h, h),
                out_lin: lin(h, h),
                n_heads: c.n_heads,
                dropout: c.attention_dropout,
            },
            sa_layer_norm: LayerNorm::new(h, LN_EPS, device),
            ffn: DistilBertFfn {
                lin1: lin(h, i),
                lin2: lin(i, h),
                relu: c.activation == "relu",
                dropout: c.dropout,
            },
            output_layer_norm: LayerNorm::new(h, LN_EPS, device),
        }
    }

    fn forward(
        &self,
        x: Tensor<B, 3>,
        mask_bias: Tensor<B, 2>,
        unpadded: Option<&Unpadded<B>>,
    ) -> Tensor<B, 3> {
        let a = &self.attention;
        let context = self_attention(
            [&a.q_lin, &a.k_lin, &a.v_lin],
            x.clone(),
            mask_bias,
            a.n_heads,
            a.dropout,
            unpadded,
        );
        // No dropout on the attention output in DistilBERT (only on its probabilities).
        let x = self
            .sa_layer_norm
            .forward_residual(a.out_lin.forward(context), x, 0.0);
        let hidden = self.ffn.lin1.forward(x.clone());
        let hidden = if self.ffn.relu {
            relu(hidden)
        } else {
            gelu(hidden)
        };
        self.output_layer_norm
            .forward_residual(self.ffn.lin2.forward(hidden), x, self.ffn.dropout)
    }
}

impl<B: Backend> DistilBertForSequenceClassification<B> {
    pub(crate) fn linears_mut(&mut self) -> Vec<(String, &mut Linear<B>)> {
        let mut out = Vec::new();
        for (i, l) in self.distilbert.transformer.layer.iter_mut().enumerate() {
            let a = &mut l.attention;
            for (name, layer) in [
                ("attention.q_lin", &mut a.q_lin),
                ("attention.k_lin", &mut a.k_lin),
                ("attention.v_lin", &mut a.v_lin),
                ("attention.out_lin", &mut a.out_lin),
                ("ffn.lin1", &mut l.ffn.lin1),
                ("ffn.lin2", &mut l.ffn.lin2),
            ] {
                out.push((format!("distilbert.transformer.layer.{i}.{name}"), layer));
            }
        }
        out.push(("pre_classifier".into(), &mut self.pre_classifier));
        out.push(("classifier".into(), &mut self.classifier));
        out
    }
}

impl<B: KilnBackend> DistilBertForSequenceClassification<B> {
    /// A model with every weight freshly initialised (transformers' `_init_weights` scheme).
    pub fn new(c: &DistilBertConfig, num_labels: usize, device: &B::Device) -> Self {
        let (h, std) = (c.dim, c.initializer_range);
        Self {
            distilbert: DistilBertModel {
                embeddings: DistilBertEmbeddings {
                    word_embeddings: Embedding::new(c.vocab_size, h, std, device),
                    position_embeddings: Embedding::new(c.max_position_embeddings, h, std, device),
                    LayerNorm: LayerNorm::new(h, LN_EPS, device),
                    dropout: c.dropout,
                },
                transformer: DistilBertTransformer {
                    layer: (0..c.n_layers)
                        .map(|_| TransformerBlock::new(c, device))
                        .collect(),
                },
            },
            pre_classifier: Linear::new(h, h, true, std, device),
            classifier: Linear::new(h, num_labels, true, std, device),
            seq_classif_dropout: c.seq_classif_dropout,
        }
    }
}

impl<B: KilnBackend> EncoderClassifier<B> for DistilBertForSequenceClassification<B> {
    fn num_labels(&self) -> usize {
        self.classifier.weight.dims()[0]
    }

    fn input(&self, batch: &TextBatch) -> BertInput<B> {
        BertInput::from_batch(batch, &self.classifier.weight.device())
    }

    fn embed(&self, input: &BertInput<B>) -> Tensor<B, 3> {
        let e = &self.distilbert.embeddings;
        let [b, t] = input.input_ids.dims();
        let positions = Tensor::<B, 1, Int>::arange(0..t as i64, &input.input_ids.device())
            .unsqueeze::<2>()
            .expand([b, t]);
        let x = e.word_embeddings.forward(input.input_ids.clone())
            + e.position_embeddings.forward(positions);
        let x = dropout(e.LayerNorm.forward(x), e.dropout);
        match &input.unpadded {
            Some(u) => u.pack(x),
            None => x,
        }
    }

    fn num_layers(&self) -> usize {
        self.distilbert.transformer.layer.len()
    }

    fn layer(&self, i: usize, x: Tensor<B, 3>, input: &BertInput<B>) -> Tensor<B, 3> {
        self.distilbert.transformer.layer[i].forward(x, mask_bias(input), input.unpadded.as_ref())
    }

    fn head(&self, x: Tensor<B, 3>, input: &BertInput<B>) -> Tensor<B, 2> {
        let pooled = relu(self.pre_classifier.forward(first_tokens(x, input)));
        self.classifier
            .forward(dropout(pooled, self.seq_classif_dropout))
    }

    fn embedding_parameters(&self) -> Vec<String> {
        ["word", "position"]
            .map(|e| format!("distilbert.embeddings.{e}_embeddings.weight"))
            .into()
    }
}

crate::models::encoder::encoder_model!(DistilBertForSequenceClassification);
