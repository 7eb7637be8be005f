//! A run's logged entries read back: kiln's `log.jsonl` (one JSON object a line, appended while
//! training), or the `log_history` of a `trainer_state.json` that Hugging Face's Trainer (or kiln)
//! wrote, so that runs of either can be compared and plotted.
//!
//! A log can be large (a million steps logged one by one is over 100 MB), so it is streamed, and
//! only what the plots draw is kept: the step and the finite values of `loss`, `learning_rate`
//! and the `eval_*` metrics, at most [`MAX_POINTS`] points per quantity. Reading a 117 MB log
//! whole, as JSON maps, used to take 2 GB of memory.

use std::collections::BTreeMap;
use std::fmt;
use std::io::{BufRead, Read};
use std::path::{Path, PathBuf};

use serde::de::{self, DeserializeSeed, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;
use serde_json::{Map, Value};

use super::live::{open_regular, read_regular};
use crate::error::{json_kind, KilnError, Result};

/// Points kept per quantity. Beyond it, each run of consecutive points keeps its first, last,
/// lowest and highest: 2,048 runs per curve, several per pixel of a 600-pixel-wide panel, so the
/// drawn curve is the same, spikes included.
pub const MAX_POINTS: usize = 8192;
/// The longest log line read: kiln's and the Trainer's lines are well under a kilobyte, and a
/// line is parsed whole.
pub const MAX_LINE_BYTES: usize = 1 << 20;
/// `training_args.json` is a few kilobytes.
const ARGS_MAX_BYTES: u64 = 1 << 20;

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
    /// when the file does not end with a newline. Any other bad line is an error naming the line,
    /// as is a line over [`MAX_LINE_BYTES`] or a file that is not a regular one (a FIFO, a
    /// device). The entries kept are those the plots draw (see the module's notes): one per
    /// step, with the step and the values logged for it.
    pub fn read(dir: &Path) -> Result<Self> {
        let name = run_name(dir).unwrap_or_else(|| match dir.file_name() {
            Some(n) if !n.is_empty() => n.to_string_lossy().into_owned(),
            _ => dir.display().to_string(),
        });
        let log = dir.join("log.jsonl");
        let state = dir.join("trainer_state.json");
        // `exists`, not `is_file`: a FIFO or a device named log.jsonl is an error naming it.
        let entries = if log.exists() {
            read_jsonl(&log)?
        } else if state.exists() {
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
    let bytes = read_regular(&dir.join("training_args.json"), ARGS_MAX_BYTES, true).ok()?;
    let args: Value = serde_json::from_slice(&bytes).ok()?;
    let name = args.get("run_name")?.as_str()?;
    let output_dir = args.get("output_dir").and_then(Value::as_str);
    (!name.is_empty() && Some(name) != output_dir).then(|| name.to_string())
}

/// Whether the plots draw `key` (see [`RunHistory::eval_metrics`] and the plot's panels).
fn plotted(key: &str) -> bool {
    key == "loss"
        || key == "learning_rate"
        || (key.starts_with("eval_") && !EVAL_NON_METRICS.contains(&key))
}

/// The points of each plotted quantity, as the entries stream by.
#[derive(Default)]
struct Collector {
    series: BTreeMap<String, Vec<(u64, f64)>>,
}

impl Collector {
    fn add(&mut self, step: u64, key: &str, value: f64) {
        let points = match self.series.get_mut(key) {
            Some(p) => p,
            None => self.series.entry(key.to_string()).or_default(),
        };
        points.push((step, value));
        if points.len() >= 2 * MAX_POINTS {
            compact(points);
        }
    }

    fn add_entry(&mut self, entry: &Map<String, Value>) {
        let Some(step) = step_of(entry) else {
            return;
        };
        for (key, v) in entry {
            if let Some(v) = finite(v).filter(|_| plotted(key)) {
                self.add(step, key, v);
            }
        }
    }

    /// One entry per step, in step order, holding the values kept for it.
    fn finish(self) -> Vec<Map<String, Value>> {
        let mut by_step: BTreeMap<u64, Map<String, Value>> = BTreeMap::new();
        for (key, mut points) in self.series {
            compact(&mut points);
            for (step, v) in points {
                by_step
                    .entry(step)
                    .or_default()
                    .insert(key.clone(), v.into());
            }
        }
        by_step
            .into_iter()
            .map(|(step, mut m)| {
                m.insert("step".into(), step.into());
                m
            })
            .collect()
    }
}

/// Sorts by step keeping the last value logged for a step (a resumed run logs its steps again),
/// then thins the points to at most [`MAX_POINTS`].
fn compact(points: &mut Vec<(u64, f64)>) {
    // A stable sort keeps equal steps in log order; then keep the last of each step.
    points.sort_by_key(|&(s, _)| s);
    let mut kept: Vec<(u64, f64)> = Vec::with_capacity(points.len());
    for &p in points.iter() {
        match kept.last_mut() {
            Some(last) if last.0 == p.0 => *last = p,
            _ => kept.push(p),
        }
    }
    if kept.len() > MAX_POINTS {
        kept = thin(&kept);
    }
    *points = kept;
}

/// The first, lowest, highest and last point of each of `MAX_POINTS / 4` runs of consecutive
/// points: the envelope a line through all of them draws.
fn thin(points: &[(u64, f64)]) -> Vec<(u64, f64)> {
    let runs = MAX_POINTS / 4;
    let n = points.len();
    let mut kept = Vec::with_capacity(MAX_POINTS);
    for r in 0..runs {
        let run = &points[r * n / runs..(r + 1) * n / runs];
        if run.is_empty() {
            continue;
        }
        let by_value =
            |a: &(usize, &(u64, f64)), b: &(usize, &(u64, f64))| a.1 .1.total_cmp(&b.1 .1);
        let lo = run.iter().enumerate().min_by(by_value).map_or(0, |m| m.0);
        let hi = run.iter().enumerate().max_by(by_value).map_or(0, |m| m.0);
        let mut picks = [0, lo, hi, run.len() - 1];
        picks.sort_unstable();
        let mut last = None;
        for i in picks {
            if last != Some(i) {
                kept.push(run[i]);
                last = Some(i);
            }
        }
    }
    kept
}

fn read_jsonl(path: &Path) -> Result<Vec<Map<String, Value>>> {
    // A regular file only: a FIFO would block, a device never end.
    let file = open_regular(path, true).map_err(|e| KilnError::io(path, e))?;
    read_jsonl_from(std::io::BufReader::new(file), path)
}

/// The entries of a `log.jsonl` read line by line from `reader` (`path` names it in errors):
/// neither the file nor its entries are held whole, only what [`Collector`] keeps.
fn read_jsonl_from(mut reader: impl BufRead, path: &Path) -> Result<Vec<Map<String, Value>>> {
    let mut collector = Collector::default();
    let mut line = Vec::new();
    for number in 1.. {
        line.clear();
        let n = (&mut reader)
            .take(MAX_LINE_BYTES as u64 + 1)
            .read_until(b'\n', &mut line)
            .map_err(|e| KilnError::io(path, e))?;
        if n == 0 {
            break;
        }
        // Without its newline, a line is either over the cap or the file's last.
        let complete = line.ends_with(b"\n");
        if !complete && line.len() > MAX_LINE_BYTES {
            return Err(KilnError::Data(format!(
                "{} line {number}: longer than {} MiB, not a log entry",
                path.display(),
                MAX_LINE_BYTES >> 20
            )));
        }
        match parse_line(&line) {
            Ok(Some(m)) => collector.add_entry(&m),
            Ok(None) => {}
            // Cut short while the run writes it: the rest of the line is still to come.
            Err(_) if !complete => {}
            Err(msg) => {
                return Err(KilnError::Data(format!(
                    "{} line {number}: {msg}",
                    path.display()
                )))
            }
        }
    }
    Ok(collector.finish())
}

/// One log line: an object, nothing (a blank line), or what is wrong with it.
fn parse_line(line: &[u8]) -> std::result::Result<Option<Map<String, Value>>, String> {
    let text = std::str::from_utf8(line).map_err(|e| format!("not UTF-8: {e}"))?;
    if text.trim().is_empty() {
        return Ok(None);
    }
    match serde_json::from_str::<Value>(text) {
        Ok(Value::Object(m)) => Ok(Some(m)),
        Ok(other) => Err(format!("not a JSON object: found {}", json_kind(&other))),
        Err(e) => Err(format!("not a JSON object: {e}")),
    }
}

/// The `log_history` of a `trainer_state.json`, streamed: its entries go to a [`Collector`] one
/// by one, and values the plots do not draw are skipped unread.
fn read_trainer_state(path: &Path) -> Result<Vec<Map<String, Value>>> {
    let file = open_regular(path, true).map_err(|e| KilnError::io(path, e))?;
    let mut collector = Collector::default();
    // What is wrong with a well-formed file of the wrong shape, in words (serde's error would
    // add a position and its own wording).
    let mut problem = None;
    let mut de = serde_json::Deserializer::from_reader(std::io::BufReader::new(file));
    let found = StateSeed {
        collector: &mut collector,
        problem: &mut problem,
    }
    .deserialize(&mut de)
    .and_then(|found| de.end().map(|()| found));
    match (found, problem) {
        (_, Some(msg)) => Err(KilnError::Data(format!("{}: {msg}", path.display()))),
        (Err(e), None) => Err(KilnError::Data(format!(
            "{} line {}: not valid JSON: {e}",
            path.display(),
            e.line()
        ))),
        (Ok(false), None) => Err(KilnError::Data(format!(
            "{}: no `log_history` list in it",
            path.display()
        ))),
        (Ok(true), None) => Ok(collector.finish()),
    }
}

/// Scalar values where a list or an object is expected: each is said by its kind.
macro_rules! reject_scalars {
    () => {
        fn visit_bool<E: de::Error>(self, _: bool) -> std::result::Result<Self::Value, E> {
            self.reject("a boolean")
        }
        fn visit_i64<E: de::Error>(self, _: i64) -> std::result::Result<Self::Value, E> {
            self.reject("a number")
        }
        fn visit_u64<E: de::Error>(self, _: u64) -> std::result::Result<Self::Value, E> {
            self.reject("a number")
        }
        fn visit_f64<E: de::Error>(self, _: f64) -> std::result::Result<Self::Value, E> {
            self.reject("a number")
        }
        fn visit_str<E: de::Error>(self, _: &str) -> std::result::Result<Self::Value, E> {
            self.reject("a string")
        }
        fn visit_unit<E: de::Error>(self) -> std::result::Result<Self::Value, E> {
            self.reject("null")
        }
    };
}

/// The whole `trainer_state.json`: whether it had a `log_history`.
struct StateSeed<'a> {
    collector: &'a mut Collector,
    problem: &'a mut Option<String>,
}

impl<'de> DeserializeSeed<'de> for StateSeed<'_> {
    type Value = bool;
    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> std::result::Result<bool, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for StateSeed<'_> {
    type Value = bool;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON object")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> std::result::Result<bool, A::Error> {
        let mut found = false;
        while let Some(key) = map.next_key::<String>()? {
            if key == "log_history" && !found {
                map.next_value_seed(HistorySeed {
                    collector: &mut *self.collector,
                    problem: &mut *self.problem,
                })?;
                found = true;
            } else {
                map.next_value::<IgnoredAny>()?;
            }
        }
        Ok(found)
    }
    // Anything but an object has no `log_history`.
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> std::result::Result<bool, A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(false)
    }
    fn visit_bool<E: de::Error>(self, _: bool) -> std::result::Result<bool, E> {
        Ok(false)
    }
    fn visit_i64<E: de::Error>(self, _: i64) -> std::result::Result<bool, E> {
        Ok(false)
    }
    fn visit_u64<E: de::Error>(self, _: u64) -> std::result::Result<bool, E> {
        Ok(false)
    }
    fn visit_f64<E: de::Error>(self, _: f64) -> std::result::Result<bool, E> {
        Ok(false)
    }
    fn visit_str<E: de::Error>(self, _: &str) -> std::result::Result<bool, E> {
        Ok(false)
    }
    fn visit_unit<E: de::Error>(self) -> std::result::Result<bool, E> {
        Ok(false)
    }
}

