"""The oracle for generate(): the same algorithms written as slow, literal Python loops.

No KV cache, no while_loop, no padding tricks: every denoising step recomputes each row's whole sequence
(prompt + committed blocks + canvas) with the cache-free model pass and the visibility the engine implies, and
the sampler decisions are plain numpy loops over rows and positions. Random draws use the same jax.random calls
on the same keys as the engine (that, and `samplers.categorical`, the draw itself, is all that is shared), so
with equal logits the outputs are equal token
for token. For tests only: it is slow by design.
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from orl_jax.config import ModelConfig
from orl_jax.decode.residual import NoResidual, ORLResidual, RCDResidual
from orl_jax.decode.samplers import MaskSampler, UniformSampler, categorical
from orl_jax.model import qwen3


def _row_logits(params, cfg: ModelConfig, prompt, blocks, canvas, emb_canvas):
    """Logits of the canvas for one row: prompt causal, committed blocks per cfg.prefix_attention, canvas one
    bidirectional segment. cfg.logit_shift: each canvas position reads the row before it (the first one, the last
    committed token's row)."""
    seq = list(prompt) + [t for blk in blocks for t in blk] + list(canvas)
    n_p, L = len(prompt), len(canvas)
    seg = list(range(n_p))
    for j in range(len(blocks)):
        s0 = n_p + j * L
        seg += list(range(s0, s0 + L)) if cfg.prefix_attention == "causal" else [s0] * L
    seg += [len(seq) - L] * L
    tokens = jnp.asarray([seq], jnp.int32)
    emb = np.array(qwen3.embed(params, cfg, tokens)[0])
    emb[-L:] = emb_canvas
    out = _forward(params, cfg, tokens, jnp.asarray([seg], jnp.int32), jnp.asarray(emb)[None])
    return np.asarray(out[0, -L - 1:-1] if cfg.logit_shift else out[0, -L:])


@partial(jax.jit, static_argnames="cfg")
def _forward(params, cfg, tokens, seg, embeds):  # jitted only so the oracle is not unbearably slow
    return qwen3.forward(params, cfg, tokens, seg_start=seg, embeds=embeds)


def _canvas_embedding(params, cfg: ModelConfig, residual, canvas, z, a):
    E = np.asarray(params["embed"], np.float32)
    x = E[np.asarray(canvas)]
    if isinstance(residual, NoResidual):
        return x
    if isinstance(residual, RCDResidual):
        for i, t in enumerate(canvas):
            if t == cfg.mask_token_id:
                x[i] = (1 - a[i]) * E[cfg.mask_token_id] + a[i] * z[i]
        return x
    assert isinstance(residual, ORLResidual)
    g = np.asarray(qwen3.adapter(params["adapter"], cfg, jnp.asarray(z)[None])[0], np.float32)
    if cfg.noise == "mask":
        w = np.array([a[i] if t == cfg.mask_token_id else 0.0 for i, t in enumerate(canvas)], np.float32)
        g = g * w[:, None]
    return x + g


def _log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def reference_generate(params, cfg: ModelConfig, prompts: list[list[int]], *, key, max_new_tokens: int,
                       sampler, residual=None, block_length: int | None = None, max_steps: int | None = None,
                       eos_token_ids: tuple[int, ...] = (), pad_token_id: int = 0):
    """Returns (tokens [B, T], forwards [B], steps_per_block)."""
    residual = NoResidual() if residual is None else residual
    B, L, V = len(prompts), block_length or cfg.block_length, cfg.vocab_size
    nb = math.ceil(max_new_tokens / L)
    max_steps = max_steps or sampler.max_steps(L)
    E = np.asarray(params["embed"], np.float32)
    blocks: list[list[list[int]]] = [[] for _ in range(B)]
    out = np.full((B, nb * L), pad_token_id, np.int64)
    seq_done = [False] * B
    forwards = [0] * B
    steps_per_block = []
    key, k_init = jax.random.split(key)
    canvas, argmax, history, edit_steps = _init(sampler, k_init, B, L, V)
    for blk in range(nb):
        if all(seq_done):
            break
        z = np.zeros((B, L, cfg.hidden_size), np.float32)
        a = np.zeros((B, L), np.float32)
        block_done = [False] * B
        step = 0
        while True:
            key, k_step, k_init = jax.random.split(key, 3)
            active = [not (block_done[r] or seq_done[r]) for r in range(B)]
            logits = np.stack([_row_logits(params, cfg, prompts[r], blocks[r], canvas[r],
                                           _canvas_embedding(params, cfg, residual, canvas[r], z[r], a[r]))
                               for r in range(B)])
            if isinstance(sampler, UniformSampler):
                T = sampler.t_min + (sampler.t_max - sampler.t_min) * (sampler.max_denoising_steps - step) \
                    / sampler.max_denoising_steps
                logp = _log_softmax(logits / T)
                k_sample, k_noise = jax.random.split(k_step)
                am = logp.argmax(-1)
                prop = am if sampler.greedy else np.asarray(categorical(k_sample, jnp.asarray(logp), sampler.rng))
                noise = np.asarray(jax.random.randint(k_noise, (B, L), 0, V, jnp.int32))
                ent = np.maximum(-(np.exp(logp) * logp).sum(-1), 0.0)
                for r in range(B):
                    if not active[r]:
                        continue
                    order = sorted(range(L), key=lambda i: ent[r, i])
                    accepted, total = set(), 0.0
                    for i in order:  # accept while sum of accepted entropies minus the largest <= bound
                        if total <= sampler.entropy_bound:
                            accepted.add(i)
                        total += ent[r, i]
                    canvas[r] = [int(prop[r, i]) if i in accepted else int(noise[r, i]) for i in range(L)]
                    stable = sampler.stability == 0 or all(list(h) == list(am[r]) for h in history[r])
                    if sampler.stability:
                        history[r] = history[r][1:] + [list(am[r])]
                    argmax[r] = [int(t) for t in am[r]]
                    if stable and ent[r].mean() < sampler.confidence:
                        block_done[r] = True
            else:
                lg = logits.copy()
                lg[..., sampler.mask_token_id] = -np.inf
                logp = _log_softmax(lg if sampler.temperature == 0 else lg / sampler.temperature)
                if sampler.temperature == 0:
                    x0 = logp.argmax(-1)
                else:
                    x0 = np.asarray(categorical(k_step, jnp.asarray(logp), sampler.rng))
                conf = np.exp(np.take_along_axis(logp, x0[..., None], -1)[..., 0])
                safe = np.where(np.isinf(logp), 0.0, logp)
                ent = np.maximum(-(np.exp(safe) * safe).sum(-1), 0.0)
                for r in range(B):
                    if not active[r]:
                        continue
                    argmax[r] = [int(t) for t in x0[r]]  # the latest predictions (fill masks left at the cap)
                    masked = [t == sampler.mask_token_id for t in canvas[r]]
                    cand = [i for i in range(L) if masked[i]]
                    if sampler.tokens_per_step is not None:
                        cand.sort(key=lambda i: -conf[r, i])
                        fill = set(cand[:sampler.tokens_per_step])
                    else:
                        fill = {i for i in cand if conf[r, i] > sampler.threshold}
                        if cand:
                            fill.add(max(cand, key=lambda i: (conf[r, i], -i)))
                    edits = set()
                    if sampler.edit_threshold is not None:
                        edits = {i for i in range(L) if not masked[i] and x0[r, i] != canvas[r][i]
                                 and conf[r, i] > sampler.edit_threshold}
                    if not cand:
                        edit_steps[r] += 1
                    canvas[r] = [int(x0[r, i]) if i in fill | edits else canvas[r][i] for i in range(L)]
                    full = sampler.mask_token_id not in canvas[r]
                    if sampler.edit_threshold is None:
                        block_done[r] = full
                    else:
                        block_done[r] = full and (not edits or edit_steps[r] >= sampler.max_edit_steps)
            if not isinstance(residual, NoResidual):
                p = np.exp(logp)
                for r in range(B):
                    if active[r]:
                        z[r] = p[r] @ E
                        a[r] = ent[r] / math.log(V)
            for r in range(B):
                forwards[r] += active[r]
            step += 1
            if all(block_done[r] or seq_done[r] for r in range(B)) or step >= max_steps:
                break
        steps_per_block.append(step)
        for r in range(B):
            if isinstance(sampler, UniformSampler):
                final = argmax[r]
            else:
                final = [argmax[r][i] if t == sampler.mask_token_id else t for i, t in enumerate(canvas[r])]
            if seq_done[r]:
                final = [pad_token_id] * L
            else:
                for i, t in enumerate(final):
                    if t in eos_token_ids:
                        final = final[:i + 1] + [pad_token_id] * (L - i - 1)
                        seq_done[r] = True
                        break
            out[r, blk * L:(blk + 1) * L] = final
            blocks[r].append(list(final))
        canvas, argmax, history, edit_steps = _init(sampler, k_init, B, L, V)
    return out, np.array(forwards), steps_per_block


def _init(sampler, key, B, L, V):
    if isinstance(sampler, MaskSampler):
        canvas = [[sampler.mask_token_id] * L for _ in range(B)]
        return canvas, [list(r) for r in canvas], None, [0] * B
    c = np.asarray(jax.random.randint(key, (B, L), 0, V, jnp.int32))
    canvas = [list(map(int, row)) for row in c]
    history = [[[-1] * L for _ in range(max(sampler.stability, 1))] for _ in range(B)]
    return canvas, [list(r) for r in canvas], history, [0] * B
