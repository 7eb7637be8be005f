#!/usr/bin/env python3
"""torch.mm GFLOP/s on the shapes of examples/gemm_crates.rs (2 threads), to set beside it:
  ~/.cache/kiln-venv/bin/python scripts/torch_mm_shapes.py
"""
import sys, torch, time
torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
S=[("sq1024",1024,1024,1024,0,0),("minilm qkv fwd",2048,384,1152,1,0),("minilm ffn1 fwd",2048,384,1536,1,0),("minilm ffn2 fwd",2048,1536,384,1,0),("minilm ffn1 dX",2048,1536,384,0,0),("minilm ffn1 dW",1536,2048,384,0,1),("smollm2 mlp fwd",512,576,1536,1,0),("smollm2 down dW",576,512,1536,0,1),("smollm2 lm_head",512,576,49152,1,0),("prefill 128 mlp",128,576,1536,1,0),("prefill 128 q",128,576,576,1,0),("prefill 128 kv",128,576,192,1,0),("prefill 128 qkv",128,576,960,1,0),("prefill 128 gate+up",128,576,3072,1,0),("prefill 128 down",128,1536,576,1,0),("prefill 128 head",128,576,49152,1,0),("infer 4096 qkv",4096,384,1152,1,0),("infer 4096 out",4096,384,384,1,0),("infer 4096 ffn1",4096,384,1536,1,0),("infer 4096 ffn2",4096,1536,384,1,0),("mnist fc1 fwd",32,784,120,1,0),("mnist fc1 dW",120,32,784,0,1),("mnist fc2 fwd",32,120,84,1,0),("mnist fc2 dX",32,84,120,0,0)]
for name,m,k,n,tb,ta in S:
    a = torch.randn(k,m).t() if ta else torch.randn(m,k)
    b = torch.randn(n,k).t() if tb else torch.randn(k,n)
    torch.mm(a,b)
    best=1e9
    for _ in range(5):
        t=time.perf_counter(); c=0
        while time.perf_counter()-t<0.2 or c<2:
            torch.mm(a,b); c+=1
        best=min(best,(time.perf_counter()-t)/c)
    print(f"{name:18} torch {2*m*k*n/best/1e9:7.1f} GF/s")
