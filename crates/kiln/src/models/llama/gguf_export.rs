//! A Hugging Face Llama or Qwen2 folder (a merged SFT / DPO model, any `LlamaForCausalLM` /
//! `Qwen2ForCausalLM`) → one GGUF file for llama.cpp and Ollama, written as llama.cpp's
//! `convert_hf_to_gguf.py` writes those: its metadata keys (`llama.*` / `qwen2.*`
//! hyperparameters, `general.file_type`), the byte-level BPE vocabulary (`tokenizer.ggml.*`:
//! tokens, token types, merges, special ids, the pre-tokenizer's name) and the chat template
//! (`tokenizer.chat_template`), tensors under llama.cpp's names (a Llama's `q_proj` / `k_proj`
//! rows permuted for its RoPE kernel), norms and biases in F32 and the matrices in the chosen type
//! (a matrix whose rows do not fill Q8_0's blocks of 32 falls back to F16, as llama.cpp's
//! converter falls back). `gguf.rs` reads such files back.

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::Value as Json;
use tracing::info;

use super::config::{LayerRules, LlamaConfig, RopeScaling};
use super::gguf::{GgufArch, REGEX_SPLITS};
use crate::data::chat_template::{special_tokens, ChatTemplate};
use crate::error::{KilnError, Result};
use crate::formats::gguf::{permute_qk, GgmlType};
use crate::formats::gguf_writer::{storable, write_gguf, MetaValue, TensorEntry};
use crate::formats::model_weights::read_model_weights;

/// The type the matrices are stored in (llama.cpp's `--outtype`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GgufOutType {
    F32,
    F16,
    BF16,
    Q8_0,
}

impl GgufOutType {
    pub const NAMES: &'static str = "f32, f16, bf16, q8_0";

    pub fn from_name(name: &str) -> Option<Self> {
        Some(match name.to_ascii_lowercase().as_str() {
            "f32" => Self::F32,
            "f16" => Self::F16,
            "bf16" => Self::BF16,
            "q8_0" => Self::Q8_0,
            _ => return None,
        })
    }

    fn ggml(self) -> GgmlType {
        match self {
            Self::F32 => GgmlType::F32,
            Self::F16 => GgmlType::F16,
            Self::BF16 => GgmlType::BF16,
            Self::Q8_0 => GgmlType::Q8_0,
        }
    }

    /// `general.file_type` (llama.cpp's `LlamaFileType`: ALL_F32, MOSTLY_F16, MOSTLY_Q8_0,
    /// MOSTLY_BF16).
    fn file_type(self) -> u32 {
        match self {
            Self::F32 => 0,
            Self::F16 => 1,
            Self::Q8_0 => 7,
            Self::BF16 => 32,
        }
    }
}

/// What an export wrote.
#[derive(Debug)]
pub struct ExportReport {
    pub tensors: usize,
    pub parameters: usize,
    /// Tensors per stored type (`F16`, `Q8_0`, …).
    pub types: BTreeMap<String, usize>,
}

/// llama.cpp's name of a Llama tensor (`model.layers.3.self_attn.q_proj.weight` →
/// `blk.3.attn_q.weight`).
fn gguf_name(hf: &str) -> Option<String> {
    let fixed = match hf {
        "model.embed_tokens.weight" => Some("token_embd.weight"),
        "model.norm.weight" => Some("output_norm.weight"),
        "lm_head.weight" => Some("output.weight"),
        _ => None,
    };
    if let Some(f) = fixed {
        return Some(f.to_string());
    }
    let rest = hf.strip_prefix("model.layers.")?;
    let (layer, leaf) = rest.split_once('.')?;
    let (part, kind) = leaf.rsplit_once('.')?;
    let part = match part {
        "input_layernorm" => "attn_norm",
        "post_attention_layernorm" => "ffn_norm",
        "self_attn.q_proj" => "attn_q",
        "self_attn.k_proj" => "attn_k",
        "self_attn.v_proj" => "attn_v",
        "self_attn.o_proj" => "attn_output",
        "mlp.gate_proj" => "ffn_gate",
        "mlp.up_proj" => "ffn_up",
        "mlp.down_proj" => "ffn_down",
        _ => return None,
    };
    Some(format!("blk.{layer}.{part}.{kind}"))
}

