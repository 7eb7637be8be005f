#!/usr/bin/env python3
"""Loads a model folder saved by kiln with transformers and checks it against `kiln predict`.

  python3 check_transformers.py MODEL_DIR PREDICTIONS.jsonl

PREDICTIONS.jsonl is `kiln predict --model MODEL_DIR --input ... --output PREDICTIONS.jsonl`; each line
has the text, kiln's logits and label. transformers must load the folder as it is (config.json,
model.safetensors, tokenizer.json) and give the same logits (rel. err < 1e-4) and labels.
Then the folder as a user hands it to transformers whole:
  - AutoTokenizer reads model_max_length from tokenizer_config.json (not 1e30), and
    pipeline("text-classification", MODEL_DIR) classifies a 2000-token text (truncating it);
  - HfArgumentParser and TrainingArguments(**json) read training_args.json;
  - config.json carries a transformers_version stamp and kiln_version.
"""
import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torch
from transformers import (
    AutoModelForSequenceClassification,
    AutoTokenizer,
    HfArgumentParser,
    PreTrainedTokenizerFast,
    TrainingArguments,
    pipeline,
)

model_dir, preds_path = sys.argv[1], sys.argv[2]
rows = [json.loads(l) for l in open(preds_path, encoding="utf-8") if l.strip()]
model = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
# tokenizer.json alone, no padding/truncation baked in: the same ids kiln predicted from.
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

tok = AutoTokenizer.from_pretrained(model_dir)
assert tok.model_max_length == model.config.max_position_embeddings, tok.model_max_length
clf = pipeline("text-classification", model=model_dir, device="cpu")
long_text = " ".join(["the car drove itself home"] * 400)
n = len(tok(long_text)["input_ids"])
assert n > 2000, n
out = clf(long_text, truncation=True)
assert out[0]["label"] in model.config.id2label.values(), out
parsed = HfArgumentParser(TrainingArguments).parse_json_file(
    os.path.join(model_dir, "training_args.json"), allow_extra_keys=False
)[0]
again = TrainingArguments(**json.load(open(os.path.join(model_dir, "training_args.json"))))
assert parsed.learning_rate == again.learning_rate
config = json.load(open(os.path.join(model_dir, "config.json")))
assert config.get("kiln_version") and config.get("transformers_version"), config
print(f"interop ok: AutoTokenizer model_max_length {tok.model_max_length}; pipeline classified "
      f"a {n}-token text as {out[0]['label']}; training_args.json parsed (lr {parsed.learning_rate})")
