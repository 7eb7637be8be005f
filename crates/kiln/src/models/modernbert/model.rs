//! `ModernBertForSequenceClassification`, following transformers' `modeling_modernbert.py` with its
//! parameter names (`model.embeddings.{tok_embeddings,norm}`, `model.layers.N.{attn_norm,attn.Wqkv,
//! attn.Wo,mlp_norm,mlp.Wi,mlp.Wo}`, `model.final_norm`, `head.{dense,norm}`, `classifier`):
//! pre-norm layers without biases, rotary positions with one base for global layers and another
//! for sliding-window layers (a token sees `local_attention / 2` neighbours on each side), a GeGLU
//! MLP, and a head on the first token or the mean of the real tokens.
#![allow(non_snake_case)]

use burn::module::{Ignored, Module};
use burn::tensor::{backend::Backend, Tensor};

use crate::data::batch::TextBatch;
use crate::models::encoder::EncoderClassifier;
use crate::models::encoder::{first_tokens, mask_bias, BertInput, Unpadded};
use crate::models::layers::{inv_freq, rope_tables, Embedding, LayerNorm, Linear};
use crate::models::modernbert::config::ModernBertConfig;
use crate::ops::{self, dropout, gelu, KilnBackend, Window};

#[derive(Module, Debug)]
pub struct ModernBertEmbeddings<B: Backend> {
    pub tok_embeddings: Embedding<B>,
    pub norm: LayerNorm<B>,
    pub dropout: f64,
}

#[derive(Module, Debug)]
pub struct ModernBertAttention<B: Backend> {
    pub Wqkv: Linear<B>,
    pub Wo: Linear<B>,
    pub num_heads: usize,
    pub dropout: f64,
    /// Keys seen on each side in a sliding layer; `None` in a global one.
    pub half_window: Option<usize>,
    pub inv_freq: Ignored<Vec<f32>>,
}

#[derive(Module, Debug)]
pub struct ModernBertMlp<B: Backend> {
    pub Wi: Linear<B>,
    pub Wo: Linear<B>,
    pub dropout: f64,
}

#[derive(Module, Debug)]
pub struct ModernBertEncoderLayer<B: Backend> {
    /// `None` in layer 0, whose input is already the normalised embeddings (`nn.Identity`).
    pub attn_norm: Option<LayerNorm<B>>,
    pub attn: ModernBertAttention<B>,
    pub mlp_norm: LayerNorm<B>,
    pub mlp: ModernBertMlp<B>,
}

#[derive(Module, Debug)]
pub struct ModernBertModel<B: Backend> {
    pub embeddings: ModernBertEmbeddings<B>,
    pub layers: Vec<ModernBertEncoderLayer<B>>,
    pub final_norm: LayerNorm<B>,
}

#[derive(Module, Debug)]
pub struct ModernBertPredictionHead<B: Backend> {
    pub dense: Linear<B>,
    pub norm: LayerNorm<B>,
}

#[derive(Module, Debug)]
pub struct ModernBertForSequenceClassification<B: Backend> {
    pub model: ModernBertModel<B>,
    pub head: ModernBertPredictionHead<B>,
    pub classifier: Linear<B>,
    pub classifier_dropout: f64,
    /// Pool the mean of the real tokens (`classifier_pooling: "mean"`) instead of the first.
    pub mean_pooling: bool,
}

fn norm<B: KilnBackend>(c: &ModernBertConfig, device: &B::Device) -> LayerNorm<B> {
    if c.norm_bias {
        LayerNorm::new(c.hidden_size, c.norm_eps, device)
    } else {
        LayerNorm::without_bias(c.hidden_size, c.norm_eps, device)
    }
}

