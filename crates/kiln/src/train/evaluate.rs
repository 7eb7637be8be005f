//! Evaluation: a model over every example of an evaluation set (each data-parallel rank its
//! share, gathered back by the data-parallel strategy), the loss, the classification report or
//! perplexity, and the user's `compute_metrics`, under transformers' `eval_*` names.

use std::collections::BTreeMap;
use std::time::Instant;

use burn::tensor::backend::Backend;
use burn::tensor::{ElementConversion, Int, Tensor, TensorData};

use super::metrics::{classification_report, ClassificationReport, Predictions};
use crate::contract::{BatchSource, Loss, Model};
use crate::error::{KilnError, Result};
use crate::parallel::DataParallel;

/// A user metric: extra `(name, value)` pairs computed from an evaluation's predictions.
pub type MetricFn = Box<dyn Fn(&Predictions) -> Vec<(String, f64)> + Send + Sync>;

/// A user metric of a causal LM, streamed batch by batch as transformers' `batch_eval_metrics`
/// streams it: an evaluation never holds more than one batch's logits. Each batch gives sums
/// (`batch`), which are added over batches and data-parallel ranks; `finish` turns the totals into
/// `(name, value)` pairs, reported under `eval_<name>`.
pub trait TokenMetrics: Send + Sync {
    /// The sums of one batch: `logits` `[tokens, vocab]` row-major over the whole vocabulary
    /// (under tensor parallelism too), `targets` one per token (`IGNORE_INDEX` where no token is
    /// predicted). Every batch must return as many sums; a batch of no tokens (called first)
    /// returns that many zeros.
    fn batch(&self, logits: &[f32], vocab: usize, targets: &[i64]) -> Vec<f64>;
    /// The named values from the totals. The totals travel between ranks as f32: sums of counts
    /// are exact up to 2²⁴.
    fn finish(&self, totals: &[f64]) -> Vec<(String, f64)>;
}

/// The outcome of an evaluation.
#[derive(Debug, Clone)]
pub struct EvalOutput {
    /// `eval_loss`, `eval_accuracy`, `eval_f1`, ... plus runtime and throughput.
    pub metrics: BTreeMap<String, f64>,
    pub report: Option<ClassificationReport>,
    pub predictions: Predictions,
}

/// What the trainer's evaluations report besides the loss, held for the run ([`Reported`]
/// borrows it for one evaluation).
#[derive(Default)]
pub struct EvalMetrics {
    /// Class names: a classification report (`None`: perplexity instead).
    pub label_names: Option<Vec<String>>,
    /// The user's metric over all predictions (classification).
    pub compute_metrics: Option<MetricFn>,
    /// The user's metric streamed per batch (causal LM).
    pub token_metrics: Option<std::sync::Arc<dyn TokenMetrics>>,
    /// A metric streamed over the training batches too, logged with the loss (TRL's preference
    /// trainers log their rewards at every logging step).
    pub train_metrics: Option<std::sync::Arc<dyn TokenMetrics>>,
    /// The loss is not a mean negative log-likelihood, so no perplexity is reported from it.
    pub no_perplexity: bool,
    /// Training logs TRL's `num_tokens`: the tokens (padding aside) trained on so far, over all
    /// data-parallel ranks.
    pub num_tokens: bool,
}

impl EvalMetrics {
    /// The metrics for one evaluation.
    pub fn reported(&self) -> Reported<'_> {
        Reported {
            label_names: self.label_names.as_deref(),
            compute_metrics: self.compute_metrics.as_ref(),
            token_metrics: self.token_metrics.as_deref(),
            no_perplexity: self.no_perplexity,
        }
    }
}

/// What an evaluation reports besides the loss.
#[derive(Default, Clone, Copy)]
pub struct Reported<'a> {
    /// Class names: a classification report (`None`: perplexity instead).
    pub label_names: Option<&'a [String]>,
    /// The user's metric over all predictions (classification).
    pub compute_metrics: Option<&'a MetricFn>,
    /// The user's metric streamed per batch (causal LM).
    pub token_metrics: Option<&'a dyn TokenMetrics>,
    /// No perplexity from the loss (see [`EvalMetrics::no_perplexity`]).
    pub no_perplexity: bool,
}

impl<'a> Reported<'a> {
    /// A classifier's report over `labels`.
    pub fn labels(labels: &'a [String]) -> Self {
        Self {
            label_names: Some(labels),
            ..Self::default()
        }
    }
}

