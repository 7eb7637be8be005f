//! GPU tests: built only with `--features cuda` (`cargo test -p kiln-cli --features cuda --test gpu`)
//! and skipped, with a message, on a machine with too few CUDA devices. CI has none; they run when
//! a session is lent a GPU machine.
#![cfg(feature = "cuda")]

#[path = "../../kiln/tests/common.rs"]
mod common;

use std::path::Path;
use std::process::Command;

use common::{max_abs_diff, model_weights, tiny_bert_and_tweets, train_args};

/// CUDA devices on this machine (0 without a driver).
fn cuda_devices() -> usize {
    Command::new("nvidia-smi")
        .arg("-L")
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map_or(0, |o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .filter(|l| l.starts_with("GPU "))
                .count()
        })
}

fn kiln() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_kiln"));
    c.env("KILN_LOG", "warn");
    c
}

fn train(
    device: &str,
    launch: Option<usize>,
    model: &Path,
    tweets: &Path,
    batch: usize,
    out: &Path,
) {
    let mut c = kiln();
    if let Some(n) = launch {
        c.args(["launch", "--nproc-per-node", &n.to_string()])
            .args([
                "--master-port",
                &common::free_ports(2).to_string(),
                "--timeout",
                "120",
                "--",
            ]);
    }
    // `--device` goes with `train`, so launched workers get it too.
    let st = c
        .args(train_args(model, tweets, batch, out, 4))
        .args(["--device", device])
        .status()
        .unwrap();
    assert!(st.success(), "{device} run into {} failed", out.display());
}

/// The tiny dropout-free BERT and the tweets, or `None` (skip) without `min_gpus` devices.
fn setup(min_gpus: usize) -> Option<(tempfile::TempDir, std::path::PathBuf, std::path::PathBuf)> {
    let found = cuda_devices();
    if found < min_gpus {
        eprintln!("skipped: needs {min_gpus} CUDA device(s), found {found}");
        return None;
    }
    tiny_bert_and_tweets(false)
}

/// The same 4 training steps on the GPU and on the CPU end at the same weights (float tolerance:
/// different kernels sum in different orders).
#[test]
fn cuda_training_matches_the_cpu() {
    let Some((tmp, model, tweets)) = setup(1) else {
        return;
    };
    let (cpu, gpu) = (tmp.path().join("cpu"), tmp.path().join("gpu"));
    train("cpu", None, &model, &tweets, 16, &cpu);
    train("cuda", None, &model, &tweets, 16, &gpu);
    let diff = max_abs_diff(&model_weights(&cpu), &model_weights(&gpu));
    eprintln!("CUDA vs CPU after 4 steps: max |Δw| = {diff:e}");
    assert!(diff < 1e-3, "CUDA training differs from the CPU by {diff}");
}

/// Two CUDA workers (one GPU each, gradients through NCCL) × batch 8 equal one GPU × batch 16.
#[test]
fn two_cuda_workers_through_nccl_equal_one_gpu() {
    let Some((tmp, model, tweets)) = setup(2) else {
        return;
    };
    let (one, two) = (tmp.path().join("one"), tmp.path().join("two"));
    train("cuda", None, &model, &tweets, 16, &one);
    train("cuda", Some(2), &model, &tweets, 8, &two);
    let diff = max_abs_diff(&model_weights(&one), &model_weights(&two));
    eprintln!("2 GPUs x 8 (NCCL) vs 1 GPU x 16: max |Δw| = {diff:e}");
    assert!(diff < 1e-4, "NCCL data parallel differs by {diff}");
}
