//! Pipeline parallelism through the `kiln` binary: `kiln launch` + `--pipeline-parallel-size N` on
//! a 5-layer Llama initialised from a config takes the same 10 AdamW steps (with global-norm
//! clipping) as one process: PP = 2 with the default and an uneven `--pipeline-cuts`, tied and
//! untied heads, 1F1B and GPipe, PP = 4, TP = 2 × PP = 2, PP = 2 × DP = 2 with ZeRO-1, and
//! gradient accumulation folded into the micro-batches. Bad layouts are one sentence each.
//!
//! "The same" is held as the tensor-parallel tests hold it: a pipeline's micro-batches are
//! smaller than one process's batch, so its GEMMs sum in other orders and AdamW (which divides by
//! √v) turns that rounding into up to a hundredth of the steps' size ([`ADAMW_ROUNDING`]); the
//! logged losses agree to their 4 decimals. A lost layer, a stale stage or a tied weight updated
//! on one side only moves weights by whole steps; the seed control differs by far more.

mod kiln_bin;
mod llm_runs;

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use kiln::formats::safetensors::HostTensor;
use kiln_bin::{kiln_one_thread, launched};
use llm_runs::{copy_dir, losses, max_diff, setup, weights};

const LR: f32 = 1e-3;
const STEPS: usize = 10;
/// Max |Δw| against one process after the 10 AdamW steps: 1 % of their full size.
const ADAMW_ROUNDING: f32 = 0.01 * STEPS as f32 * LR;
/// Max |Δ| of a logged step's loss (the log keeps 4 decimals).
const LOSS_ROUNDING: f64 = 1.5e-4;

/// A 5-layer Llama over SmolLM2's tokenizer (49157 = its 49152 + 5).
fn config(dir: &Path, name: &str, tied: bool) -> std::path::PathBuf {
    let p = dir.join(name);
    std::fs::write(
        &p,
        serde_json::json!({
            "vocab_size": 49157, "hidden_size": 32, "intermediate_size": 40,
            "num_hidden_layers": 5, "num_attention_heads": 4, "num_key_value_heads": 2,
            "rope_theta": 10000.0, "tie_word_embeddings": tied, "eos_token_id": 2,
            "pad_token_id": 2, "architectures": ["LlamaForCausalLM"], "model_type": "llama"})
        .to_string(),
    )
    .unwrap();
    p
}

struct Run<'a> {
    cfg: &'a Path,
    tokenizer: &'a Path,
    corpus: &'a Path,
    out: &'a Path,
}

/// SmolLM2's tokenizer folder, a small corpus and a tied 5-layer config in a temporary folder.
struct Fixture {
    tmp: tempfile::TempDir,
    hf: std::path::PathBuf,
    corpus: std::path::PathBuf,
    cfg: std::path::PathBuf,
}

impl Fixture {
    /// `None` without the assets.
    fn new() -> Option<Self> {
        let (tmp, hf, corpus) = setup()?;
        let cfg = config(tmp.path(), "c.json", true);
        Some(Self {
            tmp,
            hf,
            corpus,
            cfg,
        })
    }

    fn run(&self) -> Run<'_> {
        Run {
            cfg: &self.cfg,
            tokenizer: &self.hf,
            corpus: &self.corpus,
            out: self.tmp.path(),
        }
    }
}

/// `kiln train` of `r` with `procs` processes and `extra` flags (a per-device batch of 4 unless
/// they say otherwise), into `r.out/name`; returns the command's status and stderr.
fn run(r: &Run, name: &str, procs: usize, seed: u64, extra: &[&str]) -> (bool, String) {
    run_with(r, name, launched(procs), seed, extra)
}

/// [`run`] under the launcher command `c`.
fn run_with(r: &Run, name: &str, c: Command, seed: u64, extra: &[&str]) -> (bool, String) {
    let o = train_command(r, name, c, seed, extra).output().unwrap();
    (
        o.status.success(),
        String::from_utf8_lossy(&o.stderr).into(),
    )
}

