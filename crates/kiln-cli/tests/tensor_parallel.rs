//! Tensor parallelism through the `kiln` binary: `kiln launch` + `--tensor-parallel-size N` on a
//! Llama initialised from a config takes the same 5 AdamW steps (with global-norm clipping) as
//! one process, at TP = 2 and TP = 3, on configs with uneven head and vocabulary splits, replicated
//! key/value heads, tied and untied heads and biases; and bad layouts are one sentence each.

#[path = "../../kiln/tests/common.rs"]
mod common;

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

use common::asset;
use kiln::hub::weights::{read_safetensors, HostTensor};

fn kiln() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_kiln"));
    c.env("KILN_LOG", "warn").env("RAYON_NUM_THREADS", "1");
    c
}

/// A held-out corpus: the first characters of the first Brown eval text.
fn corpus(dir: &Path, brown: &Path) -> std::path::PathBuf {
    let first = std::fs::read_to_string(brown).unwrap();
    let doc: serde_json::Value = serde_json::from_str(first.lines().next().unwrap()).unwrap();
    let text: String = doc["text"].as_str().unwrap().chars().take(4000).collect();
    let p = dir.join("c.jsonl");
    std::fs::write(&p, serde_json::json!({ "text": text }).to_string() + "\n").unwrap();
    p
}

struct Run<'a> {
    cfg: &'a Path,
    tokenizer: &'a Path,
    corpus: &'a Path,
    out: &'a Path,
}

/// Trains 5 steps with `procs` processes at tensor-parallel size `tp` (`seed` as given); returns
/// the saved (consolidated) weights.
fn train(r: &Run, name: &str, procs: usize, tp: usize, seed: u64) -> BTreeMap<String, HostTensor> {
    let out = r.out.join(name);
    let mut c = kiln();
    if procs > 1 {
        c.args(["launch", "--nproc-per-node", &procs.to_string()])
            .args([
                "--master-port",
                &common::free_ports(procs as u16).to_string(),
            ])
            .args(["--timeout", "60", "--"]);
    }
    let st = c
        .args(["train", "--task", "causal-lm", "--from-config"])
        .arg(r.cfg)
        .arg("--tokenizer")
        .arg(r.tokenizer)
        .arg("--train-file")
        .arg(r.corpus)
        .args(["--block-size", "16", "--max-steps", "5"])
        .args(["--learning-rate", "1e-3", "--max-grad-norm", "0.5"])
        .args(["--per-device-train-batch-size", "4", "--seed"])
        .arg(seed.to_string())
        .args(["--tensor-parallel-size", &tp.to_string()])
        .args([
            "--logging-steps",
            "1",
            "--save-strategy",
            "no",
            "--output-dir",
        ])
        .arg(&out)
        .status()
        .unwrap();
    assert!(st.success(), "{name} failed");
    // Clipping was at work (the test covers the norm over shards): the first norm is above 0.5.
    let log = std::fs::read_to_string(out.join("log.jsonl")).unwrap();
    let first: serde_json::Value = serde_json::from_str(log.lines().next().unwrap()).unwrap();
    let norm = first["grad_norm"].as_f64().unwrap();
    assert!(
        norm > 0.5,
        "{name}: grad_norm {norm} is below --max-grad-norm"
    );
    read_safetensors(&out.join("model.safetensors")).unwrap()
}

fn max_diff(a: &BTreeMap<String, HostTensor>, b: &BTreeMap<String, HostTensor>) -> f32 {
    assert_eq!(
        a.keys().collect::<Vec<_>>(),
        b.keys().collect::<Vec<_>>(),
        "the same parameters"
    );
    a.iter()
        .flat_map(|(k, t)| {
            assert_eq!(t.shape, b[k].shape, "{k}");
            t.data.iter().zip(&b[k].data).map(|(x, y)| (x - y).abs())
        })
        .fold(0f32, f32::max)
}

