"""The oracle for the grouped GEMM kernel: jax.lax.ragged_dot with float32 accumulation."""

import jax
import jax.numpy as jnp

from orl_jax.model.layers import ACTIVATIONS


def grouped_matmul_reference(x, w, group_sizes, gated=None):
    """x [M, K] sorted by group, w [E, K, N], group_sizes [E] -> [M, N] in x's dtype (rows past the groups: 0).
    gated: w holds gate | up along N, and the result is act(gate product) * (up product) [M, N / 2]."""
    y = jax.lax.ragged_dot(x, w, group_sizes.astype(jnp.int32), preferred_element_type=jnp.float32).astype(x.dtype)
    if gated is None:
        return y
    g, u = jnp.split(y, 2, axis=-1)
    return (ACTIVATIONS[gated](g.astype(jnp.float32)) * u.astype(jnp.float32)).astype(x.dtype)
