//! Reward modelling (`kiln train --task reward-modeling`) with the semantics of TRL's
//! `RewardTrainer`: a decoder with a one-label sequence-classification head
//! (`LlamaForSequenceClassification`'s `score`, read at each row's last non-padding token), pairs
//! prepared as TRL prepares them ([`crate::data::reward`]), each batch every pair's chosen sequence
//! then its rejected one, the pairwise loss `−log σ(r_chosen − r_rejected − margin)` (plus
//! `center_rewards_coefficient · (r_chosen + r_rejected)²`), and TRL's metrics (`accuracy`,
//! `margin`, `min_reward`, `mean_reward`, `max_reward`) in training and evaluation.

use std::path::Path;
use std::sync::Arc;

use burn::tensor::activation::log_sigmoid;
use burn::tensor::{Int, Tensor};
use tokenizers::Tokenizer;
use tracing::info;

use crate::contract::{BatchSource, Loss};
use crate::data::chat_template::ChatTemplate;
use crate::data::lm::{RowValues, TokenBatch};
use crate::data::prepared::{prepare_records, RowRefusal};
use crate::data::reward::{collate_rewards, prepare_reward_row, RewardExample, RewardOptions};
use crate::data::sft::SftError;
use crate::error::Result;
use crate::ops::KilnBackend;
use crate::train::trainer::TokenMetrics;

/// `--task reward-modeling`'s settings, under TRL's `RewardConfig` names.
#[derive(Debug, Clone, Default)]
pub struct RewardData {
    pub options: RewardOptions,
    /// Adds `c · mean((r_chosen + r_rejected)²)` to the loss, which keeps rewards centred on 0
    /// (TRL's `center_rewards_coefficient`; `None`: no such term).
    pub center_rewards_coefficient: Option<f64>,
    /// Round each batch's padded length up to a multiple of this.
    pub pad_to_multiple_of: Option<usize>,
}

impl RewardData {
    pub fn loss(&self) -> RewardLoss {
        RewardLoss {
            center_rewards_coefficient: self.center_rewards_coefficient,
        }
    }

    pub fn metrics(&self) -> Arc<RewardMetrics> {
        Arc::new(RewardMetrics)
    }
}

/// What preparing rows needs besides the rows.
pub struct RewardTokenization<'a> {
    pub tokenizer: &'a Tokenizer,
    pub template: Option<&'a ChatTemplate>,
    pub options: &'a RewardOptions,
}

/// Prepared reward pairs, batched as TRL's collator batches them.
#[derive(Debug, Clone)]
pub struct RewardSet {
    pub examples: Vec<RewardExample>,
    pub pad_id: u32,
    pub pad_to_multiple_of: Option<usize>,
}

impl RewardSet {
    /// Reads and prepares every row of `path` (the first `limit` that prepare, if given); a row
    /// that cannot be prepared is skipped and counted with its line, or stops the run under
    /// `strict` (a model without a chat template for conversations stops it always).
    pub fn read(
        path: &Path,
        how: &RewardTokenization,
        pad_id: u32,
        strict: bool,
        limit: Option<usize>,
    ) -> Result<Self> {
        let examples = prepare_records(path, strict, limit, "reward modelling", |row| {
            prepare_reward_row(row, how.tokenizer, how.template, how.options).map_err(|e| {
                RowRefusal {
                    stops_the_run: matches!(e, SftError::Config(_)),
                    reason: e.to_string(),
                }
            })
        })?;
        let with_margin = examples.iter().filter(|e| e.margin != 0.0).count();
        info!(
            "{}: {} reward pairs ({with_margin} with a non-zero margin)",
            path.display(),
            examples.len()
        );
        Ok(Self {
            examples,
            pad_id,
            pad_to_multiple_of: None,
        })
    }
}

impl BatchSource for RewardSet {
    type Batch = TokenBatch;

    fn len(&self) -> usize {
        self.examples.len()
    }

