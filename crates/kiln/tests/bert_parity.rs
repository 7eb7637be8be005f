//! kiln's BERT against transformers: tokenization, logits, one step's gradients and one AdamW step,
//! on all-MiniLM-L6-v2 and real tweets. The reference values come from
//! tests/fixtures/gen_bert_parity.py (PyTorch); this test needs no Python.

use std::collections::BTreeMap;

use burn::tensor::{Int, Tensor, TensorData};
use kiln::backend::{Cpu, CpuDevice, CpuTrain};
use kiln::data::TextTokenizer;
use kiln::formats::safetensors::{read_safetensors, HostTensor};
use kiln::models::bert::config::BertConfig;
use kiln::models::bert::{BertForSequenceClassification, BertInput, Unpadded};
use kiln::models::encoder::EncoderClassifier;
use kiln::models::params::{load_into, module_tensors};
use kiln::train::optim::{AdamW, AdamWConfig, GradAccumulator};
use kiln::train::{CrossEntropy, Loss};
use kiln_testkit::common::{asset, read_i64, rel_err, repo_root};

struct Fixture {
    tensors: BTreeMap<String, HostTensor>,
    json: serde_json::Value,
    path: std::path::PathBuf,
}

fn fixture() -> Fixture {
    let path = repo_root().join("tests/fixtures/bert_parity.safetensors");
    let json =
        std::fs::read_to_string(repo_root().join("tests/fixtures/bert_parity.json")).unwrap();
    Fixture {
        tensors: read_safetensors(&path).unwrap(),
        json: serde_json::from_str(&json).unwrap(),
        path,
    }
}

/// MiniLM with dropout off and the fixture's classifier head.
fn model<B: kiln::ops::KilnBackend>(
    fx: &Fixture,
    dir: &std::path::Path,
) -> BertForSequenceClassification<B> {
    let device = Default::default();
    let mut cfg = BertConfig::from_file(&dir.join("config.json")).unwrap();
    cfg.hidden_dropout_prob = 0.0;
    cfg.attention_probs_dropout_prob = 0.0;
    let m = BertForSequenceClassification::<B>::new(&cfg, 3, &device);
    let base = read_safetensors(&dir.join("model.safetensors")).unwrap();
    let (m, report) = load_into(m, base, Some("bert"), &device).unwrap();
    assert_eq!(report.missing, vec!["classifier.weight", "classifier.bias"]);
    let head: BTreeMap<String, HostTensor> = fx
        .tensors
        .iter()
        .filter_map(|(k, v)| Some((k.strip_prefix("init.")?.to_string(), v.clone())))
        .collect();
    let (m, report) = load_into(m, head, None, &device).unwrap();
    assert_eq!(report.loaded, vec!["classifier.weight", "classifier.bias"]);
    m
}

fn input<B: burn::tensor::backend::Backend>(fx: &Fixture) -> BertInput<B> {
    let device = Default::default();
    let t = |name: &str| {
        let (shape, v) = read_i64(&fx.path, name);
        Tensor::<B, 2, Int>::from_data(TensorData::new(v, [shape[0], shape[1]]), &device)
    };
    let (shape, mask) = read_i64(&fx.path, "attention_mask");
    BertInput {
        input_ids: t("input_ids"),
        attention_mask: t("attention_mask"),
        token_type_ids: t("token_type_ids"),
        position_ids: None,
        // Right-padded fixtures run packed, as `kiln train` does: parity covers that path.
        unpadded: Some(
            Unpadded::from_mask(&mask, shape[0], shape[1], &device)
                .expect("the fixture's sentences differ in length"),
        ),
    }
}

fn labels<B: burn::tensor::backend::Backend>(fx: &Fixture) -> Tensor<B, 1, Int> {
    let (_, v) = read_i64(&fx.path, "labels");
    let n = v.len();
    Tensor::from_data(TensorData::new(v, [n]), &Default::default())
}

fn host<B: burn::tensor::backend::Backend, const D: usize>(t: Tensor<B, D>) -> Vec<f32> {
    t.into_data().convert::<f32>().into_vec::<f32>().unwrap()
}

