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

from orl_jax.model.registry import model_module


def soft_embed(params: dict, cfg, probs: jax.Array, scale: jax.Array | None = None) -> jax.Array:
    """z = p @ E (times the model's embedding scale): [B, L, V] -> [B, L, D]; scale [B, L]: p is probs * scale (the
    rows' normalization applied to the product, after the GEMM)."""
    return model_module(cfg).soft_embed(params, cfg, probs, scale)


def _masked(cfg, canvas, a):
    return jnp.where(canvas == cfg.mask_token_id, a, 0.0)


@dataclass(frozen=True)
class NoResidual:
    def embed(self, params, cfg, canvas, z, a):
        return model_module(cfg).embed(params, cfg, canvas)


@dataclass(frozen=True)
class RCDResidual:
    def embed(self, params, cfg, canvas, z, a):
        if cfg.mask_token_id is None:
            raise ValueError("RCDResidual needs a mask-token model (mask_token_id)")
        x = model_module(cfg).embed(params, cfg, canvas)  # [B, L, D]
        w = _masked(cfg, canvas, a)[..., None].astype(x.dtype)
        return x + w * (z.astype(x.dtype) - x)  # (1 - a) E[MASK] + a z at masked positions


@dataclass(frozen=True)
class ORLResidual:
    def embed(self, params, cfg, canvas, z, a):
        w = _masked(cfg, canvas, a) if cfg.noise == "mask" else jnp.ones(canvas.shape, jnp.float32)
        return model_module(cfg).residual_embed(params, cfg, canvas, jax.lax.stop_gradient(z), w)


Residual = NoResidual | RCDResidual | ORLResidual
