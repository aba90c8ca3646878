"""The first bytes of one layer of a weight stack pulled into the GPU's L2 ahead of the kernel that reads them: PTX's
bulk prefetch (`cp.async.bulk.prefetch.L2.global`, sm_90), issued by a launch of a few single-warp programs that
end as soon as each thread has issued its requests; the copy engine does the reading.

Why (issue #4): DiffusionGemma's expert kernel streams 1.52 GB per 26B layer near the chip's read rate, while the
~100 us of the layer before it (attention, dense MLP, routing) is compute- and latency-bound and leaves HBM mostly
idle. Session 22 read the first experts into L2 with ordinary loads from 176 programs and lost 0.2-0.4 ms per
forward: those programs took SMs from the latency-bound routing chain. A bulk prefetch takes one warp per program
for the microseconds it needs to issue. With `evict_last` (an L2 cache policy on the requests) the lines are meant
to outlive the ~100 MB of other weights the layer reads before its experts.

A hint: it changes no value. The [programs] int32 zeros it returns exist to order it before the reader (add
token[0] to the reader's layer index: XLA cannot fold it away, and the prefetch is then not dead code). Without a
GPU nothing is issued and zeros are returned. A raw Triton kernel through jax-triton (Pallas has no pointer to hand
inline PTX).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

ALIGN = 16  # the bulk prefetch's address and size granularity (bytes)
MAX_REQUEST = (1 << 20) - ALIGN  # the largest size one request may name (ptxas: "expected to be in range [0..1048560]")


def plan(shape, dtype, nbytes: int, programs: int, chunks: int) -> tuple[int, int]:
    """(elements per layer, elements per request) for prefetching the first `nbytes` of a layer of a stack of
    `shape` / `dtype`, split into programs x chunks requests. ValueError names what does not fit."""
    if len(shape) < 2:
        raise ValueError(f"prefetch_l2: stack must be [L, ...], got shape {tuple(shape)}")
    item = jnp.dtype(dtype).itemsize
    layer_elems = 1
    for s in shape[1:]:
        layer_elems *= s
    if programs < 1 or chunks < 1 or chunks & (chunks - 1):
        raise ValueError(f"prefetch_l2: programs={programs} must be >= 1 and chunks={chunks} a power of two")
    requests = programs * chunks
    if nbytes <= 0 or nbytes % (ALIGN * requests) or nbytes > layer_elems * item:
        raise ValueError(f"prefetch_l2: nbytes={nbytes} must be a positive multiple of {ALIGN} x programs x chunks "
                         f"= {ALIGN * requests} and at most one layer's {layer_elems * item} bytes")
    if nbytes // requests > MAX_REQUEST:
        raise ValueError(f"prefetch_l2: nbytes={nbytes} over programs={programs} x chunks={chunks} requests is "
                         f"{nbytes // requests} bytes each, over the {MAX_REQUEST} one request may name")
    if (layer_elems * item) % ALIGN:
        raise ValueError(f"prefetch_l2: a layer of {layer_elems * item} bytes is not {ALIGN}-byte aligned")
    return layer_elems, nbytes // requests // item


def _asm(chunk_bytes: int, evict_last: bool) -> str:
    if not evict_last:
        return f"cp.async.bulk.prefetch.L2.global [$1], {chunk_bytes}; mov.u32 $0, 0;"
    return ("{ .reg .b64 pol; createpolicy.fractional.L2::evict_last.b64 pol, 1.0; "
            f"cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], {chunk_bytes}, pol; }} mov.u32 $0, 0;")


@functools.cache
def _triton_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def prefetch(w_ptr, layer_ptr, out_ptr, LAYER_ELEMS: tl.constexpr, CHUNK_ELEMS: tl.constexpr,
                 CHUNKS: tl.constexpr, ASM: tl.constexpr):
        pid = tl.program_id(0)
        layer = tl.load(layer_ptr).to(tl.int64)
        chunk = (pid * CHUNKS + tl.arange(0, CHUNKS)).to(tl.int64)
        addr = (w_ptr + layer * LAYER_ELEMS + chunk * CHUNK_ELEMS).to(tl.int64)
        done = tl.inline_asm_elementwise(ASM, "=r,l", [addr], dtype=tl.int32, is_pure=False, pack=1)
        tl.store(out_ptr + pid, tl.sum(done, axis=0))

    return prefetch


def prefetch_l2(stack: jax.Array, layer, nbytes: int, *, programs: int = 1, chunks: int = 64,
                evict_last: bool = True) -> jax.Array:
    """Prefetch bytes [0, nbytes) of stack[layer] into L2 (layer: an int32 scalar, traced or not). Returns [programs]
    int32 zeros that depend on the launch. programs x chunks requests of nbytes / (programs x chunks) bytes, one
    requests per thread of a single-warp program at chunks = 64."""
    layer_elems, chunk_elems = plan(stack.shape, stack.dtype, nbytes, programs, chunks)
    token = jax.ShapeDtypeStruct((programs,), jnp.int32)
    if jax.default_backend() != "gpu":
        return jnp.zeros(token.shape, token.dtype)
    import jax_triton

    layer_arr = jnp.reshape(jnp.asarray(layer, jnp.int32), (1,))
    item = jnp.dtype(stack.dtype).itemsize
    return jax_triton.triton_call(
        stack, layer_arr, kernel=_triton_kernel(), out_shape=token, grid=(programs,), name="prefetch_l2",
        num_warps=1, num_stages=1, LAYER_ELEMS=layer_elems, CHUNK_ELEMS=chunk_elems, CHUNKS=chunks,
        ASM=_asm(chunk_elems * item, evict_last))
