"""GPU benchmark of the grouped expert GEMM at DiffusionGemma 26B-A4B's shapes against the two other expert paths:
the capacity buckets through the small-M kernel (formerly moe_impl "pallas_bucketed") and XLA's ragged_dot on the
layer's slice. Sweeps the grouped kernel's tiles and writes the best per shape as a table for small_m_gemm's
`load_tuned` (the grouped kernel takes its tiles from there).

  python kernels/grouped_gemm/bench.py [--out grouped.jsonl] [--table grouped_tuned.json]
  python kernels/grouped_gemm/bench.py --mlp [--out mlp.jsonl]

--mlp: a whole expert MLP per layer (gate/up with gathered rows, the activation, down) as two grouped GEMMs with
XLA's activation between them or in one launch (mlp.grouped_mlp), beside XLA's sum over the same bytes (the chip's
read under load), in alternating rounds over an 8-layer stack, 20 programs per sync; each checked at the first and
last layer against the two GEMMs.

Rows: 256 canvas tokens x top-8 of 128 experts = 2048 routed rows, sorted by expert; the routing is random and
uniform (each token's 8 distinct experts), so groups hold ~16 rows (a trained router is less even). Weights: a
stack of LAYERS layers (> the 60 MB L2 together), each call reading the next layer in place. Every variant is
checked against ragged_dot first.
"""

import argparse
import itertools
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))

from orl_jax import runtime  # noqa: E402

runtime.configure(None)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from bench_io import recorder, write_table  # noqa: E402
from timing import median_seconds  # noqa: E402

from orl_jax.model.layers import ACTIVATIONS  # noqa: E402
from orl_jax_kernels.grouped_gemm.kernel import default_blocks, group_offsets, grouped_matmul, supported  # noqa: E402
from orl_jax_kernels.grouped_gemm.mlp import grouped_mlp, tile_gated  # noqa: E402
from orl_jax_kernels.grouped_gemm.reference import grouped_matmul_reference  # noqa: E402
from orl_jax_kernels.small_m_gemm.kernel import Blocks, batched_small_m_matmul, pipeline_stages  # noqa: E402

INTERPRET = os.environ.get("ORL_BENCH_INTERPRET") == "1"  # CPU smoke run (tiny shapes, no timing sense)
# name: (K, N); E experts, T tokens, top-k, bucket capacity C (moe.capacity at T)
SHAPES = {"gate_up": (2816, 1408), "down": (704, 2816)}
ACT = ACTIVATIONS["gelu_tanh"]  # DiffusionGemma's experts' activation
E, T, TOPK, C, LAYERS = 128, 256, 8, 64, 4
if INTERPRET:
    SHAPES, E, T, TOPK, C, LAYERS = {"tiny": (128, 256)}, 8, 16, 2, 16, 2


def routed(key):
    """Group sizes [E] and the sorted rows' token ids of a random top-k routing."""
    scores = jax.random.normal(key, (T, E))
    experts = jax.lax.top_k(scores, TOPK)[1].reshape(-1)
    order = jnp.argsort(experts, stable=True)
    return jnp.bincount(experts, length=E).astype(jnp.int32), order // TOPK


def configs(k, n):
    out = []
    for bn, bk, warps, stages in itertools.product((64, 128, 256), (64, 128), (4, 8), (2, 3, 4)):
        b = Blocks(bn=bn, bk=bk, splits=1, num_warps=warps, num_stages=stages)
        if supported(k, n, b) and pipeline_stages(b, 64) == stages:  # skip depths shared memory cannot hold
            out.append(b)
    return out


def bench_shape(name, k, n, record) -> dict:
    ks = jax.random.split(jax.random.key(k + n), 3)
    sizes, tokens = routed(ks[0])
    x = jax.random.normal(ks[1], (T, k), jnp.bfloat16)
    xs = jnp.take(x, tokens, axis=0)  # [T * top-k, K] sorted by expert
    w = (jax.random.normal(ks[2], (LAYERS, E, k, n), jnp.float32) * 0.02).astype(jnp.bfloat16)
    layers = jnp.arange(LAYERS, dtype=jnp.int32)
    want = grouped_matmul_reference(xs, w[0], sizes).astype(jnp.float32)

    def timed(f):  # seconds per layer: one program over the LAYERS layers of the stack
        g = jax.jit(lambda xs, w: jax.lax.map(lambda i: f(xs, w, i), layers))
        return median_seconds(g, xs, w, reps=3 if INTERPRET else 10) / LAYERS

    def rel(out):
        return float(jnp.linalg.norm(out.astype(jnp.float32) - want) / jnp.linalg.norm(want))

    xla = lambda xs, w, i: grouped_matmul_reference(xs, w[i], sizes)  # noqa: E731
    record(shape=name, variant="xla_ragged_dot_slice", us=timed(xla) * 1e6, rel_err=rel(xla(xs, w, 0)))
    xb = jnp.zeros((E, C, k), jnp.bfloat16)  # the buckets' layout (contents do not change the time)
    bucket = lambda xs, w, i: batched_small_m_matmul(xb, w, i, sizes, interpret=INTERPRET)  # noqa: E731
    record(shape=name, variant="small_m_buckets", us=timed(bucket) * 1e6)
    best = None
    for b in configs(k, n):
        f = lambda xs, w, i, b=b: grouped_matmul(xs, w, sizes, i, b, interpret=INTERPRET)  # noqa: E731
        try:
            err = rel(f(xs, w, 0))
            if not err < 0.02:
                record(shape=name, variant=str(b), error=f"relative error {err:.3g}")
                continue
            us = timed(f) * 1e6
        except Exception as ex:  # a tiling the lowering or the chip rejects
            record(shape=name, variant=str(b), error=repr(ex)[:160])
            continue
        record(shape=name, variant=str(b), us=us, rel_err=err, gb_s=w[0].nbytes / us / 1e3)
        if best is None or us < best[0]:
            best = (us, b)
    print(f"{name}: best {best[0]:.1f} us {best[1]}", flush=True)
    return {"k": k, "n": n, "blocks": best[1].__dict__, "pallas_us": best[0]}


