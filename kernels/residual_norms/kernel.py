"""The residual add after attention and the three norms of the feed-forward inputs, in one kernel
(DiffusionGemma: x + post_attn_norm(attn), then the dense MLP's, the router's and the experts' normed inputs).

Why: in the 26B forward XLA spends three kernels per layer here, one after the other on the critical path between
the o projection and the MoE's routing (the residual add with its norm 6.2 us, the sum of squares 1.7, the three
normed outputs 2.5: ~10 us per layer, ~0.3 ms per forward; profile of call 1 in
benchmarks/results/2026-12-01_dg_graph_loops_h200.md). One program per token row reads attn and x once and writes
the four rows.

Semantics: reference.py (each norm in float32 with its weight multiplied before the cast; the residual add and the
router's scale products rounded to the model dtype as XLA rounds them). The weights are read in place from the
layer's packed vector stack (model/streamed.pack_vectors) at static offsets. D is read in chunks of a power of two
(`chunk`): Triton's blocks. Pallas, Triton lowering; interpret mode on CPU for tests.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from orl_jax_kernels.pallas_args import layer_operand, triton_params


# Warps per program (one token row each); read at trace time.
NUM_WARPS = 4


def chunk(d: int) -> int:
    """The largest power of two <= 256 dividing D (0 below 16: not supported)."""
    c = 256
    while c >= 16 and d % c:
        c //= 2
    return c if c >= 16 else 0


def _kernel(layer_ref, a_ref, x_ref, vec_ref, x_out, mlp_out, router_out, moe_out, *, d: int, c: int,
            offsets: tuple[int, int, int, int], eps: float, router_mult: float):
    r = pl.program_id(0)
    layer = layer_ref[0]
    f32, dt = jnp.float32, x_out.dtype
    post, mlp, scale, moe = offsets
    starts = range(0, d, c)
    vec = lambda off, s: vec_ref[layer, pl.ds(off + s, c)].astype(f32)  # noqa: E731

    def inv_rms(parts):  # the chunks' squares summed elementwise first: one block reduction, not one per chunk
        acc = parts[0] * parts[0]
        for p in parts[1:]:
            acc = acc + p * p
        return jax.lax.rsqrt(jnp.sum(acc, axis=-1, keepdims=True) / d + eps)

    a = [a_ref[r, pl.ds(s, c)].astype(f32) for s in starts]
    inv = inv_rms(a)
    xs = []
    for s, p in zip(starts, a):
        n = (vec(post, s) * (p * inv)).astype(dt)
        xi = (x_ref[r, pl.ds(s, c)].astype(f32) + n.astype(f32)).astype(dt)
        x_out[r, pl.ds(s, c)] = xi
        xs.append(xi.astype(f32))
    inv = inv_rms(xs)
    for s, p in zip(starts, xs):
        y = p * inv
        mlp_out[r, pl.ds(s, c)] = (vec(mlp, s) * y).astype(dt)
        moe_out[r, pl.ds(s, c)] = (vec(moe, s) * y).astype(dt)
        h = (y.astype(dt).astype(f32) * vec(scale, s).astype(dt).astype(f32)).astype(dt)
        router_out[r, pl.ds(s, c)] = (h.astype(f32) * router_mult).astype(dt)


@functools.partial(jax.jit, static_argnames=("offsets", "eps", "interpret", "num_warps"))
def residual_norms_stacked(attn: jax.Array, x: jax.Array, vectors: jax.Array, layer: jax.Array,
                           offsets: tuple[int, int, int, int], eps: float, interpret: bool = False,
                           num_warps: int | None = None):
    """attn, x [T, D]; vectors [L, n] (a layer's norm weights packed in row `layer`, an int32 scalar) with the
    offsets of (post_attn_norm, mlp_norm, router_scale, moe_norm) -> (x + post_attn_norm(attn), mlp_norm(x'),
    the router's input, moe_norm(x')), each [T, D] in x's dtype, equal to reference.residual_norms_reference."""
    t, d = x.shape
    c = chunk(d)
    if attn.shape != x.shape or vectors.ndim != 2 or not all(0 <= o <= vectors.shape[1] - d for o in offsets):
        raise ValueError(f"residual_norms: attn {attn.shape}, x {x.shape}, vectors {vectors.shape} and offsets "
                         f"{offsets} do not match")
    if not c:
        raise ValueError(f"residual_norms: D={d} not supported (a multiple of 16 needed)")
    router_mult = float(np.asarray(d ** -0.5, x.dtype))  # the router's D^-1/2 as the model's dtype holds it
    shape = jax.ShapeDtypeStruct((t, d), x.dtype)
    return pl.pallas_call(
        functools.partial(_kernel, d=d, c=c, offsets=offsets, eps=eps, router_mult=router_mult),
        out_shape=(shape,) * 4,
        grid=(t,),
        interpret=interpret,
        **triton_params(num_warps or NUM_WARPS, 1, interpret),
    )(layer_operand("residual_norms", True, layer, vectors.shape), attn.astype(x.dtype), x, vectors)
