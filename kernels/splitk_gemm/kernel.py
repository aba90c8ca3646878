"""Split-K GEMM whose partial sums are added inside the kernel: for a canvas's M = 128-256 rows against a weight
with few output columns (Qwen3-4B's o and down at canvas 256, DiffusionGemma's o).

Why: at M = 256, N = 2560 a GEMM has 256 x 2560 outputs, 40 tiles of 128 x 128 for 132 SMs. cuBLAS takes 96 x 64
tiles without splitting K (one wave of 120-132 small tiles) and runs Qwen3-4B's o and down at ~417 TFLOP/s on an
H200, 54% of its rate (benchmarks/results/2026-12-03_engine_invariants_h200.md's canvas-256 profile: 21.7 us per
call, 72 calls per step). Split-K through XLA (S batched GEMMs into float32 partials, summed by a second kernel) was
slower in the engine (kernels/NOTES.md, "split-K through cuBLAS"): the partials' round trip and the extra launch.
Here each of the S programs of an output tile multiplies its share of K's chunks into a float32 [bm, bn]
accumulator and stores it; the last of the S to arrive (an atomic counter per tile) adds the S partials, always in
the order 0..S-1 (the result does not depend on which program came last), and writes the output. No second launch;
the partials are read back while they sit in L2.

Memory order: a program's threads store their partial, meet at a block barrier, then one thread increments the
tile's counter (acquire-release, GPU scope: the pattern of CUTLASS's split-K semaphore); the last program's threads
meet at a block barrier after that atomic and load the partials plainly (the acquire invalidates the SM's L1, and no
program loads a partial twice). Volatile loads there cost ~4 us per partial on an H200 (unvectorized); jax's
Triton lowering rejects the ".cg" cache modifier (a KeyError in its table).

Pallas, Triton lowering; interpret mode on CPU for tests.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from orl_jax_kernels.pallas_args import layer_operand, triton_params


@dataclass(frozen=True)
class SplitBlocks:
    bm: int = 256  # rows per program (M is a multiple of it)
    bn: int = 128  # output columns per program
    bk: int = 64  # contraction rows per chunk
    splits: int = 4  # programs sharing one output tile (K's chunks divided as evenly as they go)
    num_warps: int = 8
    num_stages: int = 3


# Tiles per (K, N) measured faster than XLA's GEMM on a GPU, as rows {"k":, "n":, "blocks": {...}}
# (kernels/splitk_gemm/bench.py --table writes them). Shapes not listed stay with XLA: model/streamed.StackedWeight
# takes this kernel only for a listed shape. Empty by default; read at trace time.
TABLE: list[dict] = []
MIN_M = 128  # fewer rows: the small-M kernel's range (kernels/small_m_gemm), or XLA


def table_blocks(m: int, k: int, n: int) -> SplitBlocks | None:
    """TABLE's tiles for (K, N) if M suits them (MIN_M <= M, a multiple of bm), else None."""
    for row in TABLE:
        if (int(row["k"]), int(row["n"])) == (k, n):
            blocks = SplitBlocks(**row["blocks"])
            return blocks if m >= MIN_M and supported(m, k, n, blocks) else None
    return None


