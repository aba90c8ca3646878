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

sys.path[:0] = [".", "recipes"]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import train_qwendlm as recipe  # noqa: E402

from orl_jax.data import tasks  # noqa: E402
from orl_jax.data.prompt_format import format_prompt, response_until_stop, stop_token_ids  # noqa: E402
from orl_jax.data.tokenizer import load_tokenizer  # noqa: E402
from orl_jax.decode.residual import ORLResidual  # noqa: E402
from orl_jax.decode.samplers import MaskSampler  # noqa: E402
from orl_jax.train import base_package  # noqa: E402
from orl_jax.train.orl import ORLConfig, rollout  # noqa: E402
from orl_jax.train.replay import build_replay, policy_logits, replay_logits  # noqa: E402
from orl_jax.train.stage2 import train_prompts  # noqa: E402

G = 4
pkg = base_package.check_package(".carry/pkg_h200_mask")
r, tok = recipe.PRESETS["h200"], load_tokenizer(pkg)
cfg, params = base_package.read_package(pkg)
cfg = cfg.replace(dtype="float32", attention_impl="xla")
params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params)
exs = train_prompts(r, tok, 256, int(sys.argv[1]), 100_000)  # round 0's prompts
ocfg = ORLConfig(group_size=G, max_new_tokens=r.eval_max_new, max_states=16, max_prompt=256)
sampler = MaskSampler(mask_token_id=cfg.mask_token_id, threshold=0.9, temperature=1.0)
rows, out = rollout(params, cfg, [format_prompt(tok, e.prompt) for e in exs], jax.random.key(0), sampler, ocfg,
                    eos_token_ids=stop_token_ids(tok), pad_token_id=cfg.pad_token_id or 0)
toks, lens = np.asarray(out.tokens), np.asarray(out.lengths)
texts = [tok.decode(response_until_stop(tok, toks[i, :lens[i]]), skip_special_tokens=True) for i in range(len(rows))]
ok = tasks.verify_many([exs[i // G] for i in range(len(rows))], texts)
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
