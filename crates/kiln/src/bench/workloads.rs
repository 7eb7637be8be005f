//! The benchmark rows kiln runs, built like ../shared/reference/bench_hf.py (and
//! scripts/bench_reference.py for the rows it lacks) so the two sides do the same work.

use std::path::Path;
use std::time::Instant;

use super::device::DeviceSampler;

use burn::module::AutodiffModule;
use burn::tensor::{ElementConversion, Int, Tensor, TensorData};
use rand::{rngs::StdRng, Rng, SeedableRng};

use super::BenchResult;
use crate::contract::{CrossEntropy, Loss, Model};
use crate::data::batch::{collate, TextBatch};
use crate::data::{self, Columns, DataArgs, Padding, TextEncoding, TextTokenizer};
use crate::models::auto::EncoderConfig;
use crate::models::bert::config::BertConfig;
use crate::models::bert::BertForSequenceClassification;
use crate::models::classifier::SequenceClassifier;
use crate::models::mlp::{self, MnistMlp, PixelBatch};
use crate::ops::{KilnBackend, TrainBackend};
use crate::train::optim::{AdamWConfig, GradAccumulator, Optimizer, OptimizerType};

/// Work and size of one step's batch, for the throughput columns.
#[derive(Debug, Clone, Copy)]
pub struct StepWork {
    pub samples: usize,
    /// Sequence length as padded (0 for models without tokens).
    pub padded_seq: usize,
    /// Real (unpadded) tokens; 0 for models without tokens.
    pub tokens: usize,
    /// Model FLOPs of the step as executed (padding included).
    pub flops: f64,
}

/// Forward FLOPs of BERT over sequences of these (real, unpadded) lengths: 2 per weight per token
/// (embeddings excluded) plus QKᵀ and PV. Padding is not counted: it is not useful work (and kiln
/// skips it outside attention).
pub fn bert_forward_flops(c: &BertConfig, lengths: impl IntoIterator<Item = usize>) -> f64 {
    let (h, i, l) = (
        c.hidden_size as f64,
        c.intermediate_size as f64,
        c.num_hidden_layers as f64,
    );
    let per_layer = 4.0 * h * h + 2.0 * h * i;
    lengths
        .into_iter()
        .map(|t| {
            let t = t as f64;
            2.0 * l * per_layer * t + 4.0 * l * h * t * t
        })
        .sum()
}

/// Forward FLOPs of the MNIST MLP for `batch` images.
pub fn mlp_forward_flops(batch: usize) -> f64 {
    2.0 * (mlp::INPUT * 120 + 120 * 84 + 84 * mlp::CLASSES) as f64 * batch as f64
}

/// One random batch like bench_hf.py's: ids in [1000, 30000), full mask, labels in [0, 6).
pub fn random_text_batch(batch: usize, seq: usize, seed: u64) -> (TextBatch, Vec<i64>) {
    let mut rng = StdRng::seed_from_u64(seed);
    let ids = (0..batch * seq)
        .map(|_| rng.random_range(1000..30000))
        .collect();
    let labels = (0..batch).map(|_| rng.random_range(0..6)).collect();
    (
        TextBatch {
            batch,
            seq,
            input_ids: ids,
            attention_mask: vec![1; batch * seq],
            token_type_ids: vec![0; batch * seq],
        },
        labels,
    )
}

/// Per-step work of a BERT training step on `b`.
pub fn bert_train_work(c: &BertConfig, b: &TextBatch) -> StepWork {
    let lengths: Vec<usize> = b
        .attention_mask
        .chunks(b.seq)
        .map(|row| row.iter().filter(|&&m| m != 0).count())
        .collect();
    StepWork {
        samples: b.batch,
        padded_seq: b.seq,
        tokens: lengths.iter().sum(),
        flops: 3.0 * bert_forward_flops(c, lengths),
    }
}

