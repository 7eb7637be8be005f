//! LoRA against PyTorch + peft (tests/fixtures/gen_sft_lora.py, no Python here): the adapted
//! model's logits, loss and every adapter gradient on a tiny Llama (q/v with PEFT's default
//! initialisation; all-linear with rsLoRA and non-zero B) and a tiny BERT classifier (query/value
//! plus the classifier head PEFT trains whole); frozen parameters get no gradient; the folder
//! kiln writes holds PEFT's names, shapes and config keys; merging equals `merge_and_unload()`.
//! And the SFT loss of TRL's `SFTTrainer` on fixed batches, through kiln's SFT batches, padded
//! and packed (padding-free).

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

use burn::tensor::{Int, Tensor, TensorData};
use kiln::backend::{Cpu, CpuTrain};
use kiln::contract::Model;
use kiln::data::batch::TextBatch;
use kiln::data::lm::TokenBatch;
use kiln::formats::safetensors::{read_safetensors, HostTensor};
use kiln::models::auto::{load_causal_lm, EncoderConfig};
use kiln::models::classifier::SequenceClassifier;
use kiln::models::llama::Llama;
use kiln::models::lora::{self, internal_key, LoraConfig, TargetModules};
use kiln::models::params::{load_into, module_tensors};
use kiln::train::optim::GradAccumulator;
use kiln::train::{CrossEntropy, Loss};
use kiln_testkit::common::{read_i64, rel_err, repo_root};

fn fixtures() -> PathBuf {
    repo_root().join("tests/fixtures/sft_lora")
}

fn json() -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(fixtures().join("sft_lora.json")).unwrap()).unwrap()
}

fn host<B: burn::tensor::backend::Backend, const D: usize>(t: Tensor<B, D>) -> Vec<f32> {
    t.into_data().convert::<f32>().into_vec::<f32>().unwrap()
}

/// The fixture's `param.*` tensors (the adapter's values in peft) under kiln's paths.
fn adapter_values(tensors: &BTreeMap<String, HostTensor>) -> BTreeMap<String, HostTensor> {
    tensors
        .iter()
        .filter_map(|(k, t)| {
            let p = internal_key(k.strip_prefix("param.")?)?;
            Some((p, t.clone()))
        })
        .collect()
}

/// Every gradient kiln computed equals peft's, and there is one exactly for each parameter peft
/// trains (frozen parameters get none).
fn gradients_match(
    what: &str,
    m: &impl burn::module::AutodiffModule<CpuTrain>,
    loss: Tensor<CpuTrain, 1>,
    tensors: &BTreeMap<String, HostTensor>,
) {
    let grads = loss.backward();
    let mut acc = GradAccumulator::<Cpu>::default();
    acc.accumulate::<CpuTrain, _>(m, &grads);
    let want: BTreeMap<String, &HostTensor> = tensors
        .iter()
        .filter_map(|(k, t)| Some((internal_key(k.strip_prefix("grad.")?)?, t)))
        .collect();
    assert_eq!(
        acc.grads.keys().collect::<BTreeSet<_>>(),
        want.keys().collect::<BTreeSet<_>>(),
        "{what}: the parameters with a gradient are the adapter's"
    );
    let total = acc.global_norm();
    for (name, g) in &acc.grads {
        let r = &want[name].data;
        let scale = r.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
        let g = host(g.clone());
        if scale == 0.0 {
            // lora_A under PEFT's default initialisation: B = 0 makes its gradient exactly 0.
            assert!(g.iter().all(|v| *v == 0.0), "{what}: {name} should be 0");
            continue;
        }
        let err = rel_err(&g, r);
        assert!(
            err < 1e-4 || err * scale < 1e-6 * total,
            "{what}: {name}: grad rel err {err:e}"
        );
    }
}

fn llama_config(name: &str) -> LoraConfig {
    let all = name == "all_linear_rslora";
    LoraConfig {
        r: 4,
        alpha: 8.0,
        dropout: 0.0,
        target_modules: if all {
            TargetModules::AllLinear
        } else {
            TargetModules::parse("q_proj,v_proj")
        },
        use_rslora: all,
        modules_to_save: vec![],
    }
}

