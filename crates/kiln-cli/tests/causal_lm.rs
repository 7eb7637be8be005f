//! Causal LMs through the `kiln` binary: GGUF conversion, greedy generation against transformers'
//! fixture, continued pretraining with perplexity, `kiln eval --task causal-lm`, and data
//! parallelism on a model initialised from a config (against a single-process run).

mod kiln_bin;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use kiln_bin::{kiln_one_thread, launched};
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
        // convert writes only new folders: the last run's is removed first.
        let _ = std::fs::remove_dir_all(&dir);
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

    // LoRA: a target no layer has, and an adapter folder that is not one.
    let rows = tmp.path().join("rows.jsonl");
    std::fs::write(
        &rows,
        "{\"prompt\": \"The sky is\", \"completion\": \" blue.\"}\n",
    )
    .unwrap();
    let sft = |lora: &[&str]| {
        let out = kiln_one_thread()
            .args(["train", "--task", "sft", "--model"])
            .arg(model)
            .arg("--train-file")
            .arg(&rows)
            .args(lora)
            .args(["--max-steps", "1", "--output-dir"])
            .arg(tmp.path().join("lora"))
            .output()
            .unwrap();
        assert!(!out.status.success());
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let err = sft(&["--lora-target-modules", "qkv_proj"]);
    assert!(
        err.contains("--lora-target-modules qkv_proj") && err.contains("q_proj, k_proj"),
        "{err}"
    );
    let err = sft(&["--adapter", tmp.path().to_str().unwrap()]);
    assert!(
        err.contains("adapter_config.json: No such file") && err.matches("No such").count() == 1,
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
        kiln::formats::safetensors::read_safetensors(&out.join("model.safetensors")).unwrap()
    };
    let single = run(8, 1, "single8");
    let ddp = run(4, 2, "ddp2x4");
    let control = run(4, 1, "single4");
    let diff =
        |a: &std::collections::BTreeMap<String, kiln::formats::safetensors::HostTensor>,
         b: &std::collections::BTreeMap<String, kiln::formats::safetensors::HostTensor>| {
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

/// `kiln train --task sft` of a tiny random Llama on rows of [`tiny_sft`]'s, with SmolLM2's
/// tokenizer from `model`: the arguments every LoRA run below starts with.
fn sft_train<'c>(
    c: &'c mut Command,
    (cfg, data): &(PathBuf, PathBuf),
    model: &Path,
) -> &'c mut Command {
    c.args(["train", "--task", "sft", "--from-config"])
        .arg(cfg)
        .arg("--tokenizer")
        .arg(model)
        .arg("--train-file")
        .arg(data)
}

/// A tiny 2-layer Llama config (SmolLM2's vocabulary) and 16 prompt/completion rows cut from
/// Brown's first eval text, written into `dir`: `(config, rows)`.
fn tiny_sft(dir: &Path, brown: &Path) -> (PathBuf, PathBuf) {
    let cfg = dir.join("tiny.json");
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
    let text = std::fs::read_to_string(brown).unwrap();
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
    let data = dir.join("rows.jsonl");
    std::fs::write(&data, rows).unwrap();
    (cfg, data)
}

