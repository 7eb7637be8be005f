//! `--task dpo` and `--task orpo` against TRL's `DPOTrainer` and `ORPOTrainer`, from the fixtures `tests/fixtures/gen_dpo.py` wrote
//! (tests/fixtures/dpo/README.md): the same rows prepared into the same token ids, and four
//! AdamW steps on a tiny chat Llama giving TRL's loss and every metric it logs, step by step,
//! then its evaluation — for the sigmoid, hinge and IPO losses, standard, conversational and
//! implicit-prompt rows, truncation, and a LoRA adapter, and for ORPO with and without LoRA; alone,
//! at DP = 2 and at TP = 2 (ranks as processes of this test binary).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use kiln::backend::{CpuDevice, CpuTrain};
use kiln::contract::{BatchSource, IGNORE_INDEX};
use kiln::data::chat_template::ChatTemplate;
use kiln::data::preference::PreferenceOptions;
use kiln::data::preference::SpecialIds;
use kiln::parallel::DistEnv;
use kiln::tasks::adapter::LoraSetup;
use kiln::tasks::causal_lm::{self, CausalLmOptions};
use kiln::tasks::preference::{
    DpoLossType, PreferenceData, PreferenceMethod, PreferenceSet, PreferenceTokenization,
};
use kiln::train::schedule::SchedulerType;
use kiln::train::{IntervalStrategy, SaveStrategy, TrainingArguments};
use kiln_testkit::common;
use serde_json::Value;

const TEST: &str = "dpo_under_data_and_tensor_parallelism_equals_trl";

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/dpo")
}

