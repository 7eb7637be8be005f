//! `kiln convert --from-gguf`: a llama.cpp GGUF file of a Llama or a Qwen2 → a Hugging Face folder
//! (`config.json`, `model.safetensors`, `tokenizer.json`, `tokenizer_config.json`,
//! `generation_config.json`) that `transformers.AutoModelForCausalLM.from_pretrained` and kiln
//! both load.
//!
//! Three things differ between the two formats: names (`blk.N.attn_q` ↔ `model.layers.N.self_attn.
//! q_proj`), quantised storage (dequantised here, see [`super::gguf`]), and the Q/K row order that
//! llama.cpp permutes for its Llama's RoPE kernel (undone with [`unpermute_qk`]; its Qwen2 keeps
//! transformers' order).

use std::collections::{BTreeMap, HashSet};
use std::path::Path;

use serde_json::{json, Value as Json};

use super::config::{rope_base_freqs, LlamaConfig, RopeScaling};
use crate::error::{KilnError, Result};
use crate::formats::gguf::{short, unpermute_qk, GgufFile, Value};
use crate::formats::safetensors::{write_safetensors_as, HostTensor, StoreDtype};

/// What [`gguf_to_hf`] wrote.
#[derive(Debug)]
pub struct ConvertReport {
    pub tensors: usize,
    pub parameters: usize,
    /// `(ggml type, tensor count)`.
    pub source_types: BTreeMap<String, usize>,
    pub config: LlamaConfig,
}

/// The llama.cpp architectures kiln converts to and from GGUF: its Llama, and Qwen2 (Llama's
/// layers with q/k/v biases, whose rows llama.cpp keeps in transformers' order).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GgufArch {
    Llama,
    Qwen2,
}

impl GgufArch {
    /// `general.architecture`, and the prefix of the model's metadata keys.
    pub fn name(self) -> &'static str {
        match self {
            Self::Llama => "llama",
            Self::Qwen2 => "qwen2",
        }
    }

    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "llama" => Some(Self::Llama),
            "qwen2" => Some(Self::Qwen2),
            _ => None,
        }
    }

    /// The architecture of a config this module read from a GGUF file (`llama` or `qwen2`).
    fn of(cfg: &LlamaConfig) -> Self {
        match cfg.model_type.as_deref() {
            Some("qwen2") => Self::Qwen2,
            _ => Self::Llama,
        }
    }

    /// Whether llama.cpp stores `q_proj` / `k_proj` rows permuted for its RoPE kernel (Llama's
    /// interleaved pairs; Qwen2 rotates halves, as transformers does).
    pub fn permutes_qk(self) -> bool {
        self == Self::Llama
    }

    /// Whether q, k and v have biases.
    pub fn qkv_bias(self) -> bool {
        self == Self::Qwen2
    }
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

/// An error about `g`, naming its file.
fn bad(g: &GgufFile, msg: impl std::fmt::Display) -> KilnError {
    KilnError::Weights(format!("{}: {msg}", g.path.display()))
}

/// The context Llama 3.1's scaling was designed around (its `original_max_position_embeddings`;
/// llama.cpp's converter assumes it too). Only its ratios to the frequency factors matter.
const LLAMA3_ORIGINAL_CONTEXT: f64 = 8192.0;

