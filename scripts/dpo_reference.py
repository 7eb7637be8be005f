"""TRL's DPOTrainer on the same preference pairs and settings as a `kiln train --task dpo` run, for
BENCHMARKS.md: LoRA on SmolLM2 (peft), the reference log-probs precomputed (what kiln does), and
the median wall time of a step, measured by a callback, beside the eval metrics.

    ~/.cache/kiln-venv/bin/python scripts/dpo_reference.py MODEL_DIR TRAIN EVAL OUT_DIR STEPS LR TARGETS

TARGETS: `all-linear` or comma-separated module names (`q_proj,v_proj`). LoRA r 16, alpha 32,
no dropout; batch 8, β 0.1, max_length 256, constant rate, no weight decay, seed 42.
"""
import json
import statistics
import sys
import time

import torch
from datasets import Dataset
from peft import LoraConfig
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import DPOConfig, DPOTrainer

model_dir, train_file, eval_file, out_dir, steps, lr, targets = sys.argv[1:8]
torch.set_num_threads(2)


def rows(path):
    with open(path, encoding="utf-8") as f:
        return Dataset.from_list([json.loads(line) for line in f])


class StepTimes(TrainerCallback):
    def __init__(self):
        self.times, self.start = [], None

    def on_step_begin(self, args, state, control, **kw):
        self.start = time.perf_counter()

    def on_step_end(self, args, state, control, **kw):
        self.times.append(time.perf_counter() - self.start)


tok = AutoTokenizer.from_pretrained(model_dir)
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
config = DPOConfig(
    output_dir=out_dir, per_device_train_batch_size=8, per_device_eval_batch_size=8,
    max_steps=int(steps), learning_rate=float(lr), lr_scheduler_type="constant", warmup_steps=0,
    weight_decay=0.0, beta=0.1, max_length=256, logging_steps=5, report_to=[], seed=42,
    use_cpu=True, save_strategy="no", eval_strategy="no", gradient_checkpointing=False,
    precompute_ref_log_probs=True, dataloader_num_workers=0, disable_tqdm=True)
lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=targets if targets == "all-linear" else targets.split(","),
                  task_type="CAUSAL_LM")
times = StepTimes()
trainer = DPOTrainer(model=model, args=config, train_dataset=rows(train_file),
                     eval_dataset=rows(eval_file), processing_class=tok, peft_config=lora,
                     callbacks=[times])
start = time.perf_counter()
trainer.train()
train_seconds = time.perf_counter() - start
metrics = trainer.evaluate()
print(json.dumps({"median_step_s": statistics.median(times.times[2:]), "train_seconds": train_seconds,
                  "steps": len(times.times), **metrics}, indent=1))
