"""What the host spent on XLA's CUDA graphs (command buffers), from XLA's own log of them.

Run a benchmark with `TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=command_buffer_thunk=3` and its stderr to LOG; then

  python3 benchmarks/command_buffer_log.py LOG [--out rows.jsonl]

prints one row per command buffer, told apart by its command count (`num_commands`): how often the host recorded it
from scratch ("Initialized ... in N us": a program's first calls, and again after XLA dropped its graphs, which it
does to every other program whenever it builds one), how often it updated it before a call ("Updated ... in N us":
an allocation the graph holds moved, `updated_allocs` of them) and the times each took. A steady `generate()` whose
outputs keep their addresses (engine.OUTPUT_WORKSPACE) should show no updates of its loop's buffer.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from collections import Counter, defaultdict

_UPDATE = re.compile(r"Update command buffer on device #\d+ .*num_commands=(\d+); updated_allocs=(\d+)")
_UPDATED = re.compile(r"Updated command buffer in (\d+) \S+; num_commands=(\d+)")
_INITIALIZED = re.compile(r"Initialized command buffer on device #\d+ in (\d+) \S+; num_commands=(\d+)")
_WARMUP = "Executing warm up iteration of command buffer thunk"
_EVICTED = re.compile(r"Evicted (\d+) command buffer")


def summarize(lines) -> dict:
    """{"buffers": [row per num_commands, most commands first], "warmups": n, "evicted": n} from the log's lines."""
    buffers = defaultdict(lambda: {"updates_us": [], "updated_allocs": Counter(), "initialized_us": []})
    warmups = evicted = 0
    for line in lines:
        if m := _UPDATE.search(line):
            buffers[int(m[1])]["updated_allocs"][int(m[2])] += 1
        elif m := _UPDATED.search(line):
            buffers[int(m[2])]["updates_us"].append(int(m[1]))
        elif m := _INITIALIZED.search(line):
            buffers[int(m[2])]["initialized_us"].append(int(m[1]))
        elif _WARMUP in line:
            warmups += 1
        elif m := _EVICTED.search(line):
            evicted += int(m[1])
    rows = []
    for n, b in sorted(buffers.items(), reverse=True):
        up, init = b["updates_us"], b["initialized_us"]
        rows.append({"num_commands": n, "updates": len(up),
                     "update_us_median": statistics.median(up) if up else None, "update_us_max": max(up, default=None),
                     "updated_allocs": dict(sorted(b["updated_allocs"].items())),
                     "initializations": len(init),
                     "initialize_us_median": statistics.median(init) if init else None})
    return {"buffers": rows, "warmups": warmups, "evicted": evicted}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("log")
    ap.add_argument("--out", help="also write the rows as JSON lines here")
    args = ap.parse_args()
    with open(args.log, errors="replace") as f:
        s = summarize(f)
    rows = [{"what": "command_buffer", **r} for r in s["buffers"]]
    rows.append({"what": "command_buffer_totals", "warmups": s["warmups"], "evicted": s["evicted"]})
    text = "\n".join(json.dumps(r) for r in rows)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