/// The launcher command `c` with `kiln train` of `r` into `r.out/name` after it.
fn train_command(r: &Run, name: &str, mut c: Command, seed: u64, extra: &[&str]) -> Command {
    let out = r.out.join(name);
    c.args(["train", "--task", "causal-lm", "--from-config"])
        .arg(r.cfg)
        .arg("--tokenizer")
        .arg(r.tokenizer)
        .arg("--train-file")
        .arg(r.corpus)
        .args(["--block-size", "16", "--learning-rate", &LR.to_string()])
        .args(["--max-grad-norm", "0.5", "--logging-steps", "1"])
        .args([
            "--max-steps",
            &STEPS.to_string(),
            "--seed",
            &seed.to_string(),
        ]);
    if !extra.contains(&"--save-strategy") {
        c.args(["--save-strategy", "no"]);
    }
    if !extra.contains(&"--per-device-train-batch-size") {
        c.args(["--per-device-train-batch-size", "4"]);
    }
    c.args(extra).arg("--output-dir").arg(&out);
    c
}

/// [`run`], which must succeed and clip its first step; returns the saved weights.
fn train(
    r: &Run,
    name: &str,
    procs: usize,
    seed: u64,
    extra: &[&str],
) -> BTreeMap<String, HostTensor> {
    let (ok, err) = run(r, name, procs, seed, extra);
    assert!(ok, "{name} failed: {err}");
    let log = std::fs::read_to_string(r.out.join(name).join("log.jsonl")).unwrap();
    let first: serde_json::Value = serde_json::from_str(log.lines().next().unwrap()).unwrap();
    let norm = first["grad_norm"].as_f64().unwrap();
    assert!(
        norm > 0.5,
        "{name}: grad_norm {norm} is below --max-grad-norm"
    );
    weights(&r.out.join(name))
}

/// The largest difference between two runs' logged step losses (all 10 logged).
fn loss_diff(r: &Run, a: &str, b: &str) -> f64 {
    let (la, lb) = (losses(&r.out.join(a)), losses(&r.out.join(b)));
    assert!(
        la.len() == STEPS && lb.len() == STEPS,
        "{a}: {la:?}, {b}: {lb:?}"
    );
    la.iter()
        .zip(&lb)
        .map(|(x, y)| (x - y).abs())
        .fold(0f64, f64::max)
}

