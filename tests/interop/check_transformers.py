#!/usr/bin/env python3
"""Loads a model folder saved by kiln with transformers and checks it against `kiln predict`.

  python3 check_transformers.py MODEL_DIR PREDICTIONS.jsonl

PREDICTIONS.jsonl is `kiln predict --model MODEL_DIR --input ... --output PREDICTIONS.jsonl`; each line
has the text, kiln's logits and label. transformers must load the folder as it is (config.json,
model.safetensors, tokenizer.json) and give the same logits (rel. err < 1e-4) and labels.
"""
import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torch
from transformers import AutoModelForSequenceClassification, PreTrainedTokenizerFast

model_dir, preds_path = sys.argv[1], sys.argv[2]
rows = [json.loads(l) for l in open(preds_path, encoding="utf-8") if l.strip()]
model = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
# tokenizer.json alone (kiln saves no tokenizer_config.json); no padding/truncation baked in.
tok = PreTrainedTokenizerFast(tokenizer_file=os.path.join(model_dir, "tokenizer.json"))
tok.backend_tokenizer.no_padding()
tok.pad_token = "[PAD]"
worst = 0.0
for r in rows:
    enc = tok([r["text"]], truncation=True, max_length=128, return_tensors="pt")
    with torch.no_grad():
        logits = model(**enc).logits[0]
    kiln = torch.tensor(r["logits"])
    err = float((logits - kiln).norm() / logits.norm())
    worst = max(worst, err)
    label = model.config.id2label[int(logits.argmax())]
    assert label == r["label"], f"{r['text']!r}: transformers says {label}, kiln {r['label']}"
assert worst < 1e-4, f"logits differ: worst rel err {worst:.2e}"
print(f"interop ok: transformers loaded {model_dir} as {type(model).__name__}; "
      f"{len(rows)} texts, same labels, worst logits rel err {worst:.2e}")
