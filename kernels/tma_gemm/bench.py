"""GPU benchmark of the Mosaic GPU small-M GEMM (kernels/tma_gemm) against XLA's GEMM (cuBLAS) and the Triton
small-M kernel on the Qwen3-4B projection shapes at M = 32.

  python kernels/tma_gemm/bench.py [--m 32] [--shapes qkv,o,gate_up,down] [--out tma_gemm.jsonl]

Every variant is checked against the float32 product on random inputs, then timed two ways: over R distinct
weights passed as R arguments (> 1.5 GB together, so L2 serves no repeat), and as the model runs it, a
`fori_loop` over a [36, K, N] layer stack whose GEMM input depends on the previous layer's output (XLA feeds cuBLAS
the loop's slice in place; the kernels read layer i of the stack in place). The loop's own work (the dependency's
elementwise op, the partials' sum) is inside both numbers, as it is in a model.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))

from orl_jax import runtime  # noqa: E402

runtime.configure(None)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from bench_io import recorder  # noqa: E402
from timing import median_seconds  # noqa: E402

from orl_jax_kernels.tma_gemm.kernel import Blocks, tma_gemm  # noqa: E402

SHAPES = {"qkv": (2560, 6144), "o": (4096, 2560), "gate_up": (2560, 19456), "down": (9728, 2560)}
LAYERS = 36
TIMED_BYTES = 1.5e9


def candidates(k, n):
    out = []
    for tn in (64, 128, 256):
        for tk in (64, 128):
            for s in (1, 2, 4, 8):
                progs = (n // tn) * s
                if n % tn or k % (tk * s) or not 66 <= progs <= 6 * 132:
                    continue
                for stages in (4, 6):
                    if stages * (64 * tk + tk * tn) * 2 + 64 * tn * 4 <= 220 * 1024:
                        out.append(Blocks(tn, tk, s, stages))
    return out


def as_out(y, dtype):
    return (y.sum(0) if y.ndim == 3 else y).astype(dtype)


def bench_shape(name, k, n, m, record, only=None):
    gb = k * n * 2 / 1e9
    reps = max(2, int(TIMED_BYTES // (k * n * 2)))
    keys = jax.random.split(jax.random.key(k + n), reps + 2)
    x = jax.random.normal(keys[0], (m, k), jnp.bfloat16)
    ws = [jax.random.normal(kk, (k, n), jnp.bfloat16) * 0.02 for kk in keys[2:]]
    ref = jnp.dot(x.astype(jnp.float32), ws[0].astype(jnp.float32))
    stack = jax.random.normal(keys[1], (LAYERS, k, n), jnp.bfloat16) * 0.02

    def err(out):
        return float(jnp.linalg.norm(out.astype(jnp.float32) - ref) / jnp.linalg.norm(ref))

    def unrolled(f):
        return jax.jit(lambda x, ws: jnp.stack([as_out(f(x, w, None), x.dtype) for w in ws]))

    def looped(f):
        def body(i, x):  # the next input depends on this output, as in a model's layer loop
            y = as_out(f(x, stack_arg[0], i), x.dtype)
            return x + y[:, :1]
        stack_arg = [None]

        def run(x, st):
            stack_arg[0] = st
            return jax.lax.fori_loop(0, LAYERS, body, x)
        return jax.jit(run)

    xla = lambda x, w, i: jnp.dot(x, w if i is None else w[i], preferred_element_type=jnp.float32).astype(x.dtype)  # noqa: E731,E501
    # the loop's own cost: the same dependency op on a product-shaped array, no GEMM
    variants = [("no GEMM (loop and dependency only)", lambda x, w, i: jnp.zeros((m, n), x.dtype) + x[:, :1]),
                ("xla", xla)]
    from orl_jax_kernels.small_m_gemm.kernel import Blocks as TBlocks  # noqa: E402
    from orl_jax_kernels.small_m_gemm.kernel import small_m_matmul
    tuned = {(2560, 6144): TBlocks(128, 128, 2, 4, 4), (4096, 2560): TBlocks(64, 128, 4, 4, 4),
             (2560, 19456): TBlocks(128, 128, 1, 4, 4), (9728, 2560): TBlocks(64, 128, 4, 4, 4)}
    variants.append(("triton " + str(tuned[(k, n)]),
                     lambda x, w, i, b=tuned[(k, n)]: small_m_matmul(x, w, i, b)))
    for b in candidates(k, n):
        if only and str(b) not in only:
            continue
        variants.append((str(b), lambda x, w, i, b=b: tma_gemm(x, w, i, blocks=b)))
    rows = []
    for label, f in variants:
        try:
            rel = err(jax.jit(lambda x, w, f=f: as_out(f(x, w, None), x.dtype))(x, ws[0]))
            t_u = median_seconds(unrolled(f), x, ws, reps=5, calls=4) / reps
            t_l = median_seconds(looped(f), x, stack, reps=5, calls=4) / LAYERS
        except Exception as ex:  # a config the lowering or the chip rejects
            record(m=m, shape=name, variant=label, error=repr(ex)[:300])
            print(f"{name} {label}: {repr(ex)[:300]}", flush=True)
            continue
        record(m=m, shape=name, k=k, n=n, variant=label, rel_err=rel, us_distinct=t_u * 1e6, us_loop=t_l * 1e6,
               tb_s_distinct=gb / t_u / 1e3, tb_s_loop=gb / t_l / 1e3)
        rows.append((t_l, label, t_u, rel))
        print(f"{name:8s} {label:60s} distinct {t_u * 1e6:6.1f} us ({gb / t_u / 1e3:.2f} TB/s)  loop "
              f"{t_l * 1e6:6.1f} us ({gb / t_l / 1e3:.2f} TB/s)  err {rel:.1e}", flush=True)
    rows.sort()
    print(f"== {name}: best in the loop: " + "; ".join(f"{lb} {t * 1e6:.1f} us" for t, lb, _, _ in rows[:4]),
          flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, default=32)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--only", default="", help="'|'-separated Blocks strings to time (default: all candidates)")
    ap.add_argument("--out", default="tma_gemm.jsonl")
    args = ap.parse_args()
    record = recorder(args.out)
    record(what="device", device=jax.devices()[0].device_kind, jax=jax.__version__)
    for name in args.shapes.split(","):
        bench_shape(name, *SHAPES[name], args.m, record, [s for s in args.only.split("|") if s])


if __name__ == "__main__":
    main()