/// Evaluates `model` on every example of `eval`, in order.
pub fn evaluate<B, M, E, L>(
    model: &M,
    eval: &E,
    batch_size: usize,
    loss_fn: &L,
    reported: Reported<'_>,
    parallel: &DataParallel<B>,
) -> Result<EvalOutput>
where
    B: crate::ops::KilnBackend,
    M: Model<B>,
    E: BatchSource<Batch = M::Batch>,
    L: Loss,
{
    let device = model
        .devices()
        .into_iter()
        .next()
        .expect("model has a device");
    let logits = |batch: &M::Batch| Ok(Some(model.logits(batch)));
    evaluate_by(
        logits, &device, eval, batch_size, loss_fn, reported, parallel,
    )
}

/// [`evaluate`] with each batch's logits from `logits_of`, on `device`. A rank whose
/// `logits_of` gives `None` (a pipeline stage before the last: it runs its layers and hands them
/// on) counts nothing for that batch; its metrics are then not the evaluation's.
pub fn evaluate_by<B, E, L>(
    mut logits_of: impl FnMut(&E::Batch) -> Result<Option<Tensor<B, 2>>>,
    device: &B::Device,
    eval: &E,
    batch_size: usize,
    loss_fn: &L,
    reported: Reported<'_>,
    parallel: &DataParallel<B>,
) -> Result<EvalOutput>
where
    B: crate::ops::KilnBackend,
    E: BatchSource,
    L: Loss,
{
    let Reported {
        label_names,
        token_metrics,
        ..
    } = reported;
    let start = Instant::now();
    let (mut loss_sum, mut count) = (0.0, 0usize);
    let mut preds = Predictions::default();
    // A batch of no tokens gives the metric's zeros, and their number.
    let mut token_sums: Vec<f64> = token_metrics
        .map(|m| m.batch(&[], 0, &[]))
        .unwrap_or_default();
    let mut token_values: Vec<(String, f64)> = Vec::new();
    crate::ops::take_activation_overflow();
    // This rank's examples (no padding: nothing counted twice).
    let order = parallel.eval_share(eval.len());
    for idx in order.chunks(batch_size.max(1)) {
        let (batch, targets) = eval.batch(idx);
        let counted = targets
            .iter()
            .filter(|&&t| t != crate::contract::IGNORE_INDEX)
            .count();
        let Some(logits) = logits_of(&batch)? else {
            continue;
        };
        let loss = loss_fn.loss(logits.clone(), targets_tensor::<B>(targets.clone(), device));
        let batch_loss = loss.into_scalar().elem::<f64>();
        if !batch_loss.is_finite() {
            return Err(KilnError::NonFinite(format!(
                "evaluation: the loss of eval examples {}..={} is {batch_loss}: the model gives \
                 non-finite logits (its weights diverged, or the eval data holds NaN)",
                idx[0],
                idx[idx.len() - 1]
            )));
        }
        loss_sum += batch_loss * counted as f64;
        count += counted;
        if let Some(m) = token_metrics {
            let vocab = logits.dims()[1];
            let host = logits.clone().into_data().convert::<f32>();
            let sums = m.batch(host.as_slice::<f32>().expect("f32 logits"), vocab, &targets);
            if sums.len() != token_sums.len() {
                return Err(KilnError::Config(format!(
                    "the causal-LM metric gave {} sums for a batch and {} for no tokens",
                    sums.len(),
                    token_sums.len()
                )));
            }
            token_sums.iter_mut().zip(sums).for_each(|(t, s)| *t += s);
        }
        if label_names.is_some() {
            let rows = host_rows(logits);
            if let Some(r) = rows.iter().position(|r| r.iter().any(|v| !v.is_finite())) {
                return Err(KilnError::NonFinite(format!(
                    "evaluation: eval example {} has non-finite logits {:?}",
                    idx[r], rows[r]
                )));
            }
            preds.logits.extend(rows);
            preds
                .labels
                .extend(targets.iter().map(|&t| t.max(0) as usize));
        }
    }
    if crate::ops::take_activation_overflow() {
        return Err(KilnError::NonFinite(
            "evaluation: the activations are not finite (a LayerNorm/RMSNorm input overflowed f32 \
             or held NaN): the model's outputs collapsed; its weights diverged"
                .into(),
        ));
    }
    if parallel.size() > 1 {
        let classes = label_names.map_or(0, |l| l.len());
        (preds, loss_sum, count) = gather_ranks(
            parallel,
            (eval.len(), &order),
            classes,
            &preds,
            (loss_sum, count),
        )?;
    }
    if let Some(m) = token_metrics {
        if parallel.size() > 1 {
            let summed = parallel.sum_host(token_sums.iter().map(|&v| v as f32).collect())?;
            token_sums = summed.into_iter().map(f64::from).collect();
        }
        for (k, v) in m.finish(&token_sums) {
            let k = if k.starts_with("eval_") {
                k
            } else {
                format!("eval_{k}")
            };
            token_values.push((k, v));
        }
    }
    let runtime = start.elapsed().as_secs_f64();
    let eval_loss = loss_sum / count.max(1) as f64;
    let (mut metrics, report) = reported_metrics(eval_loss, &preds, reported, token_values);
    metrics.insert("eval_runtime".into(), round4(runtime));
    metrics.insert(
        "eval_samples_per_second".into(),
        round3(eval.len() as f64 / runtime),
    );
    // transformers counts a step as one batch of every rank together.
    let steps = eval.len().div_ceil(batch_size.max(1) * parallel.size());
    metrics.insert(
        "eval_steps_per_second".into(),
        round3(steps as f64 / runtime),
    );
    Ok(EvalOutput {
        metrics,
        report,
        predictions: preds,
    })
}