fn trl() -> Value {
    serde_json::from_slice(&std::fs::read(fixtures().join("dpo.json")).unwrap()).unwrap()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// A case's settings: DPO's (with its loss type) or ORPO's.
fn preference_case(case: &Value) -> PreferenceData {
    let config = &case["config"];
    let method = if case["trainer"].as_str().unwrap().contains("ORPO") {
        PreferenceMethod::Orpo
    } else {
        let loss = config["loss_type"][0].as_str().unwrap();
        PreferenceMethod::Dpo(DpoLossType::from_name(loss).unwrap())
    };
    PreferenceData {
        options: PreferenceOptions {
            max_length: config["max_length"].as_u64().map(|m| m as usize),
            eos_token: None,
        },
        beta: config["beta"].as_f64().unwrap(),
        method,
        pad_to_multiple_of: None,
    }
}

fn is_orpo(case: &Value) -> bool {
    preference_case(case).method == PreferenceMethod::Orpo
}

const CASES: [&str; 9] = [
    "standard_sigmoid",
    "standard_hinge",
    "standard_ipo",
    "truncation_sigmoid",
    "standard_lora_sigmoid",
    "implicit_sigmoid",
    "conversational_sigmoid",
    "orpo_standard",
    "orpo_standard_lora",
];

#[test]
fn preference_rows_are_prepared_and_batched_as_trl_does() {
    let trl = trl();
    let model = fixtures().join("tiny_chat_llama");
    let tok = causal_lm::load_tokenizer(&model).unwrap();
    let template = ChatTemplate::from_model_dir(&model).unwrap();
    for name in CASES {
        let case = &trl["cases"][name];
        let options = PreferenceOptions {
            eos_token: Some("<|im_end|>".into()),
            ..preference_case(case).options
        };
        let how = PreferenceTokenization {
            tokenizer: &tok,
            template: template.as_ref(),
            options: &options,
            orpo: is_orpo(case).then_some(SpecialIds {
                bos: None,
                eos: Some(2),
            }),
        };
        let file = fixtures().join(case["train_file"].as_str().unwrap());
        let set = PreferenceSet::read(&file, &how, 2, false, None).unwrap();
        let prepared = case["prepared"].as_array().unwrap();
        assert_eq!(set.len(), prepared.len(), "{name}: rows kept");
        for (i, (got, want)) in set.examples.iter().zip(prepared).enumerate() {
            if is_orpo(case) {
                // Each side whole, its own prompt's tokens unlabelled.
                for (side, key) in ["chosen", "rejected"].iter().enumerate() {
                    let completion = [&got.chosen_ids, &got.rejected_ids][side];
                    let seq: Vec<u32> = got.prompt_ids.iter().chain(completion).copied().collect();
                    assert_eq!(
                        seq,
                        ids(&want[format!("{key}_input_ids")]),
                        "{name} row {i} {key}"
                    );
                    let unlabelled = want[format!("{key}_labels")]
                        .as_array()
                        .unwrap()
                        .iter()
                        .take_while(|l| l.as_i64() == Some(IGNORE_INDEX))
                        .count();
                    let prompt = got.prompt_ids.len() + got.prompt_tail[side];
                    assert_eq!(prompt, unlabelled, "{name} row {i} {key}'s prompt");
                }
                continue;
            }
            assert_eq!(
                got.prompt_ids,
                ids(&want["prompt_ids"]),
                "{name} row {i} prompt"
            );
            assert_eq!(
                got.chosen_ids,
                ids(&want["chosen_ids"]),
                "{name} row {i} chosen"
            );
            assert_eq!(
                got.rejected_ids,
                ids(&want["rejected_ids"]),
                "{name} row {i} rejected"
            );
        }
        if is_orpo(case) {
            continue;
        }
        // The collated batch: TRL's ids, and a target wherever its completion mask marks the next
        // token.
        let all: Vec<usize> = (0..set.len()).collect();
        let (batch, sides) = set.batch(&all);
        let collated = &case["collated"];
        let rows: Vec<Vec<u32>> = collated["input_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(ids)
            .collect();
        let want: Vec<i64> = rows.iter().flatten().map(|&t| i64::from(t)).collect();
        assert_eq!(batch.ids, want, "{name}: collated ids");
        let masks: Vec<Vec<u32>> = collated["completion_mask"]
            .as_array()
            .unwrap()
            .iter()
            .map(ids)
            .collect();
        let seq = rows[0].len();
        let scoring = batch.scoring.as_ref().unwrap();
        let attention: Vec<Vec<u32>> = collated["attention_mask"]
            .as_array()
            .unwrap()
            .iter()
            .map(ids)
            .collect();
        for (r, (row, mask)) in rows.iter().zip(&masks).enumerate() {
            for t in 0..seq {
                let real = attention[r].get(t + 1) == Some(&1);
                let want = if real {
                    i64::from(row[t + 1])
                } else {
                    IGNORE_INDEX
                };
                assert_eq!(scoring.targets[r * seq + t], want, "{name}: target {r},{t}");
                let completion = mask.get(t + 1) == Some(&1);
                assert_eq!(
                    scoring.completion[r * seq + t],
                    completion,
                    "{name}: {r},{t}"
                );
            }
        }
        assert_eq!(sides.len(), rows.len());
    }
}

/// A run of one TRL case's settings into `out`: its log lines (steps, then the evaluation).
fn run(name: &str, out: &Path, ranks: (usize, usize)) -> Vec<Value> {
    run_with(name, out, ranks, |a| a)
}

/// [`run`] with `change` applied to its arguments.
fn run_with(
    name: &str,
    out: &Path,
    ranks: (usize, usize),
    change: impl FnOnce(TrainingArguments) -> TrainingArguments,
) -> Vec<Value> {
    run_chunked(name, out, ranks, change, None)
}

/// [`run_with`], the output head's product and scores computed `loss_chunk` positions at a time
/// (`None`: kiln's default, which at this vocabulary takes the whole logits).
fn run_chunked(
    name: &str,
    out: &Path,
    (world, tp): (usize, usize),
    change: impl FnOnce(TrainingArguments) -> TrainingArguments,
    loss_chunk: Option<usize>,
) -> Vec<Value> {
    let trl = trl();
    let case = &trl["cases"][name];
    let config = &case["config"];
    let fixtures = fixtures();
    let opts = CausalLmOptions {
        model_dir: Some(fixtures.join("tiny_chat_llama")),
        train_file: Some(fixtures.join(case["train_file"].as_str().unwrap())),
        eval_file: case["eval_file"].as_str().map(|f| fixtures.join(f)),
        dpo: Some(preference_case(case)),
        lora: case["peft_config"]
            .is_object()
            .then(|| LoraSetup::Continue(fixtures.join("lora_initial_adapter"))),
        loss_chunk,
        ..CausalLmOptions::default()
    };
    let batch = config["per_device_train_batch_size"].as_u64().unwrap() as usize;
    let args = TrainingArguments {
        output_dir: out.to_path_buf(),
        max_steps: 4,
        per_device_eval_batch_size: config["per_device_eval_batch_size"].as_u64().unwrap() as usize,
        learning_rate: config["learning_rate"].as_f64().unwrap(),
        lr_scheduler_type: SchedulerType::Constant,
        weight_decay: 0.0,
        max_grad_norm: config["max_grad_norm"].as_f64().unwrap(),
        logging_steps: 1.0,
        save_strategy: SaveStrategy::No,
        eval_strategy: IntervalStrategy::No,
        seed: 42,
        tensor_parallel_size: tp,
        ..TrainingArguments::default()
    };
    // Each data-parallel replica (of `tp × pp` processes) takes its share of TRL's batch.
    let args = change(args);
    let args = TrainingArguments {
        per_device_train_batch_size: batch * tp * args.pipeline_parallel_size / world,
        ..args
    };
    let (_, eval) = causal_lm::train::<CpuTrain>(&opts, args, &CpuDevice::default()).unwrap();
    if let (Some(eval), true) = (eval, kiln::parallel::is_main_process().unwrap()) {
        std::fs::write(
            out.join("eval.json"),
            serde_json::to_vec(&eval.metrics).unwrap(),
        )
        .unwrap();
    }
    common::read_log_and_eval(out)
}

/// The metrics TRL's ORPO logs at every step that kiln logs alike (its `logits/*` average
/// padding positions too, which kiln's unmasked attention computes otherwise).
const ORPO_METRICS: [&str; 11] = [
    "loss",
    "grad_norm",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
    "nll_loss",
    "log_odds_ratio",
    "log_odds_chosen",
];

/// The metrics a case's trainer logs that kiln must log alike.
fn metrics_of(case: &Value) -> &'static [&'static str] {
    if is_orpo(case) {
        &ORPO_METRICS
    } else {
        &METRICS
    }
}

/// The metrics TRL's DPO logs at every step, and that kiln must log alike.
const METRICS: [&str; 13] = [
    "loss",
    "num_tokens",
    "grad_norm",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
    "logits/chosen",
    "logits/rejected",
    "mean_token_accuracy",
    "entropy",
];

/// kiln's log against TRL's ([`common::compare_trl_log`]). At step 1 every reward is 0 (policy =
/// reference) up to the rounding of two batchings of the same rows; whether the chosen one is
/// ahead is then a coin toss, so step 1's `rewards/accuracies` is not compared.
fn compare(name: &str, got: &[Value], want: &[Value], metrics: &[&str]) -> f64 {
    common::compare_trl_log(name, got, want, metrics, &|step, key| {
        step == 0 && key == "rewards/accuracies"
    })
}

#[test]
fn dpo_steps_equal_trls() {
    if DistEnv::from_env().unwrap().is_some() {
        return;
    }
    let trl = trl();
    let tmp = tempfile::tempdir().unwrap();
    for name in CASES {
        let out = tmp.path().join(name);
        let got = run(name, &out, (1, 1));
        let want = trl["cases"][name]["log_history"].as_array().unwrap();
        let worst = compare(name, &got, want, metrics_of(&trl["cases"][name]));
        eprintln!("{name}: largest relative difference from TRL {worst:.2e}");
    }
}

fn worker() {
    let out = PathBuf::from(std::env::var("KILN_TEST_OUT").unwrap());
    let world: usize = std::env::var("WORLD_SIZE").unwrap().parse().unwrap();
    let tp: usize = std::env::var("KILN_TEST_TP").unwrap().parse().unwrap();
    let name = std::env::var("KILN_TEST_CASE").unwrap();
    let zero_1 = std::env::var("KILN_TEST_ZERO1").is_ok_and(|v| v == "1");
    let var = |name: &str| std::env::var(name).unwrap();
    let chunk: usize = var("KILN_TEST_LOSS_CHUNK").parse().unwrap();
    let pp: usize = var("KILN_TEST_PP").parse().unwrap();
    let micro: i64 = var("KILN_TEST_MICRO").parse().unwrap();
    let change = |a| TrainingArguments {
        zero_1,
        pipeline_parallel_size: pp,
        pipeline_parallel_num_microbatches: micro,
        ..a
    };
    run_chunked(
        &name,
        &out,
        (world, tp),
        change,
        Some(chunk).filter(|&c| c > 0),
    );
}

/// How [`launch`] lays a run out besides its process count.
#[derive(Debug, Clone, Copy)]
struct Layout {
    tp: usize,
    pp: usize,
    /// `--pipeline-parallel-num-microbatches` (-1: a micro-batch per pair).
    micro: i64,
    /// AdamW's moments split over the data-parallel ranks.
    zero_1: bool,
    /// The head's scores computed this many positions at a time (0: kiln's default).
    loss_chunk: usize,
}

const ALONE: Layout = Layout {
    tp: 1,
    pp: 1,
    micro: -1,
    zero_1: false,
    loss_chunk: 0,
};

/// [`run`] as `world` processes of this binary laid out as `layout` says; rank 0's log.
fn launch(name: &str, out: &Path, world: usize, layout: Layout) -> Vec<Value> {
    common::run_test_ranks(
        TEST,
        world,
        &[
            ("KILN_TEST_OUT", out.display().to_string()),
            ("KILN_TEST_TP", layout.tp.to_string()),
            ("KILN_TEST_PP", layout.pp.to_string()),
            ("KILN_TEST_MICRO", layout.micro.to_string()),
            ("KILN_TEST_CASE", name.to_string()),
            ("KILN_TEST_ZERO1", u8::from(layout.zero_1).to_string()),
            ("KILN_TEST_LOSS_CHUNK", layout.loss_chunk.to_string()),
        ],
    );
    common::read_log_and_eval(out)
}

#[test]
fn dpo_under_data_and_tensor_parallelism_equals_trl() {
    if DistEnv::from_env().unwrap().is_some() {
        return worker();
    }
    let trl = trl();
    let tmp = tempfile::tempdir().unwrap();
    let mut seen = BTreeMap::new();
    let tp_2 = Layout { tp: 2, ..ALONE };
    let pp_2 = Layout { pp: 2, ..ALONE };
    for (name, world, layout) in [
        ("standard_sigmoid", 2, ALONE),
        // ZeRO-1: each rank updates half of AdamW's moments, the same numbers.
        (
            "standard_sigmoid",
            2,
            Layout {
                zero_1: true,
                ..ALONE
            },
        ),
        ("standard_sigmoid", 2, tp_2),
        ("standard_lora_sigmoid", 2, tp_2),
        // ORPO at TP = 2 only: its NLL is a mean over a batch's chosen tokens, so at DP = 2 each
        // rank's mean over its own half is averaged (as under PyTorch DDP), not TRL's one batch's.
        ("orpo_standard", 2, tp_2),
        // The vocabulary-parallel head a few positions at a time: each rank's rows of the head,
        // the scores summed over the group, the head's gradient recomputed in the backward.
        (
            "standard_sigmoid",
            2,
            Layout {
                loss_chunk: 3,
                ..tp_2
            },
        ),
        (
            "orpo_standard",
            2,
            Layout {
                loss_chunk: 3,
                ..tp_2
            },
        ),
        // Two pipeline stages, a micro-batch per pair: the reference pass runs through both
        // stages, the last scores, and every stage gets the scores; TRL's metrics come from the
        // last stage's micro-batches.
        ("standard_sigmoid", 2, pp_2),
        ("standard_lora_sigmoid", 2, pp_2),
        // ORPO's NLL is the batch's mean: one micro-batch of the whole batch.
        ("orpo_standard", 2, Layout { micro: 1, ..pp_2 }),
        // Every layout at once: TP 2 × PP 2, the head in chunks, ZeRO-1 (a replica alone).
        (
            "standard_sigmoid",
            4,
            Layout {
                tp: 2,
                pp: 2,
                micro: -1,
                zero_1: true,
                loss_chunk: 3,
            },
        ),
    ] {
        let out = tmp.path().join(format!("{name}-{world}-{layout:?}"));
        let got = launch(name, &out, world, layout);
        let want = trl["cases"][name]["log_history"].as_array().unwrap();
        let worst = compare(
            &format!("{name} at world {world}, {layout:?}"),
            &got,
            want,
            metrics_of(&trl["cases"][name]),
        );
        seen.insert(format!("{name} {world} {layout:?}"), worst);
    }
    eprintln!("largest relative differences from TRL: {seen:?}");
}

/// The policy's and the reference's scores computed in the output head a few positions at a time
/// (never the whole logits) train as TRL does: DPO and ORPO, with and without LoRA (whose frozen
/// head's weight gets no gradient), in chunks of 3 positions (dozens per batch, the last short).
#[test]
fn dpo_with_the_head_in_chunks_equals_trl() {
    if DistEnv::from_env().unwrap().is_some() {
        return;
    }
    let trl = trl();
    let tmp = tempfile::tempdir().unwrap();
    for name in [
        "standard_sigmoid",
        "standard_lora_sigmoid",
        "conversational_sigmoid",
        "orpo_standard",
        "orpo_standard_lora",
    ] {
        let out = tmp.path().join(name);
        let got = run_chunked(name, &out, (1, 1), |a| a, Some(3));
        let want = trl["cases"][name]["log_history"].as_array().unwrap();
        let worst = compare(name, &got, want, metrics_of(&trl["cases"][name]));
        eprintln!("{name} in chunks of 3: largest relative difference from TRL {worst:.2e}");
    }
}

/// Activation checkpointing (each segment recomputed, the scores observed from the recomputed
/// head) and a resume from step 2's checkpoint give TRL's numbers too; the resumed run ends on
/// the uninterrupted run's weights, bit for bit (the reference is recomputed from the model as
/// loaded, which is the reference).
#[test]
fn dpo_by_segment_and_resumed_equals_trl() {
    if DistEnv::from_env().unwrap().is_some() {
        return;
    }
    let trl = trl();
    let want = trl["cases"]["standard_sigmoid"]["log_history"]
        .as_array()
        .unwrap()
        .clone();
    let tmp = tempfile::tempdir().unwrap();
    let by_segment = run_with("standard_sigmoid", &tmp.path().join("ck"), (1, 1), |a| {
        TrainingArguments {
            gradient_checkpointing: true,
            ..a
        }
    });
    compare("standard_sigmoid by segment", &by_segment, &want, &METRICS);

    let saving = |a: TrainingArguments| TrainingArguments {
        save_strategy: SaveStrategy::Steps,
        save_steps: 2.0,
        ..a
    };
    let full_dir = tmp.path().join("full");
    run_with("standard_sigmoid", &full_dir, (1, 1), saving);
    let resumed_dir = tmp.path().join("resumed");
    let checkpoint = full_dir.join("checkpoint-2").display().to_string();
    let resumed = run_with("standard_sigmoid", &resumed_dir, (1, 1), |a| {
        TrainingArguments {
            resume_from_checkpoint: Some(checkpoint),
            ..saving(a)
        }
    });
    // The resumed run logs steps 3 and 4: TRL's.
    let resumed_steps: Vec<&Value> = resumed
        .iter()
        .filter(|e| e.get("loss").is_some() && e.get("train_loss").is_none())
        .collect();
    assert_eq!(resumed_steps.len(), 2, "{resumed:?}");
    for (g, w) in resumed_steps.iter().zip(&want[2..4]) {
        for key in METRICS {
            let (gv, wv) = (g[key].as_f64().unwrap(), w[key].as_f64().unwrap());
            assert!(
                (gv - wv).abs() <= 5e-5 + 2e-3 * wv.abs().max(1.0),
                "resumed step {}: {key} {gv} vs TRL's {wv}",
                g["step"]
            );
        }
    }
    let weights = |d: &Path| {
        kiln::formats::safetensors::read_safetensors(&d.join("model.safetensors")).unwrap()
    };
    let (a, b) = (weights(&full_dir), weights(&resumed_dir));
    assert_eq!(a.len(), b.len());
    for (k, t) in &a {
        assert!(t.data == b[k].data, "{k}: the resumed run's weights differ");
    }
}
