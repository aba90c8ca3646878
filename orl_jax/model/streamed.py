"""A layer's matrix read in place from its stack, multiplied by the small-M GEMM kernel (cached passes).

`StackedWeight(stack, i)` stands for `stack[i]` wherever `layers.einsum` multiplies a weight. Under `lax.scan`
a body's slice of a stacked weight can reach its consumer as a copy (DiffusionGemma's nested layer scan made
12.5 GB of such temporaries per forward: benchmarks/results/2026-11-29_diffusion_gemma_h200.md); passing the
whole stack and the layer index lets kernels/small_m_gemm read layer i where it lies. Specs whose rows or
shapes the kernel does not take fall back to jnp.einsum, as do weights stored in another dtype than the
activations (mixed precision: casting the whole stack in every layer would cost more than the kernel saves).
The fallback multiplies `layer`, the slice as the layer loop itself delivers it (scan xs), when given: XLA feeds
that slice to cuBLAS in place, whereas `stack[index]` with an index it cannot tie to the loop is a copy (a
Qwen3-4B step lost ~2.3 ms at block 32 and ~4.7 ms at canvas 256 to such copies:
benchmarks/results/2026-11-30_engine_step_h200x2.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp


def gemm_dims(spec: str, x_shape, w_shape):
    """(groups E, rows M, contraction K, columns N, output shape) of an einsum `x, w -> out` that is a plain GEMM
    (E = 1: the contracted letters end x's spec and start w's, in the same order, and out = x's free letters +
    w's free letters) or a batched one (one leading letter shared by x, w and out, then the plain pattern, e.g.
    experts "ecd,edf->ecf"). None for any other spec."""
    ins, out = spec.split("->")
    xs, ws = ins.split(",")
    lead = ()
    if xs[0] == ws[0] == out[0] and xs[0] not in xs[1:] + ws[1:]:  # batched: a shared leading group letter
        lead, xs, ws, out = tuple(x_shape[:1]), xs[1:], ws[1:], out[1:]
        x_shape, w_shape = x_shape[1:], w_shape[1:]
    c = next((n for n in range(min(len(xs), len(ws)), 0, -1) if xs[-n:] == ws[:n]), 0)
    if not c or out != xs[:-c] + ws[c:]:
        return None
    m, k, n = math.prod(x_shape[:-c]), math.prod(x_shape[-c:]), math.prod(w_shape[c:])
    return (lead or (1,))[0], m, k, n, lead + tuple(x_shape[:-c]) + tuple(w_shape[c:])


def xla_ragged_dot(x: jax.Array, w: jax.Array, group_sizes: jax.Array, rows: jax.Array | None = None) -> jax.Array:
    """XLA's ragged_dot of x [M, K] (rows grouped; or x[rows] when rows [M] is given) with w [E, K, N]: float32
    accumulation, x's dtype."""
    x = x if rows is None else jnp.take(x, rows, axis=0)
    return jax.lax.ragged_dot(x, w.astype(x.dtype), group_sizes, preferred_element_type=jnp.float32).astype(x.dtype)


