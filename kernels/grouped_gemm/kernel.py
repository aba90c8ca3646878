"""Grouped (ragged) GEMM for mixture-of-experts decoding: rows sorted by expert, each group times its own expert's
weight, the expert weights read in place from the layer stack, experts without rows never read.

Why: at DiffusionGemma's canvas (256 tokens x top-8 of 128 experts) the capacity buckets of model/moe.py hand the
small-M kernel [E, C, D] with C = 4x the mean load: 4x the routed rows gathered, read and written, and an expert
with more tokens than slots needs another round (a while_loop whose predicate goes to the host once per layer).
Here the 2048 routed rows stay in one sorted [M, K] array with group offsets. One program per (expert, column
tile) streams its expert's weight tile once through tensor-core dots for each BM-row tile of its group (one tile
for any group of <= BM rows), loading and storing only the group's rows (masked). XLA's own ragged_dot on an H200
does the work of every group (benchmarks/ragged_dot_probe.py), hence a kernel.

Semantics: jax.lax.ragged_dot(x, w[layer], group_sizes) with float32 accumulation (reference.py), or of x[rows]
when `rows` is given (the MoE's gate/up reads its tokens' rows itself: no sorted copy of x; -0.35 to -0.42 ms per
26B forward, benchmarks/results/2026-12-01_dg_gather_rows_h200.md). Rows past the last group are 0. Pallas,
Triton lowering; interpret mode on CPU for tests.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from orl_jax_kernels.pallas_args import layer_operand, triton_params
from orl_jax_kernels.small_m_gemm.kernel import TUNED, Blocks, blocks_for, pipeline_stages

BM = 64  # rows per tile: a group of <= BM rows reads its weight once (DiffusionGemma: mean 16 rows per expert).
# Read at trace time when grouped_matmul gets no `bm` (benchmarks/diffusion_gemma_generate.py --grouped-bm sets it).
BK = 64  # contraction rows per chunk unless a tuned table says otherwise
# Program order. True (the default): one expert's column tiles are launched next to each other, so programs running
# together read adjacent 256-byte pieces of the same weight rows. False: the expert varies fastest (programs running
# together read the same columns of different experts, 2816 x 1408 x 2 bytes apart at DiffusionGemma's gate/up). On
# an H200 the 26B forward took 16.07 / 16.06 ms with True against 16.60 with False, bracketed in one call, same
# tokens (benchmarks/results/2026-12-01_dg_sort_kernel_stages_h200.md). Read at trace time
# (benchmarks/diffusion_gemma_generate.py --experts-inner sets False).
COLUMNS_INNER = True
LONG_K = 32  # from this many chunks of K, 2 pipeline stages (default_blocks)


def default_blocks(k: int, n: int) -> Blocks | None:
    """The tiles for (K, N): a loaded table's (small_m_gemm.load_tuned), else the small-M GEMM's for many groups
    (their `splits` is unused) with chunks of at most BK rows of K, and at 2 pipeline stages when K takes at least
    LONG_K chunks. On an H200, DiffusionGemma's gate/up (K 2816: 44 chunks):
    - 128-row chunks at 4 stages buffer ~196 KB, one program per SM: the 26B forward 17.60 / 17.57 ms;
    - 64-row chunks at 4 stages, two or three programs per SM: 17.20 (benchmarks/results/
      2026-12-01_dg_concurrent_graphs_h200.md); in a later call 17.03 / 17.07 / 17.11, against 16.74 / 16.81 at 3
      stages and **16.66 / 16.67 at 2** (more programs resident, each with less prefetch; 32-row chunks at 3
      stages 16.70: benchmarks/results/2026-12-01_dg_sort_kernel_stages_h200.md).
    Down (K 704: 11 chunks) keeps 4 stages: 3 or 2 were not faster there."""
    if (k, n) in TUNED:
        return TUNED[(k, n)]
    blocks = blocks_for(k, n, groups=1 << 20)
    if blocks.bk > BK and k % BK == 0:
        blocks = dataclasses.replace(blocks, bk=BK)
    return dataclasses.replace(blocks, num_stages=2) if k // blocks.bk >= LONG_K else blocks


def group_offsets(group_sizes: jax.Array) -> jax.Array:
    """[E] group sizes -> [E + 1] int32: each group's first row, then their end."""
    return jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(group_sizes.astype(jnp.int32))])


def supported(k: int, n: int, blocks: Blocks | None = None) -> bool:
    """The tiles (default_blocks unless given) divide K and N."""
    blocks = blocks or default_blocks(k, n)
    return blocks is not None and k % blocks.bk == 0 and n % blocks.bn == 0