/// transformers' `rope_scaling` whose divisors of the rotary frequencies `θ^(−2i/d)` are
/// `factors` (a GGUF's `rope_freqs.weight`): none where all are 1, linear where all are equal,
/// else Llama 3.1's — its factor the largest, its low/high frequency factors fitted from the
/// blended frequencies against [`LLAMA3_ORIGINAL_CONTEXT`] and checked to give every factor back.
fn scaling_of_rope_freqs(
    factors: &[f32],
    theta: f64,
    head_dim: usize,
) -> std::result::Result<Option<Json>, String> {
    let n = head_dim / 2;
    if factors.len() != n {
        return Err(format!(
            "{} values for the {n} rotary frequencies of heads of {head_dim}",
            factors.len()
        ));
    }
    if let Some(f) = factors.iter().find(|f| !(f.is_finite() && **f > 0.0)) {
        return Err(format!("a frequency divisor is {f}"));
    }
    let factors: Vec<f64> = factors.iter().map(|&f| f64::from(f)).collect();
    let factor = factors.iter().copied().fold(0.0, f64::max);
    let near = |a: f64, b: f64| (a - b).abs() <= 1e-6 * b.abs().max(1.0);
    if factors.iter().all(|&f| near(f, 1.0)) {
        return Ok(None);
    }
    if factors.iter().all(|&f| near(f, factor)) {
        return Ok(Some(json!({"rope_type": "linear", "factor": factor})));
    }
    // Blended frequencies: s = (old/λ − low) / (high − low), with s from each divisor.
    let old = LLAMA3_ORIGINAL_CONTEXT;
    let base = rope_base_freqs(theta, head_dim);
    let blended: Vec<(f64, f64)> = base
        .iter()
        .zip(&factors)
        .filter(|(_, &f)| !near(f, 1.0) && !near(f, factor))
        .map(|(&freq, &f)| {
            let x = old * freq / (2.0 * std::f64::consts::PI);
            (x, (1.0 / f - 1.0 / factor) / (1.0 - 1.0 / factor))
        })
        .collect();
    if blended.len() < 2 {
        return Err(format!(
            "{} of its values blend between 1 and {factor}: too few to tell Llama 3.1's \
             low_freq_factor and high_freq_factor",
            blended.len()
        ));
    }
    // The least-squares line s = a·x + b: a = 1/(high − low), b = −low/(high − low).
    let m = blended.len() as f64;
    let (sx, sy) = blended
        .iter()
        .fold((0.0, 0.0), |(sx, sy), (x, y)| (sx + x, sy + y));
    let (mx, my) = (sx / m, sy / m);
    let (cov, var) = blended.iter().fold((0.0, 0.0), |(c, v), (x, y)| {
        (c + (x - mx) * (y - my), v + (x - mx) * (x - mx))
    });
    let a = cov / var;
    let b = my - a * mx;
    let (low, high) = (-b / a, -b / a + 1.0 / a);
    let scaling = |[factor, low, high]: [f64; 3]| RopeScaling::Llama3 {
        factor,
        low_freq_factor: low,
        high_freq_factor: high,
        original_max_position_embeddings: old,
    };
    let gives_back = |s: &RopeScaling| {
        base.iter()
            .zip(&factors)
            .all(|(&freq, &f)| (s.llama3_factor(freq) - f).abs() <= 1e-5 * f)
    };
    // The values as written (1, 4, 8 …) where rounding keeps every factor, else as fitted.
    let tidy = |x: f64| (x * 1e4).round() / 1e4;
    let fitted = [factor, low, high];
    let Some([factor, low, high]) = [fitted.map(tidy), fitted]
        .into_iter()
        .find(|v| v[1] > 0.0 && v[2] > v[1] && gives_back(&scaling(*v)))
    else {
        return Err(format!(
            "its values are not a Llama 3.1 scaling of rotary frequencies {theta}^(-2i/{head_dim})"
        ));
    };
    Ok(Some(json!({
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": low,
        "high_freq_factor": high,
        "original_max_position_embeddings": old as u64,
    })))
}

/// A token id `tokenizer.ggml.{k}` (`None` when absent), checked against the vocabulary size so
/// that nothing indexes the token list with it unchecked.
fn token_id(g: &GgufFile, k: &str, vocab: usize) -> Result<Option<u32>> {
    let key = format!("tokenizer.ggml.{k}");
    let Some(v) = g.get(&key) else {
        return Ok(None);
    };
    let id = v
        .as_u64()
        .ok_or_else(|| bad(g, format!("{key} is {v}, not a token id")))?;
    usize::try_from(id)
        .ok()
        .filter(|&i| i < vocab)
        .and_then(|_| u32::try_from(id).ok())
        .map(Some)
        .ok_or_else(|| {
            bad(
                g,
                format!("{key} is {id}, but the vocabulary has {vocab} tokens"),
            )
        })
}

