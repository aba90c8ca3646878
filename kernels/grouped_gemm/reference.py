"""The oracle for the grouped GEMM kernel: jax.lax.ragged_dot with float32 accumulation."""

import jax
import jax.numpy as jnp


def grouped_matmul_reference(x, w, group_sizes, act=None):
    """x [M, K] sorted by group, w [E, K, N], group_sizes [E] -> [M, N] in x's dtype (rows past the groups: 0).
    act: w's columns are gate | up, the result act(x @ gate) * (x @ up) [M, N / 2], in float32 before the cast."""
    y = jax.lax.ragged_dot(x, w, group_sizes.astype(jnp.int32), preferred_element_type=jnp.float32)
    if act is not None:
        g, u = jnp.split(y, 2, axis=-1)
        y = act(g) * u
    return y.astype(x.dtype)
