//! Benchmark rows for SmolLM2-135M (Llama): continued-pretraining steps on real text, prompt
//! processing, and token-by-token greedy decoding with the KV cache. scripts/bench_reference.py
//! does the same work in transformers.

use std::path::{Path, PathBuf};
use std::time::Instant;

use burn::tensor::{Int, Tensor, TensorData};

use super::workloads::{train_steps, train_steps_with, StepWork};
use super::BenchResult;
use crate::backend::{Cpu, CpuTrain};
use crate::contract::CrossEntropy;
use crate::data::lm::{read_documents, LmBlocks};
use crate::data::TextEncoding;
use crate::error::Result;
use crate::models::auto::load_causal_lm;
use crate::models::llama::config::LlamaConfig;
use crate::models::llama::KvCache;
use crate::models::llama::Llama;
use crate::tasks::causal_lm::load_tokenizer;
use crate::train::metrics::argmax;
use crate::train::BatchSource;

/// The prompt of the decoding row (and of the parity fixtures).
pub const GENERATE_PROMPT: &str = "The capital of France is";

/// The converted Hugging Face folder beside `gguf` (`<dir>/hf`), written on first use.
pub fn converted_folder(gguf: &Path) -> Result<PathBuf> {
    let dir = gguf.parent().unwrap_or(Path::new(".")).join("hf");
    if !dir.join("model.safetensors").exists() {
        tracing::info!("converting {} → {}", gguf.display(), dir.display());
        // What an interrupted conversion by an older kiln left (convert writes new folders only).
        let _ = std::fs::remove_dir_all(&dir);
        crate::models::llama::gguf::gguf_to_hf(
            gguf,
            &dir,
            crate::formats::safetensors::StoreDtype::F32,
        )?;
    }
    Ok(dir)
}

/// Forward FLOPs of a Llama model over `batch` sequences of `seq` tokens: 2 per weight per token
/// (the output projection included, the embedding lookup not) plus QKᵀ and PV over the full square
/// (what the kernels compute).
pub fn llama_forward_flops(c: &LlamaConfig, batch: usize, seq: usize) -> f64 {
    let (h, i, l, v) = (
        c.hidden_size as f64,
        c.intermediate_size as f64,
        c.num_hidden_layers as f64,
        c.vocab_size as f64,
    );
    let q = (c.num_attention_heads * c.head_size()) as f64;
    let kv = (c.kv_heads() * c.head_size()) as f64;
    let per_token = l * (2.0 * h * q + 2.0 * h * kv + 3.0 * h * i) + h * v;
    let t = seq as f64;
    batch as f64 * (2.0 * per_token * t + 4.0 * l * q * t * t)
}

/// The first blocks of the corpus, tokenized and packed as `kiln train --task causal-lm` does:
/// documents are tokenized one at a time until `needed` blocks are full.
fn first_blocks(dir: &Path, corpus: &Path, block: usize, needed: usize) -> Result<LmBlocks> {
    let tok = load_tokenizer(dir)?;
    let eos = LlamaConfig::from_file(&dir.join("config.json"))?
        .eos_ids()
        .first()
        .copied();
    let (docs, _) = read_documents(corpus, "text", TextEncoding::Utf8, false)?;
    let mut stream = Vec::new();
    let mut used = 0;
    for doc in docs.chunks(1) {
        if stream.len() >= needed * block {
            break;
        }
        stream.extend(LmBlocks::token_stream(&tok, doc, eos)?);
        used += 1;
    }
    Ok(LmBlocks::pack(stream, block, used))
}

