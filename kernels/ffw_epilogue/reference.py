"""The oracle for the feed-forward epilogue kernel: DiffusionGemma's own XLA path (model/moe.combine_rows, then the
post norms, residual and layer scalar of model/diffusion_gemma._layer)."""

from orl_jax.model.layers import rms_norm_fp32
from orl_jax.model.moe import combine_rows


def ffw_epilogue_reference(y, pos, weights, mlp, x, post_mlp_norm, post_moe_norm, post_ffw_norm, scalar, eps):
    """y [M, D] sorted expert rows, pos [M], weights [T, k], mlp and x [T, D], norms [D], scalar [1] -> [T, D]."""
    moe = combine_rows(y, pos, weights, x.dtype)
    ffw = rms_norm_fp32(mlp, post_mlp_norm, eps) + rms_norm_fp32(moe, post_moe_norm, eps)
    return (x + rms_norm_fp32(ffw, post_ffw_norm, eps)) * scalar[0]
