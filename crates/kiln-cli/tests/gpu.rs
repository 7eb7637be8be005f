//! GPU tests: built only with `--features cuda` (`cargo test -p kiln-cli --features cuda --test gpu`)
//! and skipped, with a message, on a machine with too few CUDA devices. CI has none; they run when
//! a session is lent a GPU machine.
#![cfg(feature = "cuda")]

mod kiln_bin;

use std::path::Path;
use std::process::Command;

use kiln_bin::kiln;
use kiln_testkit::common::{self, max_abs_diff, model_weights, tiny_bert_and_tweets, train_args};

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

fn train(
    device: &str,
    launch: Option<usize>,
    model: &Path,
    tweets: &Path,
    batch: usize,
    out: &Path,
    extra: &[&str],
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
        .args(extra)
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
/// different kernels sum in different orders). Plain SGD shows the gradients agree; AdamW divides
/// each gradient by its own running size, so a weight whose gradient is rounding noise moves by up
/// to the learning rate either way: there the bulk of the weights must agree, on average.
#[test]
fn cuda_training_matches_the_cpu() {
    let Some((tmp, model, tweets)) = setup(1) else {
        return;
    };
    for (optim, check) in [("sgd", "max"), ("adamw_torch", "mean")] {
        let cpu = tmp.path().join(format!("cpu-{optim}"));
        let gpu = tmp.path().join(format!("gpu-{optim}"));
        let extra = ["--optim", optim];
        train("cpu", None, &model, &tweets, 16, &cpu, &extra);
        train("cuda", None, &model, &tweets, 16, &gpu, &extra);
        let (a, b) = (model_weights(&cpu), model_weights(&gpu));
        let diff = if check == "max" {
            max_abs_diff(&a, &b)
        } else {
            mean_abs_diff(&a, &b)
        };
        eprintln!("{optim}: CUDA vs CPU after 4 steps: {check} |Δw| = {diff:e}");
        assert!(
            diff < 1e-5,
            "{optim}: CUDA training differs from the CPU: {check} |Δw| = {diff}"
        );
    }
}

/// Mean |a − b| over every weight.
fn mean_abs_diff(a: &[(String, Vec<f32>)], b: &[(String, Vec<f32>)]) -> f32 {
    let (mut sum, mut n) = (0f64, 0usize);
    for ((ka, va), (kb, vb)) in a.iter().zip(b) {
        assert_eq!(ka, kb);
        for (x, y) in va.iter().zip(vb) {
            sum += f64::from((x - y).abs());
            n += 1;
        }
    }
    (sum / n.max(1) as f64) as f32
}

/// Two CUDA workers (one GPU each, gradients through NCCL) × batch 8 equal one GPU × batch 16.
#[test]
fn two_cuda_workers_through_nccl_equal_one_gpu() {
    let Some((tmp, model, tweets)) = setup(2) else {
        return;
    };
    let (one, two) = (tmp.path().join("one"), tmp.path().join("two"));
    train("cuda", None, &model, &tweets, 16, &one, &[]);
    train("cuda", Some(2), &model, &tweets, 8, &two, &[]);
    let diff = max_abs_diff(&model_weights(&one), &model_weights(&two));
    eprintln!("2 GPUs x 8 (NCCL) vs 1 GPU x 16: max |Δw| = {diff:e}");
    assert!(diff < 1e-4, "NCCL data parallel differs by {diff}");
}