impl<B: KilnBackend> ModernBertAttention<B> {
    /// `x [B, T, H]` (packed `[1, N, H]` with `unpadded`) → the attention output before `Wo`.
    fn forward(
        &self,
        x: Tensor<B, 3>,
        mask_bias: Tensor<B, 2>,
        unpadded: Option<&Unpadded<B>>,
    ) -> Tensor<B, 3> {
        let qkv = self.Wqkv.forward(x);
        // Rotary positions count within each sequence: attention runs in the padded layout.
        let qkv = match unpadded {
            Some(u) => u.unpack(qkv),
            None => qkv,
        };
        let [b, t, h3] = qkv.dims();
        let h = h3 / 3;
        let (nh, hd) = (self.num_heads, h / self.num_heads);
        let (cos, sin) = rope_tables::<B>(&self.inv_freq, 0, t, &qkv.device());
        let part = |i: usize| qkv.clone().narrow(2, i * h, h);
        let rotate =
            |x: Tensor<B, 3>| ops::rope(x.reshape([b, t, nh, hd]), &cos, &sin).reshape([b, t, h]);
        let (q, k, v) = (rotate(part(0)), rotate(part(1)), part(2));
        let out = match self.half_window {
            None => ops::attention(q, k, v, mask_bias, nh, self.dropout),
            Some(w) => ops::windowed_attention(
                q,
                k,
                v,
                mask_bias,
                nh,
                Window {
                    before: w,
                    after: w,
                },
                self.dropout,
            ),
        };
        match unpadded {
            Some(u) => u.pack(out),
            None => out,
        }
    }
}

impl<B: KilnBackend> ModernBertEncoderLayer<B> {
    fn new(c: &ModernBertConfig, i: usize, device: &B::Device) -> Self {
        let (h, inter) = (c.hidden_size, c.intermediate_size);
        // transformers' init: "in" projections N(0, σ), "out" ones N(0, σ/√(2·layers)).
        let std_in = c.initializer_range;
        let std_out = c.initializer_range / (2.0 * c.num_hidden_layers as f64).sqrt();
        let sliding = c.is_sliding(i);
        Self {
            attn_norm: (i > 0).then(|| norm(c, device)),
            attn: ModernBertAttention {
                Wqkv: Linear::new(h, 3 * h, c.attention_bias, std_in, device),
                Wo: Linear::new(h, h, c.attention_bias, std_out, device),
                num_heads: c.num_attention_heads,
                dropout: c.attention_dropout,
                half_window: sliding.then(|| c.half_window()),
                inv_freq: Ignored(inv_freq(c.rope_theta(sliding), c.head_dim())),
            },
            mlp_norm: norm(c, device),
            mlp: ModernBertMlp {
                Wi: Linear::new(h, 2 * inter, c.mlp_bias, std_in, device),
                Wo: Linear::new(inter, h, c.mlp_bias, std_out, device),
                dropout: c.mlp_dropout,
            },
        }
    }

    fn forward(
        &self,
        x: Tensor<B, 3>,
        mask_bias: Tensor<B, 2>,
        unpadded: Option<&Unpadded<B>>,
    ) -> Tensor<B, 3> {
        let normed = match &self.attn_norm {
            Some(n) => n.forward(x.clone()),
            None => x.clone(),
        };
        let a = self.attn.forward(normed, mask_bias, unpadded);
        let x = x + dropout(self.attn.Wo.forward(a), self.attn.dropout);
        let wi = self.mlp.Wi.forward(self.mlp_norm.forward(x.clone()));
        let inter = wi.dims()[2] / 2;
        // GeGLU: the first half through GELU gates the second.
        let gated = gelu(wi.clone().narrow(2, 0, inter)) * wi.narrow(2, inter, inter);
        x + self.mlp.Wo.forward(dropout(gated, self.mlp.dropout))
    }
}

