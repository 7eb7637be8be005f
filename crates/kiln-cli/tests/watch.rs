//! What a finished run leaves for people to look at, from the binary as a user runs it: TensorBoard
//! events that TensorBoard's own reader takes (against the run's log.jsonl), the curves, the model
//! card, `kiln plot` over two runs, `--report-to` choices, and plain log lines off a terminal.

mod kiln_bin;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use kiln_bin::kiln_one_thread;
use kiln_testkit::common::{self, repo_root, tiny_bert_and_tweets, train_args};
use serde_json::Value;

fn train(model: &Path, tweets: &Path, out: &Path, extra: &[&str]) -> Output {
    // The common arguments, evaluating every 4 steps and logging every 2, less any flag `extra`
    // sets.
    let mut args = train_args(model, tweets, 8, out, 12);
    let at = args.iter().position(|a| a == "--eval-strategy").unwrap();
    args.drain(at..at + 2);
    for a in [
        "--eval-split",
        "0.2",
        "--eval-strategy",
        "steps",
        "--eval-steps",
        "4",
        "--logging-steps",
        "2",
    ] {
        args.push(a.to_string());
    }
    for flag in extra.iter().filter(|a| a.starts_with("--")) {
        if let Some(at) = args.iter().position(|a| a == flag) {
            args.drain(at..at + 2);
        }
    }
    let o = kiln_one_thread()
        .env("KILN_LOG", "info")
        .args(args)
        .args(extra)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    o
}

