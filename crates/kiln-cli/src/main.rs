//! `kiln`: the command-line front end. This file holds the `Cli` and its `Command`s, parses the
//! command line, picks the backend `--device` names and hands the command to its module in
//! `commands/`; the work itself is in the `kiln` library.

mod argv;
mod commands;
mod hf_flags;

use std::process::ExitCode;

use anyhow::Result;
use clap::{ArgMatches, CommandFactory, FromArgMatches, Parser, Subcommand};
use kiln::backend::{Autodiff, Cpu, CpuDevice, DeviceSpec};

use commands::{
    bench, cache, convert, eval, generate, launch, merge, plot, precompile, predict, top, train,
};

/// Training allocates and frees the same large activation buffers every step: mimalloc keeps them,
/// where the system allocator returns them to the OS and pays page faults to get them back.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// mimalloc's `mi_option_purge_delay` (the same index in its v2 and v3 headers).
const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

/// Keeps freed memory committed: by default mimalloc hands freed pages back to the OS after 10 ms,
/// and a training step frees and reallocates ~100 MB of buffers (the embedding gradient alone is
/// 47 MB for BERT's vocabulary), so every step paid page faults and kernel zeroing for them
/// (measured: 10 % of the profile, and 6-9 % of step time).
fn keep_freed_memory() {
    if std::env::var_os("MIMALLOC_PURGE_DELAY").is_none() {
        // SAFETY: sets a process-wide allocator option; valid at any time.
        unsafe { libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, -1) };
        kiln::backend::set_freed_memory_release(release_freed_pages);
    }
}

/// Purges freed pages at once while `on` (purging is off while the delay is −1), for a one-off
/// release such as the f32 base that `--base-dtype bf16` replaces: kept, it would stay resident
/// for the whole run.
fn release_freed_pages(on: bool) {
    // SAFETY: process-wide allocator options and a collection; valid at any time.
    unsafe {
        if on {
            libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, 0);
        } else {
            libmimalloc_sys::mi_collect(true);
            libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, -1);
        }
    }
}

