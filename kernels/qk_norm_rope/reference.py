"""The oracle for the q/k norm + RoPE kernel: the model's own order of casts (orl_jax.model.layers.rms_norm, then
apply_rope on HF's rotate-half layout), written out on the fused projection's [..., K, G + 2, H] output."""

import jax
import jax.numpy as jnp


def _rms_norm(x, w, eps):
    xf = x.astype(jnp.float32)
    y = (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)).astype(x.dtype)
    return jnp.broadcast_to(w.astype(x.dtype), y.shape) * y


def _rope(x, cos, sin):
    half = x.shape[-1] // 2
    rot = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos.astype(x.dtype) + rot * sin.astype(x.dtype)


def qk_norm_rope_reference(qkv, cos, sin, q_norm, k_norm, eps):
    """qkv [B, L, K, G + 2, H] (G query heads, then k, then v per kv head); cos, sin [B, L, H] -> q [B, L, K, G, H],
    k [B, L, K, H] normed and rotated, v [B, L, K, H] as is."""
    g = qkv.shape[3] - 2
    c, s = cos[:, :, None, None, :], sin[:, :, None, None, :]
    q = _rope(_rms_norm(qkv[:, :, :, :g], q_norm, eps), c, s)
    k = _rope(_rms_norm(qkv[:, :, :, g], k_norm, eps), c[:, :, :, 0], s[:, :, :, 0])
    return q, k, qkv[:, :, :, g + 1]
