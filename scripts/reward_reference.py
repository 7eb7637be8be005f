"""TRL's RewardTrainer on the same preference pairs and settings as a `kiln train --task
reward-modeling` run, for BENCHMARKS.md: SmolLM2 read as a one-label sequence classifier (a new
score head, as kiln starts it), optionally with LoRA (peft's SEQ_CLS: the score head trained whole
beside the adapter), and the median wall time of a step, measured by a callback, beside the eval
metrics at the end.

    ~/.cache/kiln-venv/bin/python scripts/reward_reference.py MODEL_DIR TRAIN EVAL OUT_DIR EPOCHS LR TARGETS [SEED]

TARGETS: `none` (the whole model trains), `all-linear` or comma-separated module names. LoRA r 16,
alpha 32, no dropout; batch 8 pairs, max_length 256, constant rate, no weight decay, seed SEED (42), no
gradient checkpointing (kiln's default), fp32.
"""
import json
import statistics
import sys
import time

import torch
from datasets import Dataset
from peft import LoraConfig
from transformers import TrainerCallback
from trl import RewardConfig, RewardTrainer

model_dir, train_file, eval_file, out_dir, epochs, lr, targets = sys.argv[1:8]
seed = int(sys.argv[8]) if len(sys.argv) > 8 else 42
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


config = RewardConfig(
    output_dir=out_dir, per_device_train_batch_size=8, per_device_eval_batch_size=8,
    num_train_epochs=float(epochs), learning_rate=float(lr), lr_scheduler_type="constant",
    warmup_steps=0, weight_decay=0.0, max_length=256, logging_steps=5, report_to=[], seed=seed,
    use_cpu=True, bf16=False, save_strategy="no", eval_strategy="no", gradient_checkpointing=False,
    dataloader_num_workers=0, disable_tqdm=True,
    model_init_kwargs={"dtype": torch.float32, "attn_implementation": "sdpa"})
lora = None
if targets != "none":
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, task_type="SEQ_CLS",
                      target_modules=targets if targets == "all-linear" else targets.split(","))
times = StepTimes()
trainer = RewardTrainer(model=model_dir, args=config, train_dataset=rows(train_file),
                        eval_dataset=rows(eval_file), peft_config=lora, callbacks=[times])
start = time.perf_counter()
trainer.train()
train_seconds = time.perf_counter() - start
metrics = trainer.evaluate()
print(json.dumps({"median_step_s": statistics.median(times.times[2:]), "train_seconds": train_seconds,
                  "steps": len(times.times), **metrics}, indent=1))
