"""Training objectives: causal LM (stage 0) and the block-diffusion conversion losses (stage 1, METHOD.md §1).

Conversion trains the AR backbone as QwenDLM in one forward over [clean sequence | noisy sequence] (2N tokens):
- clean tokens see the clean tokens before them (cfg.prefix_attention: causal, or block-causal), exactly what
  the engine's prefill and commits write into the cache;
- a noisy response token of block b sees the clean prompt and clean blocks < b, and the noisy tokens of its own
  block (bidirectionally) — what the engine's canvas sees at decode time; never its own clean block, later
  blocks, or other noisy blocks;
- every noisy block has its own noise level t ~ U(t_min, 1). Uniform family: each token is replaced by a uniform
  random token with probability t, and the loss is cross-entropy to the clean token at every position of the
  noisy block. Mask family: each token becomes [MASK] with probability t (at least one per block), loss on the
  masked positions only.
- Uniform family with the adapter: DiffusionGemma's two-pass self-conditioning. With probability `sc_prob` a first
  pass (no residual, no gradient) produces the distribution p; the second pass gets z = p @ E through g_phi, as
  the engine feeds the previous step's distribution. The loss is on the second pass.
- Optional AR term (`ar_weight`, our addition [I], as TiDAR trains AR and diffusion in one forward): the clean
  half is causal, so its rows can also be trained with stage 0's next-token loss at no extra forward. It keeps the
  backbone's AR predictions, which a shifted QwenDLM reads for every block's first token.
Logits of a noisy token come from its own row, or with cfg.logit_shift (the AR shift) from the row before it:
the noisy row before it inside the block, and for a block's first token the clean row before the block (the AR
model's own next-token prediction, what the engine reads from the last committed token). Losses are means over
supervised tokens of the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from orl_jax.config import ModelConfig
from orl_jax.data.pipeline import segment_mask
from orl_jax.decode.residual import RCDResidual
from orl_jax.decode.samplers import exclude_token
from orl_jax.model import qwen3, qwendlm
from orl_jax.train.orl_losses import normalized_entropy


def cross_entropy(logits: jax.Array, targets: jax.Array, weights: jax.Array):
    """Sum and count of token cross-entropies; logits [B, L, V] float32, targets/weights [B, L]."""
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    return jnp.sum(nll * weights), jnp.sum(weights)


def next_token_loss(logits: jax.Array, tokens: jax.Array, weights: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy of causal rows: logits [B, N, V] of every position, tokens [B, N], weights
    [B, N - 1] (1 where token i + 1 is a target of position i)."""
    s, n = cross_entropy(logits[:, :-1], tokens[:, 1:], weights)
    return s / jnp.maximum(n, 1.0)


def check_causal_clean_rows(cfg: ModelConfig, name: str, weight: float) -> None:
    """A next-token loss on the clean rows (weight > 0) needs them causal: block-causal rows see their targets."""
    if weight > 0 and cfg.prefix_attention != "causal":
        raise ValueError(f"{name}={weight} needs causal clean rows (the next-token loss would see the targets), "
                         f"got cfg.prefix_attention={cfg.prefix_attention!r}")


def causal_lm_loss(params, cfg: ModelConfig, batch: dict, key=None, *, remat: bool = False):
    """Stage 0: next-token cross-entropy. batch: tokens [B, N], loss_mask [B, N] (1 where token i+1 is a target
    of position i), optional segment_ids/positions for packed rows."""
    tokens = batch["tokens"]
    seg = batch.get("segment_ids")
    mask = None if seg is None else segment_mask(seg)  # None: plain causal
    logits = qwen3.forward(params, cfg, tokens, mask=mask, positions=batch.get("positions"), remat=remat)
    w = batch["loss_mask"][:, 1:].astype(jnp.float32)
    if seg is not None:  # never predict across a packed example boundary or into padding
        w = w * ((seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] > 0))
    s, n = cross_entropy(logits[:, :-1], tokens[:, 1:], w)
    loss = s / jnp.maximum(n, 1.0)
    return loss, {"loss": loss, "tokens": n}


