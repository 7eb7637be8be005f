//! Tensor parallelism through the `kiln` binary: `kiln launch` + `--tensor-parallel-size N` on a
//! Llama initialised from a config takes the same 5 steps (with global-norm clipping) as one
//! process, at TP = 2 and TP = 3, on configs with uneven head and vocabulary splits, replicated
//! key/value heads, tied and untied heads and biases, the loss from whole logits and from the
//! head a chunk of positions at a time; and bad layouts are one sentence each.
//!
//! How close "the same" is depends on the optimizer. A sharded run sums in other orders than one
//! process (its GEMMs are cut, its vocabulary-parallel loss is composed), so its gradients differ
//! by f32 rounding. Under SGD that stays rounding: weights agree to [`SGD_ROUNDING`]. AdamW divides
//! each step by √v, so on a gradient near zero a rounding difference becomes a sizeable part of a
//! step: weights are held to [`ADAMW_ROUNDING`], a hundredth of the 5 steps' full size, and the
//! logged per-step losses to their 4 decimals ([`LOSS_ROUNDING`]). A lost, doubled or misplaced
//! shard moves weights by whole steps (1e-3 each); the seed controls differ by 0.14.

mod kiln_bin;
mod llm_runs;

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

use kiln::formats::safetensors::{read_safetensors, HostTensor};
use kiln_bin::{kiln_one_thread, launched};
use kiln_testkit::common::{self, asset};
use llm_runs::{copy_dir, corpus, losses, max_diff, setup, weights};

/// Learning rate of every run here.
const LR: f32 = 1e-3;
/// Max |Δw| allowed between a parallel run and one process under SGD: f32 rounding of weights of
/// size ≈ 1 (measured: 7.5e-9 on Zen 3, ≤ 1e-8 on Xeon at both dispatch levels).
const SGD_ROUNDING: f32 = 1e-7;
/// Max |Δw| allowed under AdamW after 5 steps: 1 % of 5 full steps of `LR` (measured 1.3e-6 to
/// 5.3e-6 on Xeon at both dispatch levels, 1.6e-5 on Zen 3).
const ADAMW_ROUNDING: f32 = 0.01 * 5.0 * LR;
/// Max |Δ| of a logged step's loss: the log keeps 4 decimals (as transformers), so equal losses may
/// still differ by one flip of that rounding.
const LOSS_ROUNDING: f64 = 1.5e-4;

struct Run<'a> {
    /// A config.json to start from random weights, or a model folder to start from.
    cfg: &'a Path,
    tokenizer: &'a Path,
    corpus: &'a Path,
    out: &'a Path,
}

/// `kiln train` of the causal LM `r` into `out` at tensor-parallel size `tp`; `args` adds the
/// run's own flags.
fn train_args(r: &Run, out: &Path, tp: usize, args: &[&str]) -> Vec<std::ffi::OsString> {
    let mut v: Vec<std::ffi::OsString> = ["train", "--task", "causal-lm"]
        .iter()
        .map(Into::into)
        .collect();
    if r.cfg.is_dir() {
        v.extend(["--model".into(), r.cfg.into()]);
    } else {
        v.extend(["--from-config".into(), r.cfg.into()]);
        v.extend(["--tokenizer".into(), r.tokenizer.into()]);
    }
    v.extend(["--train-file".into(), r.corpus.into()]);
    for a in [
        "--block-size",
        "16",
        "--learning-rate",
        &LR.to_string(),
        "--max-grad-norm",
        "0.5",
        "--logging-steps",
        "1",
        "--tensor-parallel-size",
        &tp.to_string(),
    ]
    .iter()
    .chain(args)
    {
        v.push(a.into());
    }
    v.extend(["--output-dir".into(), out.into()]);
    v
}

/// [`train_args`] under `kiln launch` with `procs` processes (alone when 1).
fn command(r: &Run, out: &Path, (procs, tp): (usize, usize), args: &[&str]) -> Command {
    let mut c = launched(procs);
    c.args(train_args(r, out, tp, args));
    c
}

/// Trains 5 steps with `procs` processes at tensor-parallel size `tp` (`seed` as given), a
/// per-device batch of 4 unless `extra` says otherwise; returns the saved (consolidated) weights.
fn train(
    r: &Run,
    name: &str,
    layout: (usize, usize),
    seed: u64,
    extra: &[&str],
) -> BTreeMap<String, HostTensor> {
    let out = r.out.join(name);
    let batch: &[&str] = if extra.contains(&"--per-device-train-batch-size") {
        &[]
    } else {
        &["--per-device-train-batch-size", "4"]
    };
    let seed = seed.to_string();
    let base = ["--max-steps", "5", "--save-strategy", "no", "--seed", &seed];
    let st = command(r, &out, layout, &[&base[..], batch, extra].concat())
        .status()
        .unwrap();
    assert!(st.success(), "{name} failed");
    // Clipping was at work (the test covers the norm over shards): the first norm is above 0.5.
    let log = std::fs::read_to_string(out.join("log.jsonl")).unwrap();
    let first: serde_json::Value = serde_json::from_str(log.lines().next().unwrap()).unwrap();
    let norm = first["grad_norm"].as_f64().unwrap();
    assert!(
        norm > 0.5,
        "{name}: grad_norm {norm} is below --max-grad-norm"
    );
    weights(&out)
}

