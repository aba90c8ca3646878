"""The one timing rule of the benchmark scripts: one untimed call (compilation, warm-up), then the median
wall-clock seconds per call of `reps` rounds, each of `calls` calls dispatched before one block_until_ready (calls > 1
keeps the GPU busy across calls, as a model's loop does, and spreads the host's dispatch and sync over them). And the
chip's rates timed that way, logged beside a benchmark's numbers so runs on different machines can be compared."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
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


def chip_rates(calls: int = 20) -> dict:
    """HBM read bandwidth (a sum over 2 GiB: what a forward streaming its weights does), copy bandwidth (read +
    write) and a bf16 GEMM's rate (8192^3), each with `calls` programs per sync. Timed one program per sync the same
    reads come out 15-25% slower on an H200 (benchmarks/hbm_read_probe.py, session 23)."""
    x = jnp.ones((512 * 2**20,), jnp.int32)  # 2 GiB
    read, copy = jax.jit(jnp.sum), jax.jit(lambda x: x + 1)
    a = jax.random.normal(jax.random.key(0), (8192, 8192), jnp.bfloat16)
    gemm = jax.jit(lambda a: a @ a)
    return {"read_tb_s": x.size * 4 / median_seconds(read, x, calls=calls) / 1e12,
            "copy_tb_s": 2 * x.size * 4 / median_seconds(copy, x, calls=calls) / 1e12,
            "gemm_tflop_s": 2 * 8192**3 / median_seconds(gemm, a, calls=calls) / 1e12, "calls_per_sync": calls}
