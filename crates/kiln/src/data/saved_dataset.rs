//! Hugging Face `datasets` data as that library leaves it: `save_to_disk` folders (a Dataset: Arrow
//! IPC stream files listed in `state.json`, features in `dataset_info.json`; a DatasetDict: one
//! such folder per split, named in `dataset_dict.json`), and the `ClassLabel` features that
//! `datasets` also writes into Parquet files' metadata (the Hub's Parquet conversions): integer
//! labels become the ClassLabel's names, in its order.

use std::fs::File;
use std::path::{Path, PathBuf};

use arrow_array::cast::AsArray;
use arrow_array::types::{
    Int16Type, Int32Type, Int64Type, Int8Type, UInt16Type, UInt32Type, UInt64Type, UInt8Type,
};
use arrow_array::{Array, RecordBatch};
use arrow_schema::DataType;

use super::collector::{
    catch_reader_panics, check_regular_file, missing_column, Cell, Collector, Columns, RawExample,
    ReadReport, Skipped,
};
use crate::error::{KilnError, Result};

/// Whether `dir` is one saved Dataset (not a DatasetDict).
pub fn is_saved_dataset(dir: &Path) -> bool {
    dir.join("state.json").exists()
        || dir.join("dataset_info.json").exists()
        || arrow_files_in(dir).is_ok_and(|f| !f.is_empty())
}

fn arrow_files_in(dir: &Path) -> std::io::Result<Vec<PathBuf>> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "arrow"))
        .collect();
    files.sort();
    Ok(files)
}

/// The split names of a DatasetDict folder, as `dataset_dict.json` lists them.
pub fn dict_split_names(dir: &Path) -> Result<Vec<String>> {
    #[derive(serde::Deserialize)]
    struct Dict {
        splits: Vec<String>,
    }
    let path = dir.join("dataset_dict.json");
    let d: Dict = crate::io::read_json(&path)?;
    // Split names become folder paths: only plain names are splits.
    if let Some(bad) = d
        .splits
        .iter()
        .find(|s| s.is_empty() || s.contains(['/', '\\']) || *s == "." || *s == "..")
    {
        return Err(KilnError::Data(format!(
            "{}: split {bad:?} is not a folder name in the DatasetDict",
            path.display()
        )));
    }
    Ok(d.splits)
}

/// The train and eval split folders of the DatasetDict `dir`: `train_split` (default `train`)
/// when `want_train`, and `eval_split`, else `validation`, else `test` (none if it has neither).
pub fn dict_splits(
    dir: &Path,
    train_split: Option<&str>,
    eval_split: Option<&str>,
    want_train: bool,
) -> Result<(Option<PathBuf>, Option<PathBuf>)> {
    if !dir.join("dataset_dict.json").exists() {
        let hint = if is_saved_dataset(dir) {
            " (it is a single Dataset: give it as --train-file or --eval-file)"
        } else {
            ""
        };
        return Err(KilnError::Config(format!(
            "{}: not a `datasets` DatasetDict folder: no dataset_dict.json{hint}",
            dir.display()
        )));
    }
    let splits = dict_split_names(dir)?;
    let pick = |name: &str| -> Result<PathBuf> {
        if splits.iter().any(|s| s == name) {
            Ok(dir.join(name))
        } else {
            Err(KilnError::Config(format!(
                "{}: no split {name:?} (splits: {})",
                dir.display(),
                splits.join(", ")
            )))
        }
    };
    let train = if want_train {
        Some(pick(train_split.unwrap_or("train"))?)
    } else {
        None
    };
    let eval = match eval_split {
        Some(name) => Some(pick(name)?),
        None => ["validation", "test"]
            .into_iter()
            .find(|s| splits.iter().any(|x| x == s))
            .map(|s| dir.join(s)),
    };
    Ok((train, eval))
}