/// AdamW (lr 1e-4, no weight decay) steps on batches of 4 blocks of 128 tokens of the corpus.
pub fn train(dir: &Path, corpus: &Path, warmup: usize, steps: usize) -> Result<BenchResult> {
    let (batch, seq) = (4, 128);
    let device = Default::default();
    let (model, config) = load_causal_lm::<Llama, CpuTrain>(dir, &device)?;
    let blocks = first_blocks(dir, corpus, seq, (warmup + steps) * batch)?;
    let flops = 3.0 * llama_forward_flops(&config, batch, seq);
    let batches: Vec<_> = (0..blocks.len() / batch)
        .map(|b| {
            let idx: Vec<usize> = (b * batch..(b + 1) * batch).collect();
            let (tb, targets) = blocks.batch(&idx);
            let work = StepWork {
                samples: batch,
                padded_seq: seq,
                tokens: batch * seq,
                flops,
            };
            (tb, targets, work)
        })
        .collect();
    let mut batches: Vec<_> = batches;
    let loss = lm_loss(&config, &mut batches);
    let opt = super::workloads::adamw();
    Ok(train_steps_with(
        "smollm2_train_fp32",
        model,
        opt,
        1e-4,
        &batches,
        warmup,
        steps,
        &device,
        &loss,
    ))
}

/// The configs of the causal family rows: Qwen2-0.5B as published (q/k/v biases, a tied
/// 151,936-token head), and Mistral's architecture at SmolLM2's 135M scale with a 64-token
/// sliding window, shorter than the 128-token blocks (Mistral-7B does not train on 2 cores).
pub fn family_config(key: &str) -> Option<LlamaConfig> {
    let json = match key {
        "qwen2_train" => serde_json::json!({
            "model_type": "qwen2", "vocab_size": 151936, "hidden_size": 896,
            "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
            "num_key_value_heads": 2, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0, "tie_word_embeddings": true, "use_sliding_window": false}),
        "mistral_train" => serde_json::json!({
            "model_type": "mistral", "vocab_size": 32768, "hidden_size": 576,
            "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
            "num_key_value_heads": 3, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0, "sliding_window": 64, "tie_word_embeddings": false}),
        _ => return None,
    };
    Some(serde_json::from_value(json).expect("a valid config"))
}

/// AdamW (lr 1e-4, no weight decay) steps of a causal family row's model (random weights) on
/// one batch of 4 random 128-token blocks, as bench_reference.py's rows.
pub fn family_train(key: &str, warmup: usize, steps: usize) -> Result<BenchResult> {
    let (batch, seq) = (4, 128);
    let config = family_config(key).expect("a causal family row");
    let device = Default::default();
    let model = crate::ops::with_seeded_rng::<CpuTrain, _>(&device, 0, || {
        crate::models::llama::LlamaForCausalLM::<CpuTrain>::new(&config, &device)
    });
    let mut batches = vec![random_step(&config, batch, seq)];
    let loss = lm_loss(&config, &mut batches);
    let opt = super::workloads::adamw();
    Ok(train_steps_with(
        &format!("{key}_fp32"),
        model,
        opt,
        1e-4,
        &batches,
        warmup,
        steps,
        &device,
        &loss,
    ))
}

/// How the causal-LM rows compute their loss, as the trainer does by default: inside the head, a
/// chunk of positions at a time ([`crate::tasks::causal_lm::auto_chunk`]); `KILN_LOSS_CHUNK=N`
/// sets the chunk, `0` computes the whole logits first (the "before" of BENCHMARKS.md's chunked
/// loss section).
fn lm_loss_chunk(config: &LlamaConfig) -> usize {
    std::env::var("KILN_LOSS_CHUNK")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| crate::tasks::causal_lm::auto_chunk(config.vocab_size))
}

/// The trainer's loss for `batches` under [`lm_loss_chunk`]: each batch asks its head for its
/// positions' losses and the loss is their mean, or the batches stay as they are (whole logits,
/// cross-entropy).
fn lm_loss(
    config: &LlamaConfig,
    batches: &mut [(crate::data::lm::TokenBatch, Vec<i64>, StepWork)],
) -> crate::tasks::causal_lm::LmLoss {
    use crate::tasks::causal_lm::{ChunkedMean, LmLoss};
    let chunk = lm_loss_chunk(config);
    if chunk == 0 {
        return LmLoss::Plain(CrossEntropy);
    }
    for (tb, targets, _) in batches.iter_mut() {
        tb.chunked_loss = Some(std::sync::Arc::new(crate::data::lm::ChunkedLoss {
            targets: targets.clone(),
            chunk,
        }));
    }
    LmLoss::Chunked(ChunkedMean)
}

