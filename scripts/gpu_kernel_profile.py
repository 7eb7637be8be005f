#!/usr/bin/env python3
"""Sums CubeCL's per-kernel GPU times (CUBECL_DEBUG_OPTION=profile; one `| duration | name` line per
launch in the CUBECL_DEBUG_LOG file) by kernel name, per step, largest first.

    python3 scripts/gpu_kernel_profile.py LOG STEPS [ROW_MS]

STEPS is how many steps the log covers (warm-up included); ROW_MS, the row's ms per step, makes the
remainder (cuBLAS calls, which CubeCL does not see, and idle time) a line of its own.

A fixed-shape row launches the same kernels in the same order every step after the first (which
also makes the optimizer's moments), so its log ends in STEPS − 1 copies of one sequence of kernel
names: then the last copy alone is summed, without the model's set-up and the first steps'
compilation (which put BERT-base's weight initialisation at the top of the list). A log that does
not (dynamic shapes) is averaged over STEPS.
"""
import collections
import re
import sys

UNITS = {"ns": 1e-6, "µs": 1e-3, "us": 1e-3, "ms": 1.0, "s": 1e3}


def parse(text):
    m = re.match(r"\s*([0-9.]+)\s*(ns|µs|us|ms|s)\s*$", text)
    return float(m.group(1)) * UNITS[m.group(2)] if m else None


def last_step(launches, copies):
    """The launches of one step: the longest p for which the log ends in `copies` copies of its
    last p kernel names (a longer p would reach into the set-up), or None."""
    names = [n for n, _ in launches]
    end = len(names)
    for p in range(end // copies, 0, -1):
        # Launch by launch from the end, so a wrong p is usually left at its first name.
        if all(names[end - 1 - i] == names[end - 1 - i - k * p]
               for i in range(p) for k in range(1, copies)):
            return p
    return None


def main():
    log, steps = sys.argv[1], int(sys.argv[2])
    row_ms = float(sys.argv[3]) if len(sys.argv) > 3 else None
    launches = []
    for line in open(log, encoding="utf-8", errors="replace"):
        parts = line.split("|")
        if len(parts) < 3:
            continue
        ms = parse(parts[1])
        if ms is None:
            continue
        name = "|".join(parts[2:]).strip()
        launches.append((re.sub(r"\s+", " ", name)[:110], ms))
    step = last_step(launches, steps - 1) if steps > 2 else None
    if step:
        print(f"The last of {steps} steps ({steps - 1} launching the same kernels):")
        launches, steps = launches[-step:], 1
    total, calls = collections.Counter(), collections.Counter()
    for name, ms in launches:
        total[name] += ms
        calls[name] += 1
    all_ms = sum(total.values()) / steps
    print(f"CubeCL kernels: {sum(calls.values()) / steps:.0f} launches, {all_ms:.2f} ms per step")
    print("| kernel | launches/step | ms/step | share of CubeCL time |\n|---|---|---|---|")
    for name, ms in total.most_common(40):
        print(f"| {name} | {calls[name] / steps:.0f} | {ms / steps:.2f} | {100 * ms / steps / all_ms:.1f}% |")
    if row_ms:
        print(f"\nrow {row_ms:.1f} ms/step: CubeCL kernels {all_ms:.1f}, the rest (cuBLAS, idle) "
              f"{row_ms - all_ms:.1f}")


if __name__ == "__main__":
    main()