#[test]
fn tokenizer_matches_transformers() {
    let Some(dir) = asset("minilm") else { return };
    let fx = fixture();
    let tok = TextTokenizer::from_file(&dir.join("tokenizer.json"), 128).unwrap();
    let sentences: Vec<(String, Option<String>)> = fx.json["sentences"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| (s.as_str().unwrap().to_string(), None))
        .collect();
    let enc = tok.encode(&sentences).unwrap();
    let refs: Vec<_> = enc.iter().collect();
    let batch = kiln::data::batch::collate(&refs, kiln::data::Padding::Longest, tok.pad_id);
    let (shape, ids) = read_i64(&fx.path, "input_ids");
    let (_, mask) = read_i64(&fx.path, "attention_mask");
    assert_eq!([batch.batch, batch.seq], [shape[0], shape[1]]);
    assert_eq!(batch.input_ids, ids);
    assert_eq!(batch.attention_mask, mask);
}

#[test]
fn logits_match_transformers() {
    let Some(dir) = asset("minilm") else { return };
    let fx = fixture();
    let m = model::<Cpu>(&fx, &dir);
    let logits = host(m.forward(&input::<Cpu>(&fx)));
    let err = rel_err(&logits, &fx.tensors["logits"].data);
    assert!(
        err < 1e-4,
        "logits rel err {err:e}\nkiln  {logits:?}\ntorch {:?}",
        fx.tensors["logits"].data
    );
}

#[test]
fn loss_and_gradients_match_pytorch() {
    let Some(dir) = asset("minilm") else { return };
    let fx = fixture();
    let m = model::<CpuTrain>(&fx, &dir);
    let logits = m.forward(&input::<CpuTrain>(&fx));
    let loss = CrossEntropy.loss(logits, labels::<CpuTrain>(&fx));
    let loss_v = host(loss.clone())[0];
    let ref_loss = fx.tensors["loss"].data[0];
    assert!(
        (loss_v - ref_loss).abs() / ref_loss < 1e-5,
        "loss {loss_v} vs {ref_loss}"
    );

    let grads = loss.backward();
    let mut acc = GradAccumulator::<Cpu>::default();
    acc.accumulate::<CpuTrain, _>(&m, &grads);

    // Every parameter's gradient norm, and the full gradient where the fixture has it.
    let norms = fx.json["grad_norms"].as_object().unwrap();
    // The key bias has an exactly-zero true gradient (softmax ignores a per-row shift): both sides
    // are round-off there, so differences are also bounded absolutely, relative to the total norm.
    let floor = 1e-6 * fx.json["total_grad_norm"].as_f64().unwrap();
    assert_eq!(
        acc.grads.len(),
        norms.len(),
        "every parameter gets a gradient"
    );
    let mut checked = 0;
    for (name, g) in &acc.grads {
        let g = host(g.clone());
        let norm = g.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
        let want = norms[name].as_f64().unwrap();
        assert!(
            (norm - want).abs() <= 1e-3 * want + floor,
            "{name}: grad norm {norm} vs {want}"
        );
        if let Some(r) = fx.tensors.get(&format!("grad.{name}")) {
            let err = rel_err(&g, &r.data);
            let scale = r
                .data
                .iter()
                .map(|x| (*x as f64).powi(2))
                .sum::<f64>()
                .sqrt();
            assert!(
                err < 1e-3 || err * scale < floor,
                "{name}: grad rel err {err:e}"
            );
            checked += 1;
        }
    }
    assert!(checked >= 40, "only {checked} full gradients compared");

    let total = acc.global_norm();
    let want_total = fx.json["total_grad_norm"].as_f64().unwrap();
    assert!(
        (total - want_total).abs() < 1e-3 * want_total,
        "total norm {total} vs {want_total}"
    );
}

