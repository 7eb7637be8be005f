//! Whole rows of a data file, each a JSON object, for data whose rows hold nested values:
//! supervised fine-tuning rows (`messages`, a list of `{role, content}`; `prompt` and
//! `completion`, strings or lists of messages). [`super::reader`] reads typed text and label
//! columns; this reads every column of every row, as `datasets` would hand the row over.
//!
//! The file kinds are [`super::reader`]'s, dispatched the same way ([`super::reader::source`]):
//! - JSON Lines (`.jsonl`, `.json`, `.ndjson`), or one JSON array of objects (a `.json` whose
//!   first non-blank byte is `[`, numbered by element). A line (element) that is not a JSON object
//!   is a skipped row. As in [`super::reader`] and `datasets` without `field=`, a file holding one
//!   object (`{"data": [...]}` on one line) is one row;
//! - CSV and TSV: the header row gives the keys (trimmed), every cell is a string (an empty cell
//!   the empty string), quotes follow RFC 4180 and a malformed record is a skipped row;
//! - Parquet (`.parquet`, `.pq`), a file or a folder of one split's files (each numbered from 1,
//!   named in its own skipped rows): lists, structs and maps stay nested;
//! - a `datasets` save_to_disk folder (Arrow IPC; rows numbered from 1 across its files): lists,
//!   structs (`list<struct>` messages), maps and dictionary-encoded columns stay nested.
//!
//! Values: strings and booleans as they are; integers as JSON integers; floats as JSON numbers
//! (NaN and infinities, which JSON cannot hold, become `null`, as the `parquet` crate's own JSON
//! conversion does); binary data as a list of its byte values; Parquet dates, times and decimals
//! as the `parquet` crate prints them; Arrow dates and timestamps as `2024-07-26` and
//! `2024-07-26 12:00:00`. A null is `null`. In an Arrow file a value of any other type (a decimal,
//! an interval, …) makes its row a skipped row that names the column and the type.
//!
//! A row that cannot be read is counted in the [`ReadReport`] with its file and line (or row), or
//! with `strict` is an error naming them and the reason. Only regular files are read; a file with
//! no row at all is an error.

use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::Path;

use arrow_array::cast::AsArray;
use arrow_array::types::{
    Date32Type, Date64Type, Float16Type, Float32Type, Float64Type, Int16Type, Int32Type, Int64Type,
    Int8Type, TimestampMicrosecondType, TimestampMillisecondType, TimestampNanosecondType,
    TimestampSecondType, UInt16Type, UInt32Type, UInt64Type, UInt8Type,
};
use arrow_array::{Array, RecordBatch};
use arrow_schema::{DataType, TimeUnit};
use serde_json::{Map, Value};

use super::collector::{catch_reader_panics, ReadReport, Skipped};
use super::csv_quotes::{blank, find_bad_quotes};
use super::reader::{
    check_regular_file, is_json_array, read_text, record_line, source, Source, TextEncoding,
};
use crate::error::{KilnError, Result};

/// One row of a data file.
#[derive(Debug, Clone, PartialEq)]
pub struct Record {
    /// 1-based line (CSV/TSV/JSON Lines), element (JSON array) or row (Parquet, Arrow) in its
    /// file, as [`super::RawExample::line`] numbers it.
    pub line: usize,
    /// The row's columns: key → value, nested values kept as JSON.
    pub fields: Map<String, Value>,
}

/// Every row of the data at `path` as a JSON object (see the module docs for the file kinds);
/// CSV and TSV are read as UTF-8. Malformed rows are skipped and counted in the report, or with
/// `strict` the first one is an error naming its file, line and reason.
pub fn read_records(path: &Path, strict: bool) -> Result<(Vec<Record>, ReadReport)> {
    read_records_with_encoding(path, TextEncoding::Utf8, strict)
}

