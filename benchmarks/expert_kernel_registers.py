"""Registers, shared memory and resident blocks per SM of the fused expert kernel (kernels/grouped_gemm/mlp.py) at
DiffusionGemma 26B's shapes, per variant, without a GPU (issue #4).

Why: Nsight Compute (benchmarks/results/2026-12-04_dg_l2_prefetch_h200.md) put the kernel at 90.4% of the DRAM peak
against XLA's flat read of the same bytes at 96.5%, with 3 blocks of 4 warps per SM (164 registers per thread and
72 KB of shared memory both at the limit) against the reduction's 56 warps. A variant that keeps more loads in flight
needs more resident blocks: this lists which variants would have them, before any device time is spent.

How: the pallas_call is lowered for CUDA, its Triton IR captured (kernels/pallas_args.triton_modules) and compiled by
the `triton` package for sm_90a, and `ptxas -v` reports the allocation (kernel_registers.allocation). The pip Triton
is not the copy inside jaxlib that compiles a real run, so counts may differ a little (calibrate against the default
variant's 164 registers seen by ncu on the device).

  python benchmarks/expert_kernel_registers.py [--out expert_registers.jsonl]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from types import SimpleNamespace

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from bench_io import recorder  # noqa: E402
from kernel_registers import allocation  # noqa: E402

from orl_jax.model.layers import ACTIVATIONS  # noqa: E402
from orl_jax_kernels.grouped_gemm.mlp import grouped_mlp  # noqa: E402
from orl_jax_kernels.pallas_args import h200_target, triton_modules  # noqa: E402
from orl_jax_kernels.small_m_gemm.kernel import Blocks  # noqa: E402

SM_REGISTERS, SM_SHARED, SM_BLOCKS = 65536, 233472, 32  # per Hopper SM (ncu: 233,472 B shared configuration)
DRIVER_SHARED = 1024  # bytes the driver reserves per block (ncu: "Driver Shared Memory Per Block")
W128, W64 = Blocks(bn=128, bk=64, splits=1), Blocks(bn=64, bk=64, splits=1)  # 128- / 64-wide tiles, K step 64
K32 = Blocks(bn=128, bk=32, splits=1)  # K step 32
# (name, gate/up blocks, down blocks, warps, stages, one_dot, rows per tile): the default first
VARIANTS = [
    ("default", W128, W128, 4, 3, True, 64),
    ("two half-width gate/up products", W128, W128, 4, 3, False, 64),
    ("2 stages", W128, W128, 4, 2, True, 64),
    ("2 stages, two products", W128, W128, 4, 2, False, 64),
    ("8 warps", W128, W128, 8, 3, True, 64),
    ("8 warps, 2 stages", W128, W128, 8, 2, True, 64),
    ("32-row K chunks, 4 stages", K32, K32, 4, 4, True, 64),
    ("32-row K chunks, 3 stages", K32, K32, 4, 3, True, 64),
    ("64-wide tiles", W64, W64, 4, 3, True, 64),
    ("64-wide tiles, 4 stages", W64, W64, 4, 4, True, 64),
    ("128 rows, 8 warps (prefill-sized passes' tiles, moe.FUSED_LONG_BM)", W128, W128, 8, 3, True, 128),
]


def triton_ir(gu: Blocks, dn: Blocks, warps: int, stages: int, one_dot: bool, bm: int = 64) -> str:
    sd = jax.ShapeDtypeStruct
    args = (sd((256, 2816), jnp.bfloat16), sd((2048,), jnp.int32),
            sd((25, 128, 704 * 2 // gu.bn, 2816, gu.bn), jnp.bfloat16), sd((25, 128, 704, 2816), jnp.bfloat16),
            sd((129,), jnp.int32), sd((), jnp.int32))
    with triton_modules() as modules, h200_target():
        fn = lambda x, r, g, d, o, i: grouped_mlp(x, r, g, d, o, i, ACTIVATIONS["gelu_tanh"], gu, dn,  # noqa: E731
                                                  num_warps=warps, num_stages=stages, one_dot=one_dot, bm=bm)
        jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    return modules[0].operation.get_asm(enable_debug_info=False)


def resident_blocks(registers: int, shared: int, warps: int) -> int:
    """Blocks of `warps` warps one SM holds: registers are allocated per warp in units of 256 (8 per thread)."""
    per_warp = -(-registers * 32 // 256) * 256
    return min(SM_REGISTERS // (per_warp * warps), SM_SHARED // (shared + DRIVER_SHARED), SM_BLOCKS)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="also append the rows to this JSON-lines file")
    args = ap.parse_args(argv)
    record = recorder(args.out) if args.out else (lambda **row: print(json.dumps(row), flush=True))
    for name, gu, dn, warps, stages, one_dot, bm in VARIANTS:
        got = allocation(triton_ir(gu, dn, warps, stages, one_dot, bm), SimpleNamespace(num_warps=warps,
                                                                                         num_stages=stages))
        blocks = resident_blocks(got["registers"], got["shared"], warps)
        record(variant=name, gu_bn=gu.bn, bk=gu.bk, dn_bn=dn.bn, warps=warps, stages=stages, one_dot=one_dot, bm=bm,
               **got, blocks_per_sm=blocks, warps_per_sm=blocks * warps)


if __name__ == "__main__":
    main()