/// `log_history`: a list of entries.
struct HistorySeed<'a> {
    collector: &'a mut Collector,
    problem: &'a mut Option<String>,
}

impl HistorySeed<'_> {
    fn reject<T, E: de::Error>(self, kind: &str) -> std::result::Result<T, E> {
        let msg = format!("`log_history` is {kind}, not a list");
        *self.problem = Some(msg.clone());
        Err(E::custom(msg))
    }
}

impl<'de> DeserializeSeed<'de> for HistorySeed<'_> {
    type Value = ();
    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> std::result::Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for HistorySeed<'_> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a list of log entries")
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> std::result::Result<(), A::Error> {
        for index in 0.. {
            let entry = EntrySeed {
                index,
                collector: &mut *self.collector,
                problem: &mut *self.problem,
            };
            if seq.next_element_seed(entry)?.is_none() {
                break;
            }
        }
        Ok(())
    }
    fn visit_map<A: MapAccess<'de>>(self, _: A) -> std::result::Result<(), A::Error> {
        self.reject("an object")
    }
    reject_scalars!();
}

/// One `log_history` entry: its step and the plotted values go to the collector.
struct EntrySeed<'a> {
    index: usize,
    collector: &'a mut Collector,
    problem: &'a mut Option<String>,
}

impl EntrySeed<'_> {
    fn reject<T, E: de::Error>(self, kind: &str) -> std::result::Result<T, E> {
        let msg = format!("log_history[{}] is {kind}, not a JSON object", self.index);
        *self.problem = Some(msg.clone());
        Err(E::custom(msg))
    }
}

