//! What the encoder families share: the batch as tensors ([`BertInput`], with the unpadded
//! layout of a right-padded batch), the first-token and mask helpers, and the
//! [`EncoderClassifier`] chain of segments every family implements, from which
//! [`encoder_model!`] derives kiln's `Model` and `Segments`.

use burn::tensor::{backend::Backend, IndexingUpdateOp, Int, Tensor};

use crate::data::batch::TextBatch;
use crate::ops::{reshape, KilnBackend};

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
        impl<B: $crate::ops::KilnBackend>
            $crate::contract::Segments<B, $crate::data::batch::TextBatch> for $ty<B>
        {
            fn num_layers(&self) -> usize {
                $crate::models::encoder::EncoderClassifier::num_layers(self)
            }

            fn embed(&self, batch: &$crate::data::batch::TextBatch) -> burn::tensor::Tensor<B, 3> {
                use $crate::models::encoder::EncoderClassifier as E;
                E::embed(self, &E::input(self, batch))
            }

            fn layer(
                &self,
                i: usize,
                x: burn::tensor::Tensor<B, 3>,
                batch: &$crate::data::batch::TextBatch,
            ) -> burn::tensor::Tensor<B, 3> {
                use $crate::models::encoder::EncoderClassifier as E;
                E::layer(self, i, x, &E::input(self, batch))
            }

            fn head(
                &self,
                h: burn::tensor::Tensor<B, 3>,
                batch: &$crate::data::batch::TextBatch,
            ) -> burn::tensor::Tensor<B, 2> {
                use $crate::models::encoder::EncoderClassifier as E;
                E::head(self, h, &E::input(self, batch))
            }
        }

        impl<B: $crate::ops::KilnBackend> $crate::contract::Model<B> for $ty<B> {
            type Batch = $crate::data::batch::TextBatch;

            fn logits(&self, batch: &Self::Batch) -> burn::tensor::Tensor<B, 2> {
                use $crate::models::encoder::EncoderClassifier as E;
                E::forward(self, &E::input(self, batch))
            }

            fn segments(&self) -> Option<&dyn $crate::contract::Segments<B, Self::Batch>> {
                Some(self)
            }

            fn input_ids_numel(&self, batch: &Self::Batch) -> usize {
                batch.batch * batch.seq
            }

            fn embedding_parameters(&self) -> Vec<String> {
                $crate::models::encoder::EncoderClassifier::embedding_parameters(self)
            }
        }
    };
}
pub(crate) use encoder_model;

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
