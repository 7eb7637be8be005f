//! `kiln convert`: a GGUF file to a Hugging Face Llama / Qwen2 folder and back (`--to-gguf`, for
//! llama.cpp and Ollama), and causal-LM checkpoints (any family `models::auto` lists) cut into
//! tensor-parallel shards (per pipeline stage with `--to-pp`) or put back together.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;
use kiln::formats::safetensors::StoreDtype;

#[derive(Args)]
#[command(group(clap::ArgGroup::new("mode").required(true).args(["from_gguf", "to_tp", "to_full", "to_gguf"])))]
pub struct ConvertCmd {
    /// A llama.cpp GGUF file of a Llama or Qwen2 model (F32/F16/BF16/Q4_0/Q4_1/Q8_0/Q4_K/Q6_K
    /// tensors).
    #[arg(long)]
    from_gguf: Option<PathBuf>,
    /// Cut --model (a Hugging Face Llama folder or a checkpoint, whole or sharded) into N
    /// tensor-parallel shards, optimizer state included.
    #[arg(long, value_name = "N", requires = "model")]
    to_tp: Option<usize>,
    /// With --to-tp: the shards of each of M pipeline stages in files of their own, cut as
    /// training at --pipeline-parallel-size M cuts the model.
    #[arg(long, value_name = "M", requires = "to_tp")]
    to_pp: Option<usize>,
    /// With --to-pp: the decoder-layer indices where stages 1, 2, … begin (as in training).
    #[arg(long, value_name = "LIST", requires = "to_pp")]
    pipeline_cuts: Option<String>,
    /// Put --model's shards (a sharded checkpoint or --to-tp folder) back together as one
    /// Hugging Face folder (a plain checkpoint when it holds optimizer state).
    #[arg(long, requires = "model")]
    to_full: bool,
    /// Write --model (a Hugging Face Llama or Qwen2 folder: a merged SFT / DPO model) as one GGUF file
    /// for llama.cpp / Ollama, at --out, as llama.cpp's convert_hf_to_gguf.py writes it.
    #[arg(long, requires = "model")]
    to_gguf: bool,
    /// With --to-gguf: how the matrices are stored: f32, f16, bf16 or q8_0 (the norms stay f32).
    #[arg(long, value_name = "TYPE", default_value = "f16", requires = "to_gguf")]
    outtype: String,
    /// With --to-tp: store each rank's attention q/k/v as NxD's one fused `qkv_proj` (rows: the
    /// rank's query heads, then the key/value heads they read).
    #[arg(long, requires = "to_tp")]
    coalesce_qkv: bool,
    /// The folder to convert (with --to-tp / --to-full).
    #[arg(long)]
    model: Option<PathBuf>,
    /// The folder to write (a new one); with --to-gguf, the file.
    #[arg(long)]
    out: PathBuf,
    /// How to store the dequantised weights: f32 or bf16.
    #[arg(long, default_value = "f32")]
    dtype: String,
}

pub fn run(cmd: ConvertCmd) -> Result<()> {
    let dtype = match cmd.dtype.as_str() {
        "f32" | "float32" => StoreDtype::F32,
        "bf16" | "bfloat16" => StoreDtype::BF16,
        other => bail!("--dtype {other:?}: use f32 or bf16"),
    };
    let t0 = std::time::Instant::now();
    if let (true, Some(model)) = (cmd.to_gguf, &cmd.model) {
        use kiln::models::llama::gguf_export::{hf_to_gguf, GgufOutType};
        let outtype = GgufOutType::from_name(&cmd.outtype)
            .with_context(|| format!("--outtype {:?}: use {}", cmd.outtype, GgufOutType::NAMES))?;
        let r = hf_to_gguf(model, &cmd.out, outtype)?;
        println!(
            "{} → {}: {} tensors {:?}, {:.1} M parameters ({:.1} s)",
            model.display(),
            cmd.out.display(),
            r.tensors,
            r.types,
            r.parameters as f64 / 1e6,
            t0.elapsed().as_secs_f64()
        );
        return Ok(());
    }
    if let Some(model) = &cmd.model {
        let cuts = cmd
            .pipeline_cuts
            .as_deref()
            .map(kiln::parallel::pipeline::parse_cuts)
            .transpose()?;
        let pipeline = cmd.to_pp.map(|n| (n, cuts));
        reshard(model, &cmd.out, cmd.to_tp, pipeline, cmd.coalesce_qkv)?;
        println!(
            "{} → {}: {} ({:.1} s)",
            model.display(),
            cmd.out.display(),
            match (cmd.to_tp, cmd.to_pp) {
                (Some(n), Some(m)) => format!("{n} tensor-parallel shards × {m} pipeline stages"),
                (Some(n), None) => format!("{n} tensor-parallel shards"),
                _ => "one consolidated folder".into(),
            },
            t0.elapsed().as_secs_f64()
        );
        return Ok(());
    }
    let Some(from_gguf) = &cmd.from_gguf else {
        bail!("kiln convert: give --from-gguf FILE, or --model DIR with --to-tp N or --to-full");
    };
    let r = kiln::models::llama::gguf::gguf_to_hf(from_gguf, &cmd.out, dtype)?;
    println!(
        "{} → {}: {} tensors ({:?}), {:.1} M parameters, {} layers, hidden {}, {} heads / {} kv heads, tied embeddings: {} ({:.1} s)",
        from_gguf.display(),
        cmd.out.display(),
        r.tensors,
        r.source_types,
        r.parameters as f64 / 1e6,
        r.config.num_hidden_layers,
        r.config.hidden_size,
        r.config.num_attention_heads,
        r.config.kv_heads(),
        r.config.tie_word_embeddings,
        t0.elapsed().as_secs_f64()
    );
    Ok(())
}