/// kiln's AdamW + global-norm clipping fed PyTorch's own gradients gives PyTorch's updated weights.
#[test]
fn adamw_step_with_clipping_matches_torch_optim() {
    let Some(dir) = asset("minilm") else { return };
    let fx = fixture();
    let m = model::<CpuTrain>(&fx, &dir);
    let device = CpuDevice::default();
    let mut acc = GradAccumulator::<Cpu>::default();
    for (k, g) in &fx.tensors {
        if let Some(name) = k.strip_prefix("grad.") {
            let n = g.data.len();
            acc.grads.insert(
                name.to_string(),
                Tensor::from_data(TensorData::new(g.data.clone(), [n]), &device),
            );
        }
    }
    // clip_grad_norm_ scales by max_norm / (total + 1e-6), with the total over *all* parameters.
    let total = fx.json["total_grad_norm"].as_f64().unwrap();
    let max_norm = fx.json["max_grad_norm"].as_f64().unwrap();
    acc.scale(max_norm / (total + 1e-6));
    let mut opt = AdamW::<Cpu>::new(AdamWConfig {
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: fx.json["weight_decay"].as_f64().unwrap(),
    });
    let m = opt.step::<CpuTrain, _>(m, fx.json["lr"].as_f64().unwrap(), acc);
    let after = module_tensors(&m);
    let mut stepped = 0;
    for (k, r) in &fx.tensors {
        if let Some(name) = k.strip_prefix("step1.") {
            let err = rel_err(&after[name].data, &r.data);
            assert!(err < 1e-6, "{name}: after one step rel err {err:e}");
            stepped += 1;
        }
    }
    assert!(stepped >= 40, "only {stepped} parameters compared");
}

/// Loss and per-parameter gradients of one forward/backward on `input`.
fn loss_and_grads(
    m: &BertForSequenceClassification<CpuTrain>,
    input: &BertInput<CpuTrain>,
    fx: &Fixture,
) -> (f32, BTreeMap<String, Vec<f32>>) {
    let loss = CrossEntropy.loss(m.forward(input), labels::<CpuTrain>(fx));
    let l = host(loss.clone())[0];
    let grads = loss.backward();
    let mut acc = GradAccumulator::<Cpu>::default();
    acc.accumulate::<CpuTrain, _>(m, &grads);
    let g = acc
        .grads
        .iter()
        .map(|(k, v)| (k.clone(), host(v.clone())))
        .collect();
    (l, g)
}

#[test]
fn packed_tokens_give_the_padded_layouts_results() {
    let Some(dir) = asset("minilm") else { return };
    let fx = fixture();
    let m = model::<CpuTrain>(&fx, &dir);
    let packed = input::<CpuTrain>(&fx);
    let padded = BertInput {
        unpadded: None,
        ..packed.clone()
    };
    let (lp, gp) = loss_and_grads(&m, &packed, &fx);
    let (lq, gq) = loss_and_grads(&m, &padded, &fx);
    assert!((lp - lq).abs() < 1e-6 * lq.abs(), "loss {lp} vs {lq}");
    for (name, g) in &gp {
        let err = rel_err(g, &gq[name]);
        // The key bias's true gradient is zero (round-off on both sides).
        assert!(
            err < 1e-4 || name.ends_with("key.bias"),
            "{name}: rel err {err:e}"
        );
    }
}

#[test]
fn bf16_matmuls_stay_close_to_pytorch_fp32() {
    use kiln::ops::{MatmulPrecision, MatmulPrecisionScope};
    let Some(dir) = asset("minilm") else { return };
    let fx = fixture();
    let m = model::<CpuTrain>(&fx, &dir);
    // Thread-local, so other tests in this binary keep f32.
    let bf16 = MatmulPrecisionScope::set(MatmulPrecision::Bf16);
    let logits = host(m.forward(&input::<CpuTrain>(&fx)));
    let (loss, grads) = loss_and_grads(&m, &input::<CpuTrain>(&fx), &fx);
    drop(bf16);
    // bf16 keeps 8 bits of mantissa: about 3e-3 relative per rounding, partly averaging out.
    let err = rel_err(&logits, &fx.tensors["logits"].data);
    assert!(err < 2e-2, "bf16 logits rel err {err:e}");
    assert!(
        err > 1e-5,
        "bf16 logits equal fp32 ({err:e}): no rounding happened"
    );
    let ref_loss = fx.tensors["loss"].data[0];
    assert!(
        (loss - ref_loss).abs() / ref_loss < 1e-2,
        "loss {loss} vs {ref_loss}"
    );
    let total: f64 = grads
        .values()
        .flatten()
        .map(|x| f64::from(*x).powi(2))
        .sum::<f64>()
        .sqrt();
    let want = fx.json["total_grad_norm"].as_f64().unwrap();
    assert!(
        (total - want).abs() < 3e-2 * want,
        "grad norm {total} vs {want}"
    );
    for (name, g) in &grads {
        if let Some(r) = fx.tensors.get(&format!("grad.{name}")) {
            let err = rel_err(g, &r.data);
            assert!(err < 0.1 || name.ends_with("key.bias"), "{name}: {err:e}");
        }
    }
}