fn log_lines(out: &Path) -> Vec<Value> {
    std::fs::read_to_string(out.join("log.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn is_png(path: &Path) -> bool {
    std::fs::read(path).is_ok_and(|b| b.starts_with(b"\x89PNG\r\n\x1a\n") && b.len() > 10_000)
}

/// The train losses log.jsonl holds as (step, loss): every 2 steps.
fn logged_train_losses(log: &[Value]) -> Vec<(u64, f64)> {
    let train_loss: Vec<(u64, f64)> = log
        .iter()
        .filter_map(|e| Some((e["step"].as_u64()?, e.get("loss")?.as_f64()?)))
        .collect();
    assert_eq!(
        train_loss.iter().map(|p| p.0).collect::<Vec<_>>(),
        [2, 4, 6, 8, 10, 12]
    );
    train_loss
}

/// TensorBoard's folder: runs/<start time>_<host> as transformers names it (the run name is a
/// label, never a path), holding one event file.
fn tensorboard_folder(run: &Path) -> PathBuf {
    let runs: Vec<_> = std::fs::read_dir(run.join("runs"))
        .unwrap()
        .flatten()
        .collect();
    assert_eq!(runs.len(), 1, "one TensorBoard folder");
    let tb = runs[0].path();
    assert_ne!(runs[0].file_name(), "lr-1e-3");
    let events: Vec<_> = std::fs::read_dir(&tb).unwrap().flatten().collect();
    assert_eq!(events.len(), 1, "one event file");
    assert!(events[0]
        .file_name()
        .to_string_lossy()
        .starts_with("events.out.tfevents."));
    tb
}

/// The events as TensorBoard's own reader reads them (skipped without the `tensorboard` package):
/// every logged train loss and eval accuracy at its step, the other scalars, the args text.
fn check_events_read_back(tb: &Path, log: &[Value], train_loss: &[(u64, f64)]) {
    let py = match common::python_with("tensorboard") {
        Ok(py) => py,
        Err(why) => {
            eprintln!("skipped: reading the events back: {why}");
            return;
        }
    };
    let r = Command::new(py)
        .arg(repo_root().join("tests/interop/read_tensorboard.py"))
        .arg(tb)
        .output()
        .unwrap();
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    let read: Value = serde_json::from_slice(&r.stdout).unwrap();
    let scalars = &read["scalars"];
    // Every logged train loss and eval accuracy, at its step (f32 in the file).
    let tb_loss: Vec<(u64, f64)> = scalars["train/loss"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| (p[0].as_u64().unwrap(), p[1].as_f64().unwrap()))
        .collect();
    assert_eq!(tb_loss.len(), train_loss.len());
    for ((s1, v1), (s2, v2)) in tb_loss.iter().zip(train_loss) {
        assert_eq!(s1, s2);
        assert!((v1 - v2).abs() <= 1e-6 * v2.abs().max(1.0), "{v1} vs {v2}");
    }
    let evals: Vec<&Value> = log
        .iter()
        .filter(|e| e.get("eval_accuracy").is_some())
        .collect();
    let tb_acc = scalars["eval/accuracy"].as_array().unwrap();
    assert_eq!(tb_acc.len(), evals.len());
    for (p, e) in tb_acc.iter().zip(&evals) {
        assert_eq!(p[0], e["step"]);
        let (v, want) = (p[1].as_f64().unwrap(), e["eval_accuracy"].as_f64().unwrap());
        assert!((v - want).abs() < 1e-6, "{v} vs {want}");
    }
    for tag in [
        "train/learning_rate",
        "train/grad_norm",
        "eval/loss",
        "eval/f1",
    ] {
        assert!(scalars.get(tag).is_some(), "{tag} in {:?}", scalars);
    }
    let args = read["texts"]["args/text_summary"][0][1].as_str().unwrap();
    assert!(args.contains("\"run_name\": \"lr-1e-3\""), "{args}");
}

/// The end of the run: curves and the model card, whose result is the final evaluation.
fn check_curves_and_card(run: &Path) {
    assert!(is_png(&run.join("training_curves.png")));
    let card = std::fs::read_to_string(run.join("README.md")).unwrap();
    let final_eval: Value =
        serde_json::from_str(&std::fs::read_to_string(run.join("eval_results.json")).unwrap())
            .unwrap();
    // The final evaluation (eval_results.json) is the card's result, as in transformers'
    // scripts, which evaluate before writing the card.
    let last_logged = &final_eval;
    assert!(card.starts_with("---\n"), "{card}");
    assert!(card.contains("model-index"), "{card}");
    assert!(card.contains("- learning_rate: 0.001"), "{card}");
    // Rounded to 4 places, as transformers' card does.
    let acc = (last_logged["eval_accuracy"].as_f64().unwrap() * 1e4).round() / 1e4;
    let acc = format!("- Accuracy: {acc}\n");
    assert!(
        card.contains(&acc),
        "the last evaluation's {acc} in the card:\n{card}"
    );
    assert!(
        card.contains("value: "),
        "model-index results with values:\n{card}"
    );
    assert!(final_eval["eval_accuracy"].is_number());
}

/// `kiln plot` over two runs, to `out` (its format from the extension).
fn plot(a: &Path, b: &Path, out: &Path) -> Output {
    kiln_one_thread()
        .env_remove("KILN_LOG")
        .arg("plot")
        .args([a, b])
        .arg("--out")
        .arg(out)
        .output()
        .unwrap()
}

/// `kiln plot` overlays two runs, as PNG and as SVG with both runs in the legend.
fn check_plots_of_both(tmp: &Path, a: &Path, b: &Path) {
    let png = tmp.join("both.png");
    let p = plot(a, b, &png);
    assert!(p.status.success(), "{}", String::from_utf8_lossy(&p.stderr));
    assert!(is_png(&png));
    let svg = tmp.join("both.svg");
    let p = plot(a, b, &svg);
    assert!(p.status.success());
    let svg = std::fs::read_to_string(svg).unwrap();
    assert!(
        svg.contains("lr-1e-3") && svg.contains("run-b"),
        "both runs in the legend"
    );
}

#[test]
fn a_run_leaves_tensorboard_events_curves_and_a_model_card() {
    let Some((tmp, model, tweets)) = tiny_bert_and_tweets(true) else {
        return;
    };
    let a = tmp.path().join("run-a");
    let o = train(&model, &tweets, &a, &["--run-name", "lr-1e-3"]);
    // Standard error is a pipe here: no colour codes in the log lines.
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(stderr.contains("eval at step 4"), "{stderr}");
    assert!(
        !stderr.contains('\x1b'),
        "escape codes off a terminal: {stderr:?}"
    );

    // log.jsonl: train entries every 2 steps, evaluations every 4, the summary.
    let log = log_lines(&a);
    let train_loss = logged_train_losses(&log);
    let tb = tensorboard_folder(&a);
    check_events_read_back(&tb, &log, &train_loss);
    check_curves_and_card(&a);

    // A second run at another learning rate, then both overlaid.
    let b = tmp.path().join("run-b");
    train(
        &model,
        &tweets,
        &b,
        &["--learning-rate", "3e-4", "--report-to", "jsonl"],
    );
    assert!(
        !b.join("runs").exists(),
        "--report-to jsonl writes no TensorBoard files"
    );
    check_plots_of_both(tmp.path(), &a, &b);
}

#[test]
fn report_to_none_writes_no_logs_and_the_card_has_the_final_eval() {
    let Some((tmp, model, tweets)) = tiny_bert_and_tweets(true) else {
        return;
    };
    // --report-to none: neither file.
    // (Without evaluations during training, the card's result is the final evaluation's.)
    let c = tmp.path().join("run-c");
    train(
        &model,
        &tweets,
        &c,
        &["--report-to", "none", "--eval-strategy", "no"],
    );
    assert!(!c.join("log.jsonl").exists() && !c.join("runs").exists());
    let card = std::fs::read_to_string(c.join("README.md")).unwrap();
    let final_eval: Value =
        serde_json::from_str(&std::fs::read_to_string(c.join("eval_results.json")).unwrap())
            .unwrap();
    let loss = (final_eval["eval_loss"].as_f64().unwrap() * 1e4).round() / 1e4;
    assert!(card.contains(&format!("- Loss: {loss}\n")), "{card}");
}

#[test]
fn report_to_an_integration_kiln_lacks_is_one_sentence() {
    let Some((tmp, model, tweets)) = tiny_bert_and_tweets(true) else {
        return;
    };
    let bad = kiln_one_thread()
        .env_remove("KILN_LOG")
        .args(train_args(&model, &tweets, 8, &tmp.path().join("run-d"), 2))
        .args(["--report-to", "wandb"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&bad.stderr);
    assert!(!bad.status.success());
    assert!(err.contains("wandb is not built into kiln"), "{err}");
}
