"""What the host spent on XLA's CUDA graphs (command buffers), from XLA's own log of them.

Run a benchmark with `TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=command_buffer_thunk=3` and its stderr to LOG; then

  python3 benchmarks/command_buffer_log.py LOG [--out rows.jsonl] [--others N]

prints one row per command buffer, told apart by its command count (`num_commands`): how often the host recorded it
from scratch ("Initialized" / "Recorded ... in N us": a program's first calls, and again after XLA dropped its
graphs, which it does to every other program whenever it builds one), how often it updated it before a call
("Updated ... in N us": an allocation the graph holds moved, `updated_allocs` of them) and the times each took. A
steady `generate()` whose outputs keep their addresses (engine.OUTPUT_WORKSPACE) should show no updates of its
loop's buffer. With diffusion_gemma_generate.py --mark-calls, also the host's time from each generate() call's start
to its graphs' submission, which the GPU waits for when it has nothing queued.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time
from collections import Counter, defaultdict

# diffusion_gemma_generate.py --mark-calls writes call_mark_line() to stderr as each generate() call starts
CALL_MARK = "generate() call starts"
_TIME = re.compile(r"^[IWEF]\d{4} (\d\d):(\d\d):(\d\d\.\d+)")  # glog's prefix: I<mmdd> <hh:mm:ss.us>
# Two wordings, both matched. An older command_buffer_thunk.cc: "Update command buffer on device #0 by recoding ...;
# num_commands=M; updated_allocs=K" and "Execute command buffer on device #0; ...". jax 0.11.2's (seen in a device
# log in session 60): "[0] Create/Update command buffer by recoding ...; num_commands=M; updated_allocs=K;
# is_first_record=false; needs_update=true", "[0] Updated command buffer in N us; num_commands=M", "[0] Execute
# command buffer; num_executions=N", first recordings still as "Initialized command buffer on device #0 in N us".
# Its "Recorded command buffer in N us" (a first recording) was read in XLA's source only.
_EXECUTE = re.compile(r"Execute command buffer(?: on device #\d+)?; num_executions")
_UPDATE = re.compile(r"Update command buffer\b.*?num_commands=(\d+); updated_allocs=(\d+)(?:; is_first_record=(\w+))?")
_UPDATED = re.compile(r"(Updated|Recorded) command buffer in (\d+) \S+; num_commands=(\d+)")
_INITIALIZED = re.compile(r"Initialized command buffer on device #\d+ in (\d+) \S+; num_commands=(\d+)")
_WARMUP = "Executing warm up iteration of command buffer thunk"
_EVICTED = re.compile(r"Evicted (\d+) command buffer")


def call_mark_line(now: float) -> str:
    """CALL_MARK at wall-clock time `now` (time.time()) in glog's prefix, as XLA's own lines carry it."""
    return f"I{time.strftime('%m%d %H:%M:%S', time.localtime(now))}.{int(now % 1 * 1e6):06d} {CALL_MARK}"


def _seconds(line: str) -> float | None:
    m = _TIME.match(line)
    return None if m is None else int(m[1]) * 3600 + int(m[2]) * 60 + float(m[3])


def summarize(lines) -> dict:
    """{"buffers": [row per num_commands, most commands first], "warmups": n, "evicted": n, "calls": ...} from the
    log's lines. "calls" (with CALL_MARK lines): per marked generate() call, the host's time from the call's start to
    its last command-buffer submission (the loop's graph is submitted last), median and range in ms."""
    buffers = defaultdict(lambda: {"updates_us": [], "updated_allocs": Counter(), "initialized_us": []})
    warmups = evicted = 0
    to_submit, start, last = [], None, None
    for line in lines:
        if CALL_MARK in line or _EXECUTE.search(line):
            t = _seconds(line)
            if CALL_MARK in line:
                if start is not None and last is not None:
                    to_submit.append(last - start)
                start, last = t, None
            elif start is not None and t is not None:
                last = t
            continue
        if m := _UPDATE.search(line):
            if m[3] not in ("1", "true"):  # a first recording's allocations are all new: not an update's
                buffers[int(m[1])]["updated_allocs"][int(m[2])] += 1
        elif m := _UPDATED.search(line):
            b = buffers[int(m[3])]
            (b["updates_us"] if m[1] == "Updated" else b["initialized_us"]).append(int(m[2]))
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
    if start is not None and last is not None:
        to_submit.append(last - start)
    calls = {"marked": len(to_submit)}
    if to_submit:
        ms = [1e3 * d for d in to_submit]
        calls |= {"to_last_submit_ms_median": statistics.median(ms), "min": min(ms), "max": max(ms)}
    return {"buffers": rows, "warmups": warmups, "evicted": evicted, "calls": calls}


def other_lines(lines, n: int) -> list[str]:
    """The last n lines that are neither the command buffers' nor call marks: where the run's errors show."""
    return [line for line in lines if "command_buffer" not in line and CALL_MARK not in line][-n:] if n else []


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("log")
    ap.add_argument("--out", help="also write the rows as JSON lines here")
    ap.add_argument("--others", type=int, default=0, help="then print the log's last N other lines (errors)")
    args = ap.parse_args()
    with open(args.log, errors="replace") as f:
        lines = f.read().splitlines()
    s = summarize(lines)
    rows = [{"what": "command_buffer", **r} for r in s["buffers"]]
    rows.append({"what": "command_buffer_totals", "warmups": s["warmups"], "evicted": s["evicted"], **s["calls"]})
    text = "\n".join(json.dumps(r) for r in rows)
    print(text)
    if others := other_lines(lines, args.others):
        print("\n".join(others))
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