/// The `datasets` features JSON of a data path and the file that holds it: `dataset_info.json`
/// of a saved Dataset, or the `huggingface` key of a Parquet file's metadata (the first file of
/// a folder of them).
fn features(path: &Path) -> Result<Option<(PathBuf, serde_json::Value)>> {
    if path.is_dir() && is_saved_dataset(path) {
        let info = path.join("dataset_info.json");
        if !info.exists() {
            return Ok(None);
        }
        let v: serde_json::Value = crate::io::read_json(&info)?;
        return Ok(v.get("features").cloned().map(|f| (info, f)));
    }
    let file = if path.is_dir() {
        let mut shards: Vec<PathBuf> = std::fs::read_dir(path)
            .map_err(|e| KilnError::io(path, e))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|e| e == "parquet"))
            .collect();
        shards.sort();
        match shards.into_iter().next() {
            Some(f) => f,
            None => return Ok(None),
        }
    } else if path.extension().is_some_and(|e| e == "parquet") {
        path.to_path_buf()
    } else {
        return Ok(None);
    };
    catch_reader_panics(&file, "Parquet file (the parquet crate", || {
        use parquet::file::reader::{FileReader, SerializedFileReader};
        let f = File::open(&file).map_err(|e| KilnError::io(&file, e))?;
        let Ok(reader) = SerializedFileReader::new(f) else {
            return Ok(None); // the row reader reports a broken file
        };
        let meta = reader.metadata().file_metadata().key_value_metadata();
        let hf = meta
            .into_iter()
            .flatten()
            .find(|kv| kv.key == "huggingface")
            .and_then(|kv| kv.value.clone());
        Ok(hf
            .and_then(|v| serde_json::from_str::<serde_json::Value>(&v).ok())
            .and_then(|v| v.get("info")?.get("features").cloned())
            .map(|f| (file.clone(), f)))
    })
}

/// The names of `column`'s ClassLabel, when the data's `datasets` features declare one.
pub fn class_names(path: &Path, column: &str) -> Result<Option<Vec<String>>> {
    let Some((source, features)) = features(path)? else {
        return Ok(None);
    };
    let Some(f) = features.get(column) else {
        return Ok(None);
    };
    if f.get("_type").and_then(|t| t.as_str()) != Some("ClassLabel") {
        return Ok(None);
    }
    let names = f
        .get("names")
        .and_then(|n| n.as_array())
        .map(|a| {
            a.iter()
                .map(|n| n.as_str().map(str::to_string))
                .collect::<Option<Vec<_>>>()
        })
        .unwrap_or(None);
    match names {
        Some(n) if !n.is_empty() => {
            refuse_duplicate_names(&source, column, &n)?;
            Ok(Some(n))
        }
        _ => Err(KilnError::Data(format!(
            "{}: the ClassLabel of column '{column}' has no list of names",
            path.display()
        ))),
    }
}

/// Two ids with one name would be one class: the rows of both train on the same target, and
/// the metrics count them as the same. `datasets`' ClassLabel refuses such names; so does kiln.
fn refuse_duplicate_names(source: &Path, column: &str, names: &[String]) -> Result<()> {
    let mut seen = std::collections::HashSet::new();
    match names.iter().find(|n| !seen.insert(n.as_str())) {
        Some(dup) => Err(KilnError::Data(format!(
            "{}: the ClassLabel of column '{column}' names {dup:?} twice; label names must be distinct",
            source.display()
        ))),
        None => Ok(()),
    }
}

