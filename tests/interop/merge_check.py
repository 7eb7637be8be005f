"""kiln's merged folder against peft's `merge_and_unload()`, shared by the peft checks."""
import os
import sys

from safetensors.torch import load_file


def check_merged_weights(peft_model, merged_dir):
    """Exits with FAIL unless every tensor of peft's merge of `peft_model` is in kiln's merged
    folder and within 1e-5 of it (a tied head, saved once as the embedding, aside). Merges
    `peft_model` in place: take its adapter's outputs first."""
    kiln_merged = load_file(os.path.join(merged_dir, "model.safetensors"))
    peft_merged = peft_model.merge_and_unload().state_dict()
    worst = 0.0
    for name, w in peft_merged.items():
        if name == "lm_head.weight" and name not in kiln_merged:
            continue  # a tied head is the embedding, saved once
        if name not in kiln_merged:
            sys.exit(f"FAIL: kiln's merged folder lacks {name}")
        worst = max(worst, (kiln_merged[name].float() - w.float()).abs().max().item())
    print(f"merged: {len(peft_merged)} tensors, max |kiln - peft merge_and_unload| = {worst:.2e}")
    if worst > 1e-5:
        sys.exit("FAIL: kiln's merged weights are not peft's merge_and_unload()")