#[derive(Parser)]
#[command(
    name = "kiln",
    version,
    about = "Hugging Face Transformers training in Rust"
)]
pub struct Cli {
    /// Worker threads for the CPU backend (default: all cores).
    #[arg(long, global = true)]
    threads: Option<usize>,
    /// Where to run: cpu, cuda or cuda:N (CUDA needs a build with `--features cuda`).
    #[arg(long, global = true, default_value = "cpu")]
    device: String,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
pub enum Command {
    /// Train a model (--task): fine-tune a BERT-family encoder for sequence classification, train
    /// a causal LM (Llama, Mistral, Qwen2) from a checkpoint or from a config, or the MNIST MLP
    /// sample.
    Train(Box<train::TrainCmd>),
    /// Evaluate a fine-tuned model on labelled data.
    Eval(eval::EvalCmd),
    /// Classify texts with a fine-tuned model; JSON lines out.
    Predict(predict::PredictCmd),
    /// Fixed-shape step benchmarks, beside PyTorch measured in the same invocation.
    Bench(bench::BenchCmd),
    /// Data-parallel launcher (like torchrun): `kiln launch --nproc-per-node N -- train ...`.
    Launch(launch::LaunchCmd),
    /// Fill the GPU kernel cache by running the first steps of a training command, so the real run
    /// starts without compiling (like `neuron_parallel_compile`): `kiln --device cuda precompile -- train ...`.
    Precompile(precompile::PrecompileCmd),
    /// Convert model files into --out DIR: a llama.cpp GGUF file into a Hugging Face Llama folder
    /// (`--from-gguf FILE`), a Llama folder or checkpoint into N tensor-parallel shards (`--model
    /// DIR --to-tp N`), or shards back into one folder (`--model DIR --to-full`).
    Convert(convert::ConvertCmd),
    /// Continue a prompt with a causal LM (KV cache), streaming tokens to standard output.
    Generate(generate::GenerateCmd),
    /// Fold a LoRA adapter (a PEFT folder) into its base model: one Hugging Face folder out.
    Merge(merge::MergeCmd),
    /// Watch running training jobs: every rank's step, loss, rates, CPU, memory and time in
    /// collectives, live (`kiln top OUTPUT_DIR`, or every job on this machine).
    Top(top::TopCmd),
    /// Draw runs' training curves (loss, learning rate, evaluation metrics) into a PNG or SVG.
    Plot(plot::PlotCmd),
    /// The on-disk cache of compiled GPU kernels and autotune results.
    Cache {
        #[command(subcommand)]
        action: cache::CacheAction,
    },
}

fn run(mut cli: Cli, matches: &ArgMatches) -> Result<()> {
    resolve_hub_ids(&mut cli.command)?;
    let spec: DeviceSpec = cli.device.parse()?;
    // Only these run a model in this process; the others pass --device on or ignore it.
    if !matches!(
        cli.command,
        Command::Train(_)
            | Command::Eval(_)
            | Command::Predict(_)
            | Command::Generate(_)
            | Command::Bench(_)
    ) {
        // merge and convert compute on the host whatever --device says: a GPU asked for is
        // refused rather than silently unused. launch hands it to its workers.
        if spec != DeviceSpec::Cpu && matches!(cli.command, Command::Merge(_) | Command::Convert(_))
        {
            anyhow::bail!(
                "--device {}: `kiln {}` runs on the CPU only (it reads, adds and writes weights); \
                 leave --device out",
                cli.device,
                if matches!(cli.command, Command::Merge(_)) {
                    "merge"
                } else {
                    "convert"
                }
            );
        }
        return run_on::<Cpu>(cli, matches, &CpuDevice::default());
    }
    spec.check_available()?;
    // A bad KILN_CPU_ISA is one sentence here, before any kernel runs.
    let isa = kiln::ops::isa::init()?;
    tracing::debug!("{}", isa.describe());
    match spec {
        DeviceSpec::Cpu => run_on::<Cpu>(cli, matches, &CpuDevice::default()),
        #[cfg(feature = "cuda")]
        DeviceSpec::Cuda(index) => {
            // Under a launcher, plain `cuda` is this worker's own GPU (torchrun's LOCAL_RANK).
            let index = match std::env::var("LOCAL_RANK") {
                Ok(r) if !cli.device.contains(':') => r.trim().parse().unwrap_or(index),
                _ => index,
            };
            kiln::backend::init_kernel_cache()?;
            kiln::report::live::set_gpu_index(index as u32);
            let device = kiln::backend::CudaDevice::new(index);
            run_on::<kiln::backend::Cuda>(cli, matches, &device)
        }
        #[cfg(not(feature = "cuda"))]
        DeviceSpec::Cuda(_) => unreachable!("check_available rejects CUDA in this build"),
        #[cfg(feature = "wgpu")]
        DeviceSpec::Wgpu => {
            kiln::backend::init_kernel_cache()?;
            let device = kiln::backend::WgpuDevice::default();
            run_on::<kiln::backend::Wgpu>(cli, matches, &device)
        }
        #[cfg(not(feature = "wgpu"))]
        DeviceSpec::Wgpu => unreachable!("check_available rejects wgpu in this build"),
    }
}

/// Runs the command on backend `B` (training on `Autodiff<B>`).
fn run_on<B>(cli: Cli, matches: &ArgMatches, device: &B::Device) -> Result<()>
where
    B: kiln::ops::KilnBackend,
    Autodiff<B>: kiln::ops::TrainBackend<InnerBackend = B, Device = B::Device>,
{
    match cli.command {
        Command::Train(cmd) => train::run::<B>(&cmd, matches, &cli.device, device),
        Command::Eval(cmd) => eval::run::<B>(cmd, &cli.device, device, matches),
        Command::Bench(cmd) => bench::run::<B>(cmd, cli.threads, &cli.device, device),
        Command::Launch(cmd) => {
            // A kiln subcommand (`train ...`) runs this binary; anything else is a program.
            let kiln_command = |name: &str| Cli::command().find_subcommand(name).is_some();
            launch::run(cmd, &cli.device, &kiln_command)
        }
        Command::Precompile(cmd) => precompile::run(&cli.device, cli.threads, &cmd),
        Command::Convert(cmd) => convert::run(cmd),
        Command::Merge(cmd) => merge::run(cmd),
        Command::Generate(cmd) => generate::run::<B>(cmd, device),
        Command::Top(cmd) => top::run(cmd),
        Command::Plot(cmd) => plot::run(cmd),
        Command::Cache { action } => cache::run(action),
        Command::Predict(cmd) => predict::run::<B>(cmd, device),
    }
}

/// The exit status of a process that a closed pipe ended (128 + SIGPIPE), as a shell reports
/// `yes | head -1`'s `yes`.
const CLOSED_PIPE_EXIT: i32 = 141;

/// Whether kiln's standard output is a pipe whose reader has gone (`poll` reports an error
/// condition on its write end).
fn stdout_closed() -> bool {
    let mut fd = libc::pollfd {
        fd: libc::STDOUT_FILENO,
        events: libc::POLLOUT,
        revents: 0,
    };
    // SAFETY: one valid pollfd, no wait.
    let ready = unsafe { libc::poll(&mut fd, 1, 0) };
    ready > 0 && fd.revents & libc::POLLERR != 0
}

/// `kiln eval … | head -1`: a reader that closes kiln's standard output early ends kiln quietly,
/// as it ends any Unix tool, instead of in a panic about printing. Rust ignores SIGPIPE, so that
/// a write to a closed socket is an error the caller sees (how a worker learns that a peer is
/// gone, and names it), and `println!` then panics on EPIPE: that panic, where standard output
/// is indeed closed, becomes the exit.
fn quiet_exit_on_closed_stdout() {
    let report = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let payload = info.payload();
        let message = payload
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| payload.downcast_ref::<&str>().copied())
            .unwrap_or("");
        if message.starts_with("failed printing to stdout") && stdout_closed() {
            std::process::exit(CLOSED_PIPE_EXIT);
        }
        report(info)
    }));
}