#[test]
fn pipeline_training_equals_one_process() {
    let Some((tmp, hf, corpus)) = setup() else {
        return;
    };
    for tied in [true, false] {
        let cfg = config(tmp.path(), &format!("tied-{tied}.json"), tied);
        let r = Run {
            cfg: &cfg,
            tokenizer: &hf,
            corpus: &corpus,
            out: tmp.path(),
        };
        let single = train(&r, &format!("{tied}-pp1"), 1, 3, &[]);
        let control = train(&r, &format!("{tied}-control"), 1, 4, &[]);
        let c = max_diff(&control, &single);
        assert!(c > 100.0 * ADAMW_ROUNDING, "control too close ({c})");
        let wide = train(
            &r,
            &format!("{tied}-pp1-b8"),
            1,
            3,
            &["--per-device-train-batch-size", "8"],
        );
        // (name, processes, flags, whether one process took the DP ranks' batch of 8)
        let mut layouts: Vec<(&str, usize, Vec<&str>, bool)> = vec![
            (
                "pp2",
                2,
                vec![
                    "--pipeline-parallel-size",
                    "2",
                    "--pipeline-parallel-num-microbatches",
                    "2",
                ],
                false,
            ),
            (
                "pp2-cut2-gpipe",
                2,
                vec!["--pipeline-parallel-size", "2", "--pipeline-cuts", "2"]
                    .into_iter()
                    .chain(["--pipeline-schedule", "gpipe"])
                    .collect(),
                false,
            ),
            // The last stage's head computes the loss 8 positions at a time (4 chunks of a
            // micro-batch's 2 × 16 positions), never their whole logits.
            (
                "pp2-chunked",
                2,
                vec![
                    "--pipeline-parallel-size",
                    "2",
                    "--pipeline-parallel-num-microbatches",
                    "2",
                    "--loss-chunk-size",
                    "8",
                ],
                false,
            ),
            // The 49157-token head outweighs the 5 small layers: stage 1 gets one layer.
            (
                "pp2-compute",
                2,
                vec![
                    "--pipeline-parallel-size",
                    "2",
                    "--pipeline-balance",
                    "compute",
                ],
                false,
            ),
            (
                "pp2-accumulation",
                2,
                vec![
                    "--pipeline-parallel-size",
                    "2",
                    "--per-device-train-batch-size",
                    "2",
                ]
                .into_iter()
                .chain(["--gradient-accumulation-steps", "2"])
                .chain(["--pipeline-parallel-num-microbatches", "2"])
                .collect(),
                false,
            ),
        ];
        if tied {
            // Evaluation mid-run gathers the stages and lets go again: the run goes on the same.
            let eval = [
                "--eval-file",
                r.corpus.to_str().unwrap(),
                "--eval-strategy",
                "steps",
                "--eval-steps",
                "4",
            ];
            train(&r, "eval-pp1", 1, 3, &eval);
            let pp_eval = [&eval[..], &["--pipeline-parallel-size", "2"]].concat();
            let got = train(&r, "eval-pp2", 2, 3, &pp_eval);
            let d = max_diff(&got, &single);
            let evals = |name: &str| -> Vec<f64> {
                std::fs::read_to_string(r.out.join(name).join("log.jsonl"))
                    .unwrap()
                    .lines()
                    .filter_map(|l| {
                        serde_json::from_str::<serde_json::Value>(l).ok()?["eval_loss"].as_f64()
                    })
                    .collect()
            };
            let (a, b) = (evals("eval-pp1"), evals("eval-pp2"));
            eprintln!("evaluation at PP=2: {b:?} vs {a:?}; max |Δw| {d:e}");
            assert_eq!(a.len(), 2, "evaluations at steps 4 and 8: {a:?}");
            assert!(
                a.len() == b.len() && a.iter().zip(&b).all(|(x, y)| (x - y).abs() <= 1e-4),
                "eval losses {b:?} vs {a:?}"
            );
            assert!(
                d <= ADAMW_ROUNDING,
                "PP=2 with evaluation: weights differ by {d}"
            );
            layouts.extend([
                ("pp4", 4, vec!["--pipeline-parallel-size", "4"], false),
                (
                    "tp2-pp2",
                    4,
                    vec![
                        "--pipeline-parallel-size",
                        "2",
                        "--tensor-parallel-size",
                        "2",
                    ],
                    false,
                ),
                (
                    "pp2-dp2-zero1",
                    4,
                    vec!["--pipeline-parallel-size", "2", "--zero-1"],
                    true,
                ),
            ]);
        }
        for (layout, procs, extra, is_wide) in layouts {
            let name = format!("{tied}-{layout}");
            let got = train(&r, &name, procs, 3, &extra);
            let (reference, base) = match is_wide {
                true => (&wide, format!("{tied}-pp1-b8")),
                false => (&single, format!("{tied}-pp1")),
            };
            let d = max_diff(&got, reference);
            let l = loss_diff(&r, &name, &base);
            eprintln!("tied {tied}, {layout}: max |Δw| {d:e}, losses {l:e} (control {c:e})");
            assert!(
                d <= ADAMW_ROUNDING,
                "tied {tied}, {layout}: weights differ by {d}"
            );
            assert!(
                l <= LOSS_ROUNDING,
                "tied {tied}, {layout}: losses differ by {l}"
            );
        }
    }
}

