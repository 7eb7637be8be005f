#!/usr/bin/env python3
"""Which kernels PyTorch's step spends its GPU time on, for the GPU rows whose kiln side
scripts/gpu_kernel_profile.py breaks down (the same models, shapes and optimizer as
bench_reference_cuda.py): torch.profiler over a few warm steps, device time summed per kernel name,
largest first, per step. Run on the GPU machine by scripts/gpu-checks (GPU_TORCH_PROFILE=rows).

    python3 scripts/torch_kernel_profile.py ROW [STEPS]

ROW: bertbase_train_bf16, bertbase_train_bf16_b32, bertbase_train_bf16_b128, smollm2_train_bf16.
"""
import sys

import torch
from torch.profiler import ProfilerActivity, profile


def model_and_step(row, device):
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1234)
    if row.startswith("bertbase_train_bf16"):
        from transformers import BertConfig, BertForSequenceClassification

        batch = {"bertbase_train_bf16": 8, "bertbase_train_bf16_b32": 32}.get(row, 128)
        seq = 128
        cfg = BertConfig(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                         intermediate_size=3072, vocab_size=30522, num_labels=6)
        model = BertForSequenceClassification(cfg).to(device).train()
        labels = torch.randint(0, 6, (batch,), generator=gen)
        lr = 5e-5
    elif row == "smollm2_train_bf16":
        from transformers import LlamaConfig, LlamaForCausalLM

        batch, seq = 8, 512
        cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                          num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                          max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0,
                          tie_word_embeddings=True)
        model = LlamaForCausalLM(cfg).to(device).train()
        labels = None
        lr = 1e-4
    else:
        sys.exit(f"unknown row {row!r}")
    ids = torch.randint(1000, 30000, (batch, seq), generator=gen).to(device)
    labels = ids if labels is None else labels.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()

    return step


def main():
    row = sys.argv[1]
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    device = torch.device("cuda:0")
    step = model_and_step(row, device)
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    total, calls = {}, {}
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        us = e.time_range.elapsed_us()
        total[e.name] = total.get(e.name, 0.0) + us
        calls[e.name] = calls.get(e.name, 0) + 1
    whole = sum(total.values()) / 1e3 / steps
    print(f"PyTorch {row}: {sum(calls.values()) / steps:.0f} device kernels, {whole:.2f} ms per step")
    print("| kernel | launches/step | ms/step | share |")
    print("|---|---|---|---|")
    for name, us in sorted(total.items(), key=lambda kv: -kv[1])[:30]:
        ms = us / 1e3 / steps
        print(f"| {name[:90]} | {calls[name] / steps:.0f} | {ms:.2f} | {100 * ms / whole:.1f}% |")


if __name__ == "__main__":
    main()
