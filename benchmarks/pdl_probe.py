"""Issue #3: does programmatic dependent launch (PDL) overlap dependent Pallas Mosaic GPU kernels in XLA's graphs?

Sessions 32-37 found each dependent launch on the block-32 step's chain paying ~3.6-4 us before it reads a byte, and a
persistent kernel's barrier costing the same in pipeline drain and refill (benchmarks/results/
2026-12-03_persistent_chain_h200.md). PDL is the launch-level answer: a kernel launched with programmatic stream
serialization may start while its predecessor still runs and does its independent work (a GEMM: its weight tiles)
before `griddepcontrol.wait`, which holds it until the predecessor's memory is visible. In jax 0.11 a Pallas Mosaic GPU
kernel that calls `plgpu.griddepcontrol_wait()` carries the PDL effect, its module `mosaic_gpu.uses_pdl`, and jaxlib's
launcher sets the launch attribute; whether the overlap survives XLA's command buffers (CUDA graphs) is what this
measures.

A chain of L kernels y_i = y_(i-1) + 1 over [P x 8, 128] float32 (P programs, one [8, 128] tile each). Each kernel
first calls `griddepcontrol_launch_dependents` (its successor may launch at once), then does W iterations of
independent scalar work per thread (standing in for a GEMM's weight stream), then (with PDL) `griddepcontrol_wait`,
then reads its predecessor's tile, adds 1 and writes. Without PDL the same kernel omits the wait. Per kernel = the
difference between two chain lengths over the extra kernels; the chain's result must equal x + L (a wrong value means
the wait did not order the read).

  python benchmarks/pdl_probe.py --out pdl.jsonl
  python benchmarks/pdl_probe.py --export     # lower for CUDA on any machine (no GPU): the kernels' MLIR only
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

ap = argparse.ArgumentParser()
ap.add_argument("--out", default="pdl_probe.jsonl")
ap.add_argument("--lengths", default="16,64", help="two chain lengths, comma-separated")
ap.add_argument("--programs", default="1,132", help="programs (CTAs) per kernel, comma-separated")
ap.add_argument("--work", default="0,2000,8000", help="iterations of independent work per thread, comma-separated")
ap.add_argument("--modes", default="graph,stream",
                help="graph: compiled into CUDA graphs as the engine's programs are; stream: XLA's default launches")
ap.add_argument("--export", action="store_true", help="lower every variant for CUDA and print its size (any machine)")
args = ap.parse_args()
from bench_io import chain_lengths, recorder  # noqa: E402

lengths = chain_lengths(ap, args.lengths)


def int_list(flag: str, text: str, lo: int) -> list[int]:
    try:
        vals = [int(v) for v in text.split(",")]
    except ValueError:
        ap.error(f"{flag} takes comma-separated integers, got {text!r}")
    if any(v < lo for v in vals):
        ap.error(f"{flag} values must be >= {lo}, got {text!r}")
    return vals


programs_list = int_list("--programs", args.programs, 1)
modes = args.modes.split(",")
if not modes or set(modes) - {"graph", "stream"}:
    ap.error(f"--modes takes graph and/or stream, got {args.modes!r}")
work_list = int_list("--work", args.work, 0)

from orl_jax import runtime  # noqa: E402

runtime.configure(None)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import mosaic_gpu as plgpu  # noqa: E402

ROWS, COLS = 8, 128  # one program's tile


def _kernel(x_gmem, o_gmem, tile, bar, *, work: int, pdl: bool):
    pid = pl.program_id(0)
    rows = pl.ds(pid * ROWS, ROWS)
    plgpu.griddepcontrol_launch_dependents()
    # independent work (no memory): a GEMM's weight stream would go here, ahead of the wait
    acc = jax.lax.fori_loop(0, work, lambda i, a: a * 1.0000001 + 1e-7, jnp.float32(1.0))
    if pdl:
        plgpu.griddepcontrol_wait()
    plgpu.copy_gmem_to_smem(x_gmem.at[rows], tile, bar)
    plgpu.barrier_wait(bar)
    tile[...] = tile[...] + 1.0 + jnp.minimum(acc, 0.0)  # acc >= 1: adds 0, but keeps the work alive
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(tile, o_gmem.at[rows])
    plgpu.wait_smem_to_gmem(0)


def step_fn(programs: int, work: int, pdl: bool):
    shape = jax.ShapeDtypeStruct((programs * ROWS, COLS), jnp.float32)
    return pl.pallas_call(
        functools.partial(_kernel, work=work, pdl=pdl), out_shape=shape, grid=(programs,),
        in_specs=[pl.BlockSpec(memory_space=plgpu.GMEM)], out_specs=pl.BlockSpec(memory_space=plgpu.GMEM),
        scratch_shapes=[plgpu.SMEM((ROWS, COLS), jnp.float32), plgpu.Barrier(num_arrivals=1)],
        compiler_params=plgpu.CompilerParams())


def chain_fn(n: int, programs: int, work: int, pdl: bool):
    step = step_fn(programs, work, pdl)

    def run(x):
        for _ in range(n):
            x = step(x)
        return x
    return run


def compiled(fn, mode: str):
    """graph: as the engine's programs are compiled, in CUDA graphs (command buffers); stream: XLA's defaults."""
    return jax.jit(fn, compiler_options=runtime.ENGINE_COMPILER_OPTIONS) if mode == "graph" else jax.jit(fn)


variants = [(p, w, pdl) for p in programs_list for w in work_list for pdl in (False, True)]

if args.export:
    from jax import export

    for p, w, pdl in variants:
        x = jax.ShapeDtypeStruct((p * ROWS, COLS), jnp.float32)
        text = export.export(jax.jit(chain_fn(2, p, w, pdl)), platforms=["cuda"])(x).mlir_module()
        # jax >= 0.11 also marks a module that waits `mosaic_gpu.uses_pdl` (its launch attribute); 0.10 does not
        print(json.dumps({"programs": p, "work": w, "pdl": pdl, "mlir_chars": len(text),
                          "waits": text.count("griddepcontrol.wait"), "uses_pdl_attr": "uses_pdl" in text}), flush=True)
    sys.exit(0)

from timing import median_seconds  # noqa: E402

record = recorder(args.out)
meta = {"device": jax.devices()[0].device_kind, "jax": jax.__version__}
for mode, (p, w, pdl) in ((m, v) for m in modes for v in variants):
    row = {"what": "pdl_chain", "mode": mode, "programs": p, "work": w, "pdl": pdl, "lengths": lengths, **meta}
    try:
        x = jnp.arange(p * ROWS * COLS, dtype=jnp.float32).reshape(p * ROWS, COLS)
        fns = [compiled(chain_fn(n, p, w, pdl), mode) for n in lengths]
        exact = all(bool(jnp.array_equal(fn(x), x + n)) for fn, n in zip(fns, lengths))
        t = [median_seconds(fn, x, reps=20, calls=10) for fn in fns]
        row.update(exact=exact, ms=[s * 1e3 for s in t],
                   us_per_kernel=(t[1] - t[0]) / (lengths[1] - lengths[0]) * 1e6)
    except Exception as e:  # noqa: BLE001 - one variant failing must not end the sweep
        row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
    record(**row)
