#!/usr/bin/env python3
"""Loads a reward model kiln trained (`kiln train --task reward-modeling`) with transformers'
AutoModelForSequenceClassification and checks it against `kiln predict`: each text, tokenized as
kiln tokenizes it (special tokens added, cut to MAX_LENGTH), gets kiln's score (abs. err. < 1e-4
× max(1, |score|)). With BASE and ADAPTER, the same through peft: the LoRA adapter kiln saved,
loaded onto the causal LM it was trained from (read as a one-label sequence classifier, as
PEFT's SEQ_CLS task does), scores as `kiln predict` scores the folder `kiln merge` wrote.

  python3 check_reward.py MODEL_DIR PREDICTIONS.jsonl MAX_LENGTH [BASE ADAPTER]
"""
import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

model_dir, preds_path, max_length = sys.argv[1], sys.argv[2], int(sys.argv[3])
rows = [json.loads(l) for l in open(preds_path, encoding="utf-8") if l.strip()]
tok = AutoTokenizer.from_pretrained(model_dir)
if len(sys.argv) > 5:
    from peft import PeftModel

    base = AutoModelForSequenceClassification.from_pretrained(
        sys.argv[4], num_labels=1, attn_implementation="eager"
    )
    model = PeftModel.from_pretrained(base, sys.argv[5]).eval()
    what = "peft + kiln's adapter"
else:
    model = AutoModelForSequenceClassification.from_pretrained(
        model_dir, attn_implementation="eager"
    ).eval()
    what = "transformers"
inner = model.get_base_model() if hasattr(model, "get_base_model") else model
assert type(inner).__name__.endswith("ForSequenceClassification"), type(inner).__name__
assert model.config.num_labels == 1, model.config.num_labels
worst = 0.0
for r in rows:
    enc = tok([r["text"]], truncation=True, max_length=max_length, return_tensors="pt")
    with torch.no_grad():
        score = float(model(**enc).logits[0, 0])
    err = abs(score - r["score"]) / max(1.0, abs(score))
    worst = max(worst, err)
assert worst < 1e-4, f"worst score err {worst:.2e}"
print(f"reward model: {what} reproduces kiln's scores on {len(rows)} texts (worst err {worst:.1e})")
