"""One round of rollouts of the h200 base package on CPU, as the recipe's ORL rounds roll out (sampled at
temperature 1, filled above a threshold, G responses per prompt): what the CPU diagnostics in benchmarks/results/
start from. Run them from the repository root; the package is kept outside git in .carry/pkg_h200_mask."""

from __future__ import annotations

import os
import sys

sys.path[:0] = [os.path.join(os.path.dirname(__file__), ".."), os.path.join(os.path.dirname(__file__), "..", "recipes")]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import train_qwendlm as recipe  # noqa: E402

from orl_jax.data import tasks  # noqa: E402
from orl_jax.data.prompt_format import decode_response, format_prompt, stop_token_ids  # noqa: E402
from orl_jax.data.tokenizer import load_tokenizer  # noqa: E402
from orl_jax.decode.samplers import MaskSampler  # noqa: E402
from orl_jax.train import base_package  # noqa: E402
from orl_jax.train.orl import ORLConfig, rollout  # noqa: E402
from orl_jax.train.stage2 import train_prompts  # noqa: E402


def load_base(path: str = ".carry/pkg_h200_mask"):
    """(the h200 preset, tokenizer, config, float32 params) of the base package, XLA attention (CPU)."""
    pkg = base_package.check_package(path)
    cfg, params = base_package.read_package(pkg)
    params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params)
    return recipe.PRESETS["h200"], load_tokenizer(pkg), cfg.replace(dtype="float32", attention_impl="xla"), params


def roll_out(r, tok, cfg, params, n_prompts: int, threshold: float = 0.9, group: int = 4, task: str | None = None,
             max_states: int = 16):
    """Round 0's first n_prompts training prompts (only those of `task` if given), group responses each:
    (examples, rows, GenerateOutput with capture, response texts, verified per response, the sampler)."""
    exs = [e for e in train_prompts(r, tok, 256, n_prompts, 100_000) if task is None or e.task == task]
    ocfg = ORLConfig(group_size=group, max_new_tokens=r.eval_max_new, max_states=max_states, max_prompt=256)
    sampler = MaskSampler(mask_token_id=cfg.mask_token_id, threshold=threshold, temperature=1.0)
    rows, out = rollout(params, cfg, [format_prompt(tok, e.prompt) for e in exs], jax.random.key(0), sampler, ocfg,
                        eos_token_ids=stop_token_ids(tok), pad_token_id=cfg.pad_token_id or 0)
    toks, lens = np.asarray(out.tokens), np.asarray(out.lengths)
    texts = [decode_response(tok, toks[i, :lens[i]]) for i in range(len(rows))]
    ok = tasks.verify_many([exs[i // group] for i in range(len(rows))], texts)
    return exs, rows, out, texts, ok, sampler
