//! A run's logged entries read back: kiln's `log.jsonl` (one JSON object a line, appended while
//! training), or the `log_history` of a `trainer_state.json` that Hugging Face's Trainer (or kiln)
//! wrote, so that runs of either can be compared and plotted.

use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use crate::error::{KilnError, Result};

/// The `eval_*` keys that are timings, not metrics.
const EVAL_NON_METRICS: &[&str] = &[
    "eval_runtime",
    "eval_samples_per_second",
    "eval_steps_per_second",
    "eval_jit_compilation_time",
    "eval_model_preparation_time",
];

/// The logged entries of one run.
#[derive(Debug, Clone)]
pub struct RunHistory {
    /// Legend label: the run folder's file name (or its path if that is empty).
    pub name: String,
    pub dir: PathBuf,
    pub entries: Vec<Map<String, Value>>,
}

impl RunHistory {
    /// `dir/log.jsonl` (kiln writes one JSON object per line while training), else
    /// `dir/trainer_state.json`'s `log_history` (what Hugging Face's Trainer writes), else the
    /// newest `dir/checkpoint-N/trainer_state.json`.
    ///
    /// A `log.jsonl` being written may end in a line cut short: an unparsable last line is skipped
    /// when the file does not end with a newline. Any other bad line is an error naming the line.
    pub fn read(dir: &Path) -> Result<Self> {
        let name = run_name(dir).unwrap_or_else(|| match dir.file_name() {
            Some(n) if !n.is_empty() => n.to_string_lossy().into_owned(),
            _ => dir.display().to_string(),
        });
        let log = dir.join("log.jsonl");
        let state = dir.join("trainer_state.json");
        let entries = if log.is_file() {
            read_jsonl(&log)?
        } else if state.is_file() {
            read_trainer_state(&state)?
        } else if let Some(ck) = newest_checkpoint_state(dir) {
            read_trainer_state(&ck)?
        } else if !dir.is_dir() {
            return Err(KilnError::Data(format!(
                "{}: no such run folder (it should hold log.jsonl or trainer_state.json)",
                dir.display()
            )));
        } else {
            return Err(KilnError::Data(format!(
                "{}: no logged history found: looked for log.jsonl, trainer_state.json and \
                 checkpoint-N/trainer_state.json",
                dir.display()
            )));
        };
        Ok(Self {
            name,
            dir: dir.to_path_buf(),
            entries,
        })
    }

    /// (step, value) pairs of the entries that have both `step` and a finite numeric `key`, in
    /// step order. Where a step was logged twice (a resumed run appends to its log), the later
    /// entry wins.
    pub fn series(&self, key: &str) -> Vec<(u64, f64)> {
        let mut points: Vec<(u64, f64)> = self
            .entries
            .iter()
            .filter_map(|e| Some((step_of(e)?, finite(e.get(key)?)?)))
            .collect();
        // A stable sort keeps equal steps in log order; then keep the last of each step.
        points.sort_by_key(|&(s, _)| s);
        let mut out: Vec<(u64, f64)> = Vec::with_capacity(points.len());
        for p in points {
            match out.last_mut() {
                Some(last) if last.0 == p.0 => *last = p,
                _ => out.push(p),
            }
        }
        out
    }

    /// The evaluation metrics present (`eval_*` keys with a numeric value that are metrics, not
    /// timings such as `eval_runtime`), sorted, `eval_loss` first.
    pub fn eval_metrics(&self) -> Vec<String> {
        let mut keys: Vec<String> = self
            .entries
            .iter()
            .flat_map(|e| e.iter())
            .filter(|(k, v)| {
                k.starts_with("eval_")
                    && !EVAL_NON_METRICS.contains(&k.as_str())
                    && finite(v).is_some()
            })
            .map(|(k, _)| k.clone())
            .collect();
        keys.sort_by(|a, b| (a != "eval_loss", a).cmp(&(b != "eval_loss", b)));
        keys.dedup();
        keys
    }
}

/// The optimizer step of an entry: an integer, or a whole non-negative float.
fn step_of(entry: &Map<String, Value>) -> Option<u64> {
    let v = entry.get("step")?;
    v.as_u64().or_else(|| {
        let f = v.as_f64()?;
        (f >= 0.0 && f.fract() == 0.0 && f < u64::MAX as f64).then_some(f as u64)
    })
}

fn finite(v: &Value) -> Option<f64> {
    v.as_f64().filter(|f| f.is_finite())
}

/// The run's `run_name` from its `training_args.json`, when one was chosen (transformers'
/// older default, the output folder itself, is not a name).
fn run_name(dir: &Path) -> Option<String> {
    let text = std::fs::read_to_string(dir.join("training_args.json")).ok()?;
    let args: Value = serde_json::from_str(&text).ok()?;
    let name = args.get("run_name")?.as_str()?;
    let output_dir = args.get("output_dir").and_then(Value::as_str);
    (!name.is_empty() && Some(name) != output_dir).then(|| name.to_string())
}

