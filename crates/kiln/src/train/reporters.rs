//! Where a run's logs go, as `report_to` says: `log.jsonl` and TensorBoard event files (rank 0),
//! each rank's live state for `kiln top`, and, at the end, the curves and the model card.

use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use super::args::TrainingArguments;
use crate::error::{KilnError, Result};
use crate::report::live::{LivePublisher, Phase, StepReport};
use crate::report::model_card::{model_card, CardInput, CardTask};
use crate::report::tensorboard::{hf_scalars, EventWriter};

/// How a run reports besides its logs: the progress bar, `kiln top`'s live state, and where the
/// model and data came from (for the model card).
#[derive(Debug, Clone)]
pub struct Reporting {
    /// Whether to show a progress bar (rank 0, interactive).
    pub progress: bool,
    /// Whether every rank publishes its live state for `kiln top` (on by default).
    pub live_state: bool,
    /// The index of the GPU this rank trains on, for the live state's GPU figures (default: the
    /// one given to [`crate::report::live::set_gpu_index`]).
    pub gpu_index: Option<u32>,
    pub origin: RunOrigin,
}

impl Default for Reporting {
    fn default() -> Self {
        Self {
            progress: true,
            live_state: true,
            gpu_index: None,
            origin: RunOrigin::default(),
        }
    }
}

/// What the caller knows of a run's origin, for the model card.
#[derive(Debug, Clone, Default)]
pub struct RunOrigin {
    /// `--model` as given (a Hub id or a folder); `None` when trained from a config.
    pub base_model: Option<String>,
    pub base_model_on_hub: bool,
    /// The Hub dataset id, or the data files.
    pub dataset: Option<String>,
    /// The evaluation split's name, when there is one.
    pub eval_split: Option<String>,
    /// A causal language model (else sequence classification).
    pub causal_lm: bool,
}

impl RunOrigin {
    /// From the paths a run was given: a Hub cache path is named by its Hub id, a data file by
    /// its file name.
    pub fn from_paths(
        model: Option<&Path>,
        train: Option<&Path>,
        eval: Option<&Path>,
        causal_lm: bool,
    ) -> Self {
        use crate::hub::remote::cached_repo_id;
        let hub_model = model.and_then(cached_repo_id);
        let name = |p: &Path| {
            cached_repo_id(p).unwrap_or_else(|| {
                p.file_name()
                    .map_or_else(|| p.display().to_string(), |n| n.to_string_lossy().into())
            })
        };
        Self {
            base_model_on_hub: hub_model.is_some(),
            base_model: hub_model.or_else(|| model.map(|m| m.display().to_string())),
            dataset: train.map(name),
            eval_split: eval.map(name),
            causal_lm,
        }
    }
}

/// The loggers of one rank.
#[derive(Default)]
pub struct Reporters {
    jsonl: Option<PathBuf>,
    tensorboard: Option<EventWriter>,
    live: Option<LivePublisher>,
}

impl Reporters {
    /// Opens the loggers: files on rank 0 as `report_to` says, the live state on every rank
    /// when `live` is set (`gpu`: the index of this rank's GPU).
    pub fn open(
        args: &TrainingArguments,
        main: bool,
        (rank, world): (usize, usize),
        live: bool,
        gpu: Option<u32>,
    ) -> Result<Self> {
        let mut r = Self::default();
        if main && args.report_to.jsonl {
            r.jsonl = Some(args.output_dir.join("log.jsonl"));
        }
        if main && args.report_to.tensorboard {
            let dir = logging_dir(args);
            let mut w = EventWriter::create(&dir)?;
            // transformers' TensorBoardCallback records the arguments as text at the start.
            w.add_text("args", 0, &args.to_hf_json())?;
            tracing::info!("TensorBoard logs in {}", dir.display());
            r.tensorboard = Some(w);
        }
        if live {
            r.live = Some(LivePublisher::start(&args.output_dir, rank, world, gpu)?);
        }
        Ok(r)
    }

    /// One log entry (with its `step` and `epoch`): a log.jsonl line and TensorBoard scalars.
    pub fn log(&mut self, entry: &Map<String, Value>) -> Result<()> {
        if let Some(path) = &self.jsonl {
            use std::io::Write;
            let line = serde_json::to_string(entry).expect("json");
            let mut f = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
                .map_err(|e| KilnError::io(path, e))?;
            writeln!(f, "{line}").map_err(|e| KilnError::io(path, e))?;
        }
        if let Some(tb) = &mut self.tensorboard {
            let step = entry.get("step").and_then(Value::as_u64).unwrap_or(0);
            tb.add_scalars(step, &hf_scalars(entry))?;
        }
        Ok(())
    }