    /// A pair's length is its longer side's (what its batch is padded to).
    fn lengths(&self) -> Vec<usize> {
        self.examples
            .iter()
            .map(|e| e.chosen_ids.len().max(e.rejected_ids.len()))
            .collect()
    }

    fn padded_length(&self, longest: usize) -> usize {
        crate::data::batch::round_to_multiple(longest, self.pad_to_multiple_of)
    }

    /// The pairs' chosen sequences then their rejected ones; each row carries its pair's margin
    /// (the rejected rows 0). The targets are one per row (0 chosen, 1 rejected), so the trainer
    /// weighs micro-batches by their rows.
    fn batch(&self, indices: &[usize]) -> (TokenBatch, Vec<i64>) {
        let examples: Vec<&RewardExample> = indices.iter().map(|&i| &self.examples[i]).collect();
        let (ids, lengths) = collate_rewards(&examples, self.pad_id, self.pad_to_multiple_of);
        let rows = ids.len();
        let seq = ids.first().map_or(0, Vec::len);
        let margins = examples
            .iter()
            .map(|e| e.margin)
            .chain(std::iter::repeat_n(0.0, examples.len()))
            .collect();
        let batch = TokenBatch {
            ids: ids.iter().flatten().map(|&t| i64::from(t)).collect(),
            batch: rows,
            seq,
            segments: Vec::new(),
            chunked_loss: None,
            scoring: None,
            carried: RowValues {
                values: margins,
                per_row: 1,
            },
            attended_tokens: Some(lengths.iter().sum()),
        };
        let sides = (0..rows).map(|r| i64::from(r >= indices.len())).collect();
        (batch, sides)
    }
}

/// TRL's `RewardTrainer` loss over a batch's scores `[2 × pairs, 2]` (each row's reward, then its
/// carried margin; every chosen row, then every rejected row): the mean over the pairs of
/// `−log σ(r_c − r_r − margin)`, plus `c · mean((r_c + r_r)²)` with a centring coefficient.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RewardLoss {
    pub center_rewards_coefficient: Option<f64>,
}

impl Loss for RewardLoss {
    fn loss<B: KilnBackend>(&self, scores: Tensor<B, 2>, _: Tensor<B, 1, Int>) -> Tensor<B, 1> {
        let [rows, _] = scores.dims();
        let pairs = rows / 2;
        let rewards = scores.clone().narrow(1, 0, 1).reshape([rows]);
        let margin = scores.narrow(1, 1, 1).reshape([rows]).narrow(0, 0, pairs);
        let (chosen, rejected) = (
            rewards.clone().narrow(0, 0, pairs),
            rewards.narrow(0, pairs, pairs),
        );
        let loss = log_sigmoid(chosen.clone() - rejected.clone() - margin)
            .neg()
            .mean();
        match self.center_rewards_coefficient {
            Some(c) => loss + (chosen + rejected).powi_scalar(2).mean() * c,
            None => loss,
        }
    }
}

/// TRL's reward metrics, each the mean over batches of the batch's value (as TRL averages its
/// per-micro-batch values between logs): `accuracy` (the share of pairs whose chosen reward is
/// strictly ahead), `margin` (the mean reward difference, the data's margins not subtracted), and
/// the least, mean and greatest of the batch's rewards, both sides together. Under data
/// parallelism each rank's batches count as batches (TRL takes the least and greatest over the
/// ranks' gathered rewards).
#[derive(Debug, Clone, Copy)]
pub struct RewardMetrics;

/// How many sums a batch adds.
const SUMS: usize = 6;

