"""Registers, spills and shared memory of kernels/decode_attention at a shape, per Blocks, without a GPU.

Why: a program whose live values pass 255 registers per thread spills them to local memory, which no timing names.
DiffusionGemma's sliding layers ([128, 256] float32 accumulator plus the [128, 256] bf16 query tile) were found
spilling this way (benchmarks/results/2026-12-02_dg_attention_spills_h200.md).

How: the pallas_call is lowered for CUDA on any host, its Triton IR captured from jax's Pallas lowering
(kernels/pallas_args.triton_modules, as the tests' IR verification does), compiled by the `triton` package (not an
orl_jax dependency: `pip install triton`; torch ships it) for sm_90a, and `ptxas -v` (the one Triton bundles)
reports the allocation. Triton here is the pip package, not the copy inside XLA that compiles the kernel in a real
run, so counts may differ between versions.

  python benchmarks/kernel_registers.py --shape 1,256,16,8,256,768 --blocks '{"bl": 64, "num_warps": 8}' ...
(shape: batch, queries, query heads, kv heads, head dim, cache slots; no --blocks: the library's choice.)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from orl_jax_kernels.decode_attention import kernel  # noqa: E402
from orl_jax_kernels.pallas_args import h200_target, triton_modules  # noqa: E402

HOPPER_SMEM = 232448  # bytes of shared memory one Hopper (H100 / H200) block may use: 227 KB


def triton_ir(shape, blocks: kernel.Blocks) -> str:
    """The Triton IR (text) of cached_attention at `shape` with `blocks`."""
    b, l, n, kv, h, s = shape
    bf16, i8 = jnp.bfloat16, jnp.int8
    args = [jax.ShapeDtypeStruct(x, t) for x, t in [((b, l, n, h), bf16), ((b, s, kv, h), bf16), ((b, s, kv, h), bf16),
                                                   ((b, l, s), i8), ((b, l, kv, h), bf16), ((b, l, kv, h), bf16),
                                                   ((b, l, l), i8)]]
    with triton_modules() as modules, h200_target():
        fn = lambda *a: kernel.cached_attention(*a, scale=1.0, blocks=blocks)  # noqa: E731
        jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    return modules[0].operation.get_asm(enable_debug_info=False)


def allocation(ir: str, blocks: kernel.Blocks) -> dict:
    """Compile the IR for sm_90a; ptxas's registers, spill bytes and the kernel's shared memory."""
    try:
        import triton
        from triton.backends.compiler import GPUTarget
    except ImportError as e:
        raise SystemExit(f"kernel_registers: needs the `triton` package (pip install triton): {e}") from e
    from triton.backends.nvidia import compiler as nvidia

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.ttir")
        with open(path, "w") as f:
            f.write(ir)
        compiled = triton.compile(path, target=GPUTarget("cuda", 90, 32),
                                  options=dict(num_warps=blocks.num_warps, num_stages=blocks.num_stages))
        ptx = os.path.join(tmp, "kernel.ptx")
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        ptxas = nvidia.get_ptxas(90).path if hasattr(nvidia, "get_ptxas") else nvidia._path_to_binary("ptxas")[0]
        log = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", ptx, "-o", os.devnull],
                             capture_output=True, text=True, check=True).stderr
    number = lambda pattern: int(re.search(pattern, log).group(1))  # noqa: E731
    return dict(registers=number(r"Used (\d+) registers"), spill_stores=number(r"(\d+) bytes spill stores"),
                shared=compiled.metadata.shared, fits=compiled.metadata.shared <= HOPPER_SMEM)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="1,256,16,8,256,768", help="b,l,n,kv,h,s (default: DiffusionGemma's sliding "
                                                                  "layers at canvas 256 over a 768-slot cache)")
    ap.add_argument("--blocks", action="append", default=[], help="Blocks fields as JSON; repeatable")
    args = ap.parse_args(argv)
    shape = tuple(int(x) for x in args.shape.split(","))
    if len(shape) != 6:
        raise ValueError(f"--shape: want 6 comma-separated integers (b,l,n,kv,h,s), got {args.shape!r}")
    b, l, n, kv, h, s = shape
    chosen = [kernel.blocks_for(l, s, h, n // kv)] if not args.blocks else []
    for blocks in chosen + [kernel.Blocks(**json.loads(j)) for j in args.blocks]:
        print(json.dumps(dict(shape=args.shape, blocks=dataclasses.asdict(blocks),
                              **allocation(triton_ir(shape, blocks), blocks))))


if __name__ == "__main__":
    main()
