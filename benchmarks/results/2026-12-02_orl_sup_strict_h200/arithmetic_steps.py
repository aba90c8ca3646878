"""Session 27: how many verified arithmetic rollouts of the h200 base contain a wrong "a op b = c" line (the
verifier reads only the "####" answer, so such a line would be a verified target for L_pred). Rolls out as the
recipe's ORL rounds do (fill threshold THRESHOLD, temperature 1, 4 responses per prompt) on the arithmetic prompts
among the first N training prompts of round 0.

Run from the repository root on CPU (25-50 s), with the base package in .carry/pkg_h200_mask:
  python benchmarks/results/2026-12-02_orl_sup_strict_h200/arithmetic_steps.py 64 0.9
Output: 16 arithmetic prompts; threshold 0.9: verified 52/64, none with a wrong equation (0 of 180 wrong);
threshold 0.999: verified 59/64, none (0 of 212).
"""
import re
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
from orl_jax.train.stage2 import train_prompts  # noqa: E402

G, N, THR = 4, int(sys.argv[1]), float(sys.argv[2])
pkg = base_package.check_package(".carry/pkg_h200_mask")
r, tok = recipe.PRESETS["h200"], load_tokenizer(pkg)
cfg, params = base_package.read_package(pkg)
cfg = cfg.replace(dtype="float32", attention_impl="xla")
params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params)
exs = [e for e in train_prompts(r, tok, 256, N, 100_000) if e.task == "arithmetic"]
print("arithmetic prompts", len(exs))
ocfg = ORLConfig(group_size=G, max_new_tokens=r.eval_max_new, max_states=16, max_prompt=256)
sampler = MaskSampler(mask_token_id=cfg.mask_token_id, threshold=THR, temperature=1.0)
rows, out = rollout(params, cfg, [format_prompt(tok, e.prompt) for e in exs], jax.random.key(0), sampler, ocfg,
                    eos_token_ids=stop_token_ids(tok), pad_token_id=cfg.pad_token_id or 0)
toks, lens = np.asarray(out.tokens), np.asarray(out.lengths)
texts = [tok.decode(response_until_stop(tok, toks[i, :lens[i]]), skip_special_tokens=True) for i in range(len(rows))]
ok = tasks.verify_many([exs[i // G] for i in range(len(rows))], texts)
EQ = re.compile(r"(-?\d+)\s*([-+*/])\s*(-?\d+)\s*=\s*(-?\d+)")
ops = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b,
       "/": lambda a, b: a // b if b else None}
bad_resp = eqs = bad_eqs = 0
for text, good in zip(texts, ok):
    if not good:
        continue
    wrong = [m for m in EQ.finditer(text) if ops[m[2]](int(m[1]), int(m[3])) != int(m[4])]
    eqs += len(EQ.findall(text))
    bad_eqs += len(wrong)
    bad_resp += bool(wrong)
    if wrong and bad_resp <= 3:
        print("--- verified with a wrong step:", [w[0] for w in wrong])
        print(text[:400])
print(f"threshold {THR}: verified {sum(ok)}/{len(ok)}; of those, {bad_resp} have a wrong equation "
      f"({bad_eqs} of {eqs} equations wrong)")
