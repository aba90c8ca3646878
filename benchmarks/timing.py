"""The one timing rule of the benchmark scripts: one untimed call (compilation, warm-up), then the median
wall-clock seconds per call of `reps` rounds, each of `calls` calls dispatched before one block_until_ready (calls > 1
keeps the GPU busy across calls, as a model's loop does, and spreads the host's dispatch and sync over them)."""

from __future__ import annotations

import time

import jax
import numpy as np


def median_seconds(fn, *args, reps: int = 10, calls: int = 1) -> float:
    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(calls):  # only the last result is kept: the device runs them in order
            out = fn(*args)
        jax.block_until_ready(out)
        ts.append((time.perf_counter() - t) / calls)
    return float(np.median(ts))