impl TokenMetrics for RewardMetrics {
    fn batch(&self, scores: &[f32], width: usize, _: &[i64]) -> Vec<f64> {
        let rewards: Vec<f64> = scores
            .chunks(width.max(1))
            .map(|row| f64::from(row[0]))
            .collect();
        let pairs = rewards.len() / 2;
        if pairs == 0 {
            return vec![0.0; SUMS];
        }
        let (chosen, rejected) = rewards.split_at(pairs);
        let per_pair = |f: &dyn Fn(f64, f64) -> f64| {
            chosen
                .iter()
                .zip(rejected)
                .map(|(&c, &r)| f(c, r))
                .sum::<f64>()
                / pairs as f64
        };
        vec![
            1.0,
            per_pair(&|c, r| f64::from(u8::from(c > r))),
            per_pair(&|c, r| c - r),
            rewards.iter().copied().fold(f64::INFINITY, f64::min),
            rewards.iter().sum::<f64>() / rewards.len() as f64,
            rewards.iter().copied().fold(f64::NEG_INFINITY, f64::max),
        ]
    }

    fn finish(&self, t: &[f64]) -> Vec<(String, f64)> {
        let batches = t[0];
        if batches == 0.0 {
            return Vec::new();
        }
        [
            "accuracy",
            "margin",
            "min_reward",
            "mean_reward",
            "max_reward",
        ]
        .iter()
        .zip(&t[1..])
        .map(|(name, sum)| (name.to_string(), sum / batches))
        .collect()
    }
}

/// Whether the model folder `dir` holds a decoder sequence classifier (a reward model: its
/// `config.json` names a causal-LM family and `…ForSequenceClassification`), which `kiln predict`
/// scores with [`score_texts`] rather than as an encoder classifier.
pub fn is_decoder_classifier(dir: &Path) -> bool {
    let Ok(bytes) = std::fs::read(dir.join("config.json")) else {
        return false;
    };
    let Ok(json) = serde_json::from_slice::<serde_json::Value>(&bytes) else {
        return false;
    };
    let decoder = crate::models::auto::declared_model_type(&json).is_some_and(|t| {
        crate::models::auto::causal_lms()
            .iter()
            .any(|(family, _)| *family == t)
    });
    let classifier = json["architectures"][0]
        .as_str()
        .is_some_and(|a| a.ends_with("ForSequenceClassification"));
    decoder && classifier
}