impl<'de> DeserializeSeed<'de> for EntrySeed<'_> {
    type Value = ();
    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> std::result::Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for EntrySeed<'_> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a log entry (a JSON object)")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> std::result::Result<(), A::Error> {
        let mut step = None;
        let mut values: Vec<(String, f64)> = Vec::new();
        while let Some(key) = map.next_key::<String>()? {
            if key == "step" {
                step = map.next_value::<Number>()?.step();
            } else if plotted(&key) {
                if let Some(v) = map.next_value::<Number>()?.finite() {
                    values.push((key, v));
                }
            } else {
                map.next_value::<IgnoredAny>()?;
            }
        }
        if let Some(step) = step {
            for (key, v) in values {
                self.collector.add(step, &key, v);
            }
        }
        Ok(())
    }
    fn visit_seq<A: SeqAccess<'de>>(self, _: A) -> std::result::Result<(), A::Error> {
        self.reject("an array")
    }
    reject_scalars!();
}

/// A JSON number, or anything else skipped unread.
enum Number {
    Unsigned(u64),
    Signed(i64),
    Float(f64),
    Other,
}

impl Number {
    /// As [`step_of`] takes a step: an integer, or a whole non-negative float.
    fn step(&self) -> Option<u64> {
        match *self {
            Self::Unsigned(u) => Some(u),
            Self::Signed(i) => u64::try_from(i).ok(),
            Self::Float(f) => {
                (f >= 0.0 && f.fract() == 0.0 && f < u64::MAX as f64).then_some(f as u64)
            }
            Self::Other => None,
        }
    }

