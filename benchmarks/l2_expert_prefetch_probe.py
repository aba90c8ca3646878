"""Does DiffusionGemma's gate/up expert kernel (kernels/grouped_gemm, bandwidth-bound) run faster when its first
experts were read into L2 just before it (kernels/l2_prefetch)? The question before moe.PREFETCH_EXPERTS is timed in
the forward.

At the 26B's gate/up (256 tokens x top-8 of 128 experts, K 2816, N 1408; a 2-layer stack read at layer 1), median ms
of R repetitions inside one jitted fori_loop of, in order (each step waits for the one before):
  flush                       read a 512 MB buffer (evicts L2)
  flush + gemm                then the grouped kernel (cold)
  flush + pre(n) + gemm       then the prefetch of experts [0, n), then the grouped kernel
  flush + pre(n)              the same without the kernel
  flush + pre(n) + other + gemm   with a 36 MB read between (the dense MLP's weights pass through L2 in the forward)
The kernel's cold time is (flush + gemm) - flush; after the prefetch (flush + pre + gemm) - (flush + pre). Saved us
against the bytes prefetched (n x 7.9 MB) at 4.3 TB/s says how much of the prefetch the kernel used.

  python benchmarks/l2_expert_prefetch_probe.py --out l2_experts.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

ap = argparse.ArgumentParser()
ap.add_argument("--out", default="l2_experts.jsonl")
ap.add_argument("--experts", default="2,4,6", help="experts to prefetch, comma-separated")
ap.add_argument("--policies", default="evict_last,evict_normal")
ap.add_argument("--reps", type=int, default=30, help="repetitions inside one timed call")
args = ap.parse_args()
counts = [int(n) for n in args.experts.split(",")]
if any(not 0 < n <= 128 for n in counts) or args.reps < 1:
    ap.error(f"--experts must lie in [1, 128] and --reps be positive, got {args.experts!r}, {args.reps}")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from timing import median_seconds  # noqa: E402

from orl_jax.model.moe import _sorted_rows  # noqa: E402
from orl_jax_kernels.grouped_gemm.kernel import grouped_matmul  # noqa: E402
from orl_jax_kernels.l2_prefetch.kernel import prefetch_experts  # noqa: E402

T, D, E, F, TOP = 256, 2816, 128, 704, 8


def log(**kw):
    kw |= {"device": jax.devices()[0].device_kind, "jax": jax.__version__}
    print(json.dumps(kw), flush=True)
    with open(args.out, "a") as f:
        f.write(json.dumps(kw) + "\n")


def program(prefetch: int, policy: str | None, other: bool, gemm: bool):
    """One jitted loop of args.reps steps; each step's parts run in order (barriers)."""

    def run(x, w, big, dense, experts):
        tokens, _, sizes, offsets = _sorted_rows(experts, E, kernel=True)

        def step(_, acc):
            zero = (acc * 0).astype(x.dtype)  # each read depends on the step (else XLA hoists it out of the loop)
            s = jnp.max(big + zero)  # the flush
            x1, s = jax.lax.optimization_barrier((x + zero, s))
            after = s
            if prefetch:
                after = prefetch_experts(w, jnp.int32(1), prefetch, x1, policy=policy)
                x1, after = jax.lax.optimization_barrier((x1, after))
            if other:
                r = jnp.max(dense + after.reshape(-1)[0].astype(dense.dtype) * 0)
                x1, after = jax.lax.optimization_barrier((x1, r))
            acc = acc + jnp.max(after).astype(jnp.float32) * 0
            if gemm:
                y = grouped_matmul(x1, w, sizes, jnp.int32(1), offsets=offsets, rows=tokens)
                acc = acc + y[0, 0].astype(jnp.float32)
            return acc

        return jax.lax.fori_loop(0, args.reps, step, jnp.float32(0))

    return jax.jit(run)


ks = jax.random.split(jax.random.key(0), 3)
x = jax.random.normal(ks[0], (T, D), jnp.bfloat16)
w = (jax.random.normal(ks[1], (2, E, D, 2 * F), jnp.float32) * 0.02).astype(jnp.bfloat16)
experts = jax.lax.top_k(jax.random.normal(ks[2], (T, E)), TOP)[1].astype(jnp.int32)
big = jnp.ones((256 * 2**20,), jnp.bfloat16)  # 512 MB
dense = jnp.ones((18 * 2**20,), jnp.bfloat16)  # 36 MB: the dense MLP's weights
data = (x, w, big, dense, experts)
t0 = time.perf_counter()
ms = lambda *flags: median_seconds(program(*flags), *data) * 1e3 / args.reps  # noqa: E731
flush, cold = ms(0, None, False, False), ms(0, None, False, True)
log(what="l2_experts", variant="cold", flush_ms=flush, gemm_us=(cold - flush) * 1e3)
for policy in args.policies.split(","):
    for n in counts:
        for other in (False, True):
            pre, both = ms(n, policy, other, False), ms(n, policy, other, True)
            gemm = (both - pre) * 1e3
            log(what="l2_experts", variant=f"prefetch {n}" + (" + 36 MB read" if other else ""), policy=policy,
                experts=n, gemm_us=gemm, saved_us=(cold - flush) * 1e3 - gemm,
                floor_saving_us=n * D * 2 * F * 2 / 4.3e12 * 1e6, prefetch_us=(pre - flush) * 1e3,
                t=round(time.perf_counter() - t0, 1))