def bench_mlp(record, rounds: int = 3, layers: int = 2 if INTERPRET else 8) -> None:
    """Per layer: XLA's read of the layer's expert bytes, and the expert MLP (gate/up with gathered rows, the
    activation, down) as two grouped GEMMs with XLA's activation between them or in one launch (mlp.grouped_mlp) at
    2-4 pipeline stages, alternating in `rounds` rounds."""
    (d, f2), (f, _) = (128, 256), (128, 128)
    if not INTERPRET:
        (d, f2), (f, _) = SHAPES["gate_up"], SHAPES["down"]
    ks = jax.random.split(jax.random.key(7), 4)
    sizes, tokens = routed(ks[0])
    offsets = group_offsets(sizes)
    x = jax.random.normal(ks[1], (T, d), jnp.bfloat16)
    gu = (jax.random.normal(ks[2], (layers, E, d, f2), jnp.float32) * 0.02).astype(jnp.bfloat16)
    dn = (jax.random.normal(ks[3], (layers, E, f, d), jnp.float32) * 0.02).astype(jnp.bfloat16)
    idx = jnp.arange(layers, dtype=jnp.int32)
    b_gu, b_dn = default_blocks(d, f2), default_blocks(f, d)

    def two(x, gu, dn, i):
        g, u = jnp.split(grouped_matmul(x, gu, sizes, i, b_gu, INTERPRET, offsets, rows=tokens), 2, -1)
        h = ACT(g.astype(jnp.float32)).astype(g.dtype) * u
        return grouped_matmul(h, dn, sizes, i, b_dn, INTERPRET, offsets)

    def fused(stages, one_dot=False):
        return lambda x, gu, dn, i: grouped_mlp(x, tokens, gu, dn, offsets, i, ACT, b_gu, b_dn, num_stages=stages,
                                                one_dot=one_dot, interpret=INTERPRET)

    def per_layer(f, *w):  # seconds per layer of a program over the whole stack
        g = jax.jit(lambda x, *w: jax.lax.map(lambda i: f(x, *w, i), idx))
        return median_seconds(g, x, *w, reps=3 if INTERPRET else 7, calls=1 if INTERPRET else 20) / layers

    read = lambda x, gu, dn, i: jnp.sum(gu[i], dtype=jnp.float32) + jnp.sum(dn[i], dtype=jnp.float32)  # noqa: E731
    tiles = (tile_gated(gu, b_gu.bn // 2), dn)
    variants = [("two grouped GEMMs + XLA's activation (kernel.py)", two, (gu, dn))]
    variants += [(f"one launch (mlp.grouped_mlp), {s} stages", fused(s), tiles) for s in (2, 3, 4)]
    variants.append(("one launch, gate/up as one product per step (one_dot), 3 stages", fused(3, True), tiles))
    want = {i: two(x, gu, dn, i).astype(jnp.float32) for i in (0, layers - 1)}  # the last layer: 64-bit offsets
    for r in range(rounds):
        record(mlp_round=r, variant="xla_read", us=per_layer(read, gu, dn) * 1e6,
               gb=(gu[0].nbytes + dn[0].nbytes) / 1e9)
        for name, f_, w in variants:
            errs = [float(jnp.linalg.norm(f_(x, *w, i).astype(jnp.float32) - v) / jnp.linalg.norm(v))
                    for i, v in want.items()]
            record(mlp_round=r, variant=name, us=per_layer(f_, *w) * 1e6, rel_err=max(errs))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="grouped_bench.jsonl")
    ap.add_argument("--table", default="grouped_tuned.json", help="best tiles per (K, N) (small_m_gemm.load_tuned)")
    ap.add_argument("--mlp", action="store_true", help="the whole expert MLP: two grouped GEMMs against one launch")
    args = ap.parse_args()

    record, table = recorder(args.out), []
    if args.mlp:
        return bench_mlp(record)
    for name, (k, n) in SHAPES.items():
        table.append(bench_shape(name, k, n, record))
        write_table(args.table, table)


if __name__ == "__main__":
    main()