/// `LlamaConfig` from the GGUF metadata (`llama.*` keys). Sizes are checked to be non-zero here,
/// before anything divides by them, and token ids to lie in the vocabulary; `LlamaConfig::validate`
/// then checks the config as a whole.
pub fn llama_config(g: &GgufFile) -> Result<LlamaConfig> {
    let name = g.require("general.architecture")?.as_str().unwrap_or("");
    let Some(arch) = GgufArch::from_name(name) else {
        return Err(bad(
            g,
            format!(
                "general.architecture is {:?}; kiln converts Llama and Qwen2 GGUF files \
                 (\"llama\", \"qwen2\")",
                short(name)
            ),
        ));
    };
    let prefix = arch.name();
    let int = |k: &str| -> Result<usize> {
        let key = format!("{prefix}.{k}");
        let v = g.require(&key)?;
        v.as_u64()
            .and_then(|v| usize::try_from(v).ok())
            .ok_or_else(|| bad(g, format!("{key} is {v}, not a non-negative integer")))
    };
    let positive = |k: &str| -> Result<usize> {
        match int(k)? {
            0 => Err(bad(g, format!("{prefix}.{k} is 0"))),
            v => Ok(v),
        }
    };
    let optional = |k: &str| -> Result<Option<usize>> {
        match g.get(&format!("{prefix}.{k}")) {
            Some(_) => positive(k).map(Some),
            None => Ok(None),
        }
    };
    let float = |k: &str, default: f64| {
        g.get(&format!("{prefix}.{k}"))
            .and_then(Value::as_f64)
            .unwrap_or(default)
    };
    let heads = positive("attention.head_count")?;
    let hidden = positive("embedding_length")?;
    let intermediate = positive("feed_forward_length")?;
    let layers = positive("block_count")?;
    let kv_heads = optional("attention.head_count_kv")?.unwrap_or(heads);
    let head_dim = optional("rope.dimension_count")?.unwrap_or(hidden / heads);
    let n_tokens = g
        .require("tokenizer.ggml.tokens")?
        .as_array()
        .map(|a| a.len)
        .ok_or_else(|| bad(g, "tokenizer.ggml.tokens is not an array"))?;
    let vocab = match optional("vocab_size")? {
        Some(v) if v != n_tokens => {
            return Err(bad(
                g,
                format!(
                    "{prefix}.vocab_size is {v}, but tokenizer.ggml.tokens has {n_tokens} tokens"
                ),
            ))
        }
        _ if n_tokens == 0 => return Err(bad(g, "tokenizer.ggml.tokens is empty")),
        _ => n_tokens,
    };
    let bos = token_id(g, "bos_token_id", vocab)?;
    let eos = token_id(g, "eos_token_id", vocab)?;
    let pad = token_id(g, "padding_token_id", vocab)?;
    token_id(g, "unknown_token_id", vocab)?;
    let rope_scaling = match g
        .get(&format!("{prefix}.rope.scaling.type"))
        .and_then(Value::as_str)
    {
        Some("linear") => {
            Some(json!({"rope_type": "linear", "factor": float("rope.scaling.factor", 1.0)}))
        }
        Some("none") | None => None,
        Some(other) => {
            return Err(bad(
                g,
                format!(
                    "{prefix}.rope.scaling.type {:?} is not supported",
                    short(other)
                ),
            ))
        }
    };
    // Llama 3.1's scaling comes as llama.cpp's `rope_freqs.weight` (each frequency's divisor).
    let rope_scaling = match (rope_scaling, g.tensor("rope_freqs.weight")) {
        (scaling, None) => scaling,
        (None, Some(t)) if arch == GgufArch::Llama => {
            let theta = float("rope.freq_base", 10000.0);
            scaling_of_rope_freqs(&g.dequantize(t)?, theta, head_dim)
                .map_err(|m| bad(g, format!("rope_freqs.weight: {m}")))?
        }
        (_, Some(_)) => {
            return Err(bad(
                g,
                format!(
                    "rope_freqs.weight beside {prefix}.rope.scaling.type: kiln reads one \
                     rotary scaling"
                ),
            ))
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
        intermediate_size: intermediate,
        num_hidden_layers: layers,
        num_attention_heads: heads,
        num_key_value_heads: Some(kv_heads),
        head_dim: Some(head_dim),
        hidden_act: "silu".into(),
        max_position_embeddings: g
            .get(&format!("{prefix}.context_length"))
            .and_then(Value::as_u64)
            .map_or(2048, |v| usize::try_from(v).unwrap_or(usize::MAX)),
        rms_norm_eps: eps,
        rope_theta: Some(float("rope.freq_base", 10000.0)),
        rope_scaling,
        rope_parameters: None,
        use_sliding_window: (arch == GgufArch::Qwen2).then_some(false),
        max_window_layers: None,
        layer_types: None,
        tie_word_embeddings: g.tensor("output.weight").is_none(),
        attention_bias: false,
        mlp_bias: false,
        initializer_range: 0.02,
        bos_token_id: bos,
        eos_token_id: eos.map(|v| json!(v)),
        pad_token_id: pad,
        architectures: Some(vec![match arch {
            GgufArch::Llama => "LlamaForCausalLM".into(),
            GgufArch::Qwen2 => "Qwen2ForCausalLM".into(),
        }]),
        model_type: Some(prefix.into()),
        extra,
        rules: match arch {
            GgufArch::Llama => super::config::LayerRules::LLAMA,
            GgufArch::Qwen2 => super::config::LayerRules::QWEN2,
        },
    };
    cfg.validate().map_err(|m| bad(g, m))?;
    Ok(cfg)
}

/// `blk.N.PART.KIND` → `(N, "PART.KIND")`.
fn layer_part(gguf: &str) -> Option<(usize, &str)> {
    let (layer, leaf) = gguf.strip_prefix("blk.")?.split_once('.')?;
    Some((layer.parse().ok()?, leaf))
}

/// Checks that the file's tensors are exactly the ones `cfg` implies, each with its shape: every
/// one present, none beyond `block_count`, none unknown. Cheap (no tensor data is read), so a
/// header that lies about its sizes fails before anything is dequantised.
pub fn check_tensors(g: &GgufFile, cfg: &LlamaConfig) -> Result<()> {
    let (h, i, v, hd) = (
        cfg.hidden_size,
        cfg.intermediate_size,
        cfg.vocab_size,
        cfg.head_size(),
    );
    let rows = |heads: usize, key: &str| {
        heads
            .checked_mul(hd)
            .ok_or_else(|| bad(g, format!("{key} {heads} × head dim {hd} overflows")))
    };
    let arch = GgufArch::of(cfg);
    let prefix = arch.name();
    let q = rows(
        cfg.num_attention_heads,
        &format!("{prefix}.attention.head_count"),
    )?;
    let kv = rows(cfg.kv_heads(), &format!("{prefix}.attention.head_count_kv"))?;
    // PyTorch shapes (outermost first), as `TensorInfo::shape` holds them.
    let mut layer: Vec<(&str, Vec<usize>)> = vec![
        ("attn_norm.weight", vec![h]),
        ("attn_q.weight", vec![q, h]),
        ("attn_k.weight", vec![kv, h]),
        ("attn_v.weight", vec![kv, h]),
        ("attn_output.weight", vec![h, q]),
        ("ffn_norm.weight", vec![h]),
        ("ffn_gate.weight", vec![i, h]),
        ("ffn_up.weight", vec![i, h]),
        ("ffn_down.weight", vec![h, i]),
    ];
    if arch.qkv_bias() {
        layer.extend([
            ("attn_q.bias", vec![q]),
            ("attn_k.bias", vec![kv]),
            ("attn_v.bias", vec![kv]),
        ]);
    }
    let mut global = vec![
        ("token_embd.weight", vec![v, h]),
        ("output_norm.weight", vec![h]),
    ];
    // Llama 3.1's frequency divisors, which the config holds (`llama_config`).
    if g.tensor("rope_freqs.weight").is_some() {
        global.push(("rope_freqs.weight", vec![hd / 2]));
    }
    if !cfg.tie_word_embeddings {
        global.push(("output.weight", vec![v, h]));
    }
    let n_layers = cfg.num_hidden_layers;
    // Canonical names seen: `blk.01.x` and `blk.1.x` are the same Hugging Face tensor.
    let mut seen = HashSet::new();
    let mut layers_present = 0;
    for t in &g.tensors {
        let (canonical, want) = match layer_part(&t.name) {
            Some((l, _)) if l >= n_layers => {
                return Err(bad(
                    g,
                    format!(
                        "tensor {} is for layer {l}, but {prefix}.block_count is {n_layers}",
                        t.name
                    ),
                ))
            }
            Some((l, part)) => {
                layers_present = layers_present.max(l + 1);
                let want = layer.iter().find(|(p, _)| *p == part).map(|(_, s)| s);
                (format!("blk.{l}.{part}"), want)
            }
            None => {
                let want = global.iter().find(|(n, _)| *n == t.name).map(|(_, s)| s);
                (t.name.clone(), want)
            }
        };
        let want = want.ok_or_else(|| {
            bad(
                g,
                format!("tensor {} has no counterpart in {prefix}", t.name),
            )
        })?;
        if t.shape != *want {
            return Err(bad(
                g,
                format!(
                    "tensor {} has shape {:?}, but the metadata (vocabulary {v}, \
                     {prefix}.embedding_length {h}, {prefix}.feed_forward_length {i}, {} heads \
                     and {} kv heads of {hd}) implies {want:?}",
                    t.name,
                    t.shape,
                    cfg.num_attention_heads,
                    cfg.kv_heads()
                ),
            ));
        }
        if !seen.insert(canonical) {
            return Err(bad(
                g,
                format!("tensor {} duplicates another layer's tensor", t.name),
            ));
        }
    }
    // Every tensor seen is an expected one, so counting finds whether any is missing; the search
    // for the first missing one ends within `seen.len() + 1` steps even for a huge block_count.
    let wanted = n_layers
        .saturating_mul(layer.len())
        .saturating_add(global.len());
    if seen.len() < wanted {
        let missing = global
            .iter()
            .map(|(n, _)| n.to_string())
            .chain(
                (0..n_layers).flat_map(|l| layer.iter().map(move |(p, _)| format!("blk.{l}.{p}"))),
            )
            .find(|n| !seen.contains(n))
            .unwrap_or_default();
        let layers = if layers_present == 1 {
            "layer"
        } else {
            "layers"
        };
        return Err(bad(
            g,
            format!(
                "tensor {missing} is missing: {prefix}.block_count is {n_layers}, the file has \
                 tensors for {layers_present} {layers}"
            ),
        ));
    }
    Ok(())
}

/// Every tensor of a Llama or Qwen2 GGUF, dequantised, renamed and (a Llama's q/k) un-permuted
/// (after [`check_tensors`]).
pub fn llama_tensors(g: &GgufFile, cfg: &LlamaConfig) -> Result<BTreeMap<String, HostTensor>> {
    check_tensors(g, cfg)?;
    let permuted = GgufArch::of(cfg).permutes_qk();
    let mut out = BTreeMap::new();
    for t in &g.tensors {
        if t.name == "rope_freqs.weight" {
            continue; // the config's rope_scaling
        }
        let name = hf_name(&t.name).ok_or_else(|| {
            bad(
                g,
                format!("tensor {} has no Hugging Face counterpart", t.name),
            )
        })?;
        let mut data = g.dequantize(t)?;
        let heads = if !permuted {
            None
        } else if name.ends_with("q_proj.weight") {
            Some(cfg.num_attention_heads)
        } else if name.ends_with("k_proj.weight") {
            Some(cfg.kv_heads())
        } else {
            None
        };
        if let Some(heads) = heads {
            // `check_tensors` made this [heads · head_dim, hidden] with heads ≥ 1.
            let [rows, cols] = t.shape[..] else {
                return Err(bad(g, format!("tensor {}: 2-D expected", t.name)));
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

/// Qwen2's pre-tokenizer regex, as its `tokenizer.json` holds it (llama.cpp's `qwen2`).
pub const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Llama 3's pre-tokenizer regex (llama.cpp's `llama-bpe`): Qwen2's, with digits in runs of up
/// to three.
pub const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// A pre-tokenizer that splits by a regex, then maps bytes without one, as llama.cpp names it.
pub struct RegexSplit {
    /// `tokenizer.ggml.pre`.
    pub name: &'static str,
    /// The regex, as `tokenizer.json` holds it.
    pub regex: &'static str,
    /// Whether a word found whole in the vocabulary skips the merges (the BPE model's
    /// `ignore_merges`: Llama 3's, and llama.cpp's for it).
    pub ignore_merges: bool,
}

/// The regex-split pre-tokenizers kiln reads and writes.
pub const REGEX_SPLITS: [RegexSplit; 2] = [
    RegexSplit {
        name: "qwen2",
        regex: QWEN2_SPLIT,
        ignore_merges: false,
    },
    RegexSplit {
        name: "llama-bpe",
        regex: LLAMA3_SPLIT,
        ignore_merges: true,
    },
];

/// A `tokenizer.json` (the `tokenizers` library's own format) for a GGUF byte-level BPE vocabulary.
pub fn tokenizer_json(g: &GgufFile) -> Result<Json> {
    let model = g
        .get("tokenizer.ggml.model")
        .and_then(Value::as_str)
        .unwrap_or("");
    if model != "gpt2" {
        return Err(bad(
            g,
            format!(
                "tokenizer.ggml.model {:?}: kiln converts byte-level BPE (\"gpt2\") \
                 vocabularies; use the model's original tokenizer.json",
                short(model)
            ),
        ));
    }
    let vocab = g.strings("tokenizer.ggml.tokens")?;
    let merges = g.strings("tokenizer.ggml.merges")?;
    let types = match g.get("tokenizer.ggml.token_type") {
        Some(_) => g.integers("tokenizer.ggml.token_type")?,
        None => Vec::new(),
    };
    if !types.is_empty() && types.len() != vocab.len() {
        return Err(bad(
            g,
            format!(
                "tokenizer.ggml.token_type has {} entries, but tokenizer.ggml.tokens has {}",
                types.len(),
                vocab.len()
            ),
        ));
    }
    // llama.cpp's pre-tokenizer names: "smollm" and the StarCoder family split digits one by one
    // before GPT-2's byte-level regex; "gpt2"/"default" use the regex alone; "qwen2" and
    // "llama-bpe" (Llama 3) split by their own regex, then map bytes.
    let pre = g
        .get("tokenizer.ggml.pre")
        .and_then(Value::as_str)
        .unwrap_or("default");
    let byte_level = json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true});
    let split = REGEX_SPLITS.iter().find(|s| s.name == pre);
    let pre_tokenizer = match pre {
        "smollm" | "starcoder" | "refact" | "codeshell" => json!({
            "type": "Sequence",
            "pretokenizers": [{"type": "Digits", "individual_digits": true}, byte_level],
        }),
        "gpt2" | "default" => byte_level.clone(),
        _ if split.is_some() => json!({
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": split.map(|s| s.regex)}, "behavior": "Isolated",
                 "invert": false},
                {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false,
                 "use_regex": false},
            ],
        }),
        other => {
            return Err(bad(
                g,
                format!(
                    "tokenizer.ggml.pre {:?} is not a pre-tokenizer kiln can rebuild",
                    short(other)
                ),
            ))
        }
    };
    let added: Vec<Json> = vocab
        .iter()
        .zip(&types)
        .enumerate()
        .filter(|(_, (_, &t))| t == 3 || t == 4) // 3 control, 4 user-defined
        .map(|(id, (content, &t))| {
            json!({"id": id, "content": content, "single_word": false, "lstrip": false,
                   "rstrip": false, "normalized": t == 4, "special": t == 3})
        })
        .collect();
    let add_bos = g
        .get("tokenizer.ggml.add_bos_token")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let bos = token_id(g, "bos_token_id", vocab.len())?
        .and_then(|b| Some((b, vocab.get(usize::try_from(b).ok()?)?)));
    let post_processor = match (add_bos, bos) {
        (true, Some((b, tok))) => {
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
                  "ignore_merges": split.is_some_and(|s| s.ignore_merges), "vocab": vocab_map,
                  "merges": merges},
    }))
}