/// Timed optimizer steps (forward, backward, update) of `model` over `batches` in turn: the first
/// `warmup` steps are not timed. Returns the result with the mean work of the timed steps.
#[allow(clippy::too_many_arguments)]
pub fn train_steps<B, M>(
    name: &str,
    model: M,
    opt: Optimizer<B::InnerBackend>,
    lr: f64,
    batches: &[(M::Batch, Vec<i64>, StepWork)],
    warmup: usize,
    steps: usize,
    device: &B::Device,
) -> BenchResult
where
    B: TrainBackend,
    M: Model<B> + AutodiffModule<B>,
{
    train_steps_with(
        name,
        model,
        opt,
        lr,
        batches,
        warmup,
        steps,
        device,
        &CrossEntropy,
    )
}

/// [`train_steps`] with another `loss` of the model's output (a causal LM's chunked loss).
#[allow(clippy::too_many_arguments)]
pub fn train_steps_with<B, M, L>(
    name: &str,
    mut model: M,
    mut opt: Optimizer<B::InnerBackend>,
    lr: f64,
    batches: &[(M::Batch, Vec<i64>, StepWork)],
    warmup: usize,
    steps: usize,
    device: &B::Device,
    loss_fn: &L,
) -> BenchResult
where
    B: TrainBackend,
    M: Model<B> + AutodiffModule<B>,
    L: Loss,
{
    let (mut times, mut losses, mut work) = (Vec::new(), Vec::new(), Vec::new());
    let mut gpu = DeviceSampler::<B::InnerBackend>::new(device);
    for i in 0..warmup + steps {
        if i == warmup {
            super::timed_steps_begin();
            gpu.start();
        }
        let (batch, labels, w) = &batches[i % batches.len()];
        let targets =
            Tensor::<B, 1, Int>::from_data(TensorData::new(labels.clone(), [labels.len()]), device);
        let t0 = Instant::now();
        let loss = {
            let _p = crate::ops::profile::scope("step: forward (all)");
            loss_fn.loss(model.logits(batch), targets)
        };
        let grads = {
            let _p = crate::ops::profile::scope("step: backward (all)");
            loss.backward()
        };
        let _p = crate::ops::profile::scope("step: optimizer (all)");
        let mut acc = GradAccumulator::default();
        acc.accumulate::<B, _>(&model, &grads);
        model = opt.step::<B, _>(model, lr, acc);
        drop(_p);
        let queued = t0.elapsed().as_secs_f64();
        let l = loss.into_scalar().elem::<f64>();
        let dt = t0.elapsed().as_secs_f64();
        losses.push(l);
        if i >= warmup {
            times.push(dt);
            work.push(*w);
            gpu.step_done(queued);
        }
    }
    let mut r = BenchResult::from_times(name, &times, &work);
    gpu.finish(&mut r);
    r.warmup = warmup;
    r.loss_first = losses.first().copied();
    r.loss_last = losses.last().copied();
    r
}

/// torch.optim.AdamW's defaults, without weight decay (as bench_hf.py).
const ADAMW: AdamWConfig = AdamWConfig {
    beta1: 0.9,
    beta2: 0.999,
    eps: 1e-8,
    weight_decay: 0.0,
};

pub(crate) fn adamw<B: KilnBackend>() -> Optimizer<B> {
    Optimizer::new(OptimizerType::AdamwTorch, ADAMW)
}

/// BERT classifier training steps on one fixed random batch (AdamW lr 5e-5, as bench_hf.py).
pub fn bert_train<B: TrainBackend>(
    name: &str,
    model: BertForSequenceClassification<B>,
    config: &BertConfig,
    (batch, seq): (usize, usize),
    warmup: usize,
    steps: usize,
) -> BenchResult {
    let device = model.classifier.weight.device();
    let (input, labels) = random_text_batch(batch, seq, 1234);
    let work = bert_train_work(config, &input);
    let batches = [(input, labels, work)];
    train_steps(name, model, adamw(), 5e-5, &batches, warmup, steps, &device)
}

