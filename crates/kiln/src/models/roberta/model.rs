//! `RobertaForSequenceClassification` (also XLM-RoBERTa and CamemBERT, which transformers builds from
//! the same modules), following `modeling_roberta.py` with its parameter names: BERT's embeddings
//! and encoder layers under `roberta.`, positions counted from `pad_token_id + 1`, no pooler, and a
//! two-layer head `classifier.dense` → tanh → `classifier.out_proj` on the first token (`<s>`).

use burn::module::Module;
use burn::tensor::{backend::Backend, Int, Tensor, TensorData};

use crate::data::batch::TextBatch;
use crate::models::bert::config::BertConfig;
use crate::models::bert::{BertEmbeddings, BertEncoder, BertLayer};
use crate::models::encoder::EncoderClassifier;
use crate::models::encoder::{first_tokens, mask_bias, BertInput};
use crate::models::layers::Linear;
use crate::ops::{dropout, KilnBackend};

#[derive(Module, Debug)]
pub struct RobertaModel<B: Backend> {
    pub embeddings: BertEmbeddings<B>,
    pub encoder: BertEncoder<B>,
}

#[derive(Module, Debug)]
pub struct RobertaClassificationHead<B: Backend> {
    pub dense: Linear<B>,
    pub out_proj: Linear<B>,
    pub dropout: f64,
}

#[derive(Module, Debug)]
pub struct RobertaForSequenceClassification<B: Backend> {
    pub roberta: RobertaModel<B>,
    pub classifier: RobertaClassificationHead<B>,
    /// The padding id, whose row of the position table padding reads (`padding_idx`).
    pub padding_idx: usize,
}

/// transformers' `create_position_ids_from_input_ids`: real tokens count from `padding_idx + 1`,
/// padding tokens sit at `padding_idx`.
pub fn position_ids(input_ids: &[i64], seq: usize, padding_idx: usize) -> Vec<i64> {
    let pad = padding_idx as i64;
    let mut out = Vec::with_capacity(input_ids.len());
    for row in input_ids.chunks(seq) {
        let mut count = 0;
        for &id in row {
            if id == pad {
                out.push(pad);
            } else {
                count += 1;
                out.push(pad + count);
            }
        }
    }
    out
}

impl<B: Backend> RobertaForSequenceClassification<B> {
    pub(crate) fn linears_mut(&mut self) -> Vec<(String, &mut Linear<B>)> {
        let mut out = self.roberta.encoder.linears_mut("roberta.encoder");
        out.push(("classifier.dense".into(), &mut self.classifier.dense));
        out.push(("classifier.out_proj".into(), &mut self.classifier.out_proj));
        out
    }
}

impl<B: KilnBackend> RobertaForSequenceClassification<B> {
    /// A model with every weight freshly initialised (transformers' `_init_weights` scheme).
    pub fn new(c: &BertConfig, num_labels: usize, device: &B::Device) -> Self {
        let (h, std) = (c.hidden_size, c.initializer_range);
        Self {
            roberta: RobertaModel {
                embeddings: BertEmbeddings::new(c, device),
                encoder: BertEncoder {
                    layer: (0..c.num_hidden_layers)
                        .map(|_| BertLayer::new(c, device))
                        .collect(),
                },
            },
            classifier: RobertaClassificationHead {
                dense: Linear::new(h, h, true, std, device),
                out_proj: Linear::new(h, num_labels, true, std, device),
                dropout: c.classifier_dropout_prob(),
            },
            padding_idx: c.pad_token_id.unwrap_or(1),
        }
    }
}

impl<B: KilnBackend> EncoderClassifier<B> for RobertaForSequenceClassification<B> {
    fn num_labels(&self) -> usize {
        self.classifier.out_proj.weight.dims()[0]
    }

    /// The batch with RoBERTa's positions; token types are all 0 (RoBERTa tokenizers give none,
    /// and the table has one row).
    fn input(&self, batch: &TextBatch) -> BertInput<B> {
        let device = self.classifier.dense.weight.device();
        let mut input = BertInput::from_batch(batch, &device);
        let ints = |v: Vec<i64>| {
            Tensor::<B, 2, Int>::from_data(TensorData::new(v, [batch.batch, batch.seq]), &device)
        };
        input.position_ids = Some(ints(position_ids(
            &batch.input_ids,
            batch.seq,
            self.padding_idx,
        )));
        input.token_type_ids = ints(vec![0; batch.batch * batch.seq]);
        input
    }

    fn embed(&self, input: &BertInput<B>) -> Tensor<B, 3> {
        let x = self.roberta.embeddings.forward(input);
        match &input.unpadded {
            Some(u) => u.pack(x),
            None => x,
        }
    }

    fn num_layers(&self) -> usize {
        self.roberta.encoder.layer.len()
    }

    fn layer(&self, i: usize, x: Tensor<B, 3>, input: &BertInput<B>) -> Tensor<B, 3> {
        self.roberta.encoder.layer[i].forward(x, mask_bias(input), input.unpadded.as_ref())
    }

    fn head(&self, x: Tensor<B, 3>, input: &BertInput<B>) -> Tensor<B, 2> {
        let c = &self.classifier;
        let x = dropout(first_tokens(x, input), c.dropout);
        let x = dropout(c.dense.forward(x).tanh(), c.dropout);
        c.out_proj.forward(x)
    }

    fn embedding_parameters(&self) -> Vec<String> {
        ["word", "position", "token_type"]
            .map(|e| format!("roberta.embeddings.{e}_embeddings.weight"))
            .into()
    }
}

crate::models::encoder::encoder_model!(RobertaForSequenceClassification);

#[cfg(test)]
mod tests {
    #[test]
    fn positions_count_real_tokens_from_after_the_padding_id() {
        // Two rows of 4, padding id 1: transformers gives [2,3,4,1] and [2,3,1,1].
        let ids = [0, 7, 2, 1, 0, 2, 1, 1];
        assert_eq!(
            super::position_ids(&ids, 4, 1),
            vec![2, 3, 4, 1, 2, 3, 1, 1]
        );
    }
}
