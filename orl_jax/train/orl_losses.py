"""The ORL losses (METHOD.md §3) on replayed states, written as pure functions of per-state arrays.

A replayed state s is one denoising step of one verified response: its logits under the current params
[S, L, V], the verified final tokens of its block [S, L], the behaviour distribution the rollout sampled from
(log-probs at the rollout's temperature, stop-gradient) and its normalized entropy, and which positions were
still unresolved. Defaults are our reading of the method [I] and meant to be swept.

- L_pred: cross-entropy to the verified final token on uncertain positions (behaviour entropy > pred_gate),
  averaged over those positions of the state.
- L_anchor: reverse KL(p_theta || p_behaviour) on confident positions (entropy <= pred_gate), each position's KL
  capped at anchor_cap nats, averaged over those positions.
- AEC (Adjacent Entropy Contraction), for adjacent states s -> s' of the same block:
  max(0, H(s') - (1 - rho) * sg(H(s)))^2, H = mean normalized entropy over the state's unresolved positions;
  zero when sg(H(s)) < aec_gate (already confident) or when s' has no unresolved position.
- Per response: (sum over its states of L_pred + l_anchor L_anchor + l_aec L_AEC) / its number of states;
  the batch loss is the mean over responses that have states.
- pred_norm (our reading [I]; METHOD.md leaves a state's reduction open): "state" averages L_pred over the state's
  uncertain positions, so a late state with one such position weighs as much as a first state with thirty (on one
  round of the h200 base's rollouts, states with one position hold 10% of the positions and 42% of the weight:
  benchmarks/results/2026-12-02_orl_truth_states_h200/token_weights.py); "block" sums them and divides by the block
  length, so within a response every position weighs alike, as in stage 1's token mean.
- ar_weight (our addition [I], not in the method): plus ar_weight times the next-token loss of the replay rows'
  clean tokens (prompt + verified response; train/replay.clean_next_token_loss). It keeps the causal pass
  that prefill and commits run trained as the conversion trained it (stage 1's ar_weight). RCD without that term
  lost up to 10 points of held-out accuracy; ORL at 3e-5 lost 9-13 with it and without it
  (benchmarks/results/2026-12-02_rcd_ar_term_h200/).
- l_cert (our addition [I], after dParallel's "certainty forcing"; 0 = off, the method as specified): plus l_cert
  times the mean entropy (nats) of the current policy over each state's unresolved valid positions whose current
  argmax already is the verified token, in the per-state sum. L_pred's cross-entropy is dominated by the positions
  the model gets wrong; on the h200 base the argmax at a block's first step is already the final token at 93% of
  the positions, but only 64% clear a strict fill threshold (benchmarks/block_confidence.py). This term sharpens
  exactly those, with its own normalization, and leaves the wrong ones to L_pred. Measured on that base: TPF
  1.08-1.16x at the strict settings for 2-12 points of accuracy, on or below the base's own accuracy-vs-TPF curve
  (benchmarks/results/2026-12-02_orl_cert_h200/).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp


@dataclass(frozen=True)
class ORLLossConfig:
    pred_gate: float = 0.02  # behaviour normalized entropy above which a position counts as uncertain
    anchor_cap: float = 0.5  # nats
    rho: float = 0.25  # AEC: required fractional entropy contraction per step
    aec_gate: float = 0.01  # AEC off when the previous state is already this confident
    l_anchor: float = 1.0
    l_aec: float = 10.0  # AEC values are ~1e-3; sweep 1..100
    ar_weight: float = 0.0  # next-token loss on the replayed clean tokens (see the module docstring); 0 = off
    l_cert: float = 0.0  # certainty forcing on positions already predicted right (module docstring); 0 = off
    # L_pred of a state: "state" = the mean over its uncertain positions (our first reading), "block" = their sum / the
    # block length (every position of a response weighs alike, as stage 1 weighs tokens; module docstring)
    pred_norm: str = "state"

    def __post_init__(self):
        for name in ("pred_gate", "anchor_cap", "rho", "aec_gate", "l_anchor", "l_aec", "ar_weight", "l_cert"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or math.isnan(v) or v < 0:
                raise ValueError(f"ORLLossConfig.{name} must be a number >= 0, got {v!r}")
        if self.rho > 1:
            raise ValueError(f"ORLLossConfig.rho must be in [0, 1], got {self.rho}")
        if self.pred_norm not in ("state", "block"):
            raise ValueError(f"ORLLossConfig.pred_norm must be 'state' or 'block', got {self.pred_norm!r}")


def entropy(logp: jax.Array) -> jax.Array:
    """[..., V] log-probs -> entropy in nats (>= 0)."""
    return jnp.maximum(-jnp.sum(jnp.exp(logp) * logp, axis=-1), 0.0)


def normalized_entropy(logp: jax.Array) -> jax.Array:
    """[..., V] log-probs -> entropy / log V in [0, 1]."""
    return entropy(logp) / math.log(logp.shape[-1])


def _masked_mean(x, m):
    m = m.astype(x.dtype)
    return jnp.sum(x * m, axis=-1) / jnp.maximum(jnp.sum(m, axis=-1), 1.0)


def pred_loss(logits, targets, beh_entropy, valid, gate: float, norm: str = "state"):
    """[S] cross-entropy over uncertain valid positions: their mean ("state"; 0 for a state without any) or their
    sum / L ("block")."""
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]  # [S, L]
    m = valid & (beh_entropy > gate)
    return _masked_mean(nll, m) if norm == "state" else jnp.sum(jnp.where(m, nll, 0.0), axis=-1) / nll.shape[-1]


def anchor_loss(logits, beh_logp, beh_entropy, valid, gate: float, cap: float):
    """[S] mean over confident valid positions of min(KL(p_theta || p_behaviour), cap)."""
    logp = jax.nn.log_softmax(logits, axis=-1)
    kl = jnp.sum(jnp.exp(logp) * (logp - jax.lax.stop_gradient(beh_logp)), axis=-1)  # [S, L]
    return _masked_mean(jnp.minimum(kl, cap), valid & (beh_entropy <= gate))


def certainty_loss(logits, targets, unresolved):
    """[S] mean entropy (nats) over the unresolved positions whose argmax (no gradient through the choice) is the
    target; 0 for a state without any."""
    right = jnp.argmax(jax.lax.stop_gradient(logits), axis=-1) == targets
    return _masked_mean(entropy(jax.nn.log_softmax(logits, axis=-1)), unresolved & right)


def state_entropy(logits, unresolved, temperature=1.0):
    """(H [S]: mean normalized entropy over unresolved positions, has_unresolved [S])."""
    t = jnp.asarray(temperature, jnp.float32)
    t = t[:, None, None] if t.ndim == 1 else t
    h = normalized_entropy(jax.nn.log_softmax(logits / t, axis=-1))
    return _masked_mean(h, unresolved), jnp.any(unresolved, axis=-1)


def aec_loss(h, has_unresolved, prev, rho: float, gate: float):
    """[S] AEC term of each state s' against its predecessor prev[s'] (-1: first state of its block)."""
    h_prev = jax.lax.stop_gradient(jnp.take(h, jnp.maximum(prev, 0)))
    on = (prev >= 0) & has_unresolved & (h_prev >= gate)
    return jnp.where(on, jnp.square(jnp.maximum(0.0, h - (1.0 - rho) * h_prev)), 0.0)


def per_response_mean(state_loss, response_id, num_responses: int, state_valid=None, response_weight=None):
    """Sum of each response's state losses / its state count, averaged over responses that have states (each
    response's term times response_weight[response], if given; the count is unweighted). Invalid (padding) states
    go to an extra segment that is dropped."""
    if state_valid is not None:
        response_id = jnp.where(state_valid, response_id, num_responses)
    total = jax.ops.segment_sum(state_loss, response_id, num_segments=num_responses + 1)[:num_responses]
    count = jax.ops.segment_sum(jnp.ones_like(state_loss), response_id, num_segments=num_responses + 1)
    count = count[:num_responses]
    has = count > 0
    per = jnp.where(has, total / jnp.maximum(count, 1.0), 0.0)
    if response_weight is not None:
        per = per * response_weight[:num_responses]
    return jnp.sum(per) / jnp.maximum(jnp.sum(has), 1)


def orl_loss(cfg: ORLLossConfig, logits, targets, beh_logp, beh_entropy, valid, unresolved, temperature, prev,
             response_id, num_responses: int, state_valid=None, response_weight=None):
    """The batch loss and its parts. logits/beh_logp [S, L, V]; targets/beh_entropy/valid/unresolved [S, L];
    temperature/prev/response_id [S]; state_valid [S] (False for padding states, which then count nowhere);
    response_weight [num_responses] (per_response_mean)."""
    state_valid = jnp.ones(prev.shape, bool) if state_valid is None else state_valid
    lp = pred_loss(logits, targets, beh_entropy, valid, cfg.pred_gate, cfg.pred_norm)
    la = anchor_loss(logits, beh_logp, beh_entropy, valid, cfg.pred_gate, cfg.anchor_cap)
    h, has_u = state_entropy(logits, unresolved & valid, temperature)
    lc = aec_loss(h, has_u, prev, cfg.rho, cfg.aec_gate)
    per_state = lp + cfg.l_anchor * la + cfg.l_aec * lc
    parts = {"l_pred": _mean_over(lp, state_valid), "l_anchor": _mean_over(la, state_valid),
             "l_aec": _mean_over(lc, state_valid), "entropy": _mean_over(h, state_valid)}
    if cfg.l_cert:
        lr = certainty_loss(logits, targets, unresolved & valid)
        per_state, parts = per_state + cfg.l_cert * lr, parts | {"l_cert": _mean_over(lr, state_valid)}
    per_state = jnp.where(state_valid, per_state, 0.0)
    loss = per_response_mean(per_state, response_id, num_responses, state_valid, response_weight)
    return loss, parts


def _mean_over(x, m):
    return jnp.sum(jnp.where(m, x, 0.0)) / jnp.maximum(jnp.sum(m), 1)
