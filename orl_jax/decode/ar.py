"""Greedy autoregressive decoding of the backbone (the AR baseline of the conversion report).

One jitted `lax.while_loop`, like generate(): prefill the left-padded prompts, then one token per step (a forward
of length 1 that reads and writes the KV cache), until every row has produced an EOS or max_new_tokens.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from orl_jax.checks import int_at_least
from orl_jax.config import ModelConfig
from orl_jax.decode.engine import _prompts, left_pad, resolve_eos_pad
from orl_jax.model import qwen3, qwendlm
from orl_jax.model.attention import causal_segments, self_mask


@partial(jax.jit, static_argnames=("cfg", "max_new", "eos", "pad"))
def _ar(params, prompt, lengths, *, cfg: ModelConfig, max_new: int, eos: tuple[int, ...], pad: int):
    b, p = prompt.shape
    last, cache = qwendlm.prefill(params, cfg, prompt, lengths, p + max_new)
    out = jnp.full((b, max_new), pad, jnp.int32)
    eos_arr = jnp.asarray(eos if eos else (-1,), jnp.int32)

    def cond(c):
        i, _, _, _, done = c
        return (i < max_new) & ~jnp.all(done)

    def body(c):
        i, logits, cache, out, done = c
        tok = jnp.where(done, pad, jnp.argmax(logits, axis=-1).astype(jnp.int32))  # [B]
        out = out.at[:, i].set(tok)
        done = done | jnp.isin(tok, eos_arr)
        x = qwen3.embed(params, cfg, tok[:, None])
        vis = self_mask(causal_segments(b, 1))
        h, k, v = qwen3.backbone(params, cfg, x, cache.positions(1), vis, cache)
        return i + 1, qwen3.logits(params, cfg, h)[:, 0], cache.write(k, v), out, done

    init = (jnp.int32(0), last, cache, out, jnp.zeros((b,), bool))
    i, _, _, out, _ = jax.lax.while_loop(cond, body, init)
    return out, i


def ar_generate(params, cfg: ModelConfig, prompt_ids, *, max_new_tokens: int, eos_token_id=None,
                pad_token_id: int | None = None):
    """Greedy AR decoding -> (tokens [B, max_new_tokens] with pad after EOS, forwards run)."""
    rows = _prompts(prompt_ids, cfg)
    max_new = int_at_least("max_new_tokens", max_new_tokens)
    eos, pad = resolve_eos_pad(cfg, eos_token_id, pad_token_id)
    prompt, lengths = left_pad(rows, cfg, max_new, pad)
    return _ar(params, prompt, lengths, cfg=cfg, max_new=max_new, eos=eos, pad=pad)
