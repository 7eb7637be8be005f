//! kiln's model card as the Hub's own library reads it: a README.md written by `model_card` is
//! loaded with `huggingface_hub.ModelCard.load` (in the reference venv), and its metadata and
//! evaluation results must be the run's.

use std::process::Command;

use kiln_testkit::common::{json_object, python_with};

use kiln::report::model_card::{model_card, CardInput, CardTask};
use kiln::train::TrainingArguments;
use serde_json::{json, Map, Value};

/// Loads README.md with huggingface_hub and prints its metadata and evaluation results as JSON.
const READ_CARD: &str = r#"
import json, sys
from huggingface_hub import ModelCard
card = ModelCard.load(sys.argv[1])
results = [
    {"task_type": r.task_type, "task_name": r.task_name, "dataset_type": r.dataset_type,
     "dataset_name": r.dataset_name, "dataset_split": r.dataset_split,
     "metric_type": r.metric_type, "metric_name": r.metric_name, "metric_value": r.metric_value}
    for r in (card.data.eval_results or [])
]
print(json.dumps({"data": card.data.to_dict(), "eval_results": results,
                  "model_name": card.data.model_name, "text": card.text}))
"#;

#[test]
fn huggingface_hub_reads_the_card_and_its_results() {
    let py = match python_with("huggingface_hub") {
        Ok(py) => py,
        Err(why) => {
            eprintln!("skipped: model card interop test: {why} (set KILN_PYTHON)");
            return;
        }
    };
    let log: Vec<Map<String, Value>> = vec![
        json_object(
            json!({"loss": 1.1, "grad_norm": 3.0, "learning_rate": 4e-5, "epoch": 0.5, "step": 50}),
        ),
        json_object(
            json!({"eval_loss": 0.9, "eval_accuracy": 0.61, "eval_f1": 0.55, "eval_runtime": 2.0,
                     "eval_samples_per_second": 250.0, "eval_steps_per_second": 4.0,
                     "epoch": 0.5, "step": 50}),
        ),
        json_object(
            json!({"loss": 0.7, "grad_norm": 2.0, "learning_rate": 2e-5, "epoch": 1.0, "step": 100}),
        ),
        json_object(
            json!({"eval_loss": 0.65, "eval_accuracy": 0.7421875, "eval_f1": 0.7012345678,
                     "eval_runtime": 2.0, "eval_samples_per_second": 250.0,
                     "eval_steps_per_second": 4.0, "epoch": 1.0, "step": 100}),
        ),
        json_object(
            json!({"train_runtime": 60.5, "train_samples_per_second": 26.4,
                     "train_steps_per_second": 1.65, "total_flos": 1.2e13, "train_loss": 0.9,
                     "epoch": 1.0, "step": 100}),
        ),
    ];
    let args = TrainingArguments {
        learning_rate: 5e-5,
        per_device_train_batch_size: 16,
        num_train_epochs: 1.0,
        ..TrainingArguments::default()
    };
    let card = model_card(&CardInput {
        model_name: "minilm-tweets".into(),
        base_model: Some("sentence-transformers/all-MiniLM-L6-v2".into()),
        base_model_on_hub: true,
        dataset: Some("cardiffnlp/tweet_eval".into()),
        dataset_split: Some("validation".into()),
        task: CardTask::TextClassification,
        hyperparameters: kiln::train::card_hyperparameters::card_hyperparameters(&args, 1),
        log_history: &log,
    });
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("README.md");
    std::fs::write(&path, &card).unwrap();

    let out = Command::new(&py)
        .args(["-c", READ_CARD])
        .arg(&path)
        .env("HF_HUB_OFFLINE", "1")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "huggingface_hub could not load the card:\n{}\n--- card ---\n{card}",
        String::from_utf8_lossy(&out.stderr)
    );
    let got: Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!("{e}: {}", String::from_utf8_lossy(&out.stdout));
    });

    let data = &got["data"];
    assert_eq!(data["library_name"], "transformers");
    assert_eq!(data["base_model"], "sentence-transformers/all-MiniLM-L6-v2");
    assert_eq!(data["tags"], json!(["generated_from_trainer", "kiln"]));
    assert_eq!(data["datasets"], json!(["cardiffnlp/tweet_eval"]));
    assert_eq!(data["metrics"], json!(["accuracy", "f1"]));
    assert!(data.get("license").is_none(), "{data}");
    assert_eq!(got["model_name"], "minilm-tweets");

    // The last evaluation's metrics, one EvalResult each, values as logged.
    let last = &log[3];
    let results = got["eval_results"].as_array().unwrap();
    assert_eq!(results.len(), 2, "{got}");
    for (r, (name, tag)) in results.iter().zip([("Accuracy", "accuracy"), ("F1", "f1")]) {
        assert_eq!(r["task_type"], "text-classification");
        assert_eq!(r["task_name"], "Text Classification");
        assert_eq!(r["dataset_type"], "cardiffnlp/tweet_eval");
        assert_eq!(r["dataset_name"], "cardiffnlp/tweet_eval");
        assert_eq!(r["dataset_split"], "validation");
        assert_eq!(r["metric_type"], tag);
        assert_eq!(r["metric_name"], name);
        assert_eq!(
            r["metric_value"].as_f64().unwrap(),
            last[&format!("eval_{tag}")].as_f64().unwrap(),
            "{tag}"
        );
    }

    // The body: what follows the front matter.
    let text = got["text"].as_str().unwrap();
    assert!(text.contains("\n# minilm-tweets\n"), "{text}");
    assert!(
        text.contains("- Loss: 0.65\n- Accuracy: 0.7422\n- F1: 0.7012\n"),
        "{text}"
    );
    assert!(
        text.contains("| 1.1           | 0.5   | 50   | 0.9             |"),
        "{text}"
    );
}
