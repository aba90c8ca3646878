"""Split-K weight-streaming GEMM for small M (batch-1 decoding: M = block length <= 64).

At M = 32 a GEMM with a 2560 x 6144 bf16 weight reads 31 MB and does 1 GFLOP: it is bound by reading the weight
once. cuBLAS reaches 35-60% of HBM bandwidth on these shapes (../shared/REFERENCE.md) because it launches too
few blocks. Here every program owns one BN-wide column tile of the weight and every S-th BK-deep chunk of the
contraction (split-K), streams those tiles through tensor-core dots into a float32 accumulator, and writes a
partial sum; the S partials ([S, M, N] float32, a few % of the weight's bytes) are summed by XLA. Batched over many
groups (experts), the groups alone fill the chip: the kernel then runs unsplit and writes the output dtype
(`blocks_for`, FILLED).

Stacked weights: `w` may be a layer stack [L, K, N] with `layer` an int32 scalar. The kernel then reads layer
`layer` in place. Under `lax.scan` over stacked params the body's slice `w[i]` can reach a custom call as a
copy: one extra write and read of every weight (XLA's own GEMM on such a slice measured +13%, not a copy).

Pallas, Triton lowering (pallas.triton). Runs in interpret mode on CPU for tests.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from orl_jax_kernels.pallas_args import layer_operand, triton_params


@dataclass(frozen=True)
class Blocks:
    bn: int = 128  # output columns per program
    bk: int = 128  # contraction rows per chunk
    splits: int = 4  # programs sharing one column tile (split-K)
    num_warps: int = 4
    num_stages: int = 4


# Block sizes per (K, N) measured best on a GPU (kernels/small_m_gemm/bench.py writes such a table; `load_tuned`
# reads it). None: XLA's GEMM was faster for that shape (`supported` says no, callers fall back). Shapes not
# listed get `blocks_for`'s default tiles.
TUNED: dict[tuple[int, int], Blocks | None] = {}


def load_tuned(path) -> dict[tuple[int, int], Blocks | None]:
    """Fill TUNED from a JSON table [{"k":, "n":, "blocks": {...} or null}, ...]; call before the first trace."""
    import json
    from pathlib import Path

    return set_tuned(json.loads(Path(path).read_text()), replace=False)


def set_tuned(rows, replace: bool = True) -> dict[tuple[int, int], Blocks | None]:
    """TUNED from table rows as load_tuned reads them (replace: drop the entries there were). Traces made before
    keep their tiles: jax.clear_caches() makes the next call trace again."""
    if replace:
        TUNED.clear()
    for row in rows:
        TUNED[(int(row["k"]), int(row["n"]))] = Blocks(**row["blocks"]) if row["blocks"] else None
    return TUNED


# Programs (groups x column tiles) from which split-K is not needed to fill an H200's 132 SMs. Above it the kernel
# runs unsplit and writes its output in the final dtype: split-K's float32 partials cost DiffusionGemma's experts
# (128 groups of 64 rows) 4 x 92 MB written and read again per down product, on 0.5 GB of weights
# (benchmarks/results/2026-11-30_dg_profile_h200x2.md: down at 52% of bandwidth).
FILLED = 4 * 132


def blocks_for(k: int, n: int, groups: int = 1) -> Blocks | None:
    """The tuned blocks of (K, N), else Blocks() with the largest tiles (<= its own) that divide K and N, unsplit
    when `groups` x column tiles fill the chip (FILLED)."""
    if (k, n) in TUNED:
        return TUNED[(k, n)]
    d = Blocks()
    tile = lambda size, want: next((t for t in (want, 64, 32, 16) if t <= want and size % t == 0), want)  # noqa: E731
    bn = tile(n, d.bn)
    return Blocks(bn=bn, bk=tile(k, d.bk), splits=1 if groups * (n // bn) >= FILLED else d.splits,
                  num_warps=d.num_warps, num_stages=d.num_stages)


def _kernel(layer_ref, rows_ref, x_ref, w_ref, o_ref, *, bk: int, n_chunks: int, stacked: bool):
    e, s = pl.program_id(0), pl.program_id(2)
    n_splits = pl.num_programs(2)
    m, bn = x_ref.shape[1], w_ref.shape[-1]
    layer = layer_ref[0] if stacked else 0

    def body(j, acc):
        k0 = pl.multiple_of((s + j * n_splits) * bk, bk)
        xb = x_ref[0, :, pl.ds(k0, bk)]
        wb = w_ref[layer, 0, pl.ds(k0, bk), :] if stacked else w_ref[0, pl.ds(k0, bk), :]
        return acc + jnp.dot(xb, wb, preferred_element_type=jnp.float32)

    trips = (n_chunks - s + n_splits - 1) // n_splits
    trips = jnp.where(rows_ref[e] > 0, trips, 0)  # a group without rows reads none of its weight
    o_ref[0, 0] = jax.lax.fori_loop(0, trips, body, jnp.zeros((m, bn), jnp.float32)).astype(o_ref.dtype)


SMEM_BYTES = 220 * 1024  # of the H100/H200's 227 KB of shared memory per block


def pipeline_stages(blocks: Blocks, mp: int) -> int:
    """blocks.num_stages, lowered until Triton's stages - 1 buffers of one weight tile and one x tile fit
    SMEM_BYTES (on an H200 a 128 x 256 weight tile at 4 stages asked for 245760 bytes and failed to launch)."""
    per_stage = (blocks.bn + mp) * blocks.bk * 2
    return max(1, min(blocks.num_stages, 1 + SMEM_BYTES // per_stage))


def supported(m: int, k: int, n: int, blocks: Blocks | None = None) -> bool:
    blocks = blocks or blocks_for(k, n)
    return blocks is not None and m <= 64 and k % blocks.bk == 0 and n % blocks.bn == 0


def small_m_matmul(x: jax.Array, w: jax.Array, layer: jax.Array | None = None, blocks: Blocks | None = None,
                   interpret: bool = False, out_dtype=None) -> jax.Array:
    """x [M, K] @ w [K, N] -> [M, N], or x @ w[layer] for a stack w [L, K, N] and an int32 scalar `layer`.

    M <= 64, K % bk == 0, N % bn == 0 (see `supported`); blocks default to the tuned table, then Blocks()."""
    w = w[:, None] if w.ndim == 3 else w[None]
    return batched_small_m_matmul(x[None], w, layer, blocks=blocks, interpret=interpret, out_dtype=out_dtype)[0]


@functools.partial(jax.jit, static_argnames=("blocks", "interpret", "out_dtype"))
def batched_small_m_matmul(x: jax.Array, w: jax.Array, layer: jax.Array | None = None, rows: jax.Array | None = None,
                           blocks: Blocks | None = None, interpret: bool = False, out_dtype=None) -> jax.Array:
    """Per group e: x[e] [M, K] @ w[e] [K, N] -> [E, M, N] (e.g. experts with their routed tokens in M slots), or
    x[e] @ w[layer, e] for a stack w [L, E, K, N] and an int32 scalar `layer`. rows [E] (optional): groups with 0
    rows are skipped (their weight is not read; their output is 0)."""
    e, m, k = x.shape
    n = w.shape[-1]
    stacked = w.ndim == 4
    layer_arr = layer_operand("small_m_matmul", stacked, layer, w.shape)  # stacked: [L, (E,) K, N]
    if w.shape[-3] != e or w.shape[-2] != k:
        raise ValueError(f"small_m_matmul: x of shape {x.shape} does not match w of shape {w.shape}")
    blocks = blocks or blocks_for(k, n, e)
    if not supported(m, k, n, blocks):
        raise ValueError(f"small_m_matmul: shape M={m}, K={k}, N={n} not supported with {blocks}")
    mp = max(16, 1 << (m - 1).bit_length())  # tensor-core dots need M >= 16
    xp = jnp.pad(x, ((0, 0), (0, mp - m), (0, 0))) if mp != m else x
    n_chunks = k // blocks.bk
    splits = min(blocks.splits, n_chunks)
    w_spec = (pl.BlockSpec((w.shape[0], 1, k, blocks.bn), lambda g, j, s: (0, g, 0, j)) if stacked
              else pl.BlockSpec((1, k, blocks.bn), lambda g, j, s: (g, 0, j)))
    rows = jnp.ones((e,), jnp.int32) if rows is None else rows.astype(jnp.int32)
    out_dtype = out_dtype or x.dtype
    partial = pl.pallas_call(
        functools.partial(_kernel, bk=blocks.bk, n_chunks=n_chunks, stacked=stacked),
        # split: float32 partial sums, added by XLA; unsplit: the output itself
        out_shape=jax.ShapeDtypeStruct((splits, e, mp, n), jnp.float32 if splits > 1 else out_dtype),
        grid=(e, n // blocks.bn, splits),
        in_specs=[pl.BlockSpec((1,), lambda g, j, s: (0,)),
                  pl.BlockSpec((e,), lambda g, j, s: (0,)),
                  pl.BlockSpec((1, mp, k), lambda g, j, s: (g, 0, 0)),
                  w_spec],
        out_specs=pl.BlockSpec((1, 1, mp, blocks.bn), lambda g, j, s: (s, g, 0, j)),
        interpret=interpret,
        **triton_params(blocks.num_warps, pipeline_stages(blocks, mp), interpret),
    )(layer_arr, rows, xp, w)
    out = partial.sum(axis=0).astype(out_dtype) if splits > 1 else partial[0]
    return out[:, :m]
