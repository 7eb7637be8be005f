//! One optimizer step: each micro-batch's forward and backward (on this rank, or as a pipeline
//! stage's share of the schedule), its loss weighted by its share of the step's targets, the
//! gradients synced and clipped, the update applied, or the step skipped when it is not finite.

use std::time::Instant;

use burn::module::AutodiffModule;
use burn::tensor::ElementConversion;

use super::*;
use crate::contract::{BatchSource, Loss, Model};
use crate::error::{KilnError, Result};
use crate::ops::{profile, TrainBackend};
use crate::train::activation_checkpointing::loss_and_grads_by_segment;
use crate::train::evaluate::targets_tensor;
use crate::train::grad_sync::Synced;
use crate::train::optim::GradAccumulator;
use crate::train::pipeline::stage_loss_and_grads;
use crate::train::run_sizes::RunSizes;

impl<B, M, L> Trainer<B, M, L>
where
    B: TrainBackend,
    M: AutodiffModule<B> + Model<B> + Clone,
    M::InnerModule: Model<B::InnerBackend, Batch = M::Batch>,
    L: Loss,
{
    /// One optimizer step over the micro-batches of `group`: forward and backward of each
    /// (accumulating gradients), the data-parallel average, global-norm clipping and the update —
    /// or, for a non-finite loss or norm, the skip `--skip-nonfinite-steps` allows.
    pub(in crate::train) fn optimizer_step<S>(
        &mut self,
        train: &S,
        group: &[&[usize]],
        plan: &RunSizes,
    ) -> Result<StepOutcome>
    where
        S: BatchSource<Batch = M::Batch>,
    {
        let started = Instant::now();
        // Dropout masks come from a stream re-seeded per step: resuming is exact.
        let step_seed = self
            .args
            .seed
            .wrapping_mul(1_000_003)
            .wrapping_add(self.state.global_step);
        crate::ops::reseed_dropout(step_seed);
        let batches: Vec<_> = group.iter().map(|idx| train.batch(idx)).collect();
        let scales = self.micro_batch_scales(batches.iter().map(|(_, t)| t.as_slice()))?;
        // The work counted once, whichever way the passes run.
        let samples: usize = group.iter().map(|idx| idx.len()).sum();
        let mut tokens = 0;
        for (batch, _) in &batches {
            let numel = self.model().input_ids_numel(batch);
            tokens += numel;
            self.counters.tokens_since_log += self.model().attended_tokens(batch) as u64;
            self.counters.current_flos += 6.0 * numel as f64 * self.counters.flos_params;
        }
        let ForwardBackward {
            mut loss_sum,
            grads: acc,
            stage_wait,
            metric_sums,
        } = if self.parallel.pipeline().is_some() {
            self.forward_backward_staged(&batches, &scales)?
        } else {
            self.forward_backward_local(batches, scales)
        };
        add_sums(&mut self.counters.train_metric_sums, metric_sums);
        // Overflowed activations make a finite-looking loss meaningless (the outputs collapsed):
        // the step counts as non-finite, on every rank through the average.
        let overflowed = crate::ops::take_activation_overflow();
        if overflowed {
            loss_sum = f64::NAN;
        }
        // Average gradients (and the logged loss) over ranks before clipping.
        let sync_start = Instant::now();
        let Synced {
            loss,
            grad_norm,
            grads,
        } = self
            .parallel
            .sync_and_clip(acc, loss_sum, &self.device, self.args.max_grad_norm)?;
        // Alone, the sync only adds up the norm: no waiting on peers.
        let collective_seconds = if self.parallel.alone() {
            0.0
        } else {
            stage_wait + sync_start.elapsed().as_secs_f64()
        };
        let _opt = profile::scope("step: clip + optimizer");
        let lr = self.lr(plan);
        // Every rank sees the same averaged loss and norm, so all decide alike.
        let finite = loss.is_finite() && grad_norm.is_finite();
        if finite {
            let model = self.take_model();
            self.model =
                Some(
                    self.parallel
                        .update::<B, M>(&mut self.optimizer, model, lr, grads)?,
                );
        } else {
            self.skip_nonfinite_step(loss, grad_norm, overflowed)?;
        }
        self.state.global_step += 1;
        self.state.epoch = self.state.global_step as f64 / plan.updates_per_epoch as f64;
        self.counters.last_step_loss = loss;
        Ok(StepOutcome {
            loss,
            grad_norm,
            lr,
            finite,
            // Every rank trains on as many examples.
            samples: samples * self.parallel.data.size(),
            rank_samples: samples,
            tokens,
            seconds: started.elapsed().as_secs_f64(),
            collective_seconds,
        })
    }

    /// Each micro-batch's forward and backward on this rank, its loss weighted by `scales`, the
    /// gradients accumulated (segment by segment under `--gradient-checkpointing`).
    fn forward_backward_local(
        &self,
        batches: Vec<(M::Batch, Vec<i64>)>,
        scales: Vec<f64>,
    ) -> ForwardBackward<B::InnerBackend> {
        let mut out = ForwardBackward {
            loss_sum: 0.0,
            grads: GradAccumulator::default(),
            stage_wait: 0.0,
            metric_sums: Vec::new(),
        };
        let mut losses = Vec::new();
        for ((batch, targets), scale) in batches.into_iter().zip(scales) {
            let fwd = profile::scope("step: data + forward");
            let mut observe = |logits: &burn::tensor::Tensor<B, 2>| {
                if let Some(m) = &self.metrics.train_metrics {
                    add_sums(
                        &mut out.metric_sums,
                        metric_sums(m.as_ref(), logits, &targets),
                    );
                }
            };
            let by_segment = if self.args.gradient_checkpointing {
                loss_and_grads_by_segment(
                    self.model(),
                    (&batch, &targets),
                    &self.loss,
                    scale,
                    &mut observe,
                )
            } else {
                None
            };
            if let Some((l, grads)) = by_segment {
                out.loss_sum += l;
                out.grads.merge(grads);
                continue;
            }
            let logits = self.model().logits(&batch);
            observe(&logits);
            let loss = self
                .loss
                .loss(logits, targets_tensor::<B>(targets, &self.device))
                * scale;
            // Read once every backward is queued: on a GPU, reading it here would make the host
            // wait for this forward to finish before queuing a single backward kernel.
            losses.push(loss.clone().inner());
            drop(fwd);
            let _bwd = profile::scope("step: backward");
            let grads = loss.backward();
            out.grads.accumulate::<B, M>(self.model(), &grads);
        }
        // Summed in micro-batch order, as when each was read before its backward.
        for loss in losses {
            out.loss_sum += loss.into_scalar().elem::<f64>();
        }
        out
    }

    /// This pipeline stage's share of every micro-batch, in the schedule's order; the step's
    /// loss is the last stage's, summed to every stage.
    fn forward_backward_staged(
        &mut self,
        batches: &[(M::Batch, Vec<i64>)],
        scales: &[f64],
    ) -> Result<ForwardBackward<B::InnerBackend>> {
        let _fwd = profile::scope("step: pipeline stage");
        let p = self.parallel.pipeline().expect("a pipeline stage");
        // The training metric's sums, on the last stage (the others keep its zeros).
        let metric = self.metrics.train_metrics.as_deref();
        let mut sums = metric.map(|m| m.batch(&[], 0, &[])).unwrap_or_default();
        let mut observe = |logits: &burn::tensor::Tensor<B, 2>, targets: &[i64]| {
            if let Some(m) = metric {
                add_sums(&mut sums, metric_sums(m, logits, targets));
            }
        };
        let got = stage_loss_and_grads(
            self.model(),
            batches,
            scales,
            &self.loss,
            (p.schedule(), self.args.gradient_checkpointing),
            &p.stage(),
            &mut observe,
        )?;
        let loss_sum = p.stage_sum(got.loss_sum)?;
        let metric_sums = match metric {
            Some(_) => p.stage_sums(&sums)?,
            None => Vec::new(),
        };
        self.counters.pipeline_seconds.0 += got.waited;
        self.counters.pipeline_seconds.1 += got.seconds;
        Ok(ForwardBackward {
            loss_sum,
            grads: got.grads,
            stage_wait: got.waited,
            metric_sums,
        })
    }

    /// What each micro-batch's mean loss is multiplied by in a step's loss. Most models: 1/n of
    /// n micro-batches, whose means are then averaged over the data-parallel ranks. A causal LM
    /// (as transformers' Trainer with `num_items_in_batch`): its micro-batch's share of the
    /// step's target tokens, counted over all ranks with `average_tokens_across_devices` (the
    /// scales are then multiplied by the ranks' number, which the ranks' average divides away),
    /// so a step's loss is the mean over all its target tokens.
    pub(super) fn micro_batch_scales<'t>(
        &self,
        targets: impl Iterator<Item = &'t [i64]>,
    ) -> Result<Vec<f64>> {
        let counts: Vec<f64> = targets
            .map(|t| {
                t.iter()
                    .filter(|&&x| x != crate::contract::IGNORE_INDEX)
                    .count() as f64
            })
            .collect();
        if !self.model().loss_over_step_tokens() {
            return Ok(vec![1.0 / counts.len().max(1) as f64; counts.len()]);
        }
        let local: f64 = counts.iter().sum();
        let ranks = self.parallel.data.size();
        let (total, ranks) = if self.args.average_tokens_across_devices && ranks > 1 {
            let total = self.parallel.data.sum_host(vec![local as f32])?[0] as f64;
            (total, ranks as f64)
        } else {
            (local, 1.0)
        };
        // A step without a target token (every one masked) adds nothing.
        Ok(counts.iter().map(|c| c * ranks / total.max(1.0)).collect())
    }

    /// A step whose loss or gradient norm is NaN/inf: its update is skipped while the budget of
    /// `--skip-nonfinite-steps` lasts; past it, training stops with an error naming the step.
    pub(super) fn skip_nonfinite_step(
        &mut self,
        loss: f64,
        grad_norm: f64,
        overflowed: bool,
    ) -> Result<()> {
        let step = self.state.global_step + 1;
        let budget = self.args.skip_nonfinite_steps;
        if self.counters.skipped_nonfinite < budget {
            self.counters.skipped_nonfinite += 1;
            tracing::warn!(
                "step {step}: loss {loss} / grad_norm {grad_norm} is not finite: update skipped \
                 ({} of --skip-nonfinite-steps {budget})",
                self.counters.skipped_nonfinite
            );
            return Ok(());
        }
        Err(KilnError::NonFinite(format!(
            "step {step}: {}: training diverged and stopped before this update; nothing after \
             step {} was saved (lower --learning-rate, check the data or the model, or let up to \
             N such steps be skipped with --skip-nonfinite-steps N{})",
            if overflowed {
                "the activations are not finite (a LayerNorm/RMSNorm input overflowed f32 or \
                 held NaN, and the layer's output collapsed)"
                    .to_string()
            } else if loss.is_finite() {
                format!("the gradient norm is {grad_norm} (loss {loss})")
            } else {
                format!("the loss is {loss} (grad_norm {grad_norm})")
            },
            step - 1,
            if budget > 0 {
                format!("; {budget} were skipped already")
            } else {
                String::new()
            }
        )))
    }
}

/// What a step's forward and backward passes give: the micro-batches' weighted losses summed, the
/// gradients accumulated, and (a pipeline stage) the seconds spent waiting for its neighbours.
struct ForwardBackward<B: burn::tensor::backend::Backend> {
    loss_sum: f64,
    grads: GradAccumulator<B>,
    stage_wait: f64,
    /// The training metric's sums over the micro-batches (empty without one).
    metric_sums: Vec<f64>,
}

/// A training metric's sums of one micro-batch, from its logits (no gradient is kept).
fn metric_sums<B: burn::tensor::backend::Backend>(
    metric: &dyn crate::train::trainer::TokenMetrics,
    logits: &burn::tensor::Tensor<B, 2>,
    targets: &[i64],
) -> Vec<f64> {
    let width = logits.dims()[1];
    let host = logits.clone().into_data().convert::<f32>();
    metric.batch(host.as_slice::<f32>().expect("f32 logits"), width, targets)
}

/// `more` added to `sums` element by element (`sums` empty: it becomes `more`).
fn add_sums(sums: &mut Vec<f64>, more: Vec<f64>) {
    if sums.is_empty() {
        *sums = more;
    } else {
        sums.iter_mut().zip(more).for_each(|(s, m)| *s += m);
    }
}
