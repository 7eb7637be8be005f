//! Every field of transformers' `TrainingArguments` (5.x, and the 4.x names scripts still carry),
//! and what kiln does with it. A config file or flag that names a field in none of these lists,
//! nor one of kiln's own, is an error naming it: a run never changes without a word.
//!
//! docs/TRAINING_ARGUMENTS.md is this table for people; `tests/fixtures/training_args_fields.json`
//! (written by transformers) is checked against it, so a new transformers field is noticed.

use serde_json::Value;

/// What kiln does with a transformers field it does not hold as a [`super::TrainingArguments`] field.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Disposition {
    /// Accepted, kept for `training_args.json`, and without effect in kiln, for the reason given
    /// (logged in one line when the value is not the default).
    Recorded(&'static str),
    /// Accepted at a neutral value (null, false, 0, "", [], {}, "no", "none", or one listed in
    /// [`NEUTRAL`]); any other value is refused with the reason, which says what to use instead.
    OnlyNeutral(&'static str),
    /// The older name of a field kiln implements under the new one.
    Renamed(&'static str),
}

use Disposition::{OnlyNeutral, Recorded, Renamed};

/// transformers fields kiln does not hold as a `TrainingArguments` field: (name, disposition).
/// Fields kiln implements are the struct's own (see docs/TRAINING_ARGUMENTS.md).
pub const HF_FIELDS: &[(&str, Disposition)] = &[
    // Optimizer and schedule.
    ("optim_target_modules", OnlyNeutral("GaLore/APOLLO optimizers are not implemented")),
    // Precision and memory.
    ("fp16", OnlyNeutral("kiln has no fp16 path; --bf16 gives bf16 matmuls with f32 accumulation on CPU and CUDA, what fp16 autocast is used for")),
    ("bf16_full_eval", OnlyNeutral("evaluation runs in f32 (bf16 matmuls only while training with --bf16)")),
    ("fp16_full_eval", OnlyNeutral("evaluation runs in f32")),
    ("activation_checkpointing", Renamed("gradient_checkpointing")),
    ("activation_checkpointing_kwargs", Recorded("kiln recomputes whole layers; there are no options")),
    ("gradient_checkpointing_kwargs", Recorded("kiln recomputes whole layers; there are no options")),
    ("torch_compile", Recorded("kiln's kernels are compiled ahead (CPU) or cached after their first run (CUDA)")),
    ("torch_compile_backend", Recorded("no torch.compile in kiln")),
    ("torch_compile_mode", Recorded("no torch.compile in kiln")),
    ("use_liger_kernel", Recorded("kiln's own fused kernels always run")),
    ("liger_kernel_config", Recorded("kiln's own fused kernels always run")),
    ("use_cache", Recorded("training keeps no KV cache")),
    ("neftune_noise_alpha", OnlyNeutral("NEFTune embedding noise is not implemented")),
    ("torch_empty_cache_steps", Recorded("kiln's allocators return memory on their own")),
    ("auto_find_batch_size", OnlyNeutral("set per_device_train_batch_size; kiln does not retry smaller batches")),
    // Logging.
    ("log_on_each_node", Recorded("only rank 0 logs")),
    ("logging_nan_inf_filter", Recorded("a non-finite loss stops the run, or is skipped with --skip-nonfinite-steps")),
    ("include_num_input_tokens_seen", Recorded("log.jsonl does not count input tokens")),
    ("log_level", Recorded("set KILN_LOG (error, warn, info, debug)")),
    ("log_level_replica", Recorded("set KILN_LOG")),
    ("disable_tqdm", Recorded("the progress bar hides itself when standard error is not a terminal")),
    ("project", Recorded("no tracker is called")),
    ("trackio_space_id", Recorded("no tracker is called")),
    ("trackio_bucket_id", Recorded("no tracker is called")),
    ("trackio_static_space_id", Recorded("no tracker is called")),
    // Evaluation.
    ("eval_delay", OnlyNeutral("evaluation starts at the first eval_steps (or epoch)")),
    ("prediction_loss_only", Recorded("kiln's evaluation always reports loss and metrics")),
    ("eval_do_concat_batches", Recorded("kiln gathers predictions itself")),
    ("eval_use_gather_object", Recorded("kiln gathers predictions itself")),
    ("eval_accumulation_steps", Recorded("predictions stay on the host")),
    ("include_for_metrics", Recorded("kiln's metrics are fixed per task")),
    ("batch_eval_metrics", Recorded("kiln's metrics are computed over the whole evaluation set")),
    // Saving and the Hub.
    ("save_on_each_node", Recorded("rank 0 saves; a sharded checkpoint has each rank's own file")),
    ("enable_jit_checkpoint", Recorded("kiln saves on schedule; an interrupted run resumes from the last checkpoint")),
    ("save_safetensors", Recorded("kiln always writes safetensors")),
    ("push_to_hub", OnlyNeutral("kiln does not upload; run `hf upload <repo> <output_dir>` after training")),
    ("hub_token", Recorded("kiln does not upload")),
    ("hub_private_repo", Recorded("kiln does not upload")),
    ("hub_model_id", Recorded("kiln does not upload")),
    ("hub_strategy", Recorded("kiln does not upload")),
    ("hub_always_push", Recorded("kiln does not upload")),
    ("hub_revision", Recorded("kiln does not upload")),
    ("push_to_hub_model_id", Recorded("kiln does not upload")),
    ("push_to_hub_organization", Recorded("kiln does not upload")),
    ("push_to_hub_token", Recorded("kiln does not upload")),
    ("ignore_data_skip", Recorded("kiln resumes the data order exactly, without replaying batches")),
    ("restore_callback_states_from_checkpoint", Recorded("kiln has no callbacks")),
    ("full_determinism", Recorded("kiln's runs are deterministic for a seed")),
    // Devices and data loading.
    ("use_cpu", Recorded("the device is --device (cpu by default)")),
    ("no_cuda", Recorded("the device is --device (cpu by default)")),
    ("use_mps_device", Recorded("the device is --device")),
    ("accelerator_config", Recorded("no accelerate in kiln")),
    ("parallelism_config", Recorded("parallelism is --tensor-parallel-size, --zero-1 and kiln launch")),
    ("dataloader_num_workers", Recorded("kiln reads data in the training process")),
    ("dataloader_pin_memory", Recorded("kiln reads data in the training process")),
    ("dataloader_persistent_workers", Recorded("kiln reads data in the training process")),
    ("dataloader_prefetch_factor", Recorded("kiln reads data in the training process")),
    ("dataloader_multiprocessing_context", Recorded("kiln reads data in the training process")),
    ("dataloader_in_order", Recorded("kiln reads data in the training process")),
    ("remove_unused_columns", Recorded("kiln reads only the columns it is told (--text-column, --label-column)")),
    ("label_names", Recorded("the label column is --label-column")),
    ("length_column_name", Recorded("lengths are counted from the tokens")),
    ("train_sampling_strategy", OnlyNeutral("only random (the default) and group_by_length are implemented")),
    // Distribution.
    ("ddp_find_unused_parameters", Recorded("kiln's data parallelism reduces every gradient")),
    ("ddp_bucket_cap_mb", Recorded("kiln's all-reduce buckets are fixed at 64 MiB")),
    ("ddp_broadcast_buffers", Recorded("kiln's models have no buffers")),
    ("ddp_static_graph", Recorded("kiln's data parallelism reduces every gradient")),
    ("ddp_backend", Recorded("the collectives are kiln launch --backend")),
    ("ddp_timeout", Recorded("the timeout is kiln launch --timeout")),
    ("fsdp", OnlyNeutral("use --tensor-parallel-size and --zero-1")),
    ("fsdp_config", OnlyNeutral("use --tensor-parallel-size and --zero-1")),
    ("fsdp_min_num_params", OnlyNeutral("use --tensor-parallel-size and --zero-1")),
    ("fsdp_transformer_layer_cls_to_wrap", OnlyNeutral("use --tensor-parallel-size and --zero-1")),
    ("deepspeed", OnlyNeutral("ZeRO stage 1 is --zero-1")),
    ("sharded_ddp", OnlyNeutral("ZeRO stage 1 is --zero-1")),
    ("tp_size", Renamed("tensor_parallel_size")),
    ("local_rank", Recorded("workers read LOCAL_RANK from their launcher")),
    ("debug", Recorded("kiln has no debug modes")),
    ("skip_memory_metrics", Recorded("kiln does not report memory in its metrics")),
    // What transformers' example scripts do with them.
    ("do_train", Recorded("kiln train always trains")),
    ("do_eval", Recorded("kiln train evaluates when it has an evaluation set")),
    ("do_predict", Recorded("use kiln predict")),
    // 4.x spellings.
    ("evaluation_strategy", Renamed("eval_strategy")),
    ("per_gpu_train_batch_size", Renamed("per_device_train_batch_size")),
    ("per_gpu_eval_batch_size", Renamed("per_device_eval_batch_size")),
    ("fp16_opt_level", Recorded("kiln has no fp16 path")),
    ("fp16_backend", Recorded("kiln has no fp16 path")),
    ("half_precision_backend", Recorded("kiln's bf16 path is its own")),
    ("tpu_num_cores", Recorded("no TPUs")),
    ("tpu_metrics_debug", Recorded("no TPUs")),
    ("past_index", Recorded("no models with mems")),
    ("ray_scope", Recorded("no hyperparameter search")),
    ("include_inputs_for_metrics", Recorded("kiln's metrics are fixed per task")),
    ("include_tokens_per_second", Recorded("log.jsonl reports samples and steps per second")),
    ("mp_parameters", Recorded("no SageMaker model parallelism")),
    ("jit_mode_eval", Recorded("no TorchScript")),
    ("use_ipex", Recorded("kiln's CPU kernels are its own")),
    ("torchdynamo", Recorded("no torch.compile in kiln")),
    ("dispatch_batches", Recorded("no accelerate in kiln")),
    ("split_batches", Recorded("no accelerate in kiln")),
    ("use_legacy_prediction_loop", Recorded("kiln has one evaluation loop")),
    ("adafactor", OnlyNeutral("the 4.x switch: use optim: adafactor")),
];

/// transformers' defaults that the generic rule of [`is_neutral`] does not cover (its
/// `to_json_string()` writes them all): no note is logged for a field left at its default.
pub const NEUTRAL: &[(&str, &str)] = &[
    ("train_sampling_strategy", "\"random\""),
    ("log_on_each_node", "true"),
    ("logging_nan_inf_filter", "true"),
    ("log_level", "\"passive\""),
    ("log_level_replica", "\"warning\""),
    ("project", "\"huggingface\""),
    ("eval_do_concat_batches", "true"),
    ("hub_strategy", "\"every_save\""),
    ("hub_token", "\"<HUB_TOKEN>\""),
    ("dataloader_pin_memory", "true"),
    ("dataloader_in_order", "true"),
    ("remove_unused_columns", "true"),
    ("length_column_name", "\"length\""),
    ("ddp_timeout", "1800"),
    ("skip_memory_metrics", "true"),
    ("local_rank", "-1"),
    ("save_safetensors", "true"),
    (
        "accelerator_config",
        r#"{"split_batches": false, "dispatch_batches": null, "even_batches": true, "use_seedable_sampler": true, "non_blocking": false, "gradient_accumulation_kwargs": null}"#,
    ),
];

/// The field's disposition, if transformers has it and kiln does not hold it as a struct field.
pub fn lookup(name: &str) -> Option<Disposition> {
    HF_FIELDS.iter().find(|(n, _)| *n == name).map(|(_, d)| *d)
}

/// A value that asks for nothing: null, false, 0, "", an empty list or map, "no", "none".
pub fn is_neutral(name: &str, v: &Value) -> bool {
    let listed = NEUTRAL.iter().any(|(n, text)| {
        *n == name && serde_json::from_str::<Value>(text).ok().as_ref() == Some(v)
    });
    listed
        || match v {
            Value::Null => true,
            Value::Bool(b) => !b,
            Value::Number(n) => n.as_f64() == Some(0.0),
            Value::String(s) => matches!(s.to_ascii_lowercase().as_str(), "" | "no" | "none"),
            Value::Array(a) => a.is_empty() || a.iter().all(|x| x.as_str() == Some("none")),
            Value::Object(o) => o.is_empty(),
        }
}

/// Where training-argument entries came from, for messages: a file (its text gives line
/// numbers) or the command line.
pub struct Source<'a> {
    pub name: String,
    pub text: Option<&'a str>,
}

impl Source<'_> {
    /// `file:line` of `key` (its first mention as a YAML or JSON key), or the source's name.
    fn at(&self, key: &str) -> String {
        match self
            .text
            .map_or(0, |t| super::hf_values::line_of_key(t, key))
        {
            0 => self.name.clone(),
            line => format!("{}:{line}", self.name),
        }
    }
}