def packed_rows(batch: dict) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(segment ids, positions, prompt length of each token's example), all [B, N], of a stage-1 batch.

    Two batch forms: packed rows from the grain pipeline (segment_ids, positions and prompt_mask, several examples
    per row) or one example per row (prompt_lengths [B] and lengths [B], right padding after `lengths`)."""
    tokens = batch["tokens"]
    b, n = tokens.shape
    if "segment_ids" in batch:
        seg, pos = batch["segment_ids"], batch["positions"]
        # prompt tokens per segment id (ids < N + 1), read back at every token of the segment
        count = jax.vmap(lambda s, m: jnp.zeros((n + 1,), jnp.int32).at[s].add(m))(
            seg, batch["prompt_mask"].astype(jnp.int32) * (seg > 0))
        return seg, pos, jnp.take_along_axis(count, seg, axis=1)
    i = jnp.arange(n, dtype=jnp.int32)[None]
    seg = (i < batch["lengths"][:, None]).astype(jnp.int32)
    return seg, jnp.broadcast_to(i, (b, n)), jnp.broadcast_to(batch["prompt_lengths"][:, None], (b, n))


def block_starts(seg: jax.Array, pos: jax.Array, plen: jax.Array, block: int) -> tuple[jax.Array, jax.Array]:
    """(response flags, block start) [B, N]: a response token's block start is the row index of the first token of
    its block; a prompt (or padding) token's is its own index (prompt tokens stay causal)."""
    i = jnp.arange(seg.shape[1], dtype=jnp.int32)[None]
    resp = (seg > 0) & (pos >= plen)
    return resp, jnp.where(resp, i - (pos - plen) % block, i)


def diffusion_mask(prompt_lengths: jax.Array, lengths: jax.Array, n: int, block: int,
                   prefix_attention: str = "causal") -> jax.Array:
    """Visibility [B, 2N, 2N] for [clean | noisy] rows holding one example each (right padding after `lengths`)."""
    b = prompt_lengths.shape[0]
    seg, pos, plen = packed_rows({"tokens": jnp.zeros((b, n), jnp.int32), "prompt_lengths": prompt_lengths,
                                  "lengths": lengths})
    return packed_diffusion_mask(seg, pos, plen, block, prefix_attention)


def packed_diffusion_mask(seg: jax.Array, pos: jax.Array, plen: jax.Array, block: int,
                          prefix_attention: str = "causal") -> jax.Array:
    """Visibility [B, 2N, 2N] for [clean | noisy] rows that may pack several examples (see the module docstring):
    nothing is visible across examples; inside one, the rules of a single example."""
    b, n = seg.shape
    i = jnp.arange(n)
    valid = seg > 0
    same = (seg[:, :, None] == seg[:, None, :]) & valid[:, None, :]  # [B, q, k]
    resp, bstart = block_starts(seg, pos, plen, block)
    if prefix_attention == "causal":
        cc = i[None, None, :] <= i[None, :, None]
    else:  # block-causal: prompt causal, response blocks bidirectional inside
        cc = bstart[:, None, :] <= bstart[:, :, None]
    # a padding row (no example) sees only itself: no query row is fully masked, which fused attention kernels
    # (cuDNN) turn into NaN gradients; nothing reads a padding row's output
    cc = (cc & same) | (jnp.eye(n, dtype=bool)[None] & ~valid[:, :, None])
    nc = (i[None, None, :] < bstart[:, :, None]) & same & resp[:, :, None]
    nn = (bstart[:, :, None] == bstart[:, None, :]) & resp[:, :, None] & resp[:, None, :]
    eye = jnp.eye(n, dtype=bool)[None] & ~resp[:, :, None]  # non-response noisy slots see only themselves
    top = jnp.concatenate([cc, jnp.zeros_like(cc)], axis=2)
    bottom = jnp.concatenate([nc, nn | eye], axis=2)
    return jnp.concatenate([top, bottom], axis=1)


def predicting_rows(cfg: ModelConfig, h: jax.Array, seg, pos, plen, block: int) -> jax.Array:
    """The hidden states [B, N, D] whose logits predict the noisy tokens, from h [B, 2N, D] over [clean | noisy]:
    the noisy half, or with cfg.logit_shift the row before each noisy token (the clean row before the block for a
    block's first token)."""
    n = seg.shape[1]
    if not cfg.logit_shift:
        return h[:, n:]
    resp, bstart = block_starts(seg, pos, plen, block)
    i = jnp.arange(n)[None]
    rows = jnp.maximum(jnp.where(resp & (i == bstart), i, i + n) - 1, 0)
    return jnp.take_along_axis(h, rows[..., None], axis=1)


@dataclass(frozen=True)
class DiffusionObjective:
    """Stage-1 block-diffusion loss; static under jit."""

    block_length: int
    t_min: float = 0.05  # lowest noise level of a block (t ~ U(t_min, 1))
    sc_prob: float = 0.5  # uniform family with adapter: share of batches trained with self-conditioning
    remat: bool = False
    ar_weight: float = 0.0  # weight of the next-token loss on the clean (causal) half; 0 = diffusion loss only

    def __post_init__(self):
        if self.block_length <= 0:
            raise ValueError(f"block_length must be positive, got {self.block_length}")
        if not 0.0 <= self.t_min < 1.0:
            raise ValueError(f"t_min must be in [0, 1), got {self.t_min}")
        if not 0.0 <= self.sc_prob <= 1.0:
            raise ValueError(f"sc_prob must be in [0, 1], got {self.sc_prob}")
        if not self.ar_weight >= 0.0:
            raise ValueError(f"ar_weight must be >= 0, got {self.ar_weight}")

    def noise(self, cfg: ModelConfig, tokens, seg, pos, plen, key):
        """Noisy tokens [B, N] and the supervised-position weights [B, N] (per-token rows as from packed_rows)."""
        b, n = tokens.shape
        k_t, k_flip, k_tok = jax.random.split(key, 3)
        resp, bstart = block_starts(seg, pos, plen, self.block_length)
        t = jax.random.uniform(k_t, (b, n), minval=self.t_min, maxval=1.0)  # one level per block (by its start)
        t_tok = jnp.take_along_axis(t, bstart, axis=1)  # [B, N]
        flip = (jax.random.uniform(k_flip, (b, n)) < t_tok) & resp
        if cfg.noise == "mask":
            # at least one masked token per block: the first response token of a block with none masked
            counts = jax.vmap(lambda f, bs: jnp.zeros((n,), jnp.int32).at[bs].add(f.astype(jnp.int32)))(flip, bstart)
            first = resp & (jnp.arange(n)[None] == bstart)
            flip = flip | (first & (jnp.take_along_axis(counts, bstart, axis=1) == 0))
            noisy = jnp.where(flip, cfg.mask_token_id, tokens)
            return noisy, flip.astype(jnp.float32)
        rand = jax.random.randint(k_tok, (b, n), 0, cfg.vocab_size, tokens.dtype)
        return jnp.where(flip, rand, tokens), resp.astype(jnp.float32)

    def loss(self, params, cfg: ModelConfig, batch: dict, key, reference_params=None):
        """batch: tokens [B, N] with either segment_ids / positions / prompt_mask [B, N] (packed rows, several
        examples each) or prompt_lengths [B] / lengths [B] (one right-padded example per row); see packed_rows.

        reference_params: the RCD baseline (METHOD.md §2) — the residual of every batch comes from this frozen
        model's first pass on the noised state (off-policy), instead of the trained model's own. Mask family: in
        RCD's own form, (1 - a) E[MASK] + a z at [MASK] positions with a the normalized entropy of the reference's
        distribution (as RCDResidual at inference); uniform family (no [MASK]): through the adapter g_phi, as
        self-conditioning (our adaptation)."""
        check_causal_clean_rows(cfg, "ar_weight", self.ar_weight)
        tokens = batch["tokens"]
        b, n = tokens.shape
        seg, pos, plen = packed_rows(batch)
        k_noise, k_sc = jax.random.split(key)
        noisy, weights = self.noise(cfg, tokens, seg, pos, plen, k_noise)
        mask = packed_diffusion_mask(seg, pos, plen, self.block_length, cfg.prefix_attention)
        both = jnp.concatenate([tokens, noisy], axis=1)  # [B, 2N]
        positions = jnp.concatenate([pos, pos], axis=1)

        def run(z, p=params, a=None):  # (noisy-token logits [B, N, V], clean-row logits [B, N, V] or None)
            x = qwen3.embed(p, cfg, both)
            if a is not None:  # RCD's form, (1 - a) E[MASK] + a z at [MASK] (clean rows: a = 0, unchanged)
                aa = jnp.concatenate([jnp.zeros((b, n)), a], axis=1)
                x = RCDResidual().embed(p, cfg, both, jnp.concatenate([jnp.zeros_like(z), z], axis=1), aa)
            elif z is not None:  # the adapter: E[x] + w g_phi(z)
                w = jnp.concatenate([jnp.zeros((b, n)), jnp.ones((b, n))], axis=1)
                zz = jnp.concatenate([jnp.zeros_like(z), z], axis=1)
                x = qwendlm.residual_embed(p, cfg, both, zz, w)
            h, _, _ = qwen3.backbone(p, cfg, x, positions, mask, remat=self.remat)
            out = qwen3.logits(p, cfg, predicting_rows(cfg, h, seg, pos, plen, self.block_length))
            return out, (qwen3.logits(p, cfg, h[:, :n]) if self.ar_weight > 0 else None)

        if reference_params is not None:
            ref, _ = jax.lax.stop_gradient(run(None, reference_params))
            if cfg.noise == "mask":  # the reference's distribution as its sampler sees it: never [MASK]
                logp = jax.nn.log_softmax(exclude_token(ref, cfg.mask_token_id), axis=-1)
                z = qwendlm.soft_embed(reference_params, cfg, jnp.exp(logp))
                logits, ar_logits = run(jax.lax.stop_gradient(z), a=normalized_entropy(logp))
            else:
                z = jax.lax.stop_gradient(qwendlm.soft_embed(reference_params, cfg, jax.nn.softmax(ref, axis=-1)))
                logits, ar_logits = run(z)
        else:
            logits, ar_logits = run(None)
        if reference_params is None and cfg.noise == "uniform" and cfg.has_adapter and self.sc_prob > 0:
            use_sc = jax.random.uniform(k_sc) < self.sc_prob
            z = qwendlm.soft_embed(params, cfg, jax.nn.softmax(jax.lax.stop_gradient(logits), axis=-1))
            z = jax.lax.stop_gradient(z)
            logits, ar_logits = jax.lax.cond(use_sc, lambda: run(z), lambda: (logits, ar_logits))
        s, cnt = cross_entropy(logits, tokens, weights)
        loss = s / jnp.maximum(cnt, 1.0)
        acc = jnp.sum((jnp.argmax(logits, -1) == tokens) * weights) / jnp.maximum(cnt, 1.0)
        metrics = {"loss": loss, "tokens": cnt, "denoise_acc": acc}
        if ar_logits is not None:  # stage 0's targets: every next token inside an example
            w_ar = ((seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] > 0)).astype(jnp.float32)
            metrics |= {"diffusion_loss": loss, "ar_loss": next_token_loss(ar_logits, tokens, w_ar)}
            loss = loss + self.ar_weight * metrics["ar_loss"]
        return loss, metrics
