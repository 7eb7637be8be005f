//! kiln's GGUF import and Llama model against independent references:
//! - dequantisation against llama.cpp's own Python package (tests/fixtures/gen_gguf_blocks.py);
//! - SmolLM2-135M converted from its real GGUF file against transformers' LlamaForCausalLM on the
//!   converted folder (tests/fixtures/gen_llama_parity.py, which also checks the conversion against
//!   transformers' own GGUF loader): tokenization, logits, greedy continuations, loss and gradients.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use burn::tensor::{Int, Tensor, TensorData};
use kiln::backend::{Cpu, CpuDevice, CpuTrain};
use kiln::formats::gguf::{dequantize, GgmlType};
use kiln::formats::safetensors::{read_safetensors, StoreDtype};
use kiln::tasks::causal_lm::{self, GenerateOptions};
use kiln::train::optim::GradAccumulator;
use kiln::train::{CrossEntropy, Loss, IGNORE_INDEX};
use kiln_testkit::common::{asset, rel_err, repo_root};

#[test]
fn dequantisation_matches_llama_cpp_gguf_py() {
    let text =
        std::fs::read_to_string(repo_root().join("tests/fixtures/gguf_blocks.json")).unwrap();
    let fx: serde_json::Value = serde_json::from_str(&text).unwrap();
    let types = [
        ("Q4_0", GgmlType::Q4_0),
        ("Q4_1", GgmlType::Q4_1),
        ("Q8_0", GgmlType::Q8_0),
        ("Q4_K", GgmlType::Q4K),
        ("Q6_K", GgmlType::Q6K),
        ("F16", GgmlType::F16),
        ("BF16", GgmlType::BF16),
    ];
    for (name, ty) in types {
        let case = &fx[name];
        let hex = case["raw"].as_str().unwrap();
        let raw: Vec<u8> = (0..hex.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
            .collect();
        let want: Vec<f32> = case["values"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap() as f32)
            .collect();
        let got = dequantize(ty, &raw, want.len());
        let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!(
                (g - w).abs() <= 1e-6 * scale,
                "{name} value {i}: {g} vs gguf-py {w}"
            );
        }
        assert!(scale > 0.0, "{name}: fixture is all zeros");
    }
}

/// SmolLM2-135M-Instruct converted once per test run (f32), shared by the tests below.
fn converted() -> Option<&'static Path> {
    let gguf = asset("smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")?;
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    Some(DIR.get_or_init(|| {
        // Under target/tmp, overwritten by every run (not a cache: the conversion is under test).
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("llama-smollm2");
        // convert writes only new folders: the last run's is removed first.
        let _ = std::fs::remove_dir_all(&dir);
        kiln::models::llama::gguf::gguf_to_hf(&gguf, &dir, StoreDtype::F32).unwrap();
        dir
    }))
}

fn fixture() -> (
    serde_json::Value,
    std::collections::BTreeMap<String, kiln::formats::safetensors::HostTensor>,
) {
    let json =
        std::fs::read_to_string(repo_root().join("tests/fixtures/llama_parity.json")).unwrap();
    let st =
        read_safetensors(&repo_root().join("tests/fixtures/llama_parity.safetensors")).unwrap();
    (serde_json::from_str(&json).unwrap(), st)
}

