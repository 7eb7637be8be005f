//! `kiln convert --from-gguf`: a llama.cpp GGUF file → a Hugging Face Llama folder (`config.json`,
//! `model.safetensors`, `tokenizer.json`, `tokenizer_config.json`, `generation_config.json`) that
//! `transformers.AutoModelForCausalLM.from_pretrained` and kiln both load.
//!
//! Three things differ between the two formats: names (`blk.N.attn_q` ↔ `model.layers.N.self_attn.
//! q_proj`), quantised storage (dequantised here, see [`super::gguf`]), and the Q/K row order that
//! llama.cpp permutes for its RoPE kernel (undone with [`unpermute_qk`]).

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::{json, Value as Json};

use super::gguf::{unpermute_qk, GgufFile, Value};
use super::llama_config::LlamaConfig;
use super::weights::{write_safetensors_as, HostTensor, StoreDtype};
use crate::error::{KilnError, Result};

/// What [`gguf_to_hf`] wrote.
#[derive(Debug)]
pub struct ConvertReport {
    pub tensors: usize,
    pub parameters: usize,
    /// `(ggml type, tensor count)`.
    pub source_types: BTreeMap<String, usize>,
    pub config: LlamaConfig,
}

/// The Hugging Face name of a GGUF tensor of a Llama model.
fn hf_name(gguf: &str) -> Option<String> {
    let fixed = match gguf {
        "token_embd.weight" => Some("model.embed_tokens.weight"),
        "output_norm.weight" => Some("model.norm.weight"),
        "output.weight" => Some("lm_head.weight"),
        _ => None,
    };
    if let Some(f) = fixed {
        return Some(f.to_string());
    }
    let rest = gguf.strip_prefix("blk.")?;
    let (layer, leaf) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let (part, kind) = leaf.rsplit_once('.')?;
    let hf = match part {
        "attn_norm" => "input_layernorm",
        "ffn_norm" => "post_attention_layernorm",
        "attn_q" => "self_attn.q_proj",
        "attn_k" => "self_attn.k_proj",
        "attn_v" => "self_attn.v_proj",
        "attn_output" => "self_attn.o_proj",
        "ffn_gate" => "mlp.gate_proj",
        "ffn_up" => "mlp.up_proj",
        "ffn_down" => "mlp.down_proj",
        _ => return None,
    };
    Some(format!("model.layers.{layer}.{hf}.{kind}"))
}

/// `LlamaConfig` from the GGUF metadata (`llama.*` keys).
pub fn llama_config(g: &GgufFile) -> Result<LlamaConfig> {
    let arch = g.require("general.architecture")?.as_str().unwrap_or("");
    if arch != "llama" {
        return Err(KilnError::Weights(format!(
            "{}: general.architecture is {arch:?}; kiln converts Llama-family GGUF files (\"llama\")",
            g.path.display()
        )));
    }
    let int = |k: &str| -> Result<usize> {
        g.require(&format!("llama.{k}"))?
            .as_u64()
            .map(|v| v as usize)
            .ok_or_else(|| {
                KilnError::Weights(format!("{}: llama.{k} is not an integer", g.path.display()))
            })
    };
    let float = |k: &str, default: f64| {
        g.get(&format!("llama.{k}"))
            .and_then(Value::as_f64)
            .unwrap_or(default)
    };
    let heads = int("attention.head_count")?;
    let hidden = int("embedding_length")?;
    let vocab = match g.get("llama.vocab_size").and_then(Value::as_u64) {
        Some(v) => v as usize,
        None => g
            .require("tokenizer.ggml.tokens")?
            .as_array()
            .map_or(0, <[Value]>::len),
    };
    let tok_id = |k: &str| {
        g.get(&format!("tokenizer.ggml.{k}"))
            .and_then(Value::as_u64)
            .map(|v| v as u32)
    };
    let rope_scaling = match g.get("llama.rope.scaling.type").and_then(Value::as_str) {
        Some("linear") => {
            Some(json!({"rope_type": "linear", "factor": float("rope.scaling.factor", 1.0)}))
        }
        Some("none") | None => None,
        Some(other) => {
            return Err(KilnError::Weights(format!(
                "{}: llama.rope.scaling.type {other:?} is not supported",
                g.path.display()
            )))
        }
    };
    // Rounded through f32 (as stored) then printed short: 9.999999747e-06 → 1e-05.
    let eps: f64 = format!("{}", float("attention.layer_norm_rms_epsilon", 1e-6) as f32)
        .parse()
        .unwrap_or(1e-6);
    let mut extra = serde_json::Map::new();
    extra.insert("torch_dtype".into(), json!("float32"));
    extra.insert("use_cache".into(), json!(true));
    extra.insert("attention_dropout".into(), json!(0.0));
    extra.insert("pretraining_tp".into(), json!(1));
    let cfg = LlamaConfig {
        vocab_size: vocab,
        hidden_size: hidden,
        intermediate_size: int("feed_forward_length")?,
        num_hidden_layers: int("block_count")?,
        num_attention_heads: heads,
        num_key_value_heads: Some(
            g.get("llama.attention.head_count_kv")
                .and_then(Value::as_u64)
                .map_or(heads, |v| v as usize),
        ),
        head_dim: Some(
            g.get("llama.rope.dimension_count")
                .and_then(Value::as_u64)
                .map_or(hidden / heads, |v| v as usize),
        ),
        hidden_act: "silu".into(),
        max_position_embeddings: g
            .get("llama.context_length")
            .and_then(Value::as_u64)
            .map_or(2048, |v| v as usize),
        rms_norm_eps: eps,
        rope_theta: float("rope.freq_base", 10000.0),
        rope_scaling,
        tie_word_embeddings: g.tensor("output.weight").is_none(),
        attention_bias: false,
        mlp_bias: false,
        initializer_range: 0.02,
        bos_token_id: tok_id("bos_token_id"),
        eos_token_id: tok_id("eos_token_id").map(|v| json!(v)),
        pad_token_id: tok_id("padding_token_id"),
        architectures: Some(vec!["LlamaForCausalLM".into()]),
        model_type: Some("llama".into()),
        extra,
    };
    cfg.validate()
        .map_err(|m| KilnError::Weights(format!("{}: {m}", g.path.display())))?;
    Ok(cfg)
}

