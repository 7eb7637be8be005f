//! Reading labelled text from CSV/TSV, JSONL and Parquet files.
//!
//! Every row that cannot be used is counted with its file and line (or row number for Parquet) and a
//! reason; with `strict` the first such row is an error instead. A missing column, an unreadable
//! file or an empty result are errors that name the file and the column.
//!
//! Types follow `datasets`: text is a string, a label a string or an integer; a cell of any other
//! type (a float label, a list as text) is a skipped row naming the type, never its JSON text. CSV
//! and TSV quotes follow RFC 4180: a record whose quoted field is unterminated or has text after its
//! closing quote is a skipped row, and the rows after it are read normally (see `csv_quotes`). Only
//! regular files are read.

use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};

pub(crate) use super::collector::check_regular_file;
use super::collector::{catch_reader_panics, missing_column, Cell, Collector};
pub use super::collector::{Columns, RawExample, ReadReport, Skipped};
use super::csv_quotes::{blank, find_bad_quotes};
use crate::error::{KilnError, Result};

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

/// Reads a data file; the format follows the extension (`.csv`, `.tsv`, `.jsonl`, `.json` (lines or
/// one array), `.parquet`), or a folder: a `datasets` save_to_disk Dataset, or one split's
/// `.parquet` files.
pub fn read_examples(
    path: &Path,
    cols: &Columns,
    encoding: TextEncoding,
    strict: bool,
) -> Result<(Vec<RawExample>, ReadReport)> {
    let (rows, report) = read_rows(path, cols, encoding, strict)?;
    // Integer labels of a `datasets` ClassLabel column become its names.
    super::saved_dataset::apply_class_names(path, cols, rows, report, strict)
}

fn read_rows(
    path: &Path,
    cols: &Columns,
    encoding: TextEncoding,
    strict: bool,
) -> Result<(Vec<RawExample>, ReadReport)> {
    let mut c = Collector {
        path,
        cols,
        strict,
        examples: Vec::new(),
        report: ReadReport::default(),
    };
    match source(path)? {
        Source::Delimited(delim) => read_delimited(path, delim, encoding, &mut c)?,
        Source::Json => read_jsonl(path, &mut c)?,
        Source::Parquet => read_parquet(path, &mut c)?,
        Source::SavedDataset => super::saved_dataset::read(path, &mut c)?,
        Source::ParquetShards(shards) => {
            let (mut rows, mut report) = (Vec::new(), ReadReport::default());
            for shard in &shards {
                check_regular_file(shard)?;
                let mut one = Collector {
                    path: shard,
                    cols,
                    strict,
                    examples: Vec::new(),
                    report: ReadReport::default(),
                };
                read_parquet(shard, &mut one)?;
                rows.append(&mut one.examples);
                report.rows += one.report.rows;
                report.skipped.append(&mut one.report.skipped);
            }
            c.examples = rows;
            c.report = report;
        }
    }
    finish(path, c)
}

/// What a data path holds, as every reader of data files dispatches on it (this one and
/// [`super::records`]).
pub(super) enum Source {
    /// `.csv` (delimiter `,`) or `.tsv` (`\t`).
    Delimited(u8),
    /// `.json`, `.jsonl`, `.ndjson`: JSON Lines, or one JSON array.
    Json,
    /// `.parquet`, `.pq`.
    Parquet,
    /// A folder holding a `datasets` save_to_disk Dataset.
    SavedDataset,
    /// A folder of one split's `.parquet` files (as the Hub's Parquet conversion lays them out),
    /// in name order; each must still pass [`check_regular_file`] before it is read.
    ParquetShards(Vec<PathBuf>),
}

/// The kind of data at `path`: the format follows the extension, and a folder is a dataset (a
/// `datasets` save_to_disk Dataset, or one split's `.parquet` files). A file is checked to be a
/// regular file; a DatasetDict, a folder of neither kind and an unknown extension are errors.
pub(super) fn source(path: &Path) -> Result<Source> {
    // A folder is a dataset; one named like a data file (`x.csv/`) is a mistake, said as such.
    let file_like = path.extension().and_then(|e| e.to_str()).is_some_and(|e| {
        ["csv", "tsv", "json", "jsonl", "ndjson", "parquet", "pq"]
            .contains(&e.to_ascii_lowercase().as_str())
    });
    if path.is_dir() && !file_like {
        return folder_source(path);
    }
    check_regular_file(path)?;
    let ext = path
        .extension()
        .and_then(|e| e.to_str())
        .unwrap_or("")
        .to_ascii_lowercase();
    match ext.as_str() {
        "csv" => Ok(Source::Delimited(b',')),
        "tsv" => Ok(Source::Delimited(b'\t')),
        "jsonl" | "json" | "ndjson" => Ok(Source::Json),
        "parquet" | "pq" => Ok(Source::Parquet),
        _ => Err(KilnError::Data(format!(
            "{}: unknown data format {ext:?} (expected .csv, .tsv, .json, .jsonl, .parquet \
             or a `datasets` save_to_disk folder)",
            path.display()
        ))),
    }
}

