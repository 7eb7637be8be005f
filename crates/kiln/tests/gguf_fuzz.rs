//! The GGUF reader and the GGUF → Hugging Face converter against hostile input.
//!
//! A tiny valid Llama GGUF (1–2 layers, hidden 8, eight tokens, F32/F16/Q8_0 tensors) is built
//! here, field by field, remembering where every number was written. It must convert and round-
//! trip; mutated copies of it (bytes flipped, cut short, any count/length/dim/offset/value
//! overwritten with 0, 1, u32::MAX, u64::MAX, 2^40, …) must give `Ok` or `Err`, never a panic.
//! `KILN_FUZZ_CASES` sets the number of cases per property (default 2000, a few seconds).
//!
//! The same builder makes the regression fixtures of `tests/bad-inputs/gguf/` (checked here to be
//! what it makes, and to fail with the `expect` of their `tests/bad-inputs/cases.jsonl` line);
//! `KILN_WRITE_FIXTURES=1 cargo test -p kiln --test gguf_fuzz fixtures` rewrites them.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use half::f16;
use kiln::formats::gguf::GgufFile;
use kiln::formats::safetensors::{read_safetensors, StoreDtype};
use kiln::models::llama::gguf::gguf_to_hf;
use kiln_testkit::common::repo_root;
use proptest::prelude::*;
use proptest::sample::Index;
use proptest::test_runner::Config;

/// A metadata value to write.
#[derive(Clone, Debug)]
enum Meta {
    U32(u32),
    U64(u64),
    F32(f32),
    Bool(bool),
    Str(String),
    Strs(Vec<String>),
    I32s(Vec<i32>),
}

/// ggml type ids.
const F32: u32 = 0;
const F16: u32 = 1;
const Q8_0: u32 = 8;

struct Tensor {
    name: String,
    /// PyTorch order (the file stores it reversed).
    shape: Vec<usize>,
    ty: u32,
    data: Vec<u8>,
}

/// A GGUF file's parts, editable until [`Model::bytes`] lays them out.
struct Model {
    kv: Vec<(String, Meta)>,
    tensors: Vec<Tensor>,
}

/// The bytes of a file and where each number in it was written: `(label, offset, width)`, the
/// labels like `kv llama.block_count value` or `tensor blk.0.attn_q.weight n_dims`.
#[derive(Default)]
struct Out {
    b: Vec<u8>,
    fields: Vec<(String, usize, usize)>,
}

impl Out {
    fn num(&mut self, label: String, v: u64, width: usize) {
        self.fields.push((label, self.b.len(), width));
        self.b.extend(&v.to_le_bytes()[..width]);
    }
    fn str(&mut self, label: String, s: &str) {
        self.num(format!("{label} len"), s.len() as u64, 8);
        self.b.extend(s.as_bytes());
    }
    /// An array header (element type, count).
    fn array(&mut self, label: &str, elem: u32, n: usize) {
        self.num(format!("{label} elem_type"), elem.into(), 4);
        self.num(format!("{label} count"), n as u64, 8);
    }
    fn meta(&mut self, key: &str, v: &Meta) {
        let ty: u32 = match v {
            Meta::U32(_) => 4,
            Meta::U64(_) => 10,
            Meta::F32(_) => 6,
            Meta::Bool(_) => 7,
            Meta::Str(_) => 8,
            Meta::Strs(_) | Meta::I32s(_) => 9,
        };
        self.num(format!("kv {key} type"), ty.into(), 4);
        let label = format!("kv {key} value");
        match v {
            Meta::U32(x) => self.num(label, (*x).into(), 4),
            Meta::U64(x) => self.num(label, *x, 8),
            Meta::F32(x) => self.num(label, x.to_bits().into(), 4),
            Meta::Bool(x) => self.num(label, (*x).into(), 1),
            Meta::Str(s) => self.str(label, s),
            Meta::Strs(v) => {
                self.array(&label, 8, v.len());
                for (i, s) in v.iter().enumerate() {
                    self.str(format!("kv {key} [{i}]"), s);
                }
            }
            Meta::I32s(v) => {
                self.array(&label, 5, v.len());
                for (i, x) in v.iter().enumerate() {
                    self.num(format!("kv {key} [{i}]"), *x as u32 as u64, 4);
                }
            }
        }
    }
    fn pad(&mut self, align: usize) {
        self.b.resize(self.b.len().next_multiple_of(align), 0);
    }
}

