"""The kernels of read_ceiling_probe.py, once each, for Nsight Compute's hardware counters (issue #4): XLA's flat sum
over one 26B layer's expert bytes (1.52 GB) and the fused expert kernel (mlp.grouped_mlp, the model's settings) on a
26B layer with 256 tokens x top-8 routed uniformly. Session 45 timed the first at 4.43-4.47 TB/s and the second at
4.12-4.20; the counters say where the kernel's ~6% goes (DRAM throughput, occupancy, warp stalls).

  XLA_FLAGS=--xla_gpu_autotune_level=0 ncu --clock-control none -k regex:^_kernel -c 1 \\
      --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats \\
      --section LaunchStats --section SchedulerStats --csv python3 benchmarks/ncu_read_kernels.py > experts.csv
and XLA's flat sum alone with `-k regex:reduce -c 4 ... ncu_read_kernels.py flat`. Switches after the mode, e.g.
`experts orl_jax.model.moe.FUSED_TILE=32 orl_jax.model.moe.FUSED_DOWN_BN=64` (narrower tiles). Session 45's
first run (-k 'regex:^(_kernel|.*reduce)' -c 8) profiled eight small reductions of the setup instead, and took 384 s:
ncu slows a JAX process's start a great deal, XLA's autotuning most (the line above took 61 s: counters in
benchmarks/results/2026-12-04_dg_l2_prefetch_h200.md).
(the Firecracker machines' ncu reads the counters; on gVisor it cannot.)
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from orl_jax import runtime  # noqa: E402

runtime.configure(None)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from bench_io import set_switches  # noqa: E402

from orl_jax.model import moe  # noqa: E402
from orl_jax.model.layers import ACTIVATIONS  # noqa: E402
from orl_jax_kernels.grouped_gemm.kernel import group_offsets  # noqa: E402
from orl_jax_kernels.grouped_gemm.mlp import grouped_mlp  # noqa: E402

CPU = jax.default_backend() == "cpu"  # a smoke run: tiny shapes, interpret mode
E, T, TOPK, D, F = (4, 16, 2, 128, 64) if CPU else (128, 256, 8, 2816, 704)


def main():
    what = sys.argv[1] if len(sys.argv) > 1 else "both"  # flat | experts | both: "flat" launches little else
    if what not in ("flat", "experts", "both"):
        raise SystemExit(f"ncu_read_kernels.py [flat|experts|both] [MODULE.NAME=JSON ...], got {what!r}")
    set_switches(sys.argv[2:])  # e.g. orl_jax.model.moe.FUSED_TILE=32 orl_jax.model.moe.FUSED_DOWN_BN=64
    flat = jnp.ones((E * 3 * F * D,), jnp.bfloat16)  # one layer's expert bytes
    total = jax.jit(lambda w: jnp.sum(w.astype(jnp.float32)))
    if what == "flat":
        for _ in range(2):
            print("flat sum", float(total(flat)))
        return
    ks = jax.random.split(jax.random.key(0), 4)
    experts = jax.lax.top_k(jax.random.normal(ks[0], (T, E)), TOPK)[1].reshape(-1)
    order = jnp.argsort(experts, stable=True)
    rows, offsets = (order // TOPK).astype(jnp.int32), group_offsets(jnp.bincount(experts, length=E))
    x = jax.random.normal(ks[1], (T, D), jnp.bfloat16)
    tiles = moe.fuse_gate_up(jax.random.normal(ks[2], (2, E, D, 2 * F), jnp.bfloat16) * 0.02)
    down = jax.random.normal(ks[3], (2, E, F, D), jnp.bfloat16) * 0.02
    experts_fn = jax.jit(lambda x, r, g, dn, o: grouped_mlp(
        x, r, g, dn, o, jnp.int32(1), ACTIVATIONS["gelu_tanh"], *moe.fused_blocks(g), num_stages=moe.FUSED_STAGES,
        one_dot=moe.FUSED_ONE_DOT, interpret=CPU))
    for _ in range(2):  # each twice: the second of each runs with warm clocks and caches of the first
        if what == "both":
            print("flat sum", float(total(flat)))
        print("experts", float(jnp.sum(experts_fn(x, rows, tiles, down, offsets).astype(jnp.float32))))


if __name__ == "__main__":
    main()
