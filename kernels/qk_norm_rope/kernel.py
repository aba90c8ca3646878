"""q/k RMSNorm + RoPE on the fused qkv projection's output, in one kernel: q, k normed and rotated, v copied out
(Qwen3), or normed without a weight (DiffusionGemma's sliding layers, `gemma=True`).

Why: in a Qwen3-4B denoising step XLA spends four kernels per layer here (the q slice, the k/v slices, the q
norm+RoPE and the k norm+RoPE fusions): 7.7 us per layer at block 32, 11.5 at canvas 256, ~0.3-0.4 ms per step
(benchmarks/results/2026-11-30_engine_variants_h200x2.md), on a few hundred KB of data. One program per token row
reads its [K, G + 2, H] slice once and writes q, k and v.

Semantics: reference.py (the model's cast order: norm in float32, cast, weight and RoPE in the input dtype), on
HF's rotate-half layout: the two halves of H load and store separately (Triton has no register slicing). K, G and
H / 2 must be powers of two (Triton's block shapes; `supported`). Pallas, Triton lowering; interpret mode on CPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from orl_jax_kernels.pallas_args import layer_operand, triton_params


def supported(k: int, g: int, h: int) -> bool:
    pow2 = lambda n: n > 0 and n & (n - 1) == 0  # noqa: E731
    return pow2(k) and pow2(g) and h % 2 == 0 and pow2(h // 2)


def inv_rms(x1, x2, eps: float):
    """The two halves of H (last axis) in float32, and 1 / RMS over both (kept as a last axis of 1)."""
    f1, f2 = x1.astype(jnp.float32), x2.astype(jnp.float32)
    ms = (jnp.sum(f1 * f1, axis=-1, keepdims=True) + jnp.sum(f2 * f2, axis=-1, keepdims=True)) / (2 * x1.shape[-1])
    return f1, f2, jax.lax.rsqrt(ms + eps)


def norm_rope_halves(x1, x2, w1, w2, c1, c2, s1, s2, eps: float, gemma: bool):
    """RMSNorm with weight (w1 | w2) then RoPE on HF's rotate-half layout, on the two halves of H (Triton has no
    register slicing): every operand broadcastable to x1, cos / sin already in x's dtype; returns x's dtype. The
    cast order of layers.rms_norm (the cast, then the weight), or with `gemma` layers.rms_norm_fp32's (the weight
    multiplies in float32, then the cast). Shared by this kernel and kernels/decode_attention's normed entry."""
    dt = x1.dtype
    f1, f2, inv = inv_rms(x1, x2, eps)
    if gemma:
        y1, y2 = (w1.astype(jnp.float32) * (f1 * inv)).astype(dt), (w2.astype(jnp.float32) * (f2 * inv)).astype(dt)
    else:
        y1, y2 = w1.astype(dt) * (f1 * inv).astype(dt), w2.astype(dt) * (f2 * inv).astype(dt)
    return y1 * c1 + (-y2) * s1, y2 * c2 + y1 * s2  # x * cos + rotate_half(x) * sin


def _kernel(layer_ref, qkv_ref, cos_ref, sin_ref, vec_ref, q_ref, k_ref, v_ref, *, g: int, half: int, eps: float,
            offsets: tuple[int, int], gemma: bool):
    r = pl.program_id(0)
    layer = layer_ref[0]
    lo, hi = pl.ds(0, half), pl.ds(half, half)
    dt = q_ref.dtype
    c1, c2 = cos_ref[r, lo].astype(dt), cos_ref[r, hi].astype(dt)  # [half]
    s1, s2 = sin_ref[r, lo].astype(dt), sin_ref[r, hi].astype(dt)

    def norm_rope(x1, x2, off):  # the two halves of H, [..., half] each; the norm weight at vectors[layer, off:]
        row = lambda v: v.reshape((1,) * (x1.ndim - 1) + (half,))  # noqa: E731  (explicit broadcasting)
        w1, w2 = vec_ref[layer, pl.ds(off, half)], vec_ref[layer, pl.ds(off + half, half)]
        return norm_rope_halves(x1, x2, row(w1), row(w2), row(c1), row(c2), row(s1), row(s2), eps, gemma)

    q_off, k_off = offsets
    q1, q2 = norm_rope(qkv_ref[r, :, pl.ds(0, g), lo], qkv_ref[r, :, pl.ds(0, g), hi], q_off)  # [K, G, half]
    q_ref[r, :, :, lo], q_ref[r, :, :, hi] = q1, q2
    k1, k2 = norm_rope(qkv_ref[r, :, g, lo], qkv_ref[r, :, g, hi], k_off)  # [K, half]
    k_ref[r, :, lo], k_ref[r, :, hi] = k1, k2
    v1, v2 = qkv_ref[r, :, g + 1, lo], qkv_ref[r, :, g + 1, hi]
    if gemma:  # v gets the weightless norm
        f1, f2, inv = inv_rms(v1, v2, eps)
        v1, v2 = (f1 * inv).astype(dt), (f2 * inv).astype(dt)
    v_ref[r, :, lo], v_ref[r, :, hi] = v1, v2


