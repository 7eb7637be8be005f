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
    /// Sample only among the K most likely tokens (with --temperature > 0; 0 keeps every token,
    /// while transformers' generate defaults to 50).
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    /// Nucleus sampling threshold (with --temperature > 0), applied after --top-k.
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
    /// The model's decoder layers cut into N stages on N processes (`kiln launch`), as in
    /// training: each token's step flows through them, every stage keeping its layers' KV cache.
    #[arg(long, default_value_t = 1)]
    pipeline_parallel_size: usize,
    /// Where stages 1, 2, … begin, as decoder-layer indices (as in training).
    #[arg(long)]
    pipeline_cuts: Option<String>,
    /// Generate with this LoRA adapter (a PEFT folder: adapter_config.json,
    /// adapter_model.safetensors) on --model, unmerged.
    #[arg(long, value_name = "DIR")]
    adapter: Option<PathBuf>,
    /// Send the prompt as a user's message through the model's chat template (with its
    /// generation prompt), as a chat model expects.
    #[arg(long)]
    chat: bool,
}

pub fn run<B: kiln::ops::KilnBackend>(cmd: GenerateCmd, device: &B::Device) -> Result<()> {
    let opts = causal_lm::GenerateOptions {
        max_new_tokens: cmd.max_new_tokens,
        temperature: cmd.temperature,
        top_k: cmd.top_k,
        top_p: cmd.top_p,
        seed: cmd.seed,
        stop_at_eos: !cmd.ignore_eos,
    };
    // Under tensor parallelism every rank decodes the same tokens (the logits are put
    // together on each), under a pipeline the last stage hands each to every stage; rank 0
    // prints them.
    let main = kiln::parallel::is_main_process()?;
    let stream = main && !cmd.json;
    // The prompt is printed once the model has loaded (with the first new text), so a folder
    // that fails to load prints nothing.
    let mut prompt_printed = false;
    let mut print = |piece: &str| {
        if stream {
            if !prompt_printed {
                // A chat prompt is a user's turn: the answer starts on a line of its own.
                let end = if cmd.chat { "\n" } else { "" };
                print!("{}{end}", cmd.prompt);
                prompt_printed = true;
            }
            print!("{piece}");
            let _ = std::io::stdout().flush();
        }
    };
    let prompt = causal_lm::Prompt {
        text: cmd.prompt.clone(),
        chat: cmd.chat,
        adapter: cmd.adapter.clone(),
    };
    let layout = causal_lm::InferenceLayout::from_args(
        cmd.tensor_parallel_size,
        cmd.pipeline_parallel_size,
        cmd.pipeline_cuts.as_deref(),
    )?;
    let (prompt_ids, g) = causal_lm::generate_from_folder::<B>(
        &cmd.model, &prompt, &layout, &opts, device, &mut print,
    )?;
    print("");
    if !main {
        return Ok(());
    }
    if cmd.json {
        let mut v = serde_json::to_value(&g)?;
        v["prompt_ids"] = serde_json::json!(prompt_ids);
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
