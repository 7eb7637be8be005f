//! `--task reward-modeling` against TRL's `RewardTrainer`, from the fixtures
//! `tests/fixtures/gen_reward.py` wrote (tests/fixtures/reward/README.md): the same rows prepared
//! into the same token ids and batches, each row's reward read where transformers'
//! `LlamaForSequenceClassification` reads it, four AdamW steps on a tiny chat Llama giving TRL's
//! loss and every metric it logs, step by step, then its evaluation — for standard,
//! conversational and implicit-prompt rows, dropped over-long rows, margins, centred rewards and
//! a LoRA adapter (with PEFT's trainable score copy); alone, at DP = 2 and at TP = 2. A model
//! transformers trained and saved scores in kiln as transformers scores it.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use kiln::backend::{Cpu, CpuDevice, CpuTrain};
use kiln::contract::{BatchSource, Model};
use kiln::data::chat_template::ChatTemplate;
use kiln::data::lm::TokenBatch;
use kiln::data::reward::RewardOptions;
use kiln::models::decoder::DecoderArchitecture;
use kiln::models::llama::config::LlamaConfig;
use kiln::models::llama::{last_non_padding, Llama};
use kiln::parallel::DistEnv;
use kiln::tasks::adapter::LoraSetup;
use kiln::tasks::causal_lm::{self, CausalLmOptions};
use kiln::tasks::reward::{RewardData, RewardSet, RewardTokenization};
use kiln::train::schedule::SchedulerType;
use kiln::train::{IntervalStrategy, SaveStrategy, TrainingArguments};
use kiln_testkit::common;
use serde_json::Value;

const TEST: &str = "reward_under_data_and_tensor_parallelism_equals_trl";

const CASES: [&str; 7] = [
    "standard",
    "standard_center",
    "conversational",
    "standard_lora",
    "implicit",
    "truncation_filter",
    "standard_margin",
];

/// What TRL logs at every step that kiln logs alike.
const METRICS: [&str; 8] = [
    "loss",
    "num_tokens",
    "grad_norm",
    "accuracy",
    "margin",
    "min_reward",
    "mean_reward",
    "max_reward",
];

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn fixtures() -> PathBuf {
    repo().join("tests/fixtures/reward")
}

fn trl() -> Value {
    serde_json::from_slice(&std::fs::read(fixtures().join("reward.json")).unwrap()).unwrap()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

fn floats(v: &Value) -> Vec<f64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect()
}

fn reward_case(case: &Value) -> RewardData {
    let config = &case["config"];
    RewardData {
        options: RewardOptions {
            max_length: config["max_length"].as_u64().map(|m| m as usize),
            eos_token: None,
        },
        center_rewards_coefficient: config["center_rewards_coefficient"].as_f64(),
        pad_to_multiple_of: None,
    }
}

fn model_dir() -> PathBuf {
    fixtures().join("tiny_chat_llama_rm")
}

