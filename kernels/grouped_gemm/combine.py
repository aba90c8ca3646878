"""The MoE's combine in one kernel: each token's k expert outputs, gathered from the sorted rows, weighted and
summed, written in the model dtype.

Why: in session 54's H200 trace of DiffusionGemma's `generate()` XLA's gather-and-reduce fusion for it took 9.1 us per
26B layer at the canvas (256 tokens x 8 choices of 2816 values: 11.5 MB of bf16 rows read, 2.9 MB of float32 sums
written), on the dependency chain between a layer's experts and the next layer's attention: ~1.6 TB/s. Storing the
expert rows in token order instead, so that the sum needs no gather, was slower (the expert kernel's scattered
stores: benchmarks/results/2026-12-05_dg_token_order_h100.md). Here one program per tile of BT tokens x BD columns
loads its k rows per token as row gathers (BD contiguous values each) and writes the model dtype: the same bytes
read, half the bytes written.

Semantics: sum over c of weights[t, c] * y[pos[t, c]] in float32, the choices added in order c = 0 .. k - 1 (XLA's
reduce may add them in another order: equal up to float32 rounding), rounded once to the output dtype. Pallas, Triton
lowering; interpret mode on CPU for tests.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from orl_jax_kernels.pallas_args import triton_params

# Tokens and columns per program, its warps and pipeline stages (read at trace time). At the canvas (256 tokens, D =
# 2816): 16 x 22 = 352 programs (~2.7 per SM, for the gathers' latency), each gathering 8 x [16, 128] bf16 rows, the
# choices' loop over 2 stages; no spills (pip Triton 3.6's ptxas for sm_90a). Not timed yet (session 54).
BLOCK_T = 16
BLOCK_D = 128
NUM_WARPS = 4
NUM_STAGES = 2


def supported(d: int, block_d: int | None = None) -> bool:
    """Whether rows of d values split into column tiles of block_d (BLOCK_D unless given), a power of two."""
    bd = block_d or BLOCK_D
    return bd >= 16 and not bd & (bd - 1) and d % bd == 0


def _kernel(pos_ref, w_ref, y_ref, o_ref, *, k: int, t: int, bt: int, bd: int):
    from jax.experimental.pallas import triton as plt

    t0 = pl.program_id(0) * bt
    tokens = t0 + jnp.arange(bt)
    live = tokens < t
    cols = pl.program_id(1) * bd + jnp.arange(bd)

    def choice(c, acc):  # the choices in order: a fixed order of the float32 adds
        rows = plt.load(pos_ref.at[c, pl.ds(t0, bt)], mask=live, other=0)
        w = plt.load(w_ref.at[c, pl.ds(t0, bt)], mask=live, other=0.0)
        yb = plt.load(y_ref.at[rows[:, None], cols[None, :]], mask=live[:, None], other=0.0)
        return acc + yb.astype(jnp.float32) * w[:, None]

    acc = jax.lax.fori_loop(0, k, choice, jnp.zeros((bt, bd), jnp.float32))
    plt.store(o_ref.at[pl.ds(t0, bt), pl.ds(pl.multiple_of(pl.program_id(1) * bd, bd), bd)], acc.astype(o_ref.dtype),
              mask=live[:, None])


@functools.partial(jax.jit, static_argnames=("out_dtype", "block_t", "block_d", "num_warps", "interpret"))
def moe_combine(y: jax.Array, pos: jax.Array, weights: jax.Array, *, out_dtype=None, block_t: int | None = None,
                block_d: int | None = None, num_warps: int | None = None, interpret: bool = False) -> jax.Array:
    """y [M, D] (the expert outputs in sorted order), pos [T, k] int32 (the sorted row of each token's choice, in
    [0, M)), weights [T, k] -> [T, D] in out_dtype (y's unless given): sum_c weights[t, c] * y[pos[t, c]], float32
    sums. block_t / block_d / num_warps: BLOCK_T / BLOCK_D / NUM_WARPS unless given."""
    bt, bd, warps = block_t or BLOCK_T, block_d or BLOCK_D, num_warps or NUM_WARPS
    if y.ndim != 2 or pos.ndim != 2 or pos.dtype != jnp.int32 or weights.shape != pos.shape:
        raise ValueError(f"moe_combine: y {y.shape} must be [M, D], pos {pos.dtype}{pos.shape} int32 [T, k] and "
                         f"weights {weights.shape} the same shape")
    if not supported(y.shape[1], bd) or bt < 1 or bt & (bt - 1):
        raise ValueError(f"moe_combine: D={y.shape[1]} in column tiles of {bd} (a power of two >= 16 dividing D) "
                         f"and {bt} tokens per tile (a power of two)")
    t, k = pos.shape
    d = y.shape[1]
    spare = bt if interpret else 0  # interpret mode clamps windows that leave the array
    pos_t, w_t = (jnp.pad(a.T, ((0, 0), (0, spare))) for a in (pos, weights.astype(jnp.float32)))
    whole = lambda a: pl.BlockSpec(a.shape, lambda i, j, n=a.ndim: (0,) * n)  # noqa: E731
    out_shape = (t + spare, d)
    out = pl.pallas_call(
        functools.partial(_kernel, k=k, t=t, bt=bt, bd=bd),
        out_shape=jax.ShapeDtypeStruct(out_shape, out_dtype or y.dtype),
        grid=(pl.cdiv(t, bt), d // bd),
        in_specs=[whole(pos_t), whole(w_t), whole(y)],
        out_specs=pl.BlockSpec(out_shape, lambda i, j: (0, 0)),
        interpret=interpret,
        name="moe_combine",
        **triton_params(warps, NUM_STAGES, interpret),
    )(pos_t, w_t, y)
    return out[:t] if spare else out
