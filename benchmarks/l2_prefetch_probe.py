"""Does a projection at decode sizes run faster when its weight is already in L2? The first question of an idea for
the engine (issue #3): read the next GEMM's weight into L2 during the latency-bound kernels before it (attention,
norms), as an independent graph branch, so the GEMM streams from L2 instead of HBM.

For each weight shape (Qwen3-4B's qkv, o, gate_up, down) and row count M, median ms of R repetitions inside one
jitted fori_loop of:
  flush              read a 512 MB buffer (evicts L2)
  flush + gemm       then x @ W (cold: W from HBM)
  flush + read + gemm    then a reduction over W (W into L2), then x @ W
  flush + read       the same without the GEMM
  gemm alone         x @ W repeated (W stays in L2 when it fits)
The GEMM's cold time is (flush + gemm) - flush and its L2 time (flush + read + gemm) - (flush + read); each step
depends on the one before (an optimization barrier), so nothing overlaps. H200 L2: 50 MB.

  python benchmarks/l2_prefetch_probe.py --out l2_probe.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

ap = argparse.ArgumentParser()
ap.add_argument("--out", default="l2_probe.jsonl")
ap.add_argument("--rows", default="32,256", help="M values, comma-separated")
ap.add_argument("--reps", type=int, default=50, help="repetitions inside one timed call")
ap.add_argument("--flush-mb", type=int, default=512)
args = ap.parse_args()
rows = [int(m) for m in args.rows.split(",")]
if any(m < 1 for m in rows) or args.reps < 1 or args.flush_mb < 1:
    ap.error(f"--rows, --reps and --flush-mb must be positive, got {args.rows!r}, {args.reps}, {args.flush_mb}")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from timing import median_seconds  # noqa: E402

SHAPES = {"qkv": (2560, 6144), "o": (4096, 2560), "gate_up": (2560, 19456), "down": (9728, 2560)}  # Qwen3-4B


def log(**kw):
    kw |= {"device": jax.devices()[0].device_kind, "jax": jax.__version__}
    print(json.dumps(kw), flush=True)
    with open(args.out, "a") as f:
        f.write(json.dumps(kw) + "\n")


def program(flush: bool, read: bool, gemm: bool):
    """One jitted loop of args.reps steps; each step's parts run in order (barriers)."""

    def run(x, w, big):
        def step(_, acc):
            zero = (acc * 0).astype(x.dtype)  # makes each read depend on the step (else XLA hoists it out of the loop)
            x1 = x + zero
            if flush:
                s = jnp.max(big + zero)  # the whole buffer read: L2 holds none of w afterwards
                x1, s = jax.lax.optimization_barrier((x1, s))
                acc = acc + s.astype(jnp.float32) * 0
            if read:
                r = jnp.max(w + (s * 0 if flush else zero))  # w streamed through L2, after the flush
                x1, r = jax.lax.optimization_barrier((x1, r))
                acc = acc + r.astype(jnp.float32) * 0
            if gemm:
                y = jnp.dot(x1, w, preferred_element_type=jnp.float32)
                acc = acc + y[0, 0]
            return acc

        return jax.lax.fori_loop(0, args.reps, step, jnp.float32(0))

    return jax.jit(run)


big = jnp.ones((args.flush_mb * 2**20 // 2,), jnp.bfloat16)
variants = {"flush": (1, 0, 0), "flush+gemm": (1, 0, 1), "flush+read+gemm": (1, 1, 1), "flush+read": (1, 1, 0),
            "gemm": (0, 0, 1)}
t0 = time.perf_counter()
for name, (k, n) in SHAPES.items():
    w = (jax.random.normal(jax.random.key(0), (k, n), jnp.float32) * 0.02).astype(jnp.bfloat16)
    for m in rows:
        x = jax.random.normal(jax.random.key(1), (m, k), jnp.bfloat16)
        ms = {v: median_seconds(program(*map(bool, flags)), x, w, big) * 1e3 / args.reps
              for v, flags in variants.items()}
        cold, warm = ms["flush+gemm"] - ms["flush"], ms["flush+read+gemm"] - ms["flush+read"]
        log(what="l2_probe", weight=name, k=k, n=n, m=m, weight_mb=k * n * 2 / 2**20, ms=ms,
            gemm_cold_us=cold * 1e3, gemm_after_read_us=warm * 1e3, gemm_repeated_us=ms["gemm"] * 1e3,
            read_us=(ms["flush+read"] - ms["flush"]) * 1e3, cold_gb_s=k * n * 2 / (cold * 1e-3) / 1e9,
            t=round(time.perf_counter() - t0, 1))
