"""The oracles for the q/k norm + RoPE kernel: the models' own XLA paths. Qwen3 (orl_jax.model.layers.qk_norm_rope:
the norm in float32, cast, then weight and RoPE in the input dtype, on HF's rotate-half layout) and
DiffusionGemma's sliding layers (gemma_qkv_reference: the weight multiplies in float32 before the cast; v gets the
weightless norm)."""

from orl_jax.model.layers import apply_rope, rms_norm_fp32
from orl_jax.model.layers import qk_norm_rope as qk_norm_rope_reference

__all__ = ["qk_norm_rope_reference", "gemma_qkv_reference"]


def gemma_qkv_reference(qkv, cos, sin, q_norm, k_norm, eps):
    """qkv [B, L, K, G + 2, H] -> q [B, L, K, G, H], k, v [B, L, K, H] as model/diffusion_gemma._layer makes them."""
    b, l, kv, slots, h = qkv.shape
    g = slots - 2
    q = apply_rope(rms_norm_fp32(qkv[:, :, :, :g].reshape(b, l, kv * g, h), q_norm, eps), cos, sin)
    k = apply_rope(rms_norm_fp32(qkv[:, :, :, g], k_norm, eps), cos, sin)
    return q.reshape(b, l, kv, g, h), k, rms_norm_fp32(qkv[:, :, :, g + 1], None, eps)
