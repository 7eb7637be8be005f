//! Fixed-shape step benchmarks, built like ../shared/reference/bench_hf.py so the two can be run side
//! by side: random token ids in [1000, 30000), full attention mask, 6 random labels, AdamW lr 5e-5.

use std::time::Instant;

use crate::ops::{KilnBackend, TrainBackend};
use burn::module::AutodiffModule;
use burn::tensor::{ElementConversion, Int, Tensor, TensorData};
use rand::{rngs::StdRng, Rng, SeedableRng};
use serde::Serialize;

use crate::data::batch::TextBatch;
use crate::hub::config::BertConfig;
use crate::models::bert::BertForSequenceClassification;
use crate::train::optim::{AdamW, AdamWConfig, GradAccumulator};
use crate::train::{Classifier, CrossEntropy, Loss};

#[derive(Debug, Clone, Serialize)]
pub struct BenchResult {
    pub name: String,
    #[serde(skip)]
    pub warmup: usize,
    pub batch: usize,
    pub seq: usize,
    pub steps: usize,
    pub ms_per_step_mean: f64,
    pub ms_per_step_median: f64,
    pub ms_per_step_min: f64,
    pub samples_per_sec: f64,
    pub tokens_per_sec: f64,
    /// Model FLOPs per second: training 3× forward; forward = 2·params·tokens + attention.
    pub gflops: f64,
    pub loss_first: Option<f64>,
    pub loss_last: Option<f64>,
    /// With `--profile`: time per step in each fused kernel, and in everything else.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub profile: Vec<ProfileRow>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ProfileRow {
    pub kernel: String,
    pub calls_per_step: f64,
    pub ms_per_step: f64,
    pub share: f64,
}

/// Runs `f`, and if `profile` attaches the per-kernel breakdown of its timed steps.
fn profiled(profile: bool, f: impl FnOnce() -> BenchResult) -> BenchResult {
    crate::ops::profile::enable(profile);
    let _ = crate::ops::profile::take();
    let mut r = f();
    crate::ops::profile::enable(false);
    let rows = crate::ops::profile::take();
    if profile {
        // Warmup steps are profiled too: scale by the share of timed steps.
        let steps = r.steps as f64;
        let total_steps = steps + r.warmup as f64;
        let step_ms = r.ms_per_step_mean;
        let mut covered = 0.0;
        for (k, n, sec) in rows {
            let ms = sec * 1e3 / total_steps;
            // `step:` rows are phases that contain the kernels; they do not add to coverage.
            if !k.starts_with("step:") {
                covered += ms;
            }
            r.profile.push(ProfileRow {
                kernel: k.to_string(),
                calls_per_step: n as f64 / total_steps,
                ms_per_step: ms,
                share: ms / step_ms,
            });
        }
        r.profile.push(ProfileRow {
            kernel: "other (Burn ops, autodiff, allocation)".into(),
            calls_per_step: 0.0,
            ms_per_step: step_ms - covered,
            share: (step_ms - covered) / step_ms,
        });
    }
    r
}

