"""The oracle of kernel.expert_mlp, from the untiled weights: jnp on each expert's sorted rows."""

import jax.numpy as jnp


def expert_mlp_reference(x, rows, sizes, gate_up, down, act):
    """x [T, D], rows [M] (the token of each sorted row), sizes [E] (rows per expert, in order), gate_up [E, D, 2F],
    down [E, F, D] -> [sum(sizes), D] in x's dtype, with the kernel's roundings (g and u to x's dtype, then h)."""
    xs = x[rows].astype(jnp.float32)
    group = jnp.repeat(jnp.arange(sizes.shape[0]), sizes, total_repeat_length=int(sizes.sum()))
    xs = xs[: group.shape[0]]
    gu = jnp.einsum("md,mdf->mf", xs, gate_up[group].astype(jnp.float32)).astype(x.dtype).astype(jnp.float32)
    g, u = jnp.split(gu, 2, axis=-1)
    h = (act(g) * u).astype(x.dtype).astype(jnp.float32)
    return jnp.einsum("mf,mfd->md", h, down[group].astype(jnp.float32)).astype(x.dtype)
