"""What one kernel costs inside the engine's CUDA graph when it does almost nothing: the floor under each of a
block-32 step's ~427 kernels (issue #3). A chain of N dependent kernels, each kept separate by an optimization
barrier, compiled with the engine's compiler options (runtime.ENGINE_COMPILER_OPTIONS: the program in command
buffers) and timed at two lengths; the difference over the extra kernels is the cost per kernel.

  elementwise   x = x * 1.0001 + 1 on [32, 2560] bf16 (one XLA fusion each, 160 KB in and out)
  gemm          x = x @ W_i on [32, 256] x [256, 256] bf16 (one cuBLAS call each, 128 KB of weight)
  gemm_4096     x = x @ W_i on [32, 4096] x [4096, 4096] bf16, 16 distinct weights cycled (33.5 MB each, 537 MB
                together: each read from HBM), a decode projection's size: its time per GEMM and read rate

  python benchmarks/launch_tax_probe.py --out launch_tax.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

ap = argparse.ArgumentParser()
ap.add_argument("--out", default="launch_tax.jsonl")
ap.add_argument("--lengths", default="64,256", help="two chain lengths, comma-separated")
args = ap.parse_args()
sys.path.insert(0, os.path.dirname(__file__))
from bench_io import chain_lengths  # noqa: E402

lengths = chain_lengths(ap, args.lengths)

from orl_jax import runtime  # noqa: E402

runtime.configure(None)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from timing import median_seconds  # noqa: E402


def chain(kind: str, n: int):
    if kind == "elementwise":
        def run(x, ws):
            for _ in range(n):
                x = jax.lax.optimization_barrier(x * jnp.bfloat16(1.0001) + jnp.bfloat16(1))
            return x
    else:
        def run(x, ws):
            for i in range(n):
                x = jax.lax.optimization_barrier(jnp.dot(x, ws[i % ws.shape[0]]))
            return x
    return jax.jit(run, compiler_options=runtime.ENGINE_COMPILER_OPTIONS)


key = jax.random.key(0)
inputs = {"elementwise": (jax.random.normal(key, (32, 2560), jnp.bfloat16), jnp.zeros((1,), jnp.bfloat16)),
          "gemm": (jax.random.normal(key, (32, 256), jnp.bfloat16),
                   jax.random.normal(key, (16, 256, 256), jnp.bfloat16) * 0.06),
          "gemm_4096": (jax.random.normal(key, (32, 4096), jnp.bfloat16),
                        jax.random.normal(key, (16, 4096, 4096), jnp.bfloat16) * 0.015)}
with open(args.out, "a") as f:
    for kind, (x, ws) in inputs.items():
        t = [median_seconds(chain(kind, n), x, ws, reps=20, calls=10) for n in lengths]
        per = (t[1] - t[0]) / (lengths[1] - lengths[0])
        row = {"what": "launch_tax", "kind": kind, "lengths": lengths, "ms": [s * 1e3 for s in t],
               "us_per_kernel": per * 1e6,
               "weight_tb_s": ws[0].nbytes / per / 1e12 if kind == "gemm_4096" else None,
               "device": jax.devices()[0].device_kind, "jax": jax.__version__}
        f.write(json.dumps(row) + "\n")
        print(f"{kind:12s} {lengths[0]} kernels {t[0] * 1e3:.3f} ms, {lengths[1]} kernels {t[1] * 1e3:.3f} ms: "
              f"{per * 1e6:.2f} us per kernel", flush=True)
