#!/usr/bin/env python3
"""Loads a Llama folder that kiln trained and saved, with transformers, and checks it against
`kiln generate --json` on the same folder: same greedy tokens.

  python3 check_llama.py MODEL_DIR GENERATION.json
"""
import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

model_dir, gen_path = sys.argv[1], sys.argv[2]
kiln = json.load(open(gen_path))
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
tok = AutoTokenizer.from_pretrained(model_dir)
ids = torch.tensor([kiln["prompt_ids"]])
with torch.no_grad():
    out = model.generate(ids, max_new_tokens=len(kiln["new_ids"]), do_sample=False,
                         eos_token_id=None, pad_token_id=tok.pad_token_id)
new = out[0, ids.shape[1]:].tolist()
print(f"transformers: {tok.decode(new)!r}")
print(f"kiln:         {kiln['text']!r}")
if new != kiln["new_ids"]:
    sys.exit(f"FAIL: greedy tokens differ: transformers {new} vs kiln {kiln['new_ids']}")
print(f"interop OK: transformers loads kiln's trained Llama folder and decodes the same {len(new)} tokens")
