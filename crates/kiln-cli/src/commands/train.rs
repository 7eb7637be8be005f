//! `kiln train`: fine-tunes a text classifier, trains a causal LM, or runs the MNIST MLP sample.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::{ArgMatches, Args};
use kiln::backend::Autodiff;
use kiln::tasks::causal_lm;
use kiln::tasks::text_classification as tc;
use kiln::train::{ArgLayers, TrainingArguments};

use super::data_opts::{DataOpts, LmOpts, TrainData};
use super::dpo_opts::DpoOpts;
use super::lora_opts::LoraOpts;
use super::sft_opts::SftOpts;

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Task {
    TextClassification,
    MnistMlp,
    CausalLm,
    /// Supervised fine-tuning of a causal LM on TRL's formats (prompt/completion, messages).
    Sft,
    /// Direct preference optimisation of a causal LM on prompt/chosen/rejected rows (TRL's DPO).
    Dpo,
    /// Odds-ratio preference optimisation on the same rows (TRL's ORPO, optimum-neuron's).
    Orpo,
    /// A reward model (a one-label sequence classifier on a Llama-family model) trained on
    /// chosen/rejected pairs (TRL's RewardTrainer).
    RewardModeling,
}

#[derive(Args)]
pub struct TrainCmd {
    /// The transformers flags the command line's pre-pass took out (hf_flags.rs): not a flag.
    #[arg(skip)]
    pub hf_flags: crate::hf_flags::HfFlags,
    /// What to train: `text-classification` (a BERT-family model folder and labelled text),
    /// `causal-lm` (a Llama-family model and a text corpus, packed into --block-size blocks),
    /// `sft` (a Llama-family model on TRL's prompt/completion, messages or text rows, with the
    /// model's chat template), `dpo` or `orpo` (the same models on TRL's prompt/chosen/rejected
    /// preference rows), `reward-modeling` (a reward model from such rows, saved as
    /// `LlamaForSequenceClassification`) or `mnist-mlp` (the AWS Neuron MNIST MLP sample on IDX
    /// files in --data-dir).
    #[arg(long, default_value = "text-classification", help_heading = "Model")]
    pub task: Task,
    /// A Hugging Face model folder (config.json, model.safetensors, tokenizer.json), or a Hub id
    /// (`bert-base-uncased`, `org/name@revision`) fetched into the Hugging Face cache.
    #[arg(
        long,
        alias = "model-name-or-path",
        required_if_eq("task", "text-classification"),
        help_heading = "Model"
    )]
    pub model: Option<PathBuf>,
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
    pub lm: LmOpts,
    #[command(flatten)]
    lora: LoraOpts,
    #[command(flatten)]
    sft: SftOpts,
    #[command(flatten)]
    dpo: DpoOpts,
    /// Start from random weights with this config.json (or a Hub id's; pretraining from scratch).
    #[arg(long, help_heading = "Causal LM")]
    pub from_config: Option<PathBuf>,
}

