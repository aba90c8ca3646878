"""How close do DiffusionGemma's expert GEMMs run to what the H200 can read? (issue #4)

The expert kernels are 73% of the 26B forward (gate/up at ~4.27 TB/s, down at ~4.04 in the forward's profile). This
probe says whether that is the chip's read ceiling or the kernel's. Per layer of an 8-layer weight stack (1 GB of
gate/up or 0.5 GB of down per layer, far past the 50 MB L2), each variant once per layer in one jitted program:

  grouped bk=..      kernels/grouped_gemm at its default tiles and others, 256 tokens x top-8 routed uniformly
  stream bk=..       the same grid and loads (expert, column tile; K in chunks), the dot replaced by a column sum:
                     the read of that access pattern with no tensor-core work
  xla_reduce         XLA's sum over K of each expert: [E, K, N] -> [E, N] float32
  xla_copy           XLA's w * 2 (read and write: the 4.2-4.3 TB/s "device copy" of kernels/NOTES.md)

  python benchmarks/hbm_read_probe.py --out $BENCH/hbm_read.jsonl
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from orl_jax import runtime  # noqa: E402

runtime.configure(None)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from bench_io import recorder  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from timing import median_seconds  # noqa: E402

from orl_jax_kernels.grouped_gemm.kernel import default_blocks, grouped_matmul  # noqa: E402
from orl_jax_kernels.pallas_args import triton_params  # noqa: E402

INTERPRET = os.environ.get("ORL_BENCH_INTERPRET") == "1"  # CPU smoke run (tiny shapes, no timing sense)
SHAPES = {"gate_up": (2816, 1408), "down": (704, 2816)}  # (K, N) per expert
E, T, TOPK, LAYERS = 128, 256, 8, 8
CALLS = 20  # programs dispatched before one sync (--calls)
if INTERPRET:
    SHAPES, E, T, TOPK, LAYERS = {"tiny": (128, 64)}, 4, 8, 2, 2


def _stream_kernel(layer_ref, w_ref, o_ref, *, bk: int, n_chunks: int):
    layer = layer_ref[0]

    def chunk(j, acc):
        wb = w_ref[layer, 0, pl.ds(pl.multiple_of(j * bk, bk), bk), :]
        return acc + jnp.sum(wb.astype(jnp.float32), axis=0)

    o_ref[...] = jax.lax.fori_loop(0, n_chunks, chunk, jnp.zeros((w_ref.shape[-1],), jnp.float32))[None, :]


@functools.partial(jax.jit, static_argnames=("bk", "bn", "warps", "stages"))
def stream(w, layer, *, bk: int, bn: int, warps: int, stages: int):
    """Column sums over K of every expert of layer `layer` of w [L, E, K, N], in grouped_matmul's grid order (column
    tiles outer, experts inner) and chunking: [E, N] float32."""
    _, e, k, n = w.shape
    return pl.pallas_call(
        functools.partial(_stream_kernel, bk=bk, n_chunks=k // bk),
        out_shape=jax.ShapeDtypeStruct((e, n), jnp.float32),
        grid=(n // bn, e),
        in_specs=[pl.BlockSpec((1,), lambda j, g: (0,)),
                  pl.BlockSpec((w.shape[0], 1, k, bn), lambda j, g: (0, g, 0, j))],
        out_specs=pl.BlockSpec((1, bn), lambda j, g: (g, j)),
        interpret=INTERPRET,
        **triton_params(warps, stages, INTERPRET),
    )(jnp.reshape(layer, (1,)).astype(jnp.int32), w)


def probe(name, k, n, record, calls: int):
    ks = jax.random.split(jax.random.key(k + n), 3)
    experts = jax.lax.top_k(jax.random.normal(ks[0], (T, E)), TOPK)[1].reshape(-1)
    sizes = jnp.bincount(experts, length=E).astype(jnp.int32)
    xs = jax.random.normal(ks[1], (T * TOPK, k), jnp.bfloat16)
    w = (jax.random.normal(ks[2], (LAYERS, E, k, n), jnp.float32) * 0.02).astype(jnp.bfloat16)
    layer_bytes = w[0].nbytes

    def timed(label, f, factor=1.0, **extra):  # f(w, i) on layer i; per layer over the stack, unrolled
        # (as a lax.map, a while loop, the same kernels timed 334 against 297 us per layer: 2026-12-01_balanced_splits)
        g = jax.jit(lambda w: [f(w, i) for i in range(LAYERS)])
        try:
            us = median_seconds(g, w, reps=3 if INTERPRET else 5, calls=calls) / LAYERS * 1e6
        except Exception as ex:  # a tiling the lowering or the chip rejects
            record(shape=name, variant=label, error=repr(ex)[:200], **extra)
            return
        record(shape=name, variant=label, calls=calls, us=us, tb_s=factor * layer_bytes / us / 1e6, **extra)
        print(f"{name} {label}: {us:.1f} us, {factor * layer_bytes / us / 1e6:.2f} TB/s", flush=True)

    b = default_blocks(k, n)
    want = jnp.sum(w[1].astype(jnp.float32), axis=1)
    got = stream(w, jnp.int32(1), bk=b.bk, bn=b.bn, warps=b.num_warps, stages=b.num_stages)
    err = float(jnp.max(jnp.abs(got - want)))
    if not err < 1e-2:
        raise SystemExit(f"{name}: the stream kernel's column sums differ from XLA's by {err}")
    variants = [b] + [dataclasses.replace(b, bk=bk, num_stages=s) for bk, s in ((64, 4), (128, 2), (128, 3))
                      if (bk, s) != (b.bk, b.num_stages) and k % bk == 0]
    variants += [dataclasses.replace(b, num_warps=8)]
    for v in variants:
        tiles = f"bk={v.bk} bn={v.bn} warps={v.num_warps} stages={v.num_stages}" + (" (default)" if v == b else "")
        timed(f"grouped {tiles}", lambda w, i, v=v: grouped_matmul(xs, w, sizes, i, v, interpret=INTERPRET))
        timed(f"stream {tiles}",
              lambda w, i, v=v: stream(w, i, bk=v.bk, bn=v.bn, warps=v.num_warps, stages=v.num_stages))
    timed("xla_reduce", lambda w, i: jnp.sum(w[i].astype(jnp.float32), axis=1))
    timed("xla_copy", lambda w, i: w[i] * 2, factor=2.0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="hbm_read.jsonl")
    ap.add_argument("--calls", type=int, default=CALLS, help="programs dispatched before one sync")
    args = ap.parse_args()
    record = recorder(args.out)
    for name, (k, n) in SHAPES.items():
        probe(name, k, n, record, 1 if INTERPRET else args.calls)


if __name__ == "__main__":
    main()
