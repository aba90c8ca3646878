"""The one timing rule of the benchmark scripts: one untimed call (compilation, warm-up), then the median
wall-clock seconds of `reps` calls, each waited for with block_until_ready."""

from __future__ import annotations

import time

import jax
import numpy as np


def median_seconds(fn, *args, reps: int = 10) -> float:
    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t)
    return float(np.median(ts))