/// `matches`: the whole command line's; `device_arg`: the global --device.
pub fn run<B>(
    cmd: &TrainCmd,
    matches: &ArgMatches,
    device_arg: &str,
    device: &B::Device,
) -> Result<()>
where
    B: kiln::ops::KilnBackend,
    Autodiff<B>: kiln::ops::TrainBackend<InnerBackend = B, Device = B::Device>,
{
    let sub = matches.subcommand_matches("train").expect("train matches");
    cmd.lora.base_dtype()?;
    if cmd.task == Task::MnistMlp {
        if cmd.lora.setup()?.is_some() {
            bail!(
                "LoRA (--use-peft, --lora-*, --adapter) adapts Transformers models, not the MNIST MLP"
            );
        }
        let world = kiln::parallel::world_size_from_env()?;
        let defaults = kiln::tasks::mnist::sample_defaults(world);
        let args = merged_training_args(cmd, sub, defaults)?;
        if args.label_smoothing_factor != 0.0 {
            bail!("label_smoothing_factor is implemented for text classification only");
        }
        kiln::tasks::mnist::train::<Autodiff<B>>(&cmd.data_dir, args, device)?;
        return Ok(());
    }
    // TRL's DPOConfig and ORPOConfig train at 1e-6 unless told otherwise.
    let preference = matches!(cmd.task, Task::Dpo | Task::Orpo);
    let task_defaults = match cmd.task {
        Task::Dpo | Task::Orpo => serde_json::json!({"learning_rate": 1e-6}),
        // TRL's RewardConfig.
        Task::RewardModeling => serde_json::json!({"learning_rate": 1e-4}),
        _ => serde_json::json!({}),
    };
    let serde_json::Value::Object(task_defaults) = task_defaults else {
        unreachable!("an object")
    };
    let args = merged_training_args(cmd, sub, task_defaults)?;
    let is_main = kiln::parallel::is_main_process()?;
    if cmd.task != Task::TextClassification && args.label_smoothing_factor != 0.0 {
        bail!("label_smoothing_factor is implemented for text classification only");
    }
    let lora = cmd.lora.setup()?;
    if cmd.task != Task::Sft && cmd.sft.any() {
        bail!(
            "--completion-only-loss, --assistant-only-loss and --packing are options of --task sft"
        );
    }
    if cmd.task != Task::RewardModeling && cmd.dpo.any_reward() {
        bail!("--center-rewards-coefficient is an option of --task reward-modeling");
    }
    if !preference && cmd.task != Task::RewardModeling && cmd.dpo.any() {
        bail!(
            "--beta, --loss-type and --precompute-ref-log-probs are options of --task dpo (and \
             --beta of --task orpo)"
        );
    }
    if preference || matches!(cmd.task, Task::CausalLm | Task::Sft | Task::RewardModeling) {
        let mut opts = cmd.data.lm_options(
            Some(&cmd.train_data),
            &cmd.lm,
            cmd.model.clone(),
            cmd.from_config.clone(),
        )?;
        opts.lora = lora;
        opts.lora_base_dtype = cmd.lora.base_dtype()?;
        let given = sub.value_source("max_length") == Some(clap::parser::ValueSource::CommandLine);
        let max_length = given.then(|| cmd.data.max_length());
        if cmd.task == Task::RewardModeling {
            opts.reward = Some(cmd.dpo.reward(max_length, cmd.data.pad_to_multiple_of())?);
        } else if preference {
            opts.dpo = Some(cmd.dpo.data(
                cmd.task == Task::Orpo,
                max_length,
                cmd.data.pad_to_multiple_of(),
            )?);
        } else if cmd.task == Task::Sft {
            opts.sft = Some(cmd.sft.data(
                max_length,
                cmd.data.text_column(),
                cmd.data.pad_to_multiple_of(),
            )?);
        } else if cmd.data.pad_to_multiple_of().is_some() {
            bail!("--pad-to-multiple-of: --task causal-lm cuts its corpus into --block-size blocks, so nothing is padded (it is an option of text-classification and sft)");
        }
        let (out, eval) = causal_lm::train::<Autodiff<B>>(&opts, args, device)?;
        if is_main {
            println!("{}", serde_json::to_string_pretty(&out.metrics)?);
            if let Some(ev) = eval {
                println!("{}", serde_json::to_string_pretty(&ev.metrics)?);
            }
        }
        return Ok(());
    }
    let model = cmd.model.clone().context("--model is required")?;
    let mut opts = cmd.data.options(
        Some(&cmd.train_data),
        &model,
        args.seed,
        device_arg.parse()?,
    )?;
    opts.lora = lora;
    opts.lora_base_dtype = cmd.lora.base_dtype()?;
    let loss = kiln::train::LabelSmoothedCrossEntropy {
        epsilon: args.label_smoothing_factor,
    };
    let (out, eval) = tc::train::<Autodiff<B>, _>(&opts, args, device, loss, |t| t)?;
    if kiln::parallel::is_main_process()? {
        println!("{}", serde_json::to_string_pretty(&out.metrics)?);
        if let Some(ev) = eval {
            println!("{}", serde_json::to_string_pretty(&ev.metrics)?);
        }
    }
    Ok(())
}

/// TrainingArguments from, lowest priority first: the task's defaults, the `--config` file,
/// transformers flags without a clap option of their own (hf_flags.rs), and the flags given on
/// the command line ([`ArgLayers`]).
fn merged_training_args(
    cmd: &TrainCmd,
    matches: &ArgMatches,
    task_defaults: serde_json::Map<String, serde_json::Value>,
) -> Result<TrainingArguments> {
    let mut layers = ArgLayers::new(cmd.ignore_unknown_args).defaults(task_defaults);
    if let Some(path) = &cmd.config {
        layers = layers.file(path)?;
    }
    for flag in &cmd.hf_flags.ignored {
        tracing::warn!("unknown flag {flag}: ignored (--ignore-unknown-args)");
    }
    layers = layers.named(cmd.hf_flags.entries.clone(), "the command line")?;
    let serde_json::Value::Object(flags) = serde_json::to_value(&cmd.args)? else {
        bail!("training arguments are not an object");
    };
    let given = flags.into_iter().filter(|(key, _)| {
        matches.value_source(key) == Some(clap::parser::ValueSource::CommandLine)
    });
    let mut args = layers.set(given).build()?;
    args.precompile_shapes = cmd.precompile_shapes;
    Ok(args)
}
