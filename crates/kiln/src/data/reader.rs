//! Reading labelled text from CSV/TSV, JSONL and Parquet files.
//!
//! Every row that cannot be used is counted with its file and line (or row number for Parquet) and a
//! reason; with `strict` the first such row is an error instead. A missing column, an unreadable
//! file or an empty result are errors that name the file and the column.

use std::fs::File;
use std::io::{BufRead, BufReader};
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

/// Text encodings for CSV/TSV input (JSONL and Parquet are UTF-8 by definition).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TextEncoding {
    #[default]
    Utf8,
    /// ISO-8859-1: every byte is the code point of the same value (Python's `latin-1`).
    Latin1,
    /// Windows-1252 (what WHATWG calls "latin1"; differs from ISO-8859-1 in 0x80–0x9F).
    Windows1252,
}

impl std::str::FromStr for TextEncoding {
    type Err = KilnError;
    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().replace('_', "-").as_str() {
            "utf-8" | "utf8" => Ok(Self::Utf8),
            "latin-1" | "latin1" | "iso-8859-1" | "iso8859-1" => Ok(Self::Latin1),
            "cp1252" | "windows-1252" => Ok(Self::Windows1252),
            other => Err(KilnError::Config(format!(
                "unknown encoding {other:?} (use utf-8, latin-1 or windows-1252)"
            ))),
        }
    }
}

/// One usable row.
#[derive(Debug, Clone, PartialEq)]
pub struct RawExample {
    /// 1-based line (CSV/JSONL) or row (Parquet) in the source file.
    pub line: usize,
    pub text: String,
    pub text_pair: Option<String>,
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

struct Collector<'a> {
    path: &'a Path,
    cols: &'a Columns,
    strict: bool,
    examples: Vec<RawExample>,
    report: ReadReport,
}

impl Collector<'_> {
    fn skip(&mut self, line: usize, reason: String) -> Result<()> {
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

    /// Validates and stores one row given its column values.
    fn row(
        &mut self,
        line: usize,
        text: Option<String>,
        pair: Option<String>,
        label: Option<String>,
    ) -> Result<()> {
        self.report.rows += 1;
        let text = text.unwrap_or_default();
        if text.trim().is_empty() {
            return self.skip(line, format!("empty text in column '{}'", self.cols.text));
        }
        if let Some(pc) = &self.cols.text_pair {
            if pair.as_deref().map(str::trim).unwrap_or("").is_empty() {
                return self.skip(line, format!("empty text in column '{pc}'"));
            }
        }
        if let Some(lc) = &self.cols.label {
            if label.as_deref().map(str::trim).unwrap_or("").is_empty() {
                return self.skip(line, format!("empty label in column '{lc}'"));
            }
        }
        self.examples.push(RawExample {
            line,
            text,
            text_pair: pair,
            label: label.map(|l| l.trim().to_string()),
        });
        Ok(())
    }
}

/// Reads a data file; the format follows the extension (`.csv`, `.tsv`, `.jsonl`/`.json`, `.parquet`).
pub fn read_examples(
    path: &Path,
    cols: &Columns,
    encoding: TextEncoding,
    strict: bool,
) -> Result<(Vec<RawExample>, ReadReport)> {
    let ext = path
        .extension()
        .and_then(|e| e.to_str())
        .unwrap_or("")
        .to_ascii_lowercase();
    let mut c = Collector {
        path,
        cols,
        strict,
        examples: Vec::new(),
        report: ReadReport::default(),
    };
    match ext.as_str() {
        "csv" => read_delimited(path, b',', encoding, &mut c)?,
        "tsv" => read_delimited(path, b'\t', encoding, &mut c)?,
        "jsonl" | "json" | "ndjson" => read_jsonl(path, &mut c)?,
        "parquet" | "pq" => read_parquet(path, &mut c)?,
        _ => {
            return Err(KilnError::Data(format!(
                "{}: unknown data format {ext:?} (expected .csv, .tsv, .jsonl or .parquet)",
                path.display()
            )))
        }
    }
    if c.examples.is_empty() {
        return Err(KilnError::Data(format!(
            "{}: no usable rows ({})",
            path.display(),
            c.report.summary()
        )));
    }
    Ok((c.examples, c.report))
}

fn decode(path: &Path, bytes: Vec<u8>, encoding: TextEncoding) -> Result<String> {
    match encoding {
        TextEncoding::Utf8 => String::from_utf8(bytes).map_err(|e| {
            let upto = &e.as_bytes()[..e.utf8_error().valid_up_to()];
            let line = upto.iter().filter(|&&b| b == b'\n').count() + 1;
            KilnError::Parse {
                path: path.to_path_buf(),
                line,
                msg: "invalid UTF-8 (try --encoding latin-1)".into(),
            }
        }),
        TextEncoding::Latin1 => Ok(bytes.iter().map(|&b| b as char).collect()),
        TextEncoding::Windows1252 => Ok(encoding_rs::WINDOWS_1252.decode(&bytes).0.into_owned()),
    }
}

fn missing_column(path: &Path, col: &str, have: &[String]) -> KilnError {
    KilnError::Data(format!(
        "{}: no column '{col}' (columns: {})",
        path.display(),
        have.join(", ")
    ))
}