/// [`read_records`], with CSV and TSV files decoded from `encoding` (JSON Lines, Parquet and
/// Arrow are UTF-8 by definition).
pub fn read_records_with_encoding(
    path: &Path,
    encoding: TextEncoding,
    strict: bool,
) -> Result<(Vec<Record>, ReadReport)> {
    let mut c = Rows::new(path, strict);
    match source(path)? {
        Source::Delimited(delim) => read_delimited(path, delim, encoding, &mut c)?,
        Source::Json if is_json_array(path)? => read_json_array(path, &mut c)?,
        Source::Json => read_jsonl(path, &mut c)?,
        Source::Parquet => read_parquet(path, &mut c)?,
        Source::SavedDataset => read_saved_dataset(path, &mut c)?,
        Source::ParquetShards(shards) => {
            for shard in &shards {
                check_regular_file(shard)?;
                let mut one = Rows::new(shard, strict);
                read_parquet(shard, &mut one)?;
                c.records.append(&mut one.records);
                c.report.rows += one.report.rows;
                c.report.skipped.append(&mut one.report.skipped);
            }
        }
    }
    if c.records.is_empty() {
        return Err(KilnError::Data(format!(
            "{}: no usable rows ({})",
            path.display(),
            c.report.summary()
        )));
    }
    Ok((c.records, c.report))
}

/// The rows read so far from one file and its report (what [`super::collector::Collector`] is to
/// typed rows).
struct Rows<'a> {
    path: &'a Path,
    strict: bool,
    records: Vec<Record>,
    report: ReadReport,
}

impl<'a> Rows<'a> {
    fn new(path: &'a Path, strict: bool) -> Self {
        Rows {
            path,
            strict,
            records: Vec::new(),
            report: ReadReport::default(),
        }
    }

    /// Counts one unusable row, or fails under `strict` (the message [`super::reader`] gives).
    fn skip(&mut self, line: usize, reason: String) -> Result<()> {
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

    fn row(&mut self, line: usize, fields: Map<String, Value>) {
        self.report.rows += 1;
        self.records.push(Record { line, fields });
    }
}

/// JSON Lines: one object a line; blank lines are not rows.
fn read_jsonl(path: &Path, c: &mut Rows) -> Result<()> {
    let f = File::open(path).map_err(|e| KilnError::io(path, e))?;
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
        match serde_json::from_str::<Value>(line) {
            Ok(Value::Object(o)) => c.row(n, o),
            Ok(_) => c.skip(n, "not a JSON object".into())?,
            Err(e) => c.skip(n, format!("invalid JSON: {e}"))?,
        }
    }
    Ok(())
}

/// One JSON array of objects; an element that is not an object is a skipped row.
fn read_json_array(path: &Path, c: &mut Rows) -> Result<()> {
    let bytes = crate::io::files::read_regular(path, "data file")?;
    let rows: Vec<Value> = serde_json::from_slice(&bytes).map_err(|e| KilnError::Parse {
        path: path.to_path_buf(),
        line: e.line(),
        msg: format!("not a JSON array of objects: {e}"),
    })?;
    for (i, row) in rows.into_iter().enumerate() {
        match row {
            Value::Object(o) => c.row(i + 1, o),
            _ => c.skip(i + 1, "not a JSON object".into())?,
        }
    }
    Ok(())
}

/// CSV or TSV: the header row's names are the keys, every cell a string.
fn read_delimited(path: &Path, delim: u8, enc: TextEncoding, c: &mut Rows) -> Result<()> {
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
    let header_error = |msg: String| KilnError::Parse {
        path: path.to_path_buf(),
        line: 1,
        msg,
    };
    let headers: Vec<String> = rdr
        .headers()
        .map_err(|e| header_error(e.to_string()))?
        .iter()
        .map(|h| h.trim().to_string())
        .collect();
    // Two columns of one name would be one key, the second hiding the first.
    for (i, h) in headers.iter().enumerate() {
        if headers[..i].contains(h) {
            return Err(header_error(format!(
                "column '{h}' appears twice in the header row"
            )));
        }
    }
    for rec in rdr.records() {
        let pos = match &rec {
            Ok(r) => r.position(),
            Err(e) => e.position(),
        };
        let line = pos.map_or(0, |p| record_line(text.as_bytes(), p));
        // Blanked records are reported in line order among the rest, as `reader` does.
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
        let fields = headers
            .iter()
            .zip(rec.iter())
            .map(|(h, v)| (h.clone(), Value::String(v.to_string())))
            .collect();
        c.row(line, fields);
    }
    for b in bad {
        c.skip(b.line, b.reason)?;
    }
    Ok(())
}

