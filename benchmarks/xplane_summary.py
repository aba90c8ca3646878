"""Where a traced call's device time goes: GPU kernel events of a jax.profiler trace, read with
jax.profiler.ProfileData (no TensorBoard needed).

  with jax.profiler.trace(d): f(...).block_until_ready()
  s = summarize(d, steps=16)   # per step: span, busy (union of kernel intervals), kernels; top kernels by time
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os

from jax.profiler import ProfileData


def kernel_events(trace_dir: str, plane_prefix: str = "/device:GPU", with_stream: bool = False) -> list[tuple]:
    """(kernel name, hlo op, start ns, duration ns[, stream line name]) of every event on a device plane's stream
    lines."""
    paths = sorted(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True))
    if not paths:
        raise FileNotFoundError(f"no *.xplane.pb under {trace_dir}")
    events = []
    for plane in ProfileData.from_file(paths[-1]).planes:
        if not plane.name.startswith(plane_prefix):
            continue
        for line in plane.lines:
            if not line.name.startswith("Stream"):
                continue
            for e in line.events:
                op = dict(e.stats).get("hlo_op", "")
                events.append((e.name, str(op), int(e.start_ns), int(e.duration_ns))
                              + ((line.name,) if with_stream else ()))
    return events


def host_during_gaps(trace_dir: str, min_gap_us: float = 200, top: int = 8,
                     plane_prefix: str = "/device:GPU") -> list[dict]:
    """The device's idle gaps of at least `min_gap_us` (the first one: from the trace's first host event to the
    first kernel), each with the host events that overlap it (TraceMe names of XLA's runtime: thunk execution,
    command-buffer record / update / launch, transfers), grouped by thread and name with their overlapping ms, the
    `top` largest. With one program call per trace: the host costs the GPU waits for (issue #4: a `generate()`
    trace's 2.6-2.7 ms idle before its first kernel and 2.1-2.2 ms before the loop's first step)."""
    ev = sorted(kernel_events(trace_dir, plane_prefix), key=lambda e: e[2])
    if not ev:  # no device plane (a CPU run)
        return []
    paths = sorted(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True))
    host = [(line.name[:40], e.name[:80], int(e.start_ns), int(e.start_ns) + int(e.duration_ns))
            for plane in ProfileData.from_file(paths[-1]).planes if plane.name.startswith("/host")
            for line in plane.lines for e in line.events]
    first = ev[0][2]
    gaps = ([(min(h[2] for h in host), first)] if host else []) + [(a, b) for a, b, _, _ in _idle_gaps(ev)]
    rows = []
    for g0, g1 in gaps:
        if g1 - g0 < min_gap_us * 1e3:
            continue
        by = collections.defaultdict(lambda: [0, 0])
        for thread, name, s, e in host:
            if s < g1 and e > g0:
                by[(thread, name)][0] += 1
                by[(thread, name)][1] += min(e, g1) - max(s, g0)
        rows.append({"gap_start_ms": (g0 - first) / 1e6, "gap_ms": (g1 - g0) / 1e6,
                     "host": [{"thread": t, "event": n, "count": c, "ms": ns / 1e6}
                              for (t, n), (c, ns) in sorted(by.items(), key=lambda kv: -kv[1][1])[:top]]})
    return rows


def write_timeline(trace_dir: str, path: str | os.PathLike, plane_prefix: str = "/device:GPU") -> None:
    """Every kernel event of the trace as gzipped JSON lines {kernel, op, stream, start_us (from the first),
    us}, in start order: to read a step's critical path and its idle gaps offline."""
    ev = sorted(kernel_events(trace_dir, plane_prefix, with_stream=True), key=lambda e: e[2])
    with gzip.open(path, "wt") as f:
        for name, op, s, d, stream in ev:
            f.write(json.dumps({"kernel": name[:80], "op": op[:60], "stream": stream,
                                "start_us": round((s - ev[0][2]) / 1e3, 3), "us": round(d / 1e3, 3)}) + "\n")


def summarize(trace_dir: str, steps: int, top: int = 25, plane_prefix: str = "/device:GPU",
              hlo_text: str | None = None) -> dict:
    """summarize_events of the trace; with the traced program's compiled HLO text (`compiled.as_text()`), each top
    kernel also says what it is: its fusion's shapes, fused ops and source line (hlo_describe.describe)."""
    ev = kernel_events(trace_dir, plane_prefix)
    if not ev:  # say what the trace holds instead
        path = sorted(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True))[-1]
        return {"kernels": 0, "planes": {p.name: [ln.name for ln in p.lines][:8]
                                         for p in ProfileData.from_file(path).planes}}
    s = summarize_events(ev, steps, top)
    if hlo_text is not None:
        from hlo_describe import describe

        found = describe(hlo_text, [row["kernel"] for row in s["top"]])
        for row in s["top"]:
            row.update(found.get(row["kernel"], {}))
    return s


