"""Residual context: what a denoising step carries to the next one (METHOD.md §2-3). Shared with training.

Every step turns its distribution p [B, L, V] into the soft token z = p @ E [B, L, D] (`soft_embed`). The next
step's input embedding then depends on the residual form:
- NoResidual: plain token embeddings (the converted base model);
- RCDResidual (RCD, arXiv 2601.22954): at [MASK] positions e = (1 - a) E[MASK] + a z with a = h(p) the
  normalized entropy of the previous step; other positions keep their token embedding;
- ORLResidual: e = E[x] + w * g_phi(z) with the model's adapter g_phi (stop-gradient on z). w = 1 for the uniform
  family (DiffusionGemma's self-conditioning sees every position); for the mask family w = a at [MASK] positions
  and 0 elsewhere (our reading of "combine with RCD's entropy weight").
The first step of a block has z = 0 and a = 0, which is exactly "no residual" in both forms (g_phi(0) = 0).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from orl_jax.config import ModelConfig
from orl_jax.model import qwen3


def soft_embed(params: dict, cfg: ModelConfig, probs: jax.Array) -> jax.Array:
    """z = p @ E: [B, L, V] -> [B, L, D] in the model dtype."""
    e = params["embed"]
    return jnp.einsum("blv,vd->bld", probs.astype(e.dtype), e, preferred_element_type=jnp.float32).astype(e.dtype)


@dataclass(frozen=True)
class NoResidual:
    def embed(self, params, cfg: ModelConfig, canvas, z, a):
        return qwen3.embed(params, cfg, canvas)


@dataclass(frozen=True)
class RCDResidual:
    def embed(self, params, cfg: ModelConfig, canvas, z, a):
        if cfg.mask_token_id is None:
            raise ValueError("RCDResidual needs a mask-token model (ModelConfig.mask_token_id)")
        x = qwen3.embed(params, cfg, canvas)  # [B, L, D]
        w = jnp.where(canvas == cfg.mask_token_id, a, 0.0)[..., None].astype(x.dtype)
        return x + w * (z.astype(x.dtype) - x)  # (1 - a) E[MASK] + a z at masked positions


@dataclass(frozen=True)
class ORLResidual:
    def embed(self, params, cfg: ModelConfig, canvas, z, a):
        if not cfg.has_adapter:
            raise ValueError("ORLResidual needs a model with the adapter g_phi (ModelConfig.adapter_hidden > 0)")
        x = qwen3.embed(params, cfg, canvas)
        g = qwen3.adapter(params["adapter"], cfg, jax.lax.stop_gradient(z))
        if cfg.noise == "mask":
            g = g * jnp.where(canvas == cfg.mask_token_id, a, 0.0)[..., None].astype(g.dtype)
        return x + g


Residual = NoResidual | RCDResidual | ORLResidual