impl Model {
    fn set(&mut self, key: &str, v: Meta) -> &mut Self {
        match self.kv.iter_mut().find(|(k, _)| k == key) {
            Some(slot) => slot.1 = v,
            None => self.kv.push((key.into(), v)),
        }
        self
    }

    /// The file (alignment 32) and its number fields.
    fn out(&self) -> Out {
        let mut o = Out::default();
        o.b.extend(b"GGUF");
        o.num("version".into(), 3, 4);
        o.num("n_tensors".into(), self.tensors.len() as u64, 8);
        o.num("n_kv".into(), self.kv.len() as u64, 8);
        for (k, v) in &self.kv {
            o.str(format!("kv {k} key"), k);
            o.meta(k, v);
        }
        let mut offset = 0;
        for t in &self.tensors {
            let label = format!("tensor {}", t.name);
            o.str(format!("{label} name"), &t.name);
            o.num(format!("{label} n_dims"), t.shape.len() as u64, 4);
            for (i, d) in t.shape.iter().rev().enumerate() {
                o.num(format!("{label} dim{i}"), *d as u64, 8);
            }
            o.num(format!("{label} type"), t.ty.into(), 4);
            o.num(format!("{label} offset"), offset as u64, 8);
            offset = (offset + t.data.len()).next_multiple_of(32);
        }
        o.pad(32);
        for t in &self.tensors {
            o.b.extend(&t.data);
            o.pad(32);
        }
        o
    }

    fn bytes(&self) -> Vec<u8> {
        self.out().b
    }
}

const TOKENS: [&str; 8] = ["<s>", "</s>", "a", "b", "c", "ab", "Ġ", "Ġa"];
const HIDDEN: usize = 8;
const HEADS: usize = 2;
const KV_HEADS: usize = 1;
const HEAD_DIM: usize = 4;
const FFN: usize = 32;

/// Values exactly representable in F16 and in Q8_0 with scale 1/8: multiples of 1/8 in [-1, 1].
fn values(seed: usize, n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| ((i * 7 + seed * 13) % 17) as f32 / 8.0 - 1.0)
        .collect()
}

fn encode(ty: u32, v: &[f32]) -> Vec<u8> {
    match ty {
        F32 => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        F16 => v
            .iter()
            .flat_map(|&x| f16::from_f32(x).to_le_bytes())
            .collect(),
        Q8_0 => v
            .chunks(32)
            .flat_map(|block| {
                let mut b = f16::from_f32(0.125).to_le_bytes().to_vec();
                b.extend(block.iter().map(|x| (x * 8.0).round() as i8 as u8));
                b
            })
            .collect(),
        _ => unreachable!(),
    }
}

/// llama.cpp's Q/K row order: file row `h·hd + 2i + p` is Hugging Face row `h·hd + p·hd/2 + i`.
fn permute(w: &[f32], heads: usize, cols: usize) -> Vec<f32> {
    let head_dim = w.len() / cols / heads;
    let mut out = vec![0f32; w.len()];
    for h in 0..heads {
        for i in 0..head_dim / 2 {
            for p in 0..2 {
                let src = h * head_dim + p * head_dim / 2 + i;
                let dst = h * head_dim + 2 * i + p;
                out[dst * cols..(dst + 1) * cols].copy_from_slice(&w[src * cols..(src + 1) * cols]);
            }
        }
    }
    out
}

/// Hugging Face tensors by name: `(shape, values)`.
type Expected = BTreeMap<String, (Vec<usize>, Vec<f32>)>;

