#!/usr/bin/env python3
"""torch.mm GFLOP/s of a training step's three Linear products on the shapes of
`GRADS=1 cargo run --release -p kiln --example f32_products` (2 threads), to set beside it:
  ~/.cache/kiln-venv/bin/python scripts/torch_linear_grads.py [threads]
Forward x·wᵀ (w [n, k] read transposed), input gradient dy·w, weight gradient dyᵀ·x (dy read
transposed), as autograd calls them for nn.Linear.
"""
import sys, time, torch

torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
SHAPES = [
    ("minilm train qkv", 2048, 384, 1152),
    ("minilm train out", 2048, 384, 384),
    ("minilm train ffn1", 2048, 384, 1536),
    ("minilm train ffn2", 2048, 1536, 384),
    ("bertbase train qkv", 1024, 768, 2304),
    ("bertbase train ffn1", 1024, 768, 3072),
    ("bertbase train ffn2", 1024, 3072, 768),
    ("smollm2 train q", 512, 576, 576),
    ("smollm2 train gate+up", 512, 576, 3072),
    ("smollm2 train down", 512, 1536, 576),
    ("smollm2 train head", 512, 576, 49152),
]


def rate(flops, f):
    f()
    best = 1e9
    for _ in range(7):
        t, c = time.perf_counter(), 0
        while time.perf_counter() - t < 0.2 or c < 2:
            f()
            c += 1
        best = min(best, (time.perf_counter() - t) / c)
    return flops / best / 1e9


for label, m, k, n in SHAPES:
    if len(sys.argv) > 2 and sys.argv[2] not in label:
        continue
    x, w, dy = torch.randn(m, k), torch.randn(n, k), torch.randn(m, n)
    flops = 2.0 * m * k * n
    fwd = rate(flops, lambda: torch.mm(x, w.t()))
    dx = rate(flops, lambda: torch.mm(dy, w))
    dw = rate(flops, lambda: torch.mm(dy.t(), x))
    print(f"{label:<22} {m:>5}x{k:>5}x{n:>6} {fwd:7.1f} {dx:7.1f} {dw:7.1f} GFLOP/s (x·wᵀ, dy·w, dyᵀ·x)")
