"""The oracle for the masked softmax kernel: orl_jax.model.attention's own XLA expression."""

import jax
import jax.numpy as jnp

from orl_jax.model.attention import _NEG


def masked_softmax_reference(scores, mask, scale: float, dtype):
    """scores [B, K, G, L, S] float32, mask [B, L, S] -> softmax(where(mask, s * scale, NEG)) in dtype."""
    s = jnp.where(mask[:, None, None] != 0, scores * scale, _NEG)
    return jax.nn.softmax(s, axis=-1).astype(dtype)
