"""The oracle for the q/k norm + RoPE kernel: the model's own XLA path (orl_jax.model.layers.qk_norm_rope: the norm
in float32, cast, then weight and RoPE in the input dtype, on HF's rotate-half layout)."""

from orl_jax.model.layers import qk_norm_rope as qk_norm_rope_reference

__all__ = ["qk_norm_rope_reference"]
