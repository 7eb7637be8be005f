//! Property fuzzing of the data readers: random bytes, and random mutations of small valid CSV, TSV,
//! JSONL, Parquet and text files, must read as `Ok` or `Err` and never panic; every `Ok` row must be
//! usable (non-empty text, a non-empty trimmed label that the inferred label set knows).
//!
//! `KILN_FUZZ_CASES` sets the cases per property (default 1000: under 10 s in the debug profile).
//! proptest prints the smallest failing input it finds.

use std::collections::BTreeSet;
use std::path::Path;
use std::sync::{Arc, Mutex, OnceLock};

use kiln::data::lm::read_documents;
use kiln::data::reader::read_examples;
use kiln::data::{Columns, LabelSet, TextEncoding};
use proptest::prelude::*;
use proptest::sample::Index;
use proptest::test_runner::{Config, TestRunner};

fn cases() -> u32 {
    std::env::var("KILN_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1000)
}

/// Runs `test` on `cases()` values of `strategy`; a panic or failed check fails the test with the
/// (shrunk) input.
fn check<S: Strategy>(strategy: S, test: impl Fn(S::Value) -> Result<(), TestCaseError>) {
    let mut runner = TestRunner::new(Config {
        cases: cases(),
        failure_persistence: None,
        ..Config::default()
    });
    if let Err(e) = runner.run(&strategy, test) {
        panic!("{e}");
    }
}

const CSV: &str =
    "label,text\npos,\"hello, world\"\nneg,\"multi\nline \"\"quoted\"\"\"\n1,plain\r\n\
                   01,\"x\"\n-2,  spaced  \n";
const TSV: &str = "text\tlabel\n\"a\tb\"\tpos\nplain\tneg\n\"multi\nline\"\t1\n";
const JSONL: &str = "{\"text\": \"good\", \"label\": 1}\n{\"text\": \"two\", \"label\": \"neg\"}\n\
                     {\"text\": [1], \"label\": 1.5}\n{\"label\": true, \"text\": \"x\"}\n\
                     {\"text\": \"\\u00e9\", \"label\": -3}\n";
const TXT: &str = "one paragraph\nstill one\n\nsecond\n";

/// A small valid Parquet file: optional UTF-8 text, INT64 and UTF-8 labels, a DOUBLE column.
fn parquet_seed() -> &'static [u8] {
    static SEED: OnceLock<Vec<u8>> = OnceLock::new();
    SEED.get_or_init(|| {
        use parquet::data_type::{ByteArray, ByteArrayType, DoubleType, Int64Type};
        use parquet::file::writer::SerializedFileWriter;
        let schema = parquet::schema::parser::parse_message_type(
            "message m { OPTIONAL BYTE_ARRAY text (UTF8); REQUIRED INT64 label; \
             REQUIRED BYTE_ARRAY tag (UTF8); REQUIRED DOUBLE score; }",
        )
        .unwrap();
        let mut out = Vec::new();
        let mut w =
            SerializedFileWriter::new(&mut out, Arc::new(schema), Default::default()).unwrap();
        let bytes = |v: &[&str]| v.iter().map(|s| ByteArray::from(*s)).collect::<Vec<_>>();
        let mut rg = w.next_row_group().unwrap();
        let mut c = rg.next_column().unwrap().unwrap();
        c.typed::<ByteArrayType>()
            .write_batch(&bytes(&["première", "second"]), Some(&[1, 0, 1]), None)
            .unwrap();
        c.close().unwrap();
        let mut c = rg.next_column().unwrap().unwrap();
        c.typed::<Int64Type>()
            .write_batch(&[2, 0, 1], None, None)
            .unwrap();
        c.close().unwrap();
        let mut c = rg.next_column().unwrap().unwrap();
        c.typed::<ByteArrayType>()
            .write_batch(&bytes(&["a", "b", "a"]), None, None)
            .unwrap();
        c.close().unwrap();
        let mut c = rg.next_column().unwrap().unwrap();
        c.typed::<DoubleType>()
            .write_batch(&[0.5, 1.0, -2.0], None, None)
            .unwrap();
        c.close().unwrap();
        rg.close().unwrap();
        w.close().unwrap();
        out
    })
}

#[derive(Debug, Clone)]
enum Mutation {
    Set(Index, u8),
    Insert(Index, u8),
    Delete(Index, usize),
    Duplicate(Index, usize),
    Truncate(Index),
}

