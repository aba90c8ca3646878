"""Session 28: how ORL's per-state mean spreads L_pred's weight over tokens, against stage 1's token mean.

One round of the h200 base's rollouts as ORL rolls out (round 0's first 16 prompts, 4 responses each, fill 0.9,
temperature 1), the replay the recipe builds (at most r.orl_states states per response, whole blocks in a random
order). L_pred's positions are a state's [MASK] positions inside the response whose behaviour normalized entropy
is above the gate.
Under the method's normalization (METHOD.md §3: the mean over a state's positions [our reading], summed over the
response's states / their number, averaged over responses) each position's weight is
1 / (positions of its state x states of its response x responses). Stage 1 weighs every supervised token alike.
Printed: how the positions and the weight split by the state's position count, and the base's cross-entropy there.

Run from the repository root on CPU (~2 minutes, ~8 GB), with the base package in .carry/pkg_h200_mask:
  python benchmarks/results/2026-12-02_orl_truth_states_h200/token_weights.py [prompts]
"""

import sys

sys.path[:0] = ["benchmarks"]

import jax  # noqa: E402
import numpy as np  # noqa: E402
from base_rollouts import load_base, roll_out  # noqa: E402

from orl_jax.decode.residual import ORLResidual  # noqa: E402
from orl_jax.train.orl import ORLConfig, selection_rng  # noqa: E402
from orl_jax.train.orl_losses import ORLLossConfig  # noqa: E402
from orl_jax.train.replay import build_replay, policy_logits, replay_logits  # noqa: E402

P = int(sys.argv[1]) if len(sys.argv) > 1 else 16
r, tok, cfg, params = load_base()
exs, rows, out, texts, ok, sampler = roll_out(r, tok, cfg, params, P, threshold=0.9, group=4)
L = cfg.block_length
b = build_replay(rows, out, ok, block_length=L, pad_id=0, mask_token_id=cfg.mask_token_id, max_states=r.orl_states,
                 rng=selection_rng(jax.random.key(0), ORLConfig()))
gate = ORLLossConfig().pred_gate
pos = b.valid & b.unresolved & (b.entropy > gate)  # L_pred's positions [S, L]
n_pos = pos.sum(1)  # per state
n_states = np.bincount(b.response_id, minlength=len(b.clean_len))
responses = (n_states > 0).sum()
w_state = np.where(n_pos > 0, 1.0 / np.maximum(n_pos, 1), 0.0) / n_states[b.response_id] / responses  # [S]
w = np.where(pos, w_state[:, None], 0.0)
w_token = pos / pos.sum()
logp = jax.nn.log_softmax(policy_logits(sampler, replay_logits(params, cfg, ORLResidual(), b)), axis=-1)
ce = -np.take_along_axis(np.asarray(logp), b.targets[..., None], axis=-1)[..., 0]
print(f"{len(ok)} responses, {int(np.sum(ok))} verified, {len(b.step)} states, {int(pos.sum())} L_pred positions; "
      f"weight sum {w.sum():.3f} (states without an L_pred position count in their response's state number)")
print("| positions in the state | states | share of L_pred's positions | share of its weight (method) | "
      "weight per token vs token mean | base CE there (nats) | share of sum(weight x CE) (method) | "
      "share of sum(CE) (token mean) |")
print("|---|---|---|---|---|---|---|---|")
bins = [(1, 1), (2, 2), (3, 4), (5, 8), (9, 16), (17, 32)]
for lo, hi in bins:
    sel = (n_pos >= lo) & (n_pos <= hi)
    m = pos & sel[:, None]
    if not m.any():
        continue
    print(f"| {lo}-{hi} | {sel.sum()} | {m.sum() / pos.sum():.3f} | {w[m].sum() / w.sum():.3f} | "
          f"{(w[m].sum() / w.sum()) / (m.sum() / pos.sum()):.2f}x | {ce[m].mean():.3f} | "
          f"{(w * ce)[m].sum() / (w * ce)[pos].sum():.3f} | {ce[m].sum() / ce[pos].sum():.3f} |")
print(f"mean CE: method-weighted {(w * ce)[pos].sum() / w.sum():.3f}, token mean {ce[pos].mean():.3f}")
