//! Hugging Face `datasets` data read as `datasets` wrote it (tests/fixtures/datasets, from
//! tests/fixtures/gen_datasets_dirs.py): save_to_disk folders (one Dataset, a DatasetDict, several
//! shards), the Hub's Parquet layout, a JSON array — each against the same rows as a plain CSV.

use std::path::{Path, PathBuf};

use kiln::data::reader::read_examples;
use kiln::data::saved_dataset::{class_names, dict_splits};
use kiln::data::{Columns, RawExample, TextEncoding};
use kiln_testkit::common::repo_root;

fn fixture(rel: &str) -> PathBuf {
    repo_root().join("tests/fixtures/datasets").join(rel)
}

fn cols(label: &str) -> Columns {
    Columns {
        text: "text".into(),
        text_pair: None,
        label: Some(label.into()),
    }
}

fn rows(path: &Path, label: &str) -> Vec<(String, String)> {
    let (rows, report) = read_examples(path, &cols(label), TextEncoding::Utf8, true).unwrap();
    assert!(report.skipped.is_empty(), "{}", report.summary());
    rows.into_iter()
        .map(|r: RawExample| (r.text, r.label.unwrap()))
        .collect()
}

#[test]
fn a_saved_dataset_holds_the_rows_of_the_same_csv() {
    let csv = rows(&fixture("tweets_train_200.csv"), "label");
    assert_eq!(csv.len(), 200);
    // ClassLabel ids read back as their names.
    assert_eq!(rows(&fixture("tweets_dict/train"), "label"), csv);
    // Three Arrow shards, in state.json's order.
    assert_eq!(rows(&fixture("sharded_train"), "label"), csv);
    // A plain string label column.
    assert_eq!(rows(&fixture("single_train"), "sentiment"), csv);
    // The Hub's Parquet conversion of the same split: the ClassLabel is in the file's metadata.
    assert_eq!(rows(&fixture("hub_parquet/default/train"), "label"), csv);
    let val = rows(&fixture("tweets_validation_100.csv"), "label");
    assert_eq!(rows(&fixture("tweets_dict/validation"), "label"), val);
}

#[test]
fn a_json_array_is_read_like_json_lines() {
    // datasets' to_json(lines=False): one array, the ClassLabel written as its integer id.
    let json = rows(&fixture("tweets_validation_100.json"), "label");
    let csv = rows(&fixture("tweets_validation_100.csv"), "label");
    let names = class_names(&fixture("tweets_dict/validation"), "label")
        .unwrap()
        .unwrap();
    let by_id: Vec<(String, String)> = json
        .into_iter()
        .map(|(t, id)| (t, names[id.parse::<usize>().unwrap()].clone()))
        .collect();
    assert_eq!(by_id, csv);
}

#[test]
fn class_label_names_keep_their_order_and_splits_resolve() {
    let dict = fixture("emotion_like");
    let names = class_names(&dict.join("train"), "label").unwrap().unwrap();
    assert_eq!(names, ["sadness", "joy", "love", "anger"]);
    // No validation split: evaluation falls back to test.
    let (train, eval) = dict_splits(&dict, None, None, true).unwrap();
    assert_eq!(train.as_deref(), Some(dict.join("train").as_path()));
    assert_eq!(eval.as_deref(), Some(dict.join("test").as_path()));
    let e = dict_splits(&dict, Some("training"), None, true).unwrap_err();
    assert!(
        e.to_string()
            .contains("no split \"training\" (splits: train, test)"),
        "{e}"
    );
    let e = dict_splits(&fixture("single_train"), None, None, true).unwrap_err();
    assert!(e.to_string().contains("a single Dataset"), "{e}");

    // Labels come out as the ClassLabel's names: id i is names[i].
    let args = kiln::data::DataArgs {
        train_file: train,
        eval_file: eval,
        eval_split: None,
        columns: cols("label"),
        encoding: TextEncoding::Utf8,
        strict: true,
        max_train_samples: None,
        max_eval_samples: None,
        seed: 0,
    };
    let tok = kiln::data::TextTokenizer::from_file(
        &repo_root().join("tests/fixtures/families/distilbert/tokenizer.json"),
        32,
    )
    .unwrap();
    let data = kiln::data::prepare(&args, &tok, None).unwrap();
    assert_eq!(data.labels.names(), names.as_slice());
    let train = data.train.unwrap();
    // The generator interleaves labels: joy, anger, sadness, love first.
    assert_eq!(&train.labels[..4], &[1, 3, 0, 2]);
    assert_eq!(data.eval.unwrap().len(), 12);

    // A DatasetDict handed over as one file says what it is.
    let e = read_examples(&dict, &cols("label"), TextEncoding::Utf8, true).unwrap_err();
    assert!(
        e.to_string().contains("a DatasetDict (splits train, test)"),
        "{e}"
    );
}