/// Integer labels of a ClassLabel column → its names. An id outside the names (`-1` is how
/// `datasets` marks an unlabelled row, as in GLUE's test splits) is a skipped row.
pub(super) fn apply_class_names(
    path: &Path,
    cols: &Columns,
    rows: Vec<RawExample>,
    mut report: ReadReport,
    strict: bool,
) -> Result<(Vec<RawExample>, ReadReport)> {
    let Some(col) = cols.label.as_deref() else {
        return Ok((rows, report));
    };
    let Some(names) = class_names(path, col)? else {
        return Ok((rows, report));
    };
    let mut kept = Vec::with_capacity(rows.len());
    for mut r in rows {
        let Some(id) = r.label.as_deref().and_then(|l| l.parse::<i64>().ok()) else {
            kept.push(r); // a name already
            continue;
        };
        match usize::try_from(id).ok().and_then(|i| names.get(i)) {
            Some(name) => {
                r.label = Some(name.clone());
                kept.push(r);
            }
            None => {
                let why = if id == -1 {
                    "label -1 (unlabelled: datasets marks test rows without labels so)".to_string()
                } else {
                    format!(
                        "label id {id} is not one of the ClassLabel's {} names",
                        names.len()
                    )
                };
                let s = Skipped {
                    path: path.to_path_buf(),
                    line: r.line,
                    reason: why,
                };
                if strict {
                    return Err(KilnError::Data(format!("{s} (--strict)")));
                }
                report.skipped.push(s);
            }
        }
    }
    if kept.is_empty() {
        return Err(KilnError::Data(format!(
            "{}: no usable rows ({})",
            path.display(),
            report.summary()
        )));
    }
    Ok((kept, report))
}

/// The Arrow files of a saved Dataset in order: `state.json`'s `_data_files`, else by name.
pub(super) fn data_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let state = dir.join("state.json");
    if !state.exists() {
        return arrow_files_in(dir).map_err(|e| KilnError::io(dir, e));
    }
    let v: serde_json::Value = crate::io::read_json(&state)?;
    let files = v["_data_files"]
        .as_array()
        .ok_or_else(|| KilnError::Data(format!("{}: no \"_data_files\" list", state.display())))?;
    files
        .iter()
        .map(|f| {
            let name = f["filename"].as_str().unwrap_or("");
            // Data files sit in the folder: a path elsewhere is not one of them.
            if name.is_empty() || name.contains('/') || name.contains('\\') || name == ".." {
                return Err(KilnError::Data(format!(
                    "{}: {f} is not a file name in the dataset folder",
                    state.display()
                )));
            }
            Ok(dir.join(name))
        })
        .collect()
}

/// Rows of a saved Dataset, numbered from 1 across its files.
pub(super) fn read(dir: &Path, c: &mut Collector) -> Result<()> {
    let mut n = 0;
    for file in data_files(dir)? {
        check_regular_file(&file)?;
        catch_reader_panics(&file, "Arrow file (arrow-ipc", || {
            for batch in batches(&file)? {
                read_batch(dir, &batch?, c, &mut n)?;
            }
            Ok(())
        })?;
    }
    Ok(())
}

/// The record batches of an Arrow IPC file: stream format (what `datasets` writes), or file
/// format, whose body after the 8-byte magic is the same stream.
pub(super) fn batches(path: &Path) -> Result<impl Iterator<Item = Result<RecordBatch>>> {
    let bad = |e: String| {
        KilnError::Data(format!(
            "{}: not a readable Arrow file: {e}",
            path.display()
        ))
    };
    let bytes = std::fs::read(path).map_err(|e| KilnError::io(path, e))?;
    let start = if bytes.starts_with(b"ARROW1") { 8 } else { 0 };
    check_framing(&bytes, start).map_err(bad)?;
    let mut stream = std::io::Cursor::new(bytes);
    stream.set_position(start as u64);
    let reader =
        arrow_ipc::reader::StreamReader::try_new(stream, None).map_err(|e| bad(e.to_string()))?;
    let owned = path.to_path_buf();
    Ok(reader.map(move |r| {
        r.map_err(|e| {
            KilnError::Data(format!(
                "{}: not a readable Arrow file: {e}",
                owned.display()
            ))
        })
    }))
}

