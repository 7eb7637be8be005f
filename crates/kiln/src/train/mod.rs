//! Training: arguments, the loop, optimizer, schedules, metrics and checkpoints.

pub mod args;
pub mod checkpoint;
pub mod metrics;
pub mod optim;
pub mod output_dir;
pub mod schedule;
pub mod task;
pub mod trainer;

pub use args::{IntervalStrategy, TrainingArguments};
pub use optim::OptimizerType;
pub use task::{BatchSource, Classifier, CrossEntropy, Loss, IGNORE_INDEX};
pub use trainer::{EvalOutput, MetricFn, TrainOutput, Trainer};
