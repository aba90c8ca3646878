"""The oracle for the grouped GEMM kernel: jax.lax.ragged_dot with float32 accumulation."""

import jax
import jax.numpy as jnp


def grouped_matmul_reference(x, w, group_sizes):
    """x [M, K] sorted by group, w [E, K, N], group_sizes [E] -> [M, N] in x's dtype (rows past the groups: 0)."""
    return jax.lax.ragged_dot(x, w, group_sizes.astype(jnp.int32), preferred_element_type=jnp.float32).astype(x.dtype)


def lead_as_experts(lead_w, lead, k: int, n: int):
    """The lead weight [K', N'] of kernel.Lead as the expert weights [lead.groups, K, N] its leading groups multiply
    (slice s = group // lead.per_slice): what the kernel reads in place, materialized."""
    kl, nl = lead_w.shape
    if lead.gated:  # [K, 2, S, N / 2] -> slice s: [gate_s | up_s]
        slices = lead_w.reshape(kl, 2, nl // n, n // 2).transpose(2, 0, 1, 3).reshape(nl // n, kl, n)
    else:
        slices = lead_w.reshape(kl // k, k, nl)
    return jnp.repeat(slices, lead.per_slice, axis=0)[:lead.groups]