/// The config.json that says how `model` is cut: its own, or a LoRA adapter's base model's (an
/// adapter folder of a causal LM holds none; `adapter_config.json` names its base).
fn model_config(model: &std::path::Path) -> Result<std::path::PathBuf> {
    let own = model.join("config.json");
    let adapter_config = model.join(kiln::models::lora::ADAPTER_CONFIG);
    if own.exists() || !adapter_config.exists() {
        return Ok(own);
    }
    let bytes = std::fs::read(&adapter_config)
        .with_context(|| format!("{}: cannot read it", adapter_config.display()))?;
    let v: serde_json::Value = serde_json::from_slice(&bytes)
        .with_context(|| format!("{}: not valid JSON", adapter_config.display()))?;
    let base = v["base_model_name_or_path"].as_str().unwrap_or_default();
    // A Hub id (as PEFT records a base from the Hub) is looked up in the Hub cache, or fetched.
    let base_dir = if base.is_empty() {
        std::path::PathBuf::new()
    } else {
        kiln::hub::remote::resolve(std::path::Path::new(base), kiln::hub::remote::Need::Config)?
    };
    let base_config = base_dir.join("config.json");
    if base.is_empty() || !base_config.exists() {
        bail!(
            "{}: base_model_name_or_path {base:?} is neither a local model folder nor a Hub \
             model, so the adapter's cut is unknown; copy the base model's config.json into {}",
            adapter_config.display(),
            model.display()
        );
    }
    Ok(base_config)
}

/// `kiln convert --to-tp N` (the family's splits, as training at `--tensor-parallel-size N`
/// holds them; with `pipeline`, the stages and cuts of `--pipeline-parallel-size`) or `--to-full`
/// (`to_tp` = `None`).
fn reshard(
    model: &std::path::Path,
    out: &std::path::Path,
    to_tp: Option<usize>,
    pipeline: Option<(usize, Option<Vec<usize>>)>,
    coalesce_qkv: bool,
) -> Result<()> {
    use kiln::train::reshard::{Stages, Target};
    kiln::train::reshard::reshard(model, out, |whole| match to_tp {
        None => Ok(Target::Full),
        Some(0) => Err(kiln::KilnError::Config(
            "--to-tp 0: the tensor-parallel size must be at least 1".into(),
        )),
        Some(n) => {
            // Validated as training validates it (more key/value heads than heads is a sentence);
            // the tensors' shapes are then checked against it cut by cut.
            let names: Vec<&str> = whole.model.keys().map(String::as_str).collect();
            let config_path =
                model_config(model).map_err(|e| kiln::KilnError::Config(format!("{e:#}")))?;
            Ok(Target::TensorParallel {
                splits: kiln::models::auto::tensor_parallel_splits(
                    &config_path,
                    &names,
                    n,
                    coalesce_qkv,
                )?,
                coalesce_qkv,
                // Cut as training cuts it; its sentences name convert's option.
                stages: pipeline
                    .map(|(m, cuts)| {
                        Stages::of_decoder(&names, m, cuts.as_deref()).map_err(|e| {
                            kiln::KilnError::Config(
                                e.to_string().replace("--pipeline-parallel-size", "--to-pp"),
                            )
                        })
                    })
                    .transpose()?,
            })
        }
    })?;
    Ok(())
}
