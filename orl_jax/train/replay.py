"""ORL replay: pack the states captured during an on-policy rollout into training rows with staircase attention,
and recompute their logits with the current params (METHOD.md §3, step 3).

One row per verified response: [prompt + the response's final tokens (clean, what the engine committed)] then
one segment of L tokens per replayed state (the canvas that step consumed). Visibility ("staircase"):
- clean tokens see the clean tokens before them (cfg.prefix_attention), exactly what prefill + commits wrote;
- a state of block b sees the clean prompt and clean blocks < b, and itself; never its own clean answer, later
  blocks or other states.
Positions of a state are its block's positions. With cfg.logit_shift a state's logits come from the row before
each position, and for its first position from the clean token before its block (the engine's last committed
token). Embeddings come from the same residual form the rollout used,
applied to the captured (canvas, z, a), so the replayed logits are the logits the engine computed at that step
(under the same params), which tests/test_replay.py checks against the rollout's own entropies.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from orl_jax.decode.samplers import MaskSampler, UniformSampler, exclude_token
from orl_jax.model import qwen3
from orl_jax.model.attention import block_segments
from orl_jax.train.objectives import cross_entropy


@dataclass
class ReplayBatch:
    tokens: np.ndarray  # [R, N] clean tokens, then state canvases
    z: np.ndarray  # [R, N, D] captured residual (0 on clean tokens)
    a: np.ndarray  # [R, N] captured RCD weight (0 on clean tokens)
    positions: np.ndarray  # [R, N]
    mask: np.ndarray  # [R, N, N] staircase visibility
    state_row: np.ndarray  # [S] row of each state
    state_start: np.ndarray  # [S] first column of its segment
    context_end: np.ndarray  # [S] column of the last clean token before the state's block (logit_shift reads it)
    targets: np.ndarray  # [S, L] verified final tokens of the state's block
    step: np.ndarray  # [S] denoising step inside the block
    prev: np.ndarray  # [S] index of the previous state of the same block and response (-1: first)
    response_id: np.ndarray  # [S] row = response
    entropy: np.ndarray  # [S, L] behaviour normalized entropy captured by the rollout
    unresolved: np.ndarray  # [S, L] positions the step had not resolved before it ran
    valid: np.ndarray  # [S, L] positions inside the response (before its end)
    clean_len: np.ndarray  # [R] clean tokens of each row (prompt + verified response; the states follow)


def select_states(recs: list[int], blocks: list[int], max_states: int | None, rng=None) -> list[int]:
    """Which capture records of one response to replay, in decoding order. rng None: the first max_states.
    With an rng: whole blocks in a random order while they fit max_states (a block longer than max_states gives
    its first max_states states), so every block of a long answer gets trained over the rounds and adjacent
    states of a block stay together for the AEC term."""
    if max_states is None or len(recs) <= max_states:
        return list(recs)
    if rng is None:
        return list(recs[:max_states])
    by_block: dict[int, list[int]] = {}
    for rec, blk in zip(recs, blocks):
        by_block.setdefault(blk, []).append(rec)
    chosen: list[int] = []
    for blk in rng.permutation(sorted(by_block)):
        group = by_block[int(blk)]
        if not chosen and len(group) > max_states:
            return group[:max_states]
        if len(chosen) + len(group) <= max_states:
            chosen += group
    return sorted(chosen)


STATE_ARRAYS = ("canvas", "z", "a", "entropy", "resolved")  # the capture's per-(record, row) arrays


@jax.jit
def _gather(arrays: dict, rec: jax.Array, row: jax.Array) -> dict:
    return {k: v[rec, row] for k, v in arrays.items()}


def gather_states(capture: dict, pairs: list[tuple[int, int]]) -> dict:
    """{name: [len(pairs), ...] numpy} of STATE_ARRAYS at the (record, row) pairs, gathered where the capture
    lives (the device) so that only the chosen states cross to the host: the capture holds every step of every
    block (blocks x max_steps records; 1.3 GB of z for the h200 preset's 128 rollouts), a replay ~1/20 of it.
    The pair count is padded to a power of two (pairs (0, 0)), so few gathers are compiled. A capture built on
    the host (numpy, truth_states.py) is indexed where it lies."""
    if all(isinstance(capture[k], np.ndarray) for k in STATE_ARRAYS):
        rec, row = np.asarray(pairs, np.int64).reshape(-1, 2).T
        return {k: np.asarray(capture[k][rec, row]) for k in STATE_ARRAYS}
    size = 1 << max(len(pairs) - 1, 0).bit_length()
    idx = np.zeros((2, size), np.int32)
    if pairs:
        idx[:, :len(pairs)] = np.asarray(pairs, np.int32).T
    got = _gather({k: capture[k] for k in STATE_ARRAYS}, jnp.asarray(idx[0]), jnp.asarray(idx[1]))
    return {k: np.asarray(v)[:len(pairs)] for k, v in got.items()}


def build_replay(prompts, out, verified, *, block_length: int, pad_id: int, prefix_attention: str = "causal",
                 mask_token_id: int | None = None, max_states: int | None = None, rng=None) -> ReplayBatch:
    """prompts: list of token lists; out: GenerateOutput from generate(..., capture=True); verified [B] bool.
    max_states / rng: which states of each response to replay (select_states).

    Unresolved positions of a state: [MASK] positions of its canvas when mask_token_id is given (mask family);
    otherwise (uniform family, where every step re-decides the canvas) the positions the previous step of the
    block did not accept (all of them at the block's first step)."""
    n_rec, L = int(out.total_forwards), block_length
    cap = {k: np.asarray(out.capture[k][:n_rec]) for k in ("active", "block", "step")}  # small: [records, B]
    toks, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
    rows = [b for b in range(len(prompts)) if verified[b]]
    per_row = []
    for b in rows:
        recs = [i for i in range(n_rec) if cap["active"][i, b]]
        per_row.append(select_states(recs, [int(cap["block"][i]) for i in recs], max_states, rng))
    # the chosen states' captured arrays, in the order the loop below takes them (state k = k-th pair)
    got = gather_states(out.capture, [(rec, b) for b, recs in zip(rows, per_row) for rec in recs])
    p_len = [len(prompts[b]) for b in rows]
    n_clean = [p + int(lengths[b]) for p, b in zip(p_len, rows)]
    width = max([c + len(r) * L for c, r in zip(n_clean, per_row)] + [1])
    R, D = len(rows), got["z"].shape[-1]
    tokens = np.full((R, width), pad_id, np.int32)
    z = np.zeros((R, width, D), got["z"].dtype)
    a = np.zeros((R, width), np.float32)
    positions = np.zeros((R, width), np.int32)
    mask = np.zeros((R, width, width), bool)
    st = {k: [] for k in ("row", "start", "context_end", "targets", "step", "prev", "entropy", "unresolved", "valid")}
    for r, (b, recs) in enumerate(zip(rows, per_row)):
        p, nc = p_len[r], n_clean[r]
        clean = list(prompts[b]) + list(toks[b, :lengths[b]])
        tokens[r, :nc] = clean
        positions[r, :nc] = np.arange(nc)
        i = np.arange(nc)
        if prefix_attention == "causal":
            mask[r, :nc, :nc] = i[None, :] <= i[:, None]
        else:
            seg = np.asarray(block_segments(1, nc, p, L))[0]
            mask[r, :nc, :nc] = seg[None, :] <= seg[:, None]
        last_of_block: dict[int, int] = {}  # block -> global index of its latest state
        for j, rec in enumerate(recs):
            k = len(st["row"])  # this state's index, and its row in the gathered arrays
            blk = int(cap["block"][rec])
            s0 = nc + j * L
            tokens[r, s0:s0 + L] = got["canvas"][k]
            z[r, s0:s0 + L] = got["z"][k]
            a[r, s0:s0 + L] = got["a"][k]
            positions[r, s0:s0 + L] = p + blk * L + np.arange(L)
            mask[r, s0:s0 + L, :min(p + blk * L, nc)] = True  # clean prompt + earlier blocks
            mask[r, s0:s0 + L, s0:s0 + L] = True  # itself
            block_targets = toks[b, blk * L:(blk + 1) * L]
            inside = (blk * L + np.arange(L)) < lengths[b]
            if mask_token_id is not None:
                unresolved = got["canvas"][k] == mask_token_id
            elif blk in last_of_block:
                unresolved = ~got["resolved"][last_of_block[blk]]
            else:
                unresolved = np.ones(L, bool)
            st["row"].append(r)
            st["start"].append(s0)
            st["context_end"].append(p + blk * L - 1)
            st["targets"].append(block_targets)
            st["step"].append(int(cap["step"][rec]))
            st["prev"].append(last_of_block.get(blk, -1))
            st["entropy"].append(got["entropy"][k])
            st["unresolved"].append(unresolved)
            st["valid"].append(inside)
            last_of_block[blk] = k
        for row in range(nc, width):  # padding columns see themselves only (keeps softmax rows finite)
            if not mask[r, row].any():
                mask[r, row, row] = True
    n_states = len(st["row"])
    resp = np.asarray(st["row"], np.int32)
    return ReplayBatch(
        tokens=tokens, z=z, a=a, positions=positions, mask=mask,
        state_row=resp, state_start=np.asarray(st["start"], np.int32),
        context_end=np.asarray(st["context_end"], np.int32),
        targets=np.asarray(st["targets"], np.int32).reshape(n_states, L),
        step=np.asarray(st["step"], np.int32), prev=np.asarray(st["prev"], np.int32), response_id=resp,
        entropy=np.asarray(st["entropy"], np.float32).reshape(n_states, L),
        unresolved=np.asarray(st["unresolved"], bool).reshape(n_states, L),
        valid=np.asarray(st["valid"], bool).reshape(n_states, L), clean_len=np.asarray(n_clean, np.int32))


def replay_hidden(params, cfg, residual, batch: ReplayBatch, remat: bool = False) -> jax.Array:
    """Final hidden states [R, N, D] of the packed rows under `params` (one forward). Qwen3-family models (QwenDLM);
    the residual form must be the rollout's. remat: recompute each layer in the backward pass."""
    x = residual.embed(params, cfg, jnp.asarray(batch.tokens), jnp.asarray(batch.z), jnp.asarray(batch.a))
    h, _, _ = qwen3.backbone(params, cfg, x, jnp.asarray(batch.positions), jnp.asarray(batch.mask), remat=remat)
    return h


def state_logits(params, cfg, batch: ReplayBatch, h: jax.Array) -> jax.Array:
    """Logits [S, L, V] of every replayed state, from the rows' hidden states h (replay_hidden)."""
    L = batch.targets.shape[1]
    cols = jnp.asarray(batch.state_start)[:, None] + jnp.arange(L)[None]  # [S, L]
    if cfg.logit_shift:  # the row before each position; the first reads the clean context's last token
        cols = jnp.concatenate([jnp.asarray(batch.context_end)[:, None], cols[:, :-1]], axis=1)
    return qwen3.logits(params, cfg, h[jnp.asarray(batch.state_row)[:, None], cols])  # from [S, L, D]


def replay_logits(params, cfg, residual, batch: ReplayBatch, remat: bool = False) -> jax.Array:
    """Logits [S, L, V] of every replayed state under `params`: what the engine computed at that step."""
    return state_logits(params, cfg, batch, replay_hidden(params, cfg, residual, batch, remat))


def clean_next_token_loss(params, cfg, batch: ReplayBatch, h: jax.Array, row_weight=None) -> jax.Array:
    """The next-token loss of the rows' clean tokens (their causal pass: the AR model that prefill and commits
    run), averaged over every predicted token of the batch; h from replay_hidden. row_weight [R]: each row's
    tokens count times its weight in the sum (not in the count)."""
    tokens = jnp.asarray(batch.tokens)
    w = (jnp.arange(1, tokens.shape[1])[None] < jnp.asarray(batch.clean_len)[:, None]).astype(jnp.float32)
    weighted = w if row_weight is None else w * row_weight[:, None]
    s, _ = cross_entropy(qwen3.logits(params, cfg, h)[:, :-1], tokens[:, 1:], weighted)
    return s / jnp.maximum(jnp.sum(w), 1.0)


def policy_logits(sampler, logits: jax.Array) -> jax.Array:
    """The logits the sampler draws from, before its temperature: the mask family never proposes [MASK]."""
    if isinstance(sampler, MaskSampler):
        return exclude_token(logits, sampler.mask_token_id)
    if isinstance(sampler, UniformSampler):
        return logits
    raise TypeError(f"unknown sampler {type(sampler).__name__}")


def behaviour_logp(sampler, lg: jax.Array, step: jax.Array) -> jax.Array:
    """The distribution the rollout's sampler drew from at each state: [S, L, V] log-probs, from the policy's
    logits lg (policy_logits of the replayed logits)."""
    if isinstance(sampler, UniformSampler):
        return jax.nn.log_softmax(lg / jax.vmap(sampler.temperature)(step)[:, None, None], axis=-1)
    return jax.nn.log_softmax(lg if sampler.temperature == 0 else lg / sampler.temperature, axis=-1)
