//! `kiln eval`: a model's metrics on labelled data (text classification, causal LM, reward model,
//! MNIST).

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;
use kiln::tasks::causal_lm;
use kiln::tasks::text_classification as tc;

use super::data_opts::{DataOpts, LmOpts};
use super::train::Task;

#[derive(Args)]
pub struct EvalCmd {
    /// What the model is: text-classification, causal-lm, reward-modeling or mnist-mlp (as in
    /// `train`).
    #[arg(long, default_value = "text-classification", help_heading = "Model")]
    pub task: Task,
    /// The model folder to evaluate (a `kiln train` output or checkpoint, any HF folder, a Hub id).
    #[arg(long, help_heading = "Model")]
    pub model: PathBuf,
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
    /// The model's decoder layers cut into N stages on N processes (`kiln launch`), each
    /// batch flowing through them, as in training (causal-lm).
    #[arg(long, default_value_t = 1, help_heading = "Parallelism")]
    pipeline_parallel_size: usize,
    /// Where stages 1, 2, … begin, as decoder-layer indices (as in training).
    #[arg(long, help_heading = "Parallelism")]
    pipeline_cuts: Option<String>,
    /// Also write the metrics and the per-class report here (JSON).
    #[arg(long, help_heading = "Evaluation")]
    output: Option<PathBuf>,
    #[command(flatten)]
    pub lm: LmOpts,
}

/// `device_arg`: the global --device; `matches`: the command line's.
pub fn run<B: kiln::ops::KilnBackend>(
    cmd: EvalCmd,
    device_arg: &str,
    device: &B::Device,
    matches: &clap::ArgMatches,
) -> Result<()> {
    if cmd.task == Task::MnistMlp {
        kiln::tasks::mnist::eval::<B>(
            &cmd.model,
            &cmd.data_dir,
            cmd.per_device_eval_batch_size,
            device,
        )?;
        return Ok(());
    }
    if matches!(cmd.task, Task::CausalLm | Task::RewardModeling) {
        let mut opts = cmd
            .data
            .lm_options(None, &cmd.lm, Some(cmd.model.clone()), None)?;
        if cmd.task == Task::RewardModeling {
            let given = matches
                .subcommand_matches("eval")
                .and_then(|m| m.value_source("max_length"))
                == Some(clap::parser::ValueSource::CommandLine);
            let max_length = given.then(|| cmd.data.max_length());
            opts.reward = Some(
                super::dpo_opts::DpoOpts::default()
                    .reward(max_length, cmd.data.pad_to_multiple_of())?,
            );
        }
        let layout = causal_lm::InferenceLayout::from_args(
            cmd.tensor_parallel_size,
            cmd.pipeline_parallel_size,
            cmd.pipeline_cuts.as_deref(),
        )?;
        let (out, reports) =
            causal_lm::eval_layout::<B>(&opts, cmd.per_device_eval_batch_size, &layout, device)?;
        // The world's first rank writes the result (under a pipeline, the last stage sent it there).
        if !reports {
            return Ok(());
        }
        if let Some(path) = &cmd.output {
            std::fs::write(path, serde_json::to_vec_pretty(&out.metrics)?)
                .with_context(|| format!("{}", path.display()))?;
        }
        println!("{}", serde_json::to_string_pretty(&out.metrics)?);
        return Ok(());
    }
    if cmd.tensor_parallel_size > 1 || cmd.pipeline_parallel_size > 1 {
        bail!(
            "--tensor-parallel-size and --pipeline-parallel-size: only --task causal-lm and \
             reward-modeling are cut over processes"
        );
    }
    let opts = cmd
        .data
        .options(None, &cmd.model, 42, device_arg.parse()?)?;
    let out = tc::eval::<B>(&opts, cmd.per_device_eval_batch_size, device)?;
    let json = serde_json::json!({"metrics": out.metrics, "report": out.report});
    if let Some(path) = &cmd.output {
        std::fs::write(path, serde_json::to_vec_pretty(&json)?)
            .with_context(|| format!("{}", path.display()))?;
    }
    println!("{}", serde_json::to_string_pretty(&out.metrics)?);
    if let Some(r) = out.report {
        print_class_report(&r);
    }
    Ok(())
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
