"""What keeps a block open: at every denoising state of a mask-family QwenDLM's own decoding, is each still-masked
position's argmax already the token the decoding ends up filling there ("final"), and is it confident enough to be
filled now? "final" is agreement with the model's own output, not correctness against a reference answer.

Why: TPF is set by the steps a block needs before its last position clears the fill threshold. If most positions
already predict their final token long before they are confident, filling them sooner would leave the output as it
is (approximately: a fill changes later contexts) at a higher TPF; what a model must learn for that is confidence
on those positions and not on the others (what ORL's L_pred and AEC aim at).

How: the held-out examples of a recipe preset are decoded with generate(capture=True) at one fill threshold and no
residual (the base's decoding), every captured state is replayed (train/replay.py: the same logits the engine
computed, tests/test_replay.py) against the block's final tokens, and the shares are counted over the states'
unresolved positions inside the response: at the first step of each block, and over every step.

  python benchmarks/block_confidence.py --package .carry/pkg_h200_mask --preset h200 --examples 256 \
      --threshold 0.999 --out confidence.json
CPU is enough for the h200 preset's 27 M-parameter base (~15 minutes for 256 examples on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "recipes"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from orl_jax.decode.residual import NoResidual  # noqa: E402
from orl_jax.decode.samplers import MaskSampler  # noqa: E402
from orl_jax.train.evaluate import evaluate  # noqa: E402
from orl_jax.train.replay import build_replay, policy_logits, replay_logits  # noqa: E402


def _shares(final, pmax, m, thr) -> dict:
    """Shares of the unresolved positions m. With greedy fills "not final, confident" is 0: a confident position is
    filled with its argmax at that step."""
    return {"unresolved positions": int(m.sum()),
            "argmax is the final token": float(final[m].mean()),
            "confident (p_max > threshold)": float((pmax[m] > thr).mean()),
            "final, not confident": float((final & (pmax <= thr))[m].mean()),
            "not final, confident": float((~final & (pmax > thr))[m].mean()),
            "final, p_max > 0.9": float((final & (pmax > 0.9))[m].mean()),
            "not final, p_max > 0.9": float((~final & (pmax > 0.9))[m].mean())}


def analyze(params, cfg, tok, examples, *, threshold: float, max_steps: int, max_new_tokens: int,
            batch: int = 32) -> dict:
    """The counts described in the module docstring, plus the decoding's accuracy and TPF: the recipe's evaluation
    (train/evaluate.py) in batches of `batch`, with capture, its states replayed as each batch finishes."""
    if cfg.noise != "mask":
        raise ValueError(f"block_confidence reads [MASK] positions: cfg.noise must be 'mask', got {cfg.noise!r}")
    sampler = MaskSampler(mask_token_id=cfg.mask_token_id, threshold=threshold)
    final, pmax, unres, first = [], [], [], []

    def replay(rows, out, n):
        for b in range(n):  # one response per replay: a row is as wide as its prompt, answer and states
            rb = build_replay(rows, out, [i == b for i in range(len(rows))], block_length=cfg.block_length,
                              pad_id=0, mask_token_id=cfg.mask_token_id)
            lg = policy_logits(sampler, replay_logits(params, cfg, NoResidual(), rb))
            final.append(np.asarray(jnp.argmax(lg, -1)) == rb.targets)
            pmax.append(np.asarray(jnp.max(jax.nn.softmax(lg, axis=-1), -1)))
            unres.append(rb.unresolved & rb.valid)
            first.append(rb.prev < 0)

    row = evaluate(params, cfg, tok, examples, method="base", setting="-", max_new_tokens=max_new_tokens,
                   batch_size=batch, sampler=sampler, max_steps=max_steps, residual=NoResidual(), capture=True,
                   on_output=replay)
    final, pmax, unres, first = (np.concatenate(x) for x in (final, pmax, unres, first))
    m1 = unres[first]
    return {"examples": len(examples), "threshold": threshold, "max_steps": max_steps,
            "accuracy": row.accuracy, "tpf": row.tpf,
            "blocks": int(first.sum()), "denoising steps per block": float(len(first) / max(first.sum(), 1)),
            "first step of a block": _shares(final[first], pmax[first], m1, threshold),
            "every step": _shares(final, pmax, unres, threshold),
            "per block at its first step": {
                "positions to fill": float(m1.sum(1).mean()),
                "argmax is the final token": float((final[first] & m1).sum(1).mean()),
                "confident": float(((pmax[first] > threshold) & m1).sum(1).mean())}}


def main(argv=None) -> dict:
    import train_qwendlm as recipe

    from orl_jax.data.tokenizer import load_tokenizer
    from orl_jax.train import base_package, stages

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--package", required=True, help="a base package (recipes/train_qwendlm.py --export-package)")
    ap.add_argument("--preset", default="h200", choices=sorted(recipe.PRESETS), help="whose held-out examples")
    ap.add_argument("--examples", type=int, default=256)
    ap.add_argument("--threshold", type=float, default=0.999)
    ap.add_argument("--max-steps", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0, help="the recipe's --seed (held-out examples: seed + 7)")
    ap.add_argument("--out", help="write the result here as JSON")
    args = ap.parse_args(argv)
    if args.examples <= 0:
        ap.error(f"--examples must be positive, got {args.examples}")
    if not 0 < args.threshold <= 1:
        ap.error(f"--threshold must be in (0, 1], got {args.threshold}")
    if args.max_steps <= 0:
        ap.error(f"--max-steps must be positive, got {args.max_steps}")
    try:
        pkg = base_package.check_package(args.package)
    except ValueError as e:
        ap.error(str(e))
    r = recipe.PRESETS[args.preset]
    tok = load_tokenizer(pkg)
    cfg, params = base_package.read_package(pkg)
    cfg = cfg.replace(dtype="float32", attention_impl="xla")  # float32 on any host
    params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params)
    examples = stages.heldout_examples(r, tok, args.seed + 7)[:args.examples]
    res = analyze(params, cfg, tok, examples, threshold=args.threshold, max_steps=args.max_steps,
                  max_new_tokens=r.eval_max_new)
    res |= {"package": str(pkg), "preset": args.preset}
    text = json.dumps(res, indent=1)
    if args.out:
        tmp = f"{args.out}.tmp"
        with open(tmp, "w") as f:
            f.write(text + "\n")
        os.replace(tmp, args.out)
    print(text)
    return res


if __name__ == "__main__":
    main()
