"""Which tokens each DiffusionGemma query sees, per layer type (FULL, SLIDING) and, with a cache, over the cache's
slots ("cache_" + type): the visibility dicts `diffusion_gemma.backbone` takes ([B, L, L] among the current
tokens, [B, L, S] over the cache). The rules (HF's masks and what its DynamicCache keeps) are in
diffusion_gemma.py's docstring, "Sliding window"."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from orl_jax.diffusion_gemma_config import FULL, SLIDING, DiffusionGemmaConfig
from orl_jax.model.attention import block_segments, causal_segments, full_segments, self_mask, window_mask
from orl_jax.model.cache import HybridKVCache


def encoder_vis(cfg: DiffusionGemmaConfig, b: int, l: int, valid=None, cache=None) -> dict:
    """Causal, with the window on sliding layers; query i sits at cache slot `length + i`."""
    full = self_mask(causal_segments(b, l), valid)
    vis = {FULL: full, SLIDING: full & window_mask(causal_segments(b, l), jnp.arange(l), cfg.sliding_window)}
    return vis if cache is None else vis | cache_vis(cfg, cache, cache.length + causal_segments(b, l))


def decoder_vis(cfg: DiffusionGemmaConfig, b: int, l: int, cache: HybridKVCache) -> dict:
    """Bidirectional canvas; every canvas token sees the committed prefix, sliding layers its last W - 1 slots."""
    full = self_mask(full_segments(b, l))
    # all canvas tokens see the window of the first one
    return {FULL: full, SLIDING: full, **cache_vis(cfg, cache, jnp.broadcast_to(cache.length, (b, l)))}


def cache_vis(cfg: DiffusionGemmaConfig, cache: HybridKVCache, q: jax.Array) -> dict:
    """Visibility of the cache's committed slots to queries at cache positions q [B, L]: every valid slot in full
    layers, the W - 1 slots before q in sliding layers."""
    b, l = q.shape
    slots = jnp.arange(cache.size, dtype=jnp.int32)
    m = (slots[None] >= cache.start[:, None]) & (slots[None] < cache.length)  # [B, S]
    m = jnp.broadcast_to(m[:, None, :], (b, l, cache.size))
    return {"cache_" + FULL: m, "cache_" + SLIDING: m & window_mask(q, slots, cfg.sliding_window)}


def fused_vis(cfg: DiffusionGemmaConfig, b: int, n_enc: int, n_dec: int, valid=None, cache=None) -> dict:
    """Visibility of a fused pass over [encoder tokens | canvas] (`prefill_decode`, `commit_decode`): the encoder
    tokens causal (`encoder_vis`), the canvas one segment after them (`decoder_vis`: every committed token and the
    whole canvas). Each canvas token's window is the first canvas token's (slot n_enc after the cache): the last
    W - 1 committed slots, as the decoder's cache mask. valid [B, n_enc + n_dec]: key validity (left padding);
    cache: its parts too, each row's window anchored at cache slot length + its segment start."""
    n = n_enc + n_dec
    seg = block_segments(b, n, n_enc, n_dec)  # encoder token i: i; canvas tokens: n_enc
    full = self_mask(seg, valid)
    vis = {FULL: full, SLIDING: full & window_mask(seg, jnp.arange(n), cfg.sliding_window)}
    return vis if cache is None else vis | cache_vis(cfg, cache, cache.length + seg)