    fn finite(&self) -> Option<f64> {
        match *self {
            Self::Unsigned(u) => Some(u as f64),
            Self::Signed(i) => Some(i as f64),
            Self::Float(f) => f.is_finite().then_some(f),
            Self::Other => None,
        }
    }
}

impl<'de> Deserialize<'de> for Number {
    fn deserialize<D: de::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        d.deserialize_any(NumberVisitor)
    }
}

struct NumberVisitor;

impl<'de> Visitor<'de> for NumberVisitor {
    type Value = Number;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("any JSON value")
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> std::result::Result<Number, E> {
        Ok(Number::Unsigned(v))
    }
    fn visit_i64<E: de::Error>(self, v: i64) -> std::result::Result<Number, E> {
        Ok(Number::Signed(v))
    }
    fn visit_f64<E: de::Error>(self, v: f64) -> std::result::Result<Number, E> {
        Ok(Number::Float(v))
    }
    fn visit_bool<E: de::Error>(self, _: bool) -> std::result::Result<Number, E> {
        Ok(Number::Other)
    }
    fn visit_str<E: de::Error>(self, _: &str) -> std::result::Result<Number, E> {
        Ok(Number::Other)
    }
    fn visit_unit<E: de::Error>(self) -> std::result::Result<Number, E> {
        Ok(Number::Other)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> std::result::Result<Number, A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(Number::Other)
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> std::result::Result<Number, A::Error> {
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        Ok(Number::Other)
    }
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
        // One entry a step, holding what the plots draw.
        assert_eq!(h.entries.len(), 2);
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
        assert_eq!(h.series("loss"), vec![(10, 0.69), (20, 0.61)]);
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

    /// A log of about `bytes` made as it is read, never held: a train line a step with a loss
    /// spike at step 123,457, and an eval line every 1,000 steps.
    struct GeneratedLog {
        left: usize,
        step: u64,
        line: Vec<u8>,
        at: usize,
        read: usize,
    }

    impl GeneratedLog {
        fn new(bytes: usize) -> Self {
            Self {
                left: bytes,
                step: 0,
                line: Vec::new(),
                at: 0,
                read: 0,
            }
        }
    }

    impl Read for GeneratedLog {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            if self.at == self.line.len() {
                if self.left == 0 {
                    return Ok(0);
                }
                self.step += 1;
                let step = self.step;
                let loss = if step == 123_457 {
                    99.0
                } else {
                    2.0 / (1.0 + step as f64 / 1e4)
                };
                let mut line = format!(
                    "{{\"loss\":{loss},\"grad_norm\":1.5,\"learning_rate\":5e-5,\"epoch\":0.5,\"step\":{step}}}\n"
                );
                if step.is_multiple_of(1000) {
                    line +=
                        &format!("{{\"eval_loss\":{loss},\"eval_runtime\":2.0,\"step\":{step}}}\n");
                }
                self.left = self.left.saturating_sub(line.len());
                (self.line, self.at) = (line.into_bytes(), 0);
            }
            let n = buf.len().min(self.line.len() - self.at);
            buf[..n].copy_from_slice(&self.line[self.at..self.at + n]);
            self.at += n;
            self.read += n;
            Ok(n)
        }
    }