/// Asserts runs `a` and `b` (output folders under `r.out`) logged the same losses, each within
/// [`LOSS_ROUNDING`]; returns the largest difference.
fn same_losses(r: &Run, a: &str, b: &str) -> f64 {
    let (la, lb) = (losses(&r.out.join(a)), losses(&r.out.join(b)));
    assert!(
        la.len() == 5 && la.len() == lb.len(),
        "{a}: {la:?}, {b}: {lb:?}"
    );
    let worst = la
        .iter()
        .zip(&lb)
        .map(|(x, y)| (x - y).abs())
        .fold(0f64, f64::max);
    assert!(
        worst <= LOSS_ROUNDING,
        "{a} vs {b}: losses {la:?} vs {lb:?}"
    );
    worst
}

fn config(
    dir: &Path,
    name: &str,
    heads: usize,
    kv: usize,
    tied: bool,
    bias: bool,
) -> std::path::PathBuf {
    let p = dir.join(name);
    // 49157 = the tokenizer's 49152 + 5: divisible by neither 2 nor 3.
    std::fs::write(
        &p,
        serde_json::json!({
            "vocab_size": 49157, "hidden_size": heads * 8, "intermediate_size": 40,
            "num_hidden_layers": 2, "num_attention_heads": heads, "num_key_value_heads": kv,
            "rope_theta": 10000.0, "tie_word_embeddings": tied, "attention_bias": bias,
            "mlp_bias": bias, "eos_token_id": 2, "pad_token_id": 2,
            "architectures": ["LlamaForCausalLM"], "model_type": "llama"})
        .to_string(),
    )
    .unwrap();
    p
}

#[test]
fn tensor_parallel_training_equals_one_process() {
    let Some((tmp, hf, corpus)) = setup() else {
        return;
    };
    for (cfg, sizes) in [
        // SmolLM2's 9 query / 3 key-value heads, untied, with biases: TP 2 (6+3 heads) and 3.
        (config(tmp.path(), "a.json", 9, 3, false, true), vec![2, 3]),
        // One key-value head for 4 query heads, tied: replicated k/v at TP 2.
        (config(tmp.path(), "b.json", 4, 1, true, false), vec![2]),
    ] {
        let run = Run {
            cfg: &cfg,
            tokenizer: &hf,
            corpus: &corpus,
            out: tmp.path(),
        };
        let stem = cfg.file_stem().unwrap().to_string_lossy().to_string();
        let single = train(&run, &format!("{stem}-tp1"), (1, 1), 3, &[]);
        let control = train(&run, &format!("{stem}-control"), (1, 1), 4, &[]);
        let c = max_diff(&control, &single);
        assert!(c > 1e-4, "control too close ({c}): the test cannot tell");
        let sgd = ["--optim", "sgd"];
        let single_sgd = train(&run, &format!("{stem}-sgd-tp1"), (1, 1), 3, &sgd);
        for tp in sizes {
            let name = format!("{stem}-tp{tp}");
            let sharded = train(&run, &name, (tp, tp), 3, &[]);
            let d = max_diff(&sharded, &single);
            let l = same_losses(&run, &name, &format!("{stem}-tp1"));
            let sharded_sgd = train(&run, &format!("{stem}-sgd-tp{tp}"), (tp, tp), 3, &sgd);
            let e = max_diff(&sharded_sgd, &single_sgd);
            // The vocabulary-parallel head a chunk of positions at a time (64 positions in 3
            // chunks), against one process's whole logits.
            let chunked = ["--optim", "sgd", "--loss-chunk-size", "24"];
            let name_chunked = format!("{stem}-sgd-tp{tp}-chunked");
            let sharded_chunked = train(&run, &name_chunked, (tp, tp), 3, &chunked);
            let k = max_diff(&sharded_chunked, &single_sgd);
            eprintln!(
                "{stem}: TP={tp} vs TP=1: AdamW max |Δw| = {d:e}, losses {l:e}; SGD max |Δw| = {e:e}, chunked {k:e} (control {c:e})"
            );
            assert!(
                k <= SGD_ROUNDING,
                "{stem}: TP={tp} with the loss in chunks differs from one process by {k} under SGD"
            );
            assert!(
                d <= ADAMW_ROUNDING,
                "{stem}: TP={tp} differs from one process by {d} under AdamW"
            );
            assert!(
                e <= SGD_ROUNDING,
                "{stem}: TP={tp} differs from one process by {e} under SGD"
            );
            if tp == 3 {
                // Three ranks' partial sums meet in the all-reduce: they are added in rank order,
                // not in the order they arrive (they were: 1.60e-6 one run, 1.73e-6 the next).
                let again = train(&run, &format!("{name}-again"), (tp, tp), 3, &[]);
                let r = max_diff(&again, &sharded);
                assert!(r == 0.0, "{stem}: TP=3 run twice differs by {r}");
            }
        }
    }
}

