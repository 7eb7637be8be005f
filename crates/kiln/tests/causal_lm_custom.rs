//! A library user's loss and metrics for a causal LM (`tasks::causal_lm::train_with`), honoured in
//! training and evaluation, alone, at DP = 2 and at TP = 2 (ranks as processes of this test
//! binary). The loss is cross-entropy plus PaLM's z-loss (`1e-2 · logsumexp²`), written with Burn
//! ops; the metrics stream per batch (cross-entropy, z², token accuracy, target tokens).
//!
//! References, each computed another way:
//! - the metric's cross-entropy equals `kiln eval`'s built-in loss on the saved model, and the
//!   evaluation's loss (the user's loss) equals that cross-entropy plus `1e-2 ·` the metric's z²;
//! - the metric's token count equals the eval blocks' targets counted from the data;
//! - DP = 2 and TP = 2 equal one process (weights and every metric); the built-in loss trained
//!   the same way (a control) ends elsewhere, so the user's loss is the one trained.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use burn::tensor::{Int, Tensor};
use kiln::backend::{Cpu, CpuDevice, CpuTrain};
use kiln::contract::{Loss, IGNORE_INDEX};
use kiln::formats::safetensors::{read_safetensors, HostTensor};
use kiln::ops::KilnBackend;
use kiln::parallel::DistEnv;
use kiln::tasks::causal_lm::{self, CausalLmOptions};
use kiln::train::{SaveStrategy, TokenMetrics, TrainingArguments};
use kiln_testkit::common::{self, asset};

/// The z-loss weight.
const Z: f64 = 1e-2;
const BLOCK: usize = 16;
const LR: f64 = 1e-3;
/// Max |Δw| of a parallel run against one process: 1 % of 4 AdamW steps of [`LR`] (rounding of
/// the parallel sums, amplified by Adam's `1/√v` on gradients near zero).
const ADAMW_ROUNDING: f32 = (0.01 * 4.0 * LR) as f32;
const TEST: &str = "custom_loss_and_metrics_hold_under_data_and_tensor_parallelism";

/// Cross-entropy plus `Z · logsumexp²` over the target tokens.
#[derive(Debug, Clone)]
struct ZLoss;

impl Loss for ZLoss {
    fn loss<B: KilnBackend>(
        &self,
        logits: Tensor<B, 2>,
        targets: Tensor<B, 1, Int>,
    ) -> Tensor<B, 1> {
        let [n, _] = logits.dims();
        let kept = targets.clone().not_equal_elem(IGNORE_INDEX);
        let safe = targets.mask_fill(kept.clone().bool_not(), 0);
        let max = logits.clone().max_dim(1).detach();
        let lse = (logits.clone() - max.clone()).exp().sum_dim(1).log() + max;
        let picked = logits.gather(1, safe.reshape([n, 1]));
        let per = (lse.clone() - picked) + lse.powi_scalar(2) * Z;
        let weight = kept.float().reshape([n, 1]);
        let count = weight.clone().sum();
        (per * weight).sum() / count
    }
}

/// Sums of cross-entropy, logsumexp², right argmaxes and target tokens.
struct TokenStats;

impl TokenMetrics for TokenStats {
    fn batch(&self, logits: &[f32], vocab: usize, targets: &[i64]) -> Vec<f64> {
        let mut sums = vec![0.0; 4];
        for (row, &t) in logits.chunks(vocab.max(1)).zip(targets) {
            if t == IGNORE_INDEX {
                continue;
            }
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
            let lse = max
                + row
                    .iter()
                    .map(|&x| (x as f64 - max).exp())
                    .sum::<f64>()
                    .ln();
            let argmax = (0..row.len()).fold(0, |b, i| if row[i] > row[b] { i } else { b });
            sums[0] += lse - row[t as usize] as f64;
            sums[1] += lse * lse;
            sums[2] += f64::from(argmax == t as usize);
            sums[3] += 1.0;
        }
        sums
    }

