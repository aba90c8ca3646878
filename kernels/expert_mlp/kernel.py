"""A whole expert MLP per program: act(x @ gate) * (x @ up) @ down for the rows routed to one expert, in one launch.

Why: DiffusionGemma's experts ran as two grouped GEMMs (kernels/grouped_gemm) with XLA's activation between them:
gate/up at 4.09 TB/s and down at 3.68 against ~4.23 that the chip reads under load, plus the activation's launch and
each kernel's fill and last wave. Here each program takes one expert: it streams the expert's gate/up tiles, keeps
act(g) * u for its rows in a small scratch (global memory: [M, F] bf16, mostly L2), passes a block barrier and
streams the expert's down tiles. Nothing between the two products waits for the whole grid.

Weights come as the model holds them (gate/up [L, E, D, 2F] as gate | up, down [L, E, F, D]: a program reads bf
gate and bf up columns of each K row, then bn down columns), or in a tiled layout (tile_gate_up / tile_down) in
which every program reads one contiguous stream:
- gate/up [L, E, J, D, 2 * bf]: tile j holds the gate columns j * bf .. + bf and then the same up columns;
- down [L, E, N, F, bn]: tile n holds the output columns n * bn .. + bn.
Each product runs as one flat loop over (tile, K chunk), so Triton's pipeliner streams across tile boundaries.

Semantics (reference.py): for each expert e with sorted rows r in [offsets[e], offsets[e + 1]) and x_r = x[rows[r]],
y_r = (act(round(x_r @ gate_e)) * round(x_r @ up_e)) rounded to x's dtype, times down_e, float32 accumulation.
Rows past offsets[-1] are not written (their values are unspecified). Pallas, Triton lowering; interpret mode on
CPU for tests.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from orl_jax_kernels.pallas_args import triton_params

BM = 64  # rows per tile (wgmma's M); a group over BM rows takes further tiles, each reading the weights again


@dataclasses.dataclass(frozen=True)
class Tiles:
    bf: int = 64  # gate/up columns per tile (of F; the tile is 2 * bf wide)
    bn: int = 128  # down's output columns per tile (of D)
    bk1: int = 64  # K chunk of gate/up (of D)
    bk2: int = 64  # K chunk of down (of F)
    num_warps: int = 4
    num_stages: int = 4


# The best of session 39's sweep at the 26B's shapes, tiled layout (kernels/expert_mlp/bench.py on an H200): 377 us
# per layer at 6 stages against 402 at 4; 8 warps, 2 warps, 32-row K chunks and 32- or 64-wide tiles were slower.
# Read at trace time (benchmarks' --set switches them).
NUM_WARPS = 4
NUM_STAGES = 6
DEFAULT = Tiles(num_warps=NUM_WARPS, num_stages=NUM_STAGES)


def tiles_for(d: int, f: int, base: Tiles | None = None) -> Tiles | None:
    """`base` (the default tiles at NUM_WARPS / NUM_STAGES unless given) with each tile cut to the largest power of
    two (>= 16, Triton's least dot size) dividing its dimension (D = 2816 and F = 704 keep the defaults); None if
    some dimension has no such divisor."""
    def cut(size: int, dim: int) -> int:
        while size >= 16 and dim % size:
            size //= 2
        return size

    base = base or dataclasses.replace(DEFAULT, num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    t = dataclasses.replace(base, bf=cut(base.bf, f), bn=cut(base.bn, d), bk1=cut(base.bk1, d), bk2=cut(base.bk2, f))
    return t if min(t.bf, t.bn, t.bk1, t.bk2) >= 16 else None


def tile_gate_up(gate_up: jax.Array, bf: int) -> jax.Array:
    """[..., D, 2F] (gate | up) -> [..., F / bf, D, 2 * bf]: tile j = gate columns j*bf.. then up's same columns."""
    *lead, d, f2 = gate_up.shape
    f = f2 // 2
    if f2 % 2 or f % bf:
        raise ValueError(f"tile_gate_up: 2F = {f2} does not split into gate and up tiles of bf = {bf}")
    t = gate_up.reshape(*lead, d, 2, f // bf, bf)  # [..., D, (gate, up), J, bf]
    return jnp.moveaxis(t, -2, -4).reshape(*lead, f // bf, d, 2 * bf)


def tile_down(down: jax.Array, bn: int) -> jax.Array:
    """[..., F, D] -> [..., D / bn, F, bn]: tile n = output columns n*bn.. ."""
    *lead, f, d = down.shape
    if d % bn:
        raise ValueError(f"tile_down: D = {d} does not split into tiles of bn = {bn}")
    return jnp.moveaxis(down.reshape(*lead, f, d // bn, bn), -2, -3)


def _kernel(layer_ref, off_ref, rows_ref, x_ref, gu_ref, d_ref, y_ref, h_ref, *, t: Tiles, act, interpret: bool):
    from jax.experimental.pallas import triton as plt

    e = pl.program_id(0)
    layer = layer_ref[0]
    tiled = len(gu_ref.shape) == 5
    if tiled:
        n_j, d_model = gu_ref.shape[2], gu_ref.shape[3]
        n_n, f = d_ref.shape[2], d_ref.shape[3]
    else:
        d_model, f = gu_ref.shape[2], gu_ref.shape[3] // 2
        n_j, n_n = f // t.bf, d_ref.shape[3] // t.bn

    def gu_tile(j, ks, up: bool):  # [bk1, bf]: K rows ks of gate (or up) columns j * bf ..
        if tiled:
            return gu_ref[layer, 0, j, ks, pl.ds(t.bf if up else 0, t.bf)]
        return gu_ref[layer, 0, ks, pl.ds(pl.multiple_of(j * t.bf + (f if up else 0), t.bf), t.bf)]

    def d_tile(n, ks):  # [bk2, bn]: K rows ks of down's output columns n * bn ..
        if tiled:
            return d_ref[layer, 0, n, ks, :]
        return d_ref[layer, 0, ks, pl.ds(pl.multiple_of(n * t.bn, t.bn), t.bn)]

    kc1, kc2 = d_model // t.bk1, f // t.bk2
    start, rows = off_ref[e], off_ref[e + 1] - off_ref[e]
    zero = jnp.zeros((BM, t.bf), jnp.float32)

    def row_tile(rt, carry):
        r0 = start + rt * BM
        live = (rt * BM + jnp.arange(BM)) < rows
        ids = plt.load(rows_ref.at[pl.ds(r0, BM)], mask=live, other=0)

        def gate_up(i, acc):  # i = (column tile j, K chunk k)
            j, k = i // kc1, jax.lax.rem(i, kc1)
            k0 = pl.multiple_of(k * t.bk1, t.bk1)
            xb = plt.load(x_ref.at[ids[:, None], (k0 + jnp.arange(t.bk1))[None, :]], mask=live[:, None], other=0.0)
            g = acc[0] + jnp.dot(xb, gu_tile(j, pl.ds(k0, t.bk1), False), preferred_element_type=jnp.float32)
            u = acc[1] + jnp.dot(xb, gu_tile(j, pl.ds(k0, t.bk1), True), preferred_element_type=jnp.float32)
            last = k == kc1 - 1

            @pl.when(last)
            def _():
                gx, ux = g.astype(x_ref.dtype).astype(jnp.float32), u.astype(x_ref.dtype).astype(jnp.float32)
                cols = pl.ds(pl.multiple_of(j * t.bf, t.bf), t.bf)
                plt.store(h_ref.at[pl.ds(r0, BM), cols], (act(gx) * ux).astype(h_ref.dtype), mask=live[:, None])

            return jnp.where(last, 0.0, g), jnp.where(last, 0.0, u)

        jax.lax.fori_loop(0, n_j * kc1, gate_up, (zero, zero))
        if not interpret:  # this program's h stores before its loads of them (all threads of the block)
            plt.debug_barrier()

        def down(i, acc):  # i = (output tile n, K chunk k)
            n, k = i // kc2, jax.lax.rem(i, kc2)
            k0 = pl.multiple_of(k * t.bk2, t.bk2)
            hb = plt.load(h_ref.at[pl.ds(r0, BM), pl.ds(k0, t.bk2)], mask=live[:, None], other=0.0)
            acc = acc + jnp.dot(hb, d_tile(n, pl.ds(k0, t.bk2)), preferred_element_type=jnp.float32)
            last = k == kc2 - 1

            @pl.when(last)
            def _():
                cols = pl.ds(pl.multiple_of(n * t.bn, t.bn), t.bn)
                plt.store(y_ref.at[pl.ds(r0, BM), cols], acc.astype(y_ref.dtype), mask=live[:, None])

            return jnp.where(last, 0.0, acc)

        jax.lax.fori_loop(0, n_n * kc2, down, jnp.zeros((BM, t.bn), jnp.float32))
        return carry

    jax.lax.fori_loop(0, (rows + BM - 1) // BM, row_tile, 0)  # no rows: the expert's weights are not read


@functools.partial(jax.jit, static_argnames=("act", "tiles", "interpret"))
def expert_mlp(x: jax.Array, rows: jax.Array, offsets: jax.Array, gate_up: jax.Array, down: jax.Array,
               layer: jax.Array, act, tiles: Tiles | None = None, interpret: bool = False) -> jax.Array:
    """x [T, D] (the tokens), rows [M] int32 (the token of each row sorted by expert), offsets [E + 1] (each
    expert's first sorted row, then the end); gate_up [L, E, D, 2F] and down [L, E, F, D], or tiled: gate_up
    [L, E, F / bf, D, 2 * bf] (tile_gate_up) and down [L, E, D / bn, F, bn] (tile_down); layer `layer` read in place;
    act: float32 -> float32 (hashable). tiles: tiles_for(D, F) unless given.
    -> [M, D] in x's dtype, row r = expert MLP of x[rows[r]] (rows past offsets[-1] unspecified)."""
    t = tiles or tiles_for(x.shape[-1], down.shape[-2]) or DEFAULT  # F: down's rows in either layout
    if gate_up.ndim == 5:
        n_l, e, n_j, d, bf2 = gate_up.shape
        f = n_j * bf2 // 2
        ok = bf2 == 2 * t.bf and down.shape == (n_l, e, d // t.bn, f, t.bn)
    else:
        n_l, e, d, f2 = gate_up.shape
        f = f2 // 2
        ok = gate_up.ndim == 4 and f % t.bf == 0 and d % t.bn == 0 and down.shape == (n_l, e, f, d)
    if not ok or x.shape[1] != d:
        raise ValueError(f"expert_mlp: gate_up {gate_up.shape}, down {down.shape} and x {x.shape} do not match "
                         f"{t} (see tile_gate_up / tile_down)")
    if d % t.bk1 or f % t.bk2:
        raise ValueError(f"expert_mlp: bk1 = {t.bk1} must divide D = {d} and bk2 = {t.bk2} F = {f}")
    if rows.ndim != 1 or rows.dtype != jnp.int32 or offsets.shape != (e + 1,):
        raise ValueError(f"expert_mlp: rows {rows.dtype}{list(rows.shape)} (1-D int32) and offsets {offsets.shape} "
                         f"(({e + 1},)) expected")
    m = rows.shape[0]
    spare = BM if interpret else 0  # interpret mode clamps a window that leaves the array onto other rows
    rows_in = jnp.pad(rows, (0, spare)) if spare else rows
    full = lambda shape: pl.BlockSpec(shape, lambda g: (0,) * len(shape))  # noqa: E731
    y, _ = pl.pallas_call(
        functools.partial(_kernel, t=t, act=act, interpret=interpret),
        out_shape=(jax.ShapeDtypeStruct((m + spare, d), x.dtype), jax.ShapeDtypeStruct((m + spare, f), x.dtype)),
        grid=(e,),
        in_specs=[full((1,)), full((e + 1,)), full((m + spare,)), full(x.shape),
                  pl.BlockSpec((n_l, 1) + gate_up.shape[2:], lambda g: (0, g) + (0,) * (gate_up.ndim - 2)),
                  pl.BlockSpec((n_l, 1) + down.shape[2:], lambda g: (0, g) + (0,) * (down.ndim - 2))],
        out_specs=(full((m + spare, d)), full((m + spare, f))),
        interpret=interpret,
        **triton_params(t.num_warps, t.num_stages, interpret),
    )(jnp.reshape(layer, (1,)).astype(jnp.int32), offsets.astype(jnp.int32), rows_in, x, gate_up, down)
    return y[:m] if spare else y