/// A step's SFT loss is the mean over all its target tokens, as transformers' Trainer makes it
/// (`num_items_in_batch`, `average_tokens_across_devices`): prompt/completion rows whose
/// completions hold different numbers of tokens, trained one batch of 8, 4 accumulated
/// micro-batches of 2, and 2 ranks × 2 micro-batches of 2, take the same SGD steps. Without
/// `average_tokens_across_devices` the ranks' own means are averaged: another step (the control).
#[test]
fn sft_loss_is_the_mean_over_the_steps_target_tokens() {
    let (Some(model), Some(brown)) = (converted(), asset("brown/eval.jsonl")) else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let tiny = tiny_sft(tmp.path(), &brown);
    let run = |name: &str, procs: usize, batch: usize, accumulate: usize, extra: &[&str]| {
        let out = tmp.path().join(name);
        let mut c = launched(procs);
        let st = sft_train(&mut c, &tiny, model)
            .args(["--use-peft", "--lora-r", "4", "--lora-dropout", "0"])
            .args(["--lora-target-modules", "all-linear", "--optim", "sgd"])
            .args(["--learning-rate", "0.5", "--max-steps", "2", "--seed", "3"])
            .args(["--per-device-train-batch-size", &batch.to_string()])
            .args(["--gradient-accumulation-steps", &accumulate.to_string()])
            .args(["--save-strategy", "no", "--output-dir"])
            .arg(&out)
            .args(extra)
            .status()
            .unwrap();
        assert!(st.success(), "{name} failed");
        kiln::formats::safetensors::read_safetensors(&out.join("adapter_model.safetensors"))
            .unwrap()
    };
    let max_diff =
        |a: &std::collections::BTreeMap<String, kiln::formats::safetensors::HostTensor>,
         b: &std::collections::BTreeMap<String, kiln::formats::safetensors::HostTensor>| {
            a.iter()
                .flat_map(|(k, t)| t.data.iter().zip(&b[k].data).map(|(x, y)| (x - y).abs()))
                .fold(0f32, f32::max)
        };
    let whole = run("whole", 1, 8, 1, &[]);
    let accumulated = run("accumulated", 1, 2, 4, &[]);
    let ranks = run("ranks", 2, 2, 2, &[]);
    let own_means = run(
        "own-means",
        2,
        2,
        2,
        &["--average-tokens-across-devices", "false"],
    );
    let (a, r, c) = (
        max_diff(&accumulated, &whole),
        max_diff(&ranks, &whole),
        max_diff(&own_means, &whole),
    );
    eprintln!("vs one batch of 8: 4 × 2 accumulated {a:e}, 2 ranks {r:e}; ranks' own means {c:e}");
    assert!(a < 1e-6, "accumulated micro-batches differ by {a}");
    assert!(r < 1e-6, "2 ranks differ by {r}");
    assert!(
        c > 20.0 * r.max(1e-7),
        "control too close ({c}): the test cannot tell"
    );
}

