"""QwenDLM: the Qwen3 backbone run as a block-diffusion model (METHOD.md §1, §3).

Three passes over one set of weights:
- prefill / encode: the prompt, causal, writes its K/V into the cache (the unchanged AR model);
- decode: a canvas of `block_length` tokens that sees the committed prefix and itself bidirectionally; it reads
  the cache and never writes it. The residual adapter g_phi adds g_phi(z) to the canvas embedding, where z is the
  residual the decoder carries from its previous step (decode/residual.py);
- commit: the finished block, written into the cache with `cfg.prefix_attention` visibility (causal = the
  encoder of DiffusionGemma's recipe; block_causal = bidirectional inside the block, SDAR style).

With cfg.logit_shift (the AR shift) a canvas position's logits come from the row before it: the decoder takes
the hidden state of the last committed token (returned by prefill and commit with return_hidden=True) for the
block's first position, so that position is exactly the AR model's next-token prediction.

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


def soft_embed(params: dict, cfg: ModelConfig, probs: jax.Array, scale: jax.Array | None = None) -> jax.Array:
    """z = p @ E: [B, L, V] -> [B, L, D] in the compute dtype (p = probs * scale[..., None] when scale is given)."""
    dt = cfg.jnp_dtype
    z = jnp.einsum("blv,vd->bld", probs.astype(dt), params["embed"].astype(dt), preferred_element_type=jnp.float32)
    return (z if scale is None else z * scale[..., None]).astype(dt)


def init_cache(cfg: ModelConfig, batch: int, size: int) -> KVCache:
    return KVCache.empty(cfg.num_layers, batch, size, cfg.num_kv_heads, cfg.head_dim, cfg.jnp_dtype)


def prefill(params: dict, cfg: ModelConfig, tokens: jax.Array, lengths: jax.Array, cache_size: int,
            return_hidden: bool = False):
    """Encode left-padded prompts. tokens [B, P] (row b's prompt in the last lengths[b] slots).

    Returns (float32 logits of the last prompt token [B, V], cache with slots [0, P) written), and with
    return_hidden the last prompt token's final hidden state [B, D] (what logit_shift decoding starts from).
    """
    qwen3.check_tokens(tokens, cfg)
    b, p = tokens.shape
    if cache_size < p:
        raise ValueError(f"cache_size={cache_size} is smaller than the padded prompt length {p}")
    cache = init_cache(cfg, b, cache_size)
    start = (p - lengths).astype(jnp.int32)
    cache = cache.replace(start=start)
    positions = jnp.maximum(cache.positions(p), 0)
    valid = jnp.arange(p)[None] >= start[:, None]  # [B, P]: pad keys are invisible (but to themselves: self_mask)
    vis = self_mask(causal_segments(b, p), valid)
    h, k, v = qwen3.backbone(params, cfg, qwen3.embed(params, cfg, tokens), positions, vis, cache)
    out = qwen3.logits(params, cfg, h[:, -1:])[:, 0], cache.write(k, v)
    return (*out, h[:, -1]) if return_hidden else out


def decode(params: dict, cfg: ModelConfig, canvas: jax.Array, cache: KVCache, *,
           residual: jax.Array | None = None, embeds: jax.Array | None = None, prev_hidden: jax.Array | None = None,
           return_hidden: bool = False):
    """One denoising forward over the canvas [B, L] -> float32 logits [B, L, V]; the cache is only read.

    residual [B, L, D]: z fed to the adapter g_phi (None = no residual, e.g. the first step of a block).
    embeds [B, L, D]: replaces the token embedding (RCD-style interpolation built by decode/residual.py).
    prev_hidden [B, D]: the last committed token's hidden state; required with cfg.logit_shift (see shift_rows).
    return_hidden: also return the canvas rows' own hidden states [B, L, D].
    """
    qwen3.check_tokens(canvas, cfg, "canvas")
    b, l = canvas.shape
    if cfg.logit_shift and prev_hidden is None:
        raise ValueError("decode with cfg.logit_shift needs prev_hidden (from prefill / commit, return_hidden=True)")
    x = qwen3.embed(params, cfg, canvas, residual) if embeds is None else embeds.astype(cfg.jnp_dtype)
    h, _, _ = qwen3.backbone(params, cfg, x, cache.positions(l), self_mask(full_segments(b, l)), cache)
    out = qwen3.logits(params, cfg, shift_rows(h, prev_hidden) if cfg.logit_shift else h)
    return (out, h) if return_hidden else out


def shift_rows(h: jax.Array, prev: jax.Array) -> jax.Array:
    """The rows whose logits predict each canvas position under the AR shift: [prev, h_0, ..., h_{L-2}]."""
    return jnp.concatenate([prev[:, None].astype(h.dtype), h[:, :-1]], axis=1)


def commit(params: dict, cfg: ModelConfig, block: jax.Array, cache: KVCache, return_hidden: bool = False):
    """Write the finished block [B, L] into the cache (one forward; its logits are not needed). Returns the cache,
    and with return_hidden the block's last hidden state [B, D] (the next block's prev_hidden under logit_shift)."""
    qwen3.check_tokens(block, cfg, "block")
    b, l = block.shape
    seg = causal_segments(b, l) if cfg.prefix_attention == "causal" else full_segments(b, l)
    h, k, v = qwen3.backbone(params, cfg, qwen3.embed(params, cfg, block), cache.positions(l), self_mask(seg),
                             cache)
    return (cache.write(k, v), h[:, -1]) if return_hidden else cache.write(k, v)