fn read_delimited(path: &Path, delim: u8, enc: TextEncoding, c: &mut Collector) -> Result<()> {
    let bytes = std::fs::read(path).map_err(|e| KilnError::io(path, e))?;
    let text = decode(path, bytes, enc)?;
    let mut rdr = csv::ReaderBuilder::new()
        .delimiter(delim)
        .flexible(true)
        .from_reader(text.as_bytes());
    let headers: Vec<String> = rdr
        .headers()
        .map_err(|e| KilnError::Parse {
            path: path.to_path_buf(),
            line: 1,
            msg: e.to_string(),
        })?
        .iter()
        .map(|h| h.trim().to_string())
        .collect();
    let index = |name: &str| {
        headers
            .iter()
            .position(|h| h == name)
            .ok_or_else(|| missing_column(path, name, &headers))
    };
    let ti = index(&c.cols.text)?;
    let pi = c.cols.text_pair.as_deref().map(index).transpose()?;
    let li = c.cols.label.as_deref().map(index).transpose()?;
    for rec in rdr.records() {
        let rec = match rec {
            Ok(r) => r,
            Err(e) => {
                let line = e.position().map(|p| p.line() as usize).unwrap_or(0);
                c.report.rows += 1;
                c.skip(line, format!("unreadable row: {e}"))?;
                continue;
            }
        };
        let line = rec.position().map(|p| p.line() as usize).unwrap_or(0);
        if rec.len() != headers.len() {
            c.report.rows += 1;
            c.skip(
                line,
                format!("expected {} fields, found {}", headers.len(), rec.len()),
            )?;
            continue;
        }
        let get = |i: Option<usize>| i.map(|i| rec[i].to_string());
        c.row(line, get(Some(ti)), get(pi), get(li))?;
    }
    Ok(())
}

fn json_to_string(v: &serde_json::Value) -> Option<String> {
    match v {
        serde_json::Value::Null => None,
        serde_json::Value::String(s) => Some(s.clone()),
        other => Some(other.to_string()),
    }
}

fn read_jsonl(path: &Path, c: &mut Collector) -> Result<()> {
    let f = File::open(path).map_err(|e| KilnError::io(path, e))?;
    let cols = c.cols.clone();
    let mut seen_columns: Option<Vec<String>> = None;
    let mut found = [false; 3];
    for (i, line) in BufReader::new(f).lines().enumerate() {
        let n = i + 1;
        let line = line.map_err(|e| KilnError::io(path, e))?;
        if line.trim().is_empty() {
            continue;
        }
        let obj = match serde_json::from_str::<serde_json::Value>(&line) {
            Ok(serde_json::Value::Object(o)) => o,
            Ok(_) => {
                c.report.rows += 1;
                c.skip(n, "not a JSON object".into())?;
                continue;
            }
            Err(e) => {
                c.report.rows += 1;
                c.skip(n, format!("invalid JSON: {e}"))?;
                continue;
            }
        };
        seen_columns.get_or_insert_with(|| obj.keys().cloned().collect());
        let get = |k: Option<&String>, slot: &mut bool| {
            let v = obj.get(k?)?;
            *slot = true;
            json_to_string(v)
        };
        let [ft, fp, fl] = &mut found;
        let text = get(Some(&cols.text), ft);
        let pair = get(cols.text_pair.as_ref(), fp);
        let label = get(cols.label.as_ref(), fl);
        c.row(n, text, pair, label)?;
    }
    // A column that no row has is a configuration error, not a thousand malformed rows.
    let have = seen_columns.unwrap_or_default();
    let wanted = [
        Some(&cols.text),
        cols.text_pair.as_ref(),
        cols.label.as_ref(),
    ];
    for (w, f) in wanted.iter().zip(found) {
        if let (Some(w), false) = (w, f) {
            if c.report.rows > 0 {
                return Err(missing_column(path, w, &have));
            }
        }
    }
    Ok(())
}

fn read_parquet(path: &Path, c: &mut Collector) -> Result<()> {
    use parquet::file::reader::{FileReader, SerializedFileReader};
    use parquet::record::Field;
    let f = File::open(path).map_err(|e| KilnError::io(path, e))?;
    let reader = SerializedFileReader::new(f)
        .map_err(|e| KilnError::Data(format!("{}: not a Parquet file: {e}", path.display())))?;
    let have: Vec<String> = reader
        .metadata()
        .file_metadata()
        .schema_descr()
        .columns()
        .iter()
        .map(|c| c.name().to_string())
        .collect();
    let cols = c.cols.clone();
    for w in [
        Some(&cols.text),
        cols.text_pair.as_ref(),
        cols.label.as_ref(),
    ]
    .into_iter()
    .flatten()
    {
        if !have.contains(w) {
            return Err(missing_column(path, w, &have));
        }
    }
    let rows = reader
        .get_row_iter(None)
        .map_err(|e| KilnError::Data(format!("{}: {e}", path.display())))?;
    for (i, row) in rows.enumerate() {
        let n = i + 1;
        let row = row.map_err(|e| KilnError::Parse {
            path: path.to_path_buf(),
            line: n,
            msg: e.to_string(),
        })?;
        let mut text = None;
        let mut pair = None;
        let mut label = None;
        for (name, field) in row.get_column_iter() {
            let value = match field {
                Field::Null => None,
                Field::Str(s) => Some(s.clone()),
                other => Some(other.to_string()),
            };
            if *name == cols.text {
                text = value;
            } else if Some(name) == cols.text_pair.as_ref() {
                pair = value;
            } else if Some(name) == cols.label.as_ref() {
                label = value;
            }
        }
        c.row(n, text, pair, label)?;
    }
    Ok(())
}