/// Every tensor of a Llama GGUF, dequantised, renamed and un-permuted.
pub fn llama_tensors(g: &GgufFile, cfg: &LlamaConfig) -> Result<BTreeMap<String, HostTensor>> {
    let mut out = BTreeMap::new();
    for t in &g.tensors {
        let name = hf_name(&t.name).ok_or_else(|| {
            KilnError::Weights(format!(
                "{}: tensor {} has no Llama counterpart",
                g.path.display(),
                t.name
            ))
        })?;
        let mut data = g.dequantize(t);
        let heads = if name.ends_with("q_proj.weight") {
            Some(cfg.num_attention_heads)
        } else if name.ends_with("k_proj.weight") {
            Some(cfg.kv_heads())
        } else {
            None
        };
        if let Some(heads) = heads {
            let [rows, cols] = t.shape[..] else {
                return Err(KilnError::Weights(format!("{}: 2-D expected", t.name)));
            };
            data = unpermute_qk(&data, rows, cols, heads);
        }
        out.insert(
            name,
            HostTensor {
                shape: t.shape.clone(),
                data,
            },
        );
    }
    Ok(out)
}

fn tokens(g: &GgufFile, key: &str) -> Result<Vec<String>> {
    g.require(key)?
        .as_array()
        .map(|a| {
            a.iter()
                .map(|v| v.as_str().unwrap_or_default().to_string())
                .collect()
        })
        .ok_or_else(|| KilnError::Weights(format!("{}: {key} is not a list", g.path.display())))
}

/// A `tokenizer.json` (the `tokenizers` library's own format) for a GGUF byte-level BPE vocabulary.
pub fn tokenizer_json(g: &GgufFile) -> Result<Json> {
    let model = g
        .get("tokenizer.ggml.model")
        .and_then(Value::as_str)
        .unwrap_or("");
    if model != "gpt2" {
        return Err(KilnError::Weights(format!(
            "{}: tokenizer.ggml.model {model:?}: kiln converts byte-level BPE (\"gpt2\") vocabularies; \
             use the model's original tokenizer.json",
            g.path.display()
        )));
    }
    let vocab = tokens(g, "tokenizer.ggml.tokens")?;
    let merges = tokens(g, "tokenizer.ggml.merges")?;
    let types: Vec<i64> = g
        .get("tokenizer.ggml.token_type")
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .map(|v| match v {
                    Value::I64(i) => *i,
                    Value::U64(u) => *u as i64,
                    _ => 1,
                })
                .collect()
        })
        .unwrap_or_default();
    // llama.cpp's pre-tokenizer names: "smollm" and the StarCoder family split digits one by one
    // before GPT-2's byte-level regex; "gpt2"/"default" use the regex alone.
    let pre = g
        .get("tokenizer.ggml.pre")
        .and_then(Value::as_str)
        .unwrap_or("default");
    let byte_level = json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true});
    let pre_tokenizer = match pre {
        "smollm" | "starcoder" | "refact" | "codeshell" => json!({
            "type": "Sequence",
            "pretokenizers": [{"type": "Digits", "individual_digits": true}, byte_level],
        }),
        "gpt2" | "default" => byte_level.clone(),
        other => {
            return Err(KilnError::Weights(format!(
                "{}: tokenizer.ggml.pre {other:?} is not a pre-tokenizer kiln can rebuild",
                g.path.display()
            )))
        }
    };
    let added: Vec<Json> = types
        .iter()
        .enumerate()
        .filter(|(_, &t)| t == 3 || t == 4) // 3 control, 4 user-defined
        .map(|(id, &t)| {
            json!({"id": id, "content": vocab[id], "single_word": false, "lstrip": false,
                   "rstrip": false, "normalized": t == 4, "special": t == 3})
        })
        .collect();
    let add_bos = g
        .get("tokenizer.ggml.add_bos_token")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let bos = g
        .get("tokenizer.ggml.bos_token_id")
        .and_then(Value::as_u64)
        .map(|v| v as usize);
    let post_processor = match (add_bos, bos) {
        (true, Some(b)) => {
            let tok = &vocab[b];
            json!({
                "type": "TemplateProcessing",
                "single": [{"SpecialToken": {"id": tok, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [{"SpecialToken": {"id": tok, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                         {"SpecialToken": {"id": tok, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {tok.as_str(): {"id": tok, "ids": [b], "tokens": [tok]}},
            })
        }
        _ => {
            json!({"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": false, "use_regex": true})
        }
    };
    let vocab_map: serde_json::Map<String, Json> = vocab
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), json!(i)))
        .collect();
    let merges: Vec<Json> = merges
        .iter()
        .map(|m| {
            let (a, b) = m.split_once(' ').unwrap_or((m, ""));
            json!([a, b])
        })
        .collect();
    Ok(json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": post_processor,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
                  "ignore_merges": false, "vocab": vocab_map, "merges": merges},
    }))
}

/// `tokenizer_config.json`: special tokens, whether BOS is added, and the chat template.
fn tokenizer_config(g: &GgufFile, cfg: &LlamaConfig) -> Result<Json> {
    let vocab = tokens(g, "tokenizer.ggml.tokens")?;
    let name = |k: &str| {
        g.get(&format!("tokenizer.ggml.{k}"))
            .and_then(Value::as_u64)
            .and_then(|i| vocab.get(i as usize).cloned())
    };
    let mut t = json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": g.get("tokenizer.ggml.add_bos_token").and_then(Value::as_bool).unwrap_or(false),
        "add_eos_token": false,
        "clean_up_tokenization_spaces": false,
        "model_max_length": cfg.max_position_embeddings,
    });
    for (key, field) in [
        ("bos_token_id", "bos_token"),
        ("eos_token_id", "eos_token"),
        ("unknown_token_id", "unk_token"),
        ("padding_token_id", "pad_token"),
    ] {
        if let Some(tok) = name(key) {
            t[field] = json!(tok);
        }
    }
    if let Some(tpl) = g.get("tokenizer.chat_template").and_then(Value::as_str) {
        t["chat_template"] = json!(tpl);
    }
    Ok(t)
}