#[test]
fn llama_adapters_match_peft() {
    let device = Default::default();
    let dir = fixtures().join("tiny_llama");
    let meta = json();
    for name in ["qv", "all_linear_rslora"] {
        let path = fixtures().join(format!("lora_llama_{name}.safetensors"));
        let tensors = read_safetensors(&path).unwrap();
        let (m, _) = load_causal_lm::<Llama, CpuTrain>(&dir, &device).unwrap();
        let (m, adapter) = lora::attach(m, &llama_config(name), 0).unwrap();
        // The adapted layers are the ones peft adapted.
        let peft_targets: BTreeSet<String> = meta["llama"][name]["trainable_parameters"]
            .as_object()
            .unwrap()
            .keys()
            .filter_map(|k| internal_key(k))
            .collect();
        let shapes = kiln::models::params::module_shapes(&m);
        let ours: BTreeSet<String> = shapes.keys().filter(|p| adapter.owns(p)).cloned().collect();
        assert_eq!(ours, peft_targets, "{name}: adapted layers");
        let (m, report) = load_into(m, adapter_values(&tensors), None, &device).unwrap();
        assert!(report.unexpected.is_empty(), "{:?}", report.unexpected);

        let (shape, ids) = read_i64(&path, "input_ids");
        let (_, mask) = read_i64(&path, "attention_mask");
        let (_, labels) = read_i64(&path, "labels");
        let (b, t) = (shape[0], shape[1]);
        let batch = TokenBatch {
            ids,
            batch: b,
            seq: t,
            segments: Vec::new(),
            chunked_loss: None,
            scoring: None,
            carried: Default::default(),
            attended_tokens: None,
        };
        let logits = m.logits(&batch);
        let got = host(logits.clone());
        let want = &tensors["logits"].data;
        let v = want.len() / (b * t);
        // Right padding: a causal model's logits at real tokens do not see the pads after them.
        let real = |x: &[f32]| -> Vec<f32> {
            x.chunks(v)
                .zip(&mask)
                .filter(|(_, m)| **m == 1)
                .flat_map(|(row, _)| row.to_vec())
                .collect()
        };
        let err = rel_err(&real(&got), &real(want));
        assert!(err < 1e-4, "{name}: logits rel err {err:e}");
        if name == "qv" {
            // B = 0 at PEFT's initialisation: the adapted model is the base model.
            let base = rel_err(&real(&got), &real(&tensors["base_logits"].data));
            assert!(base < 1e-4, "{name}: base logits rel err {base:e}");
        }
        let targets: Vec<i64> = labels
            .chunks(t)
            .flat_map(|row| {
                row[1..]
                    .iter()
                    .copied()
                    .chain([kiln::contract::IGNORE_INDEX])
            })
            .collect();
        let n = targets.len();
        let targets = Tensor::<CpuTrain, 1, Int>::from_data(TensorData::new(targets, [n]), &device);
        let loss = CrossEntropy.loss(logits, targets);
        let (l, want) = (host(loss.clone())[0], tensors["loss"].data[0]);
        assert!(
            (l - want).abs() < 1e-5 * want.abs(),
            "{name}: loss {l} vs {want}"
        );
        gradients_match(name, &m, loss, &tensors);
    }
}

