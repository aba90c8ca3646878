"""What kernel.py computes, in the model's expressions (diffusion_gemma._layer and moe.router_input)."""

from orl_jax.model.layers import rms_norm_fp32
from orl_jax.model.moe import router_input


def residual_norms_reference(attn, x, post_attn_norm, mlp_norm, router_scale, moe_norm, eps):
    """attn, x [T, D] -> (x + post_attn_norm(attn), then of that: mlp_norm(.), the router's input, moe_norm(.))."""
    x = x + rms_norm_fp32(attn, post_attn_norm, eps)
    return x, rms_norm_fp32(x, mlp_norm, eps), router_input(x, router_scale, eps), rms_norm_fp32(x, moe_norm, eps)
