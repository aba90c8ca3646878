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

import argparse  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from bench_io import set_switches  # noqa: E402
from expert_case import D, E, F, experts, routed_case  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("what", nargs="?", default="both", choices=("flat", "experts", "both"),
                    help='"flat" launches little else for a name filter to catch')
    ap.add_argument("switches", nargs="*", metavar="MODULE.NAME=JSON",
                    help="e.g. orl_jax.model.moe.FUSED_TILE=32 orl_jax.model.moe.FUSED_DOWN_BN=64")
    args = ap.parse_args()
    set_switches(args.switches)
    flat = jnp.ones((E * 3 * F * D,), jnp.bfloat16)  # one layer's expert bytes
    total = jax.jit(lambda w: jnp.sum(w.astype(jnp.float32)))
    a = routed_case(2) if args.what != "flat" else None
    run = jax.jit(lambda a: jnp.sum(experts(a, jnp.int32(1)).astype(jnp.float32)))
    for _ in range(2):  # each twice: the second of each runs with warm clocks and caches of the first
        if args.what != "experts":
            print("flat sum", float(total(flat)))
        if a is not None:
            print("experts", float(run(a)))

if __name__ == "__main__":
    main()
