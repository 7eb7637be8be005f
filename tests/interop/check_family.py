#!/usr/bin/env python3
"""Loads a classifier folder kiln fine-tuned from one of the other encoder families (RoBERTa,
XLM-RoBERTa, DistilBERT, ModernBERT) with transformers' Auto classes and checks it against
`kiln predict`: the same logits (rel. err < 1e-4) and labels for every text.

  python3 check_family.py MODEL_DIR PREDICTIONS.jsonl MAX_LENGTH
"""
import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

model_dir, preds_path, max_length = sys.argv[1], sys.argv[2], int(sys.argv[3])
rows = [json.loads(l) for l in open(preds_path, encoding="utf-8") if l.strip()]
model = AutoModelForSequenceClassification.from_pretrained(model_dir, attn_implementation="eager").eval()
tok = AutoTokenizer.from_pretrained(model_dir)
worst = 0.0
for r in rows:
    enc = tok([r["text"]], truncation=True, max_length=max_length, return_tensors="pt")
    with torch.no_grad():
        logits = model(**enc).logits[0]
    kiln = torch.tensor(r["logits"])
    err = float((logits - kiln).norm() / logits.norm().clamp_min(1e-30))
    worst = max(worst, err)
    label = model.config.id2label[int(logits.argmax())]
    assert label == r["label"], (r["text"], label, r["label"])
assert worst < 1e-4, f"worst logits rel. err {worst:.2e}"
print(f"{model.config.model_type}: transformers reproduces kiln's predictions on {len(rows)} texts "
      f"(worst logits rel. err {worst:.1e})")
