"""Is DiffusionGemma's expert kernel faster when the first bytes it reads already sit in L2? (issue #4)

Session 45 bulk-prefetched the first 16-48 MB of each layer's gate/up expert stack into L2 while the layer's attention
ran (a jax-triton kernel issuing PTX `cp.async.bulk.prefetch.L2`, removed; in git history at b9d0452): in the 26B
forward the expert kernel took 349-351 us per sliding layer with or without it, and the launch, outside XLA's command
buffers, cost 0.5-1.9 ms per forward (2026-12-04_dg_l2_prefetch_h200.md). This probe asks the question without the
forward's scheduling. Per layer of a 4-layer stack at the 26B's expert shapes (gate/up in moe.fuse_gate_up's layout,
256 tokens x top-8 routed uniformly), each step tied to the one before by a data dependency (a zero made from the
previous step's sum):

  cold           a 512 MB read (L2 holds 60 MB), then the expert kernel (mlp.grouped_mlp, the model's settings)
  read X         the 512 MB read, XLA's sum over the first X MB of the layer's gate/up stack, the experts
  read X+other   ... and a 100 MB read of other weights between them (the attention phase reads ~105 MB)
  reread X       the prefix summed twice in a row (the second read's time says whether L2 kept it)

The expert kernel's time comes from a trace of 8 layers per variant (median of its calls), with the kernels of one
step between two expert kernels (name, us); `step_us` is each variant's whole step by wall clock.

  python benchmarks/l2_expert_prefix_probe.py --out $BENCH/l2_prefix.jsonl
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from orl_jax import runtime  # noqa: E402

runtime.configure(None)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from bench_io import recorder  # noqa: E402
from expert_case import CPU, experts, routed_case  # noqa: E402
from timing import median_seconds  # noqa: E402
from xplane_summary import kernel_events  # noqa: E402

LAYERS, STEPS = 4, 8
# a CPU run is a smoke run (tiny shapes, interpret mode, no timing sense): its "MB" is 16 KB
MB, FLUSH_MB, OTHER_MB = (1 << 14, 4, 2) if CPU else (1 << 20, 512, 100)


def zero_of(s):
    """A float32 zero XLA cannot fold (s * 0 is NaN for an infinite s): ties a step to the one that made s."""
    return (s * 0).astype(jnp.float32)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="l2_prefix.jsonl")
    ap.add_argument("--mb", default="1" if CPU else "16,32,48", help="prefix sizes in MB")
    args = ap.parse_args()
    record = recorder(args.out)
    arrays = routed_case(LAYERS) | dict(flush=jnp.ones((FLUSH_MB * MB // 2,), jnp.bfloat16),
                                        other=jnp.ones((OTHER_MB * MB // 2,), jnp.bfloat16))

    def variant(kind, mb, with_other):  # arrays as arguments: a closure would embed them as constants
        def steps(a):
            def step(i, acc):
                i = i % LAYERS
                s = jnp.sum(a["flush"].astype(jnp.float32)) + zero_of(acc)
                if kind in ("read", "reread"):
                    prefix = jax.lax.dynamic_slice(a["tiles"].reshape(LAYERS, -1), (i, 0), (1, mb * MB // 2))
                    s = jnp.sum(prefix.astype(jnp.float32) + zero_of(s))
                    if kind == "reread":  # the same bytes again: from L2 if they stayed there
                        s = jnp.sum(prefix.astype(jnp.float32) + zero_of(s))
                if with_other:
                    s = jnp.sum(a["other"].astype(jnp.float32) + zero_of(s))
                y = experts(a, i, a["x"] + zero_of(s).astype(a["x"].dtype))
                return acc + jnp.sum(y[:8].astype(jnp.float32))

            return jax.lax.fori_loop(0, STEPS, step, jnp.float32(0))

        g = jax.jit(steps)
        return lambda: g(arrays)

    plans = [("cold", 0, False), ("cold", 0, True)]
    for mb in map(int, args.mb.split(",")):
        plans += [("read", mb, False), ("read", mb, True), ("reread", mb, False)]
    for kind, mb, with_other in plans * 2:  # twice, alternating
        f = variant(kind, mb, with_other)
        step_us = median_seconds(f, reps=5) / STEPS * 1e6
        d = tempfile.mkdtemp()
        with jax.profiler.trace(d):
            jax.block_until_ready(f())
        ev = sorted(kernel_events(d), key=lambda e: e[2])
        long = sorted(ns / 1e3 for _, _, _, ns in ev if ns > 250e3)
        ends = [j for j, e in enumerate(ev) if e[3] > 250e3]  # the step between two expert kernels, in order
        step = [(name[:40], round(ns / 1e3, 1)) for name, _, _, ns in ev[ends[3] + 1:ends[4]]] if len(ends) > 4 else []
        record(kind=kind, prefix_mb=mb, other_mb=OTHER_MB if with_other else 0, step_us=step_us,
               expert_us=float(np.median(long)) if long else None, expert_calls=len(long),
               expert_us_min=long[0] if long else None, kernels_between=step)


if __name__ == "__main__":
    main()
