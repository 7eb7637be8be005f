//! The sizes of a run — examples, micro-batch, accumulation, updates per epoch, total and warmup
//! steps, and the learning-rate schedule — derived once from the data, the arguments and the world
//! when training starts.

use burn::tensor::backend::Backend;

use super::args::TrainingArguments;
use super::schedule::Schedule;
use crate::parallel::pipeline::MicroBatches;
use crate::parallel::DataParallel;
use crate::{KilnError, Result};

/// The sizes of a run, derived once from the data, the arguments and the world.
pub struct RunSizes {
    pub(super) examples: usize,
    /// Examples per micro-batch, and micro-batches per optimizer step (the accumulation steps,
    /// or under pipeline parallelism its micro-batches).
    pub(super) batch_size: usize,
    pub(super) accumulation: usize,
    pub(super) updates_per_epoch: u64,
    pub(super) total: u64,
    pub(super) warmup: u64,
    pub(super) schedule: Schedule,
}

impl RunSizes {
    pub(super) fn new<B: Backend>(
        a: &TrainingArguments,
        n: usize,
        parallel: &DataParallel<B>,
        micro: Option<MicroBatches>,
    ) -> Result<Self> {
        // Each rank trains on its shard of every epoch: equal counts on all ranks.
        let n_rank = parallel.examples_per_rank(n, a.dataloader_drop_last);
        let (bs, accumulation) = match micro {
            Some(m) => (m.micro_batch_size, m.micro_batches),
            None => (a.per_device_train_batch_size, a.gradient_accumulation_steps),
        };
        let batches_per_epoch = if a.dataloader_drop_last {
            n_rank / bs
        } else {
            n_rank.div_ceil(bs)
        };
        if batches_per_epoch == 0 {
            return Err(KilnError::Data(format!(
                "{n} training examples make no full batch of {bs} (dataloader_drop_last)"
            )));
        }
        let updates_per_epoch = batches_per_epoch.div_ceil(accumulation) as u64;
        let total = if a.max_steps > 0 {
            a.max_steps as u64
        } else {
            (a.num_train_epochs * updates_per_epoch as f64).ceil() as u64
        };
        // Ratios of eval_steps / save_steps become step counts only now.
        a.check_best_checkpoints(total)?;
        let warmup = a.warmup_of(total);
        let schedule = Schedule::new(
            a.lr_scheduler_type,
            a.lr_scheduler_kwargs.as_ref(),
            a.learning_rate,
        )
        .map_err(KilnError::Config)?;
        Ok(Self {
            examples: n,
            batch_size: bs,
            accumulation,
            updates_per_epoch,
            total,
            warmup,
            schedule,
        })
    }

    /// The learning rate of the update after `step` updates.
    pub(super) fn lr(&self, a: &TrainingArguments, step: u64) -> f64 {
        a.learning_rate * self.schedule.factor(step, self.warmup, self.total)
    }
}
