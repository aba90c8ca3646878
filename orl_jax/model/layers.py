"""Building blocks shared by the architectures: norms, RoPE, projections, gated MLPs.

Norms and softmax run in float32 and cast back, as the Hugging Face references do. `einsum` is the one place a
weight is multiplied: a quantized weight type plugs in here (the model code never branches on it).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rms_norm(x: jax.Array, w: jax.Array | None, eps: float) -> jax.Array:
    xf = x.astype(jnp.float32)
    y = (xf * rms_factor(xf, eps)).astype(x.dtype)
    return y if w is None else jnp.broadcast_to(w.astype(x.dtype), y.shape) * y


def einsum(spec: str, x: jax.Array, w) -> jax.Array:
    """x @ w by an einsum spec whose letters are the shapes; w may be any weight type with an `einsum` method."""
    if hasattr(w, "einsum"):
        return w.einsum(spec, x)
    return jnp.einsum(spec, x, w.astype(x.dtype))


def rope_angles(positions: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """cos, sin of shape [B, L, H] (the two halves repeated, HF's rotate_half layout), in float32."""
    return rope_angles_inv_freq(positions, rope_inv_freq(head_dim, theta))


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [B, L, n, H]; cos/sin [B, L, H]."""
    half = x.shape[-1] // 2
    rot = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    cos, sin = cos[:, :, None, :].astype(x.dtype), sin[:, :, None, :].astype(x.dtype)
    return x * cos + rot * sin


def qk_norm_rope(qkv: jax.Array, cos: jax.Array, sin: jax.Array, q_norm, k_norm, eps: float):
    """q/k RMSNorm + RoPE on a fused projection's [B, L, K, G + 2, H] output (per kv head: G query heads, k, v)
    -> q [B, L, K, G, H] and k [B, L, K, H] normed and rotated, v [B, L, K, H] as is. kernels/qk_norm_rope does
    the same in one GPU kernel (this is its oracle)."""
    b, l, kv, slots, h = qkv.shape
    g = slots - 2
    q = apply_rope(rms_norm(qkv[:, :, :, :g].reshape(b, l, kv * g, h), q_norm, eps), cos, sin)
    k = apply_rope(rms_norm(qkv[:, :, :, g], k_norm, eps), cos, sin)
    return q.reshape(b, l, kv, g, h), k, qkv[:, :, :, g + 1]


ACTIVATIONS = {
    "silu": jax.nn.silu,
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
}


def gated_mlp(x: jax.Array, gate, up, down, act: str = "silu") -> jax.Array:
    """down(act(x @ gate) * (x @ up)); x [B, L, D] -> [B, L, D].

    The barrier keeps XLA from folding the activation into the gate GEMM's epilogue (a cublasLt call): XLA reads a
    layer's weight in place from its stack only for plain cuBLAS GEMMs, so the epilogue cost a copy of the gate
    matrix in every DiffusionGemma sliding layer (benchmarks/results/2026-11-30_dg_in_place_h200x2.md)."""
    g = jax.lax.optimization_barrier(einsum("bld,df->blf", x, gate))  # [B, L, F]
    u = einsum("bld,df->blf", x, up)
    return einsum("blf,fd->bld", ACTIVATIONS[act](g) * u, down)  # [B, L, D]


def fused_gated_mlp(x: jax.Array, gate_up, down, act: str = "silu", row_scale: jax.Array | None = None,
                    down_letters: str = "fd") -> jax.Array:
    """gated_mlp with gate and up stored as one [D, 2, F] weight: one GEMM streams both (XLA would otherwise
    concatenate two separate weights on every call to merge the dots). row_scale [B, L, 1] float32: the MLP's input
    is x * row_scale, applied to the gate/up product (an RMSNorm whose weight was folded into gate_up).
    down_letters: down's axes as einsum letters ("df" for an [out, in] copy)."""
    gu = einsum("bld,dtf->bltf", x, gate_up)  # [B, L, 2, F]
    if row_scale is not None:
        gu = (gu.astype(jnp.float32) * row_scale[..., None]).astype(gu.dtype)
    return einsum(f"blf,{down_letters}->bld", ACTIVATIONS[act](gu[:, :, 0]) * gu[:, :, 1], down)  # [B, L, D]


def rms_factor(x: jax.Array, eps: float) -> jax.Array:
    """RMSNorm's per-row factor rsqrt(mean(x^2) + eps) in float32, [..., 1] (the norms here, and the products of
    weights an RMSNorm was folded into: diffusion_gemma_inference)."""
    xf = x.astype(jnp.float32)
    return jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)


def rms_norm_fp32(x: jax.Array, w: jax.Array | None, eps: float) -> jax.Array:
    """RMSNorm whose weight multiplies in float32 before the cast back (Gemma 4 / DiffusionGemma order; `rms_norm`
    casts first). The weight is used as is (no Gemma-1..3 style `1 + w`)."""
    xf = x.astype(jnp.float32)
    y = xf * rms_factor(xf, eps)
    if w is not None:
        y = jnp.broadcast_to(w.astype(jnp.float32), y.shape) * y
    return y.astype(x.dtype)


def soft_cap(x: jax.Array, cap: float | None) -> jax.Array:
    """cap * tanh(x / cap) in float32 (Gemma's logit soft-capping); cap None = identity."""
    if cap is None:
        return x
    return jnp.tanh(x.astype(jnp.float32) / cap) * cap


def rope_inv_freq(head_dim: int, theta: float, rope_type: str = "default", partial_rotary_factor: float = 1.0,
                  factor: float = 1.0) -> jax.Array:
    """Inverse frequencies [H/2] in float32, as transformers' ROPE_INIT_FUNCTIONS compute them.

    "default": 1 / theta^(2i / H) for all H/2 pairs. "proportional" (Gemma 4 full-attention layers): only the first
    int(partial * H / 2) pairs rotate, with exponents over the whole H; the rest get frequency 0 (cos 1, sin 0: left
    unrotated), so the encoding keeps size H. `factor` divides all frequencies (proportional only).
    """
    if rope_type == "default":
        return 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    if rope_type != "proportional":
        raise ValueError(f"rope_type must be 'default' or 'proportional', got {rope_type!r}")
    n_rot = int(partial_rotary_factor * head_dim // 2)
    rot = 1.0 / (theta ** (jnp.arange(0, 2 * n_rot, 2, dtype=jnp.float32) / head_dim))
    return jnp.concatenate([rot, jnp.zeros((head_dim // 2 - n_rot,), jnp.float32)]) / factor


def rope_angles_inv_freq(positions: jax.Array, inv_freq: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos, sin [B, L, H] from explicit inverse frequencies [H/2] (rotate_half layout, float32)."""
    ang = positions.astype(jnp.float32)[..., None] * inv_freq[None, None]  # [B, L, H/2]
    ang = jnp.concatenate([ang, ang], axis=-1)  # [B, L, H]
    return jnp.cos(ang), jnp.sin(ang)