/// SFT with LoRA through the binary, on a small random Llama (`--from-config`, SmolLM2's
/// tokenizer) and prompt/completion rows cut from Brown: two data-parallel workers × 4 rows train
/// the adapter one process × 8 rows trains (rows of equal target counts: see below); a run
/// resumed from its step-2 checkpoint ends with the unbroken run's adapter, bit for bit (LoRA
/// dropout on, so the dropout stream is resumed too); the folders hold PEFT's files only, and the
/// frozen base got no optimizer state. ZeRO-1 with gradient checkpointing takes the same steps;
/// `--bf16` comes near them (and is them, bit for bit, where the CPU has no bf16 arithmetic).
#[test]
fn sft_lora_data_parallel_and_resume() {
    let (Some(model), Some(brown)) = (converted(), asset("brown/eval.jsonl")) else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let tiny = tiny_sft(tmp.path(), &brown);
    let run_with = |batch: usize, procs: usize, name: &str, extra: &[&str], isa: &str| {
        let out = tmp.path().join(name);
        let mut c = launched(procs);
        if !isa.is_empty() {
            c.env("KILN_CPU_ISA", isa);
        }
        let st = sft_train(&mut c, &tiny, model)
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
    let run = |batch: usize, procs: usize, name: &str, extra: &[&str]| {
        run_with(batch, procs, name, extra, "")
    };
    let adapter = |dir: &Path| {
        kiln::formats::safetensors::read_safetensors(&dir.join("adapter_model.safetensors"))
            .unwrap()
    };
    let max_diff =
        |a: &std::collections::BTreeMap<String, kiln::formats::safetensors::HostTensor>,
         b: &std::collections::BTreeMap<String, kiln::formats::safetensors::HostTensor>| {
            assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>());
            a.iter()
                .flat_map(|(k, t)| t.data.iter().zip(&b[k].data).map(|(x, y)| (x - y).abs()))
                .fold(0f32, f32::max)
        };

    // Rows cut to 16 tokens, every one a target: each rank holds as many targets, so this holds
    // with or without average_tokens_across_devices (`sft_loss_is_the_mean_over_the_steps_
    // target_tokens` covers unequal counts).
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
    // ZeRO-1 shards only the adapter's moments (the frozen base has none) and gradient
    // checkpointing recomputes the adapted layers in the backward: the same steps again.
    let zero_ckpt = [&no_dropout[..], &["--zero-1", "--gradient-checkpointing"]].concat();
    let zero = adapter(&run(4, 2, "ddp2x4-zero1-ckpt", &zero_ckpt));
    let z = max_diff(&zero, &single);
    assert!(
        z < 1e-5,
        "ZeRO-1 + gradient checkpointing differ from one process by {z}"
    );
    let control = adapter(&run(4, 1, "single4", &no_dropout));
    let (d, c) = (max_diff(&ddp, &single), max_diff(&control, &single));
    eprintln!("LoRA 2x4 vs 1x8: max |Δ| = {d:e}; 1x4 vs 1x8 (control): {c:e}");
    assert!(d < 1e-5, "2 workers differ from one process by {d}");
    assert!(c > 1e-4, "control too close ({c}): the test cannot tell");
    // --bf16 autocasts the base's and the adapters' products to bf16 where the CPU has bf16
    // arithmetic: near fp32, not equal. Elsewhere (here: capped to AVX2) the products stay f32,
    // as fast as fp32 and equal to it bit for bit (issue 36).
    let with_bf16 = [&no_dropout[..], &["--bf16"]].concat();
    let capped = |name: &str, extra: &[&str]| adapter(&run_with(8, 1, name, extra, "avx2"));
    let c = max_diff(
        &capped("avx2-bf16", &with_bf16),
        &capped("avx2-fp32", &no_dropout),
    );
    assert_eq!(c, 0.0, "--bf16 without bf16 arithmetic is not the fp32 run");
    let bf16 = adapter(&run(8, 1, "bf16", &with_bf16));
    let flat = |a: &std::collections::BTreeMap<String, kiln::formats::safetensors::HostTensor>| {
        a.values()
            .flat_map(|t| t.data.clone())
            .collect::<Vec<f32>>()
    };
    let b = common::rel_err(&flat(&bf16), &flat(&single));
    let other = common::rel_err(&flat(&control), &flat(&single));
    eprintln!("LoRA --bf16 vs fp32: rel err {b:e}; batch 4 vs 8 (control): {other:e}");
    if kiln::ops::isa::cpu_isa().bf16_dot {
        assert!(
            b > 0.0 && b < 0.1 && b < other / 2.0,
            "--bf16 adapter vs fp32: rel err {b} (a run on other batches: {other})"
        );
    } else {
        assert_eq!(b, 0.0, "--bf16 without bf16 arithmetic is not the fp32 run");
    }

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
    let moments =
        kiln::formats::safetensors::read_safetensors(&ck.join("optimizer.safetensors")).unwrap();
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

/// `--adapter DIR` trains a saved PEFT adapter further: with plain SGD at a constant rate and the
/// whole data in each step (so the optimizer carries no state and every step sees the same
/// rows), 2 steps then 2 more from the saved adapter equal 4 unbroken steps; the adapter's own
/// config (rank, targets, dropout) is used, and LoRA flags beside `--adapter` are refused.
#[test]
fn sft_lora_adapter_trains_further() {
    let (Some(model), Some(brown)) = (converted(), asset("brown/eval.jsonl")) else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let tiny = tiny_sft(tmp.path(), &brown);
    let run = |name: &str, steps: &str, lora: &[&str]| {
        let out = tmp.path().join(name);
        let o = sft_train(&mut kiln_one_thread(), &tiny, model)
            .args(lora)
            .args(["--optim", "sgd", "--lr-scheduler-type", "constant"])
            .args([
                "--learning-rate",
                "0.5",
                "--per-device-train-batch-size",
                "16",
            ])
            .args(["--max-length", "16", "--completion-only-loss", "false"])
            .args(["--save-strategy", "no", "--seed", "3", "--max-steps", steps])
            .arg("--output-dir")
            .arg(&out)
            .output()
            .unwrap();
        (out, o)
    };
    let adapter = |dir: &Path| {
        let t =
            kiln::formats::safetensors::read_safetensors(&dir.join("adapter_model.safetensors"))
                .unwrap();
        t.into_values().flat_map(|t| t.data).collect::<Vec<f32>>()
    };
    let fresh = [
        "--lora-r",
        "4",
        "--lora-target-modules",
        "q_proj,v_proj,down_proj",
    ];
    let fresh = [&fresh[..], &["--lora-dropout", "0"]].concat();
    let ok = |(out, o): (PathBuf, std::process::Output)| {
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        out
    };
    let four = ok(run("four", "4", &fresh));
    let two = ok(run("two", "2", &fresh));
    let two_more = ok(run("two-more", "2", &["--adapter", two.to_str().unwrap()]));
    let (a4, a2, a22) = (adapter(&four), adapter(&two), adapter(&two_more));
    assert_eq!(a22.len(), a4.len(), "the adapter's own rank and targets");
    let d = common::rel_err(&a22, &a4);
    let control = common::rel_err(&a2, &a4);
    eprintln!("2 + 2 steps vs 4: rel err {d:e}; 2 vs 4 (control): {control:e}");
    assert!(d < 1e-5, "2 + 2 steps differ from 4 by {d}");
    assert!(
        control > 1e-3,
        "control too close ({control}): the test cannot tell"
    );
    let config: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(two_more.join("adapter_config.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(config["r"], 4);

    let (_, o) = run(
        "both",
        "1",
        &["--adapter", two.to_str().unwrap(), "--lora-r", "8"],
    );
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && err.contains("--adapter") && err.contains("adapter_config.json"),
        "{err}"
    );
}

/// `--base-dtype bf16`: LoRA SFT on SmolLM2 (tied embeddings, so the output layer reads the held
/// table too) with its frozen base held in bf16 trains the adapter that the same run trains in
/// f32 on a copy of the model whose matrices were rounded to bf16 beforehand (PyTorch's
/// `.to(torch.bfloat16)` rounding, done here on the files), alone and on two data-parallel ranks
/// (rank 0's held base is broadcast; LoRA dropout off, as its masks are drawn per rank). The
/// unrounded base is the control.
#[test]
fn sft_lora_on_a_base_held_in_bf16() {
    let (Some(model), Some(brown)) = (converted(), asset("brown/eval.jsonl")) else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let (_, data) = tiny_sft(tmp.path(), &brown);
    let rounded = tmp.path().join("rounded");
    common::bf16_rounded_copy(model, &rounded);
    let run = |name: &str, base: &Path, procs: usize, extra: &[&str]| {
        let out = tmp.path().join(name);
        let st = launched(procs)
            .args(["train", "--task", "sft", "--model"])
            .arg(base)
            .arg("--train-file")
            .arg(&data)
            .args([
                "--use-peft",
                "--lora-r",
                "4",
                "--lora-target-modules",
                "all-linear",
            ])
            .args([
                "--optim",
                "sgd",
                "--learning-rate",
                "0.1",
                "--max-steps",
                "2",
            ])
            .args(["--max-length", "32", "--seed", "5", "--save-strategy", "no"])
            // Dropout masks are drawn per rank: off, so that two ranks take one process's steps.
            .args(["--lora-dropout", "0"])
            .args(["--per-device-train-batch-size", &(8 / procs).to_string()])
            .arg("--output-dir")
            .arg(&out)
            .args(extra)
            .status()
            .unwrap();
        assert!(st.success(), "{name} failed");
        let t =
            kiln::formats::safetensors::read_safetensors(&out.join("adapter_model.safetensors"));
        t.unwrap()
            .into_values()
            .flat_map(|t| t.data)
            .collect::<Vec<f32>>()
    };
    let bf16 = ["--base-dtype", "bf16"];
    let held = run("held", model, 1, &bf16);
    let reference = run("reference", &rounded, 1, &[]);
    let ranks = run("ranks", model, 2, &bf16);
    let unrounded = run("unrounded", model, 1, &[]);
    let (h, r, c) = (
        common::rel_err(&held, &reference),
        common::rel_err(&ranks, &reference),
        common::rel_err(&unrounded, &reference),
    );
    eprintln!("adapter vs the rounded base in f32: held {h:e}, 2 ranks {r:e}; unrounded base (control) {c:e}");
    assert!(
        h < 1e-5,
        "the base held in bf16 trains another adapter ({h})"
    );
    assert!(r < 1e-5, "two ranks with a held base differ ({r})");
    assert!(
        c > 20.0 * h.max(r).max(1e-7),
        "control too close ({c}): the test cannot tell"
    );
}

/// `--assistant-only-loss` with SmolLM2's stock chat template, which has no `{% generation %}`
/// tags: training runs on the assistant turns found by rendering turn by turn, and
/// `--print-masks` shows them: the assistant's words and end of turn trained on, the system
/// prompt, the user's words and the assistant header not.
#[test]
fn assistant_only_loss_without_generation_tags_prints_its_masks() {
    let Some(model) = converted() else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("chat.jsonl");
    let rows: String = [("Name a colour.", "Blue."), ("Say hi.", "Hi there.")]
        .iter()
        .map(|(q, a)| {
            serde_json::json!({"messages": [
                {"role": "user", "content": q}, {"role": "assistant", "content": a}]})
            .to_string()
                + "\n"
        })
        .collect();
    std::fs::write(&data, rows).unwrap();
    let out = succeed(
        kiln_one_thread()
            .args(["train", "--task", "sft", "--model"])
            .arg(model)
            .arg("--train-file")
            .arg(&data)
            .args(["--use-peft", "--lora-r", "4"])
            .args(["--assistant-only-loss", "--print-masks", "2"])
            .args(["--max-steps", "1", "--save-strategy", "no", "--output-dir"])
            .arg(tmp.path().join("run")),
    );
    let out = String::from_utf8(out).unwrap();
    let trained: Vec<&str> = out
        .lines()
        .filter(|l| l.trim_start().starts_with('+'))
        .collect();
    assert_eq!(trained.len(), 2, "one trained run per example:\n{out}");
    assert!(trained[0].ends_with(r#""Blue.<|im_end|>\n""#), "{out}");
    assert!(trained[1].ends_with(r#""Hi there.<|im_end|>\n""#), "{out}");
    let untrained: Vec<&str> = out
        .lines()
        .filter(|l| l.trim_start().starts_with('·'))
        .collect();
    assert!(
        untrained[0].contains("Name a colour.")
            && untrained[0].ends_with(r#"<|im_start|>assistant\n""#),
        "{out}"
    );
}

/// `kiln train --task dpo` on TRL's fixture (tests/fixtures/dpo): a LoRA adapter continued from
/// the one TRL started from, four steps whose logged loss and rewards are TRL's, TRL's metrics
/// in the log and the evaluation, no perplexity, and the adapter saved as PEFT saves it.
#[test]
fn dpo_with_lora_logs_trls_numbers_and_saves_the_adapter() {
    let fixtures = repo_root().join("tests/fixtures/dpo");
    let trl: serde_json::Value =
        serde_json::from_slice(&std::fs::read(fixtures.join("dpo.json")).unwrap()).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("run");
    let stdout = succeed(
        kiln_one_thread()
            .args(["train", "--task", "dpo", "--model"])
            .arg(fixtures.join("tiny_chat_llama"))
            .arg("--train-file")
            .arg(fixtures.join("standard_train.jsonl"))
            .arg("--eval-file")
            .arg(fixtures.join("standard_eval.jsonl"))
            .arg("--adapter")
            .arg(fixtures.join("lora_initial_adapter"))
            .args(["--beta", "0.1", "--loss-type", "sigmoid"])
            .args([
                "--per-device-train-batch-size",
                "8",
                "--per-device-eval-batch-size",
                "4",
            ])
            .args(["--max-steps", "4", "--learning-rate", "5e-3"])
            .args(["--lr-scheduler-type", "constant", "--weight-decay", "0"])
            .args([
                "--logging-steps",
                "1",
                "--seed",
                "42",
                "--eval-strategy",
                "no",
            ])
            .arg("--output-dir")
            .arg(&run),
    );
    let stdout = String::from_utf8(stdout).unwrap();
    let log: Vec<serde_json::Value> = std::fs::read_to_string(run.join("log.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let want = trl["cases"]["standard_lora_sigmoid"]["log_history"]
        .as_array()
        .unwrap();
    for step in 0..4 {
        for key in ["loss", "rewards/margins", "logps/chosen"] {
            let (g, w) = (
                log[step][key].as_f64().unwrap(),
                want[step][key].as_f64().unwrap(),
            );
            assert!(
                (g - w).abs() <= 1e-4 + 2e-3 * w.abs(),
                "step {}: {key} {g} vs TRL's {w}",
                step + 1
            );
        }
    }
    assert!(stdout.contains("\"eval_rewards/accuracies\""), "{stdout}");
    assert!(!stdout.contains("eval_perplexity"), "{stdout}");
    assert!(run.join("adapter_model.safetensors").is_file());
    assert!(run.join("adapter_config.json").is_file());
}

/// `--task reward-modeling` from the command line, continuing TRL's initial LoRA adapter (PEFT's
/// SEQ_CLS: the score head trained whole beside it): TRL's numbers step by step, an adapter PEFT
/// loads (its score copy saved as `base_model.model.score.weight`), and `kiln merge` + `kiln
/// predict` scoring each evaluation text as `kiln eval` scores the pairs (its accuracy).
#[test]
fn reward_modeling_with_lora_logs_trls_numbers_and_merges_into_a_scorer() {
    let fixtures = repo_root().join("tests/fixtures/reward");
    let trl: serde_json::Value =
        serde_json::from_slice(&std::fs::read(fixtures.join("reward.json")).unwrap()).unwrap();
    let data = repo_root().join("tests/fixtures/dpo");
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("run");
    let model = fixtures.join("tiny_chat_llama_rm");
    let stdout = succeed(
        kiln_one_thread()
            .args(["train", "--task", "reward-modeling", "--model"])
            .arg(&model)
            .arg("--train-file")
            .arg(data.join("standard_train.jsonl"))
            .arg("--eval-file")
            .arg(data.join("standard_eval.jsonl"))
            .arg("--adapter")
            .arg(fixtures.join("lora_initial_adapter"))
            .args([
                "--per-device-train-batch-size",
                "8",
                "--per-device-eval-batch-size",
                "4",
            ])
            .args(["--max-steps", "4", "--learning-rate", "5e-3"])
            .args(["--lr-scheduler-type", "constant", "--weight-decay", "0"])
            .args(["--logging-steps", "1", "--seed", "42"])
            .args(["--eval-strategy", "no", "--save-strategy", "no"])
            .arg("--output-dir")
            .arg(&run),
    );
    let stdout = String::from_utf8(stdout).unwrap();
    let log: Vec<serde_json::Value> = std::fs::read_to_string(run.join("log.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let want = trl["cases"]["standard_lora"]["log_history"]
        .as_array()
        .unwrap();
    for step in 0..4 {
        for key in ["loss", "accuracy", "margin", "mean_reward"] {
            let (g, w) = (
                log[step][key].as_f64().unwrap(),
                want[step][key].as_f64().unwrap(),
            );
            assert!(
                (g - w).abs() <= 1e-4 + 2e-3 * w.abs(),
                "step {}: {key} {g} vs TRL's {w}",
                step + 1
            );
        }
    }
    assert!(stdout.contains("\"eval_accuracy\""), "{stdout}");
    assert!(!stdout.contains("perplexity"), "{stdout}");
    let adapter: serde_json::Value =
        serde_json::from_slice(&std::fs::read(run.join("adapter_config.json")).unwrap()).unwrap();
    assert_eq!(adapter["task_type"], "SEQ_CLS");
    let saved = std::fs::read(run.join("adapter_model.safetensors")).unwrap();
    let names = safetensors::SafeTensors::deserialize(&saved)
        .unwrap()
        .names()
        .into_iter()
        .map(String::from)
        .collect::<Vec<_>>();
    assert!(
        names.iter().any(|n| n == "base_model.model.score.weight"),
        "{names:?}"
    );

    // The merged model scores each evaluation side; kiln eval's accuracy is the share of pairs
    // whose chosen side scores higher.
    let merged = tmp.path().join("merged");
    succeed(
        kiln_one_thread()
            .args(["merge", "--model"])
            .arg(&model)
            .arg("--adapter")
            .arg(&run)
            .arg("--out")
            .arg(&merged),
    );
    let rows: Vec<serde_json::Value> = std::fs::read_to_string(data.join("standard_eval.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let score = |side: &str| -> Vec<f64> {
        let mut cmd = kiln_one_thread();
        cmd.args(["predict", "--model"]).arg(&merged);
        for r in &rows {
            let text = format!(
                "{}{}<|im_end|>",
                r["prompt"].as_str().unwrap(),
                r[side].as_str().unwrap()
            );
            cmd.arg("--text").arg(text);
        }
        String::from_utf8(succeed(&mut cmd))
            .unwrap()
            .lines()
            .map(|l| {
                serde_json::from_str::<serde_json::Value>(l).unwrap()["score"]
                    .as_f64()
                    .unwrap()
            })
            .collect()
    };
    let (chosen, rejected) = (score("chosen"), score("rejected"));
    let wins = chosen.iter().zip(&rejected).filter(|(c, r)| c > r).count();
    let eval = String::from_utf8(succeed(
        kiln_one_thread()
            .args(["eval", "--task", "reward-modeling", "--model"])
            .arg(&merged)
            .arg("--eval-file")
            .arg(data.join("standard_eval.jsonl")),
    ))
    .unwrap();
    let start = eval.find('{').unwrap();
    let metrics: serde_json::Value = serde_json::from_str(&eval[start..]).unwrap();
    assert_eq!(
        metrics["eval_accuracy"].as_f64().unwrap(),
        wins as f64 / rows.len() as f64,
        "{eval}"
    );
    let mean = chosen.iter().chain(&rejected).sum::<f64>() / (2 * rows.len()) as f64;
    let got = metrics["eval_mean_reward"].as_f64().unwrap();
    assert!((got - mean).abs() < 1e-5, "{got} vs {mean}");

    // Over two pipeline stages (the last scores, the first reports) the same evaluation.
    let staged = String::from_utf8(succeed(
        launched(2)
            .args(["eval", "--task", "reward-modeling", "--model"])
            .arg(&merged)
            .arg("--eval-file")
            .arg(data.join("standard_eval.jsonl"))
            .args(["--pipeline-parallel-size", "2"]),
    ))
    .unwrap();
    // The launcher shows rank 0's lines, each behind its rank.
    let json: String = staged
        .lines()
        .filter_map(|l| l.strip_prefix("[rank 0] "))
        .collect();
    let at_pp: serde_json::Value =
        serde_json::from_str(&json).unwrap_or_else(|e| panic!("{e}: {staged}"));
    for key in [
        "eval_loss",
        "eval_accuracy",
        "eval_mean_reward",
        "eval_margin",
    ] {
        let (a, b) = (at_pp[key].as_f64().unwrap(), metrics[key].as_f64().unwrap());
        assert!(
            (a - b).abs() <= 1e-6 * (1.0 + b.abs()),
            "{key}: PP 2 {a} vs {b}: {staged}"
        );
    }
}