#[test]
fn bert_classifier_adapter_matches_peft() {
    let device = Default::default();
    let path = fixtures().join("lora_bert_seq_cls.safetensors");
    let tensors = read_safetensors(&path).unwrap();
    let dir = fixtures().join("tiny_bert");
    // The fixture ran in eval mode: dropout off.
    let mut config = EncoderConfig::from_file(&dir.join("config.json")).unwrap();
    if let EncoderConfig::Bert(c) = &mut config {
        c.hidden_dropout_prob = 0.0;
        c.attention_probs_dropout_prob = 0.0;
        c.classifier_dropout = Some(0.0);
    }
    let m = SequenceClassifier::<CpuTrain>::new(&config, 3, &device);
    let weights = read_safetensors(&dir.join("model.safetensors")).unwrap();
    let (m, report) = load_into(m, weights, None, &device).unwrap();
    assert!(report.missing.is_empty() && report.unexpected.is_empty());
    let lora_config = LoraConfig {
        r: 4,
        alpha: 8.0,
        dropout: 0.0,
        target_modules: TargetModules::parse("query,value"),
        use_rslora: false,
        modules_to_save: vec![],
    };
    let (m, adapter) = lora::attach(m, &lora_config, 0).unwrap();
    assert_eq!(adapter.task_type, "SEQ_CLS");
    let (m, report) = load_into(m, adapter_values(&tensors), None, &device).unwrap();
    assert!(report.unexpected.is_empty(), "{:?}", report.unexpected);
    let (shape, ids) = read_i64(&path, "input_ids");
    let (_, mask) = read_i64(&path, "attention_mask");
    let (_, labels) = read_i64(&path, "labels");
    let batch = TextBatch {
        batch: shape[0],
        seq: shape[1],
        token_type_ids: vec![0; ids.len()],
        input_ids: ids,
        attention_mask: mask,
    };
    let logits = m.logits(&batch);
    let err = rel_err(&host(logits.clone()), &tensors["logits"].data);
    assert!(err < 1e-4, "bert: logits rel err {err:e}");
    let n = labels.len();
    let labels = Tensor::<CpuTrain, 1, Int>::from_data(TensorData::new(labels, [n]), &device);
    let loss = CrossEntropy.loss(logits, labels);
    let (l, want) = (host(loss.clone())[0], tensors["loss"].data[0]);
    assert!(
        (l - want).abs() < 1e-5 * want.abs(),
        "bert: loss {l} vs {want}"
    );
    gradients_match("bert", &m, loss, &tensors);
}

/// What kiln writes for an adapter is what peft wrote for the same one: tensor names and shapes,
/// and a config peft reads (its keys are a subset of peft's, with peft's values for them).
#[test]
fn saved_adapter_has_peft_names_and_config() {
    let device = Default::default();
    let meta = json();
    for (name, folder) in [
        ("qv", "llama_adapter_qv"),
        ("all_linear_rslora", "llama_adapter_all_linear_rslora"),
    ] {
        let (m, _) =
            load_causal_lm::<Llama, CpuTrain>(&fixtures().join("tiny_llama"), &device).unwrap();
        let (m, adapter) = lora::attach(m, &llama_config(name), 0).unwrap();
        let ours = adapter.peft_tensors(&module_tensors(&m));
        let peft = read_safetensors(&fixtures().join(folder).join(lora::ADAPTER_WEIGHTS)).unwrap();
        let shapes = |t: &BTreeMap<String, HostTensor>| -> BTreeMap<String, Vec<usize>> {
            t.iter()
                .map(|(k, v)| (k.clone(), v.shape.clone()))
                .collect()
        };
        assert_eq!(shapes(&ours), shapes(&peft), "{name}: saved tensors");
        let config: serde_json::Value =
            serde_json::from_str(&adapter.config_json("tiny_llama")).unwrap();
        let theirs = &meta["llama"][name]["adapter_config"];
        for (key, value) in config.as_object().unwrap() {
            assert!(theirs.get(key).is_some(), "{name}: peft has no key {key}");
            // The fixture drew its all-linear B at random (init_lora_weights=False) so that A's
            // gradients are not zero; kiln initialises as PEFT's default does.
            let how_drawn = key == "init_lora_weights" && name != "qv";
            if how_drawn || ["base_model_name_or_path", "target_modules"].contains(&key.as_str()) {
                continue;
            }
            assert_eq!(value, &theirs[key], "{name}: {key}");
        }
        // all-linear: peft writes full paths, kiln the layer names; both name the same layers.
        let theirs: BTreeSet<String> = theirs["target_modules"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_str().unwrap().rsplit('.').next().unwrap().to_string())
            .collect();
        let ours: BTreeSet<String> = config["target_modules"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_str().unwrap().to_string())
            .collect();
        assert_eq!(ours, theirs, "{name}: target_modules");
    }
}