/// Bytes that matter to the formats (quotes, delimiters, line ends, JSON punctuation, digits,
/// invalid UTF-8), or any byte.
fn byte() -> impl Strategy<Value = u8> {
    prop_oneof![
        3 => prop::sample::select(b"\",\t\n\r{}[]:\\01-.e \xff\xc3\x00".to_vec()),
        1 => any::<u8>(),
    ]
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        4 => (any::<Index>(), byte()).prop_map(|(i, b)| Mutation::Set(i, b)),
        4 => (any::<Index>(), byte()).prop_map(|(i, b)| Mutation::Insert(i, b)),
        2 => (any::<Index>(), 1..16usize).prop_map(|(i, n)| Mutation::Delete(i, n)),
        1 => (any::<Index>(), 1..64usize).prop_map(|(i, n)| Mutation::Duplicate(i, n)),
        1 => any::<Index>().prop_map(Mutation::Truncate),
    ]
}

fn mutate(seed: &[u8], muts: &[Mutation]) -> Vec<u8> {
    let mut v = seed.to_vec();
    for m in muts {
        let at = |i: &Index, len: usize| if len == 0 { 0 } else { i.index(len) };
        match m {
            Mutation::Set(i, b) if !v.is_empty() => {
                let i = at(i, v.len());
                v[i] = *b;
            }
            Mutation::Set(..) => {}
            Mutation::Insert(i, b) => v.insert(at(i, v.len() + 1), *b),
            Mutation::Delete(i, n) => {
                let i = at(i, v.len());
                v.drain(i..(i + n).min(v.len()));
            }
            Mutation::Duplicate(i, n) => {
                let i = at(i, v.len());
                let chunk = v[i..(i + n).min(v.len())].to_vec();
                v.splice(i..i, chunk);
            }
            Mutation::Truncate(i) => v.truncate(at(i, v.len() + 1)),
        }
    }
    v
}

fn cols(text: &str, label: Option<&str>) -> Columns {
    Columns {
        text: text.into(),
        text_pair: None,
        label: label.map(str::to_string),
    }
}

/// Reads `bytes` as a file of extension `ext` every way kiln does and checks what comes back.
fn read_all_ways(ext: &str, bytes: &[u8]) -> Result<(), TestCaseError> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(format!("f.{ext}"));
    std::fs::write(&path, bytes).unwrap();
    for encoding in [TextEncoding::Utf8, TextEncoding::Latin1] {
        for strict in [false, true] {
            for label in [Some("label"), None] {
                check_rows(&path, &cols("text", label), encoding, strict)?;
            }
        }
        if let Ok((docs, report)) = read_documents(&path, "text", encoding, false) {
            prop_assert!(!docs.is_empty());
            prop_assert!(docs.iter().all(|d| !d.trim().is_empty()));
            prop_assert!(report.rows >= docs.len());
        }
    }
    Ok(())
}

/// Distinct panics of the `parquet` crate that `read_examples` turned into errors (printed, not
/// failures: containing them is the reader's job).
static CONTAINED_PANICS: Mutex<BTreeSet<String>> = Mutex::new(BTreeSet::new());

fn check_rows(
    path: &Path,
    cols: &Columns,
    encoding: TextEncoding,
    strict: bool,
) -> Result<(), TestCaseError> {
    let (rows, report) = match read_examples(path, cols, encoding, strict) {
        Ok(r) => r,
        Err(e) => {
            let e = e.to_string();
            if let Some((_, msg)) = e.split_once("the parquet crate failed on it: ") {
                if let Ok(mut seen) = CONTAINED_PANICS.lock() {
                    seen.insert(msg.trim_end_matches(')').to_string());
                }
            }
            return Ok(());
        }
    };
    prop_assert!(!rows.is_empty());
    prop_assert_eq!(report.rows - report.skipped.len(), rows.len());
    if strict {
        prop_assert!(report.skipped.is_empty());
    }
    for r in &rows {
        prop_assert!(!r.text.trim().is_empty(), "empty text at line {}", r.line);
        match (&cols.label, &r.label) {
            (Some(_), Some(l)) => {
                prop_assert!(!l.is_empty() && l.trim() == l, "label {:?}", l);
            }
            (None, _) => {}
            (Some(_), None) => prop_assert!(false, "no label at line {}", r.line),
        }
    }
    if cols.label.is_some() {
        let labels = LabelSet::infer(rows.iter().filter_map(|r| r.label.as_deref()));
        for r in &rows {
            let l = r.label.as_deref().unwrap_or_default();
            prop_assert!(labels.id(l).is_some(), "label {:?} not in its own set", l);
        }
    }
    Ok(())
}