/// Writes the Llama folder `dir` as the GGUF file `out` (a new file) with its matrices in
/// `outtype`.
pub fn hf_to_gguf(dir: &Path, out: &Path, outtype: GgufOutType) -> Result<ExportReport> {
    if out.exists() {
        return Err(KilnError::Config(format!(
            "--to-gguf {}: the file exists (kiln writes a new one)",
            out.display()
        )));
    }
    let config_path = dir.join("config.json");
    let (config, arch) = exportable_config(&config_path)?;
    let refuse = |m: String| KilnError::Config(format!("{}: {m}", config_path.display()));
    if config.sequence_classifier_labels().is_some() {
        return Err(refuse(
            "a sequence classifier (reward model): GGUF holds causal LMs for llama.cpp".into(),
        ));
    }
    if config.attention_bias || config.mlp_bias {
        return Err(refuse(format!(
            "attention_bias / mlp_bias: llama.cpp's {} has no biases on {}",
            arch.name(),
            match arch {
                GgufArch::Llama => "any projection",
                GgufArch::Qwen2 => "o_proj or the MLP",
            }
        )));
    }
    let context = config.max_position_embeddings;
    if let Some(w) = (0..config.num_hidden_layers)
        .filter_map(|i| config.window(i))
        .find(|&w| w < context)
    {
        return Err(refuse(format!(
            "a sliding attention window of {w} positions (the context is {context}): llama.cpp's \
             Llama and Qwen2 attend to every position"
        )));
    }
    let rope = config.rope().map_err(refuse)?;
    // Llama 3.1's scaling travels as llama.cpp's `rope_freqs.weight`: what each rotary
    // frequency is divided by (its converter writes no scaling keys for it).
    let rope_freqs: Option<Vec<f32>> = match (&rope, arch) {
        (RopeScaling::Llama3 { .. }, GgufArch::Llama) => Some(
            config
                .rope_freq_factors()
                .into_iter()
                .map(|f| f as f32)
                .collect(),
        ),
        (RopeScaling::Llama3 { .. }, GgufArch::Qwen2) => {
            return Err(refuse(
                "rope_scaling llama3: llama.cpp's qwen2 has no rope_freqs tensor".into(),
            ))
        }
        _ => None,
    };
    // Metadata and vocabulary first: a folder kiln cannot describe fails before the slow part.
    let mut metadata = model_metadata(dir, &config, arch, outtype, &rope);
    metadata.extend(tokenizer_metadata(dir, config.vocab_size)?);
    let weights = read_model_weights(dir)?;
    // Every tensor's shape as the config says (the q/k permutation cuts rows by heads).
    let shapes = config.param_shapes();
    for (name, t) in &weights {
        if let Some(want) = shapes.get(name).filter(|want| **want != t.shape) {
            return Err(KilnError::Weights(format!(
                "{}: {name} is {:?}, but {} makes it {want:?}",
                dir.display(),
                t.shape,
                config_path.display()
            )));
        }
    }
    let mut names: Vec<(&String, String)> = Vec::new();
    for name in weights.keys() {
        match gguf_name(name) {
            Some(g) => names.push((name, g)),
            None if config.tie_word_embeddings && name == "lm_head.weight" => {}
            None => {
                return Err(KilnError::Weights(format!(
                    "{}: tensor {name} has no place in llama.cpp's {}",
                    dir.display(),
                    arch.name()
                )))
            }
        }
    }
    // llama.cpp's order: the embedding, each block, the final norm, the output head.
    let rank = |g: &str| -> (usize, usize, String) {
        if g.starts_with("token_embd") {
            (0, 0, g.into())
        } else if let Some(rest) = g.strip_prefix("blk.") {
            let layer = rest
                .split('.')
                .next()
                .and_then(|l| l.parse().ok())
                .unwrap_or(0);
            (1, layer, g.into())
        } else {
            (2, 0, g.into())
        }
    };
    names.sort_by_key(|(_, g)| rank(g));
    let mut types = BTreeMap::new();
    // llama.cpp's converter writes its extra tensors (`rope_freqs.weight`) first.
    let extra: Vec<(TensorEntry, Vec<f32>)> = rope_freqs
        .into_iter()
        .map(|factors| {
            let entry = TensorEntry {
                name: "rope_freqs.weight".into(),
                shape: vec![factors.len()],
                ty: GgmlType::F32,
            };
            (entry, factors)
        })
        .collect();
    let entries: Vec<TensorEntry> = extra
        .iter()
        .map(|(e, _)| e.clone())
        .chain(names.iter().map(|(hf, g)| {
            let shape = weights[*hf].shape.clone();
            let row = shape.last().copied().unwrap_or(1);
            let ty = match (shape.len(), outtype.ggml()) {
                (1, _) => GgmlType::F32,
                (_, t) if storable(t, row) => t,
                _ => GgmlType::F16,
            };
            *types.entry(format!("{ty:?}")).or_insert(0) += 1;
            TensorEntry {
                name: g.clone(),
                shape,
                ty,
            }
        }))
        .collect();
    for (e, _) in &extra {
        *types.entry(format!("{:?}", e.ty)).or_insert(0) += 1;
    }
    let (heads, kv_heads) = (config.num_attention_heads, config.kv_heads());
    write_gguf(out, &metadata, &entries, |i| {
        let Some(i) = i.checked_sub(extra.len()) else {
            return Ok(extra[i].1.clone());
        };
        let (hf, g) = &names[i];
        let t = &weights[*hf];
        let heads = if !arch.permutes_qk() {
            None
        } else if g.ends_with("attn_q.weight") {
            Some(heads)
        } else if g.ends_with("attn_k.weight") {
            Some(kv_heads)
        } else {
            None
        };
        Ok(match heads {
            Some(h) => permute_qk(&t.data, t.shape[0], t.shape[1], h),
            None => t.data.clone(),
        })
    })?;
    let parameters = weights
        .iter()
        .filter(|(n, _)| gguf_name(n).is_some())
        .map(|(_, t)| t.data.len())
        .sum();
    info!(
        "{} → {}: {} tensors ({types:?})",
        dir.display(),
        out.display(),
        entries.len()
    );
    Ok(ExportReport {
        tensors: entries.len(),
        parameters,
        types,
    })
}