/// A LoRA adapter on every Linear (`all-linear`, PEFT's default dropout 0.05) trained at TP = 2
/// equals one process: `B` cut by rows beside a column-parallel weight, `A` by columns beside a
/// row-parallel one (drawn whole and cut, its dropout mask the whole input's), replicated
/// key/value projections whole; under AdamW and SGD with global-norm clipping. Its sharded
/// checkpoint resumes in one process, and `kiln generate --adapter` decodes the same tokens at
/// TP = 2 as alone.
#[test]
fn lora_under_tensor_parallelism_equals_one_process() {
    let Some((tmp, hf, corpus)) = setup() else {
        return;
    };
    let lora = [
        "--use-peft",
        "--lora-target-modules",
        "all-linear",
        "--lora-r",
        "4",
        "--lora-alpha",
        "32",
    ];
    let sgd = [&lora[..], &["--optim", "sgd"]].concat();
    for cfg in [
        config(tmp.path(), "a.json", 9, 3, false, true),
        config(tmp.path(), "b.json", 4, 1, true, false),
    ] {
        let run = Run {
            cfg: &cfg,
            tokenizer: &hf,
            corpus: &corpus,
            out: tmp.path(),
        };
        let stem = format!("lora-{}", cfg.file_stem().unwrap().to_string_lossy());
        let single = train(&run, &format!("{stem}-tp1"), (1, 1), 3, &lora);
        assert_eq!(
            single.len(),
            2 * 2 * 7,
            "{stem}: 2 layers × 7 Linear × A, B"
        );
        let control = train(&run, &format!("{stem}-control"), (1, 1), 4, &lora);
        let c = max_diff(&control, &single);
        assert!(c > 1e-4, "control too close ({c}): the test cannot tell");
        let sharded = train(&run, &format!("{stem}-tp2"), (2, 2), 3, &lora);
        let d = max_diff(&sharded, &single);
        let l = same_losses(&run, &format!("{stem}-tp2"), &format!("{stem}-tp1"));
        let single_sgd = train(&run, &format!("{stem}-sgd-tp1"), (1, 1), 3, &sgd);
        let sharded_sgd = train(&run, &format!("{stem}-sgd-tp2"), (2, 2), 3, &sgd);
        let e = max_diff(&sharded_sgd, &single_sgd);
        eprintln!(
            "{stem}: LoRA TP=2 vs TP=1: AdamW max |Δ| = {d:e}, losses {l:e}; SGD max |Δ| = {e:e} \
             (control {c:e})"
        );
        assert!(
            d <= ADAMW_ROUNDING,
            "{stem}: TP=2 differs by {d} under AdamW"
        );
        assert!(e <= SGD_ROUNDING, "{stem}: TP=2 differs by {e} under SGD");
        // TP = 2 × DP = 2 with ZeRO-1 (the adapter's moments sharded), the same global batch.
        // Without dropout: data-parallel ranks draw masks for their own rows (as DDP does).
        let plain = [&lora[..], &["--lora-dropout", "0"]].concat();
        let single = train(&run, &format!("{stem}-nodrop-tp1"), (1, 1), 3, &plain);
        let zero = [
            &plain[..],
            &["--zero-1", "--per-device-train-batch-size", "2"],
        ]
        .concat();
        let mesh = train(&run, &format!("{stem}-tp2-dp2-zero1"), (4, 2), 3, &zero);
        let z = max_diff(&mesh, &single);
        eprintln!("{stem}: LoRA TP=2 × DP=2 ZeRO-1 vs TP=1: max |Δ| = {z:e}");
        assert!(z <= ADAMW_ROUNDING, "{stem}: TP=2 × DP=2 differs by {z}");
    }
    lora_checkpoint_and_generate_under_tensor_parallelism(tmp.path(), &hf, &corpus, &lora);
}

/// A LoRA run on a saved base model: its TP = 2 checkpoint (the adapter's shards) resumed in one
/// process equals an unbroken run, and generating with the adapter at TP = 2 gives the tokens of
/// one process.
fn lora_checkpoint_and_generate_under_tensor_parallelism(
    tmp: &Path,
    hf: &Path,
    corpus: &Path,
    lora: &[&str],
) {
    let cfg = config(tmp, "base.json", 9, 3, false, true);
    let run = Run {
        cfg: &cfg,
        tokenizer: hf,
        corpus,
        out: tmp,
    };
    // A base model folder: one step from the config.
    let base = tmp.join("base");
    let st = command(
        &run,
        &base,
        (1, 1),
        &["--max-steps", "1", "--save-strategy", "no"],
    )
    .status()
    .unwrap();
    assert!(st.success());
    let on_base_run = Run { cfg: &base, ..run };
    let on_base = |out: &Path, layout: (usize, usize), extra: &[&str]| {
        let st = command(&on_base_run, out, layout, extra).status().unwrap();
        assert!(st.success(), "{}", out.display());
    };
    let steps = [
        "--max-steps",
        "6",
        "--lr-scheduler-type",
        "constant",
        "--per-device-train-batch-size",
        "4",
        "--seed",
        "3",
    ];
    let unbroken = tmp.join("lora-unbroken");
    on_base(
        &unbroken,
        (1, 1),
        &[lora, &steps, &["--save-strategy", "no"]].concat(),
    );
    let sharded = tmp.join("lora-sharded");
    on_base(
        &sharded,
        (2, 2),
        &[lora, &steps, &["--save-steps", "3"]].concat(),
    );
    let ck = sharded.join("checkpoint-3");
    for f in ["shards.json", "model/tp_rank_01.safetensors"] {
        assert!(ck.join(f).exists(), "the adapter's checkpoint lacks {f}");
    }
    // `kiln convert`: the sharded adapter put together is a PEFT folder, and whole → TP = 3 →
    // whole gives the same bytes, optimizer moments included.
    let (full, tp3, again) = (
        tmp.join("ck-full"),
        tmp.join("ck-tp3"),
        tmp.join("ck-again"),
    );
    for (from, flag, to) in [
        (&ck, &["--to-full"][..], &full),
        (&full, &["--to-tp", "3"][..], &tp3),
        (&tp3, &["--to-full"][..], &again),
    ] {
        let out = kiln_one_thread()
            .arg("convert")
            .args(flag)
            .arg("--model")
            .arg(from)
            .arg("--out")
            .arg(to)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success(),
            "convert {flag:?} {}: {err}",
            from.display()
        );
    }
    let adapter = read_safetensors(&full.join("adapter_model.safetensors")).unwrap();
    assert!(adapter.keys().all(|k| k.starts_with("base_model.model.")));
    assert!(full.join("adapter_config.json").exists());
    for f in ["adapter_model.safetensors", "optimizer.safetensors"] {
        let (a, b) = (std::fs::read(full.join(f)), std::fs::read(again.join(f)));
        assert!(
            a.unwrap() == b.unwrap(),
            "{f} changed over whole → TP 3 → whole"
        );
    }
    for (name, from) in [("resumed", &ck), ("resumed-full", &full)] {
        let resumed = tmp.join(format!("lora-{name}"));
        let ck_arg = from.to_string_lossy().to_string();
        on_base(
            &resumed,
            (1, 1),
            &[
                lora,
                &steps,
                &["--save-strategy", "no", "--resume-from-checkpoint", &ck_arg],
            ]
            .concat(),
        );
        let log = std::fs::read_to_string(resumed.join("log.jsonl")).unwrap();
        let first: serde_json::Value = serde_json::from_str(log.lines().next().unwrap()).unwrap();
        assert_eq!(first["step"], 4, "{name}: it went on from step 3: {log}");
        let d = max_diff(&weights(&resumed), &weights(&unbroken));
        eprintln!("LoRA TP=2 checkpoint {name} alone vs unbroken: max |Δ| = {d:e}");
        assert!(d <= 1e-4, "{name}: the resumed adapter differs by {d}");
    }

    let generate = |procs: usize| {
        let out = launched(procs)
            .args([
                "generate",
                "--prompt",
                "The jury said",
                "--max-new-tokens",
                "8",
            ])
            .args(["--ignore-eos", "--json", "--tensor-parallel-size"])
            .arg(procs.to_string())
            .arg("--model")
            .arg(&base)
            .arg("--adapter")
            .arg(&unbroken)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr).to_string();
        assert!(out.status.success(), "{err}");
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        let json = &text[text.find('{').expect("a JSON line")..];
        let v: serde_json::Value = serde_json::from_str(json.lines().next().unwrap()).unwrap();
        v["new_ids"].clone()
    };
    let one = generate(1);
    assert_eq!(one.as_array().unwrap().len(), 8);
    assert_eq!(
        generate(2),
        one,
        "TP = 2 with the adapter decodes other tokens"
    );
}