/// The rows read, or an error when none is usable.
fn finish(path: &Path, c: Collector) -> Result<(Vec<RawExample>, ReadReport)> {
    if c.examples.is_empty() {
        return Err(KilnError::Data(format!(
            "{}: no usable rows ({})",
            path.display(),
            c.report.summary()
        )));
    }
    Ok((c.examples, c.report))
}

/// A folder of data: a `datasets` save_to_disk Dataset (Arrow files), or the Parquet files of one
/// split (as the Hub's Parquet conversion lays them out), read in name order.
fn folder_source(path: &Path) -> Result<Source> {
    if path.join("dataset_dict.json").exists() {
        let splits = super::saved_dataset::dict_split_names(path)?;
        return Err(KilnError::Data(format!(
            "{}: a DatasetDict (splits {}): give it as --dataset-dir, or one split's folder",
            path.display(),
            splits.join(", ")
        )));
    }
    if super::saved_dataset::is_saved_dataset(path) {
        return Ok(Source::SavedDataset);
    }
    let mut shards: Vec<PathBuf> = std::fs::read_dir(path)
        .map_err(|e| KilnError::io(path, e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "parquet"))
        .collect();
    shards.sort();
    if shards.is_empty() {
        return Err(KilnError::Data(format!(
            "{}: a folder without a `datasets` save_to_disk Dataset (state.json, .arrow files) or \
             .parquet files",
            path.display()
        )));
    }
    Ok(Source::ParquetShards(shards))
}

/// Reads a whole text file (after [`check_regular_file`]) in the given encoding.
pub fn read_text(path: &Path, encoding: TextEncoding) -> Result<String> {
    check_regular_file(path)?;
    let bytes = std::fs::read(path).map_err(|e| KilnError::io(path, e))?;
    decode(path, bytes, encoding)
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

fn read_delimited(path: &Path, delim: u8, enc: TextEncoding, c: &mut Collector) -> Result<()> {
    let text = read_text(path, enc)?;
    let bad = find_bad_quotes(&text, delim);
    if let Some(h) = bad.first().filter(|b| b.first_record) {
        return Err(KilnError::Parse {
            path: path.to_path_buf(),
            line: h.line,
            msg: format!("in the header row: {}", h.reason),
        });
    }
    let text = blank(&text, &bad);
    let mut bad = bad.into_iter().peekable();
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
        let pos = match &rec {
            Ok(r) => r.position(),
            Err(e) => e.position(),
        };
        let line = pos.map_or(0, |p| record_line(text.as_bytes(), p));
        // Blanked records are reported in line order among the rest, so `--strict` stops at the
        // first bad row of the file whatever its kind.
        while let Some(b) = bad.next_if(|b| b.line < line) {
            c.skip(b.line, b.reason)?;
        }
        let rec = match rec {
            Ok(r) => r,
            Err(e) => {
                c.skip(line, format!("unreadable row: {e}"))?;
                continue;
            }
        };
        if rec.len() != headers.len() {
            c.skip(
                line,
                format!("expected {} fields, found {}", headers.len(), rec.len()),
            )?;
            continue;
        }
        // Every CSV field is a string; whether labels are integers is decided over the whole
        // training file (see `LabelSet::infer`).
        let get = |i: Option<usize>| i.map_or(Cell::Missing, |i| Cell::Str(rec[i].to_string()));
        c.row(line, get(Some(ti)), get(pi), get(li))?;
    }
    for b in bad {
        c.skip(b.line, b.reason)?;
    }
    Ok(())
}

/// The 1-based line a record starts on. The `csv` crate takes a record's position before skipping
/// the empty lines in front of it (blanked bad records among them), so those are counted here.
pub(super) fn record_line(text: &[u8], pos: &csv::Position) -> usize {
    let empty_lines = text
        .get(pos.byte() as usize..)
        .unwrap_or_default()
        .iter()
        .take_while(|&&b| b == b'\n' || b == b'\r')
        .filter(|&&b| b == b'\n')
        .count();
    pos.line() as usize + empty_lines
}