/// A complete Llama GGUF of `layers` layers, and the Hugging Face tensors it must convert to.
fn tiny_llama(layers: usize) -> (Model, Expected) {
    let strs = |v: &[&str]| Meta::Strs(v.iter().map(|s| s.to_string()).collect());
    let kv = vec![
        ("general.architecture", Meta::Str("llama".into())),
        ("general.alignment", Meta::U32(32)),
        ("llama.block_count", Meta::U32(layers as u32)),
        ("llama.vocab_size", Meta::U64(TOKENS.len() as u64)),
        ("llama.context_length", Meta::U32(128)),
        ("llama.embedding_length", Meta::U32(HIDDEN as u32)),
        ("llama.feed_forward_length", Meta::U32(FFN as u32)),
        ("llama.attention.head_count", Meta::U32(HEADS as u32)),
        ("llama.attention.head_count_kv", Meta::U32(KV_HEADS as u32)),
        ("llama.rope.dimension_count", Meta::U32(HEAD_DIM as u32)),
        ("llama.rope.freq_base", Meta::F32(10000.0)),
        ("llama.attention.layer_norm_rms_epsilon", Meta::F32(1e-5)),
        ("tokenizer.ggml.model", Meta::Str("gpt2".into())),
        ("tokenizer.ggml.pre", Meta::Str("smollm".into())),
        ("tokenizer.ggml.tokens", strs(&TOKENS)),
        (
            "tokenizer.ggml.token_type",
            Meta::I32s(vec![3, 3, 1, 1, 1, 1, 1, 1]),
        ),
        ("tokenizer.ggml.merges", strs(&["a b", "Ġ a"])),
        ("tokenizer.ggml.bos_token_id", Meta::U32(0)),
        ("tokenizer.ggml.eos_token_id", Meta::U32(1)),
        ("tokenizer.ggml.padding_token_id", Meta::U32(1)),
        ("tokenizer.ggml.add_bos_token", Meta::Bool(true)),
        (
            "tokenizer.chat_template",
            Meta::Str("{{ messages }}".into()),
        ),
    ];
    let mut m = Model {
        kv: kv.into_iter().map(|(k, v)| (k.to_string(), v)).collect(),
        tensors: Vec::new(),
    };
    let mut want = BTreeMap::new();
    let mut add = |gguf: String, hf: String, shape: Vec<usize>, ty: u32, qk_heads: usize| {
        let hf_values = values(want.len(), shape.iter().product());
        let file_values = match qk_heads {
            0 => hf_values.clone(),
            heads => permute(&hf_values, heads, shape[1]),
        };
        m.tensors.push(Tensor {
            name: gguf,
            shape: shape.clone(),
            ty,
            data: encode(ty, &file_values),
        });
        want.insert(hf, (shape, hf_values));
    };
    let (v, h) = (TOKENS.len(), HIDDEN);
    let emb = "model.embed_tokens.weight".to_string();
    add("token_embd.weight".into(), emb, vec![v, h], F32, 0);
    let norm = "model.norm.weight".to_string();
    add("output_norm.weight".into(), norm, vec![h], F32, 0);
    add(
        "output.weight".into(),
        "lm_head.weight".into(),
        vec![v, h],
        F16,
        0,
    );
    for l in 0..layers {
        let (q, kv) = (HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM);
        for (part, hf, shape, ty, qk) in [
            ("attn_norm", "input_layernorm", vec![h], F32, 0),
            ("attn_q", "self_attn.q_proj", vec![q, h], F32, HEADS),
            ("attn_k", "self_attn.k_proj", vec![kv, h], F16, KV_HEADS),
            ("attn_v", "self_attn.v_proj", vec![kv, h], F16, 0),
            ("attn_output", "self_attn.o_proj", vec![h, q], F32, 0),
            ("ffn_norm", "post_attention_layernorm", vec![h], F32, 0),
            ("ffn_gate", "mlp.gate_proj", vec![FFN, h], F16, 0),
            ("ffn_up", "mlp.up_proj", vec![FFN, h], F32, 0),
            ("ffn_down", "mlp.down_proj", vec![h, FFN], Q8_0, 0),
        ] {
            let gguf = format!("blk.{l}.{part}.weight");
            add(gguf, format!("model.layers.{l}.{hf}.weight"), shape, ty, qk);
        }
    }
    (m, want)
}

fn write(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, bytes).unwrap();
    p
}

