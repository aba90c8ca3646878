"""The oracle for the expert sort kernel: a stable argsort of the expert ids and its inverse."""

import jax.numpy as jnp


def expert_sort_reference(experts, num_experts: int, k: int = 1):
    """experts [M] -> (order [M] // k, pos [M], offsets [E + 1]) as kernel.expert_sort returns them."""
    order = jnp.argsort(experts, stable=True).astype(jnp.int32)
    pos = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=jnp.int32))
    sizes = jnp.bincount(experts, length=num_experts).astype(jnp.int32)
    return order // k, pos, jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(sizes, dtype=jnp.int32)])