/// The encoder configs of the family rows: each family's base model as published on the Hub
/// (weights random: a step's time does not depend on their values).
pub fn family_config(key: &str) -> Option<EncoderConfig> {
    let json = match key {
        "roberta_train" => serde_json::json!({
            "model_type": "roberta", "vocab_size": 50265, "hidden_size": 768,
            "num_hidden_layers": 12, "num_attention_heads": 12, "intermediate_size": 3072,
            "max_position_embeddings": 514, "type_vocab_size": 1, "pad_token_id": 1,
            "layer_norm_eps": 1e-5}),
        "distilbert_train" => serde_json::json!({
            "model_type": "distilbert", "vocab_size": 30522, "dim": 768, "n_layers": 6,
            "n_heads": 12, "hidden_dim": 3072, "pad_token_id": 0}),
        "modernbert_train" => serde_json::json!({
            "model_type": "modernbert", "vocab_size": 50368, "hidden_size": 768,
            "intermediate_size": 1152, "num_hidden_layers": 22, "num_attention_heads": 12,
            "global_attn_every_n_layers": 3, "local_attention": 128, "pad_token_id": 50283,
            "max_position_embeddings": 8192}),
        _ => return None,
    };
    let config = if key == "distilbert_train" {
        EncoderConfig::DistilBert(serde_json::from_value(json).expect("a valid config"))
    } else if key == "modernbert_train" {
        EncoderConfig::ModernBert(serde_json::from_value(json).expect("a valid config"))
    } else {
        EncoderConfig::Bert(serde_json::from_value(json).expect("a valid config"))
    };
    Some(config)
}

/// Training steps of one encoder family's classifier (`roberta_train`, `distilbert_train`,
/// `modernbert_train`) on one fixed random batch, as bench_reference.py's family rows. FLOPs:
/// 6 per non-embedding weight per token, plus the attention products (12·layers·hidden·T² per
/// sequence, forward and backward).
pub fn family_train<B: TrainBackend>(
    key: &str,
    (batch, seq): (usize, usize),
    warmup: usize,
    steps: usize,
    device: &B::Device,
) -> crate::Result<BenchResult> {
    let config = family_config(key).expect("a family row");
    let model = crate::ops::with_seeded_rng::<B, _>(device, 0, || {
        SequenceClassifier::<B>::new(&config, 6, device)
    });
    let (input, labels) = random_text_batch(batch, seq, 1234);
    let embeddings = model.embedding_parameters();
    let weights: f64 = crate::models::params::module_shapes(&model)
        .iter()
        .filter(|(name, _)| !embeddings.contains(name))
        .map(|(_, shape)| shape.iter().product::<usize>() as f64)
        .sum();
    let (layers, hidden) = match &config {
        EncoderConfig::Bert(c) => (c.num_hidden_layers, c.hidden_size),
        EncoderConfig::DistilBert(c) => (c.n_layers, c.dim),
        EncoderConfig::ModernBert(c) => (c.num_hidden_layers, c.hidden_size),
    };
    let tokens = (batch * seq) as f64;
    let attention = 12.0 * (layers * hidden) as f64 * (seq * seq) as f64 * batch as f64;
    let work = StepWork {
        samples: batch,
        padded_seq: seq,
        tokens: batch * seq,
        flops: 6.0 * weights * tokens + attention,
    };
    let batches = [(input, labels, work)];
    Ok(train_steps(
        &format!("{key}_fp32"),
        model,
        adamw(),
        5e-5,
        &batches,
        warmup,
        steps,
        device,
    ))
}