/// A float as JSON: `null` where JSON has no number for it (NaN, infinities).
fn float(v: f64) -> Value {
    serde_json::Number::from_f64(v).map_or(Value::Null, Value::Number)
}

fn bytes(b: &[u8]) -> Value {
    Value::Array(b.iter().map(|&x| Value::from(x)).collect())
}

/// A Parquet value as JSON.
fn parquet_value(field: &parquet::record::Field) -> Value {
    use parquet::record::Field;
    match field {
        Field::Null => Value::Null,
        Field::Bool(b) => Value::Bool(*b),
        Field::Byte(v) => Value::from(*v),
        Field::Short(v) => Value::from(*v),
        Field::Int(v) => Value::from(*v),
        Field::Long(v) => Value::from(*v),
        Field::UByte(v) => Value::from(*v),
        Field::UShort(v) => Value::from(*v),
        Field::UInt(v) => Value::from(*v),
        Field::ULong(v) => Value::from(*v),
        Field::Float16(v) => float(f64::from(*v)),
        Field::Float(v) => float(f64::from(*v)),
        Field::Double(v) => float(*v),
        Field::Str(s) => Value::String(s.clone()),
        Field::Bytes(b) => bytes(b.data()),
        Field::Decimal(_)
        | Field::Date(_)
        | Field::TimeMillis(_)
        | Field::TimeMicros(_)
        | Field::TimestampMillis(_)
        | Field::TimestampMicros(_) => Value::String(field.to_string()),
        Field::Group(row) => Value::Object(
            row.get_column_iter()
                .map(|(k, v)| (k.clone(), parquet_value(v)))
                .collect(),
        ),
        Field::ListInternal(list) => {
            Value::Array(list.elements().iter().map(parquet_value).collect())
        }
        Field::MapInternal(map) => Value::Object(
            map.entries()
                .iter()
                .map(|(k, v)| {
                    let key = match parquet_value(k) {
                        Value::String(s) => s,
                        other => other.to_string(),
                    };
                    (key, parquet_value(v))
                })
                .collect(),
        ),
    }
}

/// A Parquet file, every column of every row (panics of the `parquet` crate caught as
/// [`super::reader`] catches them).
fn read_parquet(path: &Path, c: &mut Rows) -> Result<()> {
    catch_reader_panics(path, "Parquet file (the parquet crate", || {
        use parquet::file::reader::{FileReader, SerializedFileReader};
        let not_parquet = |e: parquet::errors::ParquetError| {
            KilnError::Data(format!(
                "{}: not a readable Parquet file: {e}",
                path.display()
            ))
        };
        let f = File::open(path).map_err(|e| KilnError::io(path, e))?;
        let reader = SerializedFileReader::new(f).map_err(not_parquet)?;
        let rows = reader.get_row_iter(None).map_err(not_parquet)?;
        for (i, row) in rows.enumerate() {
            let n = i + 1;
            let row = row.map_err(|e| KilnError::Parse {
                path: path.to_path_buf(),
                line: n,
                msg: e.to_string(),
            })?;
            let fields = row
                .get_column_iter()
                .map(|(k, v)| (k.clone(), parquet_value(v)))
                .collect();
            c.row(n, fields);
        }
        Ok(())
    })
}

