//! Training arguments from files: YAML or JSON read within bounds (size, a pipe that never ends,
//! nesting the YAML scanner is slow on), the keys checked against transformers' fields, and
//! `training_args.json` written as transformers writes it.

use crate::error::{KilnError, Result};
use crate::train::hf_values::line_of_key;

use super::*;

/// The deepest nesting of YAML flow collections (`[ ]`, `{ }`) a config file may have. The
/// parser refuses depths past 128 anyway, but its scanner first spends time quadratic in the
/// depth (minutes at 200,000), so deeper text is refused before it is parsed.
pub(crate) const MAX_YAML_FLOW_DEPTH: usize = 128;

/// The 1-based line where YAML flow collections first nest deeper than `max`, in one pass over
/// the text. Brackets inside quoted scalars and comments do not count, nor, outside a flow
/// collection, one that does not start a value (`a: b[c` is a plain scalar). Block scalars are
/// not followed: a valid file would need over 128 bracket-led lines in one to be refused.
pub(crate) fn flow_too_deep(text: &str, max: usize) -> Option<usize> {
    let mut depth = 0usize;
    // A quoted scalar may run over several lines.
    let mut quote: Option<char> = None;
    for (i, line) in text.lines().enumerate() {
        let mut s = ScanState::default();
        let mut chars = line.chars().peekable();
        while let Some(c) = chars.next() {
            if let Some(q) = quote {
                // `\x` in double quotes and `''` in single quotes are a character, not the end.
                let escaped = (q == '"' && c == '\\')
                    || (q == '\'' && c == '\'' && chars.peek() == Some(&'\''));
                if escaped {
                    chars.next();
                } else if c == q {
                    quote = None;
                }
                s.saw(c);
                continue;
            }
            let starts_value = s.starts_value(depth);
            match c {
                '#' if s.last.is_none_or(char::is_whitespace) => break,
                '\'' | '"' if starts_value => quote = Some(c),
                '[' | '{' if depth > 0 || starts_value => {
                    depth += 1;
                    if depth > max {
                        return Some(i + 1);
                    }
                }
                ']' | '}' if depth > 0 => depth -= 1,
                _ => {}
            }
            s.saw(c);
        }
    }
    None
}

/// What [`flow_too_deep`] remembers of a line so far.
#[derive(Default)]
pub(crate) struct ScanState {
    /// The previous non-blank character.
    prev: Option<char>,
    /// The previous character (a `#` after a blank starts a comment).
    last: Option<char>,
    /// The first character of the word being read.
    word: Option<char>,
    /// The last word was an anchor (`&a`) or a tag (`!t`), which a value may follow.
    after_property: bool,
}

impl ScanState {
    pub(crate) fn saw(&mut self, c: char) {
        if c.is_whitespace() {
            if let Some(w) = self.word.take() {
                self.after_property = matches!(w, '&' | '!');
            }
        } else {
            self.word.get_or_insert(c);
            self.after_property = false;
            self.prev = Some(c);
        }
        self.last = Some(c);
    }

    /// Whether the next character starts a value (so a bracket there opens a collection): at
    /// the start of the line, after `key:`, `- ` or `? ` (and `[`, `{`, `,` inside a flow
    /// collection), or after an anchor or tag.
    pub(crate) fn starts_value(&self, depth: usize) -> bool {
        self.after_property
            || match self.prev {
                None | Some(':' | '-' | '?') => true,
                Some('[' | '{' | ',') => depth > 0,
                Some(_) => false,
            }
    }
}

/// The most a `--config` file may hold: real configs are a few KB.
pub(crate) const MAX_CONFIG_BYTES: u64 = 16 << 20;

/// How long a `--config` pipe (`--config <(...)`) may stay silent before it is an error.
pub(crate) const CONFIG_PIPE_WAIT_MS: i32 = 30_000;

/// A `--config` file's text, read with bounds: at most [`MAX_CONFIG_BYTES`] (`/dev/zero` is an
/// error, not an out-of-memory kill), and a pipe with no writer is an error after 30 s rather
/// than a hang. Pipes stay allowed, so `--config <(generate-config)` works.
pub(crate) fn read_config_text(path: &Path) -> Result<String> {
    read_config_text_within(path, CONFIG_PIPE_WAIT_MS)
}

