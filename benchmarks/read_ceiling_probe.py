"""How fast can a kernel of ours stream DiffusionGemma's expert bytes, against XLA's flat read of the same bytes?
(issue #4)

Session 45's L2 probe (l2_expert_prefix_probe.py) timed XLA's sum over a flat 512 MiB bf16 buffer at 117 us in a
trace (4.59 TB/s) on the machine where the one-launch expert kernel read its 1.52 GB layer in 347-348 us (4.37 TB/s);
`timing.chip_rates` (an int32 sum over 2 GiB, wall clock) reads 4.0-4.2 TB/s on these machines. If the chip streams at
~4.6 TB/s, the expert kernel leaves ~17 us per layer (0.5 ms per forward). This probe asks whether a Pallas (Triton)
kernel can stream at that rate at all. Per layer of a 4-layer stack of one expert layer's bytes (1.52 GB each,
[rows, 128] bf16: rows of 256 bytes, as the fused kernel's gate/up tiles lie), timed per layer with 20 programs per
sync (wall clock):

  xla_flat          XLA's sum over the layer (float32)
  stream bk/st/w    a Pallas kernel: each program sums a contiguous block of 2816 rows (one gate/up tile, 720 KB) in
                    chunks of bk rows through an st-stage pipeline, w warps: the expert kernel's loads, no dot
  experts           the fused expert kernel (mlp.grouped_mlp, the model's settings) on a 26B layer, 256 tokens x
                    top-8 routed uniformly

  python benchmarks/read_ceiling_probe.py --out $BENCH/read_ceiling.jsonl
"""

from __future__ import annotations

import argparse
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
from timing import chip_rates, median_seconds  # noqa: E402

from orl_jax.model import moe  # noqa: E402
from orl_jax.model.layers import ACTIVATIONS  # noqa: E402
from orl_jax_kernels.grouped_gemm.kernel import group_offsets  # noqa: E402
from orl_jax_kernels.grouped_gemm.mlp import grouped_mlp  # noqa: E402
from orl_jax_kernels.pallas_args import triton_params  # noqa: E402

CPU = jax.default_backend() == "cpu"  # a smoke run: tiny shapes, interpret mode, no timing sense
E, T, TOPK, D, F, LAYERS, CALLS = 128, 256, 8, 2816, 704, 4, 20
BLOCK_ROWS = 2816  # rows of 128 bf16 per program: one gate/up tile of the fused kernel
if CPU:
    E, T, TOPK, D, F, LAYERS, CALLS, BLOCK_ROWS = 4, 16, 2, 128, 64, 2, 1, 128
LAYER_ROWS = E * 3 * F * D // 128  # gate/up (2F columns) and down (F rows) of E experts, in 128-wide rows


def _stream_kernel(w_ref, o_ref, *, bk: int, n_chunks: int):
    def chunk(j, acc):
        return acc + jnp.sum(w_ref[pl.ds(pl.multiple_of(j * bk, bk), bk), :].astype(jnp.float32), axis=0)

    o_ref[...] = jax.lax.fori_loop(0, n_chunks, chunk, jnp.zeros((128,), jnp.float32))[None, :]


@functools.partial(jax.jit, static_argnames=("bk", "warps", "stages"))
def stream(w, *, bk: int, warps: int, stages: int):
    """Column sums of each BLOCK_ROWS-row block of w [R, 128]: [R / BLOCK_ROWS, 128] float32."""
    blocks = w.shape[0] // BLOCK_ROWS
    return pl.pallas_call(
        functools.partial(_stream_kernel, bk=bk, n_chunks=BLOCK_ROWS // bk),
        out_shape=jax.ShapeDtypeStruct((blocks, 128), jnp.float32),
        grid=(blocks,),
        in_specs=[pl.BlockSpec((BLOCK_ROWS, 128), lambda p: (p, 0))],
        out_specs=pl.BlockSpec((1, 128), lambda p: (p, 0)),
        interpret=CPU,
        **triton_params(warps, stages, CPU),
    )(w)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="read_ceiling.jsonl")
    args = ap.parse_args()
    record = recorder(args.out)
    if not CPU:
        record(variant="timing.chip_rates", **chip_rates())
    rows = LAYER_ROWS // BLOCK_ROWS * BLOCK_ROWS
    w = jnp.ones((LAYERS, rows, 128), jnp.bfloat16)
    layer_bytes = rows * 128 * 2

    def timed(label, f, bytes_per_layer, *args):  # f(i, *args) per layer, LAYERS unrolled in one program
        g = jax.jit(lambda *a: [f(i, *a) for i in range(LAYERS)])
        try:
            us = median_seconds(g, *args, reps=5, calls=CALLS) / LAYERS * 1e6
        except Exception as ex:  # a tiling the lowering or the chip rejects
            record(variant=label, error=repr(ex)[:200])
            return
        record(variant=label, us=us, tb_s=bytes_per_layer / us / 1e6, calls=CALLS)

    want = float(jnp.sum(stream(w[1], bk=64, warps=4, stages=3)))
    if want != rows * 128:
        raise SystemExit(f"stream kernel sums {want}, want {rows * 128}")
    timed("xla_flat", lambda i, w: jnp.sum(w[i].astype(jnp.float32)), layer_bytes, w)
    for bk, stages, warps in [(64, 3, 4), (64, 4, 4), (64, 6, 4), (128, 2, 4), (128, 3, 4), (128, 4, 4), (256, 2, 4),
                              (64, 3, 8), (128, 3, 8), (256, 2, 8), (32, 6, 4)]:
        if BLOCK_ROWS % bk:
            continue
        timed(f"stream bk={bk} stages={stages} warps={warps}",
              lambda i, w, bk=bk, s=stages, nw=warps: stream(w[i], bk=bk, warps=nw, stages=s), layer_bytes, w)
    timed("xla_flat, again", lambda i, w: jnp.sum(w[i].astype(jnp.float32)), layer_bytes, w)
    del w

    ks = jax.random.split(jax.random.key(0), 5)
    experts = jax.lax.top_k(jax.random.normal(ks[0], (T, E)), TOPK)[1].reshape(-1)
    order = jnp.argsort(experts, stable=True)
    a = dict(x=jax.random.normal(ks[1], (T, D), jnp.bfloat16), rows=(order // TOPK).astype(jnp.int32),
             offsets=group_offsets(jnp.bincount(experts, length=E)),
             tiles=moe.fuse_gate_up(jax.random.normal(ks[2], (LAYERS, E, D, 2 * F), jnp.bfloat16) * 0.02),
             down=jax.random.normal(ks[3], (LAYERS, E, F, D), jnp.bfloat16) * 0.02)
    act = ACTIVATIONS["gelu_tanh"]
    expert_bytes = (a["tiles"][0].nbytes + a["down"][0].nbytes)
    timed("experts (grouped_mlp)", lambda i, a: grouped_mlp(a["x"], a["rows"], a["tiles"], a["down"], a["offsets"],
                                                             jnp.int32(i), act, num_stages=moe.FUSED_STAGES,
                                                             one_dot=moe.FUSED_ONE_DOT, interpret=CPU),
          expert_bytes, a)


if __name__ == "__main__":
    main()