/// ZeRO-1 (`--zero-1`): at DP = 2 the sharded optimizer takes the same steps as the replicated
/// one, and TP = 2 × DP = 2 with ZeRO-1 (4 processes), and DP = 2 with gradient accumulation,
/// equal one process with the same global batch.
#[test]
fn zero1_equals_replicated_optimizer_and_one_process() {
    let Some((tmp, hf, corpus)) = setup() else {
        return;
    };
    let cfg = config(tmp.path(), "z.json", 9, 3, false, true);
    let run = Run {
        cfg: &cfg,
        tokenizer: &hf,
        corpus: &corpus,
        out: tmp.path(),
    };
    let half = ["--per-device-train-batch-size", "2"];
    let plain = train(&run, "dp2", (2, 1), 3, &half);
    let zero = train(
        &run,
        "dp2-zero1",
        (2, 1),
        3,
        &[&half[..], &["--zero-1"]].concat(),
    );
    let d = max_diff(&zero, &plain);
    eprintln!("ZeRO-1 DP=2 vs DP=2: max |Δw| = {d:e}");
    assert!(
        d <= 1e-6,
        "ZeRO-1 differs from the replicated optimizer by {d}"
    );
    let single = train(&run, "one", (1, 1), 3, &[]);
    let control = train(&run, "control", (1, 1), 4, &[]);
    let c = max_diff(&control, &single);
    assert!(c > 1e-4, "control too close ({c}): the test cannot tell");
    let mesh = train(
        &run,
        "tp2-dp2-zero1",
        (4, 2),
        3,
        &[&half[..], &["--zero-1"]].concat(),
    );
    let d = max_diff(&mesh, &single);
    let l = same_losses(&run, "tp2-dp2-zero1", "one");
    eprintln!(
        "TP=2 × DP=2 with ZeRO-1 vs one process: max |Δw| = {d:e}, losses {l:e} (control {c:e})"
    );
    assert!(
        d <= ADAMW_ROUNDING,
        "TP=2 × DP=2 with ZeRO-1 differs from one process by {d}"
    );
    // With gradient accumulation (global batch 4 = 2 ranks × batch 1 × 2 micro-batches).
    let accumulated = train(
        &run,
        "dp2-zero1-accumulation",
        (2, 1),
        3,
        &[
            "--per-device-train-batch-size",
            "1",
            "--global-batch-size",
            "4",
            "--zero-1",
        ],
    );
    let d = max_diff(&accumulated, &single);
    let l = same_losses(&run, "dp2-zero1-accumulation", "one");
    eprintln!("ZeRO-1 DP=2 × 2 micro-batches vs one process: max |Δw| = {d:e}, losses {l:e}");
    assert!(
        d <= ADAMW_ROUNDING,
        "ZeRO-1 with accumulation differs from one process by {d}"
    );
}