/// The real-data row: MiniLM fine-tuning steps on the tweet set's first `(warmup + steps) × batch`
/// rows (the file is already shuffled), each batch padded to its longest tweet.
pub fn tweets_train<B: TrainBackend>(
    model_dir: &Path,
    train_file: &Path,
    batch: usize,
    warmup: usize,
    steps: usize,
    device: &B::Device,
) -> crate::Result<BenchResult> {
    let md = crate::tasks::text_classification::ModelDir::new(model_dir)?;
    let tok = TextTokenizer::from_file(&model_dir.join("tokenizer.json"), 128)?;
    let args = tweets_data(train_file, (warmup + steps) * batch);
    let prepared = data::prepare(&args, &tok, None)?;
    let set = prepared.train.expect("a train file was given");
    let loaded = crate::tasks::text_classification::load_classifier::<B>(
        &md,
        Some(&prepared.labels),
        42,
        device,
    )?;
    let (SequenceClassifier::Bert(model), EncoderConfig::Bert(config), _) = loaded else {
        return Err(crate::error::KilnError::Config(format!(
            "{}: the tweets row measures a BERT model",
            md.dir.display()
        )));
    };
    let batches: Vec<_> = (0..set.len() / batch)
        .map(|b| {
            let idx = b * batch..(b + 1) * batch;
            let ex: Vec<_> = set.examples[idx.clone()].iter().collect();
            let input = collate(&ex, Padding::Longest, tok.pad_id);
            let labels = set.labels[idx].iter().map(|&l| l as i64).collect();
            let work = bert_train_work(&config, &input);
            (input, labels, work)
        })
        .collect();
    Ok(train_steps(
        "tweets_train_dynamic",
        model,
        adamw(),
        5e-5,
        &batches,
        warmup,
        steps,
        device,
    ))
}

/// The tweets file's first `rows` rows (sentiment labels, latin-1), as the tweet rows read it.
pub fn tweets_data(train_file: &Path, rows: usize) -> DataArgs {
    DataArgs {
        train_file: Some(train_file.to_path_buf()),
        eval_file: None,
        eval_split: None,
        columns: Columns {
            text: "text".into(),
            text_pair: None,
            label: Some("sentiment".into()),
        },
        encoding: TextEncoding::Latin1,
        strict: false,
        max_train_samples: Some(rows),
        max_eval_samples: None,
        seed: 42,
    }
}

/// MNIST MLP steps (SGD lr 0.01, batch 32, as the `mnist_mlp` sample) on one fixed batch of pixels.
pub fn mnist_train<B: TrainBackend>(
    batch: usize,
    warmup: usize,
    steps: usize,
    device: &B::Device,
) -> BenchResult {
    let model = crate::ops::with_seeded_rng::<B, _>(device, 0, || MnistMlp::<B>::new(device));
    let mut rng = StdRng::seed_from_u64(1234);
    let pixels = (0..batch * mlp::INPUT)
        .map(|_| rng.random_range(0.0..1.0))
        .collect();
    let labels = (0..batch)
        .map(|_| rng.random_range(0..mlp::CLASSES as i64))
        .collect();
    let work = StepWork {
        samples: batch,
        padded_seq: 0,
        tokens: 0,
        flops: 3.0 * mlp_forward_flops(batch),
    };
    let batches = [(PixelBatch { n: batch, pixels }, labels, work)];
    let sgd = Optimizer::new(OptimizerType::Sgd, ADAMW);
    train_steps(
        "mnist_train_fp32",
        model,
        sgd,
        0.01,
        &batches,
        warmup,
        steps,
        device,
    )
}

/// Inference (forward only, no autodiff) of a BERT classifier on one fixed random batch.
pub fn bert_infer<B: KilnBackend>(
    name: &str,
    model: &BertForSequenceClassification<B>,
    config: &BertConfig,
    (batch, seq): (usize, usize),
    warmup: usize,
    steps: usize,
) -> BenchResult {
    let (input, _) = random_text_batch(batch, seq, 4321);
    let work = StepWork {
        samples: batch,
        padded_seq: seq,
        tokens: batch * seq,
        flops: bert_forward_flops(config, vec![seq; batch]),
    };
    let (mut times, mut works) = (Vec::new(), Vec::new());
    let mut gpu = DeviceSampler::<B>::new(&model.classifier.weight.device());
    for i in 0..warmup + steps {
        if i == warmup {
            super::timed_steps_begin();
            gpu.start();
        }
        let t0 = Instant::now();
        let sum = model.logits(&input).sum();
        let queued = t0.elapsed().as_secs_f64();
        let s = sum.into_scalar().elem::<f64>();
        std::hint::black_box(s);
        if i >= warmup {
            times.push(t0.elapsed().as_secs_f64());
            works.push(work);
            gpu.step_done(queued);
        }
    }
    let mut r = BenchResult::from_times(name, &times, &works);
    gpu.finish(&mut r);
    r.warmup = warmup;
    r
}