/// `tokenizer_config.json`: special tokens, whether BOS is added, and the chat template.
fn tokenizer_config(g: &GgufFile, cfg: &LlamaConfig) -> Result<Json> {
    let vocab = g.strings("tokenizer.ggml.tokens")?;
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
        let id = token_id(g, key, vocab.len())?;
        if let Some(tok) = id.and_then(|i| vocab.get(usize::try_from(i).ok()?)) {
            t[field] = json!(tok);
        }
    }
    if let Some(tpl) = g.get("tokenizer.chat_template").and_then(Value::as_str) {
        t["chat_template"] = json!(tpl);
    }
    Ok(t)
}

/// Writes only the tokenizer files of `gguf` (`tokenizer.json`, `tokenizer_config.json` with the
/// chat template) into `out`: all that preparing SFT data needs of a model, in a moment and a few MB
/// where the whole conversion takes seconds and hundreds.
pub fn tokenizer_to_hf(gguf: &Path, out: &Path) -> Result<()> {
    let g = GgufFile::open(gguf)?;
    let cfg = llama_config(&g)?;
    let tok = tokenizer_json(&g)?;
    let tok_cfg = tokenizer_config(&g, &cfg)?;
    std::fs::create_dir_all(out).map_err(|e| KilnError::io(out, e))?;
    write_tokenizer_files(&g, out, &tok, &tok_cfg)
}