#[test]
fn bad_pipeline_layouts_are_one_sentence() {
    let Some(f) = Fixture::new() else {
        return;
    };
    let r = f.run();
    for (i, (procs, extra, says)) in [
        (
            6,
            vec!["--pipeline-parallel-size", "6"],
            "--pipeline-parallel-size 6 is more stages than the model's 5 decoder layers",
        ),
        (
            2,
            vec![
                "--pipeline-parallel-size",
                "2",
                "--pipeline-parallel-num-microbatches",
                "3",
            ],
            "--pipeline-parallel-num-microbatches 3 does not divide the per-device batch of 4",
        ),
        (
            3,
            vec!["--pipeline-parallel-size", "2"],
            "the world of 3 processes does not divide",
        ),
        (
            2,
            vec!["--pipeline-parallel-size", "2", "--pipeline-cuts", "7"],
            "--pipeline-cuts",
        ),
        (
            2,
            vec!["--pipeline-parallel-size", "2", "--pipeline-schedule", "zb"],
            "is not a pipeline schedule",
        ),
        (
            2,
            vec!["--pipeline-parallel-size", "2", "--pipeline-cuts", "2"]
                .into_iter()
                .chain(["--pipeline-balance", "compute"])
                .collect(),
            "--pipeline-cuts and --pipeline-balance compute both set the cut",
        ),
    ]
    .into_iter()
    .enumerate()
    {
        let (ok, err) = run(&r, &format!("bad{i}"), procs, 3, &extra);
        assert!(!ok, "{extra:?} ran");
        assert!(err.contains(says), "{extra:?}: {err}");
        assert!(!err.contains("panicked"), "{extra:?}: {err}");
        // Refused before anything was written.
        assert!(
            !r.out.join(format!("bad{i}")).join("kiln_run.json").exists(),
            "{extra:?} claimed its output folder"
        );
    }
}

/// `kiln convert` of `from` into `to` with `flags`; returns its success and stderr.
fn convert(flags: &[&str], from: &Path, to: &Path) -> (bool, String) {
    let o = kiln_one_thread()
        .arg("convert")
        .args(flags)
        .arg("--model")
        .arg(from)
        .arg("--out")
        .arg(to)
        .output()
        .unwrap();
    (
        o.status.success(),
        String::from_utf8_lossy(&o.stderr).into(),
    )
}