/// `batch` blocks of `seq` random ids in 1000..30000 (seed 1234, as bench_reference.py's
/// `torch.randint` rows) and their next-token targets, the last position of each block ignored.
fn random_blocks(batch: usize, seq: usize) -> (crate::data::lm::TokenBatch, Vec<i64>) {
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::StdRng::seed_from_u64(1234);
    let ids: Vec<i64> = (0..batch * seq)
        .map(|_| rng.random_range(1000..30000))
        .collect();
    let targets = ids
        .chunks(seq)
        .flat_map(|row| {
            row[1..]
                .iter()
                .copied()
                .chain([crate::contract::IGNORE_INDEX])
        })
        .collect();
    let tb = crate::data::lm::TokenBatch {
        ids,
        batch,
        seq,
        segments: Vec::new(),
        chunked_loss: None,
        scoring: None,
        carried: Default::default(),
        attended_tokens: None,
    };
    (tb, targets)
}

/// [`random_blocks`] with the training step's work (3× the forward's FLOPs) for `config`.
fn random_step(
    config: &LlamaConfig,
    batch: usize,
    seq: usize,
) -> (crate::data::lm::TokenBatch, Vec<i64>, StepWork) {
    let (tb, targets) = random_blocks(batch, seq);
    let work = StepWork {
        samples: batch,
        padded_seq: seq,
        tokens: batch * seq,
        flops: 3.0 * llama_forward_flops(config, batch, seq),
    };
    (tb, targets, work)
}

/// SmolLM2-135M's architecture (tied head, grouped-query attention) as published.
pub fn smollm2_config() -> LlamaConfig {
    serde_json::from_value(serde_json::json!({
        "model_type": "llama", "vocab_size": 49152, "hidden_size": 576,
        "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
        "num_key_value_heads": 3, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0, "tie_word_embeddings": true}))
    .expect("a valid config")
}

/// The GPU's SmolLM2 training rows (issue 32's done-means "SmolLM2 train bf16"): SmolLM2-135M's
/// architecture with random weights (a step's time does not depend on the values, and the GPU
/// machine holds no checkpoint), `--bf16` products, AdamW lr 1e-4, one batch of 8 random
/// 512-token blocks on the run's device. bench_reference_cuda.py runs the same under autocast.
/// With `lora` (issue 59, item 5), [`bench_lora`]'s adapter on the frozen f32 base, as a PEFT user
/// fine-tunes a base loaded in f32 with the Trainer's `bf16=True`.
pub fn smollm2_train_bf16<B>(
    warmup: usize,
    steps: usize,
    device: &B::Device,
    lora: bool,
) -> Result<BenchResult>
where
    B: crate::ops::KilnBackend,
    burn::backend::Autodiff<B>: crate::ops::TrainBackend<InnerBackend = B, Device = B::Device>,
{
    let (batch, seq) = (8, 512);
    let config = smollm2_config();
    let model = crate::ops::with_seeded_rng::<burn::backend::Autodiff<B>, _>(device, 0, || {
        crate::models::llama::LlamaForCausalLM::<burn::backend::Autodiff<B>>::new(&config, device)
    });
    let (tb, targets, mut work) = random_step(&config, batch, seq);
    let (model, name) = match lora {
        true => {
            // The forward twice over: the backward reaches the activations and the adapter, not
            // the frozen weights.
            work.flops = 2.0 * llama_forward_flops(&config, batch, seq);
            let (model, _) = crate::models::lora::attach(model, &bench_lora(), 0)?;
            (model, "smollm2_lora_train_bf16")
        }
        false => (model, "smollm2_train_bf16"),
    };
    let _precision = crate::ops::MatmulPrecisionScope::set(crate::ops::mixed_precision::<B>(true));
    Ok(train_steps(
        name,
        model,
        super::workloads::adamw(),
        1e-4,
        &[(tb, targets, work)],
        warmup,
        steps,
        device,
    ))
}

