#!/usr/bin/env python3
"""Reads a GGUF file `kiln convert --to-gguf` wrote with llama.cpp's own Python package (PyPI `gguf`,
gguf-py) and checks it against the Hugging Face folder it came from (a Llama, or a Qwen2: llama.cpp's
`qwen2`, whose q/k rows are not permuted and whose q/k/v biases are F32): the hyperparameters,
the tokenizer (every token, the special tokens' types and ids, the merges, the chat template), and
every tensor's bytes equal to what gguf-py's own quantiser makes of the folder's weight (llama.cpp's
q/k row permutation applied as convert_hf_to_gguf.py applies it); then transformers' own GGUF
loader reads the file (`from_pretrained(..., gguf_file=...)`) and its tokenizer and greedy
continuation of a prompt equal the folder's. A Llama 3.1 scaling's `rope_freqs.weight` is checked
against convert_hf_to_gguf.py's formula (transformers' GGUF loader does not read it).

  python3 check_gguf.py MODEL_DIR FILE.gguf OUTTYPE [bytes-only | no-greedy]

bytes-only stops before transformers: a tiny random model's greedy tokens sit on near-ties that a
quantised file may flip, so quantised files of such models are checked byte for byte only.
no-greedy checks transformers' tokenizer from the file but not its model (which does not read a
Llama 3.1 scaling's rope_freqs.weight).
"""
import json
import os
import sys

import numpy as np
from gguf import GGMLQuantizationType as T, GGUFReader, quants
from safetensors.numpy import load_file

model_dir, path, outtype = sys.argv[1], sys.argv[2], sys.argv[3]
r = GGUFReader(path)


def field(key):
    f = r.fields[key]
    if f.types[0].name == "ARRAY":
        return [f.contents(i) for i in range(len(f.data))]
    return f.contents()


config = json.load(open(os.path.join(model_dir, "config.json")))
tok = json.load(open(os.path.join(model_dir, "tokenizer.json")))
tok_config = json.load(open(os.path.join(model_dir, "tokenizer_config.json")))
heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads") or config["num_attention_heads"]
arch = "qwen2" if config.get("model_type") == "qwen2" else "llama"
assert field("general.architecture") == arch
hyper = [("block_count", config["num_hidden_layers"]), ("embedding_length", config["hidden_size"]),
         ("feed_forward_length", config["intermediate_size"]), ("attention.head_count", heads),
         ("attention.head_count_kv", kv_heads), ("context_length", config["max_position_embeddings"])]
if arch == "llama":  # convert_hf_to_gguf.py's LlamaModel adds the vocabulary size
    hyper.append(("vocab_size", config["vocab_size"]))
for key, want in hyper:
    assert field(f"{arch}.{key}") == want, (key, field(f"{arch}.{key}"), want)
assert abs(field(f"{arch}.attention.layer_norm_rms_epsilon") - config["rms_norm_eps"]) < 1e-9
file_type = {"f32": 0, "f16": 1, "q8_0": 7, "bf16": 32}[outtype]
assert field("general.file_type") == file_type

# The tokenizer: every id's token, the added tokens' types, the merges, special ids, template.
vocab = {i: t for t, i in tok["model"]["vocab"].items()}
for a in tok["added_tokens"]:
    vocab[a["id"]] = a["content"]
tokens = field("tokenizer.ggml.tokens")
assert len(tokens) == config["vocab_size"], len(tokens)
assert all(tokens[i] == t for i, t in vocab.items())
types = field("tokenizer.ggml.token_type")
for a in tok["added_tokens"]:
    assert types[a["id"]] == (3 if a["special"] else 4), a
merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
assert field("tokenizer.ggml.merges") == merges
assert field("tokenizer.ggml.model") == "gpt2"
for name, key in [("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"), ("pad_token", "padding_token_id")]:
    if tok_config.get(name):
        assert tokens[field(f"tokenizer.ggml.{key}")] == tok_config[name], name
jinja = os.path.join(model_dir, "chat_template.jinja")
template = open(jinja).read() if os.path.exists(jinja) else tok_config.get("chat_template")
if template:
    assert field("tokenizer.chat_template") == template

# Every tensor: gguf-py's quantisation of the (permuted) weight, byte for byte.
def permute(w, n_head):  # convert_hf_to_gguf.py's LlamaModel.permute
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