/// A saved `datasets` Dataset: its Arrow files in order, rows numbered from 1 across them.
fn read_saved_dataset(dir: &Path, c: &mut Rows) -> Result<()> {
    let mut n = 0;
    for file in super::saved_dataset::data_files(dir)? {
        check_regular_file(&file)?;
        catch_reader_panics(&file, "Arrow file (arrow-ipc", || {
            for batch in super::saved_dataset::batches(&file)? {
                read_batch(&batch?, c, &mut n)?;
            }
            Ok(())
        })?;
    }
    Ok(())
}

fn read_batch(batch: &RecordBatch, c: &mut Rows, n: &mut usize) -> Result<()> {
    let schema = batch.schema();
    for i in 0..batch.num_rows() {
        *n += 1;
        let fields: std::result::Result<Map<String, Value>, String> = schema
            .fields()
            .iter()
            .zip(batch.columns())
            .map(|(f, a)| {
                arrow_value(a.as_ref(), i)
                    .map(|v| (f.name().clone(), v))
                    .map_err(|ty| {
                        format!("column '{}' holds {ty}, which kiln cannot read", f.name())
                    })
            })
            .collect();
        match fields {
            Ok(fields) => c.row(*n, fields),
            Err(reason) => c.skip(*n, reason)?,
        }
    }
    Ok(())
}

/// Element `i` of an Arrow array as JSON, or the name of a type that has no conversion.
fn arrow_value(a: &dyn Array, i: usize) -> std::result::Result<Value, String> {
    if a.is_null(i) {
        return Ok(Value::Null);
    }
    let list = |values: &dyn Array| -> std::result::Result<Value, String> {
        (0..values.len())
            .map(|j| arrow_value(values, j))
            .collect::<std::result::Result<Vec<_>, _>>()
            .map(Value::Array)
    };
    Ok(match a.data_type() {
        DataType::Null => Value::Null,
        DataType::Boolean => Value::Bool(a.as_boolean().value(i)),
        DataType::Int8 => Value::from(a.as_primitive::<Int8Type>().value(i)),
        DataType::Int16 => Value::from(a.as_primitive::<Int16Type>().value(i)),
        DataType::Int32 => Value::from(a.as_primitive::<Int32Type>().value(i)),
        DataType::Int64 => Value::from(a.as_primitive::<Int64Type>().value(i)),
        DataType::UInt8 => Value::from(a.as_primitive::<UInt8Type>().value(i)),
        DataType::UInt16 => Value::from(a.as_primitive::<UInt16Type>().value(i)),
        DataType::UInt32 => Value::from(a.as_primitive::<UInt32Type>().value(i)),
        DataType::UInt64 => Value::from(a.as_primitive::<UInt64Type>().value(i)),
        DataType::Float16 => float(a.as_primitive::<Float16Type>().value(i).to_f64()),
        DataType::Float32 => float(f64::from(a.as_primitive::<Float32Type>().value(i))),
        DataType::Float64 => float(a.as_primitive::<Float64Type>().value(i)),
        DataType::Utf8 => Value::String(a.as_string::<i32>().value(i).to_string()),
        DataType::LargeUtf8 => Value::String(a.as_string::<i64>().value(i).to_string()),
        DataType::Utf8View => Value::String(a.as_string_view().value(i).to_string()),
        DataType::Binary => bytes(a.as_binary::<i32>().value(i)),
        DataType::LargeBinary => bytes(a.as_binary::<i64>().value(i)),
        DataType::BinaryView => bytes(a.as_binary_view().value(i)),
        DataType::FixedSizeBinary(_) => bytes(a.as_fixed_size_binary().value(i)),
        DataType::List(_) => list(a.as_list::<i32>().value(i).as_ref())?,
        DataType::LargeList(_) => list(a.as_list::<i64>().value(i).as_ref())?,
        DataType::FixedSizeList(..) => list(a.as_fixed_size_list().value(i).as_ref())?,
        DataType::Struct(fields) => {
            let s = a.as_struct();
            let mut obj = Map::new();
            for (f, child) in fields.iter().zip(s.columns()) {
                obj.insert(f.name().clone(), arrow_value(child.as_ref(), i)?);
            }
            Value::Object(obj)
        }
        DataType::Map(..) => {
            let entries = a.as_map().value(i);
            let (keys, values) = (entries.column(0), entries.column(1));
            let mut obj = Map::new();
            for j in 0..entries.len() {
                let key = match arrow_value(keys.as_ref(), j)? {
                    Value::String(s) => s,
                    other => other.to_string(),
                };
                obj.insert(key, arrow_value(values.as_ref(), j)?);
            }
            Value::Object(obj)
        }
        DataType::Dictionary(key, _) => {
            let (k, values) = match key.as_ref() {
                DataType::Int8 => dict_key::<Int8Type>(a, i),
                DataType::Int16 => dict_key::<Int16Type>(a, i),
                DataType::Int32 => dict_key::<Int32Type>(a, i),
                DataType::Int64 => dict_key::<Int64Type>(a, i),
                DataType::UInt8 => dict_key::<UInt8Type>(a, i),
                DataType::UInt16 => dict_key::<UInt16Type>(a, i),
                DataType::UInt32 => dict_key::<UInt32Type>(a, i),
                DataType::UInt64 => dict_key::<UInt64Type>(a, i),
                other => return Err(format!("a dictionary with {other} keys")),
            };
            match k {
                Some(k) if k < values.len() => arrow_value(values.as_ref(), k)?,
                _ => Value::Null,
            }
        }
        DataType::Date32 => date(a.as_primitive::<Date32Type>().value_as_date(i))?,
        DataType::Date64 => date(a.as_primitive::<Date64Type>().value_as_date(i))?,
        DataType::Timestamp(unit, _) => {
            let t = match unit {
                TimeUnit::Second => a.as_primitive::<TimestampSecondType>().value_as_datetime(i),
                TimeUnit::Millisecond => a
                    .as_primitive::<TimestampMillisecondType>()
                    .value_as_datetime(i),
                TimeUnit::Microsecond => a
                    .as_primitive::<TimestampMicrosecondType>()
                    .value_as_datetime(i),
                TimeUnit::Nanosecond => a
                    .as_primitive::<TimestampNanosecondType>()
                    .value_as_datetime(i),
            };
            date(t)?
        }
        other => return Err(format!("a value of type {other}")),
    })
}

