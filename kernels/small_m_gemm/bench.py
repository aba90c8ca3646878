"""GPU benchmark of the small-M GEMM kernel vs XLA (cuBLAS) on the Qwen3-4B projection shapes; writes the tuned
block table that `kernel.load_tuned` reads.

  python kernels/small_m_gemm/bench.py [--m 32] [--out gemm.jsonl] [--table gemm_tuned.json]

Every variant is checked against the float32 reference on fresh random inputs, then timed as one program that
multiplies R distinct weights (> 1.5 GB together, so the 60 MB L2 serves no repeat), passed as R separate
arguments: no slicing of a stack, which would hand a custom call a copy. Two more rows per shape time the
model's situation, a `lax.scan` over a layer stack: XLA on the scanned slice ("xla_scan") and the kernel reading
each layer in place ("pallas_stacked_scan", best blocks).
"""

import argparse
import itertools
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))

from orl_jax import runtime  # noqa: E402

runtime.configure(None)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from bench_io import recorder, write_table  # noqa: E402

from orl_jax_kernels.small_m_gemm.kernel import Blocks, batched_small_m_matmul, pipeline_stages  # noqa: E402

# name: (groups E, K, N). Qwen3-4B's projections (E = 1) and DiffusionGemma 26B-A4B's experts (E = 128, rows = the
# bucket capacity 64 at canvas 256).
SHAPES = {"qkv": (1, 2560, 6144), "o": (1, 4096, 2560), "gate_up": (1, 2560, 19456), "down": (1, 9728, 2560),
          "dg_experts_gate_up": (128, 2816, 1408), "dg_experts_down": (128, 704, 2816)}
SMS = 132
TIMED_BYTES = 1.5e9  # distinct weight bytes per timed program (> the 60 MB L2)
INTERPRET = os.environ.get("ORL_BENCH_INTERPRET") == "1"  # CPU smoke run of the script (tiny shapes, no timing sense)


def per_call(g, *args, calls=10):
    """Median seconds of one call of the jitted g (calls queued back to back, so host dispatch overlaps)."""
    jax.block_until_ready(g(*args))
    ts = []
    for _ in range(5):
        t = time.perf_counter()
        outs = [g(*args) for _ in range(calls)]
        jax.block_until_ready(outs)
        ts.append((time.perf_counter() - t) / calls)
    return float(np.median(ts))


def unrolled(f):
    return jax.jit(lambda x, ws: jnp.stack([f(x, w) for w in ws]))


def configs(e, m, k, n):
    """Block candidates whose grid fills the chip (>= 1 wave of programs, at most 16 waves; any count for many
    groups), each 4 stages deep or as deep as shared memory allows (kernel.pipeline_stages)."""
    out = []
    for bn, bk, splits in itertools.product((64, 128, 256), (64, 128, 256), (1, 2, 4, 8)):
        programs = (n // bn) * min(splits, k // bk) * (1 if e == 1 else 16)
        if n % bn or k % bk or splits > k // bk or not SMS <= programs <= 16 * SMS:
            continue
        b = Blocks(bn, bk, splits, 4, 4)
        out.append(Blocks(bn, bk, splits, 4, pipeline_stages(b, max(16, m))))
    return out


def bench_shape(name, e, k, n, m, record) -> dict:
    """Time XLA and every block candidate on one shape ([E, M, K] x [E, K, N]); the table row of the best."""
    reps = max(2, int(TIMED_BYTES // (e * k * n * 2)))
    keys = jax.random.split(jax.random.key(len(name) * 7 + m), reps + 1)
    ws = [jax.random.normal(kk, (e, k, n), jnp.bfloat16) * 0.02 for kk in keys[1:]]
    x = jax.random.normal(keys[0], (e, m, k), jnp.bfloat16)
    ref = jnp.einsum("emk,ekn->emn", x.astype(jnp.float32), ws[0].astype(jnp.float32))
    gb = e * k * n * 2 / 1e9

    def err(out):
        return float(jnp.linalg.norm(out.astype(jnp.float32) - ref) / jnp.linalg.norm(ref))

    def row(variant, seconds, rel):
        record(m=m, shape=name, e=e, k=k, n=n, variant=variant, us=seconds * 1e6, tb_s=gb / seconds / 1e3,
               rel_err=rel)

    xla = lambda x, w: jnp.einsum("emk,ekn->emn", x, w, preferred_element_type=jnp.float32).astype(x.dtype)  # noqa: E731
    t_xla = per_call(unrolled(xla), x, ws) / reps
    row("xla", t_xla, err(jax.jit(xla)(x, ws[0])))
    results = []
    for b in configs(e, m, k, n):
        f = lambda x, w, b=b: batched_small_m_matmul(x, w, None, None, b, INTERPRET)  # noqa: E731
        try:
            rel = err(jax.jit(f)(x, ws[0]))
            results.append((per_call(unrolled(f), x, ws) / reps, b, rel))
        except Exception as ex:  # a block config the lowering or the chip rejects
            record(m=m, shape=name, variant=str(b), error=repr(ex)[:160])
    if not results:
        return {"k": k, "n": n, "blocks": None, "xla_us": t_xla * 1e6}
    results.sort(key=lambda r: r[0])
    for t, b, rel in results[:5]:
        row(str(b), t, rel)
    best_t, best, _ = results[0]
    # the model's situation: a scan over a stack of layers
    stack = jnp.stack(ws[:min(reps, 16)])  # [L, E, K, N]
    nl = stack.shape[0]
    scan_xla = jax.jit(lambda x, st: jax.lax.scan(lambda c, w: (c, xla(x, w)), 0, st)[1])
    row("xla_scan", per_call(scan_xla, x, stack) / nl, err(scan_xla(x, stack)[0]))
    layers = jnp.arange(nl, dtype=jnp.int32)
    scan_k = jax.jit(lambda x, st: jax.lax.scan(
        lambda c, i: (c, batched_small_m_matmul(x, st, i, None, best, INTERPRET)), 0, layers)[1])
    row(f"pallas_stacked_scan {best}", per_call(scan_k, x, stack) / nl, err(scan_k(x, stack)[0]))
    del stack
    use = best_t < 0.97 * t_xla
    print(f"{name:8s} K={k:5d} N={n:5d}  xla {t_xla * 1e6:7.1f} us ({gb / t_xla / 1e3:.2f} TB/s)  "
          f"best {best_t * 1e6:7.1f} us ({gb / best_t / 1e3:.2f} TB/s) {best}  -> {'pallas' if use else 'xla'}",
          flush=True)
    return {"k": k, "n": n, "blocks": best.__dict__ if use else None, "pallas_us": best_t * 1e6,
            "xla_us": t_xla * 1e6}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, default=32, help="rows of the Qwen3 shapes (the expert shapes use 64)")
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated subset of {', '.join(SHAPES)}")
    ap.add_argument("--out", default="gemm_bench.jsonl")
    ap.add_argument("--table", default="gemm_tuned.json", help="per-shape best blocks (null: XLA was faster)")
    args = ap.parse_args()
    m, record, table = args.m, recorder(args.out), []
    for name in args.shapes.split(","):
        e, k, n = SHAPES[name]
        table.append(bench_shape(name, e, k, n, m if e == 1 else 64, record))
        write_table(args.table, table)


if __name__ == "__main__":
    main()
