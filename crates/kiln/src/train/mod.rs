//! Training: arguments, the loop, optimizer, schedules, metrics and checkpoints.

pub mod activation_checkpointing;
pub mod args;
pub mod card_hyperparameters;
pub mod checkpoint;
pub mod evaluate;
pub mod grad_sync;
pub mod hf_fields;
pub mod hf_values;
pub mod metrics;
pub mod optim;
pub mod output_dir;
pub mod parallel_plan;
pub mod pipeline;
pub mod precompile;
pub mod reporters;
pub mod reshard;
pub mod run_sizes;
pub mod schedule;
pub mod trainer;

pub use args::{ArgLayers, IntervalStrategy, PipelineOptions, SaveStrategy, TrainingArguments};
pub use evaluate::EvalMetrics;
pub use optim::OptimizerType;
pub use parallel_plan::{ModelOutline, ParallelPlan};
pub use reporters::{Reporting, RunOrigin};
// The task contract, re-exported where library users of the trainer look for it.
pub use crate::contract::{
    BatchSource, CrossEntropy, LabelSmoothedCrossEntropy, Loss, Model, IGNORE_INDEX,
};
pub use trainer::{EvalOutput, MetricFn, TokenMetrics, TrainOutput, Trainer, TrainerBuilder};