/// A pipeline's checkpoints (PP = 2 × DP = 2 with ZeRO-1, tied embedding): each stage writes its
/// own files, the PP rank in their names. The job killed right after its first checkpoint resumes
/// from it at the same layout, at one process, at TP = 2 × PP = 2 and at PP = 4, and from its
/// `kiln convert` copies (whole, and TP = 2 × PP = 2), each equal to the unbroken one-process run;
/// converting between (TP, PP) layouts and back is byte-identical.
#[test]
fn pipeline_checkpoints_resume_at_any_layout() {
    let Some(f) = Fixture::new() else {
        return;
    };
    let r = f.run();
    let reference = train(&r, "reference", 1, 3, &[]);
    let pp2 = ["--pipeline-parallel-size", "2"];
    let b2 = ["--per-device-train-batch-size", "2"];
    let broken = train_command(
        &r,
        "broken",
        launched(4),
        3,
        &[&pp2[..], &b2, &["--zero-1", "--save-strategy", "steps"]]
            .concat()
            .into_iter()
            .chain(["--save-steps", "5"])
            .collect::<Vec<_>>(),
    )
    .env("KILN_TEST_CRASH_AT", "checkpoint:renamed:1")
    .output()
    .unwrap();
    assert!(!broken.status.success(), "the killed job must fail");
    let ck = r.out.join("broken").join("checkpoint-5");
    for file in [
        "shards.json",
        "model/tp_rank_00_pp_rank_00.safetensors",
        "model/tp_rank_00_pp_rank_01.safetensors",
        "optimizer/tp_rank_00_pp_rank_00_dp_rank_01.safetensors",
        "optimizer/tp_rank_00_pp_rank_01_dp_rank_01.safetensors",
        "kiln_checkpoint.json",
    ] {
        assert!(ck.join(file).exists(), "checkpoint-5 lacks {file}");
    }
    assert!(!r.out.join("broken").join("checkpoint-10").exists());
    // Each stage holds its own layers; the tied embedding is stored once, by stage 0.
    let stage = |s: usize| {
        let f = ck.join(format!("model/tp_rank_00_pp_rank_{s:02}.safetensors"));
        kiln::formats::safetensors::read_safetensors(&f).unwrap()
    };
    let (s0, s1) = (stage(0), stage(1));
    assert!(s0.contains_key("model.embed_tokens.weight"));
    assert!(!s1.contains_key("model.embed_tokens.weight"));
    assert!(s1.contains_key("model.norm.weight") && !s0.contains_key("model.norm.weight"));
    assert_eq!(s0.len() + s1.len(), reference.len());

    // Convert: the checkpoint whole, and cut as TP = 2 × PP = 2; whole → (TP 2, PP 2) →
    // (TP 1, PP 4) → whole gives the whole folder back byte for byte.
    let dir = |name: &str| r.out.join(name);
    let tp2pp2 = ["--to-tp", "2", "--to-pp", "2"];
    for (flags, from, to) in [
        (&["--to-full"][..], ck.clone(), dir("ck-full")),
        (&tp2pp2[..], ck.clone(), dir("ck-tp2-pp2")),
        (&tp2pp2[..], dir("ck-full"), dir("full-tp2-pp2")),
        (
            &["--to-tp", "1", "--to-pp", "4"][..],
            dir("full-tp2-pp2"),
            dir("tp1-pp4"),
        ),
        (&["--to-full"][..], dir("tp1-pp4"), dir("tp1-pp4-full")),
        (&["--to-full"][..], dir("ck-tp2-pp2"), dir("tp2-pp2-full")),
    ] {
        let (ok, err) = convert(flags, &from, &to);
        assert!(ok, "convert {flags:?} {}: {err}", from.display());
    }
    assert!(dir("tp1-pp4/model/tp_rank_00_pp_rank_03.safetensors").exists());
    let (ok, err) = convert(&["--to-tp", "1", "--to-pp", "6"], &ck, &dir("pp6"));
    assert!(
        !ok && err.contains("--to-pp 6 is more stages than the model's 5 decoder layers"),
        "{err}"
    );
    for back in ["tp1-pp4-full", "tp2-pp2-full"] {
        for file in ["model.safetensors", "optimizer.safetensors"] {
            let a = std::fs::read(dir("ck-full").join(file)).unwrap();
            let b = std::fs::read(dir(back).join(file)).unwrap();
            assert!(a == b, "{back}/{file} differs from ck-full's");
        }
    }

    // A stage's file that holds another stage's parameter is one sentence.
    let bad = dir("bad-stage");
    copy_dir(&ck, &bad);
    let moved = bad.join("model/tp_rank_00_pp_rank_01.safetensors");
    let mut t = kiln::formats::safetensors::read_safetensors(&moved).unwrap();
    t.insert(
        "model.layers.0.mlp.up_proj.weight".into(),
        s0["model.layers.0.mlp.up_proj.weight"].clone(),
    );
    let bytes = kiln::formats::safetensors::safetensors_bytes(
        &t,
        kiln::formats::safetensors::StoreDtype::F32,
    )
    .unwrap();
    std::fs::write(&moved, bytes).unwrap();
    let (ok, err) = convert(&["--to-full"], &bad, &dir("bad-out"));
    assert!(!ok && err.contains("puts on pipeline stage 0"), "{err}");
    assert!(!dir("bad-out").exists());

    let ck_arg = |p: &Path| p.to_string_lossy().to_string();
    let (ck_s, full_s, tp2pp2_s) = (
        ck_arg(&ck),
        ck_arg(&dir("ck-full")),
        ck_arg(&dir("ck-tp2-pp2")),
    );
    let tp2 = ["--tensor-parallel-size", "2"];
    for (name, procs, layout, from) in [
        ("same", 4, [&pp2[..], &b2, &["--zero-1"]].concat(), &ck_s),
        ("single", 1, vec![], &ck_s),
        ("tp2-pp2", 4, [&pp2[..], &tp2].concat(), &ck_s),
        ("pp4", 4, vec!["--pipeline-parallel-size", "4"], &ck_s),
        ("converted-full-pp2", 2, pp2.to_vec(), &full_s),
        ("converted-tp2-pp2", 4, [&pp2[..], &tp2].concat(), &tp2pp2_s),
    ] {
        let run_name = format!("resumed-{name}");
        let flags = [&layout[..], &["--resume-from-checkpoint", from.as_str()]].concat();
        let (ok, err) = run(&r, &run_name, procs, 3, &flags);
        assert!(ok, "resume {name} failed: {err}");
        let got = weights(&r.out.join(&run_name));
        // It went on from step 5, not from the start.
        let log = std::fs::read_to_string(r.out.join(&run_name).join("log.jsonl")).unwrap();
        let first: serde_json::Value = serde_json::from_str(log.lines().next().unwrap()).unwrap();
        assert_eq!(first["step"], 6, "resume {name}: {log}");
        let d = max_diff(&got, &reference);
        eprintln!("resumed at {name}: max |Δw| {d:e} against the unbroken one-process run");
        assert!(
            d <= ADAMW_ROUNDING,
            "resumed at {name}: weights differ by {d}"
        );
    }
}

