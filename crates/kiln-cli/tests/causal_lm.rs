//! Causal LMs through the `kiln` binary: GGUF conversion, greedy generation against transformers'
//! fixture, continued pretraining with perplexity, `kiln eval --task causal-lm`, and data
//! parallelism on a model initialised from a config (against a single-process run).

mod kiln_bin;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use kiln_bin::kiln_one_thread;
use kiln_testkit::common::{self, asset, repo_root};

/// Runs `cmd`, fails the test with its stderr unless it succeeds, and returns its stdout.
fn succeed(cmd: &mut Command) -> Vec<u8> {
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

/// SmolLM2-135M converted from its GGUF by `kiln convert`, once per test binary.
fn converted() -> Option<&'static Path> {
    let gguf = asset("smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")?;
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    Some(DIR.get_or_init(|| {
        // Under target/tmp, overwritten by every run (not a cache: the conversion is under test).
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("cli-smollm2");
        let stdout = succeed(
            kiln_one_thread()
                .args(["convert", "--from-gguf"])
                .arg(&gguf)
                .arg("--out")
                .arg(&dir),
        );
        let report = String::from_utf8_lossy(&stdout);
        assert!(
            report.contains("272 tensors") && report.contains("tied embeddings: true"),
            "{report}"
        );
        dir
    }))
}

/// A small held-out corpus: the first paragraphs of the first Brown eval text.
fn small_corpus(dir: &Path, brown_eval: &Path, name: &str, chars: usize) -> PathBuf {
    let first = std::fs::read_to_string(brown_eval).unwrap();
    let doc: serde_json::Value = serde_json::from_str(first.lines().next().unwrap()).unwrap();
    let text: String = doc["text"].as_str().unwrap().chars().take(chars).collect();
    let p = dir.join(name);
    std::fs::write(&p, serde_json::json!({ "text": text }).to_string() + "\n").unwrap();
    p
}

