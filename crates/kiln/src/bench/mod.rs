//! `kiln bench`: fixed-shape and real-data training-step benchmarks, each row run beside the same row
//! in PyTorch (../shared/reference/bench_hf.py, and scripts/bench_reference.py for the rows it lacks)
//! in the same invocation. Every row runs in its own process so its peak memory can be read.

mod device;
pub mod dp;
pub mod host_profile;
pub mod live_state;
pub mod llama;
pub mod measure;
pub mod peak;
pub mod table;
pub mod workloads;

use std::path::{Path, PathBuf};
use std::process::Command;

use burn::backend::Autodiff;
use serde::{Deserialize, Serialize};

use crate::error::{KilnError, Result};
pub use table::{Devices, Elements, Reference, RowSpec, Work, ROWS};
use workloads::StepWork;

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BenchResult {
    pub name: String,
    #[serde(skip)]
    pub warmup: usize,
    pub batch: usize,
    /// Padded sequence length (the mean over steps when batches differ).
    pub seq: usize,
    pub steps: usize,
    pub ms_per_step_mean: f64,
    pub ms_per_step_median: f64,
    pub ms_per_step_min: f64,
    pub samples_per_sec: f64,
    /// Real (unpadded) tokens per second.
    pub tokens_per_sec: f64,
    /// Model FLOPs per second as executed: training 3× forward; forward = 2·params·tokens + attention.
    pub gflops: f64,
    pub loss_first: Option<f64>,
    pub loss_last: Option<f64>,
    /// The row's process at its largest (set by the suite, which runs each row in a child).
    pub peak_rss_mib: Option<f64>,
    /// With `--profile`: time per step in each fused kernel, and in everything else.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub profile: Vec<ProfileRow>,
    /// For a row that times what a feature costs ([`Reference::KilnBaseline`]): the same work
    /// with the feature off, measured in the same process; it stands where PyTorch's row would.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub baseline: Option<Box<BenchResult>>,
    /// On a GPU: kernels launched per timed step (a cuBLAS call counts one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub launches_per_step: Option<f64>,
    /// On a GPU: the most memory the allocator held from the device (its pools), MiB.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_reserved_mib: Option<f64>,
    /// On a GPU: ms per step the host spent queueing work before it waited for the loss.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_ms_per_step: Option<f64>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ProfileRow {
    pub kernel: String,
    pub calls_per_step: f64,
    pub ms_per_step: f64,
    pub share: f64,
}

impl BenchResult {
    /// Summarises timed steps; `work[i]` is what step `i` computed.
    pub fn from_times(name: &str, times: &[f64], work: &[StepWork]) -> Self {
        let mut sorted = times.to_vec();
        sorted.sort_by(|a, b| a.total_cmp(b));
        let total: f64 = times.iter().sum::<f64>().max(f64::MIN_POSITIVE);
        let n = times.len().max(1) as f64;
        let sum = |f: fn(&StepWork) -> f64| work.iter().map(f).sum::<f64>();
        BenchResult {
            name: name.into(),
            warmup: 0,
            batch: work.first().map_or(0, |w| w.samples),
            seq: (sum(|w| w.padded_seq as f64) / n).round() as usize,
            steps: times.len(),
            ms_per_step_mean: total / n * 1e3,
            ms_per_step_median: sorted.get(sorted.len() / 2).copied().unwrap_or(0.0) * 1e3,
            ms_per_step_min: sorted.first().copied().unwrap_or(0.0) * 1e3,
            samples_per_sec: sum(|w| w.samples as f64) / total,
            tokens_per_sec: sum(|w| w.tokens as f64) / total,
            gflops: sum(|w| w.flops) / total / 1e9,
            loss_first: None,
            loss_last: None,
            peak_rss_mib: None,
            profile: Vec::new(),
            baseline: None,
            launches_per_step: None,
            gpu_reserved_mib: None,
            host_ms_per_step: None,
        }
    }
}

/// Where a row's timed steps begin: the profiles (`--profile`, `--host-profile`) cover them only.
pub(crate) fn timed_steps_begin() {
    let _ = crate::ops::profile::take();
    if let Err(e) = host_profile::start() {
        tracing::warn!("{e}; the row runs unsampled");
    }
}

