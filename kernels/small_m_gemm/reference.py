"""The oracle for the small-M GEMM kernel: x [M, K] @ w [K, N] with float32 accumulation."""

import jax.numpy as jnp


def matmul_reference(x, w, out_dtype=None):
    out = jnp.dot(x, w, preferred_element_type=jnp.float32)
    return out.astype(out_dtype or x.dtype)