/// A date or time as its text, or why not (out of range).
fn date(d: Option<impl std::fmt::Display>) -> std::result::Result<Value, String> {
    d.map(|d| Value::String(d.to_string()))
        .ok_or_else(|| "a date or time out of range".to_string())
}

/// Element `i`'s key into a dictionary array's values, and those values.
fn dict_key<K: arrow_array::types::ArrowDictionaryKeyType>(
    a: &dyn Array,
    i: usize,
) -> (Option<usize>, arrow_array::ArrayRef) {
    let d = a.as_dictionary::<K>();
    (d.key(i), d.values().clone())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use std::path::PathBuf;

    fn fixtures() -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/datasets")
    }

    fn write(dir: &tempfile::TempDir, name: &str, text: &str) -> PathBuf {
        let p = dir.path().join(name);
        std::fs::write(&p, text).unwrap();
        p
    }

    fn obj(v: Value) -> Map<String, Value> {
        match v {
            Value::Object(o) => o,
            _ => panic!("not an object"),
        }
    }

    #[test]
    fn jsonl_keeps_nested_messages_and_skips_a_malformed_line() {
        let dir = tempfile::tempdir().unwrap();
        let p = write(
            &dir,
            "chat.jsonl",
            concat!(
                r#"{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]}"#,
                "\n\n",
                r#"{"messages": [{"role": "user", "content": "Hi"}"#,
                "\n",
                r#"["not", "an", "object"]"#,
                "\n",
                r#"{"prompt": [{"role": "user", "content": "2+2?"}], "completion": [{"role": "assistant", "content": "4"}], "n": 1.5}"#,
                "\n",
            ),
        );
        let (rows, report) = read_records(&p, false).unwrap();
        assert_eq!(rows.len(), 2);
        assert_eq!(rows[0].line, 1);
        assert_eq!(
            rows[0].fields,
            obj(json!({"messages": [
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello!"}
            ]}))
        );
        assert_eq!(rows[1].line, 5);
        assert_eq!(rows[1].fields["completion"][0]["content"], "4");
        assert_eq!(rows[1].fields["n"], json!(1.5));
        assert_eq!(report.rows, 4);
        assert_eq!(report.skipped.len(), 2);
        assert_eq!(
            (report.skipped[0].path.as_path(), report.skipped[0].line),
            (p.as_path(), 3)
        );
        assert!(
            report.skipped[0].reason.starts_with("invalid JSON"),
            "{:?}",
            report.skipped[0]
        );
        assert_eq!(report.skipped[1].line, 4);
        assert_eq!(report.skipped[1].reason, "not a JSON object");
        assert!(report.summary().starts_with("2/4 rows used, 2 skipped"));

        let err = read_records(&p, true).unwrap_err().to_string();
        assert!(err.contains("chat.jsonl:3: invalid JSON"), "{err}");
        assert!(err.ends_with("(--strict)"), "{err}");
    }

    #[test]
    fn no_usable_row_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let p = write(&dir, "bad.jsonl", "nope\n1\n");
        let err = read_records(&p, false).unwrap_err().to_string();
        assert!(
            err.contains("bad.jsonl: no usable rows (0/2 rows used"),
            "{err}"
        );
    }

    #[test]
    fn csv_cells_are_strings_keyed_by_the_header() {
        let dir = tempfile::tempdir().unwrap();
        let p = write(
            &dir,
            "pc.csv",
            "prompt, completion ,n\n\"Say \"\"hi\"\"\",\"hi,\nthere\",1\nshort,row\nx,,3\n",
        );
        let (rows, report) = read_records(&p, false).unwrap();
        assert_eq!(rows.len(), 2);
        assert_eq!(rows[0].line, 2);
        assert_eq!(
            rows[0].fields,
            obj(json!({"prompt": "Say \"hi\"", "completion": "hi,\nthere", "n": "1"}))
        );
        assert_eq!(rows[1].line, 5);
        assert_eq!(
            rows[1].fields,
            obj(json!({"prompt": "x", "completion": "", "n": "3"}))
        );
        assert_eq!(report.rows, 3);
        assert_eq!(report.skipped.len(), 1);
        assert_eq!(report.skipped[0].line, 4);
        assert_eq!(report.skipped[0].reason, "expected 3 fields, found 2");

        let tsv = write(&dir, "t.tsv", "text\tlabel\nhello, world\tpos\n");
        let (rows, _) = read_records(&tsv, true).unwrap();
        assert_eq!(
            rows[0].fields,
            obj(json!({"text": "hello, world", "label": "pos"}))
        );

        let dup = write(&dir, "dup.csv", "a,b,a\n1,2,3\n");
        let err = read_records(&dup, false).unwrap_err().to_string();
        assert!(err.contains("dup.csv:1: column 'a' appears twice"), "{err}");
    }

    #[test]
    fn json_array_rows_are_numbered_by_element() {
        let dir = tempfile::tempdir().unwrap();
        let p = write(
            &dir,
            "rows.json",
            r#"  [{"text": "a", "tags": ["x", "y"]}, 3, {"text": "b", "meta": {"k": null}}]"#,
        );
        let (rows, report) = read_records(&p, false).unwrap();
        assert_eq!(rows.len(), 2);
        assert_eq!(
            rows[0].fields,
            obj(json!({"text": "a", "tags": ["x", "y"]}))
        );
        assert_eq!(
            (rows[1].line, &rows[1].fields["meta"]),
            (3, &json!({"k": null}))
        );
        assert_eq!(report.skipped.len(), 1);
        assert_eq!(report.skipped[0].line, 2);

        let broken = write(&dir, "broken.json", "[{\"text\": \"a\"},\n{\"text\": ");
        let err = read_records(&broken, false).unwrap_err().to_string();
        assert!(
            err.contains("broken.json:2: not a JSON array of objects"),
            "{err}"
        );
    }

    #[test]
    fn unknown_kinds_and_dataset_dicts_are_errors_as_in_reader() {
        let dir = tempfile::tempdir().unwrap();
        let p = write(&dir, "rows.txt", "hello\n");
        let err = read_records(&p, false).unwrap_err().to_string();
        assert!(err.contains("unknown data format \"txt\""), "{err}");
        let err = read_records(&fixtures().join("tweets_dict"), false)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("a DatasetDict (splits train, validation)"),
            "{err}"
        );
        std::fs::create_dir(dir.path().join("x.jsonl")).unwrap();
        let err = read_records(&dir.path().join("x.jsonl"), false)
            .unwrap_err()
            .to_string();
        assert!(err.contains("not a regular file"), "{err}");
    }

    /// The rows every format of the `chat_messages` fixture holds (gen_sft_datasets.py).
    fn chat_rows() -> Vec<Record> {
        let (rows, report) =
            read_records(&fixtures().join("chat_messages/rows.jsonl"), true).unwrap();
        assert_eq!((rows.len(), report.rows), (5, 5));
        rows
    }

    #[test]
    fn nested_parquet_and_saved_dataset_read_as_their_json_rows() {
        let want = chat_rows();
        assert_eq!(want[2].fields["score"], Value::Null);
        assert_eq!(
            want[2].fields["messages"][1],
            json!({"role": "assistant", "content": "Très bien,\nmerci !\t—"})
        );
        for path in ["chat_messages/train.parquet", "chat_messages/saved"] {
            let (rows, report) = read_records(&fixtures().join(path), true).unwrap();
            assert_eq!(report.rows, 5, "{path}");
            assert!(report.skipped.is_empty(), "{path}");
            assert_eq!(rows, want, "{path}");
        }
    }

    #[test]
    fn committed_datasets_fixtures_read_as_records() {
        // A save_to_disk Dataset: plain string columns.
        let (rows, report) = read_records(&fixtures().join("single_train"), false).unwrap();
        assert_eq!((rows.len(), report.rows), (200, 200));
        assert_eq!(rows[0].line, 1);
        // Columns in the dataset's order, as `datasets` hands a row over.
        let keys: Vec<&String> = rows[0].fields.keys().collect();
        assert_eq!(keys, ["text", "sentiment"]);
        assert!(rows.iter().all(|r| r.fields["text"].is_string()));

        // Sharded across three Arrow files: numbered across them, as reader.rs numbers them.
        let (rows, _) = read_records(&fixtures().join("sharded_train"), false).unwrap();
        assert_eq!(rows.len(), 200);
        assert_eq!(rows.last().unwrap().line, 200);
        // The ClassLabel column keeps its integer ids (as `datasets` hands rows over); a null
        // float is null.
        assert!(rows
            .iter()
            .all(|r| r.fields["label"].as_u64().is_some_and(|l| l < 3)));
        assert!(rows.iter().any(|r| r.fields["confidence"].is_null()));
        assert!(rows.iter().any(|r| r.fields["confidence"].is_f64()));

        // The Hub's Parquet conversion: a folder of one split's files, and one file of it.
        let split = fixtures().join("hub_parquet/default/train");
        let (from_folder, _) = read_records(&split, false).unwrap();
        let (from_file, _) = read_records(&split.join("0000.parquet"), false).unwrap();
        assert_eq!(from_folder, from_file);
        // The same rows as the save_to_disk Dataset.
        let (saved, _) = read_records(&fixtures().join("tweets_dict/train"), false).unwrap();
        assert_eq!(from_file, saved);

        // The same rows as a CSV file (label names, cells strings) and datasets' to_json array.
        let (csv_rows, _) = read_records(&fixtures().join("tweets_train_200.csv"), false).unwrap();
        assert_eq!(csv_rows.len(), 200);
        for (c, s) in csv_rows.iter().zip(&saved) {
            assert_eq!(c.fields["text"], s.fields["text"]);
        }
        let (json_rows, _) =
            read_records(&fixtures().join("tweets_validation_100.json"), false).unwrap();
        let (val, _) = read_records(&fixtures().join("tweets_dict/validation"), false).unwrap();
        assert_eq!(json_rows.len(), 100);
        for (j, v) in json_rows.iter().zip(&val) {
            assert_eq!(j.fields["text"], v.fields["text"]);
            assert_eq!(j.fields["label"], v.fields["label"]);
        }
    }

    #[test]
    fn arrow_values_convert_recursively() {
        use arrow_array::builder::{ListBuilder, StringBuilder};
        use arrow_array::{
            BooleanArray, DictionaryArray, Float64Array, Int32Array, StringArray, StructArray,
        };
        use arrow_schema::Field;
        use std::sync::Arc;

        let mut lists = ListBuilder::new(StringBuilder::new());
        lists.values().append_value("a");
        lists.values().append_null();
        lists.append(true);
        lists.append(false);
        let lists = lists.finish();
        assert_eq!(arrow_value(&lists, 0).unwrap(), json!(["a", null]));
        assert_eq!(arrow_value(&lists, 1).unwrap(), Value::Null);

        let s = StructArray::from(vec![
            (
                Arc::new(Field::new("ok", DataType::Boolean, true)),
                Arc::new(BooleanArray::from(vec![Some(true), None])) as arrow_array::ArrayRef,
            ),
            (
                Arc::new(Field::new("x", DataType::Float64, false)),
                Arc::new(Float64Array::from(vec![f64::NAN, -0.25])) as arrow_array::ArrayRef,
            ),
        ]);
        assert_eq!(arrow_value(&s, 0).unwrap(), json!({"ok": true, "x": null}));
        assert_eq!(arrow_value(&s, 1).unwrap(), json!({"ok": null, "x": -0.25}));
        // A struct's fields keep the schema's order (a tool schema's `tojson` prints them so).
        let tool = StructArray::from(vec![
            (
                Arc::new(Field::new("type", DataType::Utf8, false)),
                Arc::new(StringArray::from(vec!["function"])) as arrow_array::ArrayRef,
            ),
            (
                Arc::new(Field::new("function", DataType::Utf8, false)),
                Arc::new(StringArray::from(vec!["f"])) as arrow_array::ArrayRef,
            ),
        ]);
        let tool = arrow_value(&tool, 0).unwrap();
        let keys: Vec<_> = tool.as_object().unwrap().keys().collect();
        assert_eq!(keys, ["type", "function"]);

        let d: DictionaryArray<arrow_array::types::Int8Type> =
            vec!["user", "assistant", "user"].into_iter().collect();
        assert_eq!(arrow_value(&d, 2).unwrap(), json!("user"));
        assert_eq!(arrow_value(&d, 1).unwrap(), json!("assistant"));

        assert_eq!(
            arrow_value(&Int32Array::from(vec![-7]), 0).unwrap(),
            json!(-7)
        );
        assert_eq!(
            arrow_value(&StringArray::from(vec!["é"]), 0).unwrap(),
            json!("é")
        );
        let dates = arrow_array::Date32Array::from(vec![19930]);
        assert_eq!(arrow_value(&dates, 0).unwrap(), json!("2024-07-26"));
        let dec = arrow_array::Decimal128Array::from(vec![1]);
        assert!(arrow_value(&dec, 0).unwrap_err().contains("Decimal128"));
    }
}
