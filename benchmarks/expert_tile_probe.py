"""The one-launch expert kernel (mlp.grouped_mlp through moe.fused_expert_mlp) under other tile switches, alone on a
26B layer (issue #4). Session 45's Nsight Compute counters put it at 90.4% of the DRAM peak with 3 blocks x 4 warps
per SM (164 registers per thread, 72 KB of shared memory), XLA's flat read at 96.5% with 56 warps per SM; narrower
tiles (moe.FUSED_TILE, FUSED_DOWN_BN) or fewer rows per tile (FUSED_BM: an expert gets 16 of the 2048 rows on average
at canvas 256) hold more blocks per SM. Each variant is traced afresh (its layout made again when FUSED_TILE
differs), checked against the defaults' output, and timed per layer of a 4-layer stack, 20 programs per sync (wall
clock); the variants are timed in `--rounds` alternating rounds. Session 46 ran them all: none was faster in the
forward, and the two equal or faster alone were slower there (benchmarks/results/2026-12-04_dg_expert_tiles_h200.md).

  python benchmarks/expert_tile_probe.py --out $BENCH/expert_tiles.jsonl
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from orl_jax import runtime  # noqa: E402

runtime.configure(None)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from bench_io import recorder, switched  # noqa: E402
from expert_case import CPU, experts, routed_case  # noqa: E402
from timing import median_seconds  # noqa: E402

LAYERS, CALLS = (2, 1) if CPU else (4, 20)  # a CPU run is a smoke run: tiny shapes, interpret mode, no timing sense
M = "orl_jax.model.moe."
VARIANTS = {  # name -> switches
    "defaults": {},
    "tile 32, down 64": {M + "FUSED_TILE": 32, M + "FUSED_DOWN_BN": 64},
    "32 rows": {M + "FUSED_BM": 32},
    "16 rows": {M + "FUSED_BM": 16},
    "32 rows, down 64": {M + "FUSED_BM": 32, M + "FUSED_DOWN_BN": 64},
    "32 rows, 4 stages": {M + "FUSED_BM": 32, M + "FUSED_STAGES": 4},
    "16 rows, 4 stages": {M + "FUSED_BM": 16, M + "FUSED_STAGES": 4},
    "tile 32, down 64, 32 rows": {M + "FUSED_TILE": 32, M + "FUSED_DOWN_BN": 64, M + "FUSED_BM": 32},
    "32 rows, 8 warps": {M + "FUSED_BM": 32, M + "FUSED_WARPS": 8},
    "gate/up bk 128": {M + "FUSED_GU_BK": 128},
    "gate/up bk 128, 2 stages": {M + "FUSED_GU_BK": 128, M + "FUSED_STAGES": 2},
    "gate/up bk 128, 32 rows, 2 stages": {M + "FUSED_GU_BK": 128, M + "FUSED_BM": 32, M + "FUSED_STAGES": 2},
    "gate/up bk 32": {M + "FUSED_GU_BK": 32},
    "gate/up bk 32, 4 stages": {M + "FUSED_GU_BK": 32, M + "FUSED_STAGES": 4},
    "bk 32": {M + "FUSED_GU_BK": 32, M + "FUSED_DN_BK": 32},
    "down bk 32": {M + "FUSED_DN_BK": 32},
    "bk 32, 32 rows, 4 stages": {M + "FUSED_GU_BK": 32, M + "FUSED_DN_BK": 32, M + "FUSED_BM": 32,
                                 M + "FUSED_STAGES": 4},
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="expert_tiles.jsonl")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--only", nargs="*", choices=sorted(VARIANTS), help="these variants (and the defaults)")
    args = ap.parse_args()
    if args.rounds < 1:
        raise ValueError(f"--rounds must be >= 1, got {args.rounds}")
    record = recorder(args.out)
    names = ["defaults"] + [n for n in (args.only or VARIANTS) if n != "defaults"]
    reference = None
    for rnd in range(args.rounds):
        for name in names:
            with switched(VARIANTS[name]):
                jax.clear_caches()  # the kernel traced again under these switches
                a = routed_case(LAYERS)  # the same weights and routing; the layout of this FUSED_TILE
                g = jax.jit(lambda a: [experts(a, jnp.int32(i)) for i in range(LAYERS)])
                try:
                    out = jnp.stack(g(a)).astype(jnp.float32)
                    us = median_seconds(g, a, reps=5, calls=CALLS) / LAYERS * 1e6
                except Exception as ex:  # a tiling the lowering or the chip rejects
                    record(variant=name, round=rnd, error=repr(ex)[:300])
                    continue
            if reference is None:
                reference = out
            rel = float(jnp.linalg.norm(out - reference) / jnp.linalg.norm(reference))
            layer_bytes = a["tiles"][0].nbytes + a["down"][0].nbytes
            record(variant=name, round=rnd, us=us, tb_s=layer_bytes / us / 1e6, rel_err_vs_defaults=rel,
                   set=VARIANTS[name])
            del a


if __name__ == "__main__":
    main()