#[test]
fn reward_rows_are_prepared_batched_and_pooled_as_trl_does() {
    let trl = trl();
    let tok = causal_lm::load_tokenizer(&model_dir()).unwrap();
    let template = ChatTemplate::from_model_dir(&model_dir()).unwrap();
    for name in CASES {
        let case = &trl["cases"][name];
        let options = RewardOptions {
            eos_token: Some("<|im_end|>".into()),
            ..reward_case(case).options
        };
        let how = RewardTokenization {
            tokenizer: &tok,
            template: template.as_ref(),
            options: &options,
        };
        let file = repo().join(case["train_file"].as_str().unwrap());
        let set = RewardSet::read(&file, &how, 2, false, None).unwrap();
        let prepared = case["prepared"].as_array().unwrap();
        assert_eq!(set.len(), prepared.len(), "{name}: rows kept");
        for (i, (got, want)) in set.examples.iter().zip(prepared).enumerate() {
            assert_eq!(got.chosen_ids, ids(&want["chosen_ids"]), "{name} row {i}");
            assert_eq!(
                got.rejected_ids,
                ids(&want["rejected_ids"]),
                "{name} row {i}"
            );
            let margin = want.get("margin").map_or(0.0, |m| m.as_f64().unwrap());
            assert_eq!(f64::from(got.margin), margin, "{name} row {i} margin");
        }
        // The collated batch, and where each row's reward is read.
        let all: Vec<usize> = (0..set.len()).collect();
        let (batch, sides) = set.batch(&all);
        let rows: Vec<Vec<u32>> = case["collated"]["input_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(ids)
            .collect();
        let want: Vec<i64> = rows.iter().flatten().map(|&t| i64::from(t)).collect();
        assert_eq!(batch.ids, want, "{name}: collated ids");
        assert_eq!(sides.len(), rows.len());
        let pool: Vec<usize> = ids(&case["pool_index"])
            .into_iter()
            .map(|p| p as usize)
            .collect();
        let seq = rows[0].len();
        let got: Vec<usize> = batch
            .ids
            .chunks(seq)
            .map(|row| last_non_padding(row, Some(2)))
            .collect();
        assert_eq!(got, pool, "{name}: pooled positions");
        let margins = &batch.carried.values[..set.len()];
        if let Some(m) = case["collated"].get("margin") {
            let want: Vec<f32> = floats(m).into_iter().map(|x| x as f32).collect();
            assert_eq!(margins, &want[..], "{name}: margins");
        }
    }
}

/// The model of a sequence-classifier folder, on the CPU.
fn load(dir: &Path) -> kiln::models::llama::LlamaForCausalLM<Cpu> {
    let config = LlamaConfig::from_file(&dir.join("config.json")).unwrap();
    assert_eq!(config.sequence_classifier_labels(), Some(1));
    let keep = kiln::models::params::keep_all;
    Llama::load::<Cpu>(dir, &config, &CpuDevice::default(), None, &keep).unwrap()
}

/// The rewards `model` gives `rows` (padded with id 2 into one batch, or each alone).
fn rewards(model: &kiln::models::llama::LlamaForCausalLM<Cpu>, rows: &[Vec<u32>]) -> Vec<f64> {
    let seq = rows.iter().map(Vec::len).max().unwrap();
    let ids: Vec<i64> = rows
        .iter()
        .flat_map(|r| {
            let mut r: Vec<i64> = r.iter().map(|&t| i64::from(t)).collect();
            r.resize(seq, 2);
            r
        })
        .collect();
    let batch = TokenBatch {
        ids,
        batch: rows.len(),
        seq,
        ..TokenBatch::default()
    };
    let out = model.logits(&batch);
    assert_eq!(out.dims(), [rows.len(), 1]);
    let values: Vec<f32> = out.into_data().into_vec().unwrap();
    values.into_iter().map(f64::from).collect()
}

/// TRL's trained and saved reward model, read by kiln, scores the evaluation rows as
/// transformers scores it, one row at a time and padded into one batch; and the untrained model
/// gives TRL's initial rewards.
#[test]
fn a_reward_model_transformers_saved_scores_in_kiln_as_in_transformers() {
    let trl = trl();
    let scores = &trl["scores"];
    let model = load(&repo().join(scores["model_dir"].as_str().unwrap()));
    let eval = &scores["eval_rows"];
    let rows: Vec<Vec<u32>> = ["chosen_ids", "rejected_ids"]
        .iter()
        .flat_map(|k| eval[*k].as_array().unwrap().iter().map(ids))
        .collect();
    let want: Vec<f64> = ["chosen", "rejected"]
        .iter()
        .flat_map(|k| floats(&scores["single"][*k]))
        .collect();
    let batched = rewards(&model, &rows);
    for (i, row) in rows.iter().enumerate() {
        let alone = rewards(&model, std::slice::from_ref(row))[0];
        assert!(
            (alone - want[i]).abs() < 1e-5,
            "row {i} alone: {alone} vs {}",
            want[i]
        );
        assert!(
            (batched[i] - want[i]).abs() < 1e-5,
            "row {i} batched: {} vs {}",
            batched[i],
            want[i]
        );
    }
    let initial = load(&model_dir());
    let case = &trl["cases"]["standard"];
    let rows: Vec<Vec<u32>> = case["collated"]["input_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(ids)
        .collect();
    let got = rewards(&initial, &rows);
    let want: Vec<f64> = ["chosen", "rejected"]
        .iter()
        .flat_map(|k| floats(&case["initial_rewards"][*k]))
        .collect();
    for (g, w) in got.iter().zip(&want) {
        assert!(
            (g - w).abs() < 1e-5,
            "initial rewards {got:?} vs TRL's {want:?}"
        );
    }
}

/// A run of one TRL case's settings into `out`: its log lines (steps, then the evaluation).
/// `world` processes at tensor-parallel size `tp`, `pp` pipeline stages of `micro` micro-batches
/// (-1: one per pair).
fn run(name: &str, out: &Path, (world, tp, pp, micro): (usize, usize, usize, i64)) -> Vec<Value> {
    let trl = trl();
    let case = &trl["cases"][name];
    let config = &case["config"];
    let opts = CausalLmOptions {
        model_dir: Some(model_dir()),
        train_file: Some(repo().join(case["train_file"].as_str().unwrap())),
        eval_file: case["eval_file"].as_str().map(|f| repo().join(f)),
        reward: Some(reward_case(case)),
        lora: case["peft_config"]
            .is_object()
            .then(|| LoraSetup::Continue(fixtures().join("lora_initial_adapter"))),
        ..CausalLmOptions::default()
    };
    let batch = config["per_device_train_batch_size"].as_u64().unwrap() as usize;
    let args = TrainingArguments {
        output_dir: out.to_path_buf(),
        max_steps: 4,
        per_device_train_batch_size: batch * tp * pp / world,
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
        pipeline_parallel_size: pp,
        pipeline_parallel_num_microbatches: micro,
        ..TrainingArguments::default()
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

/// kiln's log against TRL's ([`common::compare_trl_log`]), every metric at every step.
fn compare(name: &str, got: &[Value], want: &[Value], metrics: &[&str]) -> f64 {
    common::compare_trl_log(name, got, want, metrics, &|_, _| false)
}

#[test]
fn reward_steps_equal_trls() {
    if DistEnv::from_env().unwrap().is_some() {
        return;
    }
    let trl = trl();
    let tmp = tempfile::tempdir().unwrap();
    for name in CASES {
        let out = tmp.path().join(name);
        let got = run(name, &out, (1, 1, 1, -1));
        let want = trl["cases"][name]["log_history"].as_array().unwrap();
        let worst = compare(name, &got, want, &METRICS);
        eprintln!("{name}: largest relative difference from TRL {worst:.2e}");
    }
}

fn worker() {
    let out = PathBuf::from(std::env::var("KILN_TEST_OUT").unwrap());
    let world: usize = std::env::var("WORLD_SIZE").unwrap().parse().unwrap();
    let var = |name: &str| std::env::var(name).unwrap();
    let tp: usize = var("KILN_TEST_TP").parse().unwrap();
    let pp: usize = var("KILN_TEST_PP").parse().unwrap();
    let micro: i64 = var("KILN_TEST_MICRO").parse().unwrap();
    run(&var("KILN_TEST_CASE"), &out, (world, tp, pp, micro));
}

#[test]
fn reward_under_data_and_tensor_parallelism_equals_trl() {
    if DistEnv::from_env().unwrap().is_some() {
        return worker();
    }
    let trl = trl();
    let tmp = tempfile::tempdir().unwrap();
    let mut seen = BTreeMap::new();
    // (case, processes, TP, PP, micro-batches: -1 one per pair).
    for (name, world, tp, pp, micro) in [
        ("standard", 2, 1, 1, -1),
        ("standard_center", 2, 2, 1, -1),
        ("standard_lora", 2, 2, 1, -1),
        // Two pipeline stages: the last scores, every stage learns the loss and the metrics.
        ("standard", 2, 1, 2, 1),
        ("standard_center", 2, 1, 2, -1),
        ("standard_lora", 2, 1, 2, 1),
    ] {
        let layout = format!("world {world}, TP {tp}, PP {pp}, micro-batches {micro}");
        let out = tmp.path().join(format!("{name}-{world}-{tp}-{pp}-{micro}"));
        common::run_test_ranks(
            TEST,
            world,
            &[
                ("KILN_TEST_OUT", out.display().to_string()),
                ("KILN_TEST_TP", tp.to_string()),
                ("KILN_TEST_PP", pp.to_string()),
                ("KILN_TEST_MICRO", micro.to_string()),
                ("KILN_TEST_CASE", name.to_string()),
            ],
        );
        let got = common::read_log_and_eval(&out);
        let want = trl["cases"][name]["log_history"].as_array().unwrap();
        // At DP = 2 each rank's batch is half the pairs, and a pipeline's micro-batch of one
        // pair is one pair: TRL's least and greatest reward are over the whole batch, kiln's the
        // mean of the parts'.
        let whole_batch = tp * pp == world && (pp == 1 || micro == 1);
        let metrics: Vec<&str> = METRICS
            .iter()
            .copied()
            .filter(|m| whole_batch || !m.ends_with("_reward") || *m == "mean_reward")
            .collect();
        let worst = compare(&format!("{name} at {layout}"), &got, want, &metrics);
        seen.insert(format!("{name} at {layout}"), worst);
    }
    eprintln!("largest relative differences from TRL: {seen:?}");
}