/// Entries sorted by what kiln does with them.
#[derive(Debug, Default)]
pub struct Sorted {
    /// Keys of kiln's `TrainingArguments` (renamed ones under their new name).
    pub known: serde_json::Map<String, Value>,
    /// transformers fields kept as given, without effect.
    pub recorded: std::collections::BTreeMap<String, Value>,
}

/// Sorts training-argument entries: kiln's own fields (`known_keys`) pass, transformers' renamed
/// ones take their new name, recorded ones are kept aside (a non-default value logged in one line),
/// and one kiln cannot honour, or a key nobody knows, is an error naming it and where it is —
/// unknown keys only a warning with `ignore_unknown`.
pub fn sort_entries(
    entries: serde_json::Map<String, Value>,
    known_keys: &[String],
    source: &Source,
    ignore_unknown: bool,
) -> crate::Result<Sorted> {
    use crate::error::KilnError;
    let mut out = Sorted::default();
    for (key, value) in entries {
        // A secret is never kept: transformers' `to_dict` writes `<HUB_TOKEN>` for every `*_token`
        // field, and kiln (which uploads nothing) never needs the value. Masked before anything
        // logs or records it.
        let value = match value {
            Value::String(s) if key.ends_with("_token") && !s.is_empty() => {
                Value::String(mask_token(&key))
            }
            other => other,
        };
        if key == "train_sampling_strategy" && value == "group_by_length" {
            // transformers 5.x's spelling of 4.x's group_by_length, which kiln implements.
            out.known
                .insert("group_by_length".into(), Value::Bool(true));
            out.recorded.insert(key, value);
            continue;
        }
        if known_keys.contains(&key) {
            let value = normalize_known(&key, value);
            out.known.insert(key, value);
            continue;
        }
        match lookup(&key) {
            Some(Disposition::Renamed(new)) => {
                if is_neutral(&key, &value) {
                    continue;
                }
                if let Some(given) = out.known.get(new).filter(|v| !is_neutral(new, v)) {
                    if *given != value {
                        return Err(KilnError::Config(format!(
                            "{}: `{key}` ({value}) is the older name of `{new}`, which is also given ({given}): keep one",
                            source.at(&key)
                        )));
                    }
                }
                out.known
                    .insert(new.to_string(), normalize_known(new, value));
            }
            Some(Disposition::Recorded(reason)) => {
                if !is_neutral(&key, &value) {
                    tracing::info!("{key} = {value}: recorded, no effect in kiln ({reason})");
                }
                out.recorded.insert(key, value);
            }
            Some(Disposition::OnlyNeutral(reason)) => {
                if !is_neutral(&key, &value) {
                    return Err(KilnError::Config(format!(
                        "{}: `{key}` = {value} is not supported: {reason}",
                        source.at(&key)
                    )));
                }
                out.recorded.insert(key, value);
            }
            None => {
                let names = known_keys
                    .iter()
                    .map(String::as_str)
                    .chain(HF_FIELDS.iter().map(|(n, _)| *n));
                let near = names
                    .map(|n| (strsim::jaro_winkler(n, &key), n))
                    .filter(|(score, _)| *score > 0.85)
                    .max_by(|a, b| a.0.total_cmp(&b.0))
                    .map(|(_, n)| format!(" (did you mean `{n}`?)"))
                    .unwrap_or_default();
                let msg = format!(
                    "{}: unknown training argument `{key}`{near}: it is neither a transformers \
                     TrainingArguments field nor one of kiln's",
                    source.at(&key)
                );
                if !ignore_unknown {
                    return Err(KilnError::Config(format!(
                        "{msg} (--ignore-unknown-args makes this a warning)"
                    )));
                }
                tracing::warn!("{msg}; ignored (--ignore-unknown-args)");
            }
        }
    }
    Ok(out)
}

