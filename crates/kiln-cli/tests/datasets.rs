//! `kiln train --dataset-dir` on a DatasetDict that `datasets` saved from real tweets trains and
//! evaluates exactly as the CSV files of the same rows do (tests/fixtures/datasets).

mod kiln_bin;

use kiln_bin::kiln;
use kiln_testkit::common::repo_root;

/// The JSON objects a command prints first: `kiln train`'s training summary, then the
/// evaluation's metrics; `kiln eval`'s metrics (a text report follows them).
fn printed_metrics(stdout: &[u8]) -> Vec<serde_json::Value> {
    serde_json::Deserializer::from_slice(stdout)
        .into_iter::<serde_json::Value>()
        .map_while(Result::ok)
        .collect()
}

/// The evaluation's metrics without its timings.
fn eval_metrics(args: &[&str], out: &std::path::Path) -> serde_json::Value {
    let o = kiln()
        .args(["train", "--model"])
        .arg(repo_root().join("tests/fixtures/families/distilbert"))
        .args(args)
        .args([
            "--num-train-epochs",
            "2",
            "--per-device-train-batch-size",
            "16",
        ])
        .args([
            "--learning-rate",
            "2e-3",
            "--max-length",
            "48",
            "--seed",
            "3",
        ])
        .args(["--save-strategy", "no", "--eval-strategy", "epoch"])
        .arg("--output-dir")
        .arg(out)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let mut m = printed_metrics(&o.stdout).pop().unwrap();
    let obj = m.as_object_mut().unwrap();
    obj.retain(|k, _| !k.contains("runtime") && !k.contains("per_second"));
    m
}

#[test]
fn a_dataset_dict_trains_like_the_csv_of_its_rows() {
    let data = repo_root().join("tests/fixtures/datasets");
    let tmp = tempfile::tempdir().unwrap();
    let dict = data.join("tweets_dict");
    let from_dict = eval_metrics(
        &["--dataset-dir", dict.to_str().unwrap()],
        &tmp.path().join("a"),
    );
    let (train, eval) = (
        data.join("tweets_train_200.csv"),
        data.join("tweets_validation_100.csv"),
    );
    let from_csv = eval_metrics(
        &[
            "--train-file",
            train.to_str().unwrap(),
            "--eval-file",
            eval.to_str().unwrap(),
        ],
        &tmp.path().join("b"),
    );
    assert!(from_dict["eval_f1"].as_f64().is_some(), "{from_dict}");
    assert_eq!(from_dict, from_csv);
    // The label names are the ClassLabel's.
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(tmp.path().join("a/config.json")).unwrap())
            .unwrap();
    assert_eq!(config["id2label"]["2"], "positive");

    // `kiln eval` picks the same split on its own (validation), or the one asked for.
    let eval_cmd = |split: &[&str]| {
        kiln()
            .args(["eval", "--model"])
            .arg(tmp.path().join("a"))
            .args([
                "--dataset-dir",
                dict.to_str().unwrap(),
                "--max-length",
                "48",
            ])
            .args(split)
            .output()
            .unwrap()
    };
    let o = eval_cmd(&[]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let m = printed_metrics(&o.stdout).remove(0);
    assert_eq!(m["eval_f1"], from_dict["eval_f1"]);
    let o = eval_cmd(&["--eval-split", "nope"]);
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(
        e.contains("no split \"nope\" (splits: train, validation)"),
        "{e}"
    );
}