/// Whether `e` is a broken pipe on kiln's own standard output (a command that writes its
/// results itself), not on a socket or a child's pipe, which stay errors that name them.
fn is_closed_stdout(e: &anyhow::Error) -> bool {
    let broken_pipe = e.chain().any(|c| {
        c.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
    });
    broken_pipe && stdout_closed()
}

fn main() -> ExitCode {
    quiet_exit_on_closed_stdout();
    keep_freed_memory();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("KILN_LOG")
                // burn-communication logs every tensor transfer of every all-reduce at info, and
                // both Burn crates log a dead peer's broken connections as errors: kiln reports
                // those itself, in one line naming the peer (KILN_LOG=debug shows Burn's view).
                // Ranks other than 0 log warnings and errors only, as transformers' Trainer
                // logs replicas (`log_level_replica` "warning"): rank 0 tells the run once.
                .unwrap_or_else(|_| {
                    let replica = std::env::var("RANK").is_ok_and(|r| r.trim() != "0");
                    tracing_subscriber::EnvFilter::new(format!(
                        "{},burn_communication=off,burn_collective=off",
                        if replica { "warn" } else { "info" }
                    ))
                }),
        )
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr)
        .with_target(false)
        .init();
    let (argv, hf_flags) = argv::prepare_os(std::env::args_os().collect(), &Cli::command());
    let matches = Cli::command().get_matches_from(argv);
    let mut cli = match Cli::from_arg_matches(&matches) {
        Ok(c) => c,
        Err(e) => e.exit(),
    };
    if let Command::Train(cmd) = &mut cli.command {
        cmd.hf_flags = hf_flags;
    }
    kiln::ops::init_threads(cli.threads);
    // KILN_PROFILE=1: time every fused kernel and print the table at exit (stderr).
    let profile = std::env::var_os("KILN_PROFILE").is_some();
    kiln::ops::profile::enable(profile);
    let result = kiln::ops::on_pool(|| run(cli, &matches));
    if profile {
        eprintln!("kernel profile (wall time, all calls):");
        for (name, calls, secs) in kiln::ops::profile::take() {
            eprintln!("  {name:<24} {calls:>8} calls {secs:>9.3} s");
        }
    }
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if is_closed_stdout(&e) => ExitCode::from(CLOSED_PIPE_EXIT as u8),
        Err(e) => {
            // Errors quote names from files, data and the network (columns, config keys, Hub
            // file names): their control characters and bidi overrides are escaped here, once,
            // for every error.
            eprintln!("error: {}", kiln::report::escape_for_terminal(&causes(&e)));
            ExitCode::FAILURE
        }
    }
}

/// Model, tokenizer and config arguments that name a Hub repo (`org/name[@revision]`) instead of
/// an existing path become the cached files' paths, downloaded first when needed.
fn resolve_hub_ids(command: &mut Command) -> Result<()> {
    use kiln::hub::remote::{resolve, Need};
    let tokenizer = |lm: &mut commands::data_opts::LmOpts| -> Result<()> {
        if let Some(t) = &mut lm.tokenizer {
            *t = resolve(t, Need::Tokenizer)?;
        }
        Ok(())
    };
    match command {
        Command::Train(c) if c.task != commands::train::Task::MnistMlp => {
            if let Some(m) = &mut c.model {
                *m = resolve(m, Need::Model)?;
            }
            if let Some(f) = &mut c.from_config {
                *f = resolve(f, Need::Config)?;
            }
            tokenizer(&mut c.lm)?;
        }
        Command::Eval(c) if c.task != commands::train::Task::MnistMlp => {
            c.model = resolve(&c.model, Need::Model)?;
            tokenizer(&mut c.lm)?;
        }
        Command::Predict(c) => c.model = resolve(&c.model, Need::Model)?,
        Command::Generate(c) => c.model = resolve(&c.model, Need::Model)?,
        Command::Merge(c) => c.model = resolve(&c.model, Need::Model)?,
        _ => {}
    }
    Ok(())
}

/// The error and its causes, `a: b: c`, each once: kiln's I/O errors already quote their cause in
/// their own message (`path: No such file or directory`), which `{:#}` would print a second time.
fn causes(e: &anyhow::Error) -> String {
    let mut out = e.to_string();
    for cause in e.chain().skip(1) {
        let c = cause.to_string();
        if !out.ends_with(&c) {
            out.push_str(": ");
            out.push_str(&c);
        }
    }
    out
}
