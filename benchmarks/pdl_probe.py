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
first calls `griddepcontrol_launch_dependents` (its successor may launch at once), then does its independent work,
then (with PDL) `griddepcontrol_wait`, then reads its predecessor's tile, adds 1 and writes. The independent work is
either `--read-kb` KB per program of its own slice of a weight array (TMA loads of [64, 256] bf16 tiles, `--in-flight`
at a time: a GEMM's weight stream; 256 KB x 132 programs = 34.6 MB, one Qwen3-4B projection) or `--work` iterations of
a scalar loop per thread (seeded by the program id, so it cannot be folded). Without PDL the same kernel omits the
wait. Per kernel = the difference between two chain lengths over the extra kernels; the chain's result must equal
x + L (a wrong value means the wait did not order the read).

Session 38, jax 0.11.2, one H200 (benchmarks/results/2026-12-03_pdl_chain_h200.md): every chain exact and every PDL
kernel marked, but no overlap in graphs or streams (an 18 us loop per kernel costs 18.0-18.3 us with PDL as without).
Re-run it on a newer jax before building GEMMs that prefetch their weights ahead of the wait.

  python benchmarks/pdl_probe.py --out pdl.jsonl
  python benchmarks/pdl_probe.py --export     # lower for CUDA on any machine (no GPU): the kernels' MLIR only
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

ap = argparse.ArgumentParser()
ap.add_argument("--out", default="pdl_probe.jsonl")
ap.add_argument("--lengths", default="16,64", help="two chain lengths, comma-separated")
ap.add_argument("--programs", default="132", help="programs (CTAs) per kernel, comma-separated")
ap.add_argument("--work", default="0,4000", help="scalar loop iterations per thread before the wait, comma-separated")
ap.add_argument("--read-kb", default="0,256", help="KB of independent weights each program reads before the wait "
                "(multiples of 32), comma-separated")
ap.add_argument("--in-flight", type=int, default=2, choices=(1, 2, 3, 4, 6),
                help="weight tiles in flight per program (32 KB of shared memory each: at <= 3 two programs fit on "
                "one SM, so a successor can start beside its predecessor)")
ap.add_argument("--modes", default="graph,stream",
                help="graph: compiled into CUDA graphs as the engine's programs are; stream: XLA's default launches")
ap.add_argument("--export", action="store_true", help="lower every variant for CUDA and print its size (any machine)")
args = ap.parse_args()
from bench_io import chain_lengths, int_list, recorder  # noqa: E402

lengths = chain_lengths(ap, args.lengths)
TILE_KB = 32  # one TMA load of the independent weights: a [64, 256] bf16 tile (W_TILE below)
programs_list = int_list(ap, "--programs", args.programs, 1)
modes = args.modes.split(",")
if not modes or set(modes) - {"graph", "stream"}:
    ap.error(f"--modes takes graph and/or stream, got {args.modes!r}")
work_list = int_list(ap, "--work", args.work, 0)
read_list = int_list(ap, "--read-kb", args.read_kb, 0)
if any(r % TILE_KB for r in read_list):
    ap.error(f"--read-kb values must be multiples of {TILE_KB} (one [64, 256] bf16 tile), got {args.read_kb!r}")

from orl_jax import runtime  # noqa: E402

runtime.configure(None)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import mosaic_gpu as plgpu  # noqa: E402

ROWS, COLS = 8, 128  # one program's tile of the chained value
W_TILE = (64, 256)  # one TMA load of the independent weights: TILE_KB of bf16
IN_FLIGHT = args.in_flight


def _kernel(x_gmem, w_gmem, link_gmem, o_gmem, tile, bar, w_bufs, w_bars, *, work: int, tiles: int, pdl: bool):
    pid = jax.lax.axis_index("p")
    rows = pl.ds(pid * ROWS, ROWS)
    plgpu.griddepcontrol_launch_dependents()
    # independent work, ahead of the wait: this link's weight slice (a GEMM's weight stream) ...
    if tiles:
        mine = w_gmem.at[link_gmem[0]]

        def load(t):
            src = mine.at[pl.ds((pid * tiles + t) * W_TILE[0], W_TILE[0])]
            plgpu.copy_gmem_to_smem(src, w_bufs.at[t % IN_FLIGHT], w_bars.at[t % IN_FLIGHT])

        for t in range(min(tiles, IN_FLIGHT)):
            load(t)
        for t in range(tiles):  # unrolled: tiles is small and static
            plgpu.barrier_wait(w_bars.at[t % IN_FLIGHT])
            if t + IN_FLIGHT < tiles:
                load(t + IN_FLIGHT)
    # ... or a scalar loop seeded by the program id (nothing to fold)
    acc = jax.lax.fori_loop(0, work, lambda i, a: a * 1.0000001 + 1e-7, pid.astype(jnp.float32) + 1.0)
    if pdl:
        plgpu.griddepcontrol_wait()
    plgpu.copy_gmem_to_smem(x_gmem.at[rows], tile, bar)
    plgpu.barrier_wait(bar)
    tile[...] = tile[...] + 1.0 + jnp.minimum(acc, 0.0)  # acc >= 1: adds 0, but keeps the work alive
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(tile, o_gmem.at[rows])
    plgpu.wait_smem_to_gmem(0)


def step_fn(programs: int, work: int, read_kb: int, pdl: bool):
    """One kernel of the chain through `plgpu.kernel` (jax 0.11 lowers Mosaic GPU kernels only this way; its
    `pl.pallas_call` finds no Mosaic GPU lowering rule): (x, w, link) -> x + 1, reading w[link] first."""
    tiles = read_kb // TILE_KB
    return plgpu.kernel(
        functools.partial(_kernel, work=work, tiles=tiles, pdl=pdl),
        out_type=jax.ShapeDtypeStruct((programs * ROWS, COLS), jnp.float32),
        scratch_types=[plgpu.SMEM((ROWS, COLS), jnp.float32), plgpu.Barrier(num_arrivals=1),
                       plgpu.SMEM((IN_FLIGHT if tiles else 1, *W_TILE), jnp.bfloat16),
                       plgpu.Barrier(num_arrivals=1, num_barriers=IN_FLIGHT)],
        grid=(programs,), grid_names=("p",))


def weights(links: int, programs: int, read_kb: int):
    """Each link's own weights: [links, programs x tiles x 64, 256] bf16 (one row of 64 when nothing is read)."""
    rows = max(programs * (read_kb // TILE_KB), 1) * W_TILE[0]
    return jax.ShapeDtypeStruct((links, rows, W_TILE[1]), jnp.bfloat16)


def chain_fn(n: int, programs: int, work: int, read_kb: int, pdl: bool):
    step = step_fn(programs, work, read_kb, pdl)

    def run(x, w):
        for i in range(n):
            x = step(x, w, jnp.full((1,), i, jnp.int32))
        return x
    return run


def compiled(fn, mode: str):
    """graph: as the engine's programs are compiled, in CUDA graphs (command buffers); stream: XLA's defaults."""
    return jax.jit(fn, compiler_options=runtime.ENGINE_COMPILER_OPTIONS) if mode == "graph" else jax.jit(fn)


variants = [(p, w, r, pdl) for p in programs_list for w in work_list for r in read_list for pdl in (False, True)]

if args.export:
    from jax import export

    for p, w, r, pdl in variants:
        x = jax.ShapeDtypeStruct((p * ROWS, COLS), jnp.float32)
        text = export.export(jax.jit(chain_fn(2, p, w, r, pdl)), platforms=["cuda"])(x, weights(2, p, r)).mlir_module()
        # jax >= 0.11 also marks a module that waits `mosaic_gpu.uses_pdl` (its launch attribute); 0.10 does not
        print(json.dumps({"programs": p, "work": w, "read_kb": r, "pdl": pdl, "mlir_chars": len(text),
                          "waits": text.count("griddepcontrol.wait"), "uses_pdl_attr": "uses_pdl" in text}), flush=True)
    sys.exit(0)

from timing import median_seconds  # noqa: E402

record = recorder(args.out)
meta = {"device": jax.devices()[0].device_kind, "jax": jax.__version__}
for mode, (p, w, r, pdl) in ((m, v) for m in modes for v in variants):
    row = {"what": "pdl_chain", "mode": mode, "programs": p, "work": w, "read_kb": r, "pdl": pdl, "lengths": lengths,
           "in_flight": IN_FLIGHT, **meta}
    try:
        x = jnp.arange(p * ROWS * COLS, dtype=jnp.float32).reshape(p * ROWS, COLS)
        spec = weights(lengths[1], p, r)
        wts = jax.random.normal(jax.random.key(0), spec.shape, spec.dtype)
        fns = [compiled(chain_fn(n, p, w, r, pdl), mode) for n in lengths]
        row["uses_pdl_attr"] = "uses_pdl" in fns[0].lower(x, wts).as_text()  # the launch attribute's marker
        exact = all(bool(jnp.array_equal(fn(x, wts), x + n)) for fn, n in zip(fns, lengths))
        t = [median_seconds(fn, x, wts, reps=20, calls=10) for fn in fns]
        per_kernel = (t[1] - t[0]) / (lengths[1] - lengths[0])
        row.update(exact=exact, ms=[s * 1e3 for s in t], us_per_kernel=per_kernel * 1e6,
                   read_tb_s=p * r * 1024 / per_kernel / 1e12 if r else None)
        del wts
    except Exception as e:  # noqa: BLE001 - one variant failing must not end the sweep
        row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
        row["where"] = traceback.format_exc(limit=-4)[-1500:]  # an assertion inside jax says nothing by itself
    record(**row)
