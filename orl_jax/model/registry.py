"""Which model module runs a config. The engine and the residual forms talk to a model only through this
interface (a module with these functions), so a new architecture plugs into generate() without a second loop
(ModelConfig -> model/qwendlm.py, DiffusionGemmaConfig -> model/diffusion_gemma.py):

  param_specs(cfg)                                  -> ParamSpec tree
  prefill(params, cfg, tokens, lengths, cache_size) -> (last logits [B, V], KVCache)
  decode(params, cfg, canvas, cache, *, embeds)     -> logits [B, L, V]   (reads the cache)
  commit(params, cfg, block, cache)                 -> KVCache            (writes the block's K/V)
  embed(params, cfg, tokens)                        -> [B, L, D] input embeddings of tokens
  residual_embed(params, cfg, tokens, z, w)         -> [B, L, D] embeddings with the adapter applied to z,
                                                       weighted per position by w [B, L]
  soft_embed(params, cfg, probs, scale=None)        -> z [B, L, D]: the residual a step hands to the next
                                                       (p = probs * scale[..., None] when scale [B, L] is given)
and optionally (generate() takes them where they exist)
  prefill_decode(params, cfg, tokens, lengths, cache_size, canvas, *, embeds)
                                                    -> (logits [B, L, V], KVCache): prefill and the first decode
                                                       in one pass (the first step)
  commit_decode(params, cfg, block, cache, canvas, *, embeds, capped, write)
                                                    -> (logits [B, L, V], KVCache): commit and the next block's
                                                       first decode in one pass (capped=False: the head's product,
                                                       cap_logits(cfg, z) of it are the logits; decode takes it too;
                                                       write=False: the block's K/V as cache.write takes them
                                                       instead of the cache, which also has read(L))
"""

from __future__ import annotations

from types import ModuleType

from orl_jax.config import ModelConfig
from orl_jax.diffusion_gemma_config import DiffusionGemmaConfig


def model_module(cfg) -> ModuleType:
    if isinstance(cfg, ModelConfig):
        from orl_jax.model import qwendlm

        return qwendlm
    if isinstance(cfg, DiffusionGemmaConfig):
        from orl_jax.model import diffusion_gemma

        return diffusion_gemma
    raise TypeError(f"no model registered for config type {type(cfg).__name__}")
