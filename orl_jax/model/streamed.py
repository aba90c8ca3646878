"""A layer's matrix read in place from its stack, multiplied by the small-M GEMM kernel (cached passes).

`StackedWeight(stack, i)` stands for `stack[i]` wherever `layers.einsum` multiplies a weight. Under `lax.scan`
the body's slice of a stacked weight reaches a custom call as a copy; passing the whole stack and the layer index
lets kernels/small_m_gemm read layer i where it lies. Specs whose rows or shapes the kernel does not take fall
back to jnp.einsum on the slice, as do weights stored in another dtype than the activations (mixed
precision: casting the whole stack in every layer would cost more than the kernel saves).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp


def gemm_dims(spec: str, x_shape, w_shape):
    """(rows M, contraction K, columns N, output shape) of an einsum `x, w -> out` that is a plain 2-D GEMM:
    the contracted letters end x's spec and start w's (same order), and out = x's free letters + w's free
    letters. None for any other spec."""
    ins, out = spec.split("->")
    xs, ws = ins.split(",")
    c = next((n for n in range(min(len(xs), len(ws)), 0, -1) if xs[-n:] == ws[:n]), 0)
    if not c or out != xs[:-c] + ws[c:]:
        return None
    m = math.prod(x_shape[:-c])
    k = math.prod(x_shape[-c:])
    n = math.prod(w_shape[c:])
    return m, k, n, tuple(x_shape[:-c]) + tuple(w_shape[c:])


@dataclass(frozen=True)
class StackedWeight:
    stack: jax.Array  # [L, ...]: one weight per layer
    index: jax.Array  # int32 scalar: the layer

    def einsum(self, spec: str, x: jax.Array) -> jax.Array:
        from orl_jax_kernels.small_m_gemm.kernel import small_m_matmul, supported

        dims = gemm_dims(spec, x.shape, self.stack.shape[1:])
        if dims is not None and self.stack.dtype == x.dtype and supported(*dims[:3]):
            m, k, n, out_shape = dims
            w = self.stack.reshape(self.stack.shape[0], k, n)  # contiguous: no copy
            y = small_m_matmul(x.reshape(m, k), w, self.index, interpret=jax.default_backend() == "cpu")
            return y.reshape(out_shape)
        return jnp.einsum(spec, x, self.stack[self.index].astype(x.dtype))
