#!/usr/bin/env python3
"""Loads a classifier's LoRA adapter that kiln trained (`kiln train --model BASE --use-peft`) onto
its base with peft's `PeftModel.from_pretrained`, the head built from the labels of the adapter
folder's config.json, and evaluates it on the rows kiln evaluated on: the loss and accuracy must
be kiln's (`eval_results.json`).

With MERGED_DIR (`kiln merge --model BASE --adapter ADAPTER --out MERGED`): every weight of
kiln's merged folder equals peft's `merge_and_unload()`, and transformers loads the folder alone
(head, labels) to the same loss.

  python3 check_peft_classifier.py BASE_DIR ADAPTER_DIR EVAL.csv MAX_LENGTH [MERGED_DIR]
"""
import csv
import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torch
from peft import PeftModel
from transformers import AutoModelForSequenceClassification, AutoTokenizer

base_dir, adapter_dir, eval_csv, max_length = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
merged_dir = sys.argv[5] if len(sys.argv) > 5 else None
config = json.load(open(os.path.join(adapter_dir, "config.json")))
id2label = {int(k): v for k, v in config["id2label"].items()}
label2id = {v: k for k, v in id2label.items()}
base = AutoModelForSequenceClassification.from_pretrained(
    base_dir, num_labels=len(id2label), id2label=id2label, label2id=label2id, dtype=torch.float32)
model = PeftModel.from_pretrained(base, adapter_dir).eval()
lora_b = sum(p.abs().sum().item() for n, p in model.named_parameters() if "lora_B" in n)
if lora_b == 0:
    sys.exit("FAIL: every lora_B is zero: the adapter was not trained or not loaded")
tok = AutoTokenizer.from_pretrained(adapter_dir)
with open(eval_csv, encoding="latin-1", newline="") as f:
    rows = list(csv.DictReader(f))
texts = [r["text"] for r in rows]
labels = torch.tensor([label2id[r["sentiment"]] for r in rows])
enc = tok(texts, truncation=True, max_length=max_length, padding=True, return_tensors="pt")
with torch.no_grad():
    logits = model(**enc).logits
loss = torch.nn.functional.cross_entropy(logits, labels).item()
accuracy = (logits.argmax(-1) == labels).float().mean().item()
kiln = json.load(open(os.path.join(adapter_dir, "eval_results.json")))
print(f"peft: eval_loss {loss:.6f} eval_accuracy {accuracy:.4f}")
print(f"kiln: eval_loss {kiln['eval_loss']:.6f} eval_accuracy {kiln['eval_accuracy']:.4f}")
if abs(loss - kiln["eval_loss"]) > 1e-4 * max(1.0, abs(loss)):
    sys.exit("FAIL: peft's eval loss on kiln's adapter is not kiln's")
if abs(accuracy - kiln["eval_accuracy"]) > 0.5 / len(rows):  # one row decides a difference
    sys.exit("FAIL: peft's accuracy on kiln's adapter is not kiln's")
print(f"interop OK: peft loads kiln's classifier adapter and scores {len(rows)} rows as kiln does")

if merged_dir:
    from merge_check import check_merged_weights

    check_merged_weights(model, merged_dir)
    alone = AutoModelForSequenceClassification.from_pretrained(merged_dir, dtype=torch.float32).eval()
    if alone.config.id2label != id2label:
        sys.exit(f"FAIL: the merged folder's labels {alone.config.id2label} are not {id2label}")
    with torch.no_grad():
        merged_loss = torch.nn.functional.cross_entropy(alone(**enc).logits, labels).item()
    print(f"merged folder alone in transformers: eval_loss {merged_loss:.6f}")
    if abs(merged_loss - loss) > 1e-4 * max(1.0, abs(loss)):
        sys.exit("FAIL: transformers scores kiln's merged folder otherwise than the adapter")
    print("interop OK: kiln's merged classifier is peft's merge_and_unload()")