@dataclass(frozen=True)
class StackedWeight:
    stack: jax.Array  # [L, ...]: one weight per layer
    index: jax.Array  # int32 scalar: the layer
    layer: jax.Array | None = None  # stack[index] as the layer loop delivers it (the fallback's operand), if known

    def sliced(self) -> jax.Array:
        return self.stack[self.index] if self.layer is None else self.layer

    @property
    def shape(self) -> tuple[int, ...]:
        return self.stack.shape[1:]

    @property
    def dtype(self):
        return self.stack.dtype

    def ragged_dot(self, x: jax.Array, group_sizes: jax.Array, offsets: jax.Array | None = None,
                   rows: jax.Array | None = None) -> jax.Array:
        """moe.grouped_matmul's product (rows: as there): rows sorted by group times layer `index` of an expert
        stack [L, E, K, N], through kernels/grouped_gemm reading the stack in place (offsets: the groups' row
        offsets [E + 1] if the caller has them); shapes or dtypes it does not take fall back to XLA's ragged_dot on
        the slice (a copy, as XLA makes for its own ops)."""
        from orl_jax_kernels.grouped_gemm.kernel import grouped_matmul, supported

        if self.stack.ndim == 4 and self.stack.dtype == x.dtype and supported(*self.stack.shape[2:]):
            return grouped_matmul(x, self.stack, group_sizes, self.index, interpret=jax.default_backend() == "cpu",
                                  offsets=offsets, rows=rows)
        return xla_ragged_dot(x, self.sliced(), group_sizes, rows=rows)

    def einsum(self, spec: str, x: jax.Array) -> jax.Array:
        """x @ stack[index] by the einsum spec."""
        from orl_jax_kernels.small_m_gemm.kernel import batched_small_m_matmul, supported

        dims = gemm_dims(spec, x.shape, self.stack.shape[1:])
        if dims is not None and self.stack.dtype == x.dtype and supported(*dims[1:4]):
            e, m, k, n, out_shape = dims
            w = self.stack.reshape(self.stack.shape[0], e, k, n)  # contiguous: no copy
            y = batched_small_m_matmul(x.reshape(e, m, k), w, self.index,
                                       interpret=jax.default_backend() == "cpu")
            return y.reshape(out_shape)
        return jnp.einsum(spec, x, self.sliced().astype(x.dtype))


def as_stacked(w) -> StackedWeight:
    """w itself if it is a StackedWeight, else a one-layer stack of it (a free reshape)."""
    return w if isinstance(w, StackedWeight) else StackedWeight(w[None], jnp.int32(0))


def pack_vectors(layers: dict) -> tuple[dict, jax.Array | None, tuple[tuple[str, int, int], ...]]:
    """A layer-stack dict with its per-layer vectors ([L, n] arrays of the first vector's dtype: norm weights,
    scales) joined into one [L, sum n] array, for layer loops to slice once per layer: (the other stacks,
    packed, layout ((name, start, size), ...)). unpack_vectors(packed[i], layout) gives layer i's vectors back.

    Why: a layer loop hands each stacked operand to its layer as a per-iteration slice, and XLA on GPU copied
    every small vector slice in a separate launch (~1.7 us each, 7 per DiffusionGemma layer: see
    benchmarks/results/2026-11-30_dg_in_place_h200x2.md); one packed slice is one launch: 210 -> 35
    `memcpy32_post` per 26B forward (benchmarks/results/2026-11-30_dg_fused_qkv_h200x2.md)."""
    vectors = [n for n, a in layers.items() if a.ndim == 2]
    if len(vectors) < 2:
        return layers, None, ()
    dtype = layers[vectors[0]].dtype
    vectors = [n for n in vectors if layers[n].dtype == dtype]
    layout, start = [], 0
    for n in vectors:
        layout.append((n, start, layers[n].shape[1]))
        start += layers[n].shape[1]
    rest = {n: a for n, a in layers.items() if n not in vectors}
    return rest, jnp.concatenate([layers[n] for n in vectors], axis=1), tuple(layout)


def unpack_vectors(row: jax.Array, layout: tuple[tuple[str, int, int], ...]) -> dict:
    """One layer's vectors from its row of pack_vectors' array (static slices)."""
    return {n: row[start:start + size] for n, start, size in layout}


def vector_offsets(layout: tuple[tuple[str, int, int], ...], *names: str) -> tuple[int, ...] | None:
    """Where pack_vectors put each named vector in a packed row (its start), or None unless all of them are there:
    for kernels that read them in place from the packed stack (kernels/qk_norm_rope)."""
    starts = {name: start for name, start, _ in layout}
    return tuple(starts[n] for n in names) if all(n in starts for n in names) else None
