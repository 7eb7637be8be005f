//! The rows every reader makes: which columns hold what, one usable row, one skipped row and
//! why, each file's report, and the [`Collector`] a format's reader hands its cells to, which
//! checks them (text a non-empty string, a label a string or an integer) and counts what it
//! skips. The format readers ([`super::reader`], [`super::saved_dataset`]) build on it.

use std::path::{Path, PathBuf};

use crate::error::{KilnError, Result};

/// Which columns hold what.
#[derive(Debug, Clone)]
pub struct Columns {
    pub text: String,
    pub text_pair: Option<String>,
    /// `None` when reading unlabelled text for prediction.
    pub label: Option<String>,
}

/// One usable row.
#[derive(Debug, Clone, PartialEq)]
pub struct RawExample {
    /// 1-based line (CSV/JSONL) or row (Parquet) in the source file.
    pub line: usize,
    pub text: String,
    pub text_pair: Option<String>,
    /// Trimmed; an integer label (JSONL, Parquet) in decimal. Whether CSV labels are integers is
    /// decided over the whole training file, by [`super::LabelSet::infer`].
    pub label: Option<String>,
}

/// A row that was not used, and why.
#[derive(Debug, Clone, PartialEq)]
pub struct Skipped {
    pub path: PathBuf,
    pub line: usize,
    pub reason: String,
}

impl std::fmt::Display for Skipped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}: {}", self.path.display(), self.line, self.reason)
    }
}

/// The outcome of reading one file.
#[derive(Debug, Clone, Default)]
pub struct ReadReport {
    pub rows: usize,
    pub skipped: Vec<Skipped>,
}

impl ReadReport {
    /// One line for the log: `kept/total rows, N skipped (first: file:line: reason)`.
    pub fn summary(&self) -> String {
        let kept = self.rows - self.skipped.len();
        match self.skipped.first() {
            None => format!("{kept}/{} rows used", self.rows),
            Some(first) => format!(
                "{kept}/{} rows used, {} skipped (first: {first})",
                self.rows,
                self.skipped.len()
            ),
        }
    }
}

/// One cell as the file holds it, before it is checked against what its column must hold.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Cell {
    /// Absent, or null.
    Missing,
    Str(String),
    /// An integer, in decimal.
    Int(String),
    /// Any other type, named for the message ("a float", "a list", ...).
    Other(&'static str),
}

impl Cell {
    /// Text must be a non-empty string: a number or a list is never tokenized as its JSON text.
    fn text(self, col: &str) -> std::result::Result<String, String> {
        let kind = match self {
            Cell::Str(s) if !s.trim().is_empty() => return Ok(s),
            Cell::Missing | Cell::Str(_) => return Err(format!("empty text in column '{col}'")),
            Cell::Int(_) => "an integer",
            Cell::Other(kind) => kind,
        };
        Err(format!(
            "text in column '{col}' must be a string, found {kind}"
        ))
    }

    /// A label is a string or an integer, as `datasets.ClassLabel` takes them.
    fn label(self, col: &str) -> std::result::Result<String, String> {
        match self {
            Cell::Str(s) | Cell::Int(s) if !s.trim().is_empty() => Ok(s.trim().to_string()),
            Cell::Missing | Cell::Str(_) | Cell::Int(_) => {
                Err(format!("empty label in column '{col}'"))
            }
            Cell::Other(kind) => Err(format!(
                "label in column '{col}' must be a string or an integer, found {kind}"
            )),
        }
    }
}

pub(crate) struct Collector<'a> {
    pub(crate) path: &'a Path,
    pub(crate) cols: &'a Columns,
    pub(crate) strict: bool,
    pub(crate) examples: Vec<RawExample>,
    pub(crate) report: ReadReport,
}

impl Collector<'_> {
    /// Counts one unusable row (the caller has not counted it yet), or fails under `strict`.
    pub(crate) fn skip(&mut self, line: usize, reason: String) -> Result<()> {
        self.report.rows += 1;
        let s = Skipped {
            path: self.path.to_path_buf(),
            line,
            reason,
        };
        if self.strict {
            return Err(KilnError::Data(format!("{s} (--strict)")));
        }
        self.report.skipped.push(s);
        Ok(())
    }

    /// Validates and stores one row given its cells.
    pub(crate) fn row(&mut self, line: usize, text: Cell, pair: Cell, label: Cell) -> Result<()> {
        match check_row(self.cols, text, pair, label) {
            Ok((text, text_pair, label)) => {
                self.report.rows += 1;
                self.examples.push(RawExample {
                    line,
                    text,
                    text_pair,
                    label,
                });
                Ok(())
            }
            Err(reason) => self.skip(line, reason),
        }
    }
}

type CheckedRow = (String, Option<String>, Option<String>);

/// The row's text, text pair and label, or why it cannot be used (the first problem, in that order).
fn check_row(
    cols: &Columns,
    text: Cell,
    pair: Cell,
    label: Cell,
) -> std::result::Result<CheckedRow, String> {
    let text = text.text(&cols.text)?;
    let pair = cols
        .text_pair
        .as_deref()
        .map(|c| pair.text(c))
        .transpose()?;
    let label = cols.label.as_deref().map(|c| label.label(c)).transpose()?;
    Ok((text, pair, label))
}

/// Data is read only from regular files (see [`crate::io::files::ensure_regular`]), checked
/// before anything is opened.
pub(crate) fn check_regular_file(path: &Path) -> Result<()> {
    crate::io::files::ensure_regular(path, "data file")
}

pub(crate) fn missing_column(path: &Path, col: &str, have: &[String]) -> KilnError {
    KilnError::Data(format!(
        "{}: no column '{col}' (columns: {})",
        path.display(),
        have.join(", ")
    ))
}

thread_local! {
    /// Set while this thread reads a Parquet or Arrow file, so the panic hook stays quiet for a
    /// panic that [`catch_reader_panics`] turns into an error.
    static IN_PARQUET_READ: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs a third-party reader on `path`, turning a panic of it into an error that names the file
/// (`what` says what the file should have been, and which crate failed).
pub(crate) fn catch_reader_panics<T>(
    path: &Path,
    what: &str,
    read: impl FnOnce() -> Result<T>,
) -> Result<T> {
    static QUIET_HOOK: std::sync::Once = std::sync::Once::new();
    QUIET_HOOK.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if !IN_PARQUET_READ.with(|q| q.get()) {
                previous(info);
            }
        }));
    });
    IN_PARQUET_READ.with(|q| q.set(true));
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(read));
    IN_PARQUET_READ.with(|q| q.set(false));
    outcome.unwrap_or_else(|payload| {
        let msg = payload
            .downcast_ref::<&str>()
            .copied()
            .or_else(|| payload.downcast_ref::<String>().map(String::as_str))
            .unwrap_or("no message");
        Err(KilnError::Data(format!(
            "{}: not a readable {what} failed on it: {msg})",
            path.display()
        )))
    })
}
