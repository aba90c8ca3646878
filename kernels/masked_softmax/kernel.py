"""Masked, scaled softmax over the last axis of attention scores, one pass: float32 scores in, probabilities in the
value dtype out.

Why: DiffusionGemma's 512-wide full-attention layers run on XLA's einsums (no fused kernel takes heads that wide:
cuDNN stops at 256, and the Pallas attention kernel lost there, kernels/NOTES.md). Between the score and value
GEMMs XLA spent four passes over the [K, G, L, S] float32 scores per layer (the mask's select 6.6 us, the max
4.1, exp with a transpose 10.5, the sum 5.0: ~26 us of a 64 us attention in the session-20 profile,
benchmarks/results/2026-12-01_dg_attention_order_h200.md). Here one program per few score rows reads them once
with their mask rows and writes the probabilities: 16 MB read and 8 MB written at the 26B's full layers.

Semantics: jax.nn.softmax(where(mask, s * scale, NEG)) cast to `dtype` (reference.py), a masked key scoring the
same finite NEG as orl_jax.model.attention (a fully masked row is uniform, never NaN). Rows of scores
[B, K, G, L, S] share the mask row of their (b, l): mask [B, L, S]. S must be a power of two (Triton blocks).
Pallas, Triton lowering; interpret mode on CPU for tests.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from orl_jax.model.attention import _NEG as NEG
from orl_jax_kernels.pallas_args import triton_params

# Score rows per program (8 x 1024 float32: 32 KB in registers over 4 warps); read at trace time. In the 26B forward
# 8 rows took 15.58 / 15.58 ms, 4 rows 15.56 and 16 rows 15.60 (one sample each: within noise; call 6 of
# benchmarks/results/2026-12-01_dg_attention_order_h200.md).
ROWS = 8


def supported(l: int, s: int, rows: int | None = None) -> bool:
    """S a power of two >= 16 and the query count a multiple of the rows per program (ROWS unless given)."""
    return s >= 16 and not s & (s - 1) and l % (rows or ROWS) == 0


def _kernel(s_ref, m_ref, o_ref, *, scale: float):
    s = s_ref[...] * scale  # [R, S] float32
    s = jnp.where(m_ref[...] != 0, s, NEG)
    e = jnp.exp(s - jnp.max(s, axis=1, keepdims=True))
    o_ref[...] = (e / jnp.sum(e, axis=1, keepdims=True)).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("scale", "dtype", "interpret", "rows"))
def masked_softmax(scores: jax.Array, mask: jax.Array, *, scale: float, dtype, interpret: bool = False,
                   rows: int | None = None) -> jax.Array:
    """scores [B, K, G, L, S] float32; mask [B, L, S] (bool or int8) -> softmax over S of the masked, scaled
    scores, [B, K, G, L, S] in `dtype`. rows: score rows per program, ROWS unless given."""
    rows = rows or ROWS
    b, kv, g, l, s = scores.shape
    if mask.shape != (b, l, s):
        raise ValueError(f"masked_softmax: scores {scores.shape} take a mask [B, L, S] = {(b, l, s)}, got {mask.shape}")
    if not supported(l, s, rows):
        raise ValueError(f"masked_softmax: L={l}, S={s} not supported with {rows} rows per program (S a power of "
                         f"two, L a multiple of the rows)")
    tiles = l // rows  # row blocks per (b, k, g)
    flat = scores.reshape(b * kv * g * l, s)
    out = pl.pallas_call(
        functools.partial(_kernel, scale=scale),
        out_shape=jax.ShapeDtypeStruct(flat.shape, dtype),
        grid=(b * kv * g * tiles,),
        in_specs=[pl.BlockSpec((rows, s), lambda r: (r, 0)),
                  # the (b, l) mask rows of row block r: b = r // (K G tiles), l block = r % tiles
                  pl.BlockSpec((rows, s), lambda r: ((r // (kv * g * tiles)) * tiles + r % tiles, 0))],
        out_specs=pl.BlockSpec((rows, s), lambda r: (r, 0)),
        interpret=interpret,
        **triton_params(4, 1, interpret),
    )(flat, mask.astype(jnp.int8).reshape(b * l, s))
    return out.reshape(scores.shape)
