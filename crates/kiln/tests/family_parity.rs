//! Every model family beside BERT and Llama against transformers: the encoders kiln classifies with
//! (RoBERTa, XLM-RoBERTa, DistilBERT, ModernBERT) and the causal LMs (Mistral, Qwen2). Tokenization,
//! logits and one step's gradients of small random-initialised models that transformers itself
//! built and saved (tests/fixtures/gen_family_parity.py; no Python here).

use std::collections::BTreeMap;
use std::path::PathBuf;

use burn::tensor::{Int, Tensor, TensorData};
use kiln::backend::{Cpu, CpuTrain};
use kiln::contract::Model;
use kiln::data::batch::{collate, TextBatch};
use kiln::data::lm::TokenBatch;
use kiln::data::{Padding, TextTokenizer};
use kiln::formats::safetensors::{read_safetensors, HostTensor};
use kiln::models::auto::load_causal_lm;
use kiln::models::auto::EncoderConfig;
use kiln::models::classifier::SequenceClassifier;
use kiln::models::llama::KvCache;
use kiln::models::llama::Llama;
use kiln::models::params::load_into;
use kiln::tasks::text_classification::{load_classifier, ModelDir};
use kiln::train::optim::GradAccumulator;
use kiln::train::{CrossEntropy, Loss};
use kiln_testkit::common::{read_i64, rel_err, repo_root};

const CLASSIFIERS: [&str; 4] = ["roberta", "xlm-roberta", "distilbert", "modernbert"];

struct Fixture {
    dir: PathBuf,
    path: PathBuf,
    tensors: BTreeMap<String, HostTensor>,
    json: serde_json::Value,
}

fn fixture(family: &str) -> Fixture {
    let root = repo_root().join("tests/fixtures/families");
    let path = root.join(format!("{family}.parity.safetensors"));
    let json = std::fs::read_to_string(root.join(format!("{family}.parity.json"))).unwrap();
    Fixture {
        dir: root.join(family),
        tensors: read_safetensors(&path).unwrap(),
        json: serde_json::from_str(&json).unwrap(),
        path,
    }
}

/// The fixture's batch as the collator makes it.
fn batch(fx: &Fixture) -> TextBatch {
    let (shape, input_ids) = read_i64(&fx.path, "input_ids");
    let (_, attention_mask) = read_i64(&fx.path, "attention_mask");
    TextBatch {
        batch: shape[0],
        seq: shape[1],
        token_type_ids: vec![0; input_ids.len()],
        input_ids,
        attention_mask,
    }
}

fn labels(fx: &Fixture) -> Tensor<CpuTrain, 1, Int> {
    let (_, v) = read_i64(&fx.path, "labels");
    let n = v.len();
    Tensor::from_data(TensorData::new(v, [n]), &Default::default())
}

fn host<B: burn::tensor::backend::Backend, const D: usize>(t: Tensor<B, D>) -> Vec<f32> {
    t.into_data().convert::<f32>().into_vec::<f32>().unwrap()
}

/// The config with every dropout off: the fixture's gradients were taken in eval mode.
fn without_dropout(mut c: EncoderConfig) -> EncoderConfig {
    match &mut c {
        EncoderConfig::Bert(c) => {
            c.hidden_dropout_prob = 0.0;
            c.attention_probs_dropout_prob = 0.0;
            c.classifier_dropout = Some(0.0);
        }
        EncoderConfig::DistilBert(c) => {
            c.dropout = 0.0;
            c.attention_dropout = 0.0;
            c.seq_classif_dropout = 0.0;
        }
        EncoderConfig::ModernBert(c) => {
            c.embedding_dropout = 0.0;
            c.attention_dropout = 0.0;
            c.mlp_dropout = 0.0;
            c.classifier_dropout = 0.0;
        }
    }
    c
}

/// `loss` equals the fixture's, and its backward gives every parameter of `m` the fixture's
/// gradient (rel. err < 1e-3).
fn loss_and_gradients_match<M: burn::module::AutodiffModule<CpuTrain>>(
    family: &str,
    fx: &Fixture,
    m: &M,
    loss: Tensor<CpuTrain, 1>,
) {
    let (l, want) = (host(loss.clone())[0], fx.tensors["loss"].data[0]);
    assert!(
        (l - want).abs() < 1e-5 * want.abs(),
        "{family}: loss {l} vs {want}"
    );
    let grads = loss.backward();
    let mut acc = GradAccumulator::<Cpu>::default();
    acc.accumulate::<CpuTrain, _>(m, &grads);
    let total = acc.global_norm();
    let reference = fx.tensors.keys().filter(|k| k.starts_with("grad.")).count();
    assert_eq!(acc.grads.len(), reference, "{family}: every parameter");
    for (name, g) in &acc.grads {
        let g = host(g.clone());
        let r = &fx.tensors[&format!("grad.{name}")].data;
        let err = rel_err(&g, r);
        let scale = r.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
        // A gradient that is zero in exact arithmetic (the key bias: softmax ignores a shift per
        // row) is round-off on both sides: bounded by the total norm instead.
        assert!(
            err < 1e-3 || err * scale < 1e-6 * total,
            "{family}: {name}: grad rel err {err:e} (norm {scale:e}, total {total:e})"
        );
    }
}

