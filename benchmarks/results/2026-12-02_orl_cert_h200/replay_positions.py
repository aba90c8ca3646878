"""Session 26, two counts on one round of the h200 base's rollouts (fill 0.9, temperature 1), as the recipe's ORL
rounds roll out: (1) which positions ORL's L_pred and anchor trained before fd3aa88 (every position of the
response); (2) how many of the verified responses' tokens were filled with a sample other than the argmax of the
state that filled them (the noise a verified trajectory could teach).

Run from the repository root on CPU (~1 minute):
  python benchmarks/results/2026-12-02_orl_cert_h200/replay_positions.py 8
Output of that run: verified 0.625; gate 0.02: L_pred positions 235, of which filled 41 (17.4%); anchor positions
2921, of which filled 1064; 113 states; 2 of 2064 filled positions (0.10%) took a non-argmax sample.
"""

import sys

sys.path[:0] = ["benchmarks"]

import numpy as np  # noqa: E402
from base_rollouts import load_base, roll_out  # noqa: E402

from orl_jax.decode.residual import ORLResidual  # noqa: E402
from orl_jax.train.replay import build_replay, policy_logits, replay_logits  # noqa: E402

r, tok, cfg, params = load_base()
exs, rows, out, texts, ok, sampler = roll_out(r, tok, cfg, params, int(sys.argv[1]))  # round 0's prompts
print("verified", np.mean(ok))
b = build_replay(rows, out, ok, block_length=cfg.block_length, pad_id=0, mask_token_id=cfg.mask_token_id,
                 max_states=16, rng=np.random.default_rng(0))
valid, masked, ent = b.valid, b.unresolved & b.valid, b.entropy
for gate in (0.02, 0.0005):
    pred, anchor = valid & (ent > gate), valid & (ent <= gate)
    print(f"gate {gate}: L_pred positions {pred.sum()}, of which filled {(pred & ~masked).sum()} "
          f"({(pred & ~masked).sum() / max(pred.sum(), 1):.1%}); anchor positions {anchor.sum()}, of which filled "
          f"{(anchor & ~masked).sum()}")
print("positions", valid.sum(), "[MASK]", masked.sum(), "states", len(b.step), "first states", (b.prev < 0).sum())

filled = non_argmax = 0
for row in np.flatnonzero(ok):  # each verified response alone, every state of it
    rb = build_replay(rows, out, [i == row for i in range(len(rows))], block_length=cfg.block_length, pad_id=0,
                      mask_token_id=cfg.mask_token_id, max_states=10_000)
    argmax = np.asarray(policy_logits(sampler, replay_logits(params, cfg, ORLResidual(), rb))).argmax(-1)
    masked = rb.unresolved & rb.valid
    for s in range(len(rb.step)):  # filled at s: [MASK] at s, not at the block's next state (or none follows)
        nxt = np.flatnonzero(rb.prev == s)
        here = masked[s] & (~masked[nxt[0]] if len(nxt) else True)
        filled += here.sum()
        non_argmax += (here & (argmax[s] != rb.targets[s])).sum()
print(f"filled positions of verified responses {filled}, with a non-argmax sample {non_argmax} "
      f"({non_argmax / max(filled, 1):.2%})")