/// The LoRA rows' adapter: r 16, alpha 32 (TRL's defaults), every Linear but the head (PEFT's
/// `all-linear`), no dropout.
fn bench_lora() -> crate::models::lora::LoraConfig {
    crate::models::lora::LoraConfig {
        r: 16,
        alpha: 32.0,
        dropout: 0.0,
        target_modules: crate::models::lora::TargetModules::AllLinear,
        use_rslora: false,
        modules_to_save: Vec::new(),
    }
}

/// deepseek-coder-1.3B's config (Llama: 24 layers, hidden 2048, 16 heads, 32,256 tokens, linear
/// RoPE scaling 4): 1.35 B parameters, 5.4 GB in f32; fully fine-tuned (weights, gradients, two
/// AdamW moments) 21.6 GB before any activation.
pub fn deepseek_1b3_config() -> LlamaConfig {
    serde_json::from_value(serde_json::json!({
        "model_type": "llama", "vocab_size": 32256, "hidden_size": 2048,
        "intermediate_size": 5504, "num_hidden_layers": 24, "num_attention_heads": 16,
        "num_key_value_heads": 16, "max_position_embeddings": 16384, "rms_norm_eps": 1e-6,
        "rope_theta": 100000.0, "rope_scaling": {"type": "linear", "factor": 4.0},
        "tie_word_embeddings": false}))
    .expect("a valid config")
}

/// LoRA steps (AdamW lr 1e-4 on the adapter; the base frozen, in f32 or, for the `_bf16base`
/// keys, held in bf16 with `--bf16`'s products): SmolLM2 on the corpus' blocks (4 × 128), Qwen2-0.5B's config (4 × 128
/// random ids) or deepseek-coder-1.3B's (1 × 128), the last two with random weights. A step's FLOPs: the forward and the input gradients, twice the
/// forward (the frozen weights' gradient products are not computed).
pub fn lora_train(
    key: &str,
    smollm2: Option<&Path>,
    corpus: &Path,
    warmup: usize,
    steps: usize,
) -> Result<BenchResult> {
    let seq = 128;
    let device = Default::default();
    let (model, config, batches) = match smollm2 {
        Some(dir) => {
            let batch = 4;
            let (model, config) = load_causal_lm::<Llama, CpuTrain>(dir, &device)?;
            let blocks = first_blocks(dir, corpus, seq, (warmup + steps) * batch)?;
            let batches: Vec<_> = (0..blocks.len() / batch)
                .map(|b| blocks.batch(&(b * batch..(b + 1) * batch).collect::<Vec<_>>()))
                .collect();
            (model, config, batches)
        }
        None => {
            let (config, batch) = match key {
                "qwen2_lora_train" | "qwen2_lora_bf16base_train" => {
                    (family_config("qwen2_train").expect("qwen2"), 4)
                }
                _ => (deepseek_1b3_config(), 1),
            };
            let model = crate::ops::with_seeded_rng::<CpuTrain, _>(&device, 0, || {
                crate::models::llama::LlamaForCausalLM::<CpuTrain>::new(&config, &device)
            });
            (model, config, vec![random_blocks(batch, seq)])
        }
    };
    let (model, adapter) = crate::models::lora::attach(model, &bench_lora(), 0)?;
    // The `_bf16base` rows hold the frozen base in bf16 and multiply in bf16 (`--base-dtype bf16
    // --bf16`), as PyTorch multiplies a base loaded in bf16.
    let bf16_base = key.contains("_bf16base");
    let model = match bf16_base {
        true => crate::models::lora::hold_base_in_bf16(model, &adapter)?,
        false => model,
    };
    let batches: Vec<_> = batches
        .into_iter()
        .map(|(tb, targets)| {
            let work = StepWork {
                samples: tb.batch,
                padded_seq: seq,
                tokens: tb.batch * seq,
                flops: 2.0 * llama_forward_flops(&config, tb.batch, seq),
            };
            (tb, targets, work)
        })
        .collect();
    let mut batches: Vec<_> = batches;
    let loss = lm_loss(&config, &mut batches);
    let opt = super::workloads::adamw();
    let _precision =
        crate::ops::MatmulPrecisionScope::set(crate::ops::mixed_precision::<Cpu>(bf16_base));
    Ok(train_steps_with(
        &format!("{key}_{}", if bf16_base { "bf16" } else { "fp32" }),
        model,
        opt,
        1e-4,
        &batches,
        warmup,
        steps,
        &device,
        &loss,
    ))
}

