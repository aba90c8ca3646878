"""Building blocks shared by the architectures: norms, RoPE, projections, gated MLPs.

Norms and softmax run in float32 and cast back, as the Hugging Face references do. `einsum` is the one place a
weight is multiplied: a quantized weight type plugs in here (the model code never branches on it).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rms_norm(x: jax.Array, w: jax.Array | None, eps: float) -> jax.Array:
    xf = x.astype(jnp.float32)
    y = (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)).astype(x.dtype)
    return y if w is None else jnp.broadcast_to(w.astype(x.dtype), y.shape) * y


def einsum(spec: str, x: jax.Array, w) -> jax.Array:
    """x @ w by an einsum spec whose letters are the shapes; w may be any weight type with an `einsum` method."""
    if hasattr(w, "einsum"):
        return w.einsum(spec, x)
    return jnp.einsum(spec, x, w.astype(x.dtype))


def rope_angles(positions: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """cos, sin of shape [B, L, H] (the two halves repeated, HF's rotate_half layout), in float32."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    ang = positions.astype(jnp.float32)[..., None] * inv_freq[None, None]  # [B, L, H/2]
    ang = jnp.concatenate([ang, ang], axis=-1)  # [B, L, H]
    return jnp.cos(ang), jnp.sin(ang)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [B, L, n, H]; cos/sin [B, L, H]."""
    half = x.shape[-1] // 2
    rot = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    cos, sin = cos[:, :, None, :].astype(x.dtype), sin[:, :, None, :].astype(x.dtype)
    return x * cos + rot * sin


ACTIVATIONS = {
    "silu": jax.nn.silu,
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
}


def gated_mlp(x: jax.Array, gate, up, down, act: str = "silu") -> jax.Array:
    """down(act(x @ gate) * (x @ up)); x [B, L, D] -> [B, L, D]."""
    g = einsum("bld,df->blf", x, gate)  # [B, L, F]
    u = einsum("bld,df->blf", x, up)
    return einsum("blf,fd->bld", ACTIVATIONS[act](g) * u, down)  # [B, L, D]