/// Every rank's predictions put back in the examples' global order on every rank (each example's
/// logits and label as one row), and the loss sum and target count added over the ranks (the
/// count exactly: [`DataParallel::sum_exact`]). `examples`: how many the eval set has, and this
/// rank's share of them.
fn gather_ranks<B: crate::ops::KilnBackend>(
    parallel: &DataParallel<B>,
    (examples, order): (usize, &[usize]),
    classes: usize,
    preds: &Predictions,
    (loss_sum, count): (f64, usize),
) -> Result<(Predictions, f64, usize)> {
    let rows: Vec<Vec<f32>> = preds
        .logits
        .iter()
        .zip(&preds.labels)
        .map(|(logits, &label)| logits.iter().copied().chain([label as f32]).collect())
        .collect();
    let width = if classes > 0 { classes + 1 } else { 0 };
    let (rows, totals) =
        parallel.gather_rows(examples, width, order, &rows, [loss_sum as f32, 0.0])?;
    let mut gathered = Predictions::default();
    for row in rows {
        gathered.logits.push(row[..classes].to_vec());
        gathered.labels.push(row[classes] as usize);
    }
    let count = parallel.sum_exact(&[count as u64])?[0] as usize;
    Ok((gathered, totals[0] as f64, count))
}

/// The evaluation's metrics under transformers' `eval_*` names: the loss, the classification
/// report or the perplexity, the streamed metric's values and the user's `compute_metrics`.
fn reported_metrics(
    eval_loss: f64,
    preds: &Predictions,
    reported: Reported<'_>,
    token_values: Vec<(String, f64)>,
) -> (BTreeMap<String, f64>, Option<ClassificationReport>) {
    let mut metrics = BTreeMap::new();
    metrics.insert("eval_loss".to_string(), eval_loss);
    let mut report = None;
    match reported.label_names {
        Some(names) => {
            let r = classification_report(&preds.labels, &preds.predicted(), names);
            metrics.insert("eval_accuracy".into(), r.accuracy);
            metrics.insert("eval_f1".into(), r.f1_weighted);
            metrics.insert("eval_f1_weighted".into(), r.f1_weighted);
            metrics.insert("eval_f1_macro".into(), r.f1_macro);
            report = Some(r);
        }
        None if reported.no_perplexity => {}
        None => {
            metrics.insert("eval_perplexity".into(), eval_loss.exp());
        }
    }
    metrics.extend(token_values);
    if let Some(f) = reported.compute_metrics {
        for (k, v) in f(preds) {
            let k = if k.starts_with("eval_") {
                k
            } else {
                format!("eval_{k}")
            };
            metrics.insert(k, v);
        }
    }
    (metrics, report)
}

/// The targets as an integer tensor on `device`.
pub(super) fn targets_tensor<B: Backend>(t: Vec<i64>, device: &B::Device) -> Tensor<B, 1, Int> {
    let n = t.len();
    Tensor::from_data(TensorData::new(t, [n]), device)
}

/// Rows of a `[N, C]` tensor as host vectors.
fn host_rows<B: Backend>(t: Tensor<B, 2>) -> Vec<Vec<f32>> {
    let [_, c] = t.dims();
    let v = t
        .into_data()
        .convert::<f32>()
        .into_vec::<f32>()
        .expect("f32");
    v.chunks(c.max(1)).map(|r| r.to_vec()).collect()
}

pub(super) fn round3(x: f64) -> f64 {
    (x * 1e3).round() / 1e3
}

pub(super) fn round4(x: f64) -> f64 {
    (x * 1e4).round() / 1e4
}