/// A sharded checkpoint (TP = 2 × DP = 2 with ZeRO-1) written at step 3 of 6, after which rank 0
/// is killed: the job stops with an error naming it, the checkpoint is complete, and resuming from
/// it at the same layout, at TP = 3, at DP = 2 with ZeRO-1 and in one process all end where an
/// uninterrupted single process ends.
#[test]
fn sharded_checkpoints_resume_at_any_layout() {
    let Some((tmp, hf, corpus)) = setup() else {
        return;
    };
    let cfg = config(tmp.path(), "r.json", 9, 3, false, true);
    let run = Run {
        cfg: &cfg,
        tokenizer: &hf,
        corpus: &corpus,
        out: tmp.path(),
    };
    // A constant rate: a run stopped at step 3 and resumed takes the steps an unbroken one takes.
    let steps = [
        "--max-steps",
        "6",
        "--lr-scheduler-type",
        "constant",
        "--seed",
        "3",
    ];
    let (b2, b4) = (
        ["--per-device-train-batch-size", "2"],
        ["--per-device-train-batch-size", "4"],
    );
    let reference_dir = tmp.path().join("reference");
    let st = command(
        &run,
        &reference_dir,
        (1, 1),
        &[&steps[..], &b4, &["--save-strategy", "no"]].concat(),
    )
    .status()
    .unwrap();
    assert!(st.success());
    let reference = read_safetensors(&reference_dir.join("model.safetensors")).unwrap();

    let broken = tmp.path().join("broken");
    let out = command(
        &run,
        &broken,
        (4, 2),
        &[&steps[..], &b2, &["--zero-1", "--save-steps", "3"]].concat(),
    )
    .env("KILN_TEST_CRASH_AT", "checkpoint:renamed:1")
    .output()
    .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "the killed job must fail");
    assert!(
        err.contains("rank 0"),
        "the error names the killed rank: {err}"
    );
    let ck = broken.join("checkpoint-3");
    for f in [
        "shards.json",
        "model/tp_rank_00.safetensors",
        "model/tp_rank_01.safetensors",
        "optimizer/tp_rank_01_dp_rank_01.safetensors",
        "kiln_checkpoint.json",
        "tokenizer.json",
    ] {
        assert!(ck.join(f).exists(), "checkpoint-3 lacks {f}");
    }
    assert!(!broken.join("checkpoint-6").exists());
    // The checkpoint converted (optimizer state included) resumes as well.
    let converted_full = tmp.path().join("ck-full");
    let converted_tp3 = tmp.path().join("ck-tp3");
    for (flag, out) in [
        (&["--to-full"][..], &converted_full),
        (&["--to-tp", "3"][..], &converted_tp3),
    ] {
        let st = kiln_one_thread()
            .arg("convert")
            .args(flag)
            .arg("--model")
            .arg(&ck)
            .arg("--out")
            .arg(out)
            .status()
            .unwrap();
        assert!(st.success());
    }
    assert!(converted_full.join("optimizer.safetensors").exists());
    tampered_layouts_are_refused(&ck, tmp.path());
    for (name, layout, extra, from) in [
        ("same", (4, 2), [&b2[..], &["--zero-1"]].concat(), &ck),
        ("tp3", (3, 3), b4.to_vec(), &ck),
        ("dp2-zero1", (2, 1), [&b2[..], &["--zero-1"]].concat(), &ck),
        ("single", (1, 1), b4.to_vec(), &ck),
        ("converted-full", (1, 1), b4.to_vec(), &converted_full),
        ("converted-tp3", (3, 3), b4.to_vec(), &converted_tp3),
    ] {
        let ck_arg = from.to_string_lossy().to_string();
        let dir = tmp.path().join(format!("resumed-{name}"));
        let st = command(
            &run,
            &dir,
            layout,
            &[
                &steps[..],
                &extra[..],
                &["--save-strategy", "no", "--resume-from-checkpoint", &ck_arg],
            ]
            .concat(),
        )
        .status()
        .unwrap();
        assert!(st.success(), "resume {name} failed");
        // It went on from step 3, not from the start.
        let log = std::fs::read_to_string(dir.join("log.jsonl")).unwrap();
        let first: serde_json::Value = serde_json::from_str(log.lines().next().unwrap()).unwrap();
        assert_eq!(first["step"], 4, "resume {name}: {log}");
        let w = read_safetensors(&dir.join("model.safetensors")).unwrap();
        let d = max_diff(&w, &reference);
        eprintln!("resumed at {name} vs unbroken single process: max |Δw| = {d:e}");
        // Layouts with TP take the vocab-parallel cross-entropy (Burn ops) while the reference
        // takes the fused kernel: the same math rounded differently, which Adam's normalisation
        // amplifies on gradients near zero to ≈3e-5 after six steps (1e-6 without TP). A lost or
        // misplaced optimizer state moves weights by the learning rate, 1e-3; the seed control of
        // the other tests differs by 0.15.
        assert!(
            d <= 1e-4,
            "resumed at {name}: differs from the unbroken run by {d}"
        );
    }
}

