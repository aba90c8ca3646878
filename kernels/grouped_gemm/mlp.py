"""A whole expert MLP, act(x @ gate) * (x @ up) @ down per group, in one launch of many programs.

Why: the MoE's two grouped GEMMs (kernel.py) pay a kernel boundary between them: gate/up's last wave drains, XLA's
activation runs (~4 us per DiffusionGemma layer), down's pipelines fill. Session 39's one-program-per-expert kernel
(git c954eea) removed the boundary but left 4 of 132 SMs idle, and an H200's read scales with busy SMs. Here the
grid keeps the two GEMMs' programs (gate/up tiles, then down tiles), and each program takes its work item from an
atomic ticket, so a down item can only start after every gate/up item was taken. A gate/up item computes act(gate) *
up for its expert's rows and one tile of F columns (the weight in `tile_gated` layout) and counts itself done
on its expert's counter; a down item waits on that counter (all F tiles of its expert) and multiplies the expert's
rows of h by one column tile of down. Down items of early experts start while the last gate/up items run: no
drain, no activation launch, every SM busy. Deadlock-free whatever the scheduler does: an item only waits on items
with smaller tickets, which programs already running hold (CUB's decoupled look-back takes tile ids the same way).

Measured on an H200 (benchmarks/results/2026-12-04_dg_fused_expert_mlp_h200.md): 373 us per 26B layer against 382
for the two kernels and XLA's activation (the chip reads the same bytes in 362-363), although act(gate) * up in
gate/up's programs alone (two 64-wide dots per program) cost +4 us; in the 26B forward 14.96-15.01 ms against
15.17-15.20, alternating in one process on two machines.

Semantics: kernel.grouped_matmul's [gate | up] product, act(gate) * up of its rounded halves, then grouped_matmul of
that (rounded to x's dtype) with down. Pallas, Triton lowering; interpret mode on CPU for tests (programs run one
after another there, in ticket order).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from orl_jax_kernels.pallas_args import layer_operand, triton_params
from orl_jax_kernels.small_m_gemm.kernel import Blocks


def tile_gated(w: jax.Array, bw: int) -> jax.Array:
    """[..., E, K, 2F] (gate | up) -> [..., E, F / bw, K, 2 bw]: tile j holds gate columns [j bw, (j + 1) bw) then
    the same up columns, contiguous (grouped_mlp's gate/up layout: one program computes act(gate) * up itself)."""
    *lead, k, f2 = w.shape
    if f2 % (2 * bw):
        raise ValueError(f"tile_gated: 2F={f2} is not a multiple of 2 x bw={2 * bw}")
    gu = w.reshape(*lead, k, 2, f2 // (2 * bw), bw)  # [..., K, gate / up, tile, bw]
    return jnp.moveaxis(gu, -2, -4).reshape(*lead, f2 // (2 * bw), k, 2 * bw)


TILES = Blocks(bn=128, bk=64, splits=1)  # default tiles of both GEMMs (DiffusionGemma's in kernel.default_blocks)
MAX_SPIN = 1 << 22  # a safety net, never reached when the tickets hold: a wrong wait finishes (wrongly), not hangs


def _halves(acc: jax.Array) -> tuple[jax.Array, jax.Array]:
    """[bm, 2 bw] -> its two [bm, bw] halves. Pallas' Triton lowering has no slice of a value; a reshape and a masked
    sum over the new axis lower (exact: each sum has one nonzero term)."""
    bm, n = acc.shape
    a = acc.reshape(bm, 2, n // 2)
    half = jax.lax.broadcasted_iota(jnp.int32, a.shape, 1)
    return tuple(jnp.sum(jnp.where(half == h, a, 0.0), axis=1) for h in (0, 1))


def _kernel(layer_ref, off_ref, rows_ref, x_ref, gu_ref, dn_ref, *refs,
            bm: int, gu: Blocks, dn: Blocks, act, one_dot: bool, interpret: bool, scaled: bool, ordered: bool):
    refs = list(refs)
    rs_ref = refs.pop(0) if scaled else None
    order_ref = refs.pop(0) if ordered else None
    count_in, h_ref, o_ref, count_ref = refs
    del count_in  # aliased to count_ref
    from jax.experimental.pallas import triton as plt

    barrier = (lambda: None) if interpret else plt.debug_barrier  # interpret mode: one thread, no barrier op

    n_exp, f_tiles, d, bw2 = gu_ref.shape[1:]
    bw = bw2 // 2
    f = f_tiles * bw
    d_tiles = dn_ref.shape[-1] // dn.bn
    layer = layer_ref[0]
    ticket = plt.atomic_add(count_ref, (jnp.int32(n_exp),), jnp.int32(1))  # count_ref[E]: the next work item
    is_gu = ticket < n_exp * f_tiles
    item = jnp.where(is_gu, ticket, ticket - n_exp * f_tiles)
    e = jnp.where(is_gu, item // f_tiles, item // d_tiles)
    if ordered:  # the experts in the caller's order (the heaviest first)
        e = order_ref[e]
    j = jnp.where(is_gu, item % f_tiles, item % d_tiles)
    start, rows = off_ref[e], off_ref[e + 1] - off_ref[e]
    n_tiles = (rows + bm - 1) // bm

    @pl.when(is_gu)
    def _():
        def tile(t, carry):
            r0 = start + t * bm
            live = (t * bm + jnp.arange(bm)) < rows
            ids = plt.load(rows_ref.at[pl.ds(r0, bm)], mask=live, other=0)

            def chunk(c, acc):
                k0 = pl.multiple_of(c * gu.bk, gu.bk)
                xb = plt.load(x_ref.at[ids[:, None], (k0 + jnp.arange(gu.bk))[None, :]], mask=live[:, None],
                              other=0.0)
                if one_dot:  # the tile's [gate | up] columns as one [bk, 2 bw] product
                    return acc + jnp.dot(xb, gu_ref[layer, e, j, pl.ds(k0, gu.bk), :],
                                         preferred_element_type=jnp.float32)
                wg, wu = (gu_ref[layer, e, j, pl.ds(k0, gu.bk), pl.ds(at, bw)] for at in (0, bw))
                return (acc[0] + jnp.dot(xb, wg, preferred_element_type=jnp.float32),
                        acc[1] + jnp.dot(xb, wu, preferred_element_type=jnp.float32))

            if one_dot:
                g, u = _halves(jax.lax.fori_loop(0, d // gu.bk, chunk, jnp.zeros((bm, 2 * bw), jnp.float32)))
            else:
                g, u = jax.lax.fori_loop(0, d // gu.bk, chunk, (jnp.zeros((bm, bw), jnp.float32),) * 2)
            if scaled:  # each row's token factor (x is the unnormed input of folded weights)
                r = plt.load(rs_ref.at[ids], mask=live, other=0.0)[:, None]
                g, u = g * r, u * r
            g, u = (a.astype(h_ref.dtype).astype(jnp.float32) for a in (g, u))
            plt.store(h_ref.at[pl.ds(r0, bm), pl.ds(pl.multiple_of(j * bw, bw), bw)],
                      (act(g) * u).astype(h_ref.dtype), mask=live[:, None])
            return carry

        jax.lax.fori_loop(0, n_tiles, tile, 0)
        barrier()  # every thread's stores before the release
        plt.atomic_add(count_ref, (e,), jnp.int32(1))

    @pl.when(jnp.logical_not(is_gu) & (rows > 0))
    def _():
        zero = jnp.int32(0)  # carried: a constant inside the body cannot be discharged in interpret mode
        jax.lax.while_loop(lambda c: (c[0] < f_tiles) & (c[1] < MAX_SPIN),
                           lambda c: (plt.atomic_add(count_ref, (e,), c[2]), c[1] + 1, c[2]),
                           (plt.atomic_add(count_ref, (e,), zero), zero, zero))  # atomic reads of e's count
        barrier()  # every thread after the acquire
        cols = pl.ds(pl.multiple_of(j * dn.bn, dn.bn), dn.bn)

        def tile(t, carry):
            r0 = start + t * bm
            live = (t * bm + jnp.arange(bm)) < rows

            def chunk(c, acc):
                k0 = pl.multiple_of(c * dn.bk, dn.bk)
                hb = plt.load(h_ref.at[pl.ds(r0, bm), pl.ds(k0, dn.bk)], mask=live[:, None], other=0.0)
                return acc + jnp.dot(hb, dn_ref[layer, e, pl.ds(k0, dn.bk), cols],
                                     preferred_element_type=jnp.float32)

            acc = jax.lax.fori_loop(0, f // dn.bk, chunk, jnp.zeros((bm, dn.bn), jnp.float32))
            plt.store(o_ref.at[pl.ds(r0, bm), cols], acc.astype(o_ref.dtype), mask=live[:, None])
            return carry

        jax.lax.fori_loop(0, n_tiles, tile, 0)


@functools.partial(jax.jit, static_argnames=("act", "gu_blocks", "dn_blocks", "bm", "num_warps", "num_stages",
                                             "one_dot", "interpret"))
def grouped_mlp(x: jax.Array, rows: jax.Array, gate_up: jax.Array, down: jax.Array, offsets: jax.Array,
                layer: jax.Array, act, gu_blocks: Blocks = TILES,
                dn_blocks: Blocks = TILES, bm: int = 64, num_warps: int = 4,
                num_stages: int = 3, one_dot: bool = False, interpret: bool = False,
                row_scale: jax.Array | None = None, order: jax.Array | None = None) -> jax.Array:
    """Sorted row r of x[rows] through its expert's MLP: act(x_r @ gate_e) * (x_r @ up_e) @ down_e -> [M, D] in
    x's dtype (M = rows.shape[0]; rows past offsets[-1] are 0).

    x [T, D]; rows [M] int32 (the token of each row, sorted by expert); gate_up [L, E, F / bw, D, 2 bw]
    (tile_gated of a [gate | up] stack, bw = gu_blocks.bn / 2); down [L, E, F, D] (the model's layout);
    offsets [E + 1] (the groups' first rows, then their end); layer: the stacks' layer. gu_blocks / dn_blocks: bk
    (rows of K per step) and bn of each GEMM; one num_warps / num_stages for the launch. one_dot: gate/up's [gate |
    up] tile as one 2 bw-wide product per K step, its halves split after the loop (`_halves`), instead of two bw-wide
    products (the model's default, moe.FUSED_ONE_DOT: 0.3-1 us per 26B layer faster in isolation, 0.02-0.045 ms per
    forward). row_scale [T] float32: gate/up's products of row r times row_scale[rows[r]] before the activation (x is
    then an unnormed input whose RMSNorm weight was folded into gate/up: moe.experts_mlp). order [E] int32 (a
    permutation): the experts' work items in this order, gate/up and down alike (e.g. the most rows first, so that
    an expert of several row tiles, whose items run them one after another, does not start last); the same
    values."""
    _, d = x.shape
    layer_arr = layer_operand("grouped_mlp", True, layer, gate_up.shape)
    if gate_up.ndim != 5 or down.ndim != 4:
        raise ValueError(f"grouped_mlp: gate_up {gate_up.shape} must be a tile_gated stack [L, E, F / bw, D, 2 bw] "
                         f"and down {down.shape} a stack [L, E, F, D]")
    n_layers, e, f_tiles, d_w, bw2 = gate_up.shape
    f = f_tiles * bw2 // 2
    if d_w != d or down.shape != (n_layers, e, f, d) or bw2 != gu_blocks.bn:
        raise ValueError(f"grouped_mlp: x {x.shape}, gate_up {gate_up.shape} (bn {gu_blocks.bn}) and down "
                         f"{down.shape} do not match")
    if d % gu_blocks.bk or f % dn_blocks.bk or d % dn_blocks.bn:
        raise ValueError(f"grouped_mlp: blocks {gu_blocks} / {dn_blocks} do not divide D={d}, F={f}")
    if offsets.shape != (e + 1,) or rows.ndim != 1 or rows.dtype != jnp.int32:
        raise ValueError(f"grouped_mlp: offsets {offsets.shape} (want ({e + 1},)) / rows {rows.dtype}{rows.shape}")
    if row_scale is not None and row_scale.shape != x.shape[:1]:
        raise ValueError(f"grouped_mlp: row_scale {row_scale.shape} does not match x {x.shape}")
    if order is not None and (order.shape != (e,) or order.dtype != jnp.int32):
        raise ValueError(f"grouped_mlp: order {order.dtype}{order.shape} must be int32 ({e},)")
    m = rows.shape[0]
    spare = bm if interpret else 0  # interpret mode clamps windows that leave the array (kernel.py)
    rows_p = jnp.pad(rows, (0, spare))
    items = e * (f_tiles + d // dn_blocks.bn)
    whole = lambda a: pl.BlockSpec(a.shape, lambda i, n=a.ndim: (0,) * n)  # noqa: E731
    count = jnp.zeros((e + 1,), jnp.int32)
    h_shape, o_shape = (m + spare, f), (m + spare, d)
    scale = () if row_scale is None else (row_scale.astype(jnp.float32),)
    operands = (layer_arr, offsets, rows_p, x, gate_up, down, *scale, *(() if order is None else (order,)), count)
    _, out, _ = pl.pallas_call(
        functools.partial(_kernel, bm=bm, gu=gu_blocks, dn=dn_blocks, act=act, one_dot=one_dot, interpret=interpret,
                          scaled=row_scale is not None, ordered=order is not None),
        out_shape=(jax.ShapeDtypeStruct(h_shape, x.dtype), jax.ShapeDtypeStruct(o_shape, x.dtype),
                   jax.ShapeDtypeStruct(count.shape, count.dtype)),
        grid=(items,),
        in_specs=[whole(a) for a in operands],
        out_specs=[pl.BlockSpec(h_shape, lambda i: (0, 0)), pl.BlockSpec(o_shape, lambda i: (0, 0)),
                   whole(count)],
        input_output_aliases={len(operands) - 1: 2},
        interpret=interpret,
        **triton_params(num_warps, num_stages, interpret),
    )(*operands)
    live = jnp.arange(m) < offsets[-1]
    return jnp.where(live[:, None], out[:m] if spare else out, 0)
