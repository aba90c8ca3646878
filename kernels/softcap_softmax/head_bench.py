"""GPU benchmark: the LM head with the sampler's statistics in its epilogue (`head_stats.head_one_pass_stats`) against
what a step runs today, XLA's head GEMM (cuBLAS, the embedding's [V, K] layout) then `softcap_one_pass_stats`, at
DiffusionGemma's canvas (h [256, 2816], E [262144, 2816], bf16). Each tile setting is timed bare (the GEMM writing
the product only: Triton's GEMM against cuBLAS) and with the statistics (what the epilogue costs); the first one that
compiles is checked against the current path (product, probabilities, chunk statistics).

  python kernels/softcap_softmax/head_bench.py [--out head_bench.jsonl] [--tiles 128,128,64,8,4 ...]
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))

# 128 x 128 at 3 stages (96 KB of shared memory) leaves room for a second program per SM, whose main loop may run
# under the first one's epilogue
DEFAULT_TILES = ["128,128,64,8,4", "128,128,64,8,3", "128,128,64,4,3", "128,128,64,4,4", "128,256,64,8,3",
                 "256,128,64,8,3", "64,256,64,4,4", "128,256,32,8,4", "128,128,32,8,6", "128,64,64,4,3"]
ap = argparse.ArgumentParser()
ap.add_argument("--out", default="head_bench.jsonl")
ap.add_argument("--rows", type=int, default=256)
ap.add_argument("--hidden", type=int, default=2816)
ap.add_argument("--vocab", type=int, default=262144)
ap.add_argument("--cap", type=float, default=30.0)
ap.add_argument("--temperature", type=float, default=0.4)
ap.add_argument("--tiles", nargs="+", default=DEFAULT_TILES, help="bm,bn,bk,num_warps,num_stages per setting")
args = ap.parse_args()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from bench_io import recorder  # noqa: E402
from timing import chip_rates, median_seconds  # noqa: E402

from orl_jax.decode.samplers import _chunk_width  # noqa: E402
from orl_jax_kernels.softcap_softmax import head_stats as hs  # noqa: E402
from orl_jax_kernels.softcap_softmax import kernel as sk  # noqa: E402

record = recorder(args.out)
R, K, V, CAP = args.rows, args.hidden, args.vocab, args.cap
W = _chunk_width(V)
kind = jax.devices()[0].device_kind
record(what="chip", device=kind, jax=jax.__version__, **chip_rates())
h = jax.random.normal(jax.random.key(0), (R, K), jnp.bfloat16)
w = (0.02 * jax.random.normal(jax.random.key(1), (V, K), jnp.float32)).astype(jnp.bfloat16)
inv_t = jnp.float32(1 / args.temperature)
flop = 2 * R * K * V


def timed(name, fn, **fields):
    us = median_seconds(fn, h, w, reps=7, calls=10) * 1e6
    record(what="head_stats", name=name, us=us, tflop_s=flop / us / 1e6, rows=R, hidden=K, vocab=V, width=W,
           device=kind, **fields)
    return us


def current(h, w):
    raw = jnp.dot(h, w.T)
    return raw, *sk.softcap_one_pass_stats(raw, inv_t, cap=CAP, width=W)


timed("xla_head", jax.jit(lambda h, w: jnp.dot(h, w.T)))
timed("xla_head+one_pass", jax.jit(current))
reference, checked = None, False
for text in args.tiles:
    bm, bn, bk, warps, stages = map(int, text.split(","))
    tiles = hs.Tiles(bm=bm, bn=bn, bk=bk, num_warps=warps, num_stages=stages)
    fields = dict(bm=bm, bn=bn, bk=bk, num_warps=warps, num_stages=stages)
    for stats in (False, True):
        name = "fused" if stats else "triton_bare"
        fn = jax.jit(lambda h, w, t=tiles, s=stats: (hs.head_one_pass_stats(h, w, inv_t, cap=CAP, width=W, tiles=t)
                                                      if s else hs.head_one_pass_pieces(h, w, inv_t, cap=CAP,
                                                                                        tiles=t, stats=False)[0]))
        try:
            if stats and not checked:  # the first setting that compiles, against the current path
                reference = reference or jax.jit(current)(h, w)
                got = fn(h, w)
                err = {n: float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))
                       for n, a, b in zip(("raw", "e", "mass", "t", "first", "raw_max", "x_max", "shift"), got,
                                          reference)}
                record(what="head_stats_check", max_abs_diff=err, raw_differ=int(jnp.sum(got[0] != reference[0])),
                       first_differ=int(jnp.sum(got[4] != reference[4])), **fields)
                checked = True
            timed(name, fn, **fields)
        except Exception as ex:  # a setting the compiler refuses (registers, shared memory): recorded, not fatal
            record(what="head_stats", name=name, error=repr(ex)[:400], **fields)