fn read_jsonl(path: &Path) -> Result<Vec<Map<String, Value>>> {
    let bytes = std::fs::read(path).map_err(|e| KilnError::io(path, e))?;
    let complete = bytes.ends_with(b"\n");
    let lines: Vec<&[u8]> = bytes.split(|&b| b == b'\n').collect();
    // `split` yields an empty piece after a final newline; the real last line is before it.
    let last = if complete {
        lines.len().saturating_sub(2)
    } else {
        lines.len() - 1
    };
    let mut entries = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let parsed = std::str::from_utf8(line)
            .map_err(|e| format!("not UTF-8: {e}"))
            .and_then(|text| {
                if text.trim().is_empty() {
                    return Ok(None);
                }
                match serde_json::from_str::<Value>(text) {
                    Ok(Value::Object(m)) => Ok(Some(m)),
                    Ok(other) => Err(format!("not a JSON object: found {}", kind(&other))),
                    Err(e) => Err(format!("not a JSON object: {e}")),
                }
            });
        match parsed {
            Ok(Some(m)) => entries.push(m),
            Ok(None) => {}
            // Cut short while the run writes it: the rest of the line is still to come.
            Err(_) if i == last && !complete => {}
            Err(msg) => {
                return Err(KilnError::Data(format!(
                    "{} line {}: {msg}",
                    path.display(),
                    i + 1
                )))
            }
        }
    }
    Ok(entries)
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

fn read_trainer_state(path: &Path) -> Result<Vec<Map<String, Value>>> {
    let text = std::fs::read_to_string(path).map_err(|e| KilnError::io(path, e))?;
    let state: Value = serde_json::from_str(&text).map_err(|e| {
        KilnError::Data(format!(
            "{} line {}: not valid JSON: {e}",
            path.display(),
            e.line()
        ))
    })?;
    let Some(history) = state.get("log_history") else {
        return Err(KilnError::Data(format!(
            "{}: no `log_history` list in it",
            path.display()
        )));
    };
    let Some(list) = history.as_array() else {
        return Err(KilnError::Data(format!(
            "{}: `log_history` is {}, not a list",
            path.display(),
            kind(history)
        )));
    };
    list.iter()
        .enumerate()
        .map(|(i, v)| match v {
            Value::Object(m) => Ok(m.clone()),
            other => Err(KilnError::Data(format!(
                "{}: log_history[{i}] is {}, not a JSON object",
                path.display(),
                kind(other)
            ))),
        })
        .collect()
}

