//! kiln's TensorBoard event files as TensorBoard reads them: a file written by `EventWriter` is
//! loaded by tensorboard's own EventAccumulator (tests/interop/read_tensorboard.py, in the
//! reference venv), and every scalar, the args text and the event count must come back.

use std::collections::BTreeMap;
use std::process::Command;

use kiln::report::tensorboard::{hf_scalars, EventWriter};
use kiln_testkit::common::{json_object, python_with, repo_root};
use serde_json::{json, Map, Value};

#[test]
fn tensorboard_reads_back_every_scalar_and_the_args_text() {
    let py = match python_with("tensorboard") {
        Ok(py) => py,
        Err(why) => {
            eprintln!("skipped: tensorboard interop test: {why} (set KILN_PYTHON)");
            return;
        }
    };
    let tmp = tempfile::tempdir().unwrap();
    let log_dir = tmp.path().join("runs/test");
    let mut w = EventWriter::create(&log_dir).unwrap();

    // Text with quotes, newlines and non-ASCII, as TrainingArguments' JSON may hold.
    let args_text = serde_json::to_string_pretty(&json!({
        "output_dir": "runs/ünïcödé \"x\"", "learning_rate": 5e-5, "seed": 42
    }))
    .unwrap();
    w.add_text("args", 0, &args_text).unwrap();

    // Logged entries as the trainer logs them: train every 5 steps, eval every 10, a summary.
    let mut log: Vec<Map<String, Value>> = Vec::new();
    for step in (5..=40u64).step_by(5) {
        let s = step as f64;
        log.push(json_object(json!({
            "loss": 2.0 / s + 0.123_456_789,
            "grad_norm": 1.0 + s.sin(),
            "learning_rate": 5e-5 * (1.0 - s / 40.0),
            "epoch": s / 20.0,
            "step": step,
        })));
        if step % 10 == 0 {
            log.push(json_object(json!({
                "eval_loss": 1.0 / s,
                "eval_accuracy": 0.5 + s / 100.0,
                "epoch": s / 20.0,
                "step": step,
            })));
        }
    }
    log.push(json_object(json!({
        "train_runtime": 12.3456, "train_loss": 0.321, "total_flos": 1.234e15, "epoch": 2.0,
        "step": 40,
    })));

    // What the file must hold, per tag: (step, value) in writing order.
    let mut want: BTreeMap<String, Vec<(u64, f64)>> = BTreeMap::new();
    let mut scalar_events = 0;
    for e in &log {
        let step = e["step"].as_u64().unwrap();
        let scalars = hf_scalars(e);
        scalar_events += scalars.len();
        for (tag, v) in &scalars {
            want.entry(tag.clone()).or_default().push((step, *v));
        }
        w.add_scalars(step, &scalars).unwrap();
    }
    for tag in [
        "train/loss",
        "train/learning_rate",
        "train/grad_norm",
        "train/epoch",
        "eval/loss",
        "eval/accuracy",
        "train/train_loss",
        "train/total_flos",
    ] {
        assert!(want.contains_key(tag), "{tag} not written: {want:?}");
    }
    let written = std::fs::metadata(w.path()).unwrap().len();
    assert!(written > 0);

    // Read while the writer is still open: each call flushed its events.
    let script = repo_root().join("tests/interop/read_tensorboard.py");
    let out = Command::new(&py)
        .arg(&script)
        .arg(&log_dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{} failed:\n{}",
        script.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let got: Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!("{e}: {}", String::from_utf8_lossy(&out.stdout));
    });
    drop(w);

    assert_eq!(got["file_version"], "brain.Event:2");
    // No event lost: the version event, one per scalar, the text.
    assert_eq!(
        got["records"].as_u64().unwrap() as usize,
        1 + scalar_events + 1,
        "{got}"
    );

    let scalars = got["scalars"].as_object().unwrap();
    // The reader lists tags in the order it met them; the same set as written.
    let mut tags: Vec<_> = scalars.keys().collect();
    tags.sort();
    assert_eq!(tags, want.keys().collect::<Vec<_>>(), "scalar tags");
    for (tag, points) in &want {
        let back = scalars[tag].as_array().unwrap();
        assert_eq!(back.len(), points.len(), "{tag}: {back:?}");
        for ((step, v), b) in points.iter().zip(back) {
            assert_eq!(b[0].as_u64().unwrap(), *step, "{tag}");
            // TensorBoard keeps f32: the value back is the f32 nearest to what was logged
            // (compared as f32: serde_json's default float parsing may be 1 ulp off in f64).
            let b = b[1].as_f64().unwrap();
            assert_eq!(b as f32, *v as f32, "{tag} at step {step}: {b} vs {v}");
        }
    }

    assert_eq!(
        got["texts"],
        json!({ "args/text_summary": [[0, args_text]] }),
        "texts"
    );
}
