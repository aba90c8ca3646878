"""DiffusionGemma's router in one launch: RMSNorm (no weight) x scale x D^-1/2, the router GEMM, softmax, top-k,
renormalization and the chosen experts' scales (model/moe.route), for a block of tokens per program.

Why: in a cached 26B pass the router is a chain of ~5 launches per layer (the GEMM at 64 x 8 tiles 6.4 us, the
softmax 1.4 us, top-k, the renormalizing and scaling fusions) on the path from the attention output to the expert
kernels (benchmarks/results/2026-12-01_dg_concurrent_graphs_h200.md's profile). The router weight [D, E] and the
two scale vectors are read in place from their layer stacks (a custom call's operand slice would be a copy launch
each, as for kernels/qk_norm_rope).

Semantics: moe.route with the same casts (the norm's output, the scale product and the logits in x's dtype, the
softmax in float32); the sum of squares runs over K chunks, so float32 results may differ from XLA's in the last
bit. Top-k picks the lowest index among equal probabilities, as lax.top_k. Pallas, Triton lowering; interpret
mode on CPU for tests.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from orl_jax_kernels.pallas_args import layer_operand, triton_params

BT = 16  # tokens per program: the dot's rows (Triton needs >= 16)
BK = 256  # contraction chunk of D


def supported(tokens: int, d: int, experts: int, top_k: int) -> bool:
    """Powers of two for the experts and k (block shapes), BT | tokens, a chunk of D that divides it."""
    pow2 = lambda n: n > 0 and n & (n - 1) == 0  # noqa: E731
    return pow2(experts) and pow2(top_k) and top_k <= experts and tokens % BT == 0 and _chunk(d) is not None


def _chunk(d: int) -> int | None:
    return next((c for c in (BK, 128, 64, 32, 16) if d % c == 0), None)


def _kernel(layer_ref, vlayer_ref, x_ref, w_ref, v_ref, wts_ref, ids_ref, *, d: int, bk: int, top_k: int,
            eps: float, offsets: tuple[int, int]):
    t0 = pl.program_id(0) * BT
    layer, vl = layer_ref[0], vlayer_ref[0]
    dt = x_ref.dtype
    e = w_ref.shape[-1]
    scale_off, expert_off = offsets

    def squares(j, acc):
        xc = x_ref[pl.ds(t0, BT), pl.ds(j * bk, bk)].astype(jnp.float32)
        return acc + jnp.sum(xc * xc, axis=1)

    inv = jax.lax.rsqrt(jax.lax.fori_loop(0, d // bk, squares, jnp.zeros((BT,), jnp.float32)) / d + eps)
    c = jnp.asarray(d ** -0.5, dt)  # the weak-typed factor, rounded to x's dtype as jnp does

    def logits(j, z):
        xc = x_ref[pl.ds(t0, BT), pl.ds(j * bk, bk)].astype(jnp.float32)
        s = v_ref[vl, pl.ds(scale_off + j * bk, bk)].astype(dt)
        h = ((xc * inv[:, None]).astype(dt) * s[None, :]) * c  # rms_norm_fp32(x) * scale * D^-1/2, in dt
        return z + jnp.dot(h, w_ref[layer, pl.ds(j * bk, bk), :].astype(dt), preferred_element_type=jnp.float32)

    z = jax.lax.fori_loop(0, d // bk, logits, jnp.zeros((BT, e), jnp.float32)).astype(dt).astype(jnp.float32)
    p = jnp.exp(z - jnp.max(z, axis=1, keepdims=True))
    p = p / jnp.sum(p, axis=1, keepdims=True)  # jax.nn.softmax
    cols = jax.lax.broadcasted_iota(jnp.int32, (BT, e), 1)
    kcols = jax.lax.broadcasted_iota(jnp.int32, (BT, top_k), 1)
    scales = v_ref[vl, pl.ds(expert_off, e)].astype(jnp.float32)
    w, es = jnp.zeros((BT, top_k), jnp.float32), jnp.zeros((BT, top_k), jnp.float32)
    ids = jnp.zeros((BT, top_k), jnp.int32)
    for j in range(top_k):  # the largest left, lowest index first among equals; then out of the running
        m = jnp.max(p, axis=1)
        i = jnp.min(jnp.where(p == m[:, None], cols, e), axis=1)
        hit = cols == i[:, None]
        w = jnp.where(kcols == j, m[:, None], w)
        ids = jnp.where(kcols == j, i[:, None], ids)
        es = jnp.where(kcols == j, jnp.sum(jnp.where(hit, scales[None, :], 0.0), axis=1)[:, None], es)
        p = jnp.where(hit, -1.0, p)
    wts_ref[pl.ds(t0, BT), :] = w / jnp.sum(w, axis=1, keepdims=True) * es
    ids_ref[pl.ds(t0, BT), :] = ids


@functools.partial(jax.jit, static_argnames=("top_k", "eps", "offsets", "interpret", "num_warps"))
def route_stacked(x: jax.Array, proj: jax.Array, layer, vectors: jax.Array, vector_layer, offsets: tuple[int, int],
                  top_k: int, eps: float, interpret: bool = False, num_warps: int = 4):
    """moe.route(x, scale, proj[layer], expert_scale, top_k, eps) with scale = vectors[vector_layer, s:s + D] and
    expert_scale = vectors[vector_layer, e:e + E] for offsets (s, e): x [T, D]; proj a stack [L, D, E] read at
    `layer` (or one [D, E] with layer None); vectors [Lv, n] packed per-layer vectors (model/streamed.pack_vectors).
    -> (weights [T, k] float32, experts [T, k] int32)."""
    t, d = x.shape
    stacked = proj.ndim == 3
    e = proj.shape[-1]
    if proj.shape[-2] != d or vectors.ndim != 2 or not (0 <= offsets[0] <= vectors.shape[1] - d) or \
            not (0 <= offsets[1] <= vectors.shape[1] - e):
        raise ValueError(f"route_stacked: x {x.shape}, proj {proj.shape}, vectors {vectors.shape} and offsets "
                         f"{offsets} do not match")
    if not supported(t, d, e, top_k):
        raise ValueError(f"route_stacked: T={t}, D={d}, E={e}, k={top_k} not supported (powers of two for E and k, "
                         f"T a multiple of {BT})")
    return pl.pallas_call(
        functools.partial(_kernel, d=d, bk=_chunk(d), top_k=top_k, eps=eps, offsets=offsets),
        out_shape=(jax.ShapeDtypeStruct((t, top_k), jnp.float32), jax.ShapeDtypeStruct((t, top_k), jnp.int32)),
        grid=(t // BT,),
        interpret=interpret,
        **triton_params(num_warps, 1, interpret),
    )(layer_operand("route_stacked", stacked, layer, proj.shape),
      layer_operand("route_stacked", True, vector_layer, vectors.shape), x, proj if stacked else proj[None],
      vectors)