def qk_norm_rope(qkv: jax.Array, cos: jax.Array, sin: jax.Array, q_norm: jax.Array, k_norm: jax.Array, eps: float,
                 interpret: bool = False, num_warps: int = 4):
    """qkv [B, L, K, G + 2, H]; cos, sin [B, L, H]; q_norm, k_norm [H] -> (q [B, L, K, G, H], k [B, L, K, H],
    v [B, L, K, H]) in qkv's dtype, equal to reference.qk_norm_rope_reference."""
    h = qkv.shape[-1]
    if q_norm.shape != (h,) or k_norm.shape != (h,):
        raise ValueError(f"qk_norm_rope: qkv {qkv.shape}, q_norm {q_norm.shape} and k_norm {k_norm.shape} do not match")
    vectors = jnp.concatenate([q_norm, k_norm])[None]
    return qk_norm_rope_stacked(qkv, cos, sin, vectors, jnp.int32(0), (0, h), eps, interpret, num_warps)


@functools.partial(jax.jit, static_argnames=("offsets", "eps", "interpret", "num_warps", "gemma"))
def qk_norm_rope_stacked(qkv: jax.Array, cos: jax.Array, sin: jax.Array, vectors: jax.Array, layer: jax.Array,
                         offsets: tuple[int, int], eps: float, interpret: bool = False, num_warps: int = 4,
                         gemma: bool = False):
    """qk_norm_rope with the norm weights read in place from a stack of packed per-layer vectors [L, n]
    (model/streamed.pack_vectors): q_norm = vectors[layer, q:q + H], k_norm = vectors[layer, k:k + H] for
    offsets (q, k) and an int32 scalar `layer`. Why: handed to the kernel as slices, each norm weight was its own
    copy launch per layer (2 x 36 `memcpy32_post` per Qwen3-4B step, ~80 us).

    gemma=True: DiffusionGemma's order (reference.gemma_qkv_reference): each norm's weight multiplies in float32
    before the cast, and v gets the weightless norm instead of passing through."""
    b, l, kv, slots, h = qkv.shape
    g = slots - 2
    if cos.shape != (b, l, h) or sin.shape != (b, l, h) or vectors.ndim != 2 or \
            not all(0 <= o <= vectors.shape[1] - h for o in offsets):
        raise ValueError(f"qk_norm_rope: qkv {qkv.shape}, cos {cos.shape}, sin {sin.shape}, vectors "
                         f"{vectors.shape} and offsets {offsets} do not match")
    if not supported(kv, g, h):
        raise ValueError(f"qk_norm_rope: K={kv}, G={g}, H={h} not supported (powers of two needed)")
    rows = b * l
    dt = qkv.dtype
    q, k, v = pl.pallas_call(
        functools.partial(_kernel, g=g, half=h // 2, eps=eps, offsets=offsets, gemma=gemma),
        out_shape=(jax.ShapeDtypeStruct((rows, kv, g, h), dt), jax.ShapeDtypeStruct((rows, kv, h), dt),
                   jax.ShapeDtypeStruct((rows, kv, h), dt)),
        grid=(rows,),
        interpret=interpret,
        **triton_params(num_warps, 1, interpret),
    )(layer_operand("qk_norm_rope", True, layer, vectors.shape), qkv.reshape(rows, kv, slots, h),
      cos.reshape(rows, h), sin.reshape(rows, h), vectors)
    return q.reshape(b, l, kv, g, h), k.reshape(b, l, kv, h), v.reshape(b, l, kv, h)
