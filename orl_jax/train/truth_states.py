"""ORL's replay and loss code fed states built from ground-truth answers instead of rollouts: a diagnostic (session
28), not the method. ORL from the h200 base loses held-out accuracy at a steady rate per update while stage 1's
objective on ground-truth rows does not (benchmarks/results/2026-12-02_orl_sup_strict_h200/); these states tell
apart the code path (replay packing, L_pred's normalization, the update) from what the on-policy states teach.

- "truth_random": stage 1's noise through ORL's code. Each block of the answer is one state whose positions are
  [MASK] with probability t ~ U(t_min, 1) (at least one), as DiffusionObjective.noise masks a block; every masked
  position counts as uncertain (entropy 1), so L_pred is stage 1's cross-entropy on the masked positions, under
  ORL's per-state, per-response normalization.
- "truth_forced": the states threshold decoding passes through when every filled token is the ground truth
  (teacher-forced decoding). All blocks of an answer decode at once, each seeing the clean answer before it (what
  the engine's cache holds after the commits); at every step the [MASK] positions whose policy confidence (the
  largest probability, [MASK] excluded, temperature 1) exceeds the threshold are filled with their ground-truth
  tokens, at least the most confident one (MaskSampler.step itself decides, greedy). The states carry the policy's
  normalized entropy, so L_pred's gate and the anchor see what they see in a rollout. Approximations: no sampling
  (a rollout fills what it sampled at temperature 1; greedy confidences here), and no residual (z = 0, a = 0; ORL's
  adapter starts at zero output and barely moves at the rates tried).

Both make an object with GenerateOutput's fields that train/replay.build_replay reads, so the packing, the state
selection and the loss are exactly ORL's. Mask family only. The recipe's rounds (train/stage2.truth_states_round)
also offer "truth_forced_verified": truth_forced on only the examples whose rollout under the current params
verifies (ORL's selection). Measured on the h200 base: benchmarks/results/2026-12-02_orl_truth_states_h200/.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from orl_jax.decode.samplers import MaskSampler
from orl_jax.train.objectives import DiffusionObjective
from orl_jax.train.orl import pad_replay, replay_arrays_batch
from orl_jax.train.replay import build_replay, replay_hidden, state_logits


@dataclass
class TruthCapture:
    """What build_replay reads of a GenerateOutput: the answers as `tokens` / `lengths`, states as capture records."""
    tokens: np.ndarray  # [B, T] answer tokens, end-of-turn padding to a block boundary
    lengths: np.ndarray  # [B] answer tokens through the end-of-turn token
    total_forwards: int  # records
    capture: dict  # canvas / z / a / entropy / resolved [n, B, ...], active [n, B], block / step [n]


def answer_arrays(responses, block_length: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """([B, T] tokens padded with each answer's last token (its end-of-turn) to a block boundary, then pad_id;
    [B] lengths). T is the longest answer's blocks x block_length."""
    L = block_length
    lengths = np.asarray([len(r) for r in responses], np.int32)
    if (lengths < 1).any():
        raise ValueError("every answer needs at least one token")
    T = int(-(-lengths.max() // L) * L)
    tokens = np.full((len(responses), T), pad_id, np.int32)
    for b, r in enumerate(responses):
        end = -(-len(r) // L) * L
        tokens[b, :len(r)] = r
        tokens[b, len(r):end] = r[-1]
    return tokens, lengths


def _capture(records: list[dict], batch: int, L: int, d: int) -> dict:
    """Stack per-record dicts {block, step, rows: {row: (canvas, entropy, resolved)}} into capture arrays."""
    n = len(records)
    z = np.broadcast_to(np.zeros((1, 1, 1, d), np.float32), (n, batch, L, d))  # no residual: one zero, no memory
    cap = {"canvas": np.zeros((n, batch, L), np.int32), "z": z,
           "a": np.zeros((n, batch, L), np.float32), "entropy": np.zeros((n, batch, L), np.float32),
           "resolved": np.zeros((n, batch, L), bool), "active": np.zeros((n, batch), bool),
           "block": np.zeros(n, np.int32), "step": np.zeros(n, np.int32)}
    for i, rec in enumerate(records):
        cap["block"][i], cap["step"][i] = rec["block"], rec["step"]
        for b, (canvas, ent, res) in rec["rows"].items():
            cap["canvas"][i, b], cap["entropy"][i, b], cap["resolved"][i, b] = canvas, ent, res
            cap["active"][i, b] = True
    return cap


def random_mask_capture(responses, cfg, key, t_min: float = 0.05, pad_id: int = 0) -> TruthCapture:
    """One state per block of every answer, masked by stage 1's own noise (DiffusionObjective.noise: a level
    t ~ U(t_min, 1) per block, at least one [MASK] per block), the answers' end-of-turn padding included."""
    L = cfg.block_length
    tokens, lengths = answer_arrays(responses, L, pad_id)
    B, T = tokens.shape
    pos = np.broadcast_to(np.arange(T, dtype=np.int32), (B, T))
    seg = (pos < (-(-lengths // L) * L)[:, None]).astype(np.int32)  # the answer and its padding to the block end
    noisy, _ = DiffusionObjective(block_length=L, t_min=t_min).noise(cfg, jnp.asarray(tokens), jnp.asarray(seg),
                                                                     jnp.asarray(pos), jnp.zeros((B, T), jnp.int32),
                                                                     key)
    noisy = np.asarray(noisy)
    records = [{"block": blk, "step": 0,
                "rows": {b: (noisy[b, blk * L:(blk + 1) * L], np.ones(L, np.float32), np.zeros(L, bool))
                         for b in range(B) if blk * L < lengths[b]}} for blk in range(T // L)]
    return TruthCapture(tokens, lengths, len(records), _capture(records, B, L, cfg.hidden_size))


def make_forced_step(cfg, residual, threshold: float):
    """jitted (params, arrays, canvas [S, L]) -> (normalized entropy [S, L], fill [S, L]) of every state of a padded
    replay (pad_replay) whose state segments hold `canvas` (padding states write back what their slots hold): the
    policy's entropies and the positions MaskSampler's threshold rule fills there, on greedy confidences."""
    L = cfg.block_length
    sampler = MaskSampler(mask_token_id=cfg.mask_token_id, threshold=threshold, temperature=0.0)

    @jax.jit
    def fn(params, arrays, canvas):
        rows = arrays["state_row"][:, None]
        cols = arrays["state_start"][:, None] + jnp.arange(L)[None]
        keep = arrays["tokens"][rows, cols]
        tokens = arrays["tokens"].at[rows, cols].set(jnp.where(arrays["state_valid"][:, None], canvas, keep))
        batch = replay_arrays_batch(arrays | {"tokens": tokens})
        logits = state_logits(params, cfg, batch, replay_hidden(params, cfg, residual, batch)).astype(jnp.float32)
        S = canvas.shape[0]
        out = sampler.step(logits, canvas, {"edit_steps": jnp.zeros(S, jnp.int32), "x0": canvas},
                           jax.random.key(0), jnp.zeros((), jnp.int32), jnp.ones(S, bool))  # greedy: no draw
        return out.entropy, out.resolved

    return fn


def forced_capture(params, cfg, prompts, responses, step_fn, *, rows: int, width: int, states: int,
                   pad_id: int = 0) -> TruthCapture:
    """The states of teacher-forced threshold decoding of every answer (module docstring); step_fn from
    make_forced_step, run on the replay padded to (rows, width, states) so that it compiles once."""
    L, mask = cfg.block_length, cfg.mask_token_id
    tokens, lengths = answer_arrays(responses, L, pad_id)
    B, nb = len(responses), tokens.shape[1] // L
    start = [{"block": blk, "step": 0, "rows": {b: (np.full(L, mask, np.int32), np.zeros(L, np.float32),
                                                   np.zeros(L, bool)) for b in range(B) if blk * L < lengths[b]}}
             for blk in range(nb)]
    layout = build_replay(prompts, TruthCapture(tokens, lengths, nb, _capture(start, B, L, cfg.hidden_size)),
                          [True] * B, block_length=L, pad_id=pad_id, mask_token_id=mask)
    arrays = jax.device_put(pad_replay(layout, rows, width, states))
    S = len(layout.step)
    owner = [(b, blk) for b in range(B) for blk in range(nb) if blk * L < lengths[b]]  # build_replay's state order
    assert len(owner) == S
    target = layout.targets
    canvas = np.full((states, L), mask, np.int32)
    records: dict[tuple[int, int], dict] = {}  # (block, step) -> record
    for step in range(L):
        masked = canvas[:S] == mask
        open_ = masked.any(1)
        if not open_.any():
            break
        ent, fill = (np.asarray(x)[:S] for x in step_fn(params, arrays, jnp.asarray(canvas)))
        for s in np.flatnonzero(open_):
            b, blk = owner[s]
            rec = records.setdefault((blk, step), {"block": blk, "step": step, "rows": {}})
            rec["rows"][b] = (canvas[s].copy(), ent[s], fill[s])
        canvas[:S] = np.where(fill, target, canvas[:S])
    ordered = [records[k] for k in sorted(records)]  # block-major, as the engine records them
    return TruthCapture(tokens, lengths, len(ordered), _capture(ordered, B, L, cfg.hidden_size))