/// `shards.json` of the TP = 2 × DP = 2 ZeRO-1 checkpoint `ck`, changed as a hostile or broken
/// writer would: `convert --to-full` and a resume refuse each in one sentence and write nothing,
/// where they used to fill half a weight (or half the moments) with zeros, drop a parameter,
/// abort on a 422 TB allocation or overflow.
fn tampered_layouts_are_refused(ck: &Path, tmp: &Path) {
    type Edit = fn(&mut serde_json::Value);
    let cases: [(&str, Edit, &str); 7] = [
        (
            "overlapping-cuts",
            |l| {
                let r = &mut l["params"]["model.layers.0.self_attn.q_proj.weight"]["ranks"];
                r[1]["range"] = r[0]["range"].clone();
            },
            "do not cover 0..",
        ),
        (
            "false-tp-size",
            |l| {
                l["tensor_parallel_size"] = 1.into();
                for p in l["params"].as_object_mut().unwrap().values_mut() {
                    p["ranks"].as_array_mut().unwrap().truncate(1);
                }
                l["optimizer"].as_array_mut().unwrap().truncate(1);
            },
            "do not cover 0..",
        ),
        (
            "overlapping-zero-ranges",
            |l| {
                // Data-parallel rank 1's file claims values rank 0's file already covers.
                let files = l["optimizer"][0].as_array_mut().unwrap();
                let (name, range) = {
                    let (k, v) = files[0].as_object().unwrap().iter().next().unwrap();
                    (k.clone(), v.clone())
                };
                files[1][name.as_str()] = range;
            },
            "the optimizer files of tensor-parallel rank 0 cover values",
        ),
        (
            "missing-param",
            |l| {
                let params = l["params"].as_object_mut().unwrap();
                params.remove("model.norm.weight");
                for files in l["optimizer"].as_array_mut().unwrap() {
                    for f in files.as_array_mut().unwrap() {
                        f.as_object_mut().unwrap().remove("model.norm.weight");
                    }
                }
            },
            "holds model.norm.weight, which shards.json does not list",
        ),
        (
            "huge-shape",
            |l| {
                let p = &mut l["params"]["model.norm.weight"];
                p["shape"] = serde_json::json!([1u64 << 40, 96]);
            },
            // Caught by the moments' coverage, or by rank 0's piece: never allocated.
            "model.norm.weight: ",
        ),
        (
            "overflowing-shape",
            |l| {
                let p = &mut l["params"]["model.norm.weight"];
                p["shape"] = serde_json::json!([1u64 << 62, 96]);
            },
            "holds more values than memory can",
        ),
        (
            "extra-rank-file",
            |l| {
                // Rank 1's file stays, the layout claims one rank of whole tensors.
                l["tensor_parallel_size"] = 1.into();
                for p in l["params"].as_object_mut().unwrap().values_mut() {
                    let shape = p["shape"].clone();
                    p["ranks"] = serde_json::json!([null]);
                    p["shape"] = shape;
                }
                l["optimizer"] = serde_json::json!([]);
            },
            "shards.json says tensor_parallel_size 1, but",
        ),
    ];
    for (name, edit, expect) in cases {
        let dir = tmp.join(format!("tampered-{name}"));
        copy_dir(ck, &dir);
        let path = dir.join("shards.json");
        let mut layout: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        edit(&mut layout);
        std::fs::write(&path, serde_json::to_vec(&layout).unwrap()).unwrap();
        let out_dir = tmp.join(format!("tampered-{name}-full"));
        let out = kiln_one_thread()
            .args(["convert", "--to-full", "--model"])
            .arg(&dir)
            .arg("--out")
            .arg(&out_dir)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{name}: {err}");
        assert!(err.contains(expect), "{name}: {err}");
        assert_eq!(err.trim().lines().count(), 1, "{name}: one sentence: {err}");
        assert!(!out_dir.exists(), "{name}: nothing is written");
    }
}

/// `kiln launch --max-restarts 1` of a pure tensor-parallel job (TP = 2, data-parallel size 1): rank
/// 1 killed after step 3 (its last checkpoint is step 2's), every worker restarted, and the job
/// ends with the very bits of an unbroken run: weights, logged losses (step 3, taken twice, listed
/// once) and `train_loss`. The restart choice used to travel over the
/// data-parallel group only (rank 0 alone here): rank 1 started over from random weights beside a
/// resumed rank 0, logged wrong losses and died.
#[test]
fn a_restarted_tensor_parallel_job_equals_an_unbroken_one() {
    let Some((tmp, hf, corpus)) = setup() else {
        return;
    };
    let cfg = config(tmp.path(), "e.json", 4, 2, false, true);
    let run = Run {
        cfg: &cfg,
        tokenizer: &hf,
        corpus: &corpus,
        out: tmp.path(),
    };
    let args = [
        "--max-steps",
        "6",
        "--per-device-train-batch-size",
        "2",
        "--save-steps",
        "2",
        "--seed",
        "5",
    ];
    let job = |name: &str, restarts: &str| {
        let mut c = kiln_one_thread();
        c.args([
            "launch",
            "--nproc-per-node",
            "2",
            "--max-restarts",
            restarts,
        ])
        .args(["--master-port", &common::free_ports(2).to_string()])
        .args(["--timeout", "60", "--"])
        .args(train_args(&run, &tmp.path().join(name), 2, &args));
        c
    };
    let st = job("unbroken", "0").status().unwrap();
    assert!(st.success(), "the unbroken job failed");
    let out = job("restarted", "1")
        .env("KILN_LOG", "info")
        .env("KILN_TEST_CRASH_AT", "train:step:3")
        .env("KILN_TEST_CRASH_RANK", "1")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "the restarted job failed: {err}");
    assert!(
        err.contains("worker rank 1 was killed by signal 9")
            && err.contains("restart 1: resuming from")
            && err.contains("checkpoint-2"),
        "no restart from checkpoint-2 reported: {err}"
    );
    let weights =
        |n: &str| read_safetensors(&tmp.path().join(n).join("model.safetensors")).unwrap();
    let d = max_diff(&weights("restarted"), &weights("unbroken"));
    assert_eq!(
        d, 0.0,
        "the restarted job differs from the unbroken one by {d}"
    );
    let (a, b) = (
        losses(&tmp.path().join("restarted")),
        losses(&tmp.path().join("unbroken")),
    );
    assert_eq!(a, b, "logged losses");
    assert_eq!(a.len(), 6);
    let train_loss = |n: &str| {
        let v: serde_json::Value = serde_json::from_slice(
            &std::fs::read(tmp.path().join(n).join("train_results.json")).unwrap(),
        )
        .unwrap();
        v["train_loss"].as_f64().unwrap()
    };
    assert_eq!(
        train_loss("restarted"),
        train_loss("unbroken"),
        "train_loss"
    );
}

