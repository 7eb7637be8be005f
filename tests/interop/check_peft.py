#!/usr/bin/env python3
"""Loads a LoRA adapter that kiln trained (`kiln train --use-peft`) onto its base model with peft's
`PeftModel.from_pretrained`, and checks it against `kiln generate --adapter DIR --json`: the same
greedy tokens from the same prompt ids.

  python3 check_peft.py BASE_DIR ADAPTER_DIR GENERATION.json
"""
import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

base_dir, adapter_dir, gen_path = sys.argv[1], sys.argv[2], sys.argv[3]
kiln = json.load(open(gen_path))
base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
model = PeftModel.from_pretrained(base, adapter_dir).eval()
lora_b = sum(p.abs().sum().item() for n, p in model.named_parameters() if "lora_B" in n)
if lora_b == 0:
    sys.exit("FAIL: every lora_B is zero: the adapter was not trained or not loaded")
tok = AutoTokenizer.from_pretrained(adapter_dir)
ids = torch.tensor([kiln["prompt_ids"]])
with torch.no_grad():
    out = model.generate(input_ids=ids, max_new_tokens=len(kiln["new_ids"]), do_sample=False,
                         eos_token_id=None, pad_token_id=tok.pad_token_id)
new = out[0, ids.shape[1]:].tolist()
print(f"peft: {tok.decode(new)!r}")
print(f"kiln: {kiln['text']!r}")
if new != kiln["new_ids"]:
    sys.exit(f"FAIL: greedy tokens differ: peft {new} vs kiln {kiln['new_ids']}")
print(f"interop OK: peft loads kiln's LoRA adapter and decodes the same {len(new)} tokens")