fn fuzz_mutations(ext: &'static str, seed: &'static [u8]) {
    check(prop::collection::vec(mutation(), 1..8), move |muts| {
        read_all_ways(ext, &mutate(seed, &muts))
    });
}

#[test]
fn seeds_are_valid() {
    for (ext, seed) in [
        ("csv", CSV.as_bytes()),
        ("tsv", TSV.as_bytes()),
        ("jsonl", JSONL.as_bytes()),
        ("parquet", parquet_seed()),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(format!("f.{ext}"));
        std::fs::write(&path, seed).unwrap();
        let (rows, _) = read_examples(
            &path,
            &cols("text", Some("label")),
            TextEncoding::Utf8,
            false,
        )
        .unwrap();
        assert!(rows.len() >= 2, "{ext}");
    }
}

#[test]
fn mutated_csv_never_panics() {
    fuzz_mutations("csv", CSV.as_bytes());
}

#[test]
fn mutated_tsv_never_panics() {
    fuzz_mutations("tsv", TSV.as_bytes());
}

#[test]
fn mutated_jsonl_never_panics() {
    fuzz_mutations("jsonl", JSONL.as_bytes());
}

#[test]
fn mutated_parquet_never_panics() {
    fuzz_mutations("parquet", parquet_seed());
    if let Ok(seen) = CONTAINED_PANICS.lock() {
        eprintln!("parquet reader panics contained: {seen:#?}");
    }
}

#[test]
fn mutated_txt_never_panics() {
    fuzz_mutations("txt", TXT.as_bytes());
}

#[test]
fn random_bytes_never_panic() {
    let ext = prop::sample::select(vec!["csv", "tsv", "jsonl", "parquet", "txt"]);
    check(
        (ext, prop::collection::vec(byte(), 0..512)),
        |(ext, bytes)| read_all_ways(ext, &bytes),
    );
}

/// Quote-heavy CSV made of a few tokens: the shapes most likely to confuse the quote pre-scan.
#[test]
fn quote_soup_csv_never_panics() {
    let token = prop::sample::select(vec![
        "\"", "\"\"", ",", "\n", "\r\n", "\r", "a", "1", "pos", " ",
    ]);
    check(prop::collection::vec(token, 0..64), |tokens| {
        let mut text = String::from("text,label\n");
        text.extend(tokens);
        read_all_ways("csv", text.as_bytes())
    });
}

/// Well-formed CSV (fields quoted when they must be, or at random; quotes, delimiters and line ends
/// inside quoted fields; LF or CRLF; blank lines between records) reads back exactly, with each row's
/// first line: the quote pre-scan never rejects a valid record nor shifts line numbers.
#[test]
fn well_formed_csv_reads_back_exactly() {
    let text = prop::collection::vec(
        prop::sample::select(vec!['a', ' ', '"', ',', '\n', '\r', 'é', '\t']),
        0..12,
    )
    .prop_map(|cs| format!("x{}", cs.into_iter().collect::<String>()));
    let label = prop::sample::select(vec!["pos", "neg", "1"]);
    let row = (label, text, any::<bool>(), 0..3usize);
    check(
        (prop::collection::vec(row, 1..12), any::<bool>()),
        |(rows, crlf)| {
            let eol = if crlf { "\r\n" } else { "\n" };
            let mut file = format!("label,text{eol}");
            let mut want = Vec::new();
            for (label, text, quote, blank_lines) in &rows {
                file.push_str(&eol.repeat(*blank_lines));
                let line = 1 + file.matches('\n').count();
                let must = text.contains(['"', ',', '\n', '\r']);
                let field = if *quote || must {
                    format!("\"{}\"", text.replace('"', "\"\""))
                } else {
                    text.clone()
                };
                file.push_str(&format!("{label},{field}{eol}"));
                want.push((line, text.clone(), label.to_string()));
            }
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("f.csv");
            std::fs::write(&path, &file).unwrap();
            let got = read_examples(
                &path,
                &cols("text", Some("label")),
                TextEncoding::Utf8,
                true,
            )
            .map_err(|e| TestCaseError::fail(format!("{e}\n{file:?}")))?
            .0
            .into_iter()
            .map(|r| (r.line, r.text, r.label.unwrap_or_default()))
            .collect::<Vec<_>>();
            prop_assert_eq!(got, want, "{:?}", file);
            Ok(())
        },
    );
}