/// `kiln convert`: HF → TP 2 → full, HF → TP 2 → TP 3 → full and through NxD's fused q/k/v
/// layout give back the very bytes of the model file; a bad size is one sentence.
#[test]
fn convert_round_trips_are_byte_identical() {
    let Some(gguf) = asset("smollm2/SmolLM2-135M-Instruct.Q4_1.gguf") else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let dir = |n: &str| tmp.path().join(n);
    let convert = |args: &[&str], from: &Path, to: &Path| {
        let out = kiln_one_thread()
            .arg("convert")
            .args(args)
            .arg(if args.is_empty() {
                "--from-gguf"
            } else {
                "--model"
            })
            .arg(from)
            .arg("--out")
            .arg(to)
            .output()
            .unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stderr).to_string(),
        )
    };
    assert!(convert(&[], &gguf, &dir("hf")).0);
    for (from, args, to) in [
        ("hf", &["--to-tp", "2"][..], "tp2"),
        ("tp2", &["--to-tp", "3"][..], "tp3"),
        ("tp2", &["--to-full"][..], "full2"),
        ("tp3", &["--to-full"][..], "full3"),
    ] {
        let (ok, err) = convert(args, &dir(from), &dir(to));
        assert!(ok, "{from} → {to}: {err}");
    }
    // NxD's fused q/k/v with GQA-correct sizes: at TP 2 rank 0 holds query heads 0..6 and the
    // key/value heads 0..2 they read; at TP 4 (fewer key/value heads than ranks) rank 2 holds
    // query heads 5..7, which read key/value heads 1 and 2.
    for (args, to, rank, rows) in [
        (
            &["--to-tp", "2", "--coalesce-qkv"][..],
            "tp2-fused",
            0,
            (6 + 2 * 2) * 64,
        ),
        (
            &["--to-tp", "4", "--coalesce-qkv"][..],
            "tp4-fused",
            2,
            (2 + 2 * 2) * 64,
        ),
    ] {
        let (ok, err) = convert(args, &dir("hf"), &dir(to));
        assert!(ok, "{to}: {err}");
        let shard = read_safetensors(&dir(to).join(format!("model/tp_rank_{rank:02}.safetensors")))
            .unwrap();
        assert_eq!(
            shard["model.layers.0.self_attn.qkv_proj.weight"].shape,
            vec![rows, 576]
        );
        assert!(!shard.contains_key("model.layers.0.self_attn.q_proj.weight"));
        let full = format!("{to}-full");
        let (ok, err) = convert(&["--to-full"], &dir(to), &dir(&full));
        assert!(ok, "{full}: {err}");
    }
    let original = std::fs::read(dir("hf/model.safetensors")).unwrap();
    for full in ["full2", "full3", "tp2-fused-full", "tp4-fused-full"] {
        let back = std::fs::read(dir(full).join("model.safetensors")).unwrap();
        assert!(
            back == original,
            "{full}/model.safetensors differs from the original"
        );
    }
    // TP 3 shards are what a TP = 3 run holds: SmolLM2's 9 heads, 3 per rank.
    let shard = read_safetensors(&dir("tp3/model/tp_rank_01.safetensors")).unwrap();
    assert_eq!(
        shard["model.layers.0.self_attn.q_proj.weight"].shape,
        vec![192, 576]
    );
    let (ok, err) = convert(&["--to-tp", "10"], &dir("hf"), &dir("tp10"));
    assert!(
        !ok && err.contains("more than the model's 9 attention heads"),
        "{err}"
    );
    let (ok, err) = convert(&["--to-tp", "2"], &dir("hf"), &dir("tp2"));
    assert!(
        !ok && err.contains("the folder exists and is not empty"),
        "{err}"
    );
    // config.json smaller than the tensors: the tensors decide, a disagreement is one sentence
    // (it used to keep the first 2-50 % of those weights); more key/value heads than heads too
    // (it used to panic).
    for (key, value, expect) in [
        (
            "vocab_size",
            1000,
            "model.embed_tokens.weight: config.json makes dimension 0 1000 long",
        ),
        ("intermediate_size", 64, "64 long"),
        ("head_dim", 32, "config.json makes dimension 0"),
        ("num_key_value_heads", 18, "num_key_value_heads"),
    ] {
        let bad = dir(&format!("hf-{key}"));
        copy_dir(&dir("hf"), &bad);
        let path = bad.join("config.json");
        let mut cfg: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        cfg[key] = value.into();
        std::fs::write(&path, serde_json::to_vec(&cfg).unwrap()).unwrap();
        let to = dir(&format!("hf-{key}-tp2"));
        let (ok, err) = convert(&["--to-tp", "2"], &bad, &to);
        assert!(!ok && err.contains(expect), "{key} {value}: {err}");
        assert_eq!(err.trim().lines().count(), 1, "{key}: one sentence: {err}");
        assert!(!to.exists(), "{key}: nothing is written");
    }
}

