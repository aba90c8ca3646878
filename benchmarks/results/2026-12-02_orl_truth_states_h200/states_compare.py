"""Session 28: the states of the base's verified arithmetic rollouts beside truth_forced's states of the same answers.

The verified arithmetic answers equal the reference answers token for token (answers_vs_truth.py), so the two state
sets differ only in which positions are still [MASK] at each step (sampled decoding at temperature 1 against greedy
confidences), in the residual z the rollout carries, and in selection. Printed per set: states per block, [MASK]
positions per state, L_pred's positions (behaviour normalized entropy above the gate) and the base's cross-entropy
there, and where in the block those positions lie.

Run from the repository root on CPU (~3 minutes), with the base package in .carry/pkg_h200_mask:
  python benchmarks/results/2026-12-02_orl_truth_states_h200/states_compare.py [prompts]
"""

import sys

sys.path[:0] = ["benchmarks"]

import jax  # noqa: E402
import numpy as np  # noqa: E402
from base_rollouts import load_base, roll_out  # noqa: E402

from orl_jax.data.prompt_format import format_example  # noqa: E402
from orl_jax.decode.residual import ORLResidual  # noqa: E402
from orl_jax.train.orl_losses import ORLLossConfig  # noqa: E402
from orl_jax.train.replay import build_replay, policy_logits, replay_logits  # noqa: E402
from orl_jax.train.truth_states import forced_capture, make_forced_step  # noqa: E402

P = int(sys.argv[1]) if len(sys.argv) > 1 else 24
r, tok, cfg, params = load_base()
exs, rows, out, texts, ok, sampler = roll_out(r, tok, cfg, params, P, task="arithmetic")
L, gate = cfg.block_length, ORLLossConfig().pred_gate
keep = [i for i, good in enumerate(ok) if good]
rollout = build_replay(rows, out, ok, block_length=L, pad_id=0, mask_token_id=cfg.mask_token_id, max_states=None)
pairs = [format_example(tok, exs[i // 4]) for i in keep]
prompts, answers = [p for p, _ in pairs], [a[:r.eval_max_new] for _, a in pairs]
fn = make_forced_step(cfg, ORLResidual(), 0.9)
n = len(keep)
width = r.orl_max_prompt + r.eval_max_new + L + 16 * L
cap = forced_capture(params, cfg, prompts, answers, fn, rows=n, width=width, states=n * 16)
forced = build_replay(prompts, cap, [True] * n, block_length=L, pad_id=0, mask_token_id=cfg.mask_token_id)


def describe(name, b, residual):
    lg = policy_logits(sampler, replay_logits(params, cfg, residual, b))
    logp = np.asarray(jax.nn.log_softmax(lg, axis=-1))
    ce = -np.take_along_axis(logp, b.targets[..., None], axis=-1)[..., 0]
    masked = b.unresolved & b.valid
    pos = masked & (b.entropy > gate)
    blocks = len({(int(r_), int(p)) for r_, p, s in zip(b.state_row, b.positions[b.state_row, b.state_start],
                                                         b.step) if s == 0})
    where = np.nonzero(pos)[1]
    print(f"| {name} | {len(b.step)} | {len(b.step) / blocks:.2f} | {masked.sum(1).mean():.1f} | "
          f"{pos.sum()} ({pos.sum() / len(b.step):.2f} per state) | {ce[pos].mean():.3f} | "
          f"{np.median(where) if len(where) else '-'} | {(b.step[pos.any(1)] == 0).mean():.2f} |")


print(f"{len(keep)} of {len(ok)} arithmetic rollouts verified")
print("| states | count | per block | [MASK] per state | L_pred positions | base CE there | median position in "
      "the block | share of states with L_pred positions that are a block's first |")
print("|---|---|---|---|---|---|---|---|")
describe("rollouts (sampled, fill 0.9, residual as captured)", rollout, ORLResidual())
describe("truth_forced (greedy confidences, fill 0.9, z = 0)", forced, ORLResidual())
