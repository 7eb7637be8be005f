//! `BertForSequenceClassification`, following transformers' `modeling_bert.py` module for module, with
//! the same parameter names (`bert.embeddings.*`, `bert.encoder.layer.N.*`, `bert.pooler.*`,
//! `classifier.*`) so checkpoints move between kiln and transformers unchanged.
// `LayerNorm` fields carry Hugging Face's parameter name; the derive re-emits it in generated code.
#![allow(non_snake_case)]

use burn::module::Module;
use burn::tensor::{backend::Backend, Int, Tensor};

use crate::data::batch::TextBatch;
use crate::models::bert::config::BertConfig;
use crate::models::encoder::{first_tokens, mask_bias, EncoderClassifier};
pub use crate::models::encoder::{BertInput, Unpadded};
use crate::models::layers::{Embedding, LayerNorm, Linear};
use crate::ops::{attention_qkv, dropout, gelu, linear, KilnBackend};

#[derive(Module, Debug)]
pub struct BertEmbeddings<B: Backend> {
    pub word_embeddings: Embedding<B>,
    pub position_embeddings: Embedding<B>,
    pub token_type_embeddings: Embedding<B>,
    pub LayerNorm: LayerNorm<B>,
    pub dropout: f64,
}

impl<B: KilnBackend> BertEmbeddings<B> {
    pub(crate) fn new(c: &BertConfig, device: &B::Device) -> Self {
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

    pub(crate) fn forward(&self, input: &BertInput<B>) -> Tensor<B, 3> {
        let [b, t] = input.input_ids.dims();
        let device = input.input_ids.device();
        let positions = input.position_ids.clone().unwrap_or_else(|| {
            Tensor::<B, 1, Int>::arange(0..t as i64, &device)
                .unsqueeze::<2>()
                .expand([b, t])
        });
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

impl<B: Backend> BertEncoder<B> {
    /// Every Linear of the layers with its path under `prefix` (`bert.encoder`), for LoRA.
    pub(crate) fn linears_mut(&mut self, prefix: &str) -> Vec<(String, &mut Linear<B>)> {
        let mut out = Vec::new();
        for (i, l) in self.layer.iter_mut().enumerate() {
            let (s, o) = (&mut l.attention.self_, &mut l.attention.output);
            for (name, layer) in [
                ("attention.self.query", &mut s.query),
                ("attention.self.key", &mut s.key),
                ("attention.self.value", &mut s.value),
                ("attention.output.dense", &mut o.dense),
                ("intermediate.dense", &mut l.intermediate.dense),
                ("output.dense", &mut l.output.dense),
            ] {
                out.push((format!("{prefix}.layer.{i}.{name}"), layer));
            }
        }
        out
    }
}

impl<B: Backend> BertForSequenceClassification<B> {
    pub(crate) fn linears_mut(&mut self) -> Vec<(String, &mut Linear<B>)> {
        let mut out = self.bert.encoder.linears_mut("bert.encoder");
        out.push(("bert.pooler.dense".into(), &mut self.bert.pooler.dense));
        out.push(("classifier".into(), &mut self.classifier));
        out
    }
}

impl<B: KilnBackend> BertSelfAttention<B> {
    /// `x [B, T, H]` (or packed `[1, N, H]` with `unpadded`), `mask_bias [B, T]` (0 for tokens, the
    /// most negative float for padding).
    fn forward(
        &self,
        x: Tensor<B, 3>,
        mask_bias: Tensor<B, 2>,
        unpadded: Option<&Unpadded<B>>,
    ) -> Tensor<B, 3> {
        self_attention(
            [&self.query, &self.key, &self.value],
            x,
            mask_bias,
            self.num_heads,
            self.dropout,
            unpadded,
        )
    }
}

/// Bidirectional multi-head self-attention of `x [B, T, H]` (or packed `[1, N, H]` with
/// `unpadded`) through the `[q, k, v]` projections, before the output projection.
pub(crate) fn self_attention<B: KilnBackend>(
    [q, k, v]: [&Linear<B>; 3],
    x: Tensor<B, 3>,
    mask_bias: Tensor<B, 2>,
    num_heads: usize,
    dropout: f64,
    unpadded: Option<&Unpadded<B>>,
) -> Tensor<B, 3> {
    // q, k and v from one Linear with the three weights stacked: x is read (and packed for the
    // GEMM) once instead of three times, and its gradient comes back as one product instead of
    // three summed. The parameters stay three, under Hugging Face's names.
    let qkv = if crate::ops::is_bf16_store(&q.weight.val()) {
        // A frozen base held in bf16 (`--base-dtype bf16`) is not stacked: that would be an f32
        // copy of the three weights. Each product widens its own weight panel by panel.
        Tensor::cat(
            vec![q.forward(x.clone()), k.forward(x.clone()), v.forward(x)],
            2,
        )
    } else {
        let weight = Tensor::cat(vec![q.weight.val(), k.weight.val(), v.weight.val()], 0);
        let bias = match (&q.bias, &k.bias, &v.bias) {
            (Some(bq), Some(bk), Some(bv)) => {
                Some(Tensor::cat(vec![bq.val(), bk.val(), bv.val()], 0))
            }
            _ => None,
        };
        match lora_qkv([q, k, v], x.clone()) {
            Some(delta) => linear(x, weight, bias) + delta,
            None => linear(x, weight, bias),
        }
    };
    match unpadded {
        None => attention_qkv(qkv, mask_bias, num_heads, dropout),
        Some(u) => u.pack(attention_qkv(u.unpack(qkv), mask_bias, num_heads, dropout)),
    }
}

/// The LoRA adapters' part of the stacked `[q, k, v]` output (zeros for a projection without
/// one), or `None` when none of the three has an adapter.
fn lora_qkv<B: KilnBackend>(layers: [&Linear<B>; 3], x: Tensor<B, 3>) -> Option<Tensor<B, 3>> {
    if layers.iter().all(|l| l.lora.0.is_none()) {
        return None;
    }
    let [b, t, _] = x.dims();
    let parts = layers.map(|l| {
        l.lora_delta(x.clone())
            .unwrap_or_else(|| Tensor::zeros([b, t, l.weight.dims()[0]], &x.device()))
    });
    Some(Tensor::cat(parts.into(), 2))
}

impl<B: KilnBackend> BertLayer<B> {
    pub(crate) fn new(c: &BertConfig, device: &B::Device) -> Self {
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

    pub(crate) fn forward(
        &self,
        x: Tensor<B, 3>,
        mask_bias: Tensor<B, 2>,
        unpadded: Option<&Unpadded<B>>,
    ) -> Tensor<B, 3> {
        let att = &self.attention;
        let a = att.self_.forward(x.clone(), mask_bias, unpadded);
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
}

impl<B: KilnBackend> EncoderClassifier<B> for BertForSequenceClassification<B> {
    fn num_labels(&self) -> usize {
        self.classifier.weight.dims()[0]
    }

    fn input(&self, batch: &TextBatch) -> BertInput<B> {
        BertInput::from_batch(batch, &self.classifier.weight.device())
    }

    /// The embeddings' output, packed to the real tokens when the batch is right-padded.
    fn embed(&self, input: &BertInput<B>) -> Tensor<B, 3> {
        let x = self.bert.embeddings.forward(input);
        match &input.unpadded {
            Some(u) => u.pack(x),
            None => x,
        }
    }

    fn num_layers(&self) -> usize {
        self.bert.encoder.layer.len()
    }

    fn layer(&self, i: usize, x: Tensor<B, 3>, input: &BertInput<B>) -> Tensor<B, 3> {
        self.bert.encoder.layer[i].forward(x, mask_bias(input), input.unpadded.as_ref())
    }

    /// The last layer's output → pooler → classifier.
    fn head(&self, x: Tensor<B, 3>, input: &BertInput<B>) -> Tensor<B, 2> {
        let cls = first_tokens(x, input);
        let pooled = self.bert.pooler.dense.forward(cls).tanh();
        self.classifier
            .forward(dropout(pooled, self.classifier_dropout))
    }

    fn embedding_parameters(&self) -> Vec<String> {
        ["word", "position", "token_type"]
            .map(|e| format!("bert.embeddings.{e}_embeddings.weight"))
            .into()
    }
}

crate::models::encoder::encoder_model!(BertForSequenceClassification);