#[test]
fn tiny_llama_converts_and_round_trips() {
    let dir = tempfile::tempdir().unwrap();
    let (model, want) = tiny_llama(2);
    let path = write(dir.path(), "tiny.gguf", &model.bytes());
    let out = dir.path().join("hf");
    let r = gguf_to_hf(&path, &out, StoreDtype::F32).unwrap();
    assert_eq!(r.tensors, want.len());
    assert_eq!(r.source_types.get("Q8_0"), Some(&2));
    let got = read_safetensors(&out.join("model.safetensors")).unwrap();
    assert_eq!(
        got.keys().collect::<Vec<_>>(),
        want.keys().collect::<Vec<_>>()
    );
    for (name, (shape, values)) in &want {
        assert_eq!(&got[name].shape, shape, "{name}");
        assert_eq!(&got[name].data, values, "{name}");
    }
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
    for (k, v) in [
        ("vocab_size", 8),
        ("hidden_size", 8),
        ("intermediate_size", 32),
        ("num_hidden_layers", 2),
        ("num_attention_heads", 2),
        ("num_key_value_heads", 1),
        ("head_dim", 4),
        ("max_position_embeddings", 128),
        ("bos_token_id", 0),
        ("eos_token_id", 1),
        ("pad_token_id", 1),
    ] {
        assert_eq!(cfg[k], v, "config.json {k}");
    }
    assert_eq!(cfg["tie_word_embeddings"], false);
    assert_eq!(cfg["rms_norm_eps"], 1e-5);
    // The tokenizer loads, maps tokens to their ids and merges "a b".
    let tok = tokenizers::Tokenizer::from_file(out.join("tokenizer.json")).unwrap();
    let enc = tok.encode("ab a", true).unwrap();
    assert_eq!(enc.get_ids(), [0, 5, 7]);
    let tc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("tokenizer_config.json")).unwrap())
            .unwrap();
    assert_eq!(
        (tc["bos_token"].as_str(), tc["pad_token"].as_str()),
        (Some("<s>"), Some("</s>"))
    );
    // GgufFile sees what was written.
    let g = GgufFile::parse(&path, model.bytes()).unwrap();
    assert_eq!(g.strings("tokenizer.ggml.tokens").unwrap(), TOKENS);
    assert_eq!(
        g.integers("tokenizer.ggml.token_type").unwrap()[..2],
        [3, 3]
    );
}

/// One change to a file.
#[derive(Clone, Debug)]
enum Mutation {
    /// XOR a byte anywhere.
    Flip(Index, u8),
    /// Cut the file short.
    Truncate(Index),
    /// Overwrite a number field (`Out::fields`) with a value's low bytes.
    Field(Index, u64),
    /// Overwrite 4 or 8 bytes anywhere.
    Bytes(Index, u64, bool),
}

fn extreme() -> impl Strategy<Value = u64> {
    prop_oneof![
        Just(0u64),
        Just(1),
        Just(2),
        Just(0xFF),
        Just(u32::MAX as u64),
        Just(u32::MAX as u64 + 1),
        Just(1 << 40),
        Just(i64::MAX as u64),
        Just(u64::MAX),
        Just(u64::MAX - 31),
        0u64..64,
        any::<u64>(),
    ]
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        1 => (any::<Index>(), 1u8..=255).prop_map(|(i, x)| Mutation::Flip(i, x)),
        1 => any::<Index>().prop_map(Mutation::Truncate),
        3 => (any::<Index>(), extreme()).prop_map(|(i, v)| Mutation::Field(i, v)),
        1 => (any::<Index>(), extreme(), any::<bool>()).prop_map(|(i, v, w)| Mutation::Bytes(i, v, w)),
    ]
}

fn apply(o: &Out, muts: &[Mutation]) -> Vec<u8> {
    let mut b = o.b.clone();
    for m in muts {
        match m {
            Mutation::Flip(i, x) if !b.is_empty() => {
                let at = i.index(b.len());
                b[at] ^= x;
            }
            Mutation::Truncate(i) => b.truncate(i.index(b.len() + 1)),
            Mutation::Field(i, v) => {
                let (_, at, width) = &o.fields[i.index(o.fields.len())];
                if at + width <= b.len() {
                    b[*at..at + width].copy_from_slice(&v.to_le_bytes()[..*width]);
                }
            }
            Mutation::Bytes(i, v, wide) => {
                let width = if *wide { 8 } else { 4 };
                if b.len() >= width {
                    let at = i.index(b.len() - width + 1);
                    b[at..at + width].copy_from_slice(&v.to_le_bytes()[..width]);
                }
            }
            _ => {}
        }
    }
    b
}

