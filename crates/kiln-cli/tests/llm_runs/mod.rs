//! What the multi-process LLM training tests share (`mod llm_runs;`): a small corpus and
//! SmolLM2's tokenizer folder, and readers of a run's logged losses and saved weights.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::Path;

use kiln::formats::safetensors::{read_safetensors, HostTensor};
use kiln_testkit::common::asset;

use crate::kiln_bin::kiln_one_thread;

/// A held-out corpus: the first characters of the first Brown eval text.
pub fn corpus(dir: &Path, brown: &Path) -> std::path::PathBuf {
    let first = std::fs::read_to_string(brown).unwrap();
    let doc: serde_json::Value = serde_json::from_str(first.lines().next().unwrap()).unwrap();
    let text: String = doc["text"].as_str().unwrap().chars().take(4000).collect();
    let p = dir.join("c.jsonl");
    std::fs::write(&p, serde_json::json!({ "text": text }).to_string() + "\n").unwrap();
    p
}

/// A trained folder's weights: the model's, or a LoRA run's adapter.
pub fn weights(out: &Path) -> BTreeMap<String, HostTensor> {
    let model = out.join("model.safetensors");
    if model.exists() {
        read_safetensors(&model).unwrap()
    } else {
        read_safetensors(&out.join("adapter_model.safetensors")).unwrap()
    }
}

/// A temporary folder with SmolLM2's Hugging Face folder (its tokenizer serves the tiny
/// configs) and a small corpus; `None` without the assets.
pub fn setup() -> Option<(tempfile::TempDir, std::path::PathBuf, std::path::PathBuf)> {
    let gguf = asset("smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")?;
    let brown = asset("brown/eval.jsonl")?;
    let tmp = tempfile::tempdir().unwrap();
    let hf = tmp.path().join("smollm2");
    let st = kiln_one_thread()
        .args(["convert", "--from-gguf"])
        .arg(&gguf)
        .arg("--out")
        .arg(&hf)
        .status()
        .unwrap();
    assert!(st.success());
    let corpus = corpus(tmp.path(), &brown);
    Some((tmp, hf, corpus))
}

/// The training losses a run logged, step by step.
pub fn losses(out: &Path) -> Vec<f64> {
    std::fs::read_to_string(out.join("log.jsonl"))
        .unwrap()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok()?["loss"].as_f64())
        .collect()
}

/// The largest |Δ| between two runs' weights, which must name the same tensors of the same shapes.
pub fn max_diff(a: &BTreeMap<String, HostTensor>, b: &BTreeMap<String, HostTensor>) -> f32 {
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

/// Copies folder `from` to `to` (files and sub-folders).
pub fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        if e.file_type().unwrap().is_dir() {
            copy_dir(&e.path(), &to.join(e.file_name()));
        } else {
            std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
        }
    }
}
