"""GPU benchmark of the small-M GEMM kernel vs XLA (cuBLAS) on the Qwen3-4B projection shapes.

  python kernels/small_m_gemm/bench.py [--m 32,64]
Checks each variant against the float32 reference on fresh random inputs, then times it (median of many runs,
rotating between 3 weight copies so the 60 MB L2 does not serve repeats). Prints GB/s of weight traffic.
"""

import argparse
import itertools
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from orl_jax import runtime  # noqa: E402

runtime.configure(None)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from orl_jax_kernels.small_m_gemm.kernel import Blocks, small_m_matmul  # noqa: E402
from orl_jax_kernels.small_m_gemm.reference import matmul_reference  # noqa: E402

SHAPES = {"qkv": (2560, 6144), "o": (4096, 2560), "gate_up": (2560, 19456), "down": (9728, 2560)}
ap = argparse.ArgumentParser()
ap.add_argument("--m", default="32")
ap.add_argument("--out", default="gemm_bench.jsonl")
args = ap.parse_args()


def timeit(f, wst, x):
    """Seconds per call: a scan applies f to each of the R stacked weight copies inside one program, so launch
    overhead and host dispatch are excluded and the R copies (> L2) are read from HBM."""
    def chain(wst, x):
        return jax.lax.scan(lambda acc, w: (acc + f(x, w)[:, :8].astype(jnp.float32).sum(), None), 0.0, wst)[0]

    g = jax.jit(chain)
    jax.block_until_ready(g(wst, x))
    ts = []
    for _ in range(7):
        t = time.perf_counter()
        jax.block_until_ready(g(wst, x))
        ts.append(time.perf_counter() - t)
    return float(np.median(ts)) / wst.shape[0]


configs = [Blocks(bn, bk, s, nw, ns) for bn, bk, s, nw, ns in itertools.product(
    (64, 128), (128, 256), (2, 4, 8), (4, 8), (3,))]
for m in map(int, args.m.split(",")):
    for name, (k, n) in SHAPES.items():
        reps = max(4, int(1.5e9 // (k * n * 2)))  # >= 1.5 GB of distinct weights per timed program
        kw, kx = jax.random.split(jax.random.key(len(name) * 7 + m))
        wst = jax.random.normal(kw, (reps, k, n), jnp.bfloat16) * 0.02
        x = jax.random.normal(kx, (m, k), jnp.bfloat16)
        ref = matmul_reference(x.astype(jnp.float32), wst[0].astype(jnp.float32), jnp.float32)
        xla = jax.jit(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype))
        t_xla = timeit(xla, wst, x)
        rows = [("xla", t_xla, float(jnp.linalg.norm(xla(x, wst[0]).astype(jnp.float32) - ref) / jnp.linalg.norm(ref)))]
        for b in configs:
            f = lambda x, w, b=b: small_m_matmul(x, w, b)
            try:
                out = jax.jit(f)(x, wst[0])
                err = float(jnp.linalg.norm(out.astype(jnp.float32) - ref) / jnp.linalg.norm(ref))
                rows.append((str(b), timeit(f, wst, x), err))
            except Exception as e:  # a block config the lowering rejects
                rows.append((str(b), float("inf"), repr(e)[:80]))
        rows.sort(key=lambda r: r[1])
        gb = k * n * 2 / 1e9
        for label, t, err in rows[:4] + [r for r in rows if r[0] == "xla"]:
            rec = dict(m=m, shape=name, k=k, n=n, variant=label, us=t * 1e6, tb_s=gb / t / 1e3, rel_err=err)
            print(json.dumps(rec), flush=True)
            with open(args.out, "a") as fh:
                fh.write(json.dumps(rec) + "\n")
