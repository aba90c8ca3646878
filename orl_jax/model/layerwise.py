"""A transform of a layer stack [L, ...] done one layer at a time, in the stack's own buffer.

Why: inference-only layouts and folds (diffusion_gemma_inference, moe.fuse_gate_up) rewrite the 26B's expert
stacks, 25 GB (sliding) and 5 GB (full) of its ~50 GB. As one jitted `jax.lax.map`, XLA held the result beside the
input and its loop's temporaries: on the CPU backend, compiled for a small stack, 2x the stack in temporaries plus
the result, 3x when the input was donated (`Compiled.memory_analysis()`). The 26B then needed ~80 GB or more to
reach its inference layout, which an 80 GB GPU does not have. `map_layers` dispatches two small programs per
layer instead: a slice of layer i, and the layer's result written into the stack at i (a donated buffer updated in
place: no temporaries). The stack is either the caller's (donate=True: consumed) or one copy of it, so the whole
transform needs one layer or one stack more than the params themselves.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

_take = jax.jit(lambda s, i: jax.lax.dynamic_index_in_dim(s, i, keepdims=False, allow_negative_indices=False))
_put = jax.jit(lambda s, u, i: jax.lax.dynamic_update_index_in_dim(s, u, i, 0), donate_argnums=(0,))


@functools.partial(jax.jit, static_argnames=("shape",), donate_argnums=(0,))
def _reshape(s, shape):
    return s.reshape(shape)


def map_layers(stack: jax.Array, fn: Callable, *per_layer: jax.Array, donate: bool = False,
               out_shape: tuple[int, ...] | None = None) -> jax.Array:
    """[fn(stack[i], *(a[i] for a in per_layer)) for each layer i] as one stack, computed layer by layer in the
    stack's buffer. fn must return as many elements of the stack's dtype as a layer holds, in any shape: its
    result is stored row-major in the layer's place, and out_shape ([L, ...], default the stack's) is the shape
    of the whole result. donate: the caller's stack is consumed (deleted), else the transform works on a copy.
    per_layer: arrays with the stack's leading L, sliced like it."""
    n = stack.shape[0]
    if any(a.shape[:1] != (n,) for a in per_layer):
        raise ValueError(f"map_layers: per_layer arrays must lead with the stack's {n} layers, got "
                         f"{[a.shape for a in per_layer]}")
    out_shape = tuple(stack.shape) if out_shape is None else tuple(out_shape)
    if out_shape[:1] != (n,) or math.prod(out_shape) != stack.size:
        raise ValueError(f"map_layers: out_shape {out_shape} must hold the stack's {stack.shape} elements, "
                         f"layer by layer")
    layer_shape = stack.shape[1:]
    got = jax.eval_shape(fn, jax.ShapeDtypeStruct(layer_shape, stack.dtype),
                         *(jax.ShapeDtypeStruct(a.shape[1:], a.dtype) for a in per_layer))
    if got.dtype != stack.dtype or got.size != math.prod(layer_shape):
        raise ValueError(f"map_layers: fn must return {math.prod(layer_shape)} elements of {stack.dtype} per "
                         f"layer, got {got.shape} {got.dtype}")
    step = jax.jit(lambda w, *a: fn(w, *a).reshape(layer_shape))
    out = stack if donate else jnp.copy(stack)
    for i in range(n):
        out = _put(out, step(_take(out, i), *(_take(a, i) for a in per_layer)), i)
    return out if out_shape == out.shape else _reshape(out, out_shape)