fn cases() -> u32 {
    std::env::var("KILN_FUZZ_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(2000)
}

/// Parsing and converting `bytes` returns (either way) without panicking; `Ok` only when the
/// parse was `Ok` too.
fn survives(dir: &Path, bytes: Vec<u8>) {
    let path = write(dir, "m.gguf", &bytes);
    let parsed = GgufFile::parse(&path, bytes);
    if let Err(e) = &parsed {
        assert!(
            e.to_string().starts_with(&path.display().to_string()),
            "{e}"
        );
    }
    // A fresh --out each time: a folder a conversion filled is refused before parsing.
    let _ = std::fs::remove_dir_all(dir.join("out"));
    let converted = gguf_to_hf(&path, &dir.join("out"), StoreDtype::BF16);
    if let Err(e) = &converted {
        assert!(
            e.to_string().starts_with(&path.display().to_string()),
            "{e}"
        );
    }
    assert!(parsed.is_ok() || converted.is_err());
}

proptest! {
    #![proptest_config(Config { cases: cases(), failure_persistence: None, ..Config::default() })]

    #[test]
    fn mutated_files_never_panic(layers in 1usize..=2, muts in prop::collection::vec(mutation(), 1..4)) {
        let dir = tempfile::tempdir().unwrap();
        let (model, _) = tiny_llama(layers);
        survives(dir.path(), apply(&model.out(), &muts));
    }

    /// Random bytes after a header with small counts (so the reader gets past the header).
    #[test]
    fn random_bodies_never_panic(
        n_tensors in 0u64..3,
        n_kv in 0u64..4,
        body in prop::collection::vec(any::<u8>(), 0..512),
    ) {
        let dir = tempfile::tempdir().unwrap();
        let mut b = b"GGUF\x03\0\0\0".to_vec();
        b.extend(n_tensors.to_le_bytes());
        b.extend(n_kv.to_le_bytes());
        b.extend(body);
        survives(dir.path(), b);
    }
}

/// Every number field of the valid file, set to each extreme value in turn: exhaustive over the
/// fields (a few hundred), so no field depends on the random draw.
#[test]
fn every_field_at_every_extreme() {
    let dir = tempfile::tempdir().unwrap();
    let (model, _) = tiny_llama(1);
    let o = model.out();
    for (label, at, width) in &o.fields {
        for v in [0u64, 1, u32::MAX as u64, u64::MAX, 1 << 40] {
            let mut b = o.b.clone();
            b[*at..at + width].copy_from_slice(&v.to_le_bytes()[..*width]);
            let path = write(dir.path(), "m.gguf", &b);
            let r = std::panic::catch_unwind(|| {
                // A fresh --out each time: a folder a conversion filled is refused before parsing.
                let _ = std::fs::remove_dir_all(dir.path().join("out"));
                let _ = gguf_to_hf(&path, &dir.path().join("out"), StoreDtype::F32);
            });
            assert!(r.is_ok(), "{label} = {v} panicked");
        }
    }
}

/// The committed bad-input fixtures: `(file name, bytes, expected error substring)`.
fn fixtures() -> Vec<(&'static str, Vec<u8>, &'static str)> {
    let (model, _) = tiny_llama(1);
    let edited = |key: &str, v: Meta| {
        let (mut m, _) = tiny_llama(1);
        m.set(key, v);
        m.bytes()
    };
    // The valid file with the number field `label` overwritten.
    let field = |label: &str, v: u64| {
        let o = model.out();
        let (_, at, width) = o.fields.iter().find(|f| f.0 == label).unwrap().clone();
        let mut b = o.b;
        b[at..at + width].copy_from_slice(&v.to_le_bytes()[..width]);
        b
    };
    let full = model.bytes();
    let o = model.out();
    // Cut inside the tensor directory.
    let mid_directory = o
        .fields
        .iter()
        .find(|f| f.0 == "tensor blk.0.ffn_down.weight offset")
        .unwrap()
        .1;
    let mut dup = tiny_llama(1).0;
    dup.kv.push(("llama.block_count".into(), Meta::U32(1)));
    let nested = {
        // general.nested: arrays of arrays 9 deep (kiln reads 8).
        let mut m = tiny_llama(1).0;
        m.kv.push(("general.nested".into(), Meta::U32(0)));
        let mut b = m.bytes();
        let key = b"general.nested";
        let at = b.windows(key.len()).position(|w| w == key).unwrap() + key.len();
        let mut deep = 9u32.to_le_bytes().to_vec();
        for level in 1..=9 {
            deep.extend(if level < 9 { 9u32 } else { 0 }.to_le_bytes());
            deep.extend(u64::from(level < 9).to_le_bytes());
        }
        b.splice(at..at + 8, deep);
        b
    };
    vec![
        (
            "head_count_0.gguf",
            edited("llama.attention.head_count", Meta::U32(0)),
            "llama.attention.head_count is 0",
        ),
        (
            "bos_out_of_range.gguf",
            edited("tokenizer.ggml.bos_token_id", Meta::U32(1000)),
            "tokenizer.ggml.bos_token_id is 1000, but the vocabulary has 8 tokens",
        ),
        (
            "alignment_0.gguf",
            edited("general.alignment", Meta::U32(0)),
            "general.alignment is 0",
        ),
        (
            "n_dims_huge.gguf",
            field("tensor token_embd.weight n_dims", 0xFFFF_FFFF),
            "tensor token_embd.weight: 4294967295 dimensions",
        ),
        (
            "block_count_lie.gguf",
            edited("llama.block_count", Meta::U32(100_000)),
            "llama.block_count is 100000, the file has tensors for 1 layer",
        ),
        (
            "truncated_data.gguf",
            full[..full.len() - 100].to_vec(),
            "run past the end of the file",
        ),
        (
            "truncated_header.gguf",
            full[..mid_directory].to_vec(),
            "file ends early",
        ),
        (
            "offset_past_end.gguf",
            field("tensor blk.0.ffn_down.weight offset", 1 << 20),
            "tensor blk.0.ffn_down.weight: its 272 bytes at data offset 1048576",
        ),
        (
            "bad_string_length.gguf",
            field("kv general.architecture value len", 1 << 40),
            "metadata key general.architecture: string length 1099511627776",
        ),
        (
            "unknown_value_type.gguf",
            field("kv llama.context_length type", 99),
            "metadata key llama.context_length: unknown metadata value type 99",
        ),
        (
            "array_count_huge.gguf",
            field("kv tokenizer.ggml.tokens value count", u64::MAX),
            "metadata key tokenizer.ggml.tokens: array length 18446744073709551615",
        ),
        (
            "nested_too_deep.gguf",
            nested,
            "metadata arrays nested more than 8 deep",
        ),
        (
            "duplicate_key.gguf",
            dup.bytes(),
            "metadata key llama.block_count: appears twice",
        ),
        (
            "shape_mismatch.gguf",
            edited("llama.feed_forward_length", Meta::U32(64)),
            "tensor blk.0.ffn_gate.weight has shape [32, 8], but the metadata",
        ),
    ]
}

/// The fixtures are what the builder makes, fail with their `cases.jsonl` expectation, and each
/// has its line there.
#[test]
fn bad_input_fixtures() {
    let corpus = repo_root().join("tests/bad-inputs");
    let cases: Vec<serde_json::Value> = std::fs::read_to_string(corpus.join("cases.jsonl"))
        .unwrap()
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let rewrite = std::env::var_os("KILN_WRITE_FIXTURES").is_some();
    let tmp = tempfile::tempdir().unwrap();
    for (name, bytes, expect) in fixtures() {
        let path = corpus.join("gguf").join(name);
        if rewrite {
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(&path, &bytes).unwrap();
        }
        let committed = std::fs::read(&path).unwrap_or_default();
        assert!(
            committed == bytes,
            "{} differs from what the builder makes: KILN_WRITE_FIXTURES=1 cargo test -p kiln \
             --test gguf_fuzz bad_input_fixtures rewrites it",
            path.display()
        );
        let e = gguf_to_hf(&path, &tmp.path().join("out"), StoreDtype::F32)
            .err()
            .unwrap_or_else(|| panic!("{name} converted"))
            .to_string();
        assert!(e.starts_with(&path.display().to_string()), "{e}");
        assert!(e.contains(expect), "{name}: {e}");
        let arg = format!("{{corpus}}/gguf/{name}");
        let case = cases
            .iter()
            .find(|c| {
                c["args"]
                    .as_array()
                    .is_some_and(|a| a.iter().any(|x| *x == arg))
            })
            .unwrap_or_else(|| panic!("no line in cases.jsonl converts {arg}"));
        let want = case["expect"].as_str().unwrap();
        assert!(
            e.contains(want),
            "{name}: {e}\ndoes not contain cases.jsonl's {want:?}"
        );
    }
}