/// Runs row `key` through `f`; with `profile` attaches the per-kernel breakdown of its timed steps,
/// and with `host_profile` writes their sampled host stacks into that folder.
fn profiled(
    key: &str,
    profile: bool,
    host_profile: Option<&Path>,
    f: impl FnOnce() -> Result<BenchResult>,
) -> Result<BenchResult> {
    if let Some(dir) = host_profile {
        host_profile::arm(dir, key)?;
    }
    crate::ops::profile::enable(profile);
    let _ = crate::ops::profile::take();
    let r = f();
    let written = host_profile::finish();
    let mut r = r?;
    if let Some(path) = written? {
        eprintln!("host profile of {key}: {}", path.display());
    }
    crate::ops::profile::enable(false);
    let rows = crate::ops::profile::take();
    if profile {
        // Every row restarts the profile at its first timed step.
        let total_steps = r.steps.max(1) as f64;
        let step_ms = r.ms_per_step_mean;
        let mut covered = 0.0;
        for (k, n, sec) in rows {
            let ms = sec * 1e3 / total_steps;
            // `step:` rows are phases that contain the kernels, `part:` rows parts of a kernel:
            // neither adds to coverage.
            if !k.starts_with("step:") && !k.starts_with("part:") {
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
    Ok(r)
}

/// What `kiln bench` runs.
#[derive(Debug, Clone)]
pub struct SuiteOptions {
    /// all-MiniLM-L6-v2 folder (for the MiniLM and tweet rows).
    pub minilm_dir: PathBuf,
    /// The real-data row's CSV (sentiment,confidence,text; latin-1).
    pub tweets_file: PathBuf,
    /// SmolLM2-135M as GGUF (the SmolLM2 rows convert it once, to `hf/` beside it).
    pub smollm2_gguf: PathBuf,
    /// The causal-LM rows' corpus (JSONL, `text` column).
    pub lm_corpus: PathBuf,
    /// Tokens the decoding row generates (each one a timed step).
    pub generate_tokens: usize,
    /// Row keys (see [`ROWS`]).
    pub only: Vec<String>,
    pub warmup: usize,
    pub steps: usize,
    /// Steps for the larger BERT-base row.
    pub base_steps: usize,
    /// Steps for the MNIST MLP row (about 1 ms each).
    pub mnist_steps: usize,
    /// A Python with torch + transformers to run the references in the same invocation.
    pub python: Option<String>,
    pub reference: PathBuf,
    pub extra_reference: PathBuf,
    pub threads: usize,
    /// Break each step down by fused kernel.
    pub profile: bool,
    /// Sample the host's call stacks during each kiln row's timed steps into this folder
    /// (`host_profile`).
    pub host_profile: Option<PathBuf>,
    /// The command that runs one kiln row in a child process (`kiln … bench … --row`); the key is
    /// appended. Without it rows run in this process and peak memory is not measured.
    pub row_command: Option<Vec<String>>,
    /// Where kiln's rows run. On a GPU the PyTorch side is `cuda_reference` on the same GPU.
    pub device: crate::backend::DeviceSpec,
    /// The PyTorch side of every row on a CUDA device (bench_hf.py times the CPU only).
    pub cuda_reference: PathBuf,
}

/// Runs one row in this process on backend `B` (training rows on `Autodiff<B>`).
pub fn run_row<B>(key: &str, opts: &SuiteOptions, device: &B::Device) -> Result<BenchResult>
where
    B: crate::ops::KilnBackend,
    Autodiff<B>: crate::ops::TrainBackend<InnerBackend = B, Device = B::Device>,
{
    use crate::formats::safetensors::read_safetensors;
    use crate::models::bert::config::BertConfig;
    use crate::models::bert::BertForSequenceClassification;
    use crate::models::params::load_into;
    let spec = table::row(key)?;
    runs_on_device(spec, &opts.device)?;
    let device = device.clone();
    let minilm = || -> Result<_> {
        let cfg = BertConfig::from_file(&opts.minilm_dir.join("config.json"))?;
        let weights = read_safetensors(&opts.minilm_dir.join("model.safetensors"))?;
        Ok((cfg, weights))
    };
    let (w, s) = (opts.warmup, opts.steps);
    // What `--bf16` does on this CPU (f32 where it has no bf16 arithmetic), for this row only.
    let autocast =
        |bf16: bool| crate::ops::MatmulPrecisionScope::set(crate::ops::mixed_precision::<B>(bf16));
    profiled(
        key,
        opts.profile,
        opts.host_profile.as_deref(),
        || match spec.work {
            Work::MiniLmTrain { bf16 } => {
                let (cfg, weights) = minilm()?;
                let m = BertForSequenceClassification::<Autodiff<B>>::new(&cfg, 6, &device);
                let (m, _) = load_into(m, weights, Some("bert"), &device)?;
                let _precision = autocast(bf16);
                let name = if bf16 { key } else { "minilm_train_fp32" };
                Ok(workloads::bert_train(name, m, &cfg, (16, 128), w, s))
            }
            Work::MiniLmInfer => {
                let (cfg, weights) = minilm()?;
                let m = BertForSequenceClassification::<B>::new(&cfg, 6, &device);
                let (m, _) = load_into(m, weights, Some("bert"), &device)?;
                Ok(workloads::bert_infer(
                    "minilm_infer_fp32",
                    &m,
                    &cfg,
                    (32, 128),
                    w,
                    s,
                ))
            }
            Work::BertBaseTrain { batch, bf16 } => {
                let cfg: BertConfig = serde_json::from_value(serde_json::json!({
                "vocab_size": 30522, "hidden_size": 768, "num_hidden_layers": 12,
                "num_attention_heads": 12, "intermediate_size": 3072}))
                .expect("valid config");
                let m = BertForSequenceClassification::<Autodiff<B>>::new(&cfg, 6, &device);
                let name = if bf16 { key } else { "bertbase_train_fp32" };
                let _precision = autocast(bf16);
                Ok(workloads::bert_train(
                    name,
                    m,
                    &cfg,
                    (batch, 128),
                    w,
                    opts.base_steps,
                ))
            }
            Work::EncoderFamilyTrain => {
                workloads::family_train::<Autodiff<B>>(key, (8, 128), w, opts.base_steps, &device)
            }
            Work::MnistTrain => Ok(workloads::mnist_train::<Autodiff<B>>(
                32,
                w.max(5),
                opts.mnist_steps,
                &device,
            )),
            Work::TweetsTrain => workloads::tweets_train::<Autodiff<B>>(
                &opts.minilm_dir,
                &opts.tweets_file,
                16,
                w,
                s,
                &device,
            ),
            Work::LiveState => live_state::live_state_overhead::<Autodiff<B>>(
                &opts.minilm_dir,
                &opts.tweets_file,
                (16, s.max(10), 8),
                &device,
            ),
            Work::DecoderFamilyTrain => llama::family_train(key, w, opts.base_steps),
            Work::SmolLm2Train => {
                let dir = llama::converted_folder(&opts.smollm2_gguf)?;
                llama::train(&dir, &opts.lm_corpus, w, opts.base_steps)
            }
            Work::SmolLm2TrainBf16 { lora } => {
                llama::smollm2_train_bf16::<B>(w, opts.base_steps, &device, lora)
            }
            Work::LoraTrain { on_smollm2 } => {
                let dir = on_smollm2
                    .then(|| llama::converted_folder(&opts.smollm2_gguf))
                    .transpose()?;
                llama::lora_train(key, dir.as_deref(), &opts.lm_corpus, w, opts.base_steps)
            }
            Work::Prefill => {
                let dir = llama::converted_folder(&opts.smollm2_gguf)?;
                llama::prefill(&dir, &opts.lm_corpus, w, s)
            }
            Work::Generate => {
                let dir = llama::converted_folder(&opts.smollm2_gguf)?;
                llama::generate(&dir, w, opts.generate_tokens)
            }
            Work::Collective {
                op,
                engine,
                elements,
            } => {
                let (n, w, s) = match elements {
                    Elements::MnistGradient => {
                        (dp::mnist_gradient_len(), w.max(5), opts.mnist_steps)
                    }
                    Elements::Bucket => (crate::parallel::BUCKET_ELEMENTS, w, s),
                };
                dp::collective(key, op, engine, n, w, s)
            }
        },
    )
}

/// An error for a row asked for on a device it does not run on.
fn runs_on_device(spec: &RowSpec, device: &crate::backend::DeviceSpec) -> Result<()> {
    let cpu = *device == crate::backend::DeviceSpec::Cpu;
    match (spec.devices, cpu) {
        (Devices::GpuOnly, true) => Err(KilnError::Config(format!(
            "benchmark {} runs on a GPU only (use --device cuda or --device wgpu)",
            spec.key
        ))),
        (Devices::Cpu, false) => Err(KilnError::Config(format!(
            "benchmark {} runs on the CPU only (rows on a GPU: {})",
            spec.key,
            table::gpu_rows().join(", ")
        ))),
        _ => Ok(()),
    }
}

/// One PyTorch result with the peak memory of the process that produced it.
#[derive(Debug, Clone, Serialize)]
pub struct PytorchRow {
    pub result: serde_json::Value,
    pub peak_rss_mib: f64,
}

/// A kiln row beside the PyTorch rows it is compared with.
#[derive(Debug, Clone, Serialize)]
pub struct SuiteRow {
    pub key: String,
    pub kiln: BenchResult,
    pub pytorch: Vec<PytorchRow>,
}

impl SuiteRow {
    /// kiln samples/s ÷ PyTorch samples/s, for each PyTorch row.
    pub fn ratios(&self) -> Vec<Option<f64>> {
        self.pytorch
            .iter()
            .map(|t| {
                t.result["samples_per_sec"]
                    .as_f64()
                    .map(|s| self.kiln.samples_per_sec / s)
            })
            .collect()
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct SuiteReport {
    pub rows: Vec<SuiteRow>,
    pub kiln_gemm_gflops: f64,
    /// Best fp32 GEMM rate measured on this machine (kiln's or PyTorch's calibration).
    pub gemm_peak_gflops: f64,
    pub pytorch_header: Vec<String>,
    pub threads: usize,
    pub date: String,
    /// The CPU model and the vector/matrix extensions kiln dispatches on (rows of different CPU
    /// kinds are not comparable).
    pub cpu: String,
    /// The CPU's arithmetic ceiling (rows on a GPU, and CPUs without AVX2, have none).
    pub machine_peak: Option<peak::MachinePeak>,
}

/// The value of /proc/cpuinfo's first `name` line (the first CPU's).
fn cpuinfo_field(cpuinfo: &str, name: &str) -> Option<String> {
    cpuinfo
        .lines()
        .find(|l| l.split(':').next().is_some_and(|k| k.trim() == name))
        .and_then(|l| l.split_once(':'))
        .map(|(_, v)| v.trim().to_string())
}

fn cpu_flags(cpuinfo: &str) -> String {
    cpuinfo_field(cpuinfo, "flags").unwrap_or_default()
}

/// The core design of an x86 CPU from its vendor, family and model numbers, where kiln knows it:
/// cloud VMs often report only "AMD EPYC", and a Zen 4 and a Zen 5 behind that name differ 2× in
/// peak arithmetic (the Zen 5 core has full-width AVX-512 units).
fn microarchitecture(vendor: &str, family: u32, model: u32) -> Option<&'static str> {
    Some(match (vendor, family) {
        ("AuthenticAMD", 0x17) if model >= 0x30 => "Zen 2",
        ("AuthenticAMD", 0x17) => "Zen/Zen+",
        ("AuthenticAMD", 0x19) => match model {
            0x10..=0x1F | 0x60..=0x7F | 0xA0..=0xAF => "Zen 4",
            _ => "Zen 3",
        },
        ("AuthenticAMD", 0x1A) => "Zen 5",
        ("GenuineIntel", 6) => match model {
            0x55 => "Skylake/Cascade Lake",
            0x6A | 0x6C => "Ice Lake",
            0x8F => "Sapphire Rapids",
            0xCF => "Emerald Rapids",
            0xAD | 0xAE => "Granite Rapids",
            _ => return None,
        },
        _ => return None,
    })
}

/// `model (core design, family F model M; ISA: …)` from /proc/cpuinfo's text: the model name,
/// the core design where known, and which of the instruction sets kiln's kernels choose between
/// the CPU reports.
pub fn cpu_description(cpuinfo: &str) -> String {
    let model = cpuinfo_field(cpuinfo, "model name").unwrap_or_else(|| "unknown CPU".into());
    let number = |k| cpuinfo_field(cpuinfo, k).and_then(|v| v.parse::<u32>().ok());
    let design = match (number("cpu family"), number("model")) {
        (Some(f), Some(m)) => {
            let vendor = cpuinfo_field(cpuinfo, "vendor_id").unwrap_or_default();
            let name = microarchitecture(&vendor, f, m).unwrap_or("core design unknown to kiln");
            format!("{name}, family {f} model {m}; ")
        }
        _ => String::new(),
    };
    let flags = cpu_flags(cpuinfo);
    let flags: Vec<&str> = flags.split_whitespace().collect();
    let isa: Vec<&str> = [
        "avx2",
        "fma",
        "avx512f",
        "avx512_bf16",
        "amx_tile",
        "amx_bf16",
    ]
    .into_iter()
    .filter(|f| flags.contains(f))
    .collect();
    format!(
        "{model} ({design}ISA: {})",
        if isa.is_empty() {
            "none of avx2/avx512/amx".to_string()
        } else {
            isa.join(" ")
        }
    )
}

fn parse_results(text: &str) -> (Vec<serde_json::Value>, Vec<String>) {
    let (mut results, mut other) = (Vec::new(), Vec::new());
    for line in text.lines() {
        match line.strip_prefix("RESULT ") {
            Some(j) => results.extend(serde_json::from_str::<serde_json::Value>(j).ok()),
            None => other.push(line.to_string()),
        }
    }
    (results, other)
}

/// Runs a kiln row in a child process (when `row_command` is set) for its peak memory.
fn kiln_row<B>(key: &str, opts: &SuiteOptions, device: &B::Device) -> Result<BenchResult>
where
    B: crate::ops::KilnBackend,
    Autodiff<B>: crate::ops::TrainBackend<InnerBackend = B, Device = B::Device>,
{
    let Some(cmd) = &opts.row_command else {
        return run_row::<B>(key, opts, device);
    };
    let m = measure::run_measured(Command::new(&cmd[0]).args(&cmd[1..]).arg(key))
        .map_err(|e| KilnError::io(std::path::Path::new(&cmd[0]), e))?;
    let (results, _) = parse_results(&m.stdout);
    let Some(r) = results.into_iter().next().filter(|_| m.success) else {
        return Err(KilnError::Config(format!(
            "benchmark {key} failed:\n{}",
            m.stderr
        )));
    };
    let mut r: BenchResult = serde_json::from_value(r)
        .map_err(|e| KilnError::Config(format!("benchmark {key}: bad result: {e}")))?;
    r.peak_rss_mib = Some(m.peak_rss_mib);
    Ok(r)
}

/// Runs the PyTorch side of one row in its own Python process.
fn pytorch_row(
    py: &str,
    spec: &RowSpec,
    opts: &SuiteOptions,
    header: &mut Vec<String>,
) -> Vec<PytorchRow> {
    let on_gpu = match opts.device {
        crate::backend::DeviceSpec::Cpu => None,
        crate::backend::DeviceSpec::Cuda(i) => Some(format!("cuda:{i}")),
        crate::backend::DeviceSpec::Wgpu => None,
    };
    let script = match (&on_gpu, spec.reference) {
        (Some(_), _) => &opts.cuda_reference,
        (None, Reference::BenchHf) => &opts.reference,
        (None, Reference::Extra) => &opts.extra_reference,
        (None, Reference::KilnBaseline) => unreachable!("measured by kiln"),
    };
    let mut cmd = Command::new(py);
    if on_gpu.is_none() {
        // `KILN_CPU_ISA` caps PyTorch's CPU kernels as it caps kiln's: one column, one level.
        cmd.envs(crate::ops::isa::cpu_isa().cap.pytorch_env().iter().copied());
    }
    cmd.arg(script)
        .args(["--only", spec.key])
        .args(["--threads", &opts.threads.to_string()])
        .args(["--warmup", &opts.warmup.to_string()])
        .args(["--steps", &opts.steps.to_string()])
        .env("MINILM_DIR", &opts.minilm_dir);
    match (&on_gpu, spec.reference) {
        (Some(device), _) => {
            cmd.args(["--device", device])
                .args(["--base-steps", &opts.base_steps.to_string()])
                .args(["--mnist-steps", &opts.mnist_steps.to_string()])
                .arg("--tweets-file")
                .arg(&opts.tweets_file);
        }
        (None, Reference::BenchHf) => {
            cmd.args(["--base-steps", &opts.base_steps.to_string()])
                .args(["--bf16-steps", &opts.steps.to_string()]);
        }
        (None, Reference::Extra | Reference::KilnBaseline) => {
            cmd.args(["--mnist-steps", &opts.mnist_steps.to_string()])
                .args(["--base-steps", &opts.base_steps.to_string()])
                .args(["--generate-tokens", &opts.generate_tokens.to_string()])
                .arg("--tweets-file")
                .arg(&opts.tweets_file)
                .arg("--lm-corpus")
                .arg(&opts.lm_corpus);
            if spec.key.starts_with("smollm2") {
                // the kiln row (run first) has converted the GGUF
                let gguf = &opts.smollm2_gguf;
                cmd.env(
                    "SMOLLM2_DIR",
                    gguf.parent().unwrap_or(Path::new(".")).join("hf"),
                );
            }
        }
    }
    tracing::info!("PyTorch: {}", spec.key);
    let m = match measure::run_measured(&mut cmd) {
        Ok(m) => m,
        Err(e) => {
            tracing::warn!("could not run {py}: {e}");
            return Vec::new();
        }
    };
    if !m.success {
        tracing::warn!("PyTorch reference {} failed: {}", spec.key, m.stderr);
    }
    let (results, other) = parse_results(&m.stdout);
    for line in other {
        if !header.contains(&line) {
            header.push(line);
        }
    }
    spec.pytorch_rows
        .iter()
        .filter_map(|name| results.iter().find(|r| r["name"] == *name).cloned())
        .map(|result| PytorchRow {
            result,
            peak_rss_mib: m.peak_rss_mib,
        })
        .collect()
}

/// Runs each selected row in kiln, then in PyTorch (if a Python is given), one after the other.
pub fn run_suite<B>(opts: &SuiteOptions, device: &B::Device) -> Result<SuiteReport>
where
    B: crate::ops::KilnBackend,
    Autodiff<B>: crate::ops::TrainBackend<InnerBackend = B, Device = B::Device>,
{
    for key in &opts.only {
        runs_on_device(table::row(key)?, &opts.device)?;
    }
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let machine_peak = match opts.device {
        crate::backend::DeviceSpec::Cpu => peak::measure(),
        _ => None,
    };
    if let Some(p) = &machine_peak {
        tracing::info!("{}", p.how);
    }
    let gemm = workloads::gemm_gflops::<B>(device);
    tracing::info!("kiln sgemm 1024: {gemm:.1} GFLOP/s");
    let mut out = Vec::new();
    let mut header = Vec::new();
    for spec in ROWS.iter().filter(|r| opts.only.iter().any(|o| o == r.key)) {
        tracing::info!("kiln: {}", spec.key);
        let kiln = kiln_row::<B>(spec.key, opts, device)?;
        tracing::info!("{kiln:?}");
        let pytorch = match (&opts.python, spec.reference, &kiln.baseline) {
            (_, Reference::KilnBaseline, Some(b)) => vec![PytorchRow {
                result: serde_json::to_value(b).expect("plain data"),
                // Measured in the same process as the row.
                peak_rss_mib: kiln.peak_rss_mib.unwrap_or(f64::NAN),
            }],
            (_, Reference::KilnBaseline, None) => Vec::new(),
            (Some(py), _, _) => pytorch_row(py, spec, opts, &mut header),
            (None, _, _) => Vec::new(),
        };
        out.push(SuiteRow {
            key: spec.key.into(),
            kiln,
            pytorch,
        });
    }
    let torch_gemm = header
        .iter()
        .filter_map(|l| l.split("sgemm1024_gflops=").nth(1))
        .filter_map(|v| v.split_whitespace().next()?.parse::<f64>().ok())
        .fold(0.0, f64::max);
    Ok(SuiteReport {
        rows: out,
        kiln_gemm_gflops: gemm,
        gemm_peak_gflops: gemm.max(torch_gemm),
        pytorch_header: header,
        threads: opts.threads,
        date: today(),
        cpu: format!(
            "{}; {}{}",
            cpu_description(&cpuinfo),
            crate::ops::isa::cpu_isa().describe(),
            pytorch_cap(crate::ops::isa::cpu_isa().cap)
        ),
        machine_peak,
    })
}

/// The footer's note of the switches that capped the PyTorch side (empty when nothing did).
fn pytorch_cap(cap: crate::ops::isa::IsaCap) -> String {
    let env = cap.pytorch_env();
    if env.is_empty() {
        return String::new();
    }
    let vars: Vec<String> = env.iter().map(|(k, v)| format!("{k}={v}")).collect();
    format!("; PyTorch capped by {}", vars.join(" "))
}

/// Today's date (UTC) as YYYY-MM-DD, from the system clock.
fn today() -> String {
    let days = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() / 86_400) as i64;
    // Howard Hinnant's civil-from-days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02}")
}

fn fmt_opt(v: Option<f64>, digits: usize) -> String {
    v.map_or("–".into(), |x| format!("{x:.digits$}"))
}

impl SuiteReport {
    pub fn markdown(&self) -> String {
        let peak = self.gemm_peak_gflops;
        let mut s = String::from(
            "| benchmark | batch×seq | kiln ms/step | kiln samples/s | kiln tokens/s | kiln GFLOP/s | % GEMM peak | % machine peak | kiln peak RSS MiB \
             | PyTorch row | PyTorch ms/step | PyTorch samples/s | PyTorch tokens/s | PyTorch peak RSS MiB | kiln/PyTorch |\n\
             |---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
        );
        for r in &self.rows {
            let k = &r.kiln;
            let kiln_cols = format!(
                "| {} | {}×{} | {:.1} | {:.2} | {:.0} | {:.1} | {:.0}% | {} | {} ",
                k.name,
                k.batch,
                k.seq,
                k.ms_per_step_mean,
                k.samples_per_sec,
                k.tokens_per_sec,
                k.gflops,
                100.0 * k.gflops / peak,
                self.machine_share(k),
                fmt_opt(k.peak_rss_mib, 0),
            );
            if r.pytorch.is_empty() {
                s += &format!("{kiln_cols}| – | – | – | – | – | – |\n");
            }
            for (t, ratio) in r.pytorch.iter().zip(r.ratios()) {
                let v = &t.result;
                let tokens = v["tokens_per_sec"]
                    .as_f64()
                    .or_else(|| Some(v["samples_per_sec"].as_f64()? * v["seq"].as_f64()?));
                s += &format!(
                    "{kiln_cols}| {} | {} | {} | {} | {:.0} | {} |\n",
                    v["name"].as_str().unwrap_or("?"),
                    fmt_opt(v["ms_per_step_mean"].as_f64(), 1),
                    fmt_opt(v["samples_per_sec"].as_f64(), 2),
                    fmt_opt(tokens, 0),
                    t.peak_rss_mib,
                    ratio.map_or("–".into(), |x| format!("**{x:.2}×**")),
                );
            }
        }
        s += &self.gpu_counters_markdown();
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
            "\n{}; {}; threads {}; fp32 GEMM peak {:.1} GFLOP/s (best of kiln's sgemm 1024³ {:.1} and PyTorch's calibration); {}. PyTorch: {}\n",
            self.date,
            self.cpu,
            self.threads,
            peak,
            self.kiln_gemm_gflops,
            self.machine_peak
                .as_ref()
                .map_or("no machine peak measured", |p| p.how.as_str()),
            self.pytorch_header.join("; ")
        );
        s
    }

    /// On a GPU: each row's launches per step, host time per step and largest device memory
    /// reservation, kiln's beside PyTorch's (empty on the CPU).
    fn gpu_counters_markdown(&self) -> String {
        let rows: Vec<_> = self
            .rows
            .iter()
            .filter(|r| r.kiln.gpu_reserved_mib.is_some())
            .collect();
        if rows.is_empty() {
            return String::new();
        }
        let mut s = String::from(
            "\nOn the GPU, per timed step: kernel launches (kiln: CubeCL kernels + cuBLAS calls; \
             PyTorch: `torch.profiler`'s device kernels), the host's time until it waits for the \
             loss, and the allocator's largest reservation (PyTorch: `max_memory_reserved`).\n\n\
             | benchmark | kiln launches | PyTorch launches | kiln host ms | PyTorch host ms \
             | kiln MiB reserved | PyTorch MiB reserved |\n\
             |---|---|---|---|---|---|---|\n",
        );
        for r in rows {
            let k = &r.kiln;
            let t = r.pytorch.first().map(|t| &t.result);
            let field = |name: &str| t.and_then(|v| v[name].as_f64());
            s += &format!(
                "| {} | {} | {} | {} | {} | {} | {} |
",
                k.name,
                fmt_opt(k.launches_per_step, 0),
                fmt_opt(field("launches_per_step"), 0),
                fmt_opt(k.host_ms_per_step, 1),
                fmt_opt(field("host_ms_per_step"), 1),
                fmt_opt(k.gpu_reserved_mib, 0),
                fmt_opt(field("gpu_reserved_mib"), 0),
            );
        }
        s
    }

    /// A row's rate as a share of the machine's fp32 peak, and for a bf16 row of its bf16 peak.
    fn machine_share(&self, k: &BenchResult) -> String {
        let Some(p) = &self.machine_peak else {
            return "–".into();
        };
        let fp32 = 100.0 * k.gflops / p.fp32_gflops;
        if k.name.contains("bf16") {
            format!(
                "{fp32:.0}% fp32 · {:.0}% bf16",
                100.0 * k.gflops / p.bf16_gflops
            )
        } else {
            format!("{fp32:.0}%")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One table says what each row runs and where: keys are unique, a row's parameters are
    /// typed, and a row asked for on a device it does not run on is one sentence.
    #[test]
    fn the_row_table_types_each_rows_work_and_devices() {
        let mut keys: Vec<_> = ROWS.iter().map(|r| r.key).collect();
        keys.sort_unstable();
        keys.dedup();
        assert_eq!(keys.len(), ROWS.len());
        assert_eq!(
            table::row("dp_allgather_64mib_mpi").unwrap().work,
            Work::Collective {
                op: dp::Op::AllGather,
                engine: crate::parallel::Engine::Mpi,
                elements: Elements::Bucket
            }
        );
        assert_eq!(
            table::row("bertbase_train_bf16_b32").unwrap().work,
            Work::BertBaseTrain {
                batch: 32,
                bf16: true
            }
        );
        let cpu = crate::backend::DeviceSpec::Cpu;
        let gpu_only = runs_on_device(table::row("bertbase_train_bf16_b128").unwrap(), &cpu);
        assert!(gpu_only
            .unwrap_err()
            .to_string()
            .contains("runs on a GPU only"));
        assert!(runs_on_device(table::row("smollm2_prefill").unwrap(), &cpu).is_ok());
        assert!(table::gpu_rows().contains(&"tweets_train"));
        assert!(table::gpu_rows().contains(&"smollm2_lora_train_bf16"));
        assert!(!table::gpu_rows().contains(&"smollm2_prefill"));
        let unknown = table::row("resnet").unwrap_err().to_string();
        assert!(
            unknown.contains("unknown benchmark \"resnet\""),
            "{unknown}"
        );
    }

    #[test]
    fn every_row_is_a_share_of_the_machine_peak_and_bf16_rows_of_both() {
        let work = StepWork {
            samples: 1,
            tokens: 1,
            padded_seq: 1,
            flops: 50e9,
        };
        let row = |name: &str| SuiteRow {
            key: name.into(),
            kiln: BenchResult::from_times(name, &[1.0], std::slice::from_ref(&work)),
            pytorch: Vec::new(),
        };
        let report = SuiteReport {
            rows: vec![row("minilm_train_fp32"), row("minilm_train_bf16")],
            kiln_gemm_gflops: 80.0,
            gemm_peak_gflops: 100.0,
            pytorch_header: Vec::new(),
            threads: 2,
            date: "2026-11-23".into(),
            cpu: "test CPU".into(),
            machine_peak: Some(peak::MachinePeak {
                fp32_gflops: 200.0,
                bf16_gflops: 400.0,
                how: "measured somehow".into(),
            }),
        };
        let md = report.markdown();
        assert!(md.contains("| 50.0 | 50% | 25% | –"), "{md}");
        assert!(
            md.contains("| 50.0 | 50% | 25% fp32 · 12% bf16 | –"),
            "{md}"
        );
        assert!(md.contains("; measured somehow."), "{md}");
    }

    #[test]
    fn the_cpu_is_named_with_the_extensions_kiln_dispatches_on() {
        let intel = "processor\t: 0\nmodel name\t: INTEL(R) XEON(R) PLATINUM 8581C CPU @ 2.10GHz\n\
                     flags\t\t: fpu sse2 avx2 fma avx512f avx512bw avx512_bf16 amx_bf16 amx_tile amx_int8\n";
        assert_eq!(
            cpu_description(intel),
            "INTEL(R) XEON(R) PLATINUM 8581C CPU @ 2.10GHz (ISA: avx2 fma avx512f avx512_bf16 amx_tile amx_bf16)"
        );
        let zen3 = "model name\t: AMD EPYC 7B13 64-Core Processor\nflags\t\t: fpu sse2 avx2 fma\n";
        assert_eq!(
            cpu_description(zen3),
            "AMD EPYC 7B13 64-Core Processor (ISA: avx2 fma)"
        );
        // Family and model name the core design behind a VM's generic "AMD EPYC".
        let amd = |family: u32, model: u32| {
            cpu_description(&format!(
                "vendor_id\t: AuthenticAMD\ncpu family\t: {family}\nmodel\t\t: {model}\n\
                 model name\t: AMD EPYC\nflags\t\t: avx2 fma avx512f\n"
            ))
        };
        assert_eq!(
            amd(26, 2),
            "AMD EPYC (Zen 5, family 26 model 2; ISA: avx2 fma avx512f)"
        );
        assert!(amd(25, 17).contains("(Zen 4, family 25 model 17;"));
        assert!(amd(25, 1).contains("(Zen 3, family 25 model 1;"));
        assert!(amd(7, 1).contains("(core design unknown to kiln, family 7 model 1;"));
        let emerald =
            "vendor_id\t: GenuineIntel\ncpu family\t: 6\nmodel\t\t: 207\nmodel name\t: X\n";
        assert_eq!(
            cpu_description(emerald),
            "X (Emerald Rapids, family 6 model 207; ISA: none of avx2/avx512/amx)"
        );
        assert_eq!(
            cpu_description(""),
            "unknown CPU (ISA: none of avx2/avx512/amx)"
        );
    }
}
