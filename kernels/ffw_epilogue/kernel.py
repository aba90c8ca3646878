"""DiffusionGemma's feed-forward epilogue in one kernel: the experts' sorted output rows combined per token (each
token's k rows, weighted by the router, summed in float32), the dense MLP's and the MoE's post norms, their sum's
post norm, the residual add and the layer scalar.

Why: in the 26B forward XLA makes two passes per layer here, the combine (a gather-reduce writing float32 [T, D],
5.1 us) and one fusion of the three norms with the residual (4.3 us), plus slices of the norm weights: ~0.3 ms per
forward on ~7 MB per layer (benchmarks/results/2026-12-01_dg_sort_kernel_stages_h200.md's profile). One program per
token reads its k expert rows, its MLP row and its residual row once, keeps them in registers (D in power-of-two
chunks, unrolled) and writes the layer's output; the norm weights and the scalar are read in place from the layer
loop's packed vector stack (model/streamed.pack_vectors).

Semantics: reference.py (the model's cast order: the combine's float32 sum cast to x's dtype, each norm's weight
multiplied in float32 before its cast, the bf16 sums rounded where the model rounds them). Pallas, Triton
lowering; interpret mode on CPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from orl_jax_kernels.pallas_args import layer_operand, triton_params

MAX_CHUNK = 256  # columns per unrolled chunk: D = 2816 is 11 chunks of 256
MAX_CHUNKS = 32


def chunking(d: int) -> tuple[int, int] | None:
    """(chunk, chunks) for a row of d: the largest power of two <= MAX_CHUNK dividing d, if at least 16 wide and at
    most MAX_CHUNKS of them; else None (not supported)."""
    chunk = min(d & -d, MAX_CHUNK)
    return (chunk, d // chunk) if chunk >= 16 and d // chunk <= MAX_CHUNKS else None


def _kernel(layer_ref, pos_ref, wts_ref, y_ref, mlp_ref, x_ref, vec_ref, o_ref, *, k: int, chunk: int, n: int,
            eps: float, offsets: tuple[int, int, int, int]):
    r = pl.program_id(0)
    layer = layer_ref[0]
    dt = o_ref.dtype
    f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
    rnd = lambda a: a.astype(dt).astype(jnp.float32)  # noqa: E731  (a value the model holds in x's dtype)
    cols = [pl.ds(c * chunk, chunk) for c in range(n)]
    o_mlp, o_moe, o_ffw, o_scalar = offsets
    weight = lambda off, c: f32(vec_ref[layer, pl.ds(off + c * chunk, chunk)])  # noqa: E731
    srcs = [pos_ref[r * k + j] for j in range(k)]  # the sorted rows of this token's k choices
    wts = [wts_ref[r, j] for j in range(k)]

    def combined(c):
        acc = jnp.zeros((chunk,), jnp.float32)
        for j in range(k):
            acc += f32(y_ref[srcs[j], cols[c]]) * wts[j]
        return rnd(acc)

    def inv_rms(parts):
        return jax.lax.rsqrt(sum(jnp.sum(p * p) for p in parts) / (n * chunk) + eps)

    moe = [combined(c) for c in range(n)]
    mlp = [f32(mlp_ref[r, cols[c]]) for c in range(n)]
    i_moe, i_mlp = inv_rms(moe), inv_rms(mlp)
    ffw = [rnd(rnd(weight(o_mlp, c) * (mlp[c] * i_mlp)) + rnd(weight(o_moe, c) * (moe[c] * i_moe)))
           for c in range(n)]
    i_ffw = inv_rms(ffw)
    scalar = f32(vec_ref[layer, o_scalar])
    for c in range(n):
        h = rnd(f32(x_ref[r, cols[c]]) + rnd(weight(o_ffw, c) * (ffw[c] * i_ffw)))
        o_ref[r, cols[c]] = (h * scalar).astype(dt)


@functools.partial(jax.jit, static_argnames=("offsets", "eps", "interpret", "num_warps"))
def ffw_epilogue(y: jax.Array, pos: jax.Array, weights: jax.Array, mlp: jax.Array, x: jax.Array,
                 vectors: jax.Array, layer: jax.Array, offsets: tuple[int, int, int, int], eps: float,
                 interpret: bool = False, num_warps: int = 4) -> jax.Array:
    """y [M, D]: the experts' output rows in sorted order; pos [M] int32: the sorted row of assignment t * k + j;
    weights [T, k] float32: the router's; mlp, x [T, D]: the dense MLP's output and the residual stream; vectors
    [L, V]: packed per-layer vectors, of which layer `layer` holds the post-MLP, post-MoE and post-feed-forward
    norm weights (D each) and the layer scalar at `offsets` -> the layer's output [T, D] in x's dtype, equal to
    reference.ffw_epilogue_reference."""
    t, d = x.shape
    m, k = pos.shape[0], weights.shape[1]
    if (y.shape[1] != d or mlp.shape != x.shape or weights.shape[0] != t or m != t * k or y.shape[0] < m
            or vectors.ndim != 2 or not all(0 <= o <= vectors.shape[1] - d for o in offsets[:3])
            or not 0 <= offsets[3] < vectors.shape[1]):
        raise ValueError(f"ffw_epilogue: y {y.shape}, pos {pos.shape}, weights {weights.shape}, mlp {mlp.shape}, "
                         f"x {x.shape}, vectors {vectors.shape} and offsets {offsets} do not match")
    split = chunking(d)
    if split is None:
        raise ValueError(f"ffw_epilogue: D={d} not supported (a power-of-two chunk of 16 to {MAX_CHUNK} columns, "
                         f"at most {MAX_CHUNKS} of them)")
    return pl.pallas_call(
        functools.partial(_kernel, k=k, chunk=split[0], n=split[1], eps=eps, offsets=offsets),
        out_shape=jax.ShapeDtypeStruct((t, d), x.dtype),
        grid=(t,),
        interpret=interpret,
        **triton_params(num_warps, 1, interpret),
    )(layer_operand("ffw_epilogue", True, layer, vectors.shape), pos.astype(jnp.int32), weights.astype(jnp.float32),
      y, mlp, x, vectors)
