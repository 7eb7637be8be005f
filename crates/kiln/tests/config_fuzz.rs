//! Property tests (proptest, bounded): model configs, training-argument files and safetensors files
//! of any content are read into a value or a clear error — never a panic, and never an allocation
//! sized by a number in the file. `KILN_FUZZ_CASES` raises the case count.

use std::collections::BTreeMap;

use kiln::formats::safetensors::{read_safetensors, write_safetensors, HostTensor};
use kiln::models::bert::config::BertConfig;
use kiln::models::llama::config::LlamaConfig;
use kiln::train::TrainingArguments;
use proptest::prelude::*;
use serde_json::{json, Value};

fn cases() -> u32 {
    std::env::var("KILN_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1000)
}

/// Numbers a hostile config holds: zero, negative, huge, fractional, and non-numbers.
fn nasty_value() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(json!(0)),
        Just(json!(1)),
        Just(json!(-1)),
        Just(json!(2)),
        Just(json!(64)),
        Just(json!(1u64 << 40)),
        Just(json!(u64::MAX)),
        Just(json!(1.5)),
        Just(json!(-0.5)),
        Just(json!(1e300)),
        Just(json!("64")),
        Just(json!(null)),
        Just(json!([1, 2])),
        Just(json!({"a": 1})),
        Just(json!(true)),
        (0u64..100_000).prop_map(|n| json!(n)),
    ]
}

fn bert_keys() -> Vec<&'static str> {
    vec![
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "intermediate_size",
        "max_position_embeddings",
        "type_vocab_size",
        "hidden_dropout_prob",
        "attention_probs_dropout_prob",
        "layer_norm_eps",
        "initializer_range",
        "pad_token_id",
        "classifier_dropout",
        "model_type",
        "id2label",
    ]
}

fn llama_keys() -> Vec<&'static str> {
    vec![
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
        "rms_norm_eps",
        "rope_theta",
        "rope_scaling",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "tie_word_embeddings",
        "model_type",
    ]
}

/// A valid config with some keys replaced by nasty values (or removed).
fn mutated(base: Value, keys: Vec<&'static str>) -> impl Strategy<Value = Value> {
    prop::collection::vec(
        (prop::sample::select(keys), nasty_value(), any::<bool>()),
        0..6,
    )
    .prop_map(move |edits| {
        let mut c = base.clone();
        for (k, v, remove) in edits {
            if remove {
                c.as_object_mut().unwrap().remove(k);
            } else {
                c[k] = v;
            }
        }
        c
    })
}

fn write(dir: &std::path::Path, name: &str, bytes: &[u8]) -> std::path::PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, bytes).unwrap();
    p
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn bert_configs_validate_or_fail_clearly(c in mutated(json!({
        "vocab_size": 100, "hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2,
        "intermediate_size": 16, "model_type": "bert"}), bert_keys())) {
        let dir = tempfile::tempdir().unwrap();
        let p = write(dir.path(), "config.json", c.to_string().as_bytes());
        match BertConfig::from_file(&p) {
            Ok(cfg) => {
                // What validation lets through is usable: sizes positive, heads divide hidden.
                prop_assert!(cfg.hidden_size > 0 && cfg.num_attention_heads > 0);
                prop_assert!(cfg.hidden_size % cfg.num_attention_heads == 0);
                prop_assert!(cfg.param_count(2).is_finite());
            }
            Err(e) => prop_assert!(e.to_string().contains("config.json"), "{e}"),
        }
    }

    #[test]
    fn llama_configs_validate_or_fail_clearly(c in mutated(json!({
        "vocab_size": 100, "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1,
        "num_attention_heads": 2, "num_key_value_heads": 1, "model_type": "llama"}), llama_keys())) {
        let dir = tempfile::tempdir().unwrap();
        let p = write(dir.path(), "config.json", c.to_string().as_bytes());
        match LlamaConfig::from_file(&p) {
            Ok(cfg) => {
                prop_assert!(cfg.head_size() >= 2 && cfg.head_size() % 2 == 0);
                prop_assert!(cfg.num_attention_heads % cfg.kv_heads() == 0);
                prop_assert!(cfg.inv_freq().iter().all(|f| f.is_finite()));
            }
            Err(e) => prop_assert!(e.to_string().contains("config.json"), "{e}"),
        }
    }

    #[test]
    fn training_argument_files_parse_or_fail_clearly(
        edits in prop::collection::vec((prop::sample::select(vec![
            "learning_rate", "num_train_epochs", "max_steps", "per_device_train_batch_size",
            "adam_beta1", "adam_epsilon", "warmup_ratio", "save_steps", "save_total_limit",
            "eval_strategy", "lr_scheduler_type", "seed"]), nasty_value()), 0..5),
        yaml in any::<bool>(),
    ) {
        let mut c = json!({});
        for (k, v) in edits {
            c[k] = v;
        }
        let dir = tempfile::tempdir().unwrap();
        let (name, text) = if yaml {
            ("args.yaml", serde_yaml_ng::to_string(&c).unwrap())
        } else {
            ("args.json", c.to_string())
        };
        let p = write(dir.path(), name, text.as_bytes());
        match TrainingArguments::from_file(&p).and_then(|a| a.validate().map(|()| a)) {
            Ok(a) => prop_assert!(a.learning_rate.is_finite() && a.learning_rate >= 0.0),
            Err(e) => prop_assert!(!e.to_string().is_empty()),
        }
    }

    /// A small valid safetensors file, then bytes flipped, cut or overwritten anywhere.
    #[test]
    fn safetensors_files_read_or_fail_clearly(
        flips in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..8),
        cut in prop::option::of(any::<prop::sample::Index>()),
        header_len in prop::option::of(prop_oneof![Just(0u64), Just(7), Just(u64::MAX), Just(1 << 40), 0u64..4096]),
    ) {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("model.safetensors");
        let tensors = BTreeMap::from([
            ("a.weight".to_string(), HostTensor { shape: vec![2, 3], data: vec![1.0; 6] }),
            ("b.bias".to_string(), HostTensor { shape: vec![3], data: vec![0.5; 3] }),
        ]);
        write_safetensors(&p, &tensors).unwrap();
        let mut bytes = std::fs::read(&p).unwrap();
        if let Some(n) = header_len {
            bytes[..8].copy_from_slice(&n.to_le_bytes());
        }
        for (i, b) in flips {
            let at = i.index(bytes.len());
            bytes[at] = b;
        }
        if let Some(c) = cut {
            bytes.truncate(c.index(bytes.len() + 1));
        }
        std::fs::write(&p, &bytes).unwrap();
        match read_safetensors(&p) {
            Ok(t) => {
                for (name, v) in &t {
                    prop_assert_eq!(v.shape.iter().product::<usize>(), v.data.len(), "{}", name);
                }
            }
            Err(e) => prop_assert!(e.to_string().contains("model.safetensors"), "{e}"),
        }
    }
}
