//! Preference optimisation (`kiln train --task dpo` and `--task orpo`), with the semantics of
//! TRL's `DPOTrainer` and `ORPOTrainer`: preference rows prepared as each prepares them
//! ([`crate::data::preference`]), each batch every pair's chosen sequence then its rejected one,
//! the causal LM asked for each sequence's completion scores ([`crate::data::lm::CompletionScoring`])
//! and the method's loss of those ([`PreferenceLoss`]), TRL's metrics logged in training and
//! evaluation ([`PreferenceMetrics`]).
//!
//! DPO's reference model is the policy before training (with LoRA: the base model, the adapter
//! off), so its log-probabilities are computed once, before the first step, over the training and
//! evaluation rows (TRL's `precompute_ref_log_probs`, which gives the numbers its default of a
//! frozen copy gives, without holding that copy). Each data-parallel rank computes its share.
//! ORPO has no reference model.

use std::path::Path;
use std::sync::Arc;

use burn::tensor::Tensor;
use tokenizers::Tokenizer;
use tracing::info;

use crate::contract::{BatchSource, IGNORE_INDEX};
use crate::data::chat_template::ChatTemplate;
use crate::data::lm::{CompletionScoring, RowValues, TokenBatch};
use crate::data::preference::{
    collate_preferences, prepare_orpo_row, prepare_preference_row, PreferenceExample,
    PreferenceOptions, SpecialIds,
};
use crate::data::prepared::{prepare_records, RowRefusal};
use crate::data::sft::SftError;
use crate::error::{KilnError, Result};
use crate::models::completion_scores::Column;
use crate::ops::KilnBackend;
use crate::parallel::{Collectives, DataParallel};

mod loss;
mod metrics;
pub use loss::{DpoLossType, PreferenceLoss, PreferenceMethod};
pub use metrics::PreferenceMetrics;

/// `--task dpo` / `--task orpo`'s settings, under TRL's `DPOConfig` / `ORPOConfig` names.
#[derive(Debug, Clone)]
pub struct PreferenceData {
    pub options: PreferenceOptions,
    /// β: DPO's pull towards the reference, ORPO's weight of the odds ratio (TRL's default 0.1).
    pub beta: f64,
    pub method: PreferenceMethod,
    /// Round each batch's padded length up to a multiple of this.
    pub pad_to_multiple_of: Option<usize>,
}

impl Default for PreferenceData {
    fn default() -> Self {
        Self {
            options: PreferenceOptions::default(),
            beta: 0.1,
            method: PreferenceMethod::Dpo(DpoLossType::Sigmoid),
            pad_to_multiple_of: None,
        }
    }
}

impl PreferenceData {
    pub fn loss(&self) -> PreferenceLoss {
        PreferenceLoss {
            beta: self.beta,
            method: self.method,
        }
    }

    pub fn metrics(&self) -> Arc<PreferenceMetrics> {
        Arc::new(PreferenceMetrics {
            beta: self.beta,
            method: self.method,
        })
    }
}

/// Prepared preference pairs, batched as TRL's collator batches them, with the reference
/// model's log-probabilities of each pair's completions once they are computed.
#[derive(Debug, Clone)]
pub struct PreferenceSet {
    pub examples: Vec<PreferenceExample>,
    pub pad_id: u32,
    pub max_length: Option<usize>,
    pub pad_to_multiple_of: Option<usize>,
    /// Per pair: the reference log-probability of the chosen and of the rejected completion
    /// (`None` until [`Self::with_reference`]; batches then carry zeros).
    pub reference: Option<Vec<[f32; 2]>>,
    /// Score this many positions at a time in the output head ([`CompletionScoring::chunk`]).
    pub loss_chunk: usize,
}

/// What preparing rows needs besides the rows.
pub struct PreferenceTokenization<'a> {
    pub tokenizer: &'a Tokenizer,
    pub template: Option<&'a ChatTemplate>,
    pub options: &'a PreferenceOptions,
    /// DPO's preparation, or ORPO's (which adds these ids).
    pub orpo: Option<SpecialIds>,
}

impl PreferenceSet {
    /// Reads and prepares every row of `path` (the first `limit` that prepare, if given); a row
    /// that cannot be prepared is skipped and counted with its line, or stops the run under
    /// `strict` (a model without a chat template for conversations stops it always).
    pub fn read(
        path: &Path,
        how: &PreferenceTokenization,
        pad_id: u32,
        strict: bool,
        limit: Option<usize>,
    ) -> Result<Self> {
        let examples = prepare_records(path, strict, limit, "preference optimisation", |row| {
            match how.orpo {
                None => prepare_preference_row(row, how.tokenizer, how.template, how.options),
                Some(ids) => prepare_orpo_row(row, how.tokenizer, how.template, how.options, ids),
            }
            .map_err(|e| RowRefusal {
                stops_the_run: matches!(e, SftError::Config(_)),
                reason: e.to_string(),
            })
        })?;
        info!("{}: {} preference pairs", path.display(), examples.len());
        Ok(Self {
            examples,
            pad_id,
            max_length: how.options.max_length,
            pad_to_multiple_of: None,
            reference: None,
            loss_chunk: 0,
        })
    }

