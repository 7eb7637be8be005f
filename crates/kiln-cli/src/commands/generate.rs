//! `kiln generate`: a causal LM continues a prompt, streamed to standard output.

use std::io::Write;
use std::path::PathBuf;

use anyhow::Result;
use clap::Args;
use kiln::tasks::causal_lm;

#[derive(Args)]
pub struct GenerateCmd {
    /// A Hugging Face causal LM (Llama, Mistral, Qwen2): a folder or a Hub id (`org/name[@rev]`).
    #[arg(long)]
    pub model: PathBuf,
    #[arg(long)]
    prompt: String,
    #[arg(long, default_value_t = 64)]
    max_new_tokens: usize,
    /// 0 decodes greedily; above 0 samples from softmax(logits / T).
    #[arg(long, default_value_t = 0.0)]
    temperature: f64,
    /// Nucleus sampling threshold (with --temperature > 0).
    #[arg(long, default_value_t = 1.0)]
    top_p: f64,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Keep going past the end-of-sequence token, up to --max-new-tokens.
    #[arg(long)]
    ignore_eos: bool,
    /// Print one JSON object (ids, text, timings) instead of streaming the text.
    #[arg(long)]
    json: bool,
    /// The model cut over N processes started together (`kiln launch`), as in training.
    #[arg(long, default_value_t = 1)]
    tensor_parallel_size: usize,
}

pub fn run<B: kiln::ops::KilnBackend>(cmd: GenerateCmd, device: &B::Device) -> Result<()> {
    let opts = causal_lm::GenerateOptions {
        max_new_tokens: cmd.max_new_tokens,
        temperature: cmd.temperature,
        top_p: cmd.top_p,
        seed: cmd.seed,
        stop_at_eos: !cmd.ignore_eos,
    };
    // A bad sampling option is said before minutes of loading.
    opts.check()?;
    // Under tensor parallelism every rank decodes the same tokens (the logits are put
    // together on each); rank 0 prints them.
    let (model, config, _, _) =
        causal_lm::load_model_parallel::<B>(&cmd.model, device, cmd.tensor_parallel_size)?;
    let model = model.into_inference_layout();
    let main = kiln::parallel::is_main_process()?;
    let tok = causal_lm::load_tokenizer(&cmd.model)?;
    let enc = tok
        .encode(cmd.prompt.as_str(), true)
        .map_err(|e| anyhow::anyhow!("tokenizing the prompt: {e}"))?;
    let stream = main && !cmd.json;
    let mut stdout = std::io::stdout();
    if stream {
        print!("{}", cmd.prompt);
        stdout.flush()?;
    }
    let g = causal_lm::generate(&model, &tok, &config, enc.get_ids(), &opts, |piece| {
        if stream {
            print!("{piece}");
            let _ = std::io::stdout().flush();
        }
    })?;
    if !main {
        return Ok(());
    }
    if cmd.json {
        let mut v = serde_json::to_value(&g)?;
        v["prompt_ids"] = serde_json::json!(enc.get_ids());
        v["prefill_tokens_per_sec"] = serde_json::json!(g.prefill_tokens_per_sec());
        v["decode_tokens_per_sec"] = serde_json::json!(g.decode_tokens_per_sec());
        println!("{}", serde_json::to_string(&v)?);
    } else {
        println!();
        tracing::info!(
            "prompt {} tokens in {:.2} s ({:.1} tokens/s); {} new tokens, decoding {:.1} tokens/s",
            g.prompt_tokens,
            g.prefill_secs,
            g.prefill_tokens_per_sec(),
            g.new_ids.len(),
            g.decode_tokens_per_sec()
        );
    }
    Ok(())
}
