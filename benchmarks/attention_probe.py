"""Training attention on one GPU: orl_jax's materialized-score attention vs jax.nn.dot_product_attention (XLA and
cuDNN) at the h200 recipe's shapes, forward + backward, with the real training masks.

  python benchmarks/attention_probe.py --out attention_probe.jsonl

Cases: stage 0 (128 rows x 512 packed tokens, causal inside each example) and stage 1 (64 rows x [clean | noisy]
1024 positions, the packed block-diffusion mask). Each variant reports ms per forward+backward and the max abs
difference of its output and gradients from orl_jax's attention (rows with at least one visible key). A variant
that fails to compile or run is logged with its error and skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from timing import median_seconds  # noqa: E402

from orl_jax import runtime  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--out", default="attention_probe.jsonl")
ap.add_argument("--reps", type=int, default=10)
ap.add_argument("--small", action="store_true", help="tiny shapes (a CPU smoke run)")
args = ap.parse_args()
runtime.configure(os.path.expanduser("~/.cache/orl_jax/xla"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from orl_jax.data.pipeline import segment_mask  # noqa: E402
from orl_jax.model.attention import attention  # noqa: E402
from orl_jax.train.objectives import packed_diffusion_mask  # noqa: E402

N, K, H = 8, 4, 64


def log(**kw):
    kw |= {"device": jax.devices()[0].device_kind, "jax": jax.__version__}
    print(json.dumps(kw), flush=True)
    with open(args.out, "a") as f:
        f.write(json.dumps(kw) + "\n")


def packed_segments(rng, b, n, lo, hi):
    """[B, n] segment ids and positions of examples with lengths in [lo, hi), packed first-fit, zero-padded."""
    seg, pos = np.zeros((b, n), np.int32), np.zeros((b, n), np.int32)
    for r in range(b):
        at, s = 0, 1
        while True:
            ln = int(rng.integers(lo, hi))
            if at + ln > n:
                break
            seg[r, at:at + ln], pos[r, at:at + ln] = s, np.arange(ln)
            at, s = at + ln, s + 1
    return seg, pos


def cases(rng):
    d = 16 if args.small else 1  # --small: 1/16 of the rows, 1/4 of the lengths
    L0, lo, hi = 512 // (4 if args.small else 1), 100 // (4 if args.small else 1), 300 // (4 if args.small else 1)
    seg, _ = packed_segments(rng, 128 // d, L0, lo, hi)
    yield "stage0_causal_packed", 128 // d, L0, segment_mask(jnp.asarray(seg))
    seg, pos = packed_segments(rng, 64 // d, L0, lo, hi)
    plen = np.where(seg > 0, lo // 2, 0).astype(np.int32)  # prompts of half the shortest example
    yield "stage1_diffusion_packed", 64 // d, 2 * L0, packed_diffusion_mask(jnp.asarray(seg), jnp.asarray(pos),
                                                                           jnp.asarray(plen), 32)


def ours(q, k, v, mask):
    return attention(q, [(k, v, mask)])


def dpa(impl):
    def f(q, k, v, mask):
        return jax.nn.dot_product_attention(q, k, v, mask=mask[:, None], implementation=impl)
    return f


rng = np.random.default_rng(0)
for name, b, n, mask in cases(rng):
    kq, kk, kv, kr = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(kq, (b, n, N, H), jnp.bfloat16)
    k = jax.random.normal(kk, (b, n, K, H), jnp.bfloat16)
    v = jax.random.normal(kv, (b, n, K, H), jnp.bfloat16)
    r = jax.random.normal(kr, (b, n, N, H), jnp.bfloat16)
    seen = jnp.any(mask, axis=-1)[:, :, None, None]  # rows with a visible key

    def fwd_bwd(f):  # mask and r are arguments: closed-over arrays get constant-folded (minutes of compile)
        def loss(q, k, v, mask, r):
            seen = jnp.any(mask, axis=-1)[:, :, None, None]  # rows with a visible key
            return jnp.sum(jnp.where(seen, f(q, k, v, mask), 0).astype(jnp.float32) * r)
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))

    ref_o = jax.jit(ours)(q, k, v, mask)
    ref_g = fwd_bwd(ours)(q, k, v, mask, r)[1]
    for vname, f in (("orl_jax", ours), ("dpa_xla", dpa("xla")), ("dpa_cudnn", dpa("cudnn"))):
        try:
            o = jax.jit(f)(q, k, v, mask)
            g = fwd_bwd(f)(q, k, v, mask, r)[1]
            err_o = float(jnp.max(jnp.abs(jnp.where(seen, o.astype(jnp.float32) - ref_o.astype(jnp.float32), 0))))
            err_g = max(float(jnp.max(jnp.abs(a.astype(jnp.float32) - b_.astype(jnp.float32))))
                        for a, b_ in zip(g, ref_g))
            ms = median_seconds(fwd_bwd(f), q, k, v, mask, r, reps=args.reps) * 1e3
            log(case=name, variant=vname, ms_fwd_bwd=ms, max_abs_err_out=err_o, max_abs_err_grad=err_g,
                rows=b, length=n)
        except Exception as e:  # noqa: BLE001 - a probe: record what failed and go on
            log(case=name, variant=vname, error=f"{type(e).__name__}: {str(e)[:300]}")