    fn finish(&self, t: &[f64]) -> Vec<(String, f64)> {
        vec![
            ("ce".into(), t[0] / t[3]),
            ("z2".into(), t[1] / t[3]),
            ("token_accuracy".into(), t[2] / t[3]),
            ("tokens".into(), t[3]),
        ]
    }
}

/// A tiny Llama config (uneven heads at TP = 2, a vocabulary odd for the cut), the SmolLM2
/// tokenizer, a train and an eval corpus from Brown.
fn setup(dir: &Path) -> Option<()> {
    let brown = asset("brown/eval.jsonl")?;
    common::smollm2_tokenizer(&dir.join("tok"))?;
    let first = std::fs::read_to_string(brown).unwrap();
    let mut docs = first.lines().map(|l| {
        let v: serde_json::Value = serde_json::from_str(l).unwrap();
        v["text"]
            .as_str()
            .unwrap()
            .chars()
            .take(3000)
            .collect::<String>()
    });
    for name in ["train.jsonl", "eval.jsonl"] {
        let text = docs.next().unwrap();
        let line = serde_json::json!({ "text": text }).to_string() + "\n";
        std::fs::write(dir.join(name), line).unwrap();
    }
    let config = serde_json::json!({
        "vocab_size": 49157, "hidden_size": 72, "intermediate_size": 40,
        "num_hidden_layers": 2, "num_attention_heads": 9, "num_key_value_heads": 3,
        "rope_theta": 10000.0, "tie_word_embeddings": false, "eos_token_id": 2,
        "pad_token_id": 2, "architectures": ["LlamaForCausalLM"], "model_type": "llama"});
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    Some(())
}

fn options(dir: &Path) -> CausalLmOptions {
    CausalLmOptions {
        from_config: Some(dir.join("config.json")),
        tokenizer: Some(dir.join("tok")),
        train_file: Some(dir.join("train.jsonl")),
        eval_file: Some(dir.join("eval.jsonl")),
        text_column: "text".into(),
        block_size: BLOCK,
        ..CausalLmOptions::default()
    }
}

/// Trains 4 AdamW steps of a global batch of 4 into `out` with the user's loss and metrics (or
/// the built-in loss); returns the final evaluation's metrics.
fn run(dir: &Path, out: &Path, ranks: (usize, usize), user: bool) -> BTreeMap<String, f64> {
    let (world, tp) = ranks;
    let args = TrainingArguments {
        output_dir: out.to_path_buf(),
        max_steps: 4,
        per_device_train_batch_size: 4 * tp / world,
        per_device_eval_batch_size: 3,
        learning_rate: LR,
        max_grad_norm: 0.5,
        logging_steps: 1.0,
        save_strategy: SaveStrategy::No,
        seed: 5,
        tensor_parallel_size: tp,
        ..TrainingArguments::default()
    };
    let device = CpuDevice::default();
    let (loss, metrics): (_, Option<Arc<dyn TokenMetrics>>) = if user {
        (Some(ZLoss), Some(Arc::new(TokenStats)))
    } else {
        (None, None)
    };
    let (_, eval) =
        causal_lm::train_with::<CpuTrain, ZLoss>(&options(dir), args, &device, loss, metrics)
            .unwrap();
    eval.expect("an evaluation").metrics
}

fn worker() {
    let dir = PathBuf::from(std::env::var("KILN_TEST_DIR").unwrap());
    let out = PathBuf::from(std::env::var("KILN_TEST_OUT").unwrap());
    let world: usize = std::env::var("WORLD_SIZE").unwrap().parse().unwrap();
    let tp: usize = std::env::var("KILN_TEST_TP").unwrap().parse().unwrap();
    let metrics = run(&dir, &out, (world, tp), true);
    std::fs::write(
        out.join(format!("metrics-{}.json", std::env::var("RANK").unwrap())),
        serde_json::to_vec(&metrics).unwrap(),
    )
    .unwrap();
}