/// `dir/checkpoint-N/trainer_state.json` of the highest N that has one.
fn newest_checkpoint_state(dir: &Path) -> Option<PathBuf> {
    std::fs::read_dir(dir)
        .ok()?
        .filter_map(|e| {
            let e = e.ok()?;
            let step: u64 = e
                .file_name()
                .to_str()?
                .strip_prefix("checkpoint-")?
                .parse()
                .ok()?;
            let state = e.path().join("trainer_state.json");
            state.is_file().then_some((step, state))
        })
        .max_by_key(|(step, _)| *step)
        .map(|(_, state)| state)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn write(path: &Path, text: &str) {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, text).unwrap();
    }

    const LOG: &str = concat!(
        r#"{"learning_rate":4.9e-5,"loss":0.69,"grad_norm":3.1,"step":10,"epoch":0.1}"#,
        "\n",
        r#"{"learning_rate":4.8e-5,"loss":0.61,"grad_norm":2.9,"step":20,"epoch":0.2}"#,
        "\n",
        r#"{"eval_loss":0.5,"eval_accuracy":0.8,"eval_f1":0.79,"eval_runtime":1.2,"eval_samples_per_second":100.0,"eval_steps_per_second":5.0,"step":20,"epoch":0.2}"#,
        "\n",
        r#"{"train_runtime":12.5,"train_loss":0.65,"total_flos":1000.0,"step":20,"epoch":0.2}"#,
        "\n",
    );

    #[test]
    fn reads_log_jsonl() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("run-a");
        write(&dir.join("log.jsonl"), LOG);
        // log.jsonl wins over trainer_state.json.
        write(&dir.join("trainer_state.json"), r#"{"log_history":[]}"#);
        let h = RunHistory::read(&dir).unwrap();
        assert_eq!(h.name, "run-a");
        assert_eq!(h.dir, dir);
        assert_eq!(h.entries.len(), 4);
        assert_eq!(h.series("loss"), vec![(10, 0.69), (20, 0.61)]);
        assert_eq!(h.series("eval_f1"), vec![(20, 0.79)]);
        assert_eq!(h.series("missing"), vec![]);
        assert_eq!(
            h.eval_metrics(),
            vec!["eval_loss", "eval_accuracy", "eval_f1"]
        );
    }

    #[test]
    fn series_sorts_by_step_skips_nonfinite_and_keeps_the_last_of_a_step() {
        let h = RunHistory {
            name: "x".into(),
            dir: PathBuf::from("x"),
            entries: [
                json!({"loss": 3.0, "step": 30}),
                json!({"loss": 1.0, "step": 10}),
                json!({"loss": "nan", "step": 15}),
                json!({"loss": 9.0}),
                json!({"loss": 2.0, "step": 20.0}),
                // A resumed run logs step 30 again: the later entry wins.
                json!({"loss": 2.5, "step": 30}),
                json!({"eval_perplexity": 12.0, "eval_runtime": 1.0, "step": 30}),
                json!({"eval_loss": 2.4, "step": 30}),
            ]
            .into_iter()
            .map(|v| v.as_object().unwrap().clone())
            .collect(),
        };
        assert_eq!(h.series("loss"), vec![(10, 1.0), (20, 2.0), (30, 2.5)]);
        assert_eq!(h.eval_metrics(), vec!["eval_loss", "eval_perplexity"]);
    }

    #[test]
    fn reads_trainer_state_log_history() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("hf-run");
        let state = json!({
            "global_step": 20,
            "log_history": [
                {"loss": 0.7, "learning_rate": 5e-5, "step": 10, "epoch": 0.5},
                {"eval_loss": 0.6, "eval_matthews_correlation": 0.3, "eval_runtime": 2.0, "step": 20, "epoch": 1.0},
            ],
        });
        write(&dir.join("trainer_state.json"), &state.to_string());
        let h = RunHistory::read(&dir).unwrap();
        assert_eq!(h.entries.len(), 2);
        assert_eq!(h.series("learning_rate"), vec![(10, 5e-5)]);
        assert_eq!(
            h.eval_metrics(),
            vec!["eval_loss", "eval_matthews_correlation"]
        );
    }

    #[test]
    fn reads_the_newest_checkpoint() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("run");
        let state = |step: u64| json!({"log_history": [{"loss": 1.0, "step": step}]}).to_string();
        write(&dir.join("checkpoint-9/trainer_state.json"), &state(9));
        write(&dir.join("checkpoint-100/trainer_state.json"), &state(100));
        write(&dir.join("checkpoint-20/trainer_state.json"), &state(20));
        // Neither a checkpoint without a state nor a look-alike folder counts.
        std::fs::create_dir_all(dir.join("checkpoint-500")).unwrap();
        write(&dir.join("checkpoint-x/trainer_state.json"), &state(7));
        let h = RunHistory::read(&dir).unwrap();
        assert_eq!(h.series("loss"), vec![(100, 1.0)]);
    }

    #[test]
    fn a_cut_short_last_line_is_skipped() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("live");
        write(
            &dir.join("log.jsonl"),
            &format!("{LOG}{}", r#"{"loss":0.5,"st"#),
        );
        let h = RunHistory::read(&dir).unwrap();
        assert_eq!(h.entries.len(), 4);
        // A complete last line without its newline yet is kept.
        write(
            &dir.join("log.jsonl"),
            &format!("{LOG}{}", r#"{"loss":0.5,"step":30}"#),
        );
        let h = RunHistory::read(&dir).unwrap();
        assert_eq!(h.series("loss").last(), Some(&(30, 0.5)));
    }

    #[test]
    fn a_bad_line_is_an_error_naming_it() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("bad");
        // A bad middle line.
        let mut lines: Vec<&str> = LOG.lines().collect();
        lines.insert(2, r#"{"loss":0.5,"st"#);
        write(&dir.join("log.jsonl"), &(lines.join("\n") + "\n"));
        let e = RunHistory::read(&dir).unwrap_err().to_string();
        assert!(e.contains("log.jsonl line 3: not a JSON object"), "{e}");
        // A bad last line that ends with its newline was written whole: an error too.
        write(&dir.join("log.jsonl"), &format!("{LOG}[1, 2]\n"));
        let e = RunHistory::read(&dir).unwrap_err().to_string();
        assert!(
            e.contains("log.jsonl line 5: not a JSON object: found an array"),
            "{e}"
        );
    }

    #[test]
    fn no_history_says_what_was_looked_for() {
        let tmp = tempfile::tempdir().unwrap();
        let e = RunHistory::read(tmp.path()).unwrap_err().to_string();
        assert!(e.contains("log.jsonl"), "{e}");
        assert!(e.contains("trainer_state.json"), "{e}");
        assert!(e.contains("checkpoint-N/trainer_state.json"), "{e}");
        let e = RunHistory::read(&tmp.path().join("nope"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("no such run folder"), "{e}");
        // A trainer_state.json without a log_history says so.
        write(&tmp.path().join("trainer_state.json"), "{}");
        let e = RunHistory::read(tmp.path()).unwrap_err().to_string();
        assert!(e.contains("log_history"), "{e}");
    }
}