/// The config of the folder's `config.json` as its family reads it, and the llama.cpp
/// architecture it exports as (a Mistral's layers are a Llama's to llama.cpp, which converts
/// Mistral folders as Llamas).
fn exportable_config(path: &Path) -> Result<(LlamaConfig, GgufArch)> {
    let bytes = crate::io::files::read_regular(path, "JSON file")?;
    let model_type: Json = crate::io::parse_json(path, &bytes)?;
    let model_type = model_type["model_type"].as_str();
    let (arch, rules) = match model_type {
        None | Some("llama") => (GgufArch::Llama, LayerRules::LLAMA),
        Some("mistral") => (GgufArch::Llama, LayerRules::MISTRAL),
        Some("qwen2") => (GgufArch::Qwen2, LayerRules::QWEN2),
        Some(other) => {
            return Err(KilnError::Config(format!(
                "{}: model_type {other:?}: kiln writes Llama, Mistral and Qwen2 models to GGUF",
                path.display()
            )))
        }
    };
    let config = LlamaConfig::from_bytes(path, &bytes, rules)?;
    Ok((config, arch))
}

/// `general.*` and the architecture's keys (`llama.*`, `qwen2.*`), as llama.cpp's converter
/// writes them (the vocabulary size and rope dimension only for a Llama, as its `LlamaModel`).
fn model_metadata(
    dir: &Path,
    c: &LlamaConfig,
    arch: GgufArch,
    outtype: GgufOutType,
    rope: &RopeScaling,
) -> Vec<(String, MetaValue)> {
    let name = dir
        .canonicalize()
        .ok()
        .and_then(|d| d.file_name().map(|n| n.to_string_lossy().into_owned()))
        .unwrap_or_else(|| "model".into());
    let u = |v: usize| MetaValue::U32(v as u32);
    let key = |k: &str| format!("{}.{k}", arch.name());
    let mut m: Vec<(String, MetaValue)> = vec![
        (
            "general.architecture".into(),
            MetaValue::Str(arch.name().into()),
        ),
        ("general.type".into(), MetaValue::Str("model".into())),
        ("general.name".into(), MetaValue::Str(name)),
        (key("block_count"), u(c.num_hidden_layers)),
        (key("context_length"), u(c.max_position_embeddings)),
        (key("embedding_length"), u(c.hidden_size)),
        (key("feed_forward_length"), u(c.intermediate_size)),
        (key("attention.head_count"), u(c.num_attention_heads)),
        (key("attention.head_count_kv"), u(c.kv_heads())),
        (key("rope.freq_base"), MetaValue::F32(c.theta() as f32)),
        (
            key("attention.layer_norm_rms_epsilon"),
            MetaValue::F32(c.rms_norm_eps as f32),
        ),
        (
            "general.file_type".into(),
            MetaValue::U32(outtype.file_type()),
        ),
    ];
    if arch == GgufArch::Llama {
        m.push((key("vocab_size"), u(c.vocab_size)));
    }
    if arch == GgufArch::Llama || c.head_size() * c.num_attention_heads != c.hidden_size {
        m.push((key("rope.dimension_count"), u(c.head_size())));
    }
    if let RopeScaling::Linear(factor) = rope {
        m.push((key("rope.scaling.type"), MetaValue::Str("linear".into())));
        m.push((key("rope.scaling.factor"), MetaValue::F32(*factor as f32)));
    }
    m.push(("general.quantization_version".into(), MetaValue::U32(2)));
    m
}