def supported(m: int, k: int, n: int, blocks: SplitBlocks) -> bool:
    return (m % blocks.bm == 0 and k % blocks.bk == 0 and n % blocks.bn == 0
            and 1 <= blocks.splits <= k // blocks.bk)


def _kernel(layer_ref, count_in, x_ref, w_ref, o_ref, part_ref, count_ref, *, bk: int, n_chunks: int,
            splits: int, stacked: bool, interpret: bool):
    from jax.experimental.pallas import triton as plt

    barrier = (lambda: None) if interpret else plt.debug_barrier  # noqa: E731 (interpret mode runs programs in turn)

    del count_in  # aliased to count_ref
    j, i, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    bm, bn = o_ref.shape[0] // pl.num_programs(1), o_ref.shape[1] // pl.num_programs(0)
    layer = layer_ref[0] if stacked else 0
    rows, cols = pl.ds(pl.multiple_of(i * bm, bm), bm), pl.ds(pl.multiple_of(j * bn, bn), bn)

    def chunk(c, acc):
        k0 = pl.multiple_of(c * bk, bk)
        wb = w_ref[layer, pl.ds(k0, bk), cols] if stacked else w_ref[pl.ds(k0, bk), cols]
        return acc + jnp.dot(x_ref[rows, pl.ds(k0, bk)], wb, preferred_element_type=jnp.float32)

    lo, hi = s * n_chunks // splits, (s + 1) * n_chunks // splits
    acc = jax.lax.fori_loop(lo, hi, chunk, jnp.zeros((bm, bn), jnp.float32))
    if splits == 1:
        o_ref[rows, cols] = acc.astype(o_ref.dtype)
        return
    part_ref[s, rows, cols] = acc
    barrier()  # every thread's partial stored before the release
    arrived = plt.atomic_add(count_ref, (i * pl.num_programs(0) + j,), jnp.int32(1))

    @pl.when(arrived == splits - 1)
    def _():
        barrier()  # every thread after the acquire
        total = part_ref[0, rows, cols]
        for t in range(1, splits):
            total = total + part_ref[t, rows, cols]
        o_ref[rows, cols] = total.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("blocks", "interpret"))
def splitk_matmul(x: jax.Array, w: jax.Array, layer: jax.Array | None = None, blocks: SplitBlocks = SplitBlocks(),
                  interpret: bool = False) -> jax.Array:
    """x [M, K] @ w [K, N] -> [M, N] in x's dtype (float32 accumulation), or x @ w[layer] for a stack w [L, K, N]
    read in place at the int32 scalar `layer`. M % bm == 0, K % bk == 0, N % bn == 0, 1 <= splits <= K / bk."""
    m, k = x.shape
    n = w.shape[-1]
    stacked = w.ndim == 3
    layer_arr = layer_operand("splitk_matmul", stacked, layer, w.shape)
    if w.shape[-2] != k or w.dtype != x.dtype:
        raise ValueError(f"splitk_matmul: x {x.dtype}{list(x.shape)} does not match w {w.dtype}{list(w.shape)}")
    if not supported(m, k, n, blocks):
        raise ValueError(f"splitk_matmul: M={m}, K={k}, N={n} not supported with {blocks}")
    grid = (n // blocks.bn, m // blocks.bm, blocks.splits)  # column tiles launch next to each other
    whole = lambda a: pl.BlockSpec(a.shape, lambda j, i, s: (0,) * a.ndim)  # noqa: E731
    count = jnp.zeros((grid[0] * grid[1],), jnp.int32)
    out, _, _ = pl.pallas_call(
        functools.partial(_kernel, bk=blocks.bk, n_chunks=k // blocks.bk, splits=blocks.splits, stacked=stacked,
                          interpret=interpret),
        out_shape=(jax.ShapeDtypeStruct((m, n), x.dtype),
                   jax.ShapeDtypeStruct((blocks.splits, m, n), jnp.float32),  # the partials (scratch)
                   jax.ShapeDtypeStruct(count.shape, jnp.int32)),
        grid=grid,
        in_specs=[whole(layer_arr), whole(count), whole(x), whole(w)],
        out_specs=(pl.BlockSpec((m, n), lambda j, i, s: (0, 0)),
                   pl.BlockSpec((blocks.splits, m, n), lambda j, i, s: (0, 0, 0)),
                   pl.BlockSpec(count.shape, lambda j, i, s: (0,))),
        input_output_aliases={1: 2},  # the counters start at 0 in a buffer of this call's own
        interpret=interpret,
        **triton_params(blocks.num_warps, blocks.num_stages, interpret),
    )(layer_arr, count, x, w)
    return out
