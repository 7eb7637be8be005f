//! Whole rows ([`super::records`]) prepared one by one into a task's examples (SFT rows,
//! preference pairs): a row that cannot be prepared is skipped and counted with its file and line,
//! or stops the run (under `--strict`, or when the reason would fail every row alike). Skipped
//! rows are a warning with their count and first lines: data left out is never only an info line.

use std::path::{Path, PathBuf};

use serde_json::{Map, Value};
use tracing::info;

use super::collector::{ReadReport, Skipped};
use super::records::read_records;
use crate::error::{KilnError, Result};

/// Why a row was not prepared: one sentence, and whether it stops the run whatever `--strict`
/// says (a model without a chat template fails every conversation alike).
pub struct RowRefusal {
    pub reason: String,
    pub stops_the_run: bool,
}

/// Every row of `path` prepared by `prepare` (the first `limit` that prepare, if given), for
/// `what` (the error when none does: "no row could be prepared for {what}").
pub fn prepare_records<T>(
    path: &Path,
    strict: bool,
    limit: Option<usize>,
    what: &str,
    mut prepare: impl FnMut(&Map<String, Value>) -> std::result::Result<T, RowRefusal>,
) -> Result<Vec<T>> {
    let (records, mut report) = read_records(path, strict)?;
    let mut examples = Vec::new();
    for record in records {
        if limit.is_some_and(|n| examples.len() >= n) {
            break;
        }
        match prepare(&record.fields) {
            Ok(example) => examples.push(example),
            Err(refusal) if strict || refusal.stops_the_run => {
                return Err(KilnError::Data(format!(
                    "{}:{}: {}",
                    path.display(),
                    record.line,
                    refusal.reason
                )));
            }
            Err(refusal) => report.skipped.push(Skipped {
                path: PathBuf::from(path),
                line: record.line,
                reason: refusal.reason,
            }),
        }
    }
    log_report(path, &report);
    if examples.is_empty() {
        return Err(KilnError::Data(format!(
            "{}: no row could be prepared for {what} ({})",
            path.display(),
            report.summary()
        )));
    }
    Ok(examples)
}

fn log_report(path: &Path, report: &ReadReport) {
    if report.skipped.is_empty() {
        info!("{}: {}", path.display(), report.summary());
        return;
    }
    tracing::warn!("{}: {}", path.display(), report.summary());
    for s in report.skipped.iter().skip(1).take(4) {
        tracing::warn!("  also skipped {s}");
    }
}
