"""Reads a TensorBoard log folder the way TensorBoard does and prints what it found, as JSON.

Usage:
    python tests/interop/read_tensorboard.py LOG_DIR

LOG_DIR is a folder of event files: a run's logging_dir (kiln's --logging-dir; by default under
<output_dir>/runs/, as transformers' Trainer names it). It is loaded with tensorboard's
EventAccumulator, keeping every event (size_guidance 0), and one JSON object goes to stdout:

    {"scalars": {tag: [[step, value], ...]},      # e.g. "train/loss", "eval/accuracy"
     "texts": {tag: [[step, text], ...]},         # e.g. "args/text_summary"
     "file_version": "brain.Event:2",
     "records": N,                                # TFRecords read, CRCs checked, in all files
     "files": [name, ...]}

"records" counts every record of every event file in LOG_DIR (the file_version event included);
a record whose checksum fails stops the count there, as it stops TensorBoard. kiln's integration
test (crates/kiln/tests/tensorboard.rs) runs this on a file kiln wrote.
"""

import json
import os
import sys

from tensorboard.backend.event_processing import event_accumulator
from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
from tensorboard.compat.proto import event_pb2
from tensorboard.util import tensor_util


def read(log_dir):
    guidance = {k: 0 for k in event_accumulator.DEFAULT_SIZE_GUIDANCE}
    acc = event_accumulator.EventAccumulator(log_dir, size_guidance=guidance)
    acc.Reload()
    tags = acc.Tags()

    scalars = {
        tag: [[e.step, e.value] for e in acc.Scalars(tag)] for tag in tags["scalars"]
    }
    texts = {}
    for tag in tags["tensors"]:
        meta = acc.SummaryMetadata(tag)
        if meta.plugin_data.plugin_name != "text":
            continue
        rows = []
        for e in acc.Tensors(tag):
            arr = tensor_util.make_ndarray(e.tensor_proto)
            for s in arr.reshape(-1).tolist():
                rows.append([e.step, s.decode("utf-8") if isinstance(s, bytes) else str(s)])
        texts[tag] = rows

    files = sorted(f for f in os.listdir(log_dir) if "tfevents" in f)
    records = 0
    file_version = None
    for name in files:
        for raw in RawEventFileLoader(os.path.join(log_dir, name)).Load():
            records += 1
            event = event_pb2.Event.FromString(raw)
            if file_version is None and event.HasField("file_version"):
                file_version = event.file_version

    return {
        "scalars": scalars,
        "texts": texts,
        "file_version": file_version,
        "records": records,
        "files": files,
    }


def main():
    if len(sys.argv) != 2 or sys.argv[1] in ("-h", "--help"):
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    log_dir = sys.argv[1]
    if not os.path.isdir(log_dir):
        sys.exit(f"{log_dir}: not a folder")
    json.dump(read(log_dir), sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
