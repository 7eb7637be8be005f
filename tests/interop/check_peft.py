#!/usr/bin/env python3
"""Loads a LoRA adapter that kiln trained (`kiln train --use-peft`) onto its base model with peft's
`PeftModel.from_pretrained`, and checks it against `kiln generate --adapter DIR --json`: the same
greedy tokens from the same prompt ids. With MERGED_DIR (`kiln merge`'s folder of the same base
and adapter), also that kiln's merged weights are peft's `merge_and_unload()` and that the merged
folder alone gives the adapter's logits, each within 1e-5.

  python3 check_peft.py BASE_DIR ADAPTER_DIR GENERATION.json [MERGED_DIR]
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

if len(sys.argv) > 4:
    from merge_check import check_merged_weights

    merged_dir = sys.argv[4]
    alone = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        adapted_logits = model(input_ids=out).logits
        merged_logits = alone(input_ids=out).logits
    scale = adapted_logits.abs().max().item()
    diff = (adapted_logits - merged_logits).abs().max().item()
    print(f"merged folder alone: max |logits - peft's adapter logits| = {diff:.2e} (logits up to {scale:.1f})")
    if diff > 1e-5 * max(1.0, scale):
        sys.exit("FAIL: kiln's merged folder does not give the adapter's logits")
    check_merged_weights(model, merged_dir)
    print("interop OK: kiln's merge is peft's merge_and_unload(), and gives the adapter's logits")
