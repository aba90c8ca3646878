"""Session 27: do L_pred's targets line up with what decoding filled? One round of the h200 base's rollouts as ORL's
rounds roll out (16 prompts x 4, fill 0.9, temperature 1), every state of every verified response replayed: the
filled positions of each state's canvas against its targets, and the positions the next state of the block filled
against this state's targets (what L_pred trains there).

Run from the repository root on CPU (~1 minute), with the base package in .carry/pkg_h200_mask:
  python benchmarks/results/2026-12-02_orl_sup_strict_h200/target_alignment.py
Output: 200 states, 1789 filled positions, canvas == target at all of them; 980 of 980 positions newly filled by
the next state equal this state's target.
"""

import sys

sys.path[:0] = ["benchmarks"]

import numpy as np  # noqa: E402
from base_rollouts import load_base, roll_out  # noqa: E402

from orl_jax.train.replay import build_replay  # noqa: E402

r, tok, cfg, params = load_base()
exs, rows, out, texts, ok, sampler = roll_out(r, tok, cfg, params, 16)  # round 0's prompts
L = cfg.block_length
b = build_replay(rows, out, ok, block_length=L, pad_id=0, mask_token_id=cfg.mask_token_id, max_states=10_000)
filled = ~b.unresolved & b.valid
canvas = np.stack([b.tokens[row, start:start + L] for row, start in zip(b.state_row, b.state_start)])
print("states", len(b.step), "filled positions", filled.sum(),
      "canvas == target there", (canvas == b.targets)[filled].mean())
agree = total = 0
for s, n in {p: s for s, p in enumerate(b.prev) if p >= 0}.items():  # state s and the next state n of its block
    newly = b.unresolved[s] & ~b.unresolved[n] & b.valid[n]
    agree += (canvas[n][newly] == b.targets[s][newly]).sum()
    total += newly.sum()
print("newly filled by the next state == this state's target:", agree, "/", total)
