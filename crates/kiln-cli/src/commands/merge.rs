//! `kiln merge`: fold a LoRA adapter into its base model (PEFT's `merge_and_unload`).

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;

#[derive(Args)]
pub struct MergeCmd {
    /// The base model: a Hugging Face folder or a Hub id.
    #[arg(long)]
    pub model: PathBuf,
    /// The adapter: a PEFT folder (adapter_config.json, adapter_model.safetensors), such as the
    /// output folder of `kiln train --use-peft`.
    #[arg(long, value_name = "DIR")]
    adapter: PathBuf,
    /// The merged model's folder (model.safetensors, config.json, the tokenizer's files).
    #[arg(long, value_name = "DIR")]
    out: PathBuf,
}

pub fn run(cmd: MergeCmd) -> Result<()> {
    kiln::tasks::merge::merge_folder(&cmd.model, &cmd.adapter, &cmd.out)?;
    println!("{}", cmd.out.display());
    Ok(())
}
