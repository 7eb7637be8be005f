//! The model card's "training hyperparameters" list from the trainer's arguments, as
//! transformers' `extract_hyperparameters_from_trainer` makes it. Here, beside the arguments,
//! so the card writer (`report/model_card.rs`) takes a plain list and imports nothing of the
//! trainer.

use super::args::TrainingArguments;
use crate::report::model_card::py_float;

/// transformers' `extract_hyperparameters_from_trainer`, from kiln's arguments: (name, value as
/// Python prints it), in transformers' order.
pub fn card_hyperparameters(args: &TrainingArguments, world_size: usize) -> Vec<(String, String)> {
    let world = world_size.max(1);
    let tp = args.tensor_parallel_size.max(1);
    // Each data-parallel rank takes its own batch; tensor-parallel ranks share one.
    let data_parallel = (world / tp).max(1);
    let mut hp: Vec<(String, String)> = Vec::new();
    let mut put = |k: &str, v: String| hp.push((k.to_string(), v));
    put("learning_rate", py_float(args.learning_rate));
    put(
        "train_batch_size",
        args.per_device_train_batch_size.to_string(),
    );
    put(
        "eval_batch_size",
        args.per_device_eval_batch_size.to_string(),
    );
    put("seed", args.seed.to_string());
    if world > 1 {
        // transformers' name for any multi-process (DistributedDataParallel) run.
        put("distributed_type", "multi-GPU".into());
        put("num_devices", world.to_string());
    }
    if tp > 1 {
        put("tensor_parallel_size", tp.to_string());
    }
    if args.gradient_accumulation_steps > 1 {
        put(
            "gradient_accumulation_steps",
            args.gradient_accumulation_steps.to_string(),
        );
    }
    let total_train =
        args.per_device_train_batch_size * data_parallel * args.gradient_accumulation_steps;
    if total_train != args.per_device_train_batch_size {
        put("total_train_batch_size", total_train.to_string());
    }
    let total_eval = args.per_device_eval_batch_size * data_parallel;
    if total_eval != args.per_device_eval_batch_size {
        put("total_eval_batch_size", total_eval.to_string());
    }

    // transformers formats its OptimizerNames enum member: `OptimizerNames.ADAMW_TORCH`.
    let optim = serde_json::to_value(args.optim)
        .ok()
        .and_then(|v| v.as_str().map(str::to_string))
        .unwrap_or_default();
    let member = match optim.as_str() {
        "lion_32bit" => "LION".to_string(),
        other => other.to_ascii_uppercase(),
    };
    let optimizer_name = format!("OptimizerNames.{member}");
    let optimizer_args = args
        .optim_args
        .clone()
        .filter(|a| !a.is_empty())
        .unwrap_or_else(|| "No additional optimizer arguments".into());
    if optimizer_name.to_lowercase().contains("adam") {
        put(
            "optimizer",
            format!(
                "Use {optimizer_name} with betas=({},{}) and epsilon={} and optimizer_args={optimizer_args}",
                py_float(args.adam_beta1),
                py_float(args.adam_beta2),
                py_float(args.adam_epsilon)
            ),
        );
    } else {
        put(
            "optimizer",
            format!("Use {optimizer_name} and the args are:\n{optimizer_args}"),
        );
    }

    let scheduler = serde_json::to_value(args.lr_scheduler_type)
        .ok()
        .and_then(|v| v.as_str().map(str::to_string))
        .unwrap_or_default();
    put("lr_scheduler_type", scheduler);
    if args.warmup_steps != 0.0 {
        // A count prints as one; below 1 it is a ratio of the total steps (transformers 5).
        let v = if args.warmup_steps >= 1.0 && args.warmup_steps.fract() == 0.0 {
            format!("{}", args.warmup_steps as u64)
        } else {
            py_float(args.warmup_steps)
        };
        put("lr_scheduler_warmup_steps", v);
    }
    if args.warmup_ratio != 0.0 {
        // transformers 4.x's name for it.
        put("lr_scheduler_warmup_ratio", py_float(args.warmup_ratio));
    }
    if args.max_steps > 0 {
        put("training_steps", args.max_steps.to_string());
    } else {
        put("num_epochs", py_float(args.num_train_epochs));
    }
    if args.bf16 {
        // transformers writes "Native AMP" for fp16; kiln's mixed precision is bf16.
        put("mixed_precision_training", "bf16".into());
    }
    if args.label_smoothing_factor != 0.0 {
        put(
            "label_smoothing_factor",
            py_float(args.label_smoothing_factor),
        );
    }
    hp
}