    /// The set with the reference log-probabilities of every pair's completions: `scores_of`
    /// gives a batch's completion scores under the reference (the policy before training), or
    /// `None` on a pipeline stage before the last, which hands its layers' output on. Each
    /// data-parallel rank computes its share in batches of `batch_size`; `stages`, a pipeline's
    /// group, then gives every stage the last one's values.
    pub fn with_reference<B: KilnBackend>(
        mut self,
        mut scores_of: impl FnMut(&TokenBatch) -> Result<Option<Tensor<B, 2>>>,
        batch_size: usize,
        data: &DataParallel<B>,
        stages: Option<&dyn Collectives<B>>,
    ) -> Result<Self> {
        self.reference = None;
        let pairs = self.examples.len();
        let mut values = vec![0f32; 2 * pairs];
        for idx in data.eval_share(pairs).chunks(batch_size.max(1)) {
            let (batch, _) = self.batch(idx);
            let Some(scores) = scores_of(&batch)? else {
                continue;
            };
            let width = scores.dims()[1];
            let host = scores
                .into_data()
                .convert::<f32>()
                .into_vec::<f32>()
                .map_err(|e| KilnError::Data(format!("reference log-probabilities: {e:?}")))?;
            let logp = |row: usize| host[row * width + Column::LogProb.index()];
            for (k, &i) in idx.iter().enumerate() {
                values[2 * i] = logp(k);
                values[2 * i + 1] = logp(idx.len() + k);
            }
        }
        // Every pair's values come from one rank (and stage); the others add zeros.
        let mut values = data.sum_host(values)?;
        if let Some(stages) = stages {
            values = stages.sum_host(values)?;
        }
        if let Some(i) = values.iter().position(|v| !v.is_finite()) {
            return Err(KilnError::NonFinite(format!(
                "the reference model's log-probability of pair {}'s {} completion is {}",
                i / 2,
                if i % 2 == 0 { "chosen" } else { "rejected" },
                values[i]
            )));
        }
        self.reference = Some(values.chunks(2).map(|c| [c[0], c[1]]).collect());
        Ok(self)
    }
}

impl BatchSource for PreferenceSet {
    type Batch = TokenBatch;

    fn len(&self) -> usize {
        self.examples.len()
    }

    /// A pair's length is its longer sequence's (what its batch is padded to).
    fn lengths(&self) -> Vec<usize> {
        self.examples
            .iter()
            .map(|e| {
                let n = e.prompt_ids.len() + e.chosen_ids.len().max(e.rejected_ids.len());
                self.max_length.map_or(n, |m| n.min(m))
            })
            .collect()
    }

    fn padded_length(&self, longest: usize) -> usize {
        crate::data::batch::round_to_multiple(longest, self.pad_to_multiple_of)
    }

    /// The pairs' chosen sequences then their rejected ones, asking the model for each row's
    /// completion scores: each position's target is the next token where that token is a
    /// completion token. The batch's targets are one per row (0 chosen, 1 rejected), so the
    /// trainer weighs micro-batches by their rows.
    fn batch(&self, indices: &[usize]) -> (TokenBatch, Vec<i64>) {
        let examples: Vec<&PreferenceExample> =
            indices.iter().map(|&i| &self.examples[i]).collect();
        let b = collate_preferences(
            &examples,
            self.pad_id,
            self.max_length,
            self.pad_to_multiple_of,
        );
        let rows = b.input_ids.len();
        let seq = b.input_ids.first().map_or(0, Vec::len);
        let mut targets = Vec::with_capacity(rows * seq);
        let mut completion = Vec::with_capacity(rows * seq);
        for ((ids, mask), &len) in b.input_ids.iter().zip(&b.completion_mask).zip(&b.lengths) {
            for t in 0..seq {
                let real = t + 1 < len;
                targets.push(if real {
                    i64::from(ids[t + 1])
                } else {
                    IGNORE_INDEX
                });
                completion.push(real && mask[t + 1] == 1);
            }
        }
        let carried = match &self.reference {
            Some(r) => [0, 1]
                .iter()
                .flat_map(|&side| indices.iter().map(move |&i| r[i][side]))
                .collect(),
            None => vec![0.0; rows],
        };
        let batch = TokenBatch {
            ids: b
                .input_ids
                .iter()
                .flatten()
                .map(|&t| i64::from(t))
                .collect(),
            batch: rows,
            seq,
            segments: Vec::new(),
            chunked_loss: None,
            scoring: Some(Arc::new(CompletionScoring {
                targets,
                completion,
                chunk: self.loss_chunk,
            })),
            carried: RowValues {
                values: carried,
                per_row: 1,
            },
            attended_tokens: Some(b.lengths.iter().sum()),
        };
        let sides = (0..rows).map(|r| i64::from(r >= indices.len())).collect();
        (batch, sides)
    }
}
