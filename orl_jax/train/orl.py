"""On-policy residual learning: roll out with the current params, verify, replay, update once, repeat.

`orl_iteration` is one round of METHOD.md §3: G responses per prompt are generated with the engine's own
`generate(..., capture=True)` under the *current* params (the same decoding code as inference), failed responses
are dropped, the captured states of the verified ones are packed (train/replay.py) and exactly one optimizer
update is taken on them; the trajectories are then discarded. The behaviour distribution of the anchor term is
recomputed from the replay with the pre-update params and the rollout's temperature (stop-gradient), which is
the distribution the rollout sampled from, since the params have not changed between rollout and replay.
Hence, with exactly one update per rollout, the anchor KL(p_theta || p_behaviour) is zero, with zero gradient,
where the update is taken, *unless* the rollout sampled at a temperature != 1: p_theta is the policy at
temperature 1. The uniform family samples at 0.8 -> 0.4, so its anchor pulls the policy towards its own sharper
tempered distribution on confident positions (a sharpening term). The mask family samples at 1.0, and there the
anchor does nothing.

Replay arrays are padded to fixed sizes (rows, width, states) so the update compiles once.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from orl_jax.checks import int_at_least
from orl_jax.decode.engine import generate
from orl_jax.decode.residual import ORLResidual, RCDResidual
from orl_jax.train.objectives import check_causal_clean_rows
from orl_jax.train.orl_losses import ORLLossConfig, normalized_entropy, orl_loss
from orl_jax.train.replay import (
    ReplayBatch,
    behaviour_logp,
    build_replay,
    clean_next_token_loss,
    policy_logits,
    replay_hidden,
    state_logits,
)


@dataclass(frozen=True)
class ORLConfig:
    group_size: int = 4  # responses per prompt (G)
    max_new_tokens: int = 64
    max_states: int = 16  # replayed states per response
    max_prompt: int = 128  # prompts longer than this are rejected (fixed replay width)
    loss: ORLLossConfig = ORLLossConfig()
    # which states, when a response has more than max_states: "blocks" = whole blocks in a random order (every
    # block of an answer is trained over the rounds), "first" = the first ones in decoding order
    state_selection: str = "blocks"
    # the residual form of the rollouts and of the replay (one policy): ORL's adapter, or RCD's interpolation for
    # on-policy training of an RCD model (the recipe's "orl_rcd" variant)
    residual: ORLResidual | RCDResidual = ORLResidual()
    # our addition, not the method (which weighs every verified response alike): weigh each verified response by
    # 1 - its prompt's verified share (GRPO's group baseline without the negative side: failed responses still give
    # no gradient), so a prompt whose G responses all verify gives none either. Measured on the h200 base: worse
    # than without it, -12 to -16 points (benchmarks/results/2026-12-02_orl_truth_states_h200/)
    group_baseline: bool = False
    # a diagnostic (session 28), not the method: False replays the captured states without their residual (z = 0,
    # a = 0), so the replayed logits are no longer the rollout's and the adapter g_phi gets no gradient
    replay_residual: bool = True

    def __post_init__(self):
        for name in ("group_size", "max_new_tokens", "max_states", "max_prompt"):
            int_at_least(f"ORLConfig.{name}", getattr(self, name))
        if self.state_selection not in ("blocks", "first"):
            raise ValueError(f"ORLConfig.state_selection must be 'blocks' or 'first', got {self.state_selection!r}")


def pad_replay(batch: ReplayBatch, rows: int, width: int, states: int) -> dict:
    """Device-ready arrays of fixed shape; padding rows see themselves only, padding states are invalid."""
    R, N = batch.tokens.shape
    S, L = batch.targets.shape
    if R > rows or N > width or S > states:
        raise ValueError(f"replay of {R} rows x {N} tokens x {S} states exceeds the padded sizes "
                         f"{rows} x {width} x {states}")
    out = {
        "tokens": np.zeros((rows, width), np.int32), "z": np.zeros((rows, width) + batch.z.shape[2:], batch.z.dtype),
        "a": np.zeros((rows, width), np.float32), "positions": np.zeros((rows, width), np.int32),
        "mask": np.broadcast_to(np.eye(width, dtype=bool), (rows, width, width)).copy(),
        "state_row": np.zeros(states, np.int32), "state_start": np.zeros(states, np.int32),
        "context_end": np.zeros(states, np.int32), "targets": np.zeros((states, L), np.int32),
        "step": np.zeros(states, np.int32),
        "prev": np.full(states, -1, np.int32), "response_id": np.zeros(states, np.int32),
        "entropy": np.zeros((states, L), np.float32), "unresolved": np.zeros((states, L), bool),
        "valid": np.zeros((states, L), bool), "state_valid": np.arange(states) < S,
        "clean_len": np.zeros(rows, np.int32),  # padding rows: nothing to predict
    }
    out["tokens"][:R, :N] = batch.tokens
    out["z"][:R, :N] = batch.z
    out["a"][:R, :N] = batch.a
    out["positions"][:R, :N] = batch.positions
    out["mask"][:R, :N, :N] = batch.mask
    out["clean_len"][:R] = batch.clean_len
    for k in ("state_row", "state_start", "context_end", "targets", "step", "prev", "response_id", "entropy",
              "unresolved", "valid"):
        out[k][:S] = getattr(batch, k)
    return out


def replay_arrays_batch(arrays: dict) -> ReplayBatch:
    fields = {f.name for f in dataclasses.fields(ReplayBatch)}
    return ReplayBatch(**{k: v for k, v in arrays.items() if k in fields})


def make_orl_loss(cfg, sampler, num_responses: int, loss_cfg: ORLLossConfig, residual=None, remat: bool = False,
                  decided_only: bool = True, supervised: tuple[Callable, float] | None = None):
    """loss_fn(params, arrays, key) for train/step.py: the ORL loss of a padded replay batch (pad_replay).
    remat: recompute each layer in the backward pass (long replay rows).

    Which positions L_pred and the anchor train: those the decoder still decides at the state. In the uniform family
    that is every position of the response in the block (each step re-samples the whole canvas). In the mask family
    a filled position is final (no edits): its logits are never read again, so with decided_only (the default) only
    the state's [MASK] positions count. decided_only=False trains every position of the response, as earlier sessions
    did (until session 26): on the h200 base ~17% of L_pred's positions and ~36% of the anchor's were filled ones.

    supervised: (sup_loss(params, batch, key) -> (loss, parts), weight), our addition (not the method): each update
    also takes weight x the supervised loss of arrays["supervised"], a batch of train data (the recipe: stage 1's
    conversion objective on ground-truth answers), as PPO-ptx mixes pretraining gradients into RL updates. ORL's
    updates drift the h200 base away from strict-decoding accuracy by a steady amount per update
    (benchmarks/results/2026-12-02_orl_cert_h200/); a supervised term is the standard counterweight."""
    residual = ORLResidual() if residual is None else residual
    decided = cfg.noise == "mask" and decided_only  # L_pred / anchor on [MASK] positions only
    check_causal_clean_rows(cfg, "ORLLossConfig.ar_weight", loss_cfg.ar_weight)

    def loss_fn(params, arrays, key):
        batch = replay_arrays_batch(arrays)
        h = replay_hidden(params, cfg, residual, batch, remat=remat)
        # the policy is what the sampler draws from (mask: no [MASK])
        logits = policy_logits(sampler, state_logits(params, cfg, batch, h))  # [S, L, V]
        beh = jax.lax.stop_gradient(behaviour_logp(sampler, logits, arrays["step"]))
        if hasattr(sampler, "t_max"):
            temps = jax.vmap(sampler.temperature)(arrays["step"])
        else:
            temps = jnp.full(arrays["step"].shape, max(sampler.temperature, 1.0), jnp.float32)
        # gates use the behaviour entropy the rollout captured (== that of `beh`: same params, same temperature)
        loss, parts = orl_loss(loss_cfg, logits, arrays["targets"], beh, arrays["entropy"],
                               arrays["valid"] & arrays["unresolved"] if decided else arrays["valid"],
                               arrays["unresolved"], temps, arrays["prev"], arrays["response_id"], num_responses,
                               arrays["state_valid"], arrays.get("row_weight"))
        parts = parts | {"replay_entropy_gap": replay_entropy_gap(beh, arrays)}
        if loss_cfg.ar_weight:
            ar = clean_next_token_loss(params, cfg, batch, h, arrays.get("row_weight"))
            loss, parts = loss + loss_cfg.ar_weight * ar, parts | {"ar_loss": ar}
        if supervised is not None:
            sup_loss, weight = supervised
            ls, sp = sup_loss(params, arrays["supervised"], key)
            loss, parts = loss + weight * ls, parts | {"sup_loss": ls} | {f"sup/{k}": v for k, v in sp.items()}
        return loss, parts

    return loss_fn


def replay_entropy_gap(beh_logp, arrays) -> jax.Array:
    """Mean |replayed - captured| behaviour normalized entropy over the batch's response positions: how closely the
    replay reproduced what the rollout computed. 0 up to rounding when it does (float32: ~1e-6, tests/test_replay.py);
    bf16 and a different attention path (the replay's packed staircase against the engine's cache) add rounding.
    Logged every round, so a replay that sees the wrong context shows up in the metrics."""
    m = arrays["valid"] & arrays["state_valid"][:, None]
    gap = jnp.abs(normalized_entropy(beh_logp) - arrays["entropy"])
    return jnp.sum(jnp.where(m, gap, 0.0)) / jnp.maximum(jnp.sum(m), 1)


def rollout(params, cfg, prompts: Sequence[Sequence[int]], key, sampler, orl_cfg: ORLConfig, *,
            eos_token_ids=(), pad_token_id: int = 0, mesh=None):
    """G responses per prompt under the current params, with capture. Returns (rows' prompts, GenerateOutput).
    mesh: the training mesh; the rows are then split over its data axes (generate(mesh=...))."""
    for i, p in enumerate(prompts):
        if len(p) > orl_cfg.max_prompt:
            raise ValueError(f"prompt {i} has {len(p)} tokens > ORLConfig.max_prompt={orl_cfg.max_prompt}")
    rows = [list(p) for p in prompts for _ in range(orl_cfg.group_size)]
    out = generate(params, cfg, rows, key=key, max_new_tokens=orl_cfg.max_new_tokens, sampler=sampler,
                   residual=orl_cfg.residual, capture=True, eos_token_id=eos_token_ids, pad_token_id=pad_token_id,
                   mesh=mesh if mesh is not None and mesh.size > 1 else None)
    return rows, out


def selection_rng(key, orl_cfg: ORLConfig):
    """numpy Generator for the round's state selection, derived from the round key (resumes reproducibly)."""
    if orl_cfg.state_selection == "first":
        return None
    k = jax.random.fold_in(key, 1)
    if jnp.issubdtype(k.dtype, jax.dtypes.prng_key):
        k = jax.random.key_data(k)
    return np.random.default_rng(np.asarray(k).ravel().tolist())


def orl_iteration(state, step_fn, cfg, prompts, verify: Callable[[list[np.ndarray]], Sequence[bool]], key,
                  sampler, orl_cfg: ORLConfig, *, eos_token_ids=(), pad_token_id: int = 0,
                  supervised_batch: dict | None = None):
    """One on-policy round: rollout (current params) -> verify -> replay -> exactly one update.

    verify(responses) -> one bool per response, given all len(prompts) * G response token arrays at once (row r
    answers prompt r // G), so a verifier can check them in parallel (tasks.verify_many). The rollout runs over the
    step's mesh (rows split over its data axes). Returns (state, metrics, replay arrays); metrics include the
    verified share, the rollout's TPF, and where the round's wall time went (rollout_s: generate(), read back;
    replay_s: verify and pack on the host; update_s: the step, waited for). supervised_batch: the round's batch for
    a loss made with make_orl_loss(supervised=...), passed to the update as arrays["supervised"].
    """
    t0 = time.perf_counter()
    rows, out = rollout(state.params, cfg, prompts, key, sampler, orl_cfg, eos_token_ids=eos_token_ids,
                        pad_token_id=pad_token_id, mesh=getattr(step_fn, "mesh", None))
    toks, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
    t1 = time.perf_counter()
    ok = [bool(v) for v in verify([toks[r, :lengths[r]] for r in range(len(rows))])]
    if len(ok) != len(rows):
        raise ValueError(f"verify returned {len(ok)} results for {len(rows)} responses")
    batch = build_replay(rows, out, ok, block_length=cfg.block_length, pad_id=pad_token_id,
                         prefix_attention=cfg.prefix_attention,
                         mask_token_id=cfg.mask_token_id if cfg.noise == "mask" else None,
                         max_states=orl_cfg.max_states, rng=selection_rng(key, orl_cfg))
    if not orl_cfg.replay_residual:
        batch.z[:], batch.a[:] = 0, 0
    t2 = time.perf_counter()
    metrics = {"verified": float(np.mean(ok)), "rollout_tpf": float(np.mean(np.asarray(out.tpf))),
               "rollout_s": t1 - t0, "replay_s": t2 - t1}
    if not any(ok):  # nothing verified: no gradient this round (the rollout still counts)
        return state, metrics | {"replayed_states": 0, "update_s": 0.0}, None
    weight = None
    if orl_cfg.group_baseline:  # build_replay's rows are the verified responses, in order
        share = np.asarray(ok, np.float32).reshape(-1, orl_cfg.group_size).mean(1)
        weight = np.asarray([1.0 - share[r // orl_cfg.group_size] for r in range(len(rows)) if ok[r]], np.float32)
        metrics["mean_weight"] = float(weight.mean())
    return replay_update(state, step_fn, batch, len(rows), cfg.block_length, orl_cfg, metrics, supervised_batch,
                         weight)


def replay_update(state, step_fn, batch: ReplayBatch, n: int, L: int, orl_cfg: ORLConfig, metrics: dict,
                  supervised_batch: dict | None = None, row_weight: np.ndarray | None = None):
    """The round's one update on its replay, padded to the sizes of n responses (ORLConfig's) so the step compiles
    once. row_weight: a weight per replay row (response), 1 by default (arrays["row_weight"], read by
    make_orl_loss). Returns (state, metrics, padded arrays); metrics gain the replayed state count and update_s
    (packing and the step, waited for)."""
    t = time.perf_counter()
    width = orl_cfg.max_prompt + orl_cfg.max_new_tokens + L + orl_cfg.max_states * L
    arrays = pad_replay(batch, n, width, n * orl_cfg.max_states)
    arrays["row_weight"] = np.zeros(n, np.float32)
    arrays["row_weight"][:len(batch.clean_len)] = 1.0 if row_weight is None else row_weight
    if supervised_batch is not None:
        arrays["supervised"] = supervised_batch
    state, m = step_fn(state, arrays)
    jax.block_until_ready(state.params)
    return state, metrics | dict(m) | {"replayed_states": int(len(batch.step)),
                                       "update_s": time.perf_counter() - t}, arrays