#[test]
fn tokenizers_match_transformers() {
    for family in CLASSIFIERS {
        let fx = fixture(family);
        let tok = TextTokenizer::from_file(&fx.dir.join("tokenizer.json"), 32).unwrap();
        let texts: Vec<(String, Option<String>)> = fx.json["texts"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| (s.as_str().unwrap().to_string(), None))
            .collect();
        let enc = tok.encode(&texts).unwrap();
        let refs: Vec<_> = enc.iter().collect();
        let b = collate(&refs, Padding::Longest, tok.pad_id);
        let want = batch(&fx);
        assert_eq!(b.input_ids, want.input_ids, "{family}: input_ids");
        assert_eq!(b.attention_mask, want.attention_mask, "{family}: mask");
    }
}

/// `load_classifier` (what `kiln eval` and `kiln predict` run) picks the family from config.json,
/// loads every weight by its Hugging Face name and gives transformers' logits.
#[test]
fn logits_match_transformers() {
    for family in CLASSIFIERS {
        let fx = fixture(family);
        let md = ModelDir::new(&fx.dir).unwrap();
        let (m, config, labels) =
            load_classifier::<Cpu>(&md, None, 0, &Default::default()).unwrap();
        assert_eq!(config.model_type(), fx.json["model_type"].as_str().unwrap());
        assert_eq!(labels.names(), ["negative", "neutral", "positive"]);
        let logits = host(m.logits(&batch(&fx)));
        let err = rel_err(&logits, &fx.tensors["logits"].data);
        assert!(
            err < 1e-4,
            "{family}: logits rel err {err:e}\nkiln  {logits:?}\ntorch {:?}",
            fx.tensors["logits"].data
        );
    }
}

#[test]
fn loss_and_every_gradient_match_pytorch() {
    for family in CLASSIFIERS {
        let fx = fixture(family);
        let config =
            without_dropout(EncoderConfig::from_file(&fx.dir.join("config.json")).unwrap());
        let device = Default::default();
        let m = SequenceClassifier::<CpuTrain>::new(&config, 3, &device);
        let weights = read_safetensors(&fx.dir.join("model.safetensors")).unwrap();
        let (m, report) = load_into(m, weights, None, &device).unwrap();
        assert!(
            report.missing.is_empty() && report.unexpected.is_empty(),
            "{family}: {report:?}"
        );
        let loss = CrossEntropy.loss(m.logits(&batch(&fx)), labels(&fx));
        loss_and_gradients_match(family, &fx, &m, loss);
    }
}

const CAUSAL_LMS: [&str; 2] = ["mistral", "qwen2"];

/// The fixture's blocks and their targets as `kiln train --task causal-lm` makes them: each
/// token's target is the next one, the last position left out (transformers' label shift).
fn lm_batch(fx: &Fixture) -> (TokenBatch, Vec<i64>) {
    let (shape, ids) = read_i64(&fx.path, "input_ids");
    let targets = ids
        .chunks(shape[1])
        .flat_map(|row| {
            row[1..]
                .iter()
                .copied()
                .chain([kiln::contract::IGNORE_INDEX])
        })
        .collect();
    let b = TokenBatch {
        ids,
        batch: shape[0],
        seq: shape[1],
        segments: Vec::new(),
        chunked_loss: None,
        scoring: None,
        carried: Default::default(),
        attended_tokens: None,
    };
    (b, targets)
}

/// Mistral (a sliding window shorter than the blocks) and Qwen2 (q/k/v biases, tied head), loaded
/// by `load_model` as `kiln train --task causal-lm` does: logits, loss and every gradient.
#[test]
fn causal_lms_match_transformers() {
    for family in CAUSAL_LMS {
        let fx = fixture(family);
        let (b, targets) = lm_batch(&fx);
        let device = Default::default();

        let (m, config) = load_causal_lm::<Llama, Cpu>(&fx.dir, &device).unwrap();
        assert_eq!(config.model_type.as_deref(), Some(family));
        let logits = host(m.logits(&b));
        let err = rel_err(&logits, &fx.tensors["logits"].data);
        assert!(err < 1e-4, "{family}: logits rel err {err:e}");

        // Generation's cached path (one token at a time) sees the same window.
        let mut cache = KvCache::new(m.num_layers());
        let row: Vec<i64> = b.ids[..b.seq].to_vec();
        let mut last = Vec::new();
        for &id in &row {
            let ids = Tensor::<Cpu, 2, Int>::from_data(TensorData::new(vec![id], [1, 1]), &device);
            last = host(m.forward(ids, Some(&mut cache)));
        }
        let v = last.len();
        let want = &fx.tensors["logits"].data[(b.seq - 1) * v..b.seq * v];
        let err = rel_err(&last, want);
        assert!(err < 1e-4, "{family}: cached decoding rel err {err:e}");

        let (m, _) = load_causal_lm::<Llama, CpuTrain>(&fx.dir, &device).unwrap();
        let n = targets.len();
        let t = Tensor::<CpuTrain, 1, Int>::from_data(TensorData::new(targets, [n]), &device);
        let loss = CrossEntropy.loss(m.logits(&b), t);
        loss_and_gradients_match(family, &fx, &m, loss);
    }
}