def _kernel(layer_ref, off_ref, rows_ref, x_ref, w_ref, o_ref, *, bk: int, n_chunks: int, bm: int, stacked: bool,
            expert_axis: int):
    from jax.experimental.pallas import triton as plt

    e = pl.program_id(expert_axis)
    bn = w_ref.shape[-1]
    layer = layer_ref[0] if stacked else 0
    start, rows = off_ref[e], off_ref[e + 1] - off_ref[e]

    def tile(t, carry):
        r0 = start + t * bm
        live = (t * bm + jnp.arange(bm)) < rows  # the group's rows of this tile
        # the tile's rows of x: sorted rows in place, or gathered by their source row
        ids = None if rows_ref is None else plt.load(rows_ref.at[pl.ds(r0, bm)], mask=live, other=0)

        def chunk(j, acc):
            k0 = pl.multiple_of(j * bk, bk)
            # a gather indexes both axes by arrays: interpret mode takes no slice beside an array index
            xs = (x_ref.at[pl.ds(r0, bm), pl.ds(k0, bk)] if ids is None
                  else x_ref.at[ids[:, None], (k0 + jnp.arange(bk))[None, :]])
            xb = plt.load(xs, mask=live[:, None], other=0.0)
            wb = w_ref[layer, 0, pl.ds(k0, bk), :] if stacked else w_ref[0, pl.ds(k0, bk), :]
            return acc + jnp.dot(xb, wb, preferred_element_type=jnp.float32)

        acc = jax.lax.fori_loop(0, n_chunks, chunk, jnp.zeros((bm, bn), jnp.float32))
        plt.store(o_ref.at[pl.ds(r0, bm), :], acc.astype(o_ref.dtype), mask=live[:, None])
        return carry

    jax.lax.fori_loop(0, (rows + bm - 1) // bm, tile, 0)  # no rows: the expert's weight is not read


def _with_rows(kernel, have_rows: bool):
    """The kernel with None for the gather's rows when a call passes none."""
    return kernel if have_rows else lambda layer_ref, off_ref, *refs: kernel(layer_ref, off_ref, None, *refs)


@functools.partial(jax.jit, static_argnames=("blocks", "interpret", "bm"))
def grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array, layer: jax.Array | None = None,
                   blocks: Blocks | None = None, interpret: bool = False,
                   offsets: jax.Array | None = None, bm: int | None = None,
                   rows: jax.Array | None = None) -> jax.Array:
    """x [M, K] (rows sorted by group) times w [E, K, N], or the layer `layer` of a stack w [L, E, K, N], group by
    group: group_sizes [E] (int, summing to <= M) -> [M, N] in x's dtype. offsets [E + 1]: the groups' first rows
    and their end, when the caller has them (kernels/expert_sort returns them); else computed from group_sizes.
    bm: rows per tile (a power of two >= 16), BM unless given.
    rows [M] (int32): sorted row r is x[rows[r]] for an x of any number of rows, gathered by the kernel's loads
    (the MoE's tokens: no sorted copy of x is written and read back)."""
    k = x.shape[1]
    e, n = w.shape[-3], w.shape[-1]
    stacked = w.ndim == 4
    layer_arr = layer_operand("grouped_matmul", stacked, layer, w.shape)  # stacked: [L, E, K, N]
    if w.shape[-2] != k or group_sizes.shape != (e,):
        raise ValueError(f"grouped_matmul: x {x.shape}, w {w.shape} and group_sizes {group_sizes.shape} do not match")
    if rows is not None and (rows.ndim != 1 or rows.dtype != jnp.int32):
        raise ValueError(f"grouped_matmul: rows must be a 1-D int32 array, got {rows.dtype}{list(rows.shape)}")
    m = x.shape[0] if rows is None else rows.shape[0]
    bm = BM if bm is None else bm
    if bm < 16 or bm & (bm - 1):
        raise ValueError(f"grouped_matmul: bm must be a power of two >= 16, got {bm}")
    blocks = blocks or default_blocks(k, n)
    if not supported(k, n, blocks):
        raise ValueError(f"grouped_matmul: K={k}, N={n} not supported with {blocks}")
    # Interpret mode clamps a tile's window that leaves the array onto other rows: there the sorted rows (x, or
    # `rows`) get bm spare rows. Triton's masked loads and stores touch only the group's rows, so on a GPU they go
    # in as they lie (the pad was a copy of x per call, ~8 us at DiffusionGemma's gate/up input).
    spare = bm if interpret else 0
    pad = lambda a: jnp.pad(a, ((0, spare),) + ((0, 0),) * (a.ndim - 1)) if spare else a  # noqa: E731
    if offsets is None:
        offsets = group_offsets(group_sizes)
    elif offsets.shape != (e + 1,):
        raise ValueError(f"grouped_matmul: offsets {offsets.shape} for {e} groups, expected ({e + 1},)")
    inner = COLUMNS_INNER
    grid = (n // blocks.bn, e) if inner else (e, n // blocks.bn)
    ge = (lambda f: lambda j, g: f(g, j)) if inner else (lambda f: f)  # index maps in (expert, column) terms
    w_spec = (pl.BlockSpec((w.shape[0], 1, k, blocks.bn), ge(lambda g, j: (0, g, 0, j))) if stacked
              else pl.BlockSpec((1, k, blocks.bn), ge(lambda g, j: (g, 0, j))))
    xs = x if rows is not None else pad(x)
    gathered = [pad(rows)] if rows is not None else []
    out = pl.pallas_call(
        _with_rows(functools.partial(_kernel, bk=blocks.bk, n_chunks=k // blocks.bk, bm=bm, stacked=stacked,
                                     expert_axis=1 if inner else 0), rows is not None),
        out_shape=jax.ShapeDtypeStruct((m + spare, n), x.dtype),
        grid=grid,
        in_specs=[pl.BlockSpec((1,), ge(lambda g, j: (0,))), pl.BlockSpec((e + 1,), ge(lambda g, j: (0,)))]
                 + [pl.BlockSpec((m + spare,), ge(lambda g, j: (0,)))] * len(gathered)
                 + [pl.BlockSpec(xs.shape, ge(lambda g, j: (0, 0))), w_spec],
        out_specs=pl.BlockSpec((m + spare, blocks.bn), ge(lambda g, j: (0, j))),
        interpret=interpret,
        **triton_params(blocks.num_warps, pipeline_stages(blocks, bm), interpret),
    )(layer_arr, offsets, *gathered, xs, w)
    live = jnp.arange(m) < offsets[-1]  # rows past the last group: never written
    return jnp.where(live[:, None], out[:m] if spare else out, 0)