/// llama.cpp's token types.
const NORMAL: i32 = 1;
const CONTROL: i32 = 3;
const USER_DEFINED: i32 = 4;
const UNUSED: i32 = 5;

/// `tokenizer.ggml.*` and `tokenizer.chat_template` of the folder's byte-level BPE tokenizer,
/// padded to the model's `vocab_size` with unused `[PADn]` tokens (as llama.cpp pads it).
fn tokenizer_metadata(dir: &Path, vocab_size: usize) -> Result<Vec<(String, MetaValue)>> {
    let path = dir.join("tokenizer.json");
    let bytes = crate::io::files::read_regular(&path, "tokenizer")?;
    let tok: Json = crate::io::parse_json(&path, &bytes)?;
    let bad = |m: String| KilnError::Config(format!("{}: {m}", path.display()));
    let model = &tok["model"];
    if model["type"].as_str() != Some("BPE") {
        return Err(bad(format!(
            "model.type {}: kiln writes byte-level BPE vocabularies (llama.cpp's \"gpt2\") to GGUF",
            model["type"]
        )));
    }
    let pre = pre_tokenizer_name(&tok["pre_tokenizer"]).ok_or_else(|| {
        bad(
            "the pre_tokenizer is none of GPT-2's byte-level split, SmolLM's (digits one by \
             one, then byte-level), Qwen2's and Llama 3's (their regex, then bytes), the ones \
             kiln names for llama.cpp"
                .into(),
        )
    })?;
    let mut tokens: BTreeMap<usize, (String, i32)> = BTreeMap::new();
    for (text, id) in model["vocab"].as_object().into_iter().flatten() {
        let id = id
            .as_u64()
            .ok_or_else(|| bad(format!("vocab id of {text:?}")))? as usize;
        tokens.insert(id, (text.clone(), NORMAL));
    }
    for added in tok["added_tokens"].as_array().into_iter().flatten() {
        let (Some(id), Some(text)) = (added["id"].as_u64(), added["content"].as_str()) else {
            return Err(bad(format!("added token {added}")));
        };
        let kind = if added["special"].as_bool() == Some(true) {
            CONTROL
        } else {
            USER_DEFINED
        };
        tokens.insert(id as usize, (text.to_string(), kind));
    }
    let count = vocab_size.max(tokens.keys().next_back().map_or(0, |&i| i + 1));
    if count > vocab_size {
        return Err(bad(format!(
            "the tokenizer has ids up to {}, past the model's vocab_size {vocab_size}",
            count - 1
        )));
    }
    let (texts, kinds): (Vec<String>, Vec<i32>) = (0..count)
        .map(|i| {
            tokens
                .get(&i)
                .cloned()
                .unwrap_or_else(|| (format!("[PAD{i}]"), UNUSED))
        })
        .unzip();
    let merges = model["merges"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|m| match m {
            Json::String(s) => Ok(s.clone()),
            Json::Array(p) if p.len() == 2 => Ok(format!(
                "{} {}",
                p[0].as_str().unwrap_or_default(),
                p[1].as_str().unwrap_or_default()
            )),
            other => Err(bad(format!("merge {other}"))),
        })
        .collect::<Result<Vec<_>>>()?;
    let mut m = vec![
        ("tokenizer.ggml.model".into(), MetaValue::Str("gpt2".into())),
        ("tokenizer.ggml.pre".into(), MetaValue::Str(pre.into())),
        (
            "tokenizer.ggml.tokens".into(),
            MetaValue::Strs(texts.clone()),
        ),
        ("tokenizer.ggml.token_type".into(), MetaValue::I32s(kinds)),
        ("tokenizer.ggml.merges".into(), MetaValue::Strs(merges)),
    ];
    let special = special_tokens(dir).map_err(|e| KilnError::Config(e.to_string()))?;
    for (name, key) in [
        ("bos_token", "bos_token_id"),
        ("eos_token", "eos_token_id"),
        ("unk_token", "unknown_token_id"),
        ("pad_token", "padding_token_id"),
    ] {
        let Some(text) = special.get(name) else {
            continue;
        };
        if let Some(id) = texts.iter().position(|t| t == text) {
            m.push((format!("tokenizer.ggml.{key}"), MetaValue::U32(id as u32)));
        }
    }
    let config_path = dir.join("tokenizer_config.json");
    if let Ok(bytes) = std::fs::read(&config_path) {
        let config: Json = crate::io::parse_json(&config_path, &bytes)?;
        for (field, key) in [
            ("add_bos_token", "add_bos_token"),
            ("add_eos_token", "add_eos_token"),
        ] {
            if let Some(b) = config[field].as_bool() {
                m.push((format!("tokenizer.ggml.{key}"), MetaValue::Bool(b)));
            }
        }
    }
    let template =
        ChatTemplate::from_model_dir(dir).map_err(|e| KilnError::Config(e.to_string()))?;
    if let Some(t) = template {
        m.push((
            "tokenizer.chat_template".into(),
            MetaValue::Str(t.source().to_string()),
        ));
    }
    Ok(m)
}

