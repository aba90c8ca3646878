"""The tail of a DiffusionGemma denoising step at full size, alone: the LM head's bf16 output [1, 256, 262144] ->
float32 soft-cap -> UniformSampler.step (temperature, statistics, draw, acceptance, re-noise) -> the soft embedding
z = p @ E * sqrt(D) that the next step's self-conditioning reads. What generate() runs after each forward.

Each variant sets trace-time switches (e.g. orl_jax.decode.samplers.UNNORMALIZED_PROBS), is traced afresh and timed as
--steps tails in one device loop (each input depends on the previous output, nothing hoisted), with the compiler
options generate() gives DiffusionGemma. One step of each variant is compared with the first variant's: the
argmax canvas, the accepted positions, the proposal, entropies and z.

  python benchmarks/dg_sampler_tail.py --out tail.jsonl [--variants benchmarks/dg_sampler_tail_variants.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

ap = argparse.ArgumentParser()
ap.add_argument("--out", default="dg_sampler_tail.jsonl")
ap.add_argument("--preset", default="diffusiongemma-26b-a4b")
ap.add_argument("--canvas", type=int, default=256)
ap.add_argument("--steps", type=int, default=16, help="tails per device loop")
ap.add_argument("--vocab", type=int, help="override the preset's vocabulary (a small CPU check)")
ap.add_argument("--hidden", type=int, help="override the preset's hidden size (a small CPU check)")
ap.add_argument("--variants", default=os.path.join(os.path.dirname(__file__), "dg_sampler_tail_variants.json"),
                help="JSON list of {'name':, 'set': {'package.module.NAME': value}}; the first is the reference")
args = ap.parse_args()
if args.canvas < 1 or args.steps < 1:
    ap.error(f"--canvas and --steps must be >= 1, got {args.canvas}, {args.steps}")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from bench_io import switched  # noqa: E402
from timing import median_seconds  # noqa: E402

from orl_jax import runtime  # noqa: E402
from orl_jax.decode.residual import soft_embed  # noqa: E402
from orl_jax.decode.samplers import UniformSampler  # noqa: E402
from orl_jax.decode.softcapped import SoftCapped  # noqa: E402
from orl_jax.diffusion_gemma_config import DG_PRESETS  # noqa: E402

cfg = DG_PRESETS[args.preset].replace(dtype="bfloat16")
cfg = cfg.replace(vocab_size=args.vocab or cfg.vocab_size, hidden_size=args.hidden or cfg.hidden_size)
V, D, L = cfg.vocab_size, cfg.hidden_size, args.canvas
sampler = UniformSampler(confidence=0.0)
with open(args.variants) as fh:
    variants = json.load(fh)


def log(**row):
    row.update(device=jax.devices()[0].device_kind, jax=jax.__version__)
    print(json.dumps(row), flush=True)
    with open(args.out, "a") as fh:
        fh.write(json.dumps(row) + "\n")


def tail(embed, raw, canvas, state, key):
    logits = SoftCapped(raw, cfg.final_logit_softcapping)  # as generate() hands it over (softcapped.py)
    out = sampler.step(logits, canvas, state, key, 3, jnp.ones((raw.shape[0],), bool))
    return out, soft_embed({"embed": embed}, cfg, out.probs, out.probs_scale)


def loop(embed, raw, canvas, state, key):
    def body(_, carry):
        raw, canvas = carry
        out, z = tail(embed, raw, canvas, state, key)
        never = (jnp.max(z) == jnp.inf) | (jnp.max(out.canvas) < 0)  # a test that is never true: nothing hoisted
        return raw + never.astype(raw.dtype), out.canvas

    return jax.lax.fori_loop(0, args.steps, body, (raw, canvas))[0]


kd = jax.random.split(jax.random.key(0), 4)
embed = (0.02 * jax.random.normal(kd[0], (V, D), jnp.float32)).astype(jnp.bfloat16)
raw = (3.0 * jax.random.normal(kd[1], (1, L, V), jnp.float32)).astype(jnp.bfloat16)
raw = raw.at[0, : L // 2, 17].set(40.0)  # half the canvas nearly decided (low entropy, accepted)
canvas, state = sampler.init(kd[2], 1, L, cfg)
ref = None
for v in variants:
    with switched(v.get("set", {})):
        jax.clear_caches()
        one = jax.jit(tail, compiler_options=runtime.DG_COMPILER_OPTIONS)
        out, z = jax.block_until_ready(one(embed, raw, canvas, state, kd[3]))
        f = jax.jit(loop, compiler_options=runtime.DG_COMPILER_OPTIONS)
        ms = median_seconds(lambda: f(embed, raw, canvas, state, kd[3]), reps=7) * 1e3 / args.steps
    got = {"argmax": out.state["argmax"], "canvas": out.canvas, "accept": out.resolved,
           "entropy": out.entropy, "z": z.astype(jnp.float32)}
    if ref is None:
        ref = got
        cmp = {}
    else:
        cmp = {k + "_equal": float(jnp.mean(got[k] == ref[k])) for k in ("argmax", "canvas", "accept")}
        cmp["entropy_max_abs"] = float(jnp.max(jnp.abs(got["entropy"] - ref["entropy"])))
        cmp["z_rel_l2"] = float(jnp.linalg.norm(got["z"] - ref["z"]) / jnp.linalg.norm(ref["z"]))
    log(what="tail", name=v["name"], set=v.get("set", {}), ms=ms, steps=args.steps, canvas=L, vocab=V,
        accepted=int(np.asarray(out.resolved).sum()), **cmp)