/// [`run`] as `world` processes of this binary at tensor-parallel size `tp`; rank 0's metrics.
fn launch(dir: &Path, out: &Path, world: usize, tp: usize) -> BTreeMap<String, f64> {
    common::run_test_ranks(
        TEST,
        world,
        &[
            ("KILN_TEST_DIR", dir.display().to_string()),
            ("KILN_TEST_OUT", out.display().to_string()),
            ("KILN_TEST_TP", tp.to_string()),
        ],
    );
    serde_json::from_slice(&std::fs::read(out.join("metrics-0.json")).unwrap()).unwrap()
}

fn max_diff(a: &BTreeMap<String, HostTensor>, b: &BTreeMap<String, HostTensor>) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .flat_map(|(k, t)| t.data.iter().zip(&b[k].data).map(|(x, y)| (x - y).abs()))
        .fold(0f32, f32::max)
}

fn weights(out: &Path) -> BTreeMap<String, HostTensor> {
    read_safetensors(&out.join("model.safetensors")).unwrap()
}

#[test]
fn custom_loss_and_metrics_hold_under_data_and_tensor_parallelism() {
    if DistEnv::from_env().unwrap().is_some() {
        return worker();
    }
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    if setup(dir).is_none() {
        return;
    }
    let single_out = dir.join("single");
    let single = run(dir, &single_out, (1, 1), true);
    eprintln!("one process: {single:?}");

    // The metric against the data and against kiln eval's built-in cross-entropy.
    let eval_opts = CausalLmOptions {
        model_dir: Some(single_out.clone()),
        from_config: None,
        ..options(dir)
    };
    let builtin = causal_lm::eval::<Cpu>(&eval_opts, 2, 1, &CpuDevice::default()).unwrap();
    let ce = builtin.metrics["eval_loss"];
    let tokens = single["eval_tokens"];
    assert_eq!(tokens % (BLOCK - 1) as f64, 0.0, "whole blocks of targets");
    assert!(tokens >= (2 * (BLOCK - 1)) as f64);
    assert!(
        (single["eval_ce"] - ce).abs() < 1e-5 * ce,
        "the metric's cross-entropy {} against kiln eval's {ce}",
        single["eval_ce"]
    );
    let expected = single["eval_ce"] + Z * single["eval_z2"];
    assert!(
        (single["eval_loss"] - expected).abs() < 1e-5 * expected,
        "eval_loss {} is not the user's loss {expected}",
        single["eval_loss"]
    );
    assert!((0.0..=1.0).contains(&single["eval_token_accuracy"]));

    // The built-in loss, trained the same way, ends elsewhere.
    let control_out = dir.join("control");
    let control = run(dir, &control_out, (1, 1), false);
    assert!(
        !control.contains_key("eval_ce"),
        "no user metric without one"
    );
    let c = max_diff(&weights(&control_out), &weights(&single_out));
    assert!(
        c > 0.5 * LR as f32,
        "the user's loss trained like the built-in one ({c})"
    );

    for (name, world, tp) in [("dp2", 2, 1), ("tp2", 2, 2)] {
        let out = dir.join(name);
        std::fs::create_dir_all(&out).unwrap();
        let m = launch(dir, &out, world, tp);
        let d = max_diff(&weights(&out), &weights(&single_out));
        eprintln!("{name}: max |Δw| = {d:e} (control {c:e}); {m:?}");
        assert!(
            d <= ADAMW_ROUNDING,
            "{name}: weights differ from one process by {d}"
        );
        for k in [
            "eval_loss",
            "eval_ce",
            "eval_z2",
            "eval_token_accuracy",
            "eval_tokens",
        ] {
            let (a, b) = (m[k], single[k]);
            assert!(
                (a - b).abs() <= 1e-4 * b.abs().max(1.0),
                "{name}: {k} {a} against {b} alone"
            );
        }
    }
}
