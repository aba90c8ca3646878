"""Grouped-query attention over [cache | current tokens], and the visibility masks of block diffusion.

Every pass attends to the concatenation of the KV cache (committed prefix) and the tokens of the pass itself.
Which keys a query sees is a boolean mask [B, L, S + L] built here:

- cache part: a slot is visible when it holds a committed token of this row (start[b] <= slot < length);
- self part: `seg_start` gives each current token the index of the first token of its visibility segment, and
  query q sees key k iff seg_start[k] <= seg_start[q]. Per-token segments give a causal mask, one segment a fully
  bidirectional canvas, and prompt-tokens-causal + answer-blocks gives block-causal (block diffusion training);
- staircase (ORL replay) masks are built by the trainer and passed in whole.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from orl_jax.model.streamed import StackedWeight

_NEG = -0.7 * float(jnp.finfo(jnp.float32).max)  # finite: a fully masked row (left padding) stays NaN-free
CUDNN_MAX_HEAD_DIM = 256  # cuDNN's fused attention (cudnn frontend support matrix: d <= 256)

# Heads wider than CUDNN_MAX_HEAD_DIM (DiffusionGemma's 512-wide full layers; no fused kernel takes them) on the
# einsum path: True joins the cache and self parts (their K/V and masks concatenated: one score GEMM, one softmax
# pass, one PV GEMM) instead of a score GEMM per part and a softmax over their concatenated float32 scores. On an H200
# the 26B forward took 15.59 / 15.58 against 15.69 / 15.70 ms per part, and 15.62 / 15.59 against 15.67 / 15.67 in
# another call; writing the scores in bf16 (HF's eager order) was slower, 15.77 / 15.75
# (benchmarks/results/2026-12-01_dg_routing_chain_h200.md). Read at trace time; see `attention`.
JOIN_WIDE_PARTS = True
# ... and normalize late: PV over exp(s - max), its [.., L, H] output divided by the row sums (scaled_attention's
# late_normalize), not the [.., L, S] probabilities. On an H200 the 26B forward took 15.59 / 15.61 against 15.63 /
# 15.66 ms, alternating in one process (2026-12-01_dg_routing_chain_h200.md): small, the same sign twice. Read at
# trace time.
WIDE_LATE_NORMALIZE = True
# ... and with impl "pallas", where the shape fits it: the mask, scale and softmax between the two einsums in one
# pass of kernels/masked_softmax instead of XLA's four (~26 us per 26B full layer in the session-20 profile); the
# probabilities are normalized before PV then (HF's eager order), not late. On an H200 the 26B forward took
# 15.58 / 15.58 ms against 15.63 / 15.62 / 15.61 without, alternating in one process
# (benchmarks/results/2026-12-01_dg_attention_order_h200.md, call 6). Read at trace time.
WIDE_SOFTMAX_KERNEL = True
# On that path the queries go in query-major, [B, K, G, L, H], so the score GEMM (batched over (b, k), rows (g, l))
# writes [B, K, G, L, S], the softmax kernel's rows, and PV writes [B, K, G, L, H]. The einsums on [B, L, K, G, H]
# queries before made XLA compute the scores keys-major ([K, S, L G]) and transpose them (float32 [2, 8, 256, 1024]
# per 26B full layer: 11.2 us in the session-21 profile); on an H200 the 26B forward took 14.946 / 14.960 ms against
# 15.036 / 15.015 with them per forward in a device loop, alternating in one process
# (benchmarks/results/2026-12-01_dg_query_major_h200.md; the switch that compared them is in git at a6ef11e).
# Head dims sent to that joined einsum path even where kernels/decode_attention takes them (a benchmark switch).
# DiffusionGemma's 256-wide sliding layers that way (cuBLAS and kernels/masked_softmax): 15.43-15.45 ms per 26B
# forward against 15.07-15.09 with the kernel, alternating in one process
# (benchmarks/results/2026-12-04_dg_fused_expert_mlp_h200.md); the DiffusionGemma benchmark uses it to show how far
# rounding alone moves the random-weight model's logits. Read at trace time.
EINSUM_HEAD_DIMS: tuple[int, ...] = ()


class KernelMask(NamedTuple):
    """A cache part's visibility as kernels/decode_attention takes it, made once per pass outside the layer loop
    (`kernel_masks`): the int8 mask [B, L, S] and each query's extent [B, L] (one past its last visible slot). The
    other attention paths read `mask`."""
    mask: jax.Array
    extent: jax.Array


def kernel_masks(vis: dict[str, jax.Array], cache_names: tuple[str, ...]) -> dict:
    """A pass's visibility masks for the Pallas attention, computed once before the layer loop: every mask as int8
    (the kernel's operand; one conversion, not one per layer) and the cache parts' (those in cache_names) as
    KernelMask. Behind an optimization barrier: otherwise XLA sinks a constant mask (a canvas's all-visible self
    part) into the layer loop as a broadcast launched in every layer, and recomputes the extent's two reductions
    in every DiffusionGemma sliding layer (~1-2 us each). 73 launches fewer per 26B forward, 39 per Qwen3-4B step;
    no measurable change in speed (they ran beside the layers' dependency chain in the CUDA graph), a shorter
    profile (benchmarks/results/2026-12-03_engine_invariants_h200.md)."""
    from orl_jax_kernels.decode_attention.kernel import cache_extent

    out = {name: m.astype(jnp.int8) for name, m in vis.items()}
    out |= {name: KernelMask(out[name], cache_extent(out[name])) for name in cache_names}
    return jax.lax.optimization_barrier(out)


def _mask(m) -> jax.Array:
    return m.mask if isinstance(m, KernelMask) else m


def _extent(m) -> jax.Array | None:
    return m.extent if isinstance(m, KernelMask) else None


def attention(q: jax.Array, parts: list[tuple[jax.Array, jax.Array, jax.Array]], impl: str = "orl_jax",
              scale: float | None = None) -> jax.Array:
    """q [B, L, N, H]; parts: (k [B, S, K, H], v [B, S, K, H], mask [B, L, S]) -> [B, L, N, H]; a cache part's mask
    may be a KernelMask (`kernel_masks`).

    The parts (cache, self) share one softmax: their scores are concatenated, not their K/V, so a long cache is
    read once and not copied; heads wider than cuDNN's join the parts instead (JOIN_WIDE_PARTS, measured faster
    there), and with impl "pallas" their mask and softmax run in kernels/masked_softmax (WIDE_SOFTMAX_KERNEL).
    Scores and softmax run in float32 (as HF's eager attention does). scale: of the scores, head_dim ** -0.5 by
    default (Gemma 4 uses 1.0: its q/k RMSNorms set the scale).
    impl "pallas" (cache + self parts, shapes the kernel supports and is measured faster at: `preferred`):
    kernels/decode_attention's fused kernel; one part (a cache-free inference pass): its masked_attention. The
    cache part's k and v may be StackedWeight (layer i of the cache stacks): the kernel then reads them in place
    when its blocks say cache_in_place, every other path takes the layer loop's slice.
    impl "xla" / "cudnn": jax.nn.dot_product_attention with that implementation, the mask passed whole. With two
    parts (cache + self) their K/V and masks are concatenated first: one copy of the layer's cache per pass, the
    price of a fused kernel (cuDNN's flash attention) that takes one key sequence. cuDNN takes head dims <= 256;
    wider heads (DiffusionGemma's full layers) take orl_jax's einsums. A query row with no visible key (padding)
    may differ from ours (the mean of all values); no loss reads such rows, but the value must stay finite, since
    masked keys still multiply it by 0 in later layers (tests: test_objectives.py, the cuDNN one marked gpu;
    self_mask lets padding rows see themselves, so cached passes have no such row).
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale  # jax.nn.dot_product_attention's default too
    forced = q.shape[-1] in EINSUM_HEAD_DIMS
    # the fused kernel takes as many own keys as queries (a pass's last layer may keep fewer query rows)
    if impl == "pallas" and len(parts) == 2 and not forced and parts[1][0].shape[1] == q.shape[1]:
        from orl_jax_kernels.decode_attention.kernel import cached_attention

        (kc, vc, cm), (ks, vs, sm) = parts
        plan = _kernel_plan(kc, vc, q.shape[1], q.shape[-1], q.shape[2] // kc.shape[2])
        if plan is not None:
            blocks, kc, vc, layer = plan
            return cached_attention(q, kc, vc, _mask(cm), ks, vs, sm, scale=scale, blocks=blocks, layer=layer,
                                    extent=_extent(cm), interpret=jax.default_backend() == "cpu")
    if impl == "pallas" and len(parts) == 1 and not forced:  # a cache-free inference pass (DiffusionGemma's
        # UNCACHED_ATTENTION = "pallas"): the kernel over the pass's own keys alone
        from orl_jax_kernels.decode_attention.kernel import masked_attention

        (k, v, m), = parts
        plan = _kernel_plan(k, v, q.shape[1], q.shape[-1], q.shape[2] // k.shape[2])
        if plan is not None:
            blocks, k, v, _ = plan
            return masked_attention(q, k, v, _mask(m), scale=scale, blocks=blocks, extent=_extent(m),
                                    interpret=jax.default_backend() == "cpu")
    parts = [(k, v, _mask(m)) for k, v, m in parts]
    if impl in ("xla", "cudnn") and not (impl == "cudnn" and q.shape[-1] > CUDNN_MAX_HEAD_DIM):
        k, v, mask = _joined(parts)
        return jax.nn.dot_product_attention(q, k, v, mask=mask[:, None], scale=scale, implementation=impl)
    if JOIN_WIDE_PARTS and len(parts) > 1 and (q.shape[-1] > CUDNN_MAX_HEAD_DIM or forced):
        joined = _joined(parts)
        if impl == "pallas" and WIDE_SOFTMAX_KERNEL:
            from orl_jax_kernels.masked_softmax.kernel import supported as softmax_supported

            if softmax_supported(q.shape[1], joined[0].shape[1]):
                return scaled_attention(q, [joined], scale, softmax_kernel=True)
        return scaled_attention(q, [joined], scale, late_normalize=WIDE_LATE_NORMALIZE)
    return scaled_attention(q, [(_slice(k), _slice(v), m) for k, v, m in parts], scale)


def attention_normed(proj: jax.Array, cache_part: tuple, self_vis: jax.Array, cos: jax.Array, sin: jax.Array,
                     packed_vectors: tuple, eps: float, gemma: bool, scale: float | None = None) -> jax.Array | None:
    """The cached pass's attention straight from the fused projection proj [B, L, K, G + 2, H] (raw q, k, v), the
    q/k norms and RoPE inside kernels/decode_attention (`cached_attention_normed`): one launch instead of the norm
    kernel's and the attention's. packed_vectors: (stack [layers, n], layer, (q offset, k offset)) where the norm
    weights lie. None where the kernel's blocks for the shape are grouped, unsupported or not preferred (the
    caller takes the two-kernel path)."""
    from orl_jax_kernels.decode_attention.kernel import cached_attention_normed

    kc, vc, cm = cache_part
    b, l, kv, slots, h = proj.shape
    plan = _kernel_plan(kc, vc, l, h, slots - 2)
    if plan is None or plan[0].group_heads:
        return None
    blocks, kc, vc, layer = plan
    vectors, vec_layer, offsets = packed_vectors
    return cached_attention_normed(proj, kc, vc, _mask(cm), self_vis, cos, sin, vectors, vec_layer, offsets=offsets,
                                   eps=eps, gemma=gemma, scale=h ** -0.5 if scale is None else scale,
                                   blocks=blocks, layer=layer, extent=_extent(cm),
                                   interpret=jax.default_backend() == "cpu")


def _kernel_plan(kc, vc, l: int, h: int, g: int):
    """The attention kernel's blocks for l queries over the cache part (kc, vc) (head dim h, g query heads per kv
    head), and the cache as the kernel takes it: (blocks, k, v, layer), the whole stacks and the layer index when the
    blocks read the cache in place, else the layer loop's slices and None. None where the kernel does not take the
    shape or is not preferred there."""
    from orl_jax_kernels.decode_attention.kernel import blocks_for, fits, preferred, supported

    s, itemsize = kc.shape[-3], jnp.dtype(kc.dtype).itemsize
    blocks = blocks_for(l, s, h, g, itemsize)
    # no blocks within shared memory (float32 passes of > 64 queries at wide heads): the einsums
    if not (supported(l, s, h, blocks, g) and preferred(l, s, h, g) and fits(blocks, h, g, itemsize)):
        return None
    if blocks.cache_in_place and isinstance(kc, StackedWeight):
        return blocks, kc.stack, vc.stack, kc.index
    return blocks, _slice(kc), _slice(vc), None


def _slice(a):
    """A cache part's array; a StackedWeight (a layer of the cache stacks) as the layer loop delivers it."""
    return a.sliced() if isinstance(a, StackedWeight) else a


def _joined(parts: list[tuple]) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The parts as one key sequence: K and V concatenated along the keys, the masks along their key axis."""
    ks, vs, masks = zip(*[(_slice(k), _slice(v), m) for k, v, m in parts])
    return jnp.concatenate(ks, axis=1), jnp.concatenate(vs, axis=1), jnp.concatenate(masks, axis=-1)


def scaled_attention(q: jax.Array, parts: list[tuple[jax.Array, jax.Array, jax.Array]], scale: float,
                     late_normalize: bool = False, softmax_kernel: bool = False) -> jax.Array:
    """`attention` with an explicit score scale (Gemma 4 uses 1.0: its q/k RMSNorms set the scale).
    late_normalize: the PV product takes the unnormalized exp(s - max) and its output [.., L, H] is divided by the
    row sums, instead of the probabilities [.., L, S] (fewer passes over the scores when S is long).
    softmax_kernel (one part, shapes kernels/masked_softmax supports): the scale, mask and softmax of the float32
    scores in that kernel's one pass, its probabilities in the value dtype (WIDE_SOFTMAX_KERNEL), the products
    query-major."""
    b, l, n, h = q.shape
    kv = parts[0][0].shape[2]
    qg = q.reshape(b, l, kv, n // kv, h)  # [B, L, K, G, H]
    if softmax_kernel:
        from orl_jax_kernels.masked_softmax.kernel import masked_softmax

        (k, v, mask), = parts
        # batch (b, k), rows (g, l): the GEMMs write the layouts the kernel and o want (query-major, above)
        qt = jnp.transpose(qg, (0, 2, 3, 1, 4))  # [B, K, G, L, H]
        s = jax.lax.dot_general(qt, k, (((4,), (3,)), ((0, 1), (0, 2))), preferred_element_type=jnp.float32)
        p = masked_softmax(s, mask, scale=scale, dtype=v.dtype, interpret=jax.default_backend() == "cpu")
        o = jax.lax.dot_general(p, v, (((4,), (1,)), ((0, 1), (0, 2))), preferred_element_type=jnp.float32)
        return jnp.transpose(o.astype(q.dtype), (0, 3, 1, 2, 4)).reshape(b, l, n, h)  # [B, L, N, H]
    raw = [jnp.einsum("blkgh,bskh->bkgls", qg, k, preferred_element_type=jnp.float32) for k, _, _ in parts]
    s = jnp.concatenate([jnp.where(m[:, None, None], r * scale, _NEG) for r, (_, _, m) in zip(raw, parts)],
                        axis=-1)  # [B, K, G, L, S]
    if late_normalize:
        p = jnp.exp(s - jax.lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True)))
        total = jnp.sum(p, axis=-1)  # [B, K, G, L]
    else:
        p = jax.nn.softmax(s, axis=-1)
    o, at = 0.0, 0
    for k, v, _ in parts:
        o = o + jnp.einsum("bkgls,bskh->blkgh", p[..., at:at + k.shape[1]].astype(v.dtype), v,
                           preferred_element_type=jnp.float32)
        at += k.shape[1]
    if late_normalize:
        o = o / jnp.transpose(total, (0, 3, 1, 2))[..., None]
    return o.astype(q.dtype).reshape(b, l, n, h)  # [B, L, N, H]


# --- segment starts for the self part ------------------------------------------------------------------------

def causal_segments(batch: int, length: int) -> jax.Array:
    """Each token its own segment: a causal mask."""
    return jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))


def full_segments(batch: int, length: int) -> jax.Array:
    """One segment: every token sees every other (a diffusion canvas)."""
    return jnp.zeros((batch, length), jnp.int32)


def block_segments(batch: int, length: int, prompt_length, block_length: int) -> jax.Array:
    """Block-causal: prompt tokens causal, then blocks of `block_length` bidirectional inside, causal across.

    prompt_length: one int for all rows, or [B] per row. Each token's value is the first index of its block."""
    i = jnp.arange(length, dtype=jnp.int32)[None]  # [1, L]
    p = jnp.asarray(prompt_length, jnp.int32).reshape(-1, 1)  # [1 or B, 1]
    blk = p + (i - p) // block_length * block_length
    return jnp.broadcast_to(jnp.where(i < p, i, blk), (batch, length))


def self_mask(seg_start: jax.Array, valid: jax.Array | None = None) -> jax.Array:
    """[B, L] segment starts (+ optional [B, L] key validity) -> [B, L, L] visibility. An invalid key (left padding)
    is hidden from every query but itself: no row is fully masked, which fused kernels (cuDNN) leave undefined; a
    pad row's output is never read."""
    m = seg_start[:, None, :] <= seg_start[:, :, None]
    return m if valid is None else (m & valid[:, None, :]) | jnp.eye(m.shape[-1], dtype=bool)[None]


def cache_mask(start: jax.Array, length: jax.Array, cache_size: int, num_queries: int) -> jax.Array:
    """[B, L, S]: slot j of row b is visible iff start[b] <= j < length."""
    j = jnp.arange(cache_size, dtype=jnp.int32)
    m = (j[None] >= start[:, None]) & (j[None] < length)  # [B, S]
    return jnp.broadcast_to(m[:, None, :], (start.shape[0], num_queries, cache_size))


def window_mask(q_slots: jax.Array, k_slots: jax.Array, window: int) -> jax.Array:
    """Sliding-window visibility: key slot k is within `window` of query slot q iff q - k < window (the query
    itself counts: `window` keys in all, transformers' sliding_window_overlay). q_slots [B, L], k_slots [B, S] or
    [S] -> [B, L, S]. Combine with a causal / cache mask by `&`."""
    k = k_slots if k_slots.ndim == 2 else k_slots[None]
    return (q_slots[:, :, None] - k[:, None, :]) < window