fn write_tokenizer_files(g: &GgufFile, out: &Path, tok: &Json, tok_cfg: &Json) -> Result<()> {
    let pretty =
        serde_json::to_string_pretty(tok_cfg).map_err(|e| bad(g, format!("writing JSON: {e}")))?;
    crate::io::atomic_write(&out.join("tokenizer.json"), tok.to_string().as_bytes())?;
    crate::io::atomic_write(&out.join("tokenizer_config.json"), pretty.as_bytes())
}

/// Converts `gguf` into a Hugging Face folder `out`, weights stored as `dtype`.
pub fn gguf_to_hf(gguf: &Path, out: &Path, dtype: StoreDtype) -> Result<ConvertReport> {
    crate::io::files::check_new_folder(out, "--out", &[("GGUF file", gguf)])?;
    let g = GgufFile::open(gguf)?;
    let cfg = llama_config(&g)?;
    // Everything that reads only metadata first, so a bad file fails before the slow part.
    check_tensors(&g, &cfg)?;
    let tok = tokenizer_json(&g)?;
    let tok_cfg = tokenizer_config(&g, &cfg)?;
    let tensors = llama_tensors(&g, &cfg)?;
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
    // Serialising a `serde_json::Value` cannot fail; mapped rather than unwrapped all the same.
    let pretty = |v: &Json| {
        serde_json::to_string_pretty(v).map_err(|e| bad(&g, format!("writing JSON: {e}")))
    };
    crate::io::files::write_new_folder(out, "--out", &[("GGUF file", gguf)], |out| {
        crate::io::atomic_write(&out.join("config.json"), cfg_out.to_json().as_bytes())?;
        write_tokenizer_files(&g, out, &tok, &tok_cfg)?;
        crate::io::atomic_write(
            &out.join("generation_config.json"),
            pretty(&gen)?.as_bytes(),
        )?;
        write_safetensors_as(&out.join("model.safetensors"), &tensors, dtype)
    })?;
    Ok(ConvertReport {
        tensors: tensors.len(),
        parameters: tensors.values().map(|t| t.data.len()).sum(),
        source_types,
        config: cfg_out,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::formats::gguf::testing::Writer;

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
        // The config holds it (`scaling_of_rope_freqs`).
        assert_eq!(hf_name("rope_freqs.weight"), None);
    }

    /// A complete 2-layer Llama: hidden 8, 2 heads and 1 kv head of 4, ffn 16, 6 tokens, untied.
    fn tiny() -> Writer {
        tiny_as("llama", false)
    }

    /// [`tiny`] as architecture `arch`, with q/k/v biases where `biases`.
    fn tiny_as(arch: &str, biases: bool) -> Writer {
        let mut w = Writer::new();
        let key = |k: &str| format!("{arch}.{k}");
        w.str("general.architecture", arch)
            .u32(&key("block_count"), 2)
            .u32(&key("context_length"), 64)
            .u32(&key("embedding_length"), 8)
            .u32(&key("feed_forward_length"), 16)
            .u32(&key("attention.head_count"), 2)
            .u32(&key("attention.head_count_kv"), 1)
            .f32(&key("attention.layer_norm_rms_epsilon"), 1e-5)
            .str("tokenizer.ggml.model", "gpt2")
            .strs(
                "tokenizer.ggml.tokens",
                &["<s>", "</s>", "a", "b", "ab", "Ġ"],
            )
            .strs("tokenizer.ggml.merges", &["a b"])
            .i32s("tokenizer.ggml.token_type", &[3, 3, 1, 1, 1, 1])
            .u32("tokenizer.ggml.bos_token_id", 0)
            .u32("tokenizer.ggml.eos_token_id", 1)
            .bool("tokenizer.ggml.add_bos_token", true);
        let f = |i: usize| i as f32 * 0.01;
        w.f32_tensor("token_embd.weight", &[6, 8], f);
        w.f32_tensor("output_norm.weight", &[8], f);
        w.f32_tensor("output.weight", &[6, 8], f);
        for l in 0..2 {
            for (part, shape) in [
                ("attn_norm", &[8][..]),
                ("ffn_norm", &[8]),
                ("attn_q", &[8, 8]),
                ("attn_k", &[4, 8]),
                ("attn_v", &[4, 8]),
                ("attn_output", &[8, 8]),
                ("ffn_gate", &[16, 8]),
                ("ffn_up", &[16, 8]),
                ("ffn_down", &[8, 16]),
            ] {
                w.f32_tensor(&format!("blk.{l}.{part}.weight"), shape, f);
            }
            if biases {
                for (part, rows) in [("attn_q", 8), ("attn_k", 4), ("attn_v", 4)] {
                    w.f32_tensor(&format!("blk.{l}.{part}.bias"), &[rows], f);
                }
            }
        }
        w
    }

    /// A `qwen2` file: read under its own keys as transformers' Qwen2 (q/k/v biases), its q/k
    /// rows as stored (llama.cpp's Qwen2 does not permute them, its Llama does), Qwen2's
    /// pre-tokenizer rebuilt; without the biases it is refused, naming the first missing one.
    #[test]
    fn converts_a_tiny_qwen2() {
        let mut w = tiny_as("qwen2", true);
        w.str("tokenizer.ggml.pre", "qwen2");
        let g = open(&w);
        let cfg = llama_config(&g).unwrap();
        assert_eq!(cfg.model_type.as_deref(), Some("qwen2"));
        assert!(cfg.qkv_bias());
        let tensors = llama_tensors(&g, &cfg).unwrap();
        let stored: Vec<f32> = (0..64).map(|i| i as f32 * 0.01).collect();
        assert_eq!(
            tensors["model.layers.1.self_attn.q_proj.weight"].data,
            stored
        );
        assert_eq!(
            tensors["model.layers.0.self_attn.k_proj.bias"].shape,
            vec![4]
        );
        let llama = open(&tiny());
        let llama_cfg = llama_config(&llama).unwrap();
        let permuted =
            &llama_tensors(&llama, &llama_cfg).unwrap()["model.layers.1.self_attn.q_proj.weight"];
        assert_ne!(permuted.data, stored, "a Llama's q rows are un-permuted");
        let tok = tokenizer_json(&g).unwrap();
        assert_eq!(
            tok["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"],
            QWEN2_SPLIT
        );
        let e = error(&tiny_as("qwen2", false));
        assert!(
            e.contains("tensor blk.0.attn_q.bias is missing: qwen2.block_count is 2"),
            "{e}"
        );
    }

    /// Llama 3.1's and 3.2's scalings come back from the divisors llama.cpp writes for them
    /// (`rope_freqs.weight`, from their config.json values: heads of 128 and 64, θ 500000), the
    /// same numbers as written; plain and linear divisors as no and linear scaling; divisors no
    /// Llama 3.1 scaling gives, or of the wrong count, are one sentence.
    #[test]
    fn rope_freqs_read_back_as_the_scaling_that_wrote_them() {
        let divisors = |head_dim: usize, factor: f64| -> Vec<f32> {
            let scaling = RopeScaling::Llama3 {
                factor,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 8192.0,
            };
            rope_base_freqs(500000.0, head_dim)
                .into_iter()
                .map(|f| scaling.llama3_factor(f) as f32)
                .collect()
        };
        for (head_dim, factor) in [(128, 8.0), (64, 32.0)] {
            let got = scaling_of_rope_freqs(&divisors(head_dim, factor), 500000.0, head_dim)
                .unwrap()
                .unwrap();
            assert_eq!(
                got,
                json!({"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
                "heads of {head_dim}"
            );
        }
        assert_eq!(scaling_of_rope_freqs(&[1.0; 4], 1e4, 8).unwrap(), None);
        assert_eq!(
            scaling_of_rope_freqs(&[2.5; 4], 1e4, 8).unwrap(),
            Some(json!({"rope_type": "linear", "factor": 2.5}))
        );
        let mut bent = divisors(128, 8.0);
        bent[20] *= 1.01;
        let e = scaling_of_rope_freqs(&bent, 500000.0, 128).unwrap_err();
        assert!(e.contains("not a Llama 3.1 scaling"), "{e}");
        let e = scaling_of_rope_freqs(&divisors(128, 8.0), 500000.0, 64).unwrap_err();
        assert!(e.contains("64 values for the 32 rotary frequencies"), "{e}");
        let e = scaling_of_rope_freqs(&[1.0, 1.0, 3.0, f32::NAN], 1e4, 8).unwrap_err();
        assert!(e.contains("a frequency divisor is NaN"), "{e}");
    }

    fn open(w: &Writer) -> GgufFile {
        GgufFile::parse(Path::new("t.gguf"), w.bytes()).unwrap()
    }

    /// The error converting `w`'s file (metadata, then tensors, then tokenizer).
    fn error(w: &Writer) -> String {
        let g = open(w);
        let e = llama_config(&g)
            .and_then(|cfg| llama_tensors(&g, &cfg))
            .and_then(|_| tokenizer_json(&g))
            .expect_err("an error")
            .to_string();
        assert!(e.starts_with("t.gguf: "), "{e}");
        e
    }

    #[test]
    fn converts_a_tiny_model() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.gguf");
        std::fs::write(&path, tiny().bytes()).unwrap();
        let r = gguf_to_hf(&path, &dir.path().join("hf"), StoreDtype::F32).unwrap();
        assert_eq!(
            (r.tensors, r.parameters),
            (
                21,
                6 * 8 * 2 + 8 + 2 * (8 * 2 + 8 * 8 * 2 + 4 * 8 * 2 + 16 * 8 * 3)
            )
        );
        assert!(!r.config.tie_word_embeddings);
        assert_eq!(r.config.head_size(), 4);
    }

    #[test]
    fn sizes_are_checked_before_use() {
        for key in [
            "attention.head_count",
            "embedding_length",
            "feed_forward_length",
            "block_count",
            "attention.head_count_kv",
        ] {
            let e = error(tiny().u32(&format!("llama.{key}"), 0));
            assert!(e.contains(&format!("llama.{key} is 0")), "{e}");
        }
        let e = error(tiny().str("llama.embedding_length", "8"));
        assert!(
            e.contains("llama.embedding_length is \"8\", not a non-negative integer"),
            "{e}"
        );
        let e = error(tiny().remove("llama.block_count"));
        assert!(
            e.contains("metadata key llama.block_count is missing"),
            "{e}"
        );
        let e = error(tiny().u32("llama.vocab_size", 7));
        assert!(
            e.contains("llama.vocab_size is 7, but tokenizer.ggml.tokens has 6 tokens"),
            "{e}"
        );
        let e = error(tiny().strs("tokenizer.ggml.tokens", &[]));
        assert!(e.contains("tokenizer.ggml.tokens is empty"), "{e}");
    }

    #[test]
    fn token_ids_must_be_in_the_vocabulary() {
        for key in ["bos", "eos", "unknown", "padding"] {
            let e = error(tiny().u32(&format!("tokenizer.ggml.{key}_token_id"), 6));
            assert!(
                e.contains(&format!(
                    "tokenizer.ggml.{key}_token_id is 6, but the vocabulary has 6 tokens"
                )),
                "{e}"
            );
        }
        let e = error(tiny().str("tokenizer.ggml.bos_token_id", "<s>"));
        assert!(e.contains("not a token id"), "{e}");
        let e = error(tiny().i32s("tokenizer.ggml.token_type", &[1, 1]));
        assert!(
            e.contains("token_type has 2 entries, but tokenizer.ggml.tokens has 6"),
            "{e}"
        );
    }

    #[test]
    fn config_must_agree_with_the_tensors() {
        let e = error(tiny().u32("llama.block_count", 100_000));
        assert!(
            e.contains("tensor blk.2.attn_norm.weight is missing: llama.block_count is 100000, the file has tensors for 2 layers"),
            "{e}"
        );
        // 2^40 layers: found out without building 2^40 names.
        let e = error(tiny().set("llama.block_count", 10, (1u64 << 40).to_le_bytes().to_vec()));
        assert!(
            e.contains("is missing: llama.block_count is 1099511627776"),
            "{e}"
        );
        let e = error(tiny().u32("llama.block_count", 1));
        assert!(
            e.contains("tensor blk.1.attn_norm.weight is for layer 1, but llama.block_count is 1"),
            "{e}"
        );
        let e = error(tiny().u32("llama.embedding_length", 16));
        assert!(
            e.contains("tensor token_embd.weight has shape [6, 8], but the metadata"),
            "{e}"
        );
        assert!(e.contains("implies [6, 16]"), "{e}");
        let e = error(tiny().u32("llama.attention.head_count_kv", 2));
        assert!(
            e.contains("tensor blk.0.attn_k.weight has shape [4, 8]"),
            "{e}"
        );
        let e = error(tiny().u32("llama.rope.dimension_count", 2));
        assert!(
            e.contains("tensor blk.0.attn_q.weight has shape [8, 8]"),
            "{e}"
        );
        let mut w = tiny();
        w.tensors.retain(|(n, ..)| n != "blk.1.ffn_up.weight");
        let e = error(&w);
        assert!(e.contains("tensor blk.1.ffn_up.weight is missing"), "{e}");
        let mut w = tiny();
        w.f32_tensor("blk.01.ffn_up.weight", &[16, 8], |_| 0.0);
        let e = error(&w);
        assert!(e.contains("tensor blk.01.ffn_up.weight duplicates"), "{e}");
        let mut w = tiny();
        w.f32_tensor("blk.0.attn_q.bias", &[8], |_| 0.0);
        let e = error(&w);
        assert!(
            e.contains("tensor blk.0.attn_q.bias has no counterpart in llama"),
            "{e}"
        );
        // Without output.weight the embeddings are tied, and that is complete too.
        let mut w = tiny();
        w.tensors.retain(|(n, ..)| n != "output.weight");
        let g = open(&w);
        let cfg = llama_config(&g).unwrap();
        assert!(cfg.tie_word_embeddings);
        assert_eq!(llama_tensors(&g, &cfg).unwrap().len(), 20);
    }
}