/// Two "machines" on loopback (two launchers, `--nnodes 2`, two workers each): TP = 2 inside
/// each machine, data parallelism with ZeRO-1 across them, equals one process.
#[test]
fn two_nodes_tensor_parallel_inside_data_parallel_across() {
    let Some((tmp, hf, corpus)) = setup() else {
        return;
    };
    let cfg = config(tmp.path(), "n.json", 9, 3, false, true);
    let run = Run {
        cfg: &cfg,
        tokenizer: &hf,
        corpus: &corpus,
        out: tmp.path(),
    };
    let single = train(&run, "single", (1, 1), 3, &[]);
    let out = tmp.path().join("two-nodes");
    let port = common::free_ports(4).to_string();
    let node = |rank: usize| {
        kiln_one_thread()
            .args(["launch", "--nnodes", "2", "--node-rank", &rank.to_string()])
            .args(["--nproc-per-node", "2", "--master-addr", "127.0.0.1"])
            .args(["--master-port", &port, "--timeout", "60", "--"])
            .args(train_args(
                &run,
                &out,
                2,
                &[
                    "--max-steps",
                    "5",
                    "--save-strategy",
                    "no",
                    "--seed",
                    "3",
                    "--per-device-train-batch-size",
                    "2",
                    "--zero-1",
                ],
            ))
            .spawn()
            .unwrap()
    };
    let (mut n0, mut n1) = (node(0), node(1));
    assert!(n0.wait().unwrap().success() && n1.wait().unwrap().success());
    let nodes = read_safetensors(&out.join("model.safetensors")).unwrap();
    let d = max_diff(&nodes, &single);
    let l = same_losses(&run, "two-nodes", "single");
    eprintln!(
        "2 nodes × (TP = 2) with ZeRO-1 across vs one process: max |Δw| = {d:e}, losses {l:e}"
    );
    assert!(
        d <= ADAMW_ROUNDING,
        "two nodes differ from one process by {d}"
    );
}

/// `kiln generate` and `kiln eval --task causal-lm` under `--tensor-parallel-size`: SmolLM2 cut
/// over 3 processes (from a `convert --to-tp 3` folder) decodes the same greedy tokens as one
/// process, and over 2 gives the same held-out loss.
#[test]
fn generate_and_eval_under_tensor_parallelism() {
    let Some((tmp, hf, corpus)) = setup() else {
        return;
    };
    let tp3 = tmp.path().join("tp3");
    let st = kiln_one_thread()
        .args(["convert", "--to-tp", "3", "--model"])
        .arg(&hf)
        .arg("--out")
        .arg(&tp3)
        .status()
        .unwrap();
    assert!(st.success());
    let generate = |procs: usize, model: &Path| {
        let out = launched(procs)
            .args([
                "generate",
                "--prompt",
                "The jury said",
                "--max-new-tokens",
                "8",
            ])
            .args([
                "--ignore-eos",
                "--json",
                "--tensor-parallel-size",
                &procs.to_string(),
            ])
            .arg("--model")
            .arg(model)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        let json = &text[text.find('{').expect("a JSON line")..];
        let v: serde_json::Value = serde_json::from_str(json.lines().next().unwrap()).unwrap();
        v["new_ids"].clone()
    };
    let one = generate(1, &hf);
    assert_eq!(one.as_array().unwrap().len(), 8);
    assert_eq!(generate(3, &tp3), one, "TP = 3 decodes other tokens");
    let eval = |procs: usize| {
        let metrics = tmp.path().join(format!("eval-{procs}.json"));
        let st = launched(procs)
            .args(["eval", "--task", "causal-lm", "--block-size", "64"])
            .args(["--tensor-parallel-size", &procs.to_string(), "--model"])
            .arg(&hf)
            .arg("--eval-file")
            .arg(&corpus)
            .arg("--output")
            .arg(&metrics)
            .status()
            .unwrap();
        assert!(st.success());
        let v: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&metrics).unwrap()).unwrap();
        v["eval_loss"].as_f64().unwrap()
    };
    let (l1, l2) = (eval(1), eval(2));
    assert!(
        (l1 - l2).abs() < 1e-4,
        "eval loss {l1} alone, {l2} at TP = 2"
    );
}

#[test]
fn bad_tensor_parallel_layouts_are_one_sentence() {
    let Some(brown) = asset("brown/eval.jsonl") else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let cfg = config(tmp.path(), "c.json", 4, 2, true, false);
    let corpus = corpus(tmp.path(), &brown);
    // Each command must fail before anything is loaded (the tokenizer does not even exist).
    let fail = |extra: &[&str]| {
        let out = kiln_one_thread()
            .args(["train", "--task", "causal-lm", "--from-config"])
            .arg(&cfg)
            .arg("--tokenizer")
            .arg(tmp.path().join("missing-tokenizer"))
            .arg("--train-file")
            .arg(&corpus)
            .args(extra)
            .args(if extra.contains(&"--per-device-train-batch-size") {
                &[][..]
            } else {
                &["--per-device-train-batch-size", "4"][..]
            })
            .arg("--output-dir")
            .arg(tmp.path().join("o"))
            .output()
            .unwrap();
        assert!(!out.status.success());
        String::from_utf8_lossy(&out.stderr).to_string()
    };
    // Alone, TP 2 has no second process.
    let err = fail(&["--tensor-parallel-size", "2"]);
    assert!(
        err.contains("--tensor-parallel-size 2 needs 2 processes"),
        "{err}"
    );
    // More ranks than attention heads, said before the tokenizer (missing) is looked for.
    let out = kiln_one_thread()
        .args(["launch", "--nproc-per-node", "5"])
        .args(["--master-port", &common::free_ports(5).to_string()])
        .args([
            "--timeout",
            "60",
            "--",
            "train",
            "--task",
            "causal-lm",
            "--from-config",
        ])
        .arg(&cfg)
        .arg("--tokenizer")
        .arg(tmp.path().join("missing-tokenizer"))
        .arg("--train-file")
        .arg(&corpus)
        .args(["--tensor-parallel-size", "5", "--output-dir"])
        .arg(tmp.path().join("o5"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("--tensor-parallel-size 5 is more than the model's 4 attention heads"),
        "{err}"
    );
    // A global batch that the per-device batch does not divide.
    let err = fail(&[
        "--global-batch-size",
        "6",
        "--per-device-train-batch-size",
        "4",
    ]);
    assert!(
        err.contains("--global-batch-size 6 is not a multiple of --per-device-train-batch-size 4"),
        "{err}"
    );
}