/// Forward passes over one 128-token block of the corpus (prompt processing).
pub fn prefill(dir: &Path, corpus: &Path, warmup: usize, steps: usize) -> Result<BenchResult> {
    let seq = 128;
    let device = Default::default();
    let (model, config) = load_causal_lm::<Llama, Cpu>(dir, &device)?;
    let model = model.into_inference_layout();
    let blocks = first_blocks(dir, corpus, seq, 1)?;
    let ids: Vec<i64> = blocks.blocks[0].iter().map(|&t| t as i64).collect();
    let work = StepWork {
        samples: 1,
        padded_seq: seq,
        tokens: seq,
        flops: llama_forward_flops(&config, 1, seq),
    };
    let mut times = Vec::new();
    for i in 0..warmup + steps {
        if i == warmup {
            super::timed_steps_begin();
        }
        let input =
            Tensor::<Cpu, 2, Int>::from_data(TensorData::new(ids.clone(), [1, seq]), &device);
        let t0 = Instant::now();
        let logits = model.forward(input, None);
        let _ = logits.into_data();
        if i >= warmup {
            times.push(t0.elapsed().as_secs_f64());
        }
    }
    Ok(BenchResult::from_times(
        "smollm2_prefill_fp32",
        &times,
        &vec![work; times.len()],
    ))
}

/// Greedy decoding after [`GENERATE_PROMPT`]: each step is one new token (a forward over it with
/// the KV cache, then argmax), as transformers' `generate` does.
pub fn generate(dir: &Path, warmup: usize, tokens: usize) -> Result<BenchResult> {
    let device = Default::default();
    let (model, config) = load_causal_lm::<Llama, Cpu>(dir, &device)?;
    let model = model.into_inference_layout();
    let tok = load_tokenizer(dir)?;
    let prompt: Vec<i64> = tok
        .encode(GENERATE_PROMPT, true)
        .map_err(|e| crate::KilnError::Data(e.to_string()))?
        .get_ids()
        .iter()
        .map(|&t| t as i64)
        .collect();
    let mut cache = KvCache::new(model.num_layers());
    let mut input = prompt;
    let mut times = Vec::new();
    let mut work = Vec::new();
    for i in 0..=warmup + tokens {
        if i == warmup + 1 {
            super::timed_steps_begin();
        }
        let past = cache.len();
        let t0 = Instant::now();
        let next = argmax(&model.next_token_logits(&input, &mut cache));
        let dt = t0.elapsed().as_secs_f64();
        // Step 0 is the prompt (prefill); the next `warmup` tokens warm up.
        if i > warmup {
            times.push(dt);
            let mut f = llama_forward_flops(&config, 1, 1);
            // attention over the cached positions
            f += 4.0
                * (config.num_hidden_layers * config.num_attention_heads * config.head_size())
                    as f64
                * past as f64;
            work.push(StepWork {
                samples: 1,
                padded_seq: past + 1,
                tokens: 1,
                flops: f,
            });
        }
        input = vec![next as i64];
    }
    Ok(BenchResult::from_times(
        "smollm2_generate_fp32",
        &times,
        &work,
    ))
}