/// The scores (one per label; a reward model's one reward) a decoder sequence classifier in
/// `dir` gives each of `texts`, each tokenized with the tokenizer's special tokens and cut to its
/// first `max_length` tokens, in batches of `batch_size` padded on the right: what
/// transformers' `AutoModelForSequenceClassification` gives the same ids.
pub fn score_texts<B: KilnBackend>(
    dir: &Path,
    texts: &[String],
    max_length: usize,
    batch_size: usize,
    device: &B::Device,
) -> Result<Vec<Vec<f32>>> {
    use crate::models::decoder::{
        DecoderArchitecture, DecoderConfig, DecoderFamily, DecoderVisitor,
    };
    struct Run<'a, B: KilnBackend>(&'a Path, &'a [String], usize, usize, &'a B::Device);
    impl<B: KilnBackend> DecoderVisitor for Run<'_, B> {
        type Output = Result<Vec<Vec<f32>>>;
        fn visit<A: DecoderArchitecture>(
            self,
            _: &'static DecoderFamily<A>,
            config: A::Config,
        ) -> Self::Output {
            let Run(dir, texts, max_length, batch_size, device) = self;
            let labels = config.sequence_classifier_labels().ok_or_else(|| {
                crate::error::KilnError::Config(format!(
                    "{}: not a sequence classifier (architectures names no \
                     …ForSequenceClassification)",
                    dir.join("config.json").display()
                ))
            })?;
            let tok = crate::tasks::causal_lm::load_tokenizer(dir)?;
            let pad = i64::from(config.pad_token_id().unwrap_or(0));
            let keep = crate::models::params::keep_all;
            let model = A::load::<B>(dir, &config, device, None, &keep)?;
            let mut out = Vec::with_capacity(texts.len());
            for chunk in texts.chunks(batch_size.max(1)) {
                let rows = chunk
                    .iter()
                    .map(|t| {
                        let mut ids = crate::data::sft::encode(&tok, t, true)
                            .map_err(|e| crate::error::KilnError::Data(e.to_string()))?;
                        ids.truncate(max_length.max(1));
                        Ok(ids)
                    })
                    .collect::<Result<Vec<Vec<u32>>>>()?;
                let seq = rows.iter().map(Vec::len).max().unwrap_or(1).max(1);
                let ids = rows
                    .iter()
                    .flat_map(|r| {
                        let mut r: Vec<i64> = r.iter().map(|&t| i64::from(t)).collect();
                        r.resize(seq, pad);
                        r
                    })
                    .collect();
                let batch = TokenBatch {
                    ids,
                    batch: rows.len(),
                    seq,
                    ..TokenBatch::default()
                };
                let scores: Vec<f32> = crate::contract::Model::logits(&model, &batch)
                    .into_data()
                    .convert::<f32>()
                    .into_vec()
                    .map_err(|e| crate::error::KilnError::Data(format!("scores: {e:?}")))?;
                out.extend(scores.chunks(labels).map(<[f32]>::to_vec));
            }
            Ok(out)
        }
    }
    crate::models::auto::with_causal_lm(
        &dir.join("config.json"),
        Run::<B>(dir, texts, max_length, batch_size, device),
    )?
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::Cpu;
    use burn::tensor::TensorData;

    /// The loss against its formula in f64, with margins and the centring term.
    #[test]
    fn pairwise_loss_subtracts_margins_and_centres() {
        let rewards = [0.7f32, -0.2, 1.5, 0.1, 0.4, 2.0];
        let margins = [0.5f32, 0.0, -1.0];
        let mut values = Vec::new();
        for (i, r) in rewards.iter().enumerate() {
            values.extend([*r, if i < 3 { margins[i] } else { 0.0 }]);
        }
        let scores =
            Tensor::<Cpu, 2>::from_data(TensorData::new(values, [6, 2]), &Default::default());
        let targets = Tensor::<Cpu, 1, Int>::zeros([6], &Default::default());
        let c = 0.01;
        let got: f32 = RewardLoss {
            center_rewards_coefficient: Some(c),
        }
        .loss(scores, targets)
        .into_scalar();
        let mut want = 0.0;
        for i in 0..3 {
            let (rc, rr) = (f64::from(rewards[i]), f64::from(rewards[i + 3]));
            let d = rc - rr - f64::from(margins[i]);
            want += (1.0 + (-d).exp()).ln() / 3.0 + c * (rc + rr).powi(2) / 3.0;
        }
        assert!((f64::from(got) - want).abs() < 1e-6, "{got} vs {want}");
    }

    #[test]
    fn metrics_average_each_batchs_values() {
        let m = RewardMetrics;
        // Two pairs: (1, 0) chosen ahead, (−1, 2) behind.
        let a = m.batch(&[1.0, 0.0, -1.0, 0.0, 0.0, 0.0, 2.0, 0.0], 2, &[]);
        let b = m.batch(&[3.0, 0.0, 1.0, 0.0], 2, &[]);
        let sums: Vec<f64> = a.iter().zip(&b).map(|(x, y)| x + y).collect();
        let got: std::collections::BTreeMap<String, f64> = m.finish(&sums).into_iter().collect();
        assert_eq!(got["accuracy"], (0.5 + 1.0) / 2.0);
        assert_eq!(got["margin"], ((1.0 - 3.0) / 2.0 + 2.0) / 2.0);
        assert_eq!(got["min_reward"], (-1.0 + 1.0) / 2.0);
        assert_eq!(got["mean_reward"], (0.5 + 2.0) / 2.0);
        assert_eq!(got["max_reward"], (2.0 + 3.0) / 2.0);
        assert!(m.finish(&m.batch(&[], 2, &[])).is_empty());
    }
}