    /// Publishes a finished step (live state).
    pub fn step(&self, s: &StepReport) {
        if let Some(l) = &self.live {
            l.step(s);
        }
    }

    pub fn phase(&self, p: Phase) {
        if let Some(l) = &self.live {
            l.phase(p);
        }
    }

    pub fn started(&self, total: u64, step: u64) {
        if let Some(l) = &self.live {
            l.set_total_steps(total, step);
            l.phase(Phase::Training);
        }
    }

    pub fn fail(&self, error: &str) {
        if let Some(l) = &self.live {
            l.fail(error);
        }
    }

    /// Stops the loggers (the live state is written one last time).
    pub fn close(&mut self) {
        *self = Self::default();
    }
}

/// TensorBoard's folder: `logging_dir`, else `$TENSORBOARD_LOGGING_DIR` (transformers 5), else
/// `output_dir/runs/<start time>_<host>` as transformers names it. Never from `run_name`, as in
/// transformers: a run name is a label, and `../../x` or an absolute one would put the events
/// outside the output folder.
pub fn logging_dir(args: &TrainingArguments) -> PathBuf {
    if let Some(d) = &args.logging_dir {
        return d.clone();
    }
    if let Some(d) = std::env::var_os("TENSORBOARD_LOGGING_DIR").filter(|d| !d.is_empty()) {
        return PathBuf::from(d);
    }
    let host = crate::report::live::hostname().replace(['/', '\\', '\0'], "_");
    args.output_dir
        .join("runs")
        .join(format!("{}_{host}", local_time_label()))
}

/// The local time as transformers' `default_logdir` writes it: `Nov24_01-05-44`.
fn local_time_label() -> String {
    const MONTHS: [&str; 12] = [
        "Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec",
    ];
    // SAFETY: time and localtime_r write only into the values given to them.
    let tm = unsafe {
        let t = libc::time(std::ptr::null_mut());
        let mut tm: libc::tm = std::mem::zeroed();
        libc::localtime_r(&t, &mut tm);
        tm
    };
    format!(
        "{}{:02}_{:02}-{:02}-{:02}",
        MONTHS[tm.tm_mon.clamp(0, 11) as usize],
        tm.tm_mday,
        tm.tm_hour,
        tm.tm_min,
        tm.tm_sec
    )
}

/// The end of a run on rank 0: `training_curves.png` and the model card (`README.md`) in `dir`.
/// Neither is worth failing a finished run for: a problem is a warning.
pub fn write_run_summary(
    dir: &Path,
    args: &TrainingArguments,
    origin: &RunOrigin,
    world_size: usize,
    log_history: &[Map<String, Value>],
) {
    let history = crate::report::history::RunHistory {
        name: args.run_name.clone().unwrap_or_else(|| {
            dir.file_name()
                .map_or_else(|| dir.display().to_string(), |n| n.to_string_lossy().into())
        }),
        dir: dir.to_path_buf(),
        entries: log_history.to_vec(),
    };
    let curves = dir.join("training_curves.png");
    if let Err(e) = crate::report::plot::plot_runs(&[history], &curves) {
        tracing::warn!("{} not drawn: {e}", curves.display());
    }
    let name = dir
        .file_name()
        .map_or_else(|| "model".to_string(), |n| n.to_string_lossy().into());
    let card = model_card(&CardInput {
        model_name: name,
        base_model: origin.base_model.clone(),
        base_model_on_hub: origin.base_model_on_hub,
        dataset: origin.dataset.clone(),
        dataset_split: origin.eval_split.clone(),
        task: if origin.causal_lm {
            CardTask::TextGeneration
        } else {
            CardTask::TextClassification
        },
        hyperparameters: super::card_hyperparameters::card_hyperparameters(args, world_size),
        log_history,
    });
    let path = dir.join("README.md");
    if let Err(e) = crate::io::atomic_write(&path, card.as_bytes()) {
        tracing::warn!("model card not written: {e}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn logging_dir_follows_transformers() {
        let mut a = TrainingArguments {
            output_dir: "out".into(),
            ..TrainingArguments::default()
        };
        // A run name is a label, not a folder: `../../x` stays inside the output folder.
        a.run_name = Some("../../x".into());
        let dir = logging_dir(&a);
        assert_eq!(
            dir.parent(),
            Some(Path::new("out/runs")),
            "{}",
            dir.display()
        );
        a.logging_dir = Some("tb".into());
        assert_eq!(logging_dir(&a), PathBuf::from("tb"));
        let label = local_time_label();
        // "Nov24_01-05-44": a month, the day, then time with dashes.
        assert_eq!(label.len(), 14, "{label}");
        assert_eq!(&label[5..6], "_");
    }
}