fn config(
    dir: &Path,
    name: &str,
    heads: usize,
    kv: usize,
    tied: bool,
    bias: bool,
) -> std::path::PathBuf {
    let p = dir.join(name);
    // 49157 = the tokenizer's 49152 + 5: divisible by neither 2 nor 3.
    std::fs::write(
        &p,
        serde_json::json!({
            "vocab_size": 49157, "hidden_size": heads * 8, "intermediate_size": 40,
            "num_hidden_layers": 2, "num_attention_heads": heads, "num_key_value_heads": kv,
            "rope_theta": 10000.0, "tie_word_embeddings": tied, "attention_bias": bias,
            "mlp_bias": bias, "eos_token_id": 2, "pad_token_id": 2,
            "architectures": ["LlamaForCausalLM"], "model_type": "llama"})
        .to_string(),
    )
    .unwrap();
    p
}

#[test]
fn tensor_parallel_training_equals_one_process() {
    let (Some(gguf), Some(brown)) = (
        asset("smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
        asset("brown/eval.jsonl"),
    ) else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    // The tokenizer: SmolLM2's, from its GGUF.
    let hf = tmp.path().join("smollm2");
    let st = kiln()
        .args(["convert", "--from-gguf"])
        .arg(&gguf)
        .arg("--out")
        .arg(&hf)
        .status()
        .unwrap();
    assert!(st.success());
    let corpus = corpus(tmp.path(), &brown);
    for (cfg, sizes) in [
        // SmolLM2's 9 query / 3 key-value heads, untied, with biases: TP 2 (6+3 heads) and 3.
        (config(tmp.path(), "a.json", 9, 3, false, true), vec![2, 3]),
        // One key-value head for 4 query heads, tied: replicated k/v at TP 2.
        (config(tmp.path(), "b.json", 4, 1, true, false), vec![2]),
    ] {
        let run = Run {
            cfg: &cfg,
            tokenizer: &hf,
            corpus: &corpus,
            out: tmp.path(),
        };
        let stem = cfg.file_stem().unwrap().to_string_lossy().to_string();
        let single = train(&run, &format!("{stem}-tp1"), 1, 1, 3);
        let control = train(&run, &format!("{stem}-control"), 1, 1, 4);
        let c = max_diff(&control, &single);
        assert!(c > 1e-4, "control too close ({c}): the test cannot tell");
        for tp in sizes {
            let sharded = train(&run, &format!("{stem}-tp{tp}"), tp, tp, 3);
            let d = max_diff(&sharded, &single);
            eprintln!("{stem}: TP={tp} vs TP=1: max |Δw| = {d:e} (control {c:e})");
            assert!(d <= 1e-5, "{stem}: TP={tp} differs from one process by {d}");
        }
    }
}

#[test]
fn bad_tensor_parallel_layouts_are_one_sentence() {
    let Some(brown) = asset("brown/eval.jsonl") else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let cfg = config(tmp.path(), "c.json", 4, 2, true, false);
    let corpus = corpus(tmp.path(), &brown);
    // Each command must fail before anything is loaded (the tokenizer does not even exist).
    let fail = |extra: &[&str]| {
        let out = kiln()
            .args(["train", "--task", "causal-lm", "--from-config"])
            .arg(&cfg)
            .arg("--tokenizer")
            .arg(tmp.path().join("missing-tokenizer"))
            .arg("--train-file")
            .arg(&corpus)
            .args(extra)
            .arg("--output-dir")
            .arg(tmp.path().join("o"))
            .output()
            .unwrap();
        assert!(!out.status.success());
        String::from_utf8_lossy(&out.stderr).to_string()
    };
    // Alone, TP 2 has no second process.
    let err = fail(&["--tensor-parallel-size", "2"]);
    assert!(
        err.contains("--tensor-parallel-size 2 needs 2 processes"),
        "{err}"
    );
    // A global batch that the per-device batch does not divide.
    let err = fail(&[
        "--global-batch-size",
        "6",
        "--per-device-train-batch-size",
        "4",
    ]);
    assert!(
        err.contains("--global-batch-size 6 is not a multiple of --per-device-train-batch-size 4"),
        "{err}"
    );
}
