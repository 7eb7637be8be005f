//! How a [`Trainer`] is put together: the arguments, the model and the device it needs, and what
//! a caller may add (a loss, the files a checkpoint carries, the run's parallelism, the metrics an
//! evaluation reports, how the run reports itself), each with a default, as transformers'
//! `Trainer(model, args, compute_metrics=...)` takes keyword arguments.

use std::sync::Arc;

use burn::module::AutodiffModule;

use super::{adamw_config, Counters, Trainer};
use crate::contract::{CrossEntropy, Loss, Model};
use crate::ops::TrainBackend;
use crate::train::args::TrainingArguments;
use crate::train::checkpoint::{Checkpointer, ModelFiles, TrainerState};
use crate::train::evaluate::{EvalMetrics, MetricFn, TokenMetrics};
use crate::train::optim::Optimizer;
use crate::train::parallel_plan::ParallelPlan;
use crate::train::reporters::{Reporters, Reporting, RunOrigin};

/// A [`Trainer`] being configured: [`Trainer::builder`], the setters, then [`Self::build`].
pub struct TrainerBuilder<B: TrainBackend, M, L = CrossEntropy> {
    args: TrainingArguments,
    model: M,
    device: B::Device,
    loss: L,
    files: ModelFiles,
    parallel: Option<ParallelPlan<B::InnerBackend>>,
    metrics: EvalMetrics,
    reporting: Reporting,
}

impl<B, M> TrainerBuilder<B, M, CrossEntropy>
where
    B: TrainBackend,
{
    pub(super) fn new(args: TrainingArguments, model: M, device: B::Device) -> Self {
        Self {
            args,
            model,
            device,
            loss: CrossEntropy,
            files: ModelFiles::default(),
            parallel: None,
            metrics: EvalMetrics::default(),
            reporting: Reporting::default(),
        }
    }
}

impl<B, M, L> TrainerBuilder<B, M, L>
where
    B: TrainBackend,
    M: AutodiffModule<B> + Model<B> + Clone,
    M::InnerModule: Model<B::InnerBackend, Batch = M::Batch>,
    L: Loss,
{
    /// The loss the model trains on (default: transformers' cross-entropy).
    pub fn loss<L2: Loss>(self, loss: L2) -> TrainerBuilder<B, M, L2> {
        TrainerBuilder {
            args: self.args,
            model: self.model,
            device: self.device,
            loss,
            files: self.files,
            parallel: self.parallel,
            metrics: self.metrics,
            reporting: self.reporting,
        }
    }

    /// What a checkpoint carries besides the weights: the model's config, its tokenizer's files,
    /// an adapter's settings (default: none of them).
    pub fn files(mut self, files: ModelFiles) -> Self {
        self.files = files;
        self
    }

    /// The run's parallelism (default: this process alone, [`ParallelPlan::single`]).
    pub fn parallel(mut self, plan: ParallelPlan<B::InnerBackend>) -> Self {
        self.parallel = Some(plan);
        self
    }

    /// Class names: evaluations report per-class precision, recall and F1 (default: none, and a
    /// perplexity instead).
    pub fn label_names(mut self, names: Vec<String>) -> Self {
        self.metrics.label_names = Some(names);
        self
    }

    /// The user's metric over an evaluation's predictions (transformers' `compute_metrics`).
    pub fn compute_metrics(mut self, metric: MetricFn) -> Self {
        self.metrics.compute_metrics = Some(metric);
        self
    }

    /// The user's metric streamed over a causal LM's evaluation batches.
    pub fn token_metrics(mut self, metric: Option<Arc<dyn TokenMetrics>>) -> Self {
        self.metrics.token_metrics = metric;
        self
    }

    /// A metric streamed over the training batches as well as the evaluations', its values
    /// logged with the loss at every logging step (averaged over the steps since the last log).
    pub fn train_metrics(mut self, metric: Arc<dyn TokenMetrics>) -> Self {
        self.metrics.train_metrics = Some(metric);
        self
    }

    /// Training logs TRL's `num_tokens` at every logging step: the tokens (padding aside) trained
    /// on so far over all data-parallel ranks, as TRL's SFT, DPO and reward trainers log them.
    pub fn log_num_tokens(mut self) -> Self {
        self.metrics.num_tokens = true;
        self
    }

    /// Evaluations report no perplexity: the loss is not a mean negative log-likelihood
    /// (default: a causal LM's evaluation reports `exp(eval_loss)`).
    pub fn no_perplexity(mut self) -> Self {
        self.metrics.no_perplexity = true;
        self
    }

    /// Whether rank 0 shows a progress bar when interactive (default: yes).
    pub fn progress(mut self, show: bool) -> Self {
        self.reporting.progress = show;
        self
    }

    /// Whether every rank publishes its live state for `kiln top` (default: yes).
    pub fn live_state(mut self, publish: bool) -> Self {
        self.reporting.live_state = publish;
        self
    }

    /// The GPU this rank trains on, for the live state's GPU figures (default: the one given to
    /// [`crate::report::live::set_gpu_index`]).
    pub fn gpu_index(mut self, index: u32) -> Self {
        self.reporting.gpu_index = Some(index);
        self
    }

    /// Where the run's model and data came from, for the model card.
    pub fn origin(mut self, origin: RunOrigin) -> Self {
        self.reporting.origin = origin;
        self
    }

    pub fn build(self) -> Trainer<B, M, L> {
        // Built again from the checked arguments when training starts (optim_args may be bad).
        let optimizer = Optimizer::new(self.args.optim, adamw_config(&self.args));
        Trainer {
            args: self.args,
            model: Some(self.model),
            device: self.device,
            loss: self.loss,
            metrics: self.metrics,
            files: self.files,
            state: TrainerState::default(),
            optimizer,
            parallel: self.parallel.unwrap_or_else(ParallelPlan::single),
            checkpointer: Checkpointer::default(),
            plateau: None,
            reporters: Reporters::default(),
            reporting: self.reporting,
            counters: Counters::default(),
        }
    }
}