/// [`read_config_text`], waiting at most `wait_ms` for a pipe's first byte.
pub(crate) fn read_config_text_within(path: &Path, wait_ms: i32) -> Result<String> {
    use std::io::Read;
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
    let io = |e: std::io::Error| KilnError::io(path, e);
    // O_NONBLOCK: opening a FIFO without a writer returns at once instead of blocking.
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .map_err(io)?;
    let kind = file.metadata().map_err(io)?.file_type();
    if kind.is_dir() {
        return Err(KilnError::Config(format!(
            "--config {}: a folder, not a YAML or JSON file",
            path.display()
        )));
    }
    if !kind.is_file() && !kind.is_fifo() && !kind.is_char_device() {
        return Err(KilnError::Config(format!(
            "--config {}: not a file or a pipe",
            path.display()
        )));
    }
    let fd = file.as_raw_fd();
    if kind.is_fifo() {
        let mut poll = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd for the open descriptor `fd`.
        let ready = unsafe { libc::poll(&mut poll, 1, wait_ms) };
        if ready == 0 {
            return Err(KilnError::Config(format!(
                "--config {}: a pipe that nothing wrote to in {:.1} s",
                path.display(),
                wait_ms as f64 / 1000.0
            )));
        }
    }
    // Back to blocking reads: a pipe's writer may still be writing.
    // SAFETY: fcntl on the open descriptor `fd`, clearing one status flag.
    unsafe {
        let flags = libc::fcntl(fd, libc::F_GETFL);
        libc::fcntl(fd, libc::F_SETFL, flags & !libc::O_NONBLOCK);
    }
    let mut bytes = Vec::new();
    file.take(MAX_CONFIG_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(io)?;
    if bytes.len() as u64 > MAX_CONFIG_BYTES {
        return Err(KilnError::Config(format!(
            "--config {}: larger than {} MiB; a training config is a few KB",
            path.display(),
            MAX_CONFIG_BYTES >> 20
        )));
    }
    String::from_utf8(bytes).map_err(|e| {
        KilnError::Config(format!(
            "--config {}: not UTF-8 text (byte {})",
            path.display(),
            e.utf8_error().valid_up_to()
        ))
    })
}

impl TrainingArguments {
    /// Reads a YAML or JSON file (by extension) of TrainingArguments keys; absent keys keep
    /// defaults, transformers fields kiln does not act on are kept in `recorded`, and an unknown
    /// key is an error naming it.
    pub fn from_file(path: &Path) -> Result<Self> {
        let sorted = Self::file_entries(path, false)?;
        let mut args = Self::over_defaults(sorted.known, |key, e| {
            KilnError::Config(format!("{}: key `{key}`: {e}", path.display()))
        })?;
        args.recorded = sorted.recorded;
        Ok(args)
    }

    /// `training_args.json` as transformers writes it: only its field names (HfArgumentParser and
    /// `TrainingArguments(**json)` read it back), kiln's 4.x fields in their 5.x form, and the
    /// recorded fields as they were given. kiln's own settings (tensor parallelism, ZeRO-1, …)
    /// are in the log and, for a sharded checkpoint, shards.json.
    pub fn to_hf_json(&self) -> String {
        let mut v = serde_json::to_value(self).expect("plain data serialises");
        let m = v.as_object_mut().expect("a struct is an object");
        for kiln_only in [
            "skip_nonfinite_steps",
            "tensor_parallel_size",
            "global_batch_size",
            "zero_1",
            "pipeline_parallel_size",
            "pipeline_parallel_num_microbatches",
            "pipeline_schedule",
            "pipeline_cuts",
            "pipeline_balance",
            "overwrite_output_dir",
            // transformers 5 reads TENSORBOARD_LOGGING_DIR instead.
            "logging_dir",
        ] {
            m.remove(kiln_only);
        }
        // transformers knows tensorboard, not kiln's log.jsonl.
        let hf: Vec<&str> = self
            .report_to
            .names()
            .into_iter()
            .filter(|n| *n == "tensorboard")
            .collect();
        m.insert("report_to".into(), serde_json::json!(hf));
        if let Some(ratio) = m.remove("warmup_ratio").and_then(|r| r.as_f64()) {
            if self.warmup_steps == 0.0 && ratio > 0.0 {
                m.insert(
                    "warmup_steps".into(),
                    serde_json::json!(ratio.min(0.999_999)),
                );
            }
        }
        if m.remove("group_by_length") == Some(serde_json::Value::Bool(true)) {
            m.insert("train_sampling_strategy".into(), "group_by_length".into());
        }
        if self.resume_from_checkpoint.as_deref() == Some("latest") {
            m.insert(
                "resume_from_checkpoint".into(),
                serde_json::Value::Bool(true),
            );
        }
        for (k, val) in &self.recorded {
            m.entry(k.clone()).or_insert_with(|| val.clone());
        }
        crate::io::to_sorted_json_pretty(&v)
    }

    /// The names of kiln's fields (as a file or transformers spells them).
    pub fn field_names() -> Vec<String> {
        match serde_json::to_value(Self::default()) {
            Ok(serde_json::Value::Object(m)) => m.keys().cloned().collect(),
            _ => Vec::new(),
        }
    }

    /// `entries` laid over the defaults; a bad value is `bad(key, error)`.
    pub fn over_defaults(
        entries: serde_json::Map<String, serde_json::Value>,
        bad: impl Fn(String, String) -> KilnError,
    ) -> Result<Self> {
        let mut base = serde_json::to_value(Self::default()).expect("plain data serialises");
        if let Some(b) = base.as_object_mut() {
            b.extend(entries);
        }
        serde_path_to_error::deserialize(base).map_err(|e| {
            let key = e.path().to_string();
            bad(key, e.into_inner().to_string())
        })
    }

    /// A YAML/JSON file's keys sorted by [`crate::train::hf_fields::sort_entries`] (an unknown key only
    /// warns with `ignore_unknown`), their values checked: a bad one names its file, line and key.
    pub fn file_entries(
        path: &Path,
        ignore_unknown: bool,
    ) -> Result<crate::train::hf_fields::Sorted> {
        use crate::train::hf_fields::{sort_entries, Source};
        let text = read_config_text(path)?;
        let is_json = path.extension().and_then(|e| e.to_str()) == Some("json");
        let value: serde_json::Value = if is_json {
            serde_json::from_str(&text).map_err(|e| KilnError::Parse {
                path: path.to_path_buf(),
                line: e.line(),
                msg: e.to_string(),
            })?
        } else {
            if let Some(line) = flow_too_deep(&text, MAX_YAML_FLOW_DEPTH) {
                return Err(KilnError::Parse {
                    path: path.to_path_buf(),
                    line,
                    msg: format!(
                        "YAML lists/mappings ([ ], {{ }}) nest deeper than {MAX_YAML_FLOW_DEPTH} levels here, far more than training arguments need"
                    ),
                });
            }
            let yaml: serde_yaml_ng::Value =
                serde_yaml_ng::from_str(&text).map_err(|e| KilnError::Parse {
                    path: path.to_path_buf(),
                    line: e.location().map(|l| l.line()).unwrap_or(0),
                    msg: e.to_string(),
                })?;
            // YAML has .nan and .inf, JSON values do not (they would become null): name them here.
            if let serde_yaml_ng::Value::Mapping(m) = &yaml {
                for (k, v) in m {
                    if let (Some(k), Some(f)) = (k.as_str(), v.as_f64()) {
                        if !f.is_finite() {
                            return Err(KilnError::Parse {
                                path: path.to_path_buf(),
                                line: line_of_key(&text, k),
                                msg: format!("{k} must be a finite number, got {f}"),
                            });
                        }
                    }
                }
            }
            serde_json::to_value(yaml).map_err(|e| KilnError::Parse {
                path: path.to_path_buf(),
                line: 0,
                msg: e.to_string(),
            })?
        };
        let entries = match value {
            serde_json::Value::Object(m) => m,
            serde_json::Value::Null => serde_json::Map::new(),
            other => {
                return Err(KilnError::Parse {
                    path: path.to_path_buf(),
                    line: 1,
                    msg: format!(
                        "training arguments must be a mapping of names to values, not {other}"
                    ),
                })
            }
        };
        let source = Source {
            name: path.display().to_string(),
            text: Some(&text),
        };
        let sorted = sort_entries(entries, &Self::field_names(), &source, ignore_unknown)?;
        // The values' types and ranges, checked now so that a bad one names this file.
        let args = Self::over_defaults(sorted.known.clone(), |key, msg| KilnError::Parse {
            path: path.to_path_buf(),
            line: line_of_key(&text, &key),
            msg: format!("key `{key}`: {msg}"),
        })?;
        args.check_values().map_err(|(key, msg)| KilnError::Parse {
            path: path.to_path_buf(),
            line: line_of_key(&text, key),
            msg,
        })?;
        Ok(sorted)
    }
}