    #[test]
    fn a_50_mb_log_is_streamed_and_keeps_a_bounded_number_of_points() {
        let mut log = GeneratedLog::new(50 << 20);
        let entries =
            read_jsonl_from(std::io::BufReader::new(&mut log), Path::new("log.jsonl")).unwrap();
        let (read, steps) = (log.read, log.step);
        assert!(
            read >= 50 << 20 && steps > 500_000,
            "{read} bytes, {steps} steps"
        );
        let h = RunHistory {
            name: "big".into(),
            dir: "big".into(),
            entries,
        };
        // Kept: at most MAX_POINTS per quantity, whatever the log's length.
        let loss = h.series("loss");
        assert!(loss.len() <= MAX_POINTS, "{}", loss.len());
        assert!(h.entries.len() <= 2 * MAX_POINTS, "{}", h.entries.len());
        // The curve's ends and extremes survive the thinning, and every eval point is kept.
        // (serde_json reads floats to within an ulp.)
        assert_eq!(loss[0].0, 1);
        assert!((loss[0].1 - 2.0 / (1.0 + 1.0 / 1e4)).abs() < 1e-12);
        assert_eq!(loss.last().map(|p| p.0), Some(steps));
        assert!(loss.contains(&(123_457, 99.0)), "the spike is drawn");
        assert_eq!(h.series("eval_loss").len() as u64, steps / 1000);
        assert_eq!(h.eval_metrics(), vec!["eval_loss"]);
        assert!(h.series("grad_norm").is_empty(), "not drawn, not kept");
    }

