"""GPU benchmark of the sampler's statistics pass alone at DiffusionGemma's [256, 262144] bf16 head product: the row
max (XLA) + the two-pass kernel (`softcap_chunk_stats`) against the one-pass kernel
(`softcap_one_pass_stats`), over chunks per program and warps, the one-pass kernel also on halves and quarters of
the samplers' chunks; beside XLA's read of the product and its copy (the bytes' floor: the kernels read 134 MB and
write 134 MB). Each row: us per call (20 calls per sync) and the bytes' rate.

  python kernels/softcap_softmax/bench.py [--out softcap_bench.jsonl] [--rows 256] [--vocab 262144]
      [--chunks 4,8,16] [--warps 4,8] [--once]

Why: session 54's H200 trace had the kernel at 151.7 us per step (1.8 TB/s), the row max before it at ~38 us;
A branch-free tanh (fewer instructions) did not change the step's tail on an H100 (session 56). Halves of the
chunks (one warp each) at 8 chunks / 4 warps were 6.7 us faster alone on an H100, but generate() on halves at 4 / 4
ran 10.9 ms slower (session 60, 2026-12-06_dg_one_pass_split_h100.md; that switch was removed). The one-pass kernel
also with FAST_MATH (PTX's approximate exponential and reciprocal: "one_pass_fast_math").
"""

import argparse
import functools
import itertools
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))

ap = argparse.ArgumentParser()
ap.add_argument("--out", default="softcap_bench.jsonl")
ap.add_argument("--rows", type=int, default=256)
ap.add_argument("--vocab", type=int, default=262144)
ap.add_argument("--cap", type=float, default=30.0)
ap.add_argument("--temperature", type=float, default=0.4)
ints = lambda text: [int(n) for n in text.split(",")]  # noqa: E731  (argparse names the option on a bad value)
ap.add_argument("--chunks", type=ints, default=[4, 8, 16], help="chunks per program to time, comma-separated")
ap.add_argument("--warps", type=ints, default=[4, 8], help="warps per program to time, comma-separated")
ap.add_argument("--once", action="store_true",
                help="only the one-pass kernel, once per FAST_MATH setting, untimed (for Nsight Compute: "
                     "ncu -k regex:one_pass -c 2 ... bench.py --once)")
args = ap.parse_args()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from bench_io import recorder  # noqa: E402
from timing import median_seconds  # noqa: E402

from orl_jax.decode.samplers import _chunk_width  # noqa: E402
from orl_jax_kernels.softcap_softmax import kernel as sk  # noqa: E402

record = recorder(args.out)
R, V, CAP = args.rows, args.vocab, args.cap
W = _chunk_width(V)
raw = (3.0 * jax.random.normal(jax.random.key(0), (R, V), jnp.float32)).astype(jnp.bfloat16)
inv_t = jnp.float32(1 / args.temperature)
nbytes = raw.size * raw.dtype.itemsize


def timed(name, fn, moved, width=W, **fields):
    us = median_seconds(fn, raw, reps=7, calls=20) * 1e6
    record(what="softcap_stats", name=name, us=us, tb_s=moved / us / 1e6, rows=R, vocab=V, width=width,
           device=jax.devices()[0].device_kind, jax=jax.__version__, **fields)
    return us


if args.once:
    for fast_math in (False, True):
        jax.block_until_ready(sk.softcap_one_pass_stats(raw, inv_t, cap=CAP, width=W, fast_math=fast_math))
    sys.exit(0)
timed("xla_read_max", jax.jit(lambda r: jnp.max(r, axis=-1)), nbytes)
timed("xla_copy", jax.jit(lambda r: r * jnp.bfloat16(1.5)), 2 * nbytes)


def two_pass(r):
    raw_max = jnp.max(r, axis=-1)
    m = jnp.tanh(raw_max.astype(jnp.float32) / CAP) * CAP * inv_t
    return sk.softcap_chunk_stats(r, m, raw_max, inv_t, cap=CAP, width=W)


def one_pass(r, width=W, fast_math=False):
    return sk.softcap_one_pass_stats(r, inv_t, cap=CAP, width=width, fast_math=fast_math)


prev = (sk.CHUNKS_PER_PROGRAM, sk.NUM_WARPS)
variants = [("two_pass", two_pass, W), ("one_pass", one_pass, W),
            ("one_pass_fast_math", functools.partial(one_pass, fast_math=True), W)]
variants += [("one_pass", functools.partial(one_pass, width=W // s), W // s) for s in (2, 4)]
for cpp, warps in itertools.product(args.chunks, args.warps):
    sk.CHUNKS_PER_PROGRAM, sk.NUM_WARPS = cpp, warps
    for name, fn, width in variants:
        if not sk.supported(V, width, cpp):
            continue
        jax.clear_caches()
        try:
            timed(name, jax.jit(fn), 2 * nbytes + (nbytes if name.startswith("two") else 0), width,
                  chunks_per_program=cpp, num_warps=warps)
        except Exception as ex:  # a variant the compiler refuses (registers, shared memory): recorded, not fatal
            record(what="softcap_stats", name=name, width=width, chunks_per_program=cpp, num_warps=warps,
                   error=repr(ex)[:300])
sk.CHUNKS_PER_PROGRAM, sk.NUM_WARPS = prev