impl<B: Backend> ModernBertForSequenceClassification<B> {
    pub(crate) fn linears_mut(&mut self) -> Vec<(String, &mut Linear<B>)> {
        let mut out = Vec::new();
        for (i, l) in self.model.layers.iter_mut().enumerate() {
            for (name, layer) in [
                ("attn.Wqkv", &mut l.attn.Wqkv),
                ("attn.Wo", &mut l.attn.Wo),
                ("mlp.Wi", &mut l.mlp.Wi),
                ("mlp.Wo", &mut l.mlp.Wo),
            ] {
                out.push((format!("model.layers.{i}.{name}"), layer));
            }
        }
        out.push(("head.dense".into(), &mut self.head.dense));
        out.push(("classifier".into(), &mut self.classifier));
        out
    }
}

impl<B: KilnBackend> ModernBertForSequenceClassification<B> {
    /// A model with every weight freshly initialised (transformers' scheme, with normal instead
    /// of truncated-normal draws).
    pub fn new(c: &ModernBertConfig, num_labels: usize, device: &B::Device) -> Self {
        let (h, std) = (c.hidden_size, c.initializer_range);
        let std_out = std / (2.0 * c.num_hidden_layers as f64).sqrt();
        Self {
            model: ModernBertModel {
                embeddings: ModernBertEmbeddings {
                    tok_embeddings: Embedding::new(c.vocab_size, h, std, device),
                    norm: norm(c, device),
                    dropout: c.embedding_dropout,
                },
                layers: (0..c.num_hidden_layers)
                    .map(|i| ModernBertEncoderLayer::new(c, i, device))
                    .collect(),
                final_norm: norm(c, device),
            },
            head: ModernBertPredictionHead {
                dense: Linear::new(h, h, c.classifier_bias, std_out, device),
                norm: norm(c, device),
            },
            classifier: Linear::new(h, num_labels, true, (h as f64).powf(-0.5), device),
            classifier_dropout: c.classifier_dropout,
            mean_pooling: c.classifier_pooling == "mean",
        }
    }
}

impl<B: KilnBackend> EncoderClassifier<B> for ModernBertForSequenceClassification<B> {
    fn num_labels(&self) -> usize {
        self.classifier.weight.dims()[0]
    }

    fn input(&self, batch: &TextBatch) -> BertInput<B> {
        BertInput::from_batch(batch, &self.classifier.weight.device())
    }

    fn embed(&self, input: &BertInput<B>) -> Tensor<B, 3> {
        let e = &self.model.embeddings;
        let x = dropout(
            e.norm
                .forward(e.tok_embeddings.forward(input.input_ids.clone())),
            e.dropout,
        );
        match &input.unpadded {
            Some(u) => u.pack(x),
            None => x,
        }
    }

    fn num_layers(&self) -> usize {
        self.model.layers.len()
    }

    fn layer(&self, i: usize, x: Tensor<B, 3>, input: &BertInput<B>) -> Tensor<B, 3> {
        self.model.layers[i].forward(x, mask_bias(input), input.unpadded.as_ref())
    }

    /// The last layer's output → final norm → pooling → head → classifier.
    fn head(&self, x: Tensor<B, 3>, input: &BertInput<B>) -> Tensor<B, 2> {
        let x = self.model.final_norm.forward(x);
        let pooled = if self.mean_pooling {
            let x = match &input.unpadded {
                Some(u) => u.unpack(x),
                None => x,
            };
            let [b, t, _] = x.dims();
            let mask = input.attention_mask.clone().float();
            let counts = mask.clone().sum_dim(1); // [B, 1]
            let sums = (x * mask.reshape([b, t, 1])).sum_dim(1).squeeze_dim::<2>(1);
            sums / counts
        } else {
            first_tokens(x, input)
        };
        let pooled = self
            .head
            .norm
            .forward(gelu(self.head.dense.forward(pooled)));
        self.classifier
            .forward(dropout(pooled, self.classifier_dropout))
    }

    fn embedding_parameters(&self) -> Vec<String> {
        vec!["model.embeddings.tok_embeddings.weight".into()]
    }
}

crate::models::encoder::encoder_model!(ModernBertForSequenceClassification);