    #[test]
    fn a_resumed_runs_later_steps_win_across_compaction() {
        let series = |c: Collector| {
            let h = RunHistory {
                name: "r".into(),
                dir: "r".into(),
                entries: c.finish(),
            };
            h.series("loss")
        };
        // Resumed from step 10: its steps are logged again, with other values.
        let mut c = Collector::default();
        for step in 1..=30 {
            c.add(step, "loss", 1.0);
        }
        for step in 10..=20 {
            c.add(step, "loss", 2.0);
        }
        let loss = series(c);
        assert_eq!(loss.len(), 30);
        assert!(loss
            .iter()
            .all(|p| p.1 == if (10..=20).contains(&p.0) { 2.0 } else { 1.0 }));
        // The same after the points were thinned on the way: a kept step has its later value.
        let mut c = Collector::default();
        for step in 1..=(3 * MAX_POINTS as u64) {
            c.add(step, "loss", step as f64);
        }
        for step in 10..=20 {
            c.add(step, "loss", -1.0);
        }
        let loss = series(c);
        assert!(loss.len() <= MAX_POINTS, "{}", loss.len());
        assert!(loss.windows(2).all(|w| w[0].0 < w[1].0), "one point a step");
        let resumed: Vec<_> = loss.iter().filter(|p| (10..=20).contains(&p.0)).collect();
        assert!(!resumed.is_empty() && resumed.iter().all(|p| p.1 == -1.0));
    }

    #[test]
    fn an_overlong_line_or_a_fifo_is_an_error_naming_it() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("long");
        let long = format!(
            "{{\"loss\":1.0,\"x\":\"{}\",\"step\":1}}\n",
            "a".repeat(MAX_LINE_BYTES)
        );
        write(&dir.join("log.jsonl"), &format!("{LOG}{long}"));
        let e = RunHistory::read(&dir).unwrap_err().to_string();
        assert!(e.contains("log.jsonl line 5: longer than 1 MiB"), "{e}");
        let fifo = tmp.path().join("fifo");
        std::fs::create_dir_all(&fifo).unwrap();
        let path =
            std::ffi::CString::new(fifo.join("log.jsonl").as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(path.as_ptr(), 0o600) }, 0);
        let e = RunHistory::read(&fifo).unwrap_err().to_string();
        assert!(e.contains("log.jsonl: a FIFO, not a regular file"), "{e}");
    }

    #[test]
    fn a_trainer_state_of_the_wrong_shape_says_what_is_wrong() {
        let tmp = tempfile::tempdir().unwrap();
        let state = tmp.path().join("trainer_state.json");
        let err = |text: &str| {
            write(&state, text);
            RunHistory::read(tmp.path()).unwrap_err().to_string()
        };
        assert!(err(r#"{"log_history": "x"}"#).ends_with("`log_history` is a string, not a list"));
        assert!(err(r#"{"log_history": {}}"#).ends_with("`log_history` is an object, not a list"));
        assert!(err(r#"{"log_history": [{"step": 1}, 3]}"#)
            .ends_with("log_history[1] is a number, not a JSON object"));
        assert!(err("[1, 2]").ends_with("no `log_history` list in it"));
        let e = err("{\n\"log_history\": [\n{\"step\": 1,}\n]}");
        assert!(
            e.contains("trainer_state.json line 3: not valid JSON"),
            "{e}"
        );
        assert!(err(r#"{"log_history": []} x"#).contains("not valid JSON"));
        // Values it does not draw are skipped unread, whatever their shape.
        write(
            &state,
            r#"{"best": null, "log_history": [{"loss": 0.5, "step": 3.0, "extra": {"a": [1, "b"]}, "epoch": "x"}], "log_history": 7}"#,
        );
        assert_eq!(
            RunHistory::read(tmp.path()).unwrap().series("loss"),
            vec![(3, 0.5)]
        );
    }
}
