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

sys.path[:0] = [".", "recipes"]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import train_qwendlm as recipe  # noqa: E402

from orl_jax.data import tasks  # noqa: E402
from orl_jax.data.prompt_format import format_prompt, response_until_stop, stop_token_ids  # noqa: E402
from orl_jax.data.tokenizer import load_tokenizer  # noqa: E402
from orl_jax.decode.samplers import MaskSampler  # noqa: E402
from orl_jax.train import base_package  # noqa: E402
from orl_jax.train.orl import ORLConfig, rollout  # noqa: E402
from orl_jax.train.replay import build_replay  # noqa: E402
from orl_jax.train.stage2 import train_prompts  # noqa: E402

G = 4
pkg = base_package.check_package(".carry/pkg_h200_mask")
r, tok = recipe.PRESETS["h200"], load_tokenizer(pkg)
cfg, params = base_package.read_package(pkg)
cfg = cfg.replace(dtype="float32", attention_impl="xla")
params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params)
exs = train_prompts(r, tok, 256, 16, 100_000)  # round 0's prompts
ocfg = ORLConfig(group_size=G, max_new_tokens=r.eval_max_new, max_states=16, max_prompt=256)
sampler = MaskSampler(mask_token_id=cfg.mask_token_id, threshold=0.9, temperature=1.0)
rows, out = rollout(params, cfg, [format_prompt(tok, e.prompt) for e in exs], jax.random.key(0), sampler, ocfg,
                    eos_token_ids=stop_token_ids(tok), pad_token_id=cfg.pad_token_id or 0)
toks, lens = np.asarray(out.tokens), np.asarray(out.lengths)
texts = [tok.decode(response_until_stop(tok, toks[i, :lens[i]]), skip_special_tokens=True) for i in range(len(rows))]
ok = tasks.verify_many([exs[i // G] for i in range(len(rows))], texts)
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