fn json_file(p: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

#[test]
fn convert_generate_train_and_eval_smollm2() {
    let (Some(model), Some(brown)) = (converted(), asset("brown/eval.jsonl")) else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    for f in [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ] {
        assert!(model.join(f).exists(), "convert wrote no {f}");
    }

    // Greedy generation reproduces transformers' continuation (tests/fixtures/gen_llama_parity.py).
    let fx = json_file(&repo_root().join("tests/fixtures/llama_parity.json"));
    let p0 = &fx["prompts"][0];
    let want: Vec<u64> = p0["greedy_ids"].as_array().unwrap()[..8]
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect();
    let stdout = succeed(
        kiln_one_thread()
            .args(["generate", "--model"])
            .arg(model)
            .args(["--prompt", p0["text"].as_str().unwrap()])
            .args(["--max-new-tokens", "8", "--ignore-eos", "--json"]),
    );
    let g: serde_json::Value = serde_json::from_slice(&stdout).unwrap();
    let got: Vec<u64> = g["new_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect();
    assert_eq!(got, want, "kiln generate: {}", g["text"]);
    assert!(g["decode_tokens_per_sec"].as_f64().unwrap() > 0.0);

    // Two steps of continued pretraining, evaluated on held-out text.
    let train = small_corpus(tmp.path(), &brown, "train.jsonl", 1500);
    let eval = small_corpus(tmp.path(), &brown, "eval.jsonl", 800);
    let run = tmp.path().join("run");
    let st = kiln_one_thread()
        .args(["train", "--task", "causal-lm", "--model"])
        .arg(model)
        .arg("--train-file")
        .arg(&train)
        .arg("--eval-file")
        .arg(&eval)
        .args([
            "--block-size",
            "32",
            "--per-device-train-batch-size",
            "2",
            "--max-steps",
            "2",
        ])
        .args([
            "--learning-rate",
            "1e-4",
            "--save-strategy",
            "no",
            "--output-dir",
        ])
        .arg(&run)
        .status()
        .unwrap();
    assert!(st.success());
    for f in [
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ] {
        assert!(run.join(f).exists(), "the trained folder has no {f}");
    }
    let ev = json_file(&run.join("eval_results.json"));
    let (loss, ppl) = (
        ev["eval_loss"].as_f64().unwrap(),
        ev["eval_perplexity"].as_f64().unwrap(),
    );
    assert!(
        loss.is_finite() && (ppl - loss.exp()).abs() < 1e-9 * ppl,
        "{ev}"
    );

    // `kiln eval` on the saved folder gives the trainer's final evaluation.
    let stdout = succeed(
        kiln_one_thread()
            .args(["eval", "--task", "causal-lm", "--model"])
            .arg(&run)
            .arg("--eval-file")
            .arg(&eval)
            .args(["--block-size", "32"]),
    );
    let m: serde_json::Value = serde_json::from_slice(&stdout).unwrap();
    let again = m["eval_loss"].as_f64().unwrap();
    assert!(
        (again - loss).abs() < 1e-5 * loss,
        "kiln eval {again} vs trainer {loss}"
    );
}

#[test]
fn bad_causal_lm_inputs_are_clear_errors() {
    let Some(model) = converted() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let not_gguf = tmp.path().join("model.gguf");
    std::fs::write(&not_gguf, b"PK\x03\x04 not a gguf").unwrap();
    let out = kiln_one_thread()
        .args(["convert", "--from-gguf"])
        .arg(&not_gguf)
        .args(["--out", tmp.path().join("x").to_str().unwrap()])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("model.gguf: not a GGUF file"),
        "{err}"
    );

    let tiny = tmp.path().join("tiny.txt");
    std::fs::write(&tiny, "just a few words\n").unwrap();
    let out = kiln_one_thread()
        .args(["train", "--task", "causal-lm", "--model"])
        .arg(model)
        .arg("--train-file")
        .arg(&tiny)
        .args([
            "--block-size",
            "512",
            "--output-dir",
            tmp.path().join("r").to_str().unwrap(),
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("tiny.txt") && err.contains("fewer than one block"),
        "{err}"
    );
}

/// `--from-config` (random init) + data parallelism: 2 workers × 4 blocks take the same steps as
/// one process × 8 blocks (that one with `--gradient-checkpointing`).
#[test]
fn from_config_two_workers_equal_one_process() {
    let (Some(model), Some(brown)) = (converted(), asset("brown/eval.jsonl")) else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let cfg = tmp.path().join("tiny.json");
    std::fs::write(
        &cfg,
        serde_json::json!({
            "vocab_size": 49152, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "rope_theta": 10000.0,
            "tie_word_embeddings": false, "eos_token_id": 2, "pad_token_id": 2,
            "architectures": ["LlamaForCausalLM"], "model_type": "llama"})
        .to_string(),
    )
    .unwrap();
    let corpus = small_corpus(tmp.path(), &brown, "c.jsonl", 4000);
    let run = |batch: usize, procs: usize, name: &str| {
        let out = tmp.path().join(name);
        let mut c = kiln_one_thread();
        if procs > 1 {
            c.args(["launch", "--nproc-per-node", &procs.to_string()])
                .args([
                    "--master-port",
                    &common::free_ports(2).to_string(),
                    "--timeout",
                    "60",
                    "--",
                ]);
        }
        // the reference run goes through activation checkpointing: the same steps
        let extra: &[&str] = if name == "single8" {
            &["--gradient-checkpointing"]
        } else {
            &[]
        };
        let st = c
            .args(["train", "--task", "causal-lm", "--from-config"])
            .arg(&cfg)
            .arg("--tokenizer")
            .arg(model)
            .arg("--train-file")
            .arg(&corpus)
            .args([
                "--block-size",
                "16",
                "--max-steps",
                "3",
                "--learning-rate",
                "1e-3",
            ])
            .args([
                "--per-device-train-batch-size",
                &batch.to_string(),
                "--seed",
                "3",
            ])
            .args(["--save-strategy", "no", "--output-dir"])
            .arg(&out)
            .args(extra)
            .status()
            .unwrap();
        assert!(st.success(), "{name} failed");
        kiln::hub::weights::read_safetensors(&out.join("model.safetensors")).unwrap()
    };
    let single = run(8, 1, "single8");
    let ddp = run(4, 2, "ddp2x4");
    let control = run(4, 1, "single4");
    let diff =
        |a: &std::collections::BTreeMap<String, kiln::hub::weights::HostTensor>,
         b: &std::collections::BTreeMap<String, kiln::hub::weights::HostTensor>| {
            assert_eq!(a.len(), b.len());
            a.iter()
                .flat_map(|(k, t)| t.data.iter().zip(&b[k].data).map(|(x, y)| (x - y).abs()))
                .fold(0f32, f32::max)
        };
    let (d, c) = (diff(&ddp, &single), diff(&control, &single));
    eprintln!("2x4 vs 1x8: max |Δw| = {d:e}; 1x4 vs 1x8 (control): {c:e}");
    assert!(d < 1e-5, "2 workers differ from one process by {d}");
    assert!(c > 1e-4, "control too close ({c}): the test cannot tell");
    assert!(
        single.contains_key("lm_head.weight"),
        "untied config keeps lm_head"
    );
}

/// SFT with LoRA through the binary, on a small random Llama (`--from-config`, SmolLM2's
/// tokenizer) and prompt/completion rows cut from Brown: two data-parallel workers × 4 rows train
/// the adapter one process × 8 rows trains (rows of equal target counts: see below); a run resumed from its step-2 checkpoint ends with the
/// unbroken run's adapter, bit for bit (LoRA dropout on, so the dropout stream is resumed too);
/// the folders hold PEFT's files only, and the frozen base got no optimizer state.
#[test]
fn sft_lora_data_parallel_and_resume() {
    let (Some(model), Some(brown)) = (converted(), asset("brown/eval.jsonl")) else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let cfg = tmp.path().join("tiny.json");
    std::fs::write(
        &cfg,
        serde_json::json!({
            "vocab_size": 49152, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "rope_theta": 10000.0,
            "tie_word_embeddings": false, "eos_token_id": 2, "pad_token_id": 2,
            "architectures": ["LlamaForCausalLM"], "model_type": "llama"})
        .to_string(),
    )
    .unwrap();
    // 16 prompt/completion rows from Brown's first eval text.
    let text = std::fs::read_to_string(&brown).unwrap();
    let doc: serde_json::Value = serde_json::from_str(text.lines().next().unwrap()).unwrap();
    let words: Vec<&str> = doc["text"].as_str().unwrap().split_whitespace().collect();
    let rows: String = words
        .chunks(18)
        .take(16)
        .map(|w| {
            let json = serde_json::json!({
                "prompt": w[..6].join(" "),
                "completion": format!(" {}", w[6..].join(" ")),
            });
            json.to_string() + "\n"
        })
        .collect();
    let data = tmp.path().join("rows.jsonl");
    std::fs::write(&data, rows).unwrap();
    let run = |batch: usize, procs: usize, name: &str, extra: &[&str]| {
        let out = tmp.path().join(name);
        let mut c = kiln_one_thread();
        if procs > 1 {
            c.args(["launch", "--nproc-per-node", &procs.to_string()])
                .args(["--master-port", &common::free_ports(2).to_string()])
                .args(["--timeout", "60", "--"]);
        }
        let st = c
            .args(["train", "--task", "sft", "--from-config"])
            .arg(&cfg)
            .arg("--tokenizer")
            .arg(model)
            .arg("--train-file")
            .arg(&data)
            .args(["--use-peft", "--lora-r", "4"])
            .args([
                "--lora-target-modules",
                "all-linear",
                "--learning-rate",
                "1e-2",
            ])
            .args([
                "--per-device-train-batch-size",
                &batch.to_string(),
                "--seed",
                "3",
            ])
            .args(["--max-steps", "4", "--output-dir"])
            .arg(&out)
            .args(extra)
            .status()
            .unwrap();
        assert!(st.success(), "{name} failed");
        out
    };
    let adapter = |dir: &Path| {
        kiln::hub::weights::read_safetensors(&dir.join("adapter_model.safetensors")).unwrap()
    };
    let max_diff =
        |a: &std::collections::BTreeMap<String, kiln::hub::weights::HostTensor>,
         b: &std::collections::BTreeMap<String, kiln::hub::weights::HostTensor>| {
            assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>());
            a.iter()
                .flat_map(|(k, t)| t.data.iter().zip(&b[k].data).map(|(x, y)| (x - y).abs()))
                .fold(0f32, f32::max)
        };

    // kiln averages each batch's loss over its target tokens, then over the ranks (it records
    // transformers' average_tokens_across_devices): rows cut to 16 tokens, every one a target,
    // give each rank the same count, so the two runs mean the same loss.
    let no_dropout = [
        "--lora-dropout",
        "0",
        "--save-strategy",
        "no",
        "--max-length",
        "16",
        "--completion-only-loss",
        "false",
    ];
    let single = adapter(&run(8, 1, "single8", &no_dropout));
    assert_eq!(single.len(), 2 * 7 * 2, "2 layers × 7 Linear × (A, B)");
    assert!(single
        .keys()
        .all(|k| k.starts_with("base_model.model.model.layers.")));
    let ddp = adapter(&run(4, 2, "ddp2x4", &no_dropout));
    let control = adapter(&run(4, 1, "single4", &no_dropout));
    let (d, c) = (max_diff(&ddp, &single), max_diff(&control, &single));
    eprintln!("LoRA 2x4 vs 1x8: max |Δ| = {d:e}; 1x4 vs 1x8 (control): {c:e}");
    assert!(d < 1e-5, "2 workers differ from one process by {d}");
    assert!(c > 1e-4, "control too close ({c}): the test cannot tell");

    let save = [
        "--save-steps",
        "2",
        "--lora-dropout",
        "0.1",
        "--max-length",
        "32",
    ];
    let unbroken = run(8, 1, "unbroken", &save);
    let ck = unbroken.join("checkpoint-2");
    assert!(ck.join("adapter_config.json").exists() && !ck.join("model.safetensors").exists());
    let moments = kiln::hub::weights::read_safetensors(&ck.join("optimizer.safetensors")).unwrap();
    assert!(
        moments
            .keys()
            .all(|k| k.contains(".lora_a.") || k.contains(".lora_b.")),
        "optimizer state only for the adapter: {:?}",
        moments.keys().find(|k| !k.contains(".lora_"))
    );
    assert!(!unbroken.join("config.json").exists());
    let resumed = run(
        8,
        1,
        "resumed",
        &[
            &save[..],
            &["--resume-from-checkpoint"],
            &[ck.to_str().unwrap()],
        ]
        .concat(),
    );
    let d = max_diff(&adapter(&resumed), &adapter(&unbroken));
    assert_eq!(
        d, 0.0,
        "a resumed LoRA run differs from the unbroken one by {d}"
    );
}