/// Every message of the IPC stream in `bytes[start..]` declares sizes that fit in the file.
/// arrow-ipc allocates a message's declared body before reading it, so a corrupt length would be
/// an allocation without bound (an abort, not an error).
fn check_framing(bytes: &[u8], start: usize) -> std::result::Result<(), String> {
    let word = |at: usize| {
        bytes
            .get(at..at + 4)
            .map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    };
    let mut pos = start;
    while pos < bytes.len() {
        let mut len = word(pos).ok_or("the file ends inside a message header")?;
        pos += 4;
        if len == -1 {
            // The continuation marker, then the metadata length.
            len = word(pos).ok_or("the file ends inside a message header")?;
            pos += 4;
        }
        if len == 0 {
            return Ok(()); // end of stream
        }
        let meta = usize::try_from(len)
            .ok()
            .and_then(|l| bytes.get(pos..pos.checked_add(l)?))
            .ok_or_else(|| format!("a message at byte {pos} declares {len} bytes of metadata, past the end of the file"))?;
        let message = arrow_ipc::root_as_message(meta)
            .map_err(|e| format!("the message at byte {pos}: {e}"))?;
        pos += meta.len();
        let body = message.bodyLength();
        pos = usize::try_from(body)
            .ok()
            .and_then(|b| pos.checked_add(b))
            .filter(|&end| end <= bytes.len())
            .ok_or_else(|| format!("a message at byte {pos} declares a body of {body} bytes, past the end of the file"))?;
    }
    Ok(())
}

fn read_batch(dir: &Path, batch: &RecordBatch, c: &mut Collector, n: &mut usize) -> Result<()> {
    let cols = c.cols.clone();
    let schema = batch.schema();
    let have: Vec<String> = schema.fields().iter().map(|f| f.name().clone()).collect();
    let column = |name: Option<&String>| -> Result<Option<&std::sync::Arc<dyn Array>>> {
        let Some(name) = name else { return Ok(None) };
        batch
            .column_by_name(name)
            .map(Some)
            .ok_or_else(|| missing_column(dir, name, &have))
    };
    let text = column(Some(&cols.text))?;
    let pair = column(cols.text_pair.as_ref())?;
    let label = column(cols.label.as_ref())?;
    for i in 0..batch.num_rows() {
        *n += 1;
        let get = |a: Option<&std::sync::Arc<dyn Array>>| a.map_or(Cell::Missing, |a| cell(a, i));
        c.row(*n, get(text), get(pair), get(label))?;
    }
    Ok(())
}

fn cell(a: &dyn Array, i: usize) -> Cell {
    if a.is_null(i) {
        return Cell::Missing;
    }
    let int = |s: String| Cell::Int(s);
    match a.data_type() {
        DataType::Utf8 => Cell::Str(a.as_string::<i32>().value(i).to_string()),
        DataType::LargeUtf8 => Cell::Str(a.as_string::<i64>().value(i).to_string()),
        DataType::Utf8View => Cell::Str(a.as_string_view().value(i).to_string()),
        DataType::Int8 => int(a.as_primitive::<Int8Type>().value(i).to_string()),
        DataType::Int16 => int(a.as_primitive::<Int16Type>().value(i).to_string()),
        DataType::Int32 => int(a.as_primitive::<Int32Type>().value(i).to_string()),
        DataType::Int64 => int(a.as_primitive::<Int64Type>().value(i).to_string()),
        DataType::UInt8 => int(a.as_primitive::<UInt8Type>().value(i).to_string()),
        DataType::UInt16 => int(a.as_primitive::<UInt16Type>().value(i).to_string()),
        DataType::UInt32 => int(a.as_primitive::<UInt32Type>().value(i).to_string()),
        DataType::UInt64 => int(a.as_primitive::<UInt64Type>().value(i).to_string()),
        DataType::Float16 | DataType::Float32 | DataType::Float64 => Cell::Other("a float"),
        DataType::Boolean => Cell::Other("a boolean"),
        DataType::List(_) | DataType::LargeList(_) | DataType::FixedSizeList(..) => {
            Cell::Other("a list")
        }
        DataType::Struct(_) => Cell::Other("a struct"),
        DataType::Binary | DataType::LargeBinary => Cell::Other("binary data"),
        _ => Cell::Other("a value of another type"),
    }
}
