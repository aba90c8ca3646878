"""Where one decoder layer's time goes in a denoising forward: Qwen3-4B shape, batch 1, a 512-token cache, canvas 32
and 256, bf16. Each part of `qwen3._layer` is timed alone (jitted, run `--layers` times in a fori_loop over stacked
weights so launch overhead is amortized the way the real scan amortizes it), next to the whole layer and to its
roofline (weights read once at the copy bandwidth, FLOPs at 790 TFLOP/s).

  python benchmarks/layer_breakdown.py --out layer_breakdown.jsonl
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
ap.add_argument("--out", default="layer_breakdown.jsonl")
ap.add_argument("--preset", default="qwen3-4b")
ap.add_argument("--blocks", default="32,256")
ap.add_argument("--prompt", type=int, default=512)
ap.add_argument("--layers", type=int, default=36, help="repetitions per timed call (the model's layer count)")
ap.add_argument("--gemm-table", help="tuned small-M GEMM blocks (kernels/small_m_gemm/bench.py --table)")
args = ap.parse_args()
runtime.configure(os.path.expanduser("~/.cache/orl_jax/xla"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from orl_jax import params as P  # noqa: E402
from orl_jax.config import preset  # noqa: E402
from orl_jax.model import qwen3  # noqa: E402
from orl_jax.model.attention import attention, cache_mask, full_segments, self_mask  # noqa: E402
from orl_jax.model.layers import apply_rope, einsum, fused_gated_mlp, rms_norm, rope_angles  # noqa: E402

if args.gemm_table:
    from orl_jax_kernels.small_m_gemm.kernel import load_tuned

    load_tuned(args.gemm_table)

cfg = preset(args.preset)
specs = qwen3.param_specs(cfg)
params = P.init(specs, jax.random.key(0))
W = params["layers"]
D, N, K, H = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
G = N // K
REPS = args.layers


def log(**kw):
    kw |= {"device": jax.devices()[0].device_kind, "jax": jax.__version__}
    print(json.dumps(kw), flush=True)
    with open(args.out, "a") as f:
        f.write(json.dumps(kw) + "\n")


def over_layers(part):
    """part(x, w) -> x, applied with layer i's weights for i in range(REPS) (like the model's layer scan)."""
    def run(x, ws):
        return jax.lax.fori_loop(0, REPS, lambda i, x: part(x, jax.tree.map(lambda a: a[i % a.shape[0]], ws)), x)
    return jax.jit(run)


def over_layers_in_place(part):
    """The same with the matrices read in place from their stacks (cached_matmul_impl="pallas", as the model)."""
    def run(x, ws):
        def body(i, x):
            return part(x, qwen3.layer_in_place(ws, i % ws["qkv"].shape[0]))
        return jax.lax.fori_loop(0, REPS, body, x)
    return jax.jit(run)


for L in map(int, args.blocks.split(",")):
    S = args.prompt
    x = jax.random.normal(jax.random.key(1), (1, L, D), jnp.bfloat16)
    ck = jax.random.normal(jax.random.key(2), (1, S, K, H), jnp.bfloat16)
    cvis = cache_mask(jnp.zeros((1,), jnp.int32), jnp.asarray(S, jnp.int32), S, L)
    svis = self_mask(full_segments(1, L))
    cos, sin = rope_angles(S + jnp.arange(L)[None], H, cfg.rope_theta)
    q0 = jax.random.normal(jax.random.key(3), (1, L, N, H), jnp.bfloat16)
    kv0 = jax.random.normal(jax.random.key(4), (1, L, K, H), jnp.bfloat16)

    def use(x, y):  # make y an input of the next repetition (so nothing is dead code), at negligible cost
        return x + (jnp.sum(y.astype(jnp.float32)) * 1e-9).astype(x.dtype)

    def qkv_part(x, w):
        return use(x, einsum("bld,dkth->blkth", rms_norm(x, w["attn_norm"], 1e-6), w["qkv"]))

    def rope_norm_part(x, w):
        return use(x, apply_rope(rms_norm(q0 + x[..., :1, None], w["q_norm"], 1e-6), cos, sin))

    def attention_part(x, w):
        return use(x, attention(q0 + x[..., :1, None], [(ck, ck, cvis), (kv0, kv0, svis)]))

    cvis8, svis8 = cvis.astype(jnp.int8), svis.astype(jnp.int8)  # as qwen3.backbone hands them to the kernel

    def attention_pallas_part(x, w):
        return use(x, attention(q0 + x[..., :1, None], [(ck, ck, cvis8), (kv0, kv0, svis8)], "pallas"))

    def o_part(x, w):
        return use(x, einsum("blnh,nhd->bld", q0 + x[..., :1, None], w["o"]))

    def mlp_part(x, w):
        return use(x, fused_gated_mlp(rms_norm(x, w["mlp_norm"], 1e-6), w["gate_up"], w["down"]))

    def whole(x, w):
        return qwen3._layer(cfg, x, w, cos, sin, svis, (ck, ck, cvis))[0]

    def whole_pallas(x, w):
        return qwen3._layer(cfg.replace(cached_attention_impl="pallas"), x, w, cos, sin, svis8, (ck, ck, cvis8))[0]

    per_layer = sum(int(np.prod(a.shape[1:])) * 2 for a in jax.tree.leaves(W))  # bytes of one layer's weights
    roof_ms = max(per_layer / 4.3e12, 2 * per_layer / 2 * L / 790e12) * 1e3
    parts = (("qkv_gemm", qkv_part, over_layers), ("q_norm_rope", rope_norm_part, over_layers),
             ("attention", attention_part, over_layers), ("attention_pallas", attention_pallas_part, over_layers),
             ("o_gemm", o_part, over_layers), ("mlp", mlp_part, over_layers), ("whole_layer", whole, over_layers),
             ("whole_layer_pallas", whole_pallas, over_layers),
             # the small-M GEMM kernel reading each layer in place (M = L <= 64 only; larger L falls back to XLA)
             ("qkv_gemm_in_place", qkv_part, over_layers_in_place), ("o_gemm_in_place", o_part, over_layers_in_place),
             ("mlp_in_place", mlp_part, over_layers_in_place), ("whole_layer_in_place", whole, over_layers_in_place))
    for name, part, runner in parts:
        ms = median_seconds(runner(part), x, W, reps=20) * 1e3 / REPS
        log(canvas=L, part=name, ms_per_layer=ms, roofline_ms_per_layer=roof_ms)
