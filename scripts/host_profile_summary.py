#!/usr/bin/env python3
"""Sums a folded-stack host profile (`kiln bench --host-profile DIR` writes DIR/ROW.folded) into
three Markdown tables: the share of samples per crate where the time was spent (the innermost
frame), per function including what it calls, and per function itself.

    python3 scripts/host_profile_summary.py DIR/ROW.folded [TOP]
"""
import collections
import re
import sys

HASH = re.compile(r"::h[0-9a-f]{16}$")


def clean(name):
    """A frame's function without its symbol hash and with long generic arguments shortened."""
    name = HASH.sub("", name)
    # `<impl Trait for Type<...>>::f` keeps its outer shape; very long names are cut.
    return name if len(name) <= 160 else name[:157] + "..."


def crate_of(name):
    """The crate a frame belongs to: `<burn_autodiff::X as Y>::f` and `burn_autodiff::f` are
    burn_autodiff's; symbols with no path (libc, the kernel's vDSO, the CUDA driver) are 'native'."""
    m = re.match(r"^<*(?:&(?:mut )?)?([A-Za-z_][A-Za-z0-9_]*)::", name)
    return m.group(1) if m else "native (" + name.split("@")[0][:40] + ")"


def main():
    path = sys.argv[1]
    top = int(sys.argv[2]) if len(sys.argv) > 2 else 30
    total = 0
    threads = collections.Counter()
    by_crate = collections.Counter()
    inclusive = collections.Counter()
    own = collections.Counter()
    for line in open(path, encoding="utf-8", errors="replace"):
        line = line.rstrip("\n")
        if not line:
            continue
        stack, _, count = line.rpartition(" ")
        n = int(count)
        thread, *frames = stack.split(";")
        frames = [clean(f) for f in frames]
        total += n
        threads[thread] += n
        if frames:
            own[frames[-1]] += n
            by_crate[crate_of(frames[-1])] += n
        for f in set(frames):
            inclusive[f] += n
    if total == 0:
        print(f"{path}: no samples")
        return

    def table(title, counter, k):
        print(f"\n**{title}** ({total} samples)\n")
        print("| share | samples | where |\n|---|---|---|")
        for name, n in counter.most_common(k):
            print(f"| {100 * n / total:.1f} % | {n} | `{name}` |")

    table("Threads", threads, 8)
    table("Crate of the innermost frame", by_crate, 15)
    table("Functions, with what they call", inclusive, top)
    table("Functions themselves", own, top)


if __name__ == "__main__":
    main()