/// Converts `gguf` into a Hugging Face folder `out`, weights stored as `dtype`.
pub fn gguf_to_hf(gguf: &Path, out: &Path, dtype: StoreDtype) -> Result<ConvertReport> {
    let g = GgufFile::open(gguf)?;
    let cfg = llama_config(&g)?;
    let tensors = llama_tensors(&g, &cfg)?;
    let tok = tokenizer_json(&g)?;
    let tok_cfg = tokenizer_config(&g, &cfg)?;
    let mut gen = json!({"do_sample": false});
    for (k, v) in [
        ("bos_token_id", cfg.bos_token_id.map(|v| json!(v))),
        ("eos_token_id", cfg.eos_token_id.clone()),
        ("pad_token_id", cfg.pad_token_id.map(|v| json!(v))),
    ] {
        if let Some(v) = v {
            gen[k] = v;
        }
    }
    let mut source_types = BTreeMap::new();
    for t in &g.tensors {
        *source_types.entry(format!("{:?}", t.ty)).or_insert(0) += 1;
    }
    let mut cfg_out = cfg.clone();
    cfg_out.extra.insert(
        "torch_dtype".into(),
        json!(match dtype {
            StoreDtype::F32 => "float32",
            StoreDtype::BF16 => "bfloat16",
        }),
    );
    std::fs::create_dir_all(out).map_err(|e| KilnError::io(out, e))?;
    let pretty = |v: &Json| serde_json::to_string_pretty(v).expect("json");
    super::atomic_write(&out.join("config.json"), cfg_out.to_json().as_bytes())?;
    super::atomic_write(&out.join("tokenizer.json"), tok.to_string().as_bytes())?;
    super::atomic_write(
        &out.join("tokenizer_config.json"),
        pretty(&tok_cfg).as_bytes(),
    )?;
    super::atomic_write(&out.join("generation_config.json"), pretty(&gen).as_bytes())?;
    write_safetensors_as(&out.join("model.safetensors"), &tensors, dtype)?;
    Ok(ConvertReport {
        tensors: tensors.len(),
        parameters: tensors.values().map(|t| t.data.len()).sum(),
        source_types,
        config: cfg_out,
    })
}

#[cfg(test)]
mod tests {
    use super::hf_name;

    #[test]
    fn names_map_to_transformers() {
        assert_eq!(
            hf_name("blk.12.attn_k.weight").as_deref(),
            Some("model.layers.12.self_attn.k_proj.weight")
        );
        assert_eq!(
            hf_name("blk.0.ffn_norm.weight").as_deref(),
            Some("model.layers.0.post_attention_layernorm.weight")
        );
        assert_eq!(hf_name("output.weight").as_deref(), Some("lm_head.weight"));
        assert_eq!(hf_name("blk.x.attn_k.weight"), None);
        assert_eq!(hf_name("rope_freqs.weight"), None);
    }
}