/// `kiln merge`'s arithmetic on peft's own adapter equals `merge_and_unload()`.
#[test]
fn merging_equals_peft_merge_and_unload() {
    let dir = fixtures().join("llama_adapter_all_linear_rslora");
    let config = LoraConfig::from_adapter_dir(&dir).unwrap();
    assert!(config.use_rslora);
    let adapter = lora::read_adapter_tensors(&dir).unwrap();
    let mut base = read_safetensors(&fixtures().join("tiny_llama/model.safetensors")).unwrap();
    let merged = lora::merge(&mut base, &adapter, &config).unwrap();
    assert_eq!(merged, 14, "7 layers × 2 blocks");
    let want =
        read_safetensors(&fixtures().join("llama_merged_all_linear_rslora.safetensors")).unwrap();
    for (name, w) in &want {
        let err = rel_err(&base[name].data, &w.data);
        assert!(err < 1e-6, "{name}: merged rel err {err:e}");
    }
}

/// TRL's SFT loss (completion-only, mean over the batch's target tokens) on two fixed batches of
/// the tiny Llama equals kiln's: its labels from the completion masks, its right-padded batch, its
/// shifted targets and cross-entropy.
#[test]
fn sft_loss_equals_trl() {
    use kiln::data::sft::{build_labels, SftExample, SftFormat, SftOptions};
    use kiln::tasks::sft::SftSet;
    let device = Default::default();
    let meta: serde_json::Value =
        serde_json::from_slice(&std::fs::read(fixtures().join("sft_loss.json")).unwrap()).unwrap();
    let (m, _) = load_causal_lm::<Llama, Cpu>(&fixtures().join("tiny_llama"), &device).unwrap();
    let options = SftOptions {
        completion_only_loss: Some(true),
        max_length: None,
        ..SftOptions::default()
    };
    for (i, b) in meta["batches"].as_array().unwrap().iter().enumerate() {
        let ids = |v: &serde_json::Value| -> Vec<u32> {
            v.as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap() as u32)
                .collect()
        };
        let examples: Vec<_> = b["rows"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| {
                let ex = SftExample {
                    format: SftFormat::PromptCompletion,
                    input_ids: ids(&r["input_ids"]),
                    completion_mask: Some(
                        ids(&r["completion_mask"])
                            .iter()
                            .map(|&v| v as u8)
                            .collect(),
                    ),
                    assistant_mask: None,
                };
                build_labels(&ex, &options).unwrap()
            })
            .collect();
        let set = SftSet {
            examples,
            pad_id: 0,
            targets: 0,
            packed: None,
            pad_to_multiple_of: None,
        };
        let all: Vec<usize> = (0..set.examples.len()).collect();
        let (batch, targets) = kiln::contract::BatchSource::batch(&set, &all);
        let counted = targets
            .iter()
            .filter(|&&t| t != kiln::contract::IGNORE_INDEX)
            .count();
        assert_eq!(
            counted as u64,
            b["padded"]["num_target_tokens"].as_u64().unwrap()
        );
        let n = targets.len();
        let targets = Tensor::<Cpu, 1, Int>::from_data(TensorData::new(targets, [n]), &device);
        let loss = host(CrossEntropy.loss(m.logits(&batch), targets))[0];
        // Packed, padding-free: the rows end to end in one sequence (longest first), positions
        // restarting and attention kept inside each row.
        let packed = set.clone().pack(usize::MAX);
        let (batch, targets) = kiln::contract::BatchSource::batch(&packed, &[0]);
        assert_eq!((batch.batch, batch.segments.len()), (1, set.examples.len()));
        let n = targets.len();
        let targets = Tensor::<Cpu, 1, Int>::from_data(TensorData::new(targets, [n]), &device);
        let packed_loss = host(CrossEntropy.loss(m.logits(&batch), targets))[0];
        for (how, got) in [("padded", loss), ("padding_free", packed_loss)] {
            let want = b[how]["loss"].as_f64().unwrap() as f32;
            assert!(
                (got - want).abs() < 1e-5 * want.abs(),
                "batch {i}: kiln's {how} loss {got} vs TRL's {want}"
            );
        }
    }
}