fn ids_of(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

fn host<B: burn::tensor::backend::Backend, const D: usize>(t: Tensor<B, D>) -> Vec<f32> {
    t.into_data().convert::<f32>().into_vec::<f32>().unwrap()
}

#[test]
fn smollm2_from_gguf_matches_transformers() {
    let Some(dir) = converted() else { return };
    let (fx, st) = fixture();
    let device = CpuDevice::default();
    let (model, config) =
        kiln::models::auto::load_causal_lm::<kiln::models::llama::Llama, Cpu>(dir, &device)
            .unwrap();
    assert!(config.tie_word_embeddings && model.lm_head.is_none());
    assert_eq!((config.num_attention_heads, config.kv_heads()), (9, 3));
    let tok = causal_lm::load_tokenizer(dir).unwrap();
    for (i, p) in fx["prompts"].as_array().unwrap().iter().enumerate() {
        let text = p["text"].as_str().unwrap();
        let ids = ids_of(&p["ids"]);
        let enc = tok.encode(text, true).unwrap();
        assert_eq!(enc.get_ids(), &ids[..], "tokenization of {text:?}");

        // Logits: the full last row, and the first 256 vocabulary entries at every position.
        let n = ids.len();
        let input = Tensor::<Cpu, 2, Int>::from_data(
            TensorData::new(ids.iter().map(|&t| t as i64).collect(), [1, n]),
            &device,
        );
        let logits = model.forward(input, None);
        let v = logits.dims()[2];
        let all = host(logits);
        let last = &all[(n - 1) * v..];
        let err = rel_err(last, &st[&format!("last_logits_{i}")].data);
        assert!(err < 1e-3, "{text:?}: last-position logits rel err {err:e}");
        let head_ref: Vec<f32> = p["logits_head"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|row| {
                row.as_array()
                    .unwrap()
                    .iter()
                    .map(|x| x.as_f64().unwrap() as f32)
            })
            .collect();
        let head: Vec<f32> = (0..n)
            .flat_map(|t| all[t * v..t * v + 256].to_vec())
            .collect();
        let err = rel_err(&head, &head_ref);
        assert!(err < 1e-3, "{text:?}: per-position logits rel err {err:e}");

        // Greedy decoding with the KV cache gives transformers' continuation, token for token.
        let want = ids_of(&p["greedy_ids"]);
        let o = GenerateOptions {
            max_new_tokens: want.len(),
            stop_at_eos: false,
            ..Default::default()
        };
        let g = causal_lm::generate(&model, &tok, &config, &ids, &o, |_| {}).unwrap();
        assert_eq!(
            g.new_ids, want,
            "{text:?}: greedy continuation {:?}",
            g.text
        );
        assert_eq!(g.text, p["greedy_text"].as_str().unwrap());
    }
}

#[test]
fn smollm2_loss_and_gradients_match_transformers() {
    let Some(dir) = converted() else { return };
    let (fx, st) = fixture();
    let device = CpuDevice::default();
    let (model, _) =
        kiln::models::auto::load_causal_lm::<kiln::models::llama::Llama, CpuTrain>(dir, &device)
            .unwrap();
    let ids = ids_of(&fx["train_ids"]);
    let n = ids.len();
    let batch = kiln::data::lm::LmBlocks::pack(ids.clone(), n, 1);
    let (tb, targets) = kiln::train::BatchSource::batch(&batch, &[0]);
    assert_eq!(targets[n - 1], IGNORE_INDEX);
    let logits = kiln::contract::Model::logits(&model, &tb);
    let t = Tensor::<CpuTrain, 1, Int>::from_data(TensorData::new(targets, [n]), &device);
    let loss = CrossEntropy.loss(logits, t);
    let l = host(loss.clone())[0] as f64;
    let want = fx["train_loss"].as_f64().unwrap();
    assert!(
        (l - want).abs() < 1e-4 * want,
        "loss {l} vs transformers {want}"
    );
    let grads = loss.backward();
    let mut acc = GradAccumulator::<Cpu>::default();
    acc.accumulate::<CpuTrain, _>(&model, &grads);
    let mut checked = 0;
    for (key, r) in st.iter().filter(|(k, _)| k.starts_with("grad:")) {
        let name = &key["grad:".len()..];
        let g = host(acc.grads[name].clone());
        let width = *r.shape.last().unwrap();
        let got: Vec<f32> = if name == "model.embed_tokens.weight" {
            // the fixture holds the rows of the prompt's tokens
            ids.iter()
                .flat_map(|&t| g[t as usize * width..(t as usize + 1) * width].to_vec())
                .collect()
        } else {
            g[..r.data.len()].to_vec()
        };
        let err = rel_err(&got, &r.data);
        assert!(err < 2e-3, "{name}: gradient rel err {err:e}");
        checked += 1;
    }
    assert_eq!(checked, 6);
}

/// A Hugging Face folder sharded the way transformers saves large models
/// (`model.safetensors.index.json` + shards) loads like the single-file one.
#[test]
fn sharded_folders_load() {
    use kiln::formats::safetensors::write_safetensors;
    use kiln::models::llama::config::LlamaConfig;
    use kiln::models::llama::LlamaForCausalLM;
    use kiln::models::params::module_tensors;
    let cfg: LlamaConfig = serde_json::from_value(serde_json::json!({
        "vocab_size": 40, "hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2}))
    .unwrap();
    let device = CpuDevice::default();
    let model = kiln::ops::with_seeded_rng::<Cpu, _>(&device, 7, || {
        LlamaForCausalLM::<Cpu>::new(&cfg, &device)
    });
    let tensors = module_tensors(&model);
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    std::fs::write(dir.join("config.json"), cfg.to_json()).unwrap();
    let (first, second): (Vec<_>, Vec<_>) =
        tensors.iter().enumerate().partition(|(i, _)| i % 2 == 0);
    let mut map = serde_json::Map::new();
    for (name, part) in [
        ("model-00001-of-00002.safetensors", first),
        ("model-00002-of-00002.safetensors", second),
    ] {
        let shard: std::collections::BTreeMap<_, _> = part
            .into_iter()
            .map(|(_, (k, v))| (k.clone(), v.clone()))
            .collect();
        for k in shard.keys() {
            map.insert(k.clone(), serde_json::json!(name));
        }
        write_safetensors(&dir.join(name), &shard).unwrap();
    }
    std::fs::write(
        dir.join("model.safetensors.index.json"),
        serde_json::json!({"metadata": {}, "weight_map": map}).to_string(),
    )
    .unwrap();
    let (loaded, _) =
        kiln::models::auto::load_causal_lm::<kiln::models::llama::Llama, Cpu>(dir, &device)
            .unwrap();
    let ids =
        Tensor::<Cpu, 2, Int>::from_data(TensorData::new(vec![1i64, 5, 9, 3], [1, 4]), &device);
    let a = host(model.forward(ids.clone(), None));
    let b = host(loaded.forward(ids, None));
    assert_eq!(a, b);
    // a shard named in the index but missing is an error naming the file
    std::fs::remove_file(dir.join("model-00002-of-00002.safetensors")).unwrap();
    let e = kiln::models::auto::load_causal_lm::<kiln::models::llama::Llama, Cpu>(dir, &device)
        .err()
        .unwrap();
    assert!(
        e.to_string().contains("model-00002-of-00002.safetensors"),
        "{e}"
    );
}

/// kiln's GGUF export stores values as llama.cpp's own Python package stores them, byte for
/// byte: F16 and BF16 rounded to nearest even, Q8_0's scales and rounded quotients
/// (tests/fixtures/gen_gguf_blocks.py, `encode`).
#[test]
fn gguf_export_encodes_as_llama_cpp_gguf_py() {
    use kiln::formats::gguf_writer::encode;
    let json: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(repo_root().join("tests/fixtures/gguf_blocks.json")).unwrap(),
    )
    .unwrap();
    let e = &json["encode"];
    let values: Vec<f32> = e["values"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap() as f32)
        .collect();
    for (name, ty) in [
        ("F16", GgmlType::F16),
        ("BF16", GgmlType::BF16),
        ("Q8_0", GgmlType::Q8_0),
    ] {
        let got: String = encode(ty, &values)
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        assert_eq!(got, e[name].as_str().unwrap(), "{name}");
    }
}

/// Prompts the export round trips decode greedily.
const GGUF_PROMPTS: [&str; 2] = ["The capital of France is", "Once upon a time"];

/// Greedy ids of `dir` continuing each prompt.
fn greedy(dir: &Path, n: usize) -> Vec<Vec<u32>> {
    let layout = causal_lm::InferenceLayout {
        tensor_parallel_size: 1,
        pipeline_parallel_size: 1,
        pipeline_cuts: None,
    };
    let options = GenerateOptions {
        max_new_tokens: n,
        stop_at_eos: false,
        ..GenerateOptions::default()
    };
    GGUF_PROMPTS
        .iter()
        .map(|p| {
            let prompt = causal_lm::Prompt {
                text: p.to_string(),
                chat: false,
                adapter: None,
            };
            let (ids, _) = causal_lm::generate_from_folder::<Cpu>(
                dir,
                &prompt,
                &layout,
                &options,
                &CpuDevice::default(),
                |_| {},
            )
            .unwrap();
            ids
        })
        .collect()
}

/// A Llama folder exported to GGUF (`kiln convert --to-gguf`) and read back by kiln's importer
/// (`--from-gguf`): the config's shape, every tensor (F32 exactly, F16 as f16 rounds it, Q8_0
/// within half a quantisation step), the tokenizer's ids, the special tokens and the chat
/// template; and the F32 file decodes the source folder's greedy tokens. On the tiny chat Llama of
/// the DPO fixtures (untied head, grouped-query attention, ChatML template) and its copy made a
/// Llama 3 (its rotary scaling, llama.cpp's `rope_freqs.weight`, and its pre-tokenizer,
/// `llama-bpe`), on the tiny Qwen2 of
/// the family fixtures (llama.cpp's `qwen2`: q/k/v biases, rows not permuted, Qwen2's
/// pre-tokenizer, tied head), on the tiny Mistral without its window (llama.cpp's Llama: it comes
/// back as a Llama) and, where the assets are fetched, SmolLM2-135M-Instruct as
/// converted from its GGUF file (tied embeddings, 9 heads / 3 kv heads, SmolLM's pre-tokenizer,
/// its chat template), in F16, BF16 and Q8_0 too.
#[test]
fn exported_gguf_reads_back_as_the_source_folder() {
    use kiln::models::llama::config::LlamaConfig;
    use kiln::models::llama::gguf_export::{hf_to_gguf, GgufOutType};
    let config = |dir: &Path| {
        kiln::models::auto::read_causal_lm_config::<kiln::models::llama::Llama>(
            &dir.join("config.json"),
        )
        .unwrap()
    };
    let tmp = tempfile::tempdir().unwrap();
    // A fixture's copy under `name` with its config changed by `edit`.
    let copy = |fixture: &str, name: &str, edit: &dyn Fn(&mut serde_json::Value)| {
        let (from, to) = (repo_root().join(fixture), tmp.path().join(name));
        std::fs::create_dir(&to).unwrap();
        for f in std::fs::read_dir(&from).unwrap() {
            let f = f.unwrap();
            std::fs::copy(f.path(), to.join(f.file_name())).unwrap();
        }
        let mut c: serde_json::Value =
            serde_json::from_slice(&std::fs::read(from.join("config.json")).unwrap()).unwrap();
        edit(&mut c);
        std::fs::write(to.join("config.json"), c.to_string()).unwrap();
        to
    };
    let mistral = copy("tests/fixtures/families/mistral", "mistral", &|c| {
        c["sliding_window"] = serde_json::Value::Null
    });
    // Llama 3.1's rotary scaling (llama.cpp's `rope_freqs.weight`), its bands placed on the tiny
    // model's four frequencies (wavelengths 6, 63, 628, 6283: one kept, two blended, one
    // divided by 4); it comes back as the same frequencies from another original context.
    let llama3 = copy("tests/fixtures/dpo/tiny_chat_llama", "llama3", &|c| {
        c["rope_scaling"] = serde_json::json!({"rope_type": "llama3", "factor": 4.0,
            "low_freq_factor": 0.05, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64})
    });
    // And Llama 3's pre-tokenizer (llama.cpp's `llama-bpe`: digits in runs of up to three) with
    // its BPE's `ignore_merges`.
    let tokenizer = llama3.join("tokenizer.json");
    let mut t: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&tokenizer).unwrap()).unwrap();
    t["pre_tokenizer"] = serde_json::json!({"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": kiln::models::llama::gguf::LLAMA3_SPLIT},
         "behavior": "Isolated", "invert": false},
        {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}]});
    t["model"]["ignore_merges"] = serde_json::json!(true);
    std::fs::write(&tokenizer, t.to_string()).unwrap();
    let unscaled = config(&repo_root().join("tests/fixtures/dpo/tiny_chat_llama")).inv_freq();
    let scaled = config(&llama3).inv_freq();
    assert!(
        scaled.iter().zip(&unscaled).filter(|(a, b)| a != b).count() == 3,
        "{scaled:?} vs {unscaled:?}"
    );
    let mut sources = vec![
        repo_root().join("tests/fixtures/dpo/tiny_chat_llama"),
        repo_root().join("tests/fixtures/families/qwen2"),
        mistral,
        llama3,
    ];
    if let Some(smollm2) = converted() {
        sources.push(smollm2.to_path_buf());
    }
    for (k, src) in sources.iter().enumerate() {
        let original = kiln::formats::model_weights::read_model_weights(src).unwrap();
        let src_config: LlamaConfig = config(src);
        let src_tok = causal_lm::load_tokenizer(src).unwrap();
        for outtype in [
            GgufOutType::F32,
            GgufOutType::F16,
            GgufOutType::BF16,
            GgufOutType::Q8_0,
        ] {
            let file = tmp.path().join(format!("{k}-{outtype:?}.gguf"));
            hf_to_gguf(src, &file, outtype).unwrap();
            let back = tmp.path().join(format!("{k}-{outtype:?}"));
            kiln::models::llama::gguf::gguf_to_hf(&file, &back, StoreDtype::F32).unwrap();
            let c: LlamaConfig = config(&back);
            let written_as = match src_config.model_type.as_deref() {
                Some("mistral") => Some("llama"),
                t => t,
            };
            assert_eq!(c.model_type.as_deref(), written_as);
            assert_eq!(c.qkv_bias(), src_config.qkv_bias());
            assert_eq!(
                (
                    c.vocab_size,
                    c.hidden_size,
                    c.intermediate_size,
                    c.num_hidden_layers
                ),
                (
                    src_config.vocab_size,
                    src_config.hidden_size,
                    src_config.intermediate_size,
                    src_config.num_hidden_layers
                )
            );
            assert_eq!(c.kv_heads(), src_config.kv_heads());
            assert_eq!(c.head_size(), src_config.head_size());
            assert_eq!(c.tie_word_embeddings, src_config.tie_word_embeddings);
            assert_eq!(c.theta(), src_config.theta());
            for (a, b) in c.inv_freq().iter().zip(src_config.inv_freq()) {
                assert!((a - b).abs() <= 1e-6 * b, "rotary frequencies {a} vs {b}");
            }
            assert_eq!(c.eos_ids(), src_config.eos_ids());
            // The GGUF's padding id is the tokenizer's pad token where the config has none (as
            // llama.cpp's converter reads it), and the importer's config takes it.
            let tokenizer_pad = std::fs::read_to_string(src.join("tokenizer_config.json"))
                .ok()
                .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
                .and_then(|t| src_tok.token_to_id(t["pad_token"].as_str()?));
            assert_eq!(c.pad_token_id, src_config.pad_token_id.or(tokenizer_pad));
            let weights = kiln::formats::model_weights::read_model_weights(&back).unwrap();
            let expected: Vec<&String> = original
                .keys()
                .filter(|n| !(src_config.tie_word_embeddings && *n == "lm_head.weight"))
                .collect();
            assert_eq!(weights.keys().collect::<Vec<_>>(), expected, "{outtype:?}");
            for (name, t) in &weights {
                let o = &original[name];
                assert_eq!(t.shape, o.shape, "{name}");
                let matrix = o.shape.len() == 2;
                for (block, (got, want)) in t.data.chunks(32).zip(o.data.chunks(32)).enumerate() {
                    let step = want.iter().fold(0f32, |a, &x| a.max(x.abs())) / 127.0;
                    for (&g, &w) in got.iter().zip(want) {
                        let ok = match outtype {
                            _ if !matrix => g == w,
                            GgufOutType::F32 => g == w,
                            GgufOutType::F16 => g == half::f16::from_f32(w).to_f32(),
                            GgufOutType::BF16 => g == half::bf16::from_f32(w).to_f32(),
                            GgufOutType::Q8_0 => {
                                // Half a step, plus up to 127 × the scale's f16 rounding
                                // (2⁻¹¹ of it): the quotients are rounded with the f32 scale.
                                (g - w).abs() <= step * (0.5 + 127.0 / 2048.0) * 1.001
                            }
                        };
                        assert!(ok, "{outtype:?} {name} block {block}: {g} vs {w}");
                    }
                }
            }
            // The pre-tokenizer's split and the BPE's `ignore_merges` come back as they were
            // (the tiny vocabularies tokenize alike under several of them).
            let json = |d: &Path| -> serde_json::Value {
                serde_json::from_slice(&std::fs::read(d.join("tokenizer.json")).unwrap()).unwrap()
            };
            let (a, b) = (json(&back), json(src));
            let split = |t: &serde_json::Value| t["pre_tokenizer"]["pretokenizers"][0].clone();
            assert_eq!(split(&a)["pattern"], split(&b)["pattern"], "{outtype:?}");
            let ignore =
                |t: &serde_json::Value| t["model"]["ignore_merges"].as_bool() == Some(true);
            assert_eq!(ignore(&a), ignore(&b), "{outtype:?}: ignore_merges");
            let tok = causal_lm::load_tokenizer(&back).unwrap();
            for text in [
                "Hello, world! 12345",
                "It's 1234567 o'clock, isn't it?\n\n  ok",
                "<|im_start|>user\nhi<|im_end|>\n",
                "  spaced  ",
            ] {
                assert_eq!(
                    tok.encode(text, true).unwrap().get_ids(),
                    src_tok.encode(text, true).unwrap().get_ids(),
                    "{outtype:?}: {text:?}"
                );
            }
            let template = |d: &Path| {
                kiln::data::chat_template::ChatTemplate::from_model_dir(d)
                    .unwrap()
                    .map(|t| t.source().to_string())
            };
            assert_eq!(template(&back), template(src));
            if outtype == GgufOutType::F32 {
                assert_eq!(greedy(&back, 8), greedy(src, 8), "greedy tokens");
            }
        }
    }
}