/// `--gradient-checkpointing` under a pipeline recomputes each micro-batch's stage at its
/// backward with the dropout masks its forward drew: a LoRA run with dropout takes exactly the
/// steps it takes without checkpointing (1F1B and GPipe), and a run without dropout differs (the
/// masks were in play).
#[test]
fn checkpointing_inside_a_stage_changes_nothing() {
    let Some(f) = Fixture::new() else {
        return;
    };
    let r = f.run();
    let lora = |dropout: &'static str| {
        vec![
            "--pipeline-parallel-size",
            "2",
            "--lora-r",
            "4",
            "--lora-target-modules",
            "all-linear",
            "--lora-dropout",
            dropout,
        ]
    };
    let trained = |name: &str, extra: &[&str]| {
        let (ok, err) = run(&r, name, 2, 3, extra);
        assert!(ok, "{name} failed: {err}");
        weights(&r.out.join(name))
    };
    let checkpointing = ["--gradient-checkpointing"];
    for schedule in ["1f1b", "gpipe"] {
        let with = [&lora("0.2")[..], &["--pipeline-schedule", schedule]].concat();
        let plain = trained(&format!("plain-{schedule}"), &with);
        let again = trained(
            &format!("checkpointed-{schedule}"),
            &[&with[..], &checkpointing].concat(),
        );
        let d = max_diff(&again, &plain);
        eprintln!("{schedule}: checkpointed vs plain max |Δw| {d:e}");
        assert_eq!(d, 0.0, "{schedule}: checkpointing changed the steps");
    }
    let no_dropout = trained("no-dropout", &lora("0.0"));
    let plain = weights(&r.out.join("plain-1f1b"));
    assert!(
        max_diff(&no_dropout, &plain) > 1e-6,
        "dropout made no difference"
    );
}