weights = {}
for f in sorted(os.listdir(model_dir)):
    if f.endswith(".safetensors"):
        weights.update({k: v.astype(np.float32) for k, v in load_file(os.path.join(model_dir, f)).items()})
names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
         "lm_head.weight": "output.weight"}
parts = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
         "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
         "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
in_file = {t.name: t for t in r.tensors}
want_type = {"f32": T.F32, "f16": T.F16, "bf16": T.BF16, "q8_0": T.Q8_0}[outtype]
seen = 0
for hf, w in weights.items():
    if hf == "lm_head.weight" and config.get("tie_word_embeddings"):
        continue
    if hf.startswith("model.layers."):
        layer, rest = hf[len("model.layers."):].split(".", 1)
        part, kind = rest.rsplit(".", 1)
        name = f"blk.{layer}.{parts[part]}.{kind}"
    else:
        name = names[hf]
    if arch == "llama" and name.endswith("attn_q.weight"):
        w = permute(w, heads)
    elif arch == "llama" and name.endswith("attn_k.weight"):
        w = permute(w, kv_heads)
    t = in_file[name]
    qt = T.F32 if w.ndim == 1 else want_type
    if qt == T.Q8_0 and w.shape[-1] % 32:
        qt = T.F16
    assert t.tensor_type == qt, (name, t.tensor_type, qt)
    assert list(reversed([int(d) for d in t.shape])) == list(w.shape), (name, t.shape, w.shape)
    want = np.asarray(quants.quantize(w, qt)).tobytes()
    assert bytes(t.data.tobytes()) == want, f"{name}: bytes differ from gguf-py's {qt.name}"
    seen += 1
# Llama 3.1's rotary scaling: llama.cpp's `rope_freqs.weight`, each frequency's divisor, computed
# as convert_hf_to_gguf.py computes it (f32 frequencies, the bands from the rope_scaling values).
scaling = config.get("rope_scaling") or {}
if scaling.get("rope_type") == "llama3":
    import math
    dim = config.get("head_dim") or config["hidden_size"] // heads
    freqs = 1.0 / (np.float32(config.get("rope_theta", 10000.0)) ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / float(freq)
        if wavelen < old / high:
            factors.append(1.0)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    t = in_file["rope_freqs.weight"]
    assert t.tensor_type == T.F32, t.tensor_type
    got = np.asarray(t.data, dtype=np.float32)
    assert np.allclose(got, np.asarray(factors, dtype=np.float32), rtol=1e-6, atol=0), (got, factors)
    seen += 1
assert seen == len(r.tensors), (seen, len(r.tensors))
if sys.argv[4:] in (["bytes-only"], ["no-greedy"]):
    if sys.argv[4:] == ["no-greedy"]:
        from transformers import AutoTokenizer
        folder, name = os.path.split(os.path.abspath(path))
        text = "It's 1234567 o'clock, isn't it?\n\n  Hello, world! 12345"
        want_ids = AutoTokenizer.from_pretrained(model_dir)(text).input_ids
        got_ids = AutoTokenizer.from_pretrained(folder, gguf_file=name)(text).input_ids
        assert got_ids == want_ids, (got_ids, want_ids)
        print(f"transformers' GGUF loader tokenizes as the folder ({field('tokenizer.ggml.pre')})")
    print(f"gguf-py reads {path}: {seen} tensors byte-identical to its own {outtype} quantisation of "
          f"{model_dir}, {len(tokens)} tokens, the chat template and special tokens")
    sys.exit(0)
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as hf_logging

hf_logging.disable_progress_bar()
torch.set_num_threads(2)
prompt = "The capital of France is"
src_tok = AutoTokenizer.from_pretrained(model_dir)
ids = src_tok(prompt, return_tensors="pt").input_ids
want = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).generate(
    ids, max_new_tokens=12, do_sample=False)[0].tolist()
folder, name = os.path.split(os.path.abspath(path))
assert AutoTokenizer.from_pretrained(folder, gguf_file=name)(prompt).input_ids == ids[0].tolist()
got = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).generate(
    ids, max_new_tokens=12, do_sample=False)[0].tolist()
assert got == want, (src_tok.decode(got), src_tok.decode(want))
print(f"gguf-py reads {path}: {seen} tensors byte-identical to its own {outtype} quantisation of "
      f"{model_dir}, {len(tokens)} tokens, the chat template and special tokens; transformers decodes "
      f"the folder's greedy tokens from it ({src_tok.decode(got[ids.shape[1]:])!r})")