fn json_cell(v: Option<&serde_json::Value>) -> Cell {
    use serde_json::Value;
    match v {
        None | Some(Value::Null) => Cell::Missing,
        Some(Value::String(s)) => Cell::Str(s.clone()),
        Some(Value::Number(n)) if n.is_i64() || n.is_u64() => Cell::Int(n.to_string()),
        Some(Value::Number(_)) => Cell::Other("a float"),
        Some(Value::Bool(_)) => Cell::Other("a boolean"),
        Some(Value::Array(_)) => Cell::Other("a list"),
        Some(Value::Object(_)) => Cell::Other("an object"),
    }
}

/// JSON Lines, or one JSON array of objects (what `datasets`' `to_json(lines=False)` and pandas'
/// `to_json(orient="records")` write); an array's rows are numbered by element.
fn read_jsonl(path: &Path, c: &mut Collector) -> Result<()> {
    if is_json_array(path)? {
        return read_json_array(path, c);
    }
    let f = File::open(path).map_err(|e| KilnError::io(path, e))?;
    let mut objects = JsonObjects::default();
    for (i, line) in BufReader::new(f).split(b'\n').enumerate() {
        let n = i + 1;
        let line = line.map_err(|e| KilnError::io(path, e))?;
        // JSON Lines is UTF-8 by definition; a line that is not is one malformed row.
        let Ok(line) = std::str::from_utf8(&line) else {
            c.skip(n, "invalid UTF-8".into())?;
            continue;
        };
        if line.trim().is_empty() {
            continue;
        }
        let obj = match serde_json::from_str::<serde_json::Value>(line) {
            Ok(serde_json::Value::Object(o)) => o,
            Ok(_) => {
                c.skip(n, "not a JSON object".into())?;
                continue;
            }
            Err(e) => {
                c.skip(n, format!("invalid JSON: {e}"))?;
                continue;
            }
        };
        objects.row(c, n, &obj)?;
    }
    objects.finish(path, c)
}

/// Whether a `.json`/`.jsonl` file is one JSON array (its first non-blank byte is `[`) rather than
/// JSON Lines.
pub(super) fn is_json_array(path: &Path) -> Result<bool> {
    let mut f = File::open(path).map_err(|e| KilnError::io(path, e))?;
    let mut first = [0u8; 1];
    loop {
        use std::io::Read;
        match f.read(&mut first) {
            Ok(0) => break,
            Ok(_) if first[0].is_ascii_whitespace() => continue,
            Ok(_) => break,
            Err(e) => return Err(KilnError::io(path, e)),
        }
    }
    Ok(first[0] == b'[')
}

/// The rows of a JSON file, one object each (JSON Lines or one array): each object's cells and,
/// at the end, a wanted column that no row has — a configuration error, not a thousand
/// malformed rows.
#[derive(Default)]
struct JsonObjects {
    /// The first object's keys, for the error.
    have: Option<Vec<String>>,
    /// Whether any row has the text, text-pair and label columns.
    found: [bool; 3],
}