fn random_batch(batch: usize, seq: usize, seed: u64) -> (TextBatch, Vec<i64>) {
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

/// Forward FLOPs of BERT for one batch: 2 per weight per token (embeddings excluded) plus QKᵀ and PV.
pub fn bert_forward_flops(c: &BertConfig, batch: usize, seq: usize) -> f64 {
    let (h, i, l) = (
        c.hidden_size as f64,
        c.intermediate_size as f64,
        c.num_hidden_layers as f64,
    );
    let per_layer = 4.0 * h * h + 2.0 * h * i;
    let tokens = (batch * seq) as f64;
    2.0 * l * per_layer * tokens + 4.0 * l * seq as f64 * h * tokens
}

fn summarize(name: &str, batch: usize, seq: usize, times: &[f64], flops: f64) -> BenchResult {
    let mut sorted = times.to_vec();
    sorted.sort_by(|a, b| a.total_cmp(b));
    let mean = times.iter().sum::<f64>() / times.len().max(1) as f64;
    BenchResult {
        name: name.into(),
        warmup: 0,
        batch,
        seq,
        steps: times.len(),
        ms_per_step_mean: mean * 1e3,
        ms_per_step_median: sorted[sorted.len() / 2] * 1e3,
        ms_per_step_min: sorted[0] * 1e3,
        samples_per_sec: batch as f64 / mean,
        tokens_per_sec: (batch * seq) as f64 / mean,
        gflops: flops / mean / 1e9,
        loss_first: None,
        loss_last: None,
        profile: Vec::new(),
    }
}

/// Training steps (forward, backward, AdamW) of a BERT classifier on one fixed random batch.
pub fn bert_train<B: TrainBackend>(
    name: &str,
    mut model: BertForSequenceClassification<B>,
    config: &BertConfig,
    batch: usize,
    seq: usize,
    warmup: usize,
    steps: usize,
) -> BenchResult {
    let device = model.classifier.weight.device();
    let (input, labels) = random_batch(batch, seq, 1234);
    let targets = Tensor::<B, 1, Int>::from_data(TensorData::new(labels, [batch]), &device);
    let mut opt = AdamW::<B::InnerBackend>::new(AdamWConfig {
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.0,
    });
    let (mut times, mut losses) = (Vec::new(), Vec::new());
    for i in 0..warmup + steps {
        let t0 = Instant::now();
        let loss = {
            let _p = crate::ops::profile::scope("step: forward (all)");
            CrossEntropy.loss(model.logits(&input), targets.clone())
        };
        let grads = {
            let _p = crate::ops::profile::scope("step: backward (all)");
            loss.backward()
        };
        let _p = crate::ops::profile::scope("step: optimizer (all)");
        let mut acc = GradAccumulator::default();
        acc.accumulate::<B, _>(&model, &grads);
        model = opt.step::<B, _>(model, 5e-5, acc);
        drop(_p);
        let l = loss.into_scalar().elem::<f64>();
        let dt = t0.elapsed().as_secs_f64();
        losses.push(l);
        if i >= warmup {
            times.push(dt);
        }
    }
    let mut r = summarize(
        name,
        batch,
        seq,
        &times,
        3.0 * bert_forward_flops(config, batch, seq),
    );
    r.warmup = warmup;
    r.loss_first = losses.first().copied();
    r.loss_last = losses.last().copied();
    let _ = model.valid();
    r
}

/// Inference (forward only, no autodiff) of a BERT classifier on one fixed random batch.
pub fn bert_infer<B: KilnBackend>(
    name: &str,
    model: &BertForSequenceClassification<B>,
    config: &BertConfig,
    batch: usize,
    seq: usize,
    warmup: usize,
    steps: usize,
) -> BenchResult {
    let (input, _) = random_batch(batch, seq, 4321);
    let mut times = Vec::new();
    for i in 0..warmup + steps {
        let t0 = Instant::now();
        let s = model.logits(&input).sum().into_scalar().elem::<f64>();
        std::hint::black_box(s);
        if i >= warmup {
            times.push(t0.elapsed().as_secs_f64());
        }
    }
    let mut r = summarize(
        name,
        batch,
        seq,
        &times,
        bert_forward_flops(config, batch, seq),
    );
    r.warmup = warmup;
    r
}

/// The machine's fp32 GEMM rate through kiln's Linear kernel (1024³, like bench_hf.py's calibration).
pub fn gemm_gflops<B: KilnBackend>(device: &B::Device) -> f64 {
    let a = Tensor::<B, 2>::random([1024, 1024], burn::tensor::Distribution::Default, device);
    let b = Tensor::<B, 2>::random([1024, 1024], burn::tensor::Distribution::Default, device);
    for _ in 0..3 {
        let _ = crate::ops::linear(a.clone(), b.clone(), None)
            .sum()
            .into_scalar();
    }
    let k = 10;
    let t0 = Instant::now();
    for _ in 0..k {
        let _ = crate::ops::linear(a.clone(), b.clone(), None)
            .sum()
            .into_scalar();
    }
    2.0 * 1024f64.powi(3) * k as f64 / t0.elapsed().as_secs_f64() / 1e9
}

/// What `kiln bench` runs.
#[derive(Debug, Clone)]
pub struct SuiteOptions {
    /// all-MiniLM-L6-v2 folder (for the `minilm_*` rows).
    pub minilm_dir: std::path::PathBuf,
    /// Row names: `minilm_train`, `minilm_infer`, `bertbase_train`.
    pub only: Vec<String>,
    pub warmup: usize,
    pub steps: usize,
    /// Steps for the larger BERT-base row.
    pub base_steps: usize,
    /// A Python with torch + transformers to run the reference in the same invocation.
    pub python: Option<String>,
    pub reference: std::path::PathBuf,
    pub threads: usize,
    /// Break each row's step time down by fused kernel.
    pub profile: bool,
}

/// One row: kiln's result beside PyTorch's, measured in the same invocation.
#[derive(Debug, Clone, Serialize)]
pub struct SuiteRow {
    pub kiln: BenchResult,
    pub pytorch: Option<serde_json::Value>,
    /// kiln samples/s ÷ PyTorch samples/s.
    pub ratio: Option<f64>,
}

#[derive(Debug, Clone, Serialize)]
pub struct SuiteReport {
    pub rows: Vec<SuiteRow>,
    pub kiln_gemm_gflops: f64,
    pub pytorch_header: Vec<String>,
    pub threads: usize,
}

/// Runs kiln's rows, then the PyTorch reference (if a Python is given), on the CPU backend.
pub fn run_suite(opts: &SuiteOptions) -> crate::Result<SuiteReport> {
    use crate::backend::{Cpu, CpuTrain};
    use crate::hub::weights::{load_into, read_safetensors};
    let device = Default::default();
    let gemm = gemm_gflops::<Cpu>(&device);
    tracing::info!("kiln sgemm 1024: {gemm:.1} GFLOP/s");
    let mut results = Vec::new();
    let wants = |n: &str| opts.only.iter().any(|o| o == n);
    if wants("minilm_train") || wants("minilm_infer") {
        let cfg = BertConfig::from_file(&opts.minilm_dir.join("config.json"))?;
        let weights = read_safetensors(&opts.minilm_dir.join("model.safetensors"))?;
        if wants("minilm_train") {
            let m = BertForSequenceClassification::<CpuTrain>::new(&cfg, 6, &device);
            let (m, _) = load_into(m, &weights, Some("bert"), &device)?;
            let r = profiled(opts.profile, || {
                bert_train(
                    "minilm_train_fp32",
                    m,
                    &cfg,
                    16,
                    128,
                    opts.warmup,
                    opts.steps,
                )
            });
            tracing::info!("{r:?}");
            results.push(r);
        }
        if wants("minilm_infer") {
            let m = BertForSequenceClassification::<Cpu>::new(&cfg, 6, &device);
            let (m, _) = load_into(m, &weights, Some("bert"), &device)?;
            let r = profiled(opts.profile, || {
                bert_infer(
                    "minilm_infer_fp32",
                    &m,
                    &cfg,
                    32,
                    128,
                    opts.warmup,
                    opts.steps,
                )
            });
            tracing::info!("{r:?}");
            results.push(r);
        }
    }
    if wants("bertbase_train") {
        let cfg: BertConfig = serde_json::from_value(serde_json::json!({
            "vocab_size": 30522, "hidden_size": 768, "num_hidden_layers": 12,
            "num_attention_heads": 12, "intermediate_size": 3072}))
        .expect("valid config");
        let m = BertForSequenceClassification::<CpuTrain>::new(&cfg, 6, &device);
        let r = profiled(opts.profile, || {
            bert_train(
                "bertbase_train_fp32",
                m,
                &cfg,
                8,
                128,
                opts.warmup,
                opts.base_steps,
            )
        });
        tracing::info!("{r:?}");
        results.push(r);
    }

    let (mut header, mut torch) = (Vec::new(), Vec::<serde_json::Value>::new());
    if let Some(py) = &opts.python {
        tracing::info!("running the PyTorch reference {}", opts.reference.display());
        let out = std::process::Command::new(py)
            .arg(&opts.reference)
            .arg("--only")
            .arg(opts.only.join(","))
            .args(["--threads", &opts.threads.to_string()])
            .args(["--warmup", &opts.warmup.to_string()])
            .args(["--steps", &opts.steps.to_string()])
            .args(["--base-steps", &opts.base_steps.to_string()])
            .env("MINILM_DIR", &opts.minilm_dir)
            .output()
            .map_err(|e| crate::KilnError::io(std::path::Path::new(py), e))?;
        let text = String::from_utf8_lossy(&out.stdout);
        for line in text.lines() {
            match line.strip_prefix("RESULT ") {
                Some(j) => torch.extend(serde_json::from_str::<serde_json::Value>(j).ok()),
                None => header.push(line.to_string()),
            }
        }
        if !out.status.success() {
            tracing::warn!(
                "PyTorch reference failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }
    let rows = results
        .into_iter()
        .map(|k| {
            let t = torch.iter().find(|t| t["name"] == k.name).cloned();
            let ratio = t
                .as_ref()
                .and_then(|t| t["samples_per_sec"].as_f64())
                .map(|s| k.samples_per_sec / s);
            SuiteRow {
                kiln: k,
                pytorch: t,
                ratio,
            }
        })
        .collect();
    Ok(SuiteReport {
        rows,
        kiln_gemm_gflops: gemm,
        pytorch_header: header,
        threads: opts.threads,
    })
}

impl SuiteReport {
    pub fn markdown(&self) -> String {
        let mut s = String::from(
            "| benchmark | batch×seq | kiln ms/step | kiln samples/s | kiln GFLOP/s | PyTorch ms/step | PyTorch samples/s | kiln/PyTorch |\n|---|---|---|---|---|---|---|---|\n",
        );
        for r in &self.rows {
            let k = &r.kiln;
            let (tm, ts) = match &r.pytorch {
                Some(t) => (
                    format!("{}", t["ms_per_step_mean"]),
                    format!("{}", t["samples_per_sec"]),
                ),
                None => ("–".into(), "–".into()),
            };
            s += &format!(
                "| {} | {}×{} | {:.1} | {:.2} | {:.1} | {tm} | {ts} | {} |\n",
                k.name,
                k.batch,
                k.seq,
                k.ms_per_step_mean,
                k.samples_per_sec,
                k.gflops,
                r.ratio.map_or("–".into(), |x| format!("{x:.2}×"))
            );
        }
        for r in self.rows.iter().filter(|r| !r.kiln.profile.is_empty()) {
            s += &format!(
                "\nProfile of {} ({:.1} ms/step):\n\n| kernel | calls/step | ms/step | share |\n|---|---|---|---|\n",
                r.kiln.name, r.kiln.ms_per_step_mean
            );
            for p in &r.kiln.profile {
                s += &format!(
                    "| {} | {:.0} | {:.1} | {:.1}% |\n",
                    p.kernel,
                    p.calls_per_step,
                    p.ms_per_step,
                    100.0 * p.share
                );
            }
        }
        s += &format!(
            "\nkiln sgemm 1024³: {:.1} GFLOP/s; threads {}. PyTorch: {}\n",
            self.kiln_gemm_gflops,
            self.threads,
            self.pytorch_header.join("; ")
        );
        s
    }
}
