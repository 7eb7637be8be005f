//! How a data-parallel rank's batch becomes a pipeline's micro-batches, with optimum-neuron's
//! semantics for its options:
//! - under pipeline parallelism the gradient-accumulation steps fold into the per-device batch
//!   (`per_device_train_batch_size × gradient_accumulation_steps`, accumulation 1): the pipeline's
//!   micro-batches are the accumulation;
//! - `--pipeline-parallel-num-microbatches` splits that batch; unset (optimum-neuron's −1), it is
//!   the batch itself, i.e. micro-batches of one example;
//! - the batch must divide into the micro-batches evenly.
//!
//! A step is then `micro_batches` micro-batches of `micro_batch_size` examples on every
//! data-parallel rank: `world = TP × PP × DP` and the global batch is
//! `micro_batches × micro_batch_size × DP`.

use crate::{KilnError, Result};

/// One data-parallel rank's step under pipeline parallelism.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MicroBatches {
    /// Micro-batches per optimizer step (the schedule's `m`).
    pub micro_batches: usize,
    /// Examples in each.
    pub micro_batch_size: usize,
}

impl MicroBatches {
    /// The split of `per_device_train_batch_size × gradient_accumulation_steps` examples into
    /// `num_microbatches` micro-batches (all of them one example each when `None`). An error is
    /// one sentence naming the options.
    pub fn settle(
        per_device_train_batch_size: usize,
        gradient_accumulation_steps: usize,
        num_microbatches: Option<usize>,
    ) -> Result<Self> {
        let accumulation = gradient_accumulation_steps.max(1);
        let batch = per_device_train_batch_size
            .checked_mul(accumulation)
            .filter(|&b| b > 0)
            .ok_or_else(|| {
                KilnError::Config(format!(
                    "--per-device-train-batch-size {per_device_train_batch_size} × \
                     --gradient-accumulation-steps {gradient_accumulation_steps} is not a batch a \
                     pipeline can split (it is 0, or too large to count)"
                ))
            })?;
        let m = num_microbatches.unwrap_or(batch);
        if m == 0 {
            return Err(KilnError::Config(
                "--pipeline-parallel-num-microbatches must be at least 1".into(),
            ));
        }
        if !batch.is_multiple_of(m) {
            return Err(KilnError::Config(format!(
                "--pipeline-parallel-num-microbatches {m} does not divide the per-device batch of \
                 {batch} (--per-device-train-batch-size {per_device_train_batch_size} × \
                 --gradient-accumulation-steps {gradient_accumulation_steps}): give a divisor of \
                 {batch}"
            )));
        }
        Ok(Self {
            micro_batches: m,
            micro_batch_size: batch / m,
        })
    }

    /// Examples per optimizer step over `dp` data-parallel replicas.
    pub fn global_batch(&self, dp: usize) -> usize {
        self.micro_batches * self.micro_batch_size * dp
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_batch_splits_as_optimum_neuron_splits_it() {
        // Unset: micro-batches of one example (optimum-neuron's -1).
        let mb = MicroBatches::settle(8, 1, None).unwrap();
        assert_eq!((mb.micro_batches, mb.micro_batch_size), (8, 1));
        // Accumulation folds into the pipeline's batch.
        let mb = MicroBatches::settle(4, 2, Some(4)).unwrap();
        assert_eq!((mb.micro_batches, mb.micro_batch_size), (4, 2));
        assert_eq!(mb.global_batch(2), 16);
        let mb = MicroBatches::settle(6, 1, Some(1)).unwrap();
        assert_eq!((mb.micro_batches, mb.micro_batch_size), (1, 6));
    }

    #[test]
    fn a_batch_that_does_not_divide_is_one_sentence() {
        let e = MicroBatches::settle(6, 1, Some(4)).unwrap_err().to_string();
        assert!(
            e.contains(
                "--pipeline-parallel-num-microbatches 4 does not divide the per-device batch of 6"
            ),
            "{e}"
        );
        let e = MicroBatches::settle(6, 1, Some(0)).unwrap_err().to_string();
        assert!(e.contains("at least 1"), "{e}");
        for (per_device, accumulation) in [(0, 1), (usize::MAX, 2)] {
            let e = MicroBatches::settle(per_device, accumulation, None)
                .unwrap_err()
                .to_string();
            assert!(e.contains("is not a batch a pipeline can split"), "{e}");
        }
    }
}
