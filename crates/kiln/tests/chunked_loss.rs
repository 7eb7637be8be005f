//! The causal-LM loss computed inside the output head a chunk of positions at a time
//! (`CausalLmOptions::loss_chunk`, the default) against the whole logits' cross-entropy
//! (`loss_chunk = Some(0)`): the same training, step by step (loss and gradient norm within f32
//! rounding) and in the end (weights, evaluation), for an untied head (the tiny chat Llama of the
//! DPO fixtures) and a head tied to the embedding (the tiny Qwen2 of the family fixtures), with
//! chunks that do not divide the batch's positions.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use kiln::backend::{CpuDevice, CpuTrain};
use kiln::formats::safetensors::read_safetensors;
use kiln::tasks::causal_lm::{self, CausalLmOptions};
use kiln::train::{IntervalStrategy, SaveStrategy, TrainingArguments};
use serde_json::Value;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// A small corpus: sentences of varied lengths.
fn corpus(dir: &Path) -> PathBuf {
    let path = dir.join("corpus.jsonl");
    let lines: String = (0..24)
        .map(|i| {
            let text = format!(
                "Document {i}: the quick brown fox {} over the lazy dog, {} times before noon.",
                ["jumps", "leaps", "runs", "walks"][i % 4],
                i * 7 % 13
            );
            serde_json::json!({ "text": text }).to_string() + "\n"
        })
        .collect();
    std::fs::write(&path, lines).unwrap();
    path
}

/// A run's step log, final evaluation and final weights.
type Outcome = (
    Vec<Value>,
    BTreeMap<String, f64>,
    BTreeMap<String, Vec<f32>>,
);

/// Four SGD steps of causal-LM training of `model` with the loss chunked `chunk` positions at
/// a time (0: the whole logits); the log, the evaluation and the final weights. SGD, not AdamW:
/// AdamW divides each gradient by its own size, so a rounding-sized difference of a gradient
/// near 0 could move a weight by the whole learning rate, and the comparison would have to be
/// loose.
fn run(model: &Path, data: &Path, out: &Path, chunk: usize) -> Outcome {
    let opts = CausalLmOptions {
        model_dir: Some(model.to_path_buf()),
        train_file: Some(data.to_path_buf()),
        eval_file: Some(data.to_path_buf()),
        text_column: "text".into(),
        block_size: 19,
        loss_chunk: Some(chunk),
        ..CausalLmOptions::default()
    };
    let args = TrainingArguments {
        output_dir: out.to_path_buf(),
        max_steps: 4,
        per_device_train_batch_size: 3,
        per_device_eval_batch_size: 4,
        learning_rate: 0.5,
        optim: kiln::train::optim::OptimizerType::Sgd,
        logging_steps: 1.0,
        save_strategy: SaveStrategy::No,
        eval_strategy: IntervalStrategy::No,
        seed: 7,
        ..TrainingArguments::default()
    };
    let (_, eval) = causal_lm::train::<CpuTrain>(&opts, args, &CpuDevice::default()).unwrap();
    let log = std::fs::read_to_string(out.join("log.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .filter(|e: &Value| e.get("loss").is_some() && e.get("train_loss").is_none())
        .collect();
    let weights = read_safetensors(&out.join("model.safetensors"))
        .unwrap()
        .into_iter()
        .map(|(k, t)| (k, t.data))
        .collect();
    (log, eval.unwrap().metrics, weights)
}

#[test]
fn chunked_loss_trains_as_the_whole_logits() {
    let tmp = tempfile::tempdir().unwrap();
    let data = corpus(tmp.path());
    for model in [
        repo().join("tests/fixtures/dpo/tiny_chat_llama"),
        repo().join("tests/fixtures/families/qwen2"),
    ] {
        let name = model.file_name().unwrap().to_string_lossy().into_owned();
        let (whole_log, whole_eval, whole_w) =
            run(&model, &data, &tmp.path().join(format!("{name}-0")), 0);
        // A control: training moved the weights far more than the bound below.
        let initial = read_safetensors(&model.join("model.safetensors")).unwrap();
        let moved = whole_w
            .iter()
            .flat_map(|(k, t)| t.iter().zip(&initial[k].data).map(|(a, b)| (a - b).abs()))
            .fold(0f32, f32::max);
        assert!(
            moved > 1e-3,
            "{name}: training moved the weights by {moved} only"
        );
        // 3 blocks of 19 positions: chunks of at most 7 (57 positions: 8 of 7 and one of 1); 1
        // is one position each; 40 is more than half the batch, which then takes the whole
        // logits (the same numbers by the other path).
        for chunk in [7, 1, 40] {
            let (log, eval, w) = run(
                &model,
                &data,
                &tmp.path().join(format!("{name}-{chunk}")),
                chunk,
            );
            assert_eq!(log.len(), 4, "{name}: {log:?}");
            for (s, (g, want)) in log.iter().zip(&whole_log).enumerate() {
                for key in ["loss", "grad_norm"] {
                    let (a, b) = (g[key].as_f64().unwrap(), want[key].as_f64().unwrap());
                    // The logged loss is rounded to 4 decimals.
                    let bound = if key == "loss" { 5e-5 } else { 1e-4 * b.abs() };
                    assert!(
                        (a - b).abs() <= bound,
                        "{name} chunk {chunk} step {}: {key} {a} vs the whole logits' {b}",
                        s + 1
                    );
                }
            }
            let (a, b) = (eval["eval_loss"], whole_eval["eval_loss"]);
            assert!(
                (a - b).abs() <= 1e-5 * b,
                "{name} chunk {chunk}: eval_loss {a} vs {b}"
            );
            assert!(eval.contains_key("eval_perplexity"));
            let mut worst = 0f32;
            for (k, t) in &w {
                for (x, y) in t.iter().zip(&whole_w[k]) {
                    worst = worst.max((x - y).abs());
                }
            }
            // Four steps of 5e-3: a wrong gradient moves weights by ~1e-2.
            assert!(
                worst < 2e-4,
                "{name} chunk {chunk}: weights differ by {worst}"
            );
            eprintln!("{name} chunk {chunk}: largest weight difference {worst:e}");
        }
    }
}