impl JsonObjects {
    fn row(
        &mut self,
        c: &mut Collector,
        n: usize,
        obj: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<()> {
        self.have
            .get_or_insert_with(|| obj.keys().cloned().collect());
        let cols: &Columns = c.cols;
        let mut get = |k: Option<&String>, slot: usize| {
            let v = k.and_then(|k| obj.get(k));
            self.found[slot] |= v.is_some();
            json_cell(v)
        };
        let text = get(Some(&cols.text), 0);
        let pair = get(cols.text_pair.as_ref(), 1);
        let label = get(cols.label.as_ref(), 2);
        c.row(n, text, pair, label)
    }

    fn finish(self, path: &Path, c: &Collector) -> Result<()> {
        let cols = c.cols;
        let wanted = [
            Some(&cols.text),
            cols.text_pair.as_ref(),
            cols.label.as_ref(),
        ];
        for (w, f) in wanted.iter().zip(self.found) {
            if let (Some(w), false) = (w, f) {
                if c.report.rows > 0 {
                    return Err(missing_column(path, w, &self.have.unwrap_or_default()));
                }
            }
        }
        Ok(())
    }
}

fn read_json_array(path: &Path, c: &mut Collector) -> Result<()> {
    let bytes = std::fs::read(path).map_err(|e| KilnError::io(path, e))?;
    let rows: Vec<serde_json::Value> =
        serde_json::from_slice(&bytes).map_err(|e| KilnError::Parse {
            path: path.to_path_buf(),
            line: e.line(),
            msg: format!("not a JSON array of objects: {e}"),
        })?;
    let mut objects = JsonObjects::default();
    for (i, row) in rows.iter().enumerate() {
        let serde_json::Value::Object(obj) = row else {
            c.skip(i + 1, "not a JSON object".into())?;
            continue;
        };
        objects.row(c, i + 1, obj)?;
    }
    objects.finish(path, c)
}

fn parquet_cell(field: &parquet::record::Field) -> Cell {
    use parquet::record::Field;
    match field {
        Field::Null => Cell::Missing,
        Field::Str(s) => Cell::Str(s.clone()),
        Field::Byte(v) => Cell::Int(v.to_string()),
        Field::Short(v) => Cell::Int(v.to_string()),
        Field::Int(v) => Cell::Int(v.to_string()),
        Field::Long(v) => Cell::Int(v.to_string()),
        Field::UByte(v) => Cell::Int(v.to_string()),
        Field::UShort(v) => Cell::Int(v.to_string()),
        Field::UInt(v) => Cell::Int(v.to_string()),
        Field::ULong(v) => Cell::Int(v.to_string()),
        Field::Bool(_) => Cell::Other("a boolean"),
        Field::Float16(_) | Field::Float(_) | Field::Double(_) => Cell::Other("a float"),
        Field::Decimal(_) => Cell::Other("a decimal"),
        Field::Bytes(_) => Cell::Other("binary data"),
        Field::Date(_)
        | Field::TimeMillis(_)
        | Field::TimeMicros(_)
        | Field::TimestampMillis(_)
        | Field::TimestampMicros(_) => Cell::Other("a date or time"),
        Field::Group(_) => Cell::Other("a struct"),
        Field::ListInternal(_) => Cell::Other("a list"),
        Field::MapInternal(_) => Cell::Other("a map"),
    }
}

/// The `parquet` crate panics on some malformed files (slicing past a buffer, overflowing
/// arithmetic) instead of returning an error. A data file must never crash kiln, so a panic inside
/// the read is caught and becomes an error naming the file. The hook `catch_reader_panics` installs (once, chaining
/// to the previous one) keeps the default panic message and backtrace off stderr for exactly these
/// panics: they are reported as the error instead. An allocation failure aborts and cannot be caught.
fn read_parquet(path: &Path, c: &mut Collector) -> Result<()> {
    catch_reader_panics(path, "Parquet file (the parquet crate", || {
        parquet_rows(path, c)
    })
}

fn parquet_rows(path: &Path, c: &mut Collector) -> Result<()> {
    use parquet::file::reader::{FileReader, SerializedFileReader};
    use parquet::schema::types::Type;
    let not_parquet = |e: parquet::errors::ParquetError| {
        KilnError::Data(format!(
            "{}: not a readable Parquet file: {e}",
            path.display()
        ))
    };
    let f = File::open(path).map_err(|e| KilnError::io(path, e))?;
    let reader = SerializedFileReader::new(f).map_err(not_parquet)?;
    let root = reader
        .metadata()
        .file_metadata()
        .schema_descr()
        .root_schema();
    // Top-level columns: a list or struct column is one column here, named as the user knows it.
    let have: Vec<String> = root
        .get_fields()
        .iter()
        .map(|f| f.name().to_string())
        .collect();
    let cols = c.cols.clone();
    let wanted: Vec<&String> = [
        Some(&cols.text),
        cols.text_pair.as_ref(),
        cols.label.as_ref(),
    ]
    .into_iter()
    .flatten()
    .collect();
    for w in &wanted {
        if !have.contains(w) {
            return Err(missing_column(path, w, &have));
        }
    }
    // Read only the wanted columns: others are never decoded, whatever they hold.
    let projection = Type::group_type_builder(root.name())
        .with_fields(
            root.get_fields()
                .iter()
                .filter(|f| wanted.iter().any(|w| *w == f.name()))
                .cloned()
                .collect(),
        )
        .build()
        .map_err(not_parquet)?;
    let rows = reader.get_row_iter(Some(projection)).map_err(not_parquet)?;
    for (i, row) in rows.enumerate() {
        let n = i + 1;
        let row = row.map_err(|e| KilnError::Parse {
            path: path.to_path_buf(),
            line: n,
            msg: e.to_string(),
        })?;
        let (mut text, mut pair, mut label) = (Cell::Missing, Cell::Missing, Cell::Missing);
        for (name, field) in row.get_column_iter() {
            if *name == cols.text {
                text = parquet_cell(field);
            }
            if Some(name) == cols.text_pair.as_ref() {
                pair = parquet_cell(field);
            }
            if Some(name) == cols.label.as_ref() {
                label = parquet_cell(field);
            }
        }
        c.row(n, text, pair, label)?;
    }
    Ok(())
}
