"""QwenDLM: the Qwen3 backbone run as a block-diffusion model (METHOD.md §1, §3).

Three passes over one set of weights:
- prefill / encode: the prompt, causal, writes its K/V into the cache (the unchanged AR model);
- decode: a canvas of `block_length` tokens that sees the committed prefix and itself bidirectionally; it reads
  the cache and never writes it. The residual adapter g_phi adds g_phi(z) to the canvas embedding, where z is the
  residual the decoder carries from its previous step (decode/residual.py);
- commit: the finished block, written into the cache with `cfg.prefix_attention` visibility (causal = the
  encoder of DiffusionGemma's recipe; block_causal = bidirectional inside the block, SDAR style).

Two noise modes share the passes: "uniform" (the canvas starts as random tokens) and "mask" (it starts as
cfg.mask_token_id); they differ only in the decoder loop (decode/samplers.py), not here.

Block-causal training visibility for whole sequences is `qwen3.forward(..., seg_start=block_segments(...))`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from orl_jax.config import ModelConfig
from orl_jax.model import qwen3
from orl_jax.model.attention import causal_segments, full_segments, self_mask
from orl_jax.model.cache import KVCache

param_specs = qwen3.param_specs
embed = qwen3.embed


def residual_embed(params: dict, cfg: ModelConfig, tokens: jax.Array, z: jax.Array, w: jax.Array) -> jax.Array:
    """E[x] + w * g_phi(z): the ORL residual input (w = 1 everywhere for the uniform family)."""
    if not cfg.has_adapter:
        raise ValueError("the residual adapter needs ModelConfig.adapter_hidden > 0")
    g = qwen3.adapter(params["adapter"], cfg, z)
    return qwen3.embed(params, cfg, tokens) + w[..., None].astype(g.dtype) * g


def soft_embed(params: dict, cfg: ModelConfig, probs: jax.Array) -> jax.Array:
    """z = p @ E: [B, L, V] -> [B, L, D] in the compute dtype."""
    dt = cfg.jnp_dtype
    return jnp.einsum("blv,vd->bld", probs.astype(dt), params["embed"].astype(dt),
                      preferred_element_type=jnp.float32).astype(dt)


def init_cache(cfg: ModelConfig, batch: int, size: int) -> KVCache:
    return KVCache.empty(cfg.num_layers, batch, size, cfg.num_kv_heads, cfg.head_dim, cfg.jnp_dtype)


def prefill(params: dict, cfg: ModelConfig, tokens: jax.Array, lengths: jax.Array, cache_size: int):
    """Encode left-padded prompts. tokens [B, P] (row b's prompt in the last lengths[b] slots).

    Returns (float32 logits of the last prompt token [B, V], cache with slots [0, P) written).
    """
    qwen3.check_tokens(tokens, cfg)
    b, p = tokens.shape
    if cache_size < p:
        raise ValueError(f"cache_size={cache_size} is smaller than the padded prompt length {p}")
    cache = init_cache(cfg, b, cache_size)
    start = (p - lengths).astype(jnp.int32)
    cache = cache.replace(start=start)
    positions = jnp.maximum(cache.positions(p), 0)
    valid = jnp.arange(p)[None] >= start[:, None]  # [B, P]: pad keys are invisible
    vis = self_mask(causal_segments(b, p), valid)
    h, k, v = qwen3.backbone(params, cfg, qwen3.embed(params, cfg, tokens), positions, vis, cache)
    return qwen3.logits(params, cfg, h[:, -1:])[:, 0], cache.write(k, v)


def decode(params: dict, cfg: ModelConfig, canvas: jax.Array, cache: KVCache, *,
           residual: jax.Array | None = None, embeds: jax.Array | None = None,
           return_hidden: bool = False):
    """One denoising forward over the canvas [B, L] -> float32 logits [B, L, V]; the cache is only read.

    residual [B, L, D]: z fed to the adapter g_phi (None = no residual, e.g. the first step of a block).
    embeds [B, L, D]: replaces the token embedding (RCD-style interpolation built by decode/residual.py).
    """
    qwen3.check_tokens(canvas, cfg, "canvas")
    b, l = canvas.shape
    x = qwen3.embed(params, cfg, canvas, residual) if embeds is None else embeds.astype(cfg.jnp_dtype)
    h, _, _ = qwen3.backbone(params, cfg, x, cache.positions(l), self_mask(full_segments(b, l)), cache)
    out = qwen3.logits(params, cfg, h)
    return (out, h) if return_hidden else out


def commit(params: dict, cfg: ModelConfig, block: jax.Array, cache: KVCache) -> KVCache:
    """Write the finished block [B, L] into the cache (one forward; its logits are not needed)."""
    qwen3.check_tokens(block, cfg, "block")
    b, l = block.shape
    seg = causal_segments(b, l) if cfg.prefix_attention == "causal" else full_segments(b, l)
    _, k, v = qwen3.backbone(params, cfg, qwen3.embed(params, cfg, block), cache.positions(l), self_mask(seg),
                             cache)
    return cache.write(k, v)