/// What transformers writes in place of a `*_token` field's value: `<HUB_TOKEN>`.
pub fn mask_token(key: &str) -> String {
    format!("<{}>", key.to_ascii_uppercase())
}

/// transformers' spellings of values kiln's fields take: `resume_from_checkpoint: true`
/// ("True" in scripts) is the newest checkpoint, `false` none; `lr_scheduler_kwargs` given as a
/// JSON string that starts with `{` is that object, as transformers' `__post_init__` reads it;
/// `tf32: null` (transformers' default, "leave PyTorch's setting", which is IEEE f32) is `false`.
fn normalize_known(key: &str, value: Value) -> Value {
    match (key, &value) {
        ("lr_scheduler_kwargs", Value::String(s)) if s.trim_start().starts_with('{') => {
            match serde_json::from_str::<Value>(s) {
                Ok(object @ Value::Object(_)) => object,
                // Left a string: the value check names the field.
                _ => value,
            }
        }
        ("tf32", Value::Null) => Value::Bool(false),
        ("resume_from_checkpoint", Value::Bool(true)) => Value::String("latest".into()),
        ("resume_from_checkpoint", Value::Bool(false)) => Value::Null,
        ("resume_from_checkpoint", Value::String(s)) if s.eq_ignore_ascii_case("true") => {
            Value::String("latest".into())
        }
        ("resume_from_checkpoint", Value::String(s)) if s.eq_ignore_ascii_case("false") => {
            Value::Null
        }
        _ => value,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every field of transformers' TrainingArguments (tests/fixtures/training_args_fields.json,
    /// written by transformers) is one of kiln's or has a disposition here: a field a new
    /// transformers adds fails this test until it is sorted.
    #[test]
    fn every_transformers_field_is_sorted() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../tests/fixtures/training_args_fields.json"
        );
        let fx: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let kiln = crate::train::TrainingArguments::field_names();
        let unsorted: Vec<&String> = fx["fields"]
            .as_object()
            .unwrap()
            .keys()
            .filter(|k| !kiln.contains(k) && lookup(k).is_none())
            .collect();
        assert!(
            unsorted.is_empty(),
            "fields with no disposition: {unsorted:?}"
        );
        // And no field is both kiln's and in the table.
        for (name, _) in HF_FIELDS {
            assert!(
                !kiln.iter().any(|k| k == name),
                "{name} is kiln's own field"
            );
        }
    }

    #[test]
    fn neutral_values() {
        assert!(is_neutral("fsdp", &Value::Array(vec![])));
        assert!(is_neutral(
            "include_for_metrics",
            &serde_json::json!(["none"])
        ));
        assert!(is_neutral("ddp_timeout", &serde_json::json!(1800)));
        assert!(!is_neutral("push_to_hub", &Value::Bool(true)));
        assert!(!is_neutral(
            "include_for_metrics",
            &serde_json::json!(["inputs"])
        ));
    }
}