def summarize_events(ev: list[tuple[str, str, int, int]], steps: int, top: int = 25) -> dict:
    """Per step: span (first start to last end), busy time (union of the kernels' intervals: overlapping streams
    count once), kernel count; the idle gaps (no kernel running) grouped by the kernel that ended last and the one
    that starts after, the 15 largest groups; the `top` (kernel, hlo op) pairs by total time, each with its call
    durations' p10 / p50 / p90 and its time alone on the GPU (`alone_us_per_step`: no other kernel running; with
    concurrent command-buffer branches, the rest of its time overlapped others, e.g. a compute-bound GEMM under a
    bandwidth-bound one). Kernels replayed inside XLA's command buffers (CUDA graphs) carry the buffer's name, not
    their op's: they count by kernel name alone, so a kernel that several loops launch (one command buffer each)
    adds up to one row."""
    ev = sorted(ev, key=lambda e: e[2])
    gaps = collections.defaultdict(lambda: [0, 0])
    for g0, g1, last, name in _idle_gaps(ev):
        gaps[(last[:60], name[:60])][0] += 1
        gaps[(last[:60], name[:60])][1] += g1 - g0
    span = max(s + d for _, _, s, d in ev) - ev[0][2]
    busy = span - sum(t for _, t in gaps.values())  # the union of the kernels' intervals
    key = [(name[:80], "command_buffer" if op.startswith("command_buffer") else op[:60]) for name, op, _, _ in ev]
    by = collections.defaultdict(lambda: [0, 0])
    durations = collections.defaultdict(list)
    for k, (_, _, _, d) in zip(key, ev):
        by[k][0] += 1
        by[k][1] += d
        durations[k].append(d)
    alone = _alone_time(ev, key)
    rows = sorted(by.items(), key=lambda kv: -kv[1][1])[:top]
    return {"kernels_per_step": len(ev) / steps, "span_ms_per_step": span / steps / 1e6,
            "busy_ms_per_step": busy / steps / 1e6, "idle_pct": 100 * (1 - busy / span),
            "gaps": [{"after": a, "before": b, "per_step": c / steps, "us_per_step": t / steps / 1e3}
                     for (a, b), (c, t) in sorted(gaps.items(), key=lambda kv: -kv[1][1])[:15]],
            "top": [{"kernel": n, "hlo_op": op, "calls_per_step": c / steps, "us_per_call": t / c / 1e3,
                     "us_per_step": t / steps / 1e3, "alone_us_per_step": alone[(n, op)] / steps / 1e3,
                     **_percentiles(durations[(n, op)])}
                    for (n, op), (c, t) in rows]}


def _idle_gaps(ev: list[tuple]) -> list[tuple[int, int, str, str]]:
    """The times no kernel runs between the first and the last of `ev` (kernel events sorted by start): (start ns,
    end ns, the kernel that ended last, the one that starts after) per gap."""
    gaps, end, last = [], None, None
    for name, _, s, d in ev:
        if end is not None and s > end:
            gaps.append((end, s, last, name))
        if end is None or s >= end or s + d > end:
            end, last = s + d, name
    return gaps


def _percentiles(durations: list[int]) -> dict:
    """p10 / p50 / p90 of one kernel's call durations in us: a kernel name that several GEMM shapes share (cuBLAS
    picks the same tiles for o and down) shows up as a spread."""
    d = sorted(durations)
    at = lambda q: d[min(len(d) - 1, int(q * len(d)))] / 1e3  # noqa: E731
    return {"us_p10": at(0.1), "us_p50": at(0.5), "us_p90": at(0.9)}


def _alone_time(ev: list[tuple[str, str, int, int]], key: list) -> dict:
    """Per key, the ns during which one of its events ran and no other event did (a sweep over interval ends)."""
    points = sorted([(s + d, 0, i) for i, (_, _, s, d) in enumerate(ev)] + [(s, 1, i) for i, (_, _, s, _) in
                                                                         enumerate(ev)])  # ends before starts
    alone, active, last = collections.defaultdict(int), set(), None
    for t, starts, i in points:
        if len(active) == 1 and last is not None:
            alone[key[next(iter(active))]] += t - last
        (active.add if starts else active.discard)(i)
        last = t
    return alone
