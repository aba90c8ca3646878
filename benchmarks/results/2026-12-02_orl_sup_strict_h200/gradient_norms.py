"""Session 27: one ORL update's gradient on the h200 base beside stage 1's. The norm of the gradient of each ORL term
(L_pred, AEC x 10, the AR term on the replayed clean rows; one round of rollouts of P prompts x 4 at fill 0.9,
temperature 1) and of stage 1's conversion objective on two batches of 8 ground-truth train rows, and each one's
cosine with the first stage-1 batch's, over all parameters and per group.

Run from the repository root on CPU (~3 minutes for P = 4), with the base package in .carry/pkg_h200_mask:
  python benchmarks/results/2026-12-02_orl_sup_strict_h200/gradient_norms.py 4
Output of that run (the README has the numbers): the two stage-1 batches' gradients are as far from parallel as
any ORL term's (cosines within +-0.05 everywhere), so this cosine says nothing at this point; L_pred's gradient
norm is 4-8x stage 1's (layers 12.2 against 1.5 / 2.8).
"""
import sys

sys.path[:0] = ["benchmarks"]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from base_rollouts import load_base, roll_out  # noqa: E402

from orl_jax.train.objectives import DiffusionObjective  # noqa: E402
from orl_jax.train.orl import make_orl_loss, pad_replay  # noqa: E402
from orl_jax.train.orl_losses import ORLLossConfig  # noqa: E402
from orl_jax.train.replay import build_replay  # noqa: E402
from orl_jax.train.stages import DIFFUSION_BATCH_KEYS, conversion_data, diffusion_loss_fn  # noqa: E402

r, tok, cfg, params = load_base()
exs, rows, out, texts, ok, sampler = roll_out(r, tok, cfg, params, int(sys.argv[1]), max_states=r.orl_states)
b = build_replay(rows, out, ok, block_length=cfg.block_length, pad_id=cfg.pad_token_id or 0,
                 prefix_attention=cfg.prefix_attention, mask_token_id=cfg.mask_token_id, max_states=r.orl_states,
                 rng=np.random.default_rng(0))
n = len(rows)
arrays = pad_replay(b, n, b.tokens.shape[1], len(b.step))
print("verified", np.mean(ok), "states", len(b.step), "width", b.tokens.shape[1])
key = jax.random.key(1)


def grad_of(loss_cfg):
    fn = make_orl_loss(cfg, sampler, n, loss_cfg)
    return jax.block_until_ready(jax.jit(jax.grad(lambda p: fn(p, arrays, key)[0]))(params))


base = dict(l_anchor=0.0, l_aec=0.0, ar_weight=0.0)
g = {"L_pred": grad_of(ORLLossConfig(**base)),
     "L_pred+AEC(10)": grad_of(ORLLossConfig(**(base | {"l_aec": 10.0}))),
     "L_pred+AR(1)": grad_of(ORLLossConfig(**(base | {"ar_weight": 1.0})))}
print("orl grads done", flush=True)
g["AEC(10)"] = jax.tree.map(lambda a, c: a - c, g["L_pred+AEC(10)"], g["L_pred"])
g["AR(1)"] = jax.tree.map(lambda a, c: a - c, g["L_pred+AR(1)"], g["L_pred"])
obj = DiffusionObjective(block_length=r.block_length, ar_weight=r.ar_weight)
sup_fn = diffusion_loss_fn(obj, cfg)
data = iter(conversion_data(r, tok, 5))
for i in range(2):
    batch = {k: jnp.asarray(v[:8]) for k, v in next(data).items() if k in DIFFUSION_BATCH_KEYS}
    grad = jax.jit(jax.grad(lambda p, batch=batch, i=i: sup_fn(p, batch, jax.random.key(7 + i))[0]))
    g[f"stage1 batch {i}"] = jax.block_until_ready(grad(params))
    print("stage 1 grad", i, flush=True)


def flat(t, keep=lambda path: True):
    leaves = [v.ravel() for path, v in jax.tree_util.tree_flatten_with_path(t)[0] if keep(jax.tree_util.keystr(path))]
    return jnp.concatenate(leaves)


groups = {"all": lambda p: True, "embed": lambda p: "embed" in p, "layers": lambda p: "layers" in p,
          "adapter": lambda p: "adapter" in p}
for name, keep in groups.items():
    ref = flat(g["stage1 batch 0"], keep)
    if ref.size == 0:
        continue
    for k, v in g.items():
        x = flat(v, keep)
        cos = float(jnp.dot(x, ref) / (jnp.linalg.norm(x) * jnp.linalg.norm(ref) + 1e-30))
        print(f"{name:8s} {k:18s} |g| {float(jnp.linalg.norm(x)):9.4f}  cos with stage 1 batch 0 {cos:+.3f}")
