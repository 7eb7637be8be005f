//! `BertForSequenceClassification`, following transformers' `modeling_bert.py` module for module, with
//! the same parameter names (`bert.embeddings.*`, `bert.encoder.layer.N.*`, `bert.pooler.*`,
//! `classifier.*`) so checkpoints move between kiln and transformers unchanged.
// `LayerNorm` fields carry Hugging Face's parameter name; the derive re-emits it in generated code.
#![allow(non_snake_case)]

use burn::module::Module;
use burn::tensor::{backend::Backend, IndexingUpdateOp, Int, Tensor};

use super::classifier::EncoderClassifier;
use super::layers::{Embedding, LayerNorm, Linear};
use crate::data::batch::TextBatch;
use crate::hub::config::BertConfig;
use crate::ops::{attention_qkv, dropout, gelu, linear, reshape, KilnBackend};

/// One tokenized, padded batch. Masks are 1 for real tokens and 0 for padding.
#[derive(Debug, Clone)]
pub struct BertInput<B: Backend> {
    pub input_ids: Tensor<B, 2, Int>,
    pub attention_mask: Tensor<B, 2, Int>,
    pub token_type_ids: Tensor<B, 2, Int>,
    /// Each token's row in the position table; `None` counts `0..T` (BERT). RoBERTa counts from
    /// `pad_token_id + 1`.
    pub position_ids: Option<Tensor<B, 2, Int>>,
    /// Set when the batch is right-padded: the encoder then runs on the real tokens only.
    pub unpadded: Option<Unpadded<B>>,
}

/// Where the real tokens of a right-padded `[B, T]` batch are. Every Linear, LayerNorm, GELU and
/// dropout runs on the `N` real tokens packed as `[1, N, H]`; only attention, which needs the
/// `[B, T]` layout, scatters back to it (padded rows are zero and masked out). A batch of short
/// texts padded to its longest does a fraction of the work, with the same result for every real
/// token.
#[derive(Debug, Clone)]
pub struct Unpadded<B: Backend> {
    /// Row in the flattened `[B·T]` batch of each real token, in order.
    pub tokens: Tensor<B, 1, Int>,
    /// Row in the packed `[N]` tokens of each sequence's first token (`[CLS]`).
    pub first: Tensor<B, 1, Int>,
    pub batch: usize,
    pub seq: usize,
}

impl<B: Backend> Unpadded<B> {
    /// `None` unless `mask` (`[batch, seq]`, row-major) is right padding with some padding in it.
    pub fn from_mask(mask: &[i64], batch: usize, seq: usize, device: &B::Device) -> Option<Self> {
        let mut tokens = Vec::with_capacity(mask.len());
        let mut first = Vec::with_capacity(batch);
        for (b, row) in mask.chunks(seq).enumerate() {
            let len = row.iter().take_while(|&&m| m != 0).count();
            if len == 0 || row[len..].iter().any(|&m| m != 0) {
                return None; // empty or not right-padded: keep the padded layout
            }
            first.push(tokens.len() as i64);
            tokens.extend((b * seq..b * seq + len).map(|i| i as i64));
        }
        if tokens.len() == mask.len() {
            return None; // nothing to skip
        }
        let ints = |v: Vec<i64>| {
            let n = v.len();
            Tensor::from_data(burn::tensor::TensorData::new(v, [n]), device)
        };
        Some(Self {
            tokens: ints(tokens),
            first: ints(first),
            batch,
            seq,
        })
    }
}

impl<B: KilnBackend> Unpadded<B> {
    /// `[B, T, H]` → the real tokens `[1, N, H]`.
    pub(crate) fn pack(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let h = x.dims()[2];
        let rows = reshape::<B, 3, 2>(x, [self.batch * self.seq, h]).select(0, self.tokens.clone());
        let n = rows.dims()[0];
        reshape(rows, [1, n, h])
    }

    /// `[1, N, H]` → `[B, T, H]` with zero rows at the padding.
    pub(crate) fn unpack(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let [_, n, h] = x.dims();
        let zeros = Tensor::zeros([self.batch * self.seq, h], &x.device());
        let rows = zeros.select_assign(
            0,
            self.tokens.clone(),
            reshape::<B, 3, 2>(x, [n, h]),
            IndexingUpdateOp::Add,
        );
        reshape(rows, [self.batch, self.seq, h])
    }
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
            position_ids: None,
            unpadded: Unpadded::from_mask(&b.attention_mask, b.batch, b.seq, device),
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
    let weight = Tensor::cat(vec![q.weight.val(), k.weight.val(), v.weight.val()], 0);
    let bias = match (&q.bias, &k.bias, &v.bias) {
        (Some(bq), Some(bk), Some(bv)) => Some(Tensor::cat(vec![bq.val(), bk.val(), bv.val()], 0)),
        _ => None,
    };
    let qkv = linear(x, weight, bias);
    match unpadded {
        None => attention_qkv(qkv, mask_bias, num_heads, dropout),
        Some(u) => u.pack(attention_qkv(u.unpack(qkv), mask_bias, num_heads, dropout)),
    }
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

/// Each sequence's first token (`[CLS]`, `<s>`) `[B, H]` of the hidden states `[B, T, H]` (or the
/// packed `[1, N, H]` of an unpadded batch).
pub(crate) fn first_tokens<B: KilnBackend>(x: Tensor<B, 3>, input: &BertInput<B>) -> Tensor<B, 2> {
    let b = input.input_ids.dims()[0];
    let h = x.dims()[2];
    match &input.unpadded {
        Some(u) => reshape::<B, 3, 2>(x, [u.tokens.dims()[0], h]).select(0, u.first.clone()),
        None => x.slice([0..b, 0..1, 0..h]).reshape([b, h]),
    }
}

/// Additive attention mask `[B, T]`: 0 where attended, the most negative float where padded (as
/// transformers).
pub(crate) fn mask_bias<B: KilnBackend>(input: &BertInput<B>) -> Tensor<B, 2> {
    (input.attention_mask.clone().float().neg() + 1.0).mul_scalar(f32::MIN)
}

crate::models::classifier::encoder_model!(BertForSequenceClassification);
