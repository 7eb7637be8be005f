//! The AWS Neuron `mnist_mlp` sample, reproduced: MLP 784-120-84-10 on real MNIST (IDX files),
//! plain SGD with lr = 0.01 × world size, batch 32 per worker, 4 epochs, seed 0, pixels / 255, and
//! the sample's output lines. Data parallel through `kiln launch` like every kiln task.

use std::path::Path;

use serde_json::json;

use crate::contract::BatchSource;
use crate::data::idx::read_idx;
use crate::formats::safetensors::read_safetensors;
use crate::models::mlp::{MnistMlp, PixelBatch, CLASSES, INPUT};
use crate::models::params::load_into;
use crate::ops::{KilnBackend, TrainBackend};
use crate::train::checkpoint::ModelFiles;
use crate::train::schedule::SchedulerType;
use crate::train::trainer::{evaluate, EvalOutput, Reported, TrainOutput, Trainer};
use crate::train::ParallelPlan;
use crate::train::{CrossEntropy, OptimizerType, TrainingArguments};
use crate::{KilnError, Result};

/// One split of MNIST: `n` images of 28×28 bytes and their digits.
#[derive(Debug, Clone)]
pub struct MnistSplit {
    pub images: Vec<u8>,
    pub labels: Vec<u8>,
}

/// Reads `{split}-images-idx3-ubyte` and `{split}-labels-idx1-ubyte` (or `.gz`) from `dir`;
/// `split` is `train` or `t10k`.
pub fn load_split(dir: &Path, split: &str) -> Result<MnistSplit> {
    let images = read_idx(&dir.join(format!("{split}-images-idx3-ubyte")))?;
    let labels = read_idx(&dir.join(format!("{split}-labels-idx1-ubyte")))?;
    if images.dims.len() != 3 || images.dims[1] * images.dims[2] != INPUT {
        return Err(KilnError::Data(format!(
            "{}: images are {:?}, expected [n, 28, 28]",
            dir.display(),
            images.dims
        )));
    }
    if labels.dims != [images.dims[0]] {
        return Err(KilnError::Data(format!(
            "{}: {} images but labels {:?}",
            dir.display(),
            images.dims[0],
            labels.dims
        )));
    }
    if let Some(bad) = labels.data.iter().position(|&l| l as usize >= CLASSES) {
        return Err(KilnError::Data(format!(
            "{}: label {} at index {bad} is not a digit",
            dir.display(),
            labels.data[bad]
        )));
    }
    Ok(MnistSplit {
        images: images.data,
        labels: labels.data,
    })
}

impl BatchSource for MnistSplit {
    type Batch = PixelBatch;
    fn len(&self) -> usize {
        self.labels.len()
    }
    fn lengths(&self) -> Vec<usize> {
        vec![1; self.len()]
    }
    fn batch(&self, indices: &[usize]) -> (PixelBatch, Vec<i64>) {
        let mut pixels = Vec::with_capacity(indices.len() * INPUT);
        for &i in indices {
            pixels.extend(
                self.images[i * INPUT..(i + 1) * INPUT]
                    .iter()
                    .map(|&p| p as f32 / 255.0),
            );
        }
        let targets = indices.iter().map(|&i| self.labels[i] as i64).collect();
        (
            PixelBatch {
                n: indices.len(),
                pixels,
            },
            targets,
        )
    }
}

/// The sample's settings as TrainingArguments defaults (a flag or config file still overrides;
/// see [`crate::train::ArgLayers::defaults`]).
pub fn sample_defaults(world_size: usize) -> serde_json::Map<String, serde_json::Value> {
    let serde_json::Value::Object(defaults) = json!({
        "learning_rate": 0.01 * world_size as f64,
        "per_device_train_batch_size": 32,
        "per_device_eval_batch_size": 32,
        "num_train_epochs": 4.0,
        "seed": 0,
        "optim": OptimizerType::Sgd,
        "lr_scheduler_type": SchedulerType::Constant,
        "max_grad_norm": 0.0,
        "weight_decay": 0.0,
        "logging_steps": 500,
        "save_strategy": "no",
        "eval_strategy": "no",
    }) else {
        unreachable!("an object literal")
    };
    defaults
}

fn digits() -> Vec<String> {
    (0..CLASSES).map(|d| d.to_string()).collect()
}

fn files() -> ModelFiles {
    ModelFiles {
        config_json: serde_json::to_string_pretty(&json!({
            "model_type": "kiln_mnist_mlp",
            "architectures": ["MnistMlp"],
            "layer_sizes": [INPUT, 120, 84, CLASSES],
            "id2label": (0..CLASSES).map(|d| (d.to_string(), json!(d.to_string()))).collect::<serde_json::Map<_, _>>(),
        }))
        .expect("json"),
        tokenizer_json: None,
        copy: Vec::new(),
        source_dir: None,
        adapter: None,
    }
}

/// Trains the MLP on `data_dir`'s training split and prints the sample's lines (rank 0).
pub fn train<B: TrainBackend>(
    data_dir: &Path,
    args: TrainingArguments,
    device: &B::Device,
) -> Result<TrainOutput> {
    let train = load_split(data_dir, "train")?;
    let model =
        crate::ops::with_seeded_rng::<B, _>(device, args.seed, || MnistMlp::<B>::new(device));
    let plan = ParallelPlan::new(crate::parallel::DataParallel::join(device)?);
    let mut trainer = Trainer::<B, _>::builder(args, model, device.clone())
        .files(files())
        .parallel(plan)
        .label_names(digits())
        .build();
    let out = trainer.train(&train, None::<&MnistSplit>)?;
    if trainer.is_main() {
        println!(
            "Train throughput (iter/sec): {}",
            out.metrics["train_steps_per_second"]
        );
        println!("Final loss is {:.4}", trainer.last_step_loss());
        println!("----------End Training ---------------");
    }
    Ok(out)
}

/// Evaluates a saved MLP on `data_dir`'s test split; prints the sample's lines.
pub fn eval<B: KilnBackend>(
    model_dir: &Path,
    data_dir: &Path,
    batch_size: usize,
    device: &B::Device,
) -> Result<EvalOutput> {
    let test = load_split(data_dir, "t10k")?;
    let weights = read_safetensors(&model_dir.join("model.safetensors"))?;
    let (model, report) = load_into(MnistMlp::<B>::new(device), weights, None, device)?;
    if !report.missing.is_empty() {
        return Err(KilnError::Weights(format!(
            "{}: not an MNIST MLP checkpoint (missing {:?})",
            model_dir.display(),
            report.missing
        )));
    }
    let out = evaluate(
        &model,
        &test,
        batch_size,
        &CrossEntropy,
        Reported::labels(&digits()),
        &crate::parallel::DataParallel::single(),
    )?;
    let iters = test.len().div_ceil(batch_size.max(1)) as f64;
    println!(
        "Test throughput (iter/sec): {:.3}",
        iters / out.metrics["eval_runtime"].max(1e-4)
    );
    println!("Accuracy: {:.4}", out.metrics["eval_accuracy"]);
    Ok(out)
}