/// `kiln eval --task causal-lm` under a pipeline gives one process's loss and perplexity on a
/// trained model: PP = 2 (default and uneven cuts), TP = 2 × PP = 2 and PP = 2 × DP = 2; the last
/// stage computes the result, and rank 0 shows and writes it. `kiln generate` under a pipeline decodes one
/// process's tokens, greedy and sampled.
#[test]
fn evaluation_and_generation_under_a_pipeline_equal_one_process() {
    let Some(f) = Fixture::new() else {
        return;
    };
    let r = f.run();
    train(&r, "trained", 1, 3, &[]);
    let model = r.out.join("trained");
    let eval = |name: &str, mut c: Command, extra: &[&str]| -> serde_json::Value {
        let out = r.out.join(format!("{name}.json"));
        c.args(["eval", "--task", "causal-lm", "--block-size", "16"])
            .args(["--per-device-eval-batch-size", "2", "--model"])
            .arg(&model)
            .arg("--eval-file")
            .arg(r.corpus)
            .arg("--output")
            .arg(&out)
            .args(extra);
        let o = c.output().unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(o.status.success(), "{name}: {err}");
        // The metrics are shown too: the launcher shows rank 0's output, and under a pipeline
        // the last stage hands them to the first.
        let shown = String::from_utf8_lossy(&o.stdout);
        assert!(
            shown.contains("\"eval_loss\""),
            "{name}: no metrics shown: {shown}"
        );
        serde_json::from_slice(&std::fs::read(&out).unwrap()).unwrap()
    };
    let one = eval("one", kiln_one_thread(), &[]);
    let pp2 = ["--pipeline-parallel-size", "2"];
    for (name, procs, extra) in [
        ("pp2", 2, pp2.to_vec()),
        (
            "pp2-cut1",
            2,
            [&pp2[..], &["--pipeline-cuts", "1"]].concat(),
        ),
        (
            "tp2-pp2",
            4,
            [&pp2[..], &["--tensor-parallel-size", "2"]].concat(),
        ),
        ("pp2-dp2", 4, pp2.to_vec()),
    ] {
        let got = eval(name, launched(procs), &extra);
        let (a, b) = (
            one["eval_loss"].as_f64().unwrap(),
            got["eval_loss"].as_f64().unwrap(),
        );
        eprintln!("eval at {name}: loss {b} vs {a} alone");
        assert!((a - b).abs() <= 1e-5 * a, "{name}: eval_loss {b} vs {a}");
        assert_eq!(got["eval_tokens"], one["eval_tokens"], "{name}");
        let (pa, pb) = (
            one["eval_perplexity"].as_f64().unwrap(),
            got["eval_perplexity"].as_f64().unwrap(),
        );
        assert!(
            (pa - pb).abs() <= 1e-4 * pa,
            "{name}: perplexity {pb} vs {pa}"
        );
    }
    // `kiln generate`: greedy and sampled (the last stage draws, as one process does), each stage
    // with its own layers' KV cache, decode one process's tokens. This barely trained model
    // repeats one token greedily; the sampled tokens are the ones that read every position (a
    // stage's cache counting its positions from layer 0's, which stage 1 lacks, fails them).
    let generate = |name: &str, mut c: Command, extra: &[&str]| -> serde_json::Value {
        c.args([
            "generate",
            "--prompt",
            "The jury said",
            "--max-new-tokens",
            "8",
        ])
        .args(["--ignore-eos", "--json", "--model"])
        .arg(&model)
        .args(extra);
        let o = c.output().unwrap();
        assert!(
            o.status.success(),
            "{name}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        let text = String::from_utf8_lossy(&o.stdout).to_string();
        let json = &text[text.find('{').expect("a JSON line")..];
        let v: serde_json::Value = serde_json::from_str(json.lines().next().unwrap()).unwrap();
        v["new_ids"].clone()
    };
    let sampled = ["--temperature", "0.9", "--top-p", "0.95", "--seed", "7"];
    for sampling in [&[][..], &sampled[..]] {
        let one = generate("one", kiln_one_thread(), sampling);
        assert_eq!(one.as_array().unwrap().len(), 8);
        for (name, procs, extra) in [
            ("pp2", 2, pp2.to_vec()),
            (
                "pp2-cut1",
                2,
                [&pp2[..], &["--pipeline-cuts", "1"]].concat(),
            ),
            (
                "tp2-pp2",
                4,
                [&pp2[..], &["--tensor-parallel-size", "2"]].concat(),
            ),
        ] {
            let got = generate(name, launched(procs), &[sampling, &extra[..]].concat());
            assert_eq!(
                got, one,
                "{name} {sampling:?}: other tokens than one process"
            );
        }
    }
    // The control: another seed draws other tokens.
    let other = ["--temperature", "0.9", "--top-p", "0.95", "--seed", "8"];
    let got = generate("pp2-seed8", launched(2), &[&other[..], &pp2[..]].concat());
    assert_ne!(
        got,
        generate("one", kiln_one_thread(), &sampled),
        "the seed changes nothing"
    );
}

/// A stage's worker killed in the middle of a step (after a hand-over) stops the job with an error
/// naming it; a stage that hangs there is named by its neighbour's receive after the job's
/// collective timeout, and the job stops.
#[test]
fn a_killed_or_hung_stage_is_named() {
    let Some(f) = Fixture::new() else {
        return;
    };
    let r = f.run();
    let pp = ["--pipeline-parallel-size", "2"];
    for mode in ["kill", "hang"] {
        let mut c = kiln_one_thread();
        c.args(["launch", "--nproc-per-node", "2", "--master-port"])
            .arg(kiln_testkit::common::free_ports(2).to_string())
            .args(["--timeout", "10", "--"])
            .env("KILN_TEST_CRASH_AT", "pipeline:hand-over:3")
            .env("KILN_TEST_CRASH_RANK", "1")
            .env("KILN_TEST_CRASH_MODE", mode);
        let started = Instant::now();
        let (ok, err) = run_with(&r, mode, c, 3, &pp);
        let took = started.elapsed();
        assert!(!ok, "{mode}: the job went on");
        // The launcher's last line names the stage: the killed worker itself, or (when its
        // neighbour's link notices first, as under load) the neighbour's error naming it.
        let last = err
            .lines()
            .rev()
            .find(|l| l.starts_with("error:"))
            .unwrap_or("");
        // (killed: "worker rank 1 was killed" or "the link from rank 1 ended"; hung: "rank 1 sent
        // nothing within 10s").
        assert!(last.contains("rank 1"), "{mode}: {err}");
        assert!(!err.contains("panicked"), "{mode}: {err}");
        assert!(
            took < Duration::from_secs(90),
            "{mode}: stopped after {took:?}"
        );
        eprintln!(
            "{mode}: stopped after {took:.1?}: {}",
            err.lines().last().unwrap_or("")
        );
    }
}

/// Two "nodes" on loopback (two launchers of two workers each): TP = 2 inside each node, the two
/// pipeline stages across them (the mesh puts TP fastest, so node 0 holds stage 0), equal to one
/// process.
#[test]
fn two_nodes_pipeline_across_tensor_parallel_inside() {
    let Some(f) = Fixture::new() else {
        return;
    };
    let r = f.run();
    let single = train(&r, "single", 1, 3, &[]);
    let port = kiln_testkit::common::free_ports(4).to_string();
    let layout = [
        "--tensor-parallel-size",
        "2",
        "--pipeline-parallel-size",
        "2",
    ];
    let node = |rank: usize| {
        let mut c = kiln_one_thread();
        c.args(["launch", "--nnodes", "2", "--node-rank", &rank.to_string()])
            .args(["--nproc-per-node", "2", "--master-addr", "127.0.0.1"])
            .args(["--master-port", &port, "--timeout", "60", "--"]);
        train_command(&r, "two-nodes", c, 3, &layout)
            .spawn()
            .unwrap()
    };
    let (mut n0, mut n1) = (node(0), node(1));
    assert!(n0.wait().unwrap().success() && n1.wait().unwrap().success());
    let nodes = weights(&r.out.join("two-nodes"));
    let d = max_diff(&nodes, &single);
    let l = loss_diff(&r, "two-nodes", "single");
    eprintln!(
        "2 nodes: PP = 2 across, TP = 2 inside, vs one process: max |Δw| {d:e}, losses {l:e}"
    );
    assert!(
        d <= ADAMW_ROUNDING,
        "two nodes differ from one process by {d}"
    );
    assert!(l <= LOSS_ROUNDING, "two nodes' losses differ by {l}");
}
