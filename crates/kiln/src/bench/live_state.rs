//! The `live_state` row: what publishing each rank's live state (`kiln top`) costs a step. The
//! whole Trainer fine-tunes MiniLM on the tweets, in rounds that alternate live state on and off
//! (on, off, off, on, …, so a drift of the machine's speed falls on both alike); the row is the
//! runs with it on, its baseline the runs with it off, measured in the same process.

use std::path::Path;

use super::workloads::StepWork;
use super::BenchResult;
use crate::error::{KilnError, Result};
use crate::ops::TrainBackend;
use crate::tasks::text_classification::{self as tc, ClassificationOptions};
use crate::train::{CrossEntropy, IntervalStrategy, SaveStrategy, TrainingArguments};

/// `rounds` runs of `steps` steps each way (batch `batch`); times per step from each run's
/// `train_runtime` (the steps only: no loading, no saving).
pub fn live_state_overhead<B: TrainBackend>(
    model_dir: &Path,
    tweets: &Path,
    (batch, steps, rounds): (usize, usize, usize),
    device: &B::Device,
) -> Result<BenchResult> {
    let opts = ClassificationOptions {
        model_dir: model_dir.to_path_buf(),
        data: super::workloads::tweets_data(tweets, steps * batch),
        max_length: 128,
        pad_to_max_length: false,
        pad_to_multiple_of: None,
        lora: None,
        lora_base_dtype: Default::default(),
    };
    let scratch = std::env::temp_dir().join(format!("kiln-bench-live-{}", std::process::id()));
    let run = |live: bool, round: usize| -> Result<f64> {
        let args = TrainingArguments {
            output_dir: scratch.join(format!("{round}-{live}")),
            max_steps: steps as i64,
            per_device_train_batch_size: batch,
            logging_strategy: IntervalStrategy::No,
            save_strategy: SaveStrategy::No,
            report_to: crate::train::args::ReportTo::parse("none").expect("a known value"),
            ..TrainingArguments::default()
        };
        let (out, _) = tc::train::<B, _>(&opts, args, device, CrossEntropy, |t| {
            t.live_state(live).progress(false)
        })?;
        out.metrics
            .get("train_runtime")
            .map(|r| r / steps as f64)
            .ok_or_else(|| KilnError::Config("training reported no train_runtime".into()))
    };
    let (mut on, mut off) = (Vec::new(), Vec::new());
    // One untimed run of each first: page cache, allocator and thread pools warm.
    run(true, 0)?;
    run(false, 0)?;
    for round in 1..=rounds {
        let first = round % 2 == 1;
        for live in [first, !first] {
            let t = run(live, round)?;
            if live {
                on.push(t)
            } else {
                off.push(t)
            };
        }
    }
    let _ = std::fs::remove_dir_all(&scratch);
    let work = vec![
        StepWork {
            samples: batch,
            padded_seq: 0,
            tokens: 0,
            flops: 0.0,
        };
        rounds
    ];
    let mut row = BenchResult::from_times("live_state_on", &on, &work);
    let mut baseline = BenchResult::from_times("live_state_off", &off, &work);
    row.warmup = 1;
    baseline.warmup = 1;
    row.baseline = Some(Box::new(baseline));
    Ok(row)
}