/// llama.cpp's name for a tokenizer.json pre-tokenizer kiln recognises: GPT-2's byte-level regex
/// alone (`gpt2`), digits split one by one before it (`smollm`, as SmolLM and StarCoder), or
/// Qwen2's or Llama 3's regex before a byte mapping without one (`qwen2`, `llama-bpe`:
/// [`REGEX_SPLITS`]).
fn pre_tokenizer_name(pre: &Json) -> Option<&'static str> {
    let byte_level = |p: &Json| p["type"] == "ByteLevel" && p["use_regex"] != false;
    if byte_level(pre) {
        return Some("gpt2");
    }
    let parts = pre["pretokenizers"].as_array()?;
    match parts.as_slice() {
        [split, bytes]
            if pre["type"] == "Sequence"
                && split["type"] == "Split"
                && split["behavior"] == "Isolated"
                && split["invert"] != true
                && bytes["type"] == "ByteLevel"
                && bytes["use_regex"] == false =>
        {
            let regex = split["pattern"]["Regex"].as_str()?;
            REGEX_SPLITS
                .iter()
                .find(|s| s.regex == regex)
                .map(|s| s.name)
        }
        [digits, level]
            if pre["type"] == "Sequence"
                && digits["type"] == "Digits"
                && digits["individual_digits"] == true
                && byte_level(level) =>
        {
            Some("smollm")
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::formats::gguf::{permute_qk, unpermute_qk};

    #[test]
    fn permuting_rows_is_undone_by_the_reader() {
        let (rows, cols, heads) = (8, 3, 2);
        let w: Vec<f32> = (0..rows * cols).map(|i| i as f32).collect();
        let p = permute_qk(&w, rows, cols, heads);
        assert_ne!(p, w);
        assert_eq!(unpermute_qk(&p, rows, cols, heads), w);
        // Head 0 (rows 0..4, half 2): file rows are HF rows 0, 2, 1, 3.
        assert_eq!(
            &p[..4 * cols],
            &[0., 1., 2., 6., 7., 8., 3., 4., 5., 9., 10., 11.]
        );
    }

    /// A weight whose shape is not the config's is one sentence, not a panic in the permutation.
    #[test]
    fn a_weight_of_another_shape_is_refused() {
        let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/dpo/tiny_chat_llama");
        let dir = tempfile::tempdir().unwrap();
        for f in [
            "tokenizer.json",
            "tokenizer_config.json",
            "special_tokens_map.json",
        ] {
            std::fs::copy(src.join(f), dir.path().join(f)).unwrap();
        }
        let mut config: serde_json::Value =
            serde_json::from_slice(&std::fs::read(src.join("config.json")).unwrap()).unwrap();
        // 8 heads of 4 instead of 4 of 8: q_proj's rows no longer split as the file's do.
        config["num_attention_heads"] = 8.into();
        config["head_dim"] = 8.into();
        config["num_key_value_heads"] = 4.into();
        std::fs::write(dir.path().join("config.json"), config.to_string()).unwrap();
        std::fs::copy(
            src.join("model.safetensors"),
            dir.path().join("model.safetensors"),
        )
        .unwrap();
        let e = hf_to_gguf(dir.path(), &dir.path().join("m.gguf"), GgufOutType::F16).unwrap_err();
        assert!(e.to_string().contains("but"), "{e}");
        assert!(!dir.path().join("m.gguf").exists());
    }

    /// A family GGUF does not hold (Gemma) and layers that slide (the Mistral fixture's window of
    /// 6, a Qwen2's) are refused in one sentence naming the config, before any file is written.
    #[test]
    fn families_and_windows_gguf_does_not_hold_are_refused() {
        let fixtures =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/families");
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("m.gguf");
        let gemma = dir.path().join("gemma");
        std::fs::create_dir(&gemma).unwrap();
        std::fs::write(gemma.join("config.json"), r#"{"model_type": "gemma"}"#).unwrap();
        let e = hf_to_gguf(&gemma, &out, GgufOutType::F16).unwrap_err();
        assert!(
            e.to_string().contains(
                "config.json: model_type \"gemma\": kiln writes Llama, Mistral and Qwen2 models"
            ),
            "{e}"
        );
        let e = hf_to_gguf(&fixtures.join("mistral"), &out, GgufOutType::F16).unwrap_err();
        assert!(
            e.to_string()
                .contains("a sliding attention window of 6 positions (the context is 128)"),
            "{e}"
        );
        let qwen2 = dir.path().join("qwen2");
        std::fs::create_dir(&qwen2).unwrap();
        for f in [
            "tokenizer.json",
            "tokenizer_config.json",
            "model.safetensors",
        ] {
            std::fs::copy(fixtures.join("qwen2").join(f), qwen2.join(f)).unwrap();
        }
        let mut config: serde_json::Value =
            serde_json::from_slice(&std::fs::read(fixtures.join("qwen2/config.json")).unwrap())
                .unwrap();
        config["use_sliding_window"] = true.into();
        config["sliding_window"] = 16.into();
        config["max_window_layers"] = 1.into();
        config.as_object_mut().unwrap().remove("layer_types");
        std::fs::write(qwen2.join("config.json"), config.to_string()).unwrap();
        let e = hf_to_gguf(&qwen2, &out, GgufOutType::F16).unwrap_err();
        assert!(e.to_string().contains("a sliding attention window"), "{e}");
        assert!(!out.exists());
    }

    #[test]
    fn names_are_llama_cpps() {
        assert_eq!(
            gguf_name("model.layers.3.self_attn.q_proj.weight").as_deref(),
            Some("blk.3.attn_q.weight")
        );
        assert_eq!(
            gguf_name("model.layers.0.post_attention_layernorm.weight").as_deref(),
            Some("blk.0.ffn_norm.weight")
        );
        assert_eq!(
            gguf_name("lm_head.weight").as_deref(),
            Some("output.weight")
        );
        assert_eq!(gguf_name("score.weight"), None);
    }
}
