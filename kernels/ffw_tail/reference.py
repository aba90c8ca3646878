"""The oracle for the feed-forward tail kernel: model/diffusion_gemma._layer's XLA path after the experts, as one
function (the MoE's weighted sum of its sorted expert rows, the three post norms, the residual, the layer scalar)."""

import jax.numpy as jnp

from orl_jax.model.layers import rms_norm_fp32


def ffw_tail_reference(x, mlp, y, pos, weights, post_mlp_norm, post_moe_norm, post_ffw_norm, scalar, eps):
    """x, mlp [T, D]; y [M, D] (the expert rows, sorted); pos [T, k] (each choice's row of y); weights [T, k]
    float32; the norms [D]; scalar [1] -> (x + post_ffw(post_mlp(mlp) + post_moe(moe))) * scalar [T, D]."""
    t, k = pos.shape
    rows = jnp.take(y, pos.reshape(-1), axis=0).astype(jnp.float32) * weights.reshape(-1, 1)  # [T k, D]
    moe = jnp.sum(rows.reshape(t, k, -1), axis=1)
    moe = moe.astype(x.dtype)
    ffw = rms_norm_fp32(mlp, post_mlp_norm, eps) + rms_norm_fp32(moe, post_moe_norm, eps)
    return (x + rms_norm_fp32(ffw, post_ffw_norm, eps)) * scalar[0]