/// The machine's fp32 GEMM rate through kiln's Linear kernel (1024³, like bench_hf.py's
/// calibration): the best of five timings, so a busy moment on a shared machine does not lower it.
pub fn gemm_gflops<B: KilnBackend>(device: &B::Device) -> f64 {
    // Operands with buffers of their own, as a step's weights and activations are: a tensor made
    // from data borrows it, and kiln's kernels copy a borrowed operand on every call.
    let operand = || {
        crate::ops::owned(Tensor::<B, 2>::random(
            [1024, 1024],
            burn::tensor::Distribution::Default,
            device,
        ))
    };
    let (a, b) = (operand(), operand());
    // The products alone, as PyTorch's calibration times `a @ b`: the outputs are dropped, and a
    // round ends by reading one value of its last (what waits for a GPU), where each output was
    // summed and the sum read.
    let product = || crate::ops::linear(a.clone(), b.clone(), None);
    let round = |k: usize| {
        (1..k).for_each(|_| drop(product()));
        product().slice([0..1, 0..1]).into_scalar().elem::<f64>()
    };
    round(1);
    (0..5)
        .map(|_| {
            let k = 4;
            let t0 = Instant::now();
            round(k);
            2.0 * 1024f64.powi(3) * k as f64 / t0.elapsed().as_secs_f64() / 1e9
        })
        .fold(0.0, f64::max)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::Cpu;

    /// The family rows' configs (written in the code, not read from files) pass the checks a
    /// config.json would.
    #[test]
    fn family_configs_are_valid() {
        for key in ["roberta_train", "distilbert_train", "modernbert_train"] {
            match family_config(key).unwrap() {
                EncoderConfig::Bert(c) => c.validate(),
                EncoderConfig::DistilBert(c) => c.validate(),
                EncoderConfig::ModernBert(c) => c.validate(),
            }
            .unwrap();
        }
        for key in ["qwen2_train", "mistral_train"] {
            crate::bench::llama::family_config(key)
                .unwrap()
                .validate()
                .unwrap();
        }
    }

    #[test]
    fn flop_count_is_twice_the_encoder_weights_per_token_plus_attention() {
        let cfg: BertConfig = serde_json::from_value(serde_json::json!({
            "vocab_size": 100, "hidden_size": 32, "num_hidden_layers": 3,
            "num_attention_heads": 4, "intermediate_size": 48}))
        .unwrap();
        let model = BertForSequenceClassification::<Cpu>::new(&cfg, 2, &Default::default());
        // Weights the encoder multiplies each token by, counted from the module itself.
        let weights: usize = crate::models::params::module_tensors(&model)
            .iter()
            .filter(|(k, _)| {
                k.contains(".encoder.") && k.ends_with("dense.weight")
                    || k.ends_with("query.weight")
                    || k.ends_with("key.weight")
                    || k.ends_with("value.weight")
            })
            .map(|(_, t)| t.data.len())
            .sum();
        let (h, l) = (32.0, 3.0);
        for t in [1usize, 7, 20] {
            let tf = t as f64;
            let want = 2.0 * weights as f64 * tf + 4.0 * l * h * tf * tf;
            let got = bert_forward_flops(&cfg, [t]);
            assert!((got - want).abs() < 1e-9 * want, "t={t}: {got} vs {want}");
        }
        // Two sequences cost the sum of each.
        let two = bert_forward_flops(&cfg, [5, 9]);
        assert_eq!(
            two,
            bert_forward_flops(&cfg, [5]) + bert_forward_flops(&cfg, [9])
        );
    }
}
