"""The params DiffusionGemma's `generate()` runs fastest with: `inference_params` and the transforms it applies.

Inference only: training, export (convert/hf.save_hf refuses these params) and expert-parallel meshes take the
model's own params. Each transform keeps the model's arithmetic (up to rounding; fold_attention_norms up to its eps,
see there); model/diffusion_gemma.py's `_layer` reads which ones were applied from the params themselves (the
fused 5-D expert stacks, the missing norm vectors).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from orl_jax.diffusion_gemma_config import DiffusionGemmaConfig
from orl_jax.model.diffusion_gemma import TRANSPOSES, moe_impl
from orl_jax.model.layerwise import map_layers
from orl_jax.model.moe import fusable, fuse_gate_up

# inference_params folds a bf16 / fp16 model's attention-input RMSNorms into the q/k/v projections
# (`fold_attention_norms`): each layer then feeds the residual stream straight to the projection's GEMM, one XLA
# fusion (~2 us on the layer's dependency chain) fewer. An approximation below the dtype's rounding: the head norms'
# eps meets a rescaled mean square (see there). Read by inference_params. Both folds together, on an H200 (the 26B,
# alternating in one process): the forward 14.197 against 14.375 ms, generate() 730.6 against 739.4 ms
# (benchmarks/results/2026-12-05_dg_norm_folds_h200.md).
FOLD_ATTENTION_NORMS = True
FOLD_SCALE = 16.0  # fold_attention_norms' c: a power of two (exact in any float format), small enough for fp16
# ... and the feed-forward input norms (`fold_ffw_norms`): the dense MLP's, the router's and the experts' norm
# weights go into their first matrices, each layer computes one per-token factor beside its router GEMM (off the
# dependency chain) and the three normed copies of x (one XLA fusion, ~3 us on the chain) are gone. Read by
# inference_params.
FOLD_FFW_NORMS = True
# ... and the attention output and dense-down projections stored as [out, in] ("o_t" [L, D, N, H], "down_t" [L, D,
# F]; `transposed_projections`): alone, XLA's GEMM (cuBLAS) ran o's shape in 16.4 against 18.0 us and dense down's in
# 13.6 against 14.2 with the weight as [N, K] (benchmarks/results/2026-12-05_dg_softcap_masked_h200.md). In the 26B
# forward on an H100: 19.310 against 19.342 ms at 48 per loop, -0.029 ms, faster in 6 of 6 alternating rounds, the
# logits bitwise equal (benchmarks/results/2026-12-05_dg_token_order_h100.md). "auto": on a GPU (a layout for cuBLAS;
# elsewhere the model's params stay as they are); True / False: always / never. Read by inference_params.
TRANSPOSED_PROJECTIONS: bool | str = "auto"
# The norm vectors each fold drops from the layer stacks (what `applied` reads).
FOLDED = {"attention": ("attn_norm",), "ffw": ("mlp_norm", "router_scale", "moe_norm")}


def fused_expert_params(params: dict, donate: bool = False) -> dict:
    """params with both expert gate/up stacks in moe.fuse_gate_up's layout, so that passes with moe_impl "pallas"
    run each layer's experts in one launch (kernels/grouped_gemm/mlp.py) instead of two grouped GEMMs and XLA's
    activation: on an H200 the 26B's denoising forward took 14.96-15.01 ms against 15.17-15.20, alternating in one
    process on two machines (benchmarks/results/2026-12-04_dg_fused_expert_mlp_h200.md). A new copy of those stacks
    (the 26B: 30 GB; the old ones go when the caller drops them), or with donate those stacks themselves, rewritten
    in place (`params`' stacks are then consumed); inference only: training, export and the other moe_impls take
    the model's layout (moe.experts_mlp refuses it there)."""
    return params | {t: params[t] | {"experts_gate_up": fuse_gate_up(params[t]["experts_gate_up"], donate)}
                     for t in ("sliding", "full")}


_fold = jax.jit(lambda w, g: (g * w).astype(w.dtype))  # w times float32 g (broadcast), rounded once


def _fold_expert_layer(w, g):
    """One layer of an expert gate/up stack [E, ..., D, N] times g [D] along D, rounded once."""
    return (g.reshape((1,) * (w.ndim - 2) + (-1, 1)) * w).astype(w.dtype)


def fold_attention_norms(params: dict) -> dict:
    """params with each layer's attention-input RMSNorm folded into its q/k/v projection: W'[d] = c attn_norm[d] W[d]
    (rounded once to the weight dtype; c = FOLD_SCALE), "attn_norm" dropped, so that `_layer` projects the residual
    stream x itself.

    Why it holds: RMSNorm(x) * w @ W = r(x) / c * (x @ W') with r(x) = rsqrt(mean(x^2) + eps) one scalar per token,
    and every projected head is RMS-normed before use (q and k with their weights, v without: Gemma 4), which removes
    a positive per-token factor. Exact up to rounding and the head norms' eps: a head y = x @ W' has mean square
    m c^2 / r^2 where the model's has m, so the norm's eps weighs r^2 / c^2 as much against it, a relative change of
    at most ~eps / (2 m) in each head's scale (the power of two c keeps r^2 / c^2 small where the residual stream is
    small). Inference only: training and export take the model's layout (its attn_norm)."""
    out = dict(params)
    for t in ("sliding", "full"):
        layers = dict(params[t])
        if missing := set(FOLDED["attention"]) - set(layers):
            raise ValueError(f"fold_attention_norms: params[{t!r}] lacks {sorted(missing)} (already folded?)")
        name = "qkv" if "qkv" in layers else "qk"
        w, norm = layers[name], layers.pop("attn_norm")  # [n, D, K, slots, H], [n, D]
        layers[name] = _fold(w, FOLD_SCALE * norm.astype(jnp.float32)[:, :, None, None, None])
        out[t] = layers
    return out


def fold_ffw_norms(params: dict, donate_experts: bool = False) -> dict:
    """params with each layer's three feed-forward input norms folded into the matrices they feed: mlp_norm into
    the dense gate_up, router_scale * D^-1/2 into the router, moe_norm into the experts' gate/up (either layout;
    each rounded once to the weight dtype); the three vectors dropped. `_layer` then gives the dense MLP, the
    router and the experts the residual stream x itself and multiplies their products by each token's
    r(x) = rsqrt(mean(x^2) + eps): RMSNorm(x) * w @ W = r(x) * (x @ (w W)) exactly, so this is the model up to
    rounding. donate_experts: the expert gate/up stacks are the caller's to give up (inference_params' own fused
    copies): folded in place, no second 30 GB copy for the 26B (layerwise.map_layers: one layer at a time, in
    place either way). Inference only, as fold_attention_norms."""
    out = dict(params)
    for t in ("sliding", "full"):
        layers = dict(params[t])
        if missing := set(FOLDED["ffw"]) - set(layers):
            raise ValueError(f"fold_ffw_norms: params[{t!r}] lacks {sorted(missing)} (already folded?)")
        mlp, scale, moe_norm = (layers.pop(n).astype(jnp.float32) for n in FOLDED["ffw"])
        layers["gate_up"] = _fold(layers["gate_up"], mlp[:, :, None, None])
        layers["router"] = _fold(layers["router"], scale[:, :, None] * layers["router"].shape[1] ** -0.5)
        layers["experts_gate_up"] = map_layers(layers["experts_gate_up"], _fold_expert_layer, moe_norm,
                                               donate=donate_experts)
        out[t] = layers
    return out


OUTPUT_PROJECTIONS = ("o", "down")
_transpose = jax.jit(jnp.transpose, static_argnums=1)


def transposed_projections(params: dict, names: tuple[str, ...] = OUTPUT_PROJECTIONS) -> dict:
    """params with each layer's `names` projections (those the layer has) stored as [out, in] under NAME + "_t", in
    diffusion_gemma.TRANSPOSES' axis order, which `diffusion_gemma._layer` multiplies instead (the same products and
    sums; only the operands' layout differs). After any norm fold. Inference only, as the folds."""
    if unknown := set(names) - set(TRANSPOSES):
        raise ValueError(f"transposed_projections: unknown names {sorted(unknown)} (of {sorted(TRANSPOSES)})")
    out = dict(params)
    for t in ("sliding", "full"):
        layers = dict(params[t])
        present = [n for n in names if n in layers]
        if not present:
            raise ValueError(f"transposed_projections: params['{t}'] has none of {list(names)} (transposed already?)")
        for n in present:
            layers[n + "_t"] = _transpose(layers.pop(n), TRANSPOSES[n])
        out[t] = layers
    return out


def applied(params) -> list[str]:
    """Which of inference_params' transforms `params` carry, in words ([] for the model's own params)."""
    layers = params.get("sliding") if isinstance(params, dict) else None
    if not isinstance(layers, dict):
        return []
    done = ["fused expert layout"] if getattr(layers.get("experts_gate_up"), "ndim", 4) == 5 else []
    done += [f"folded norms {list(vectors)}" for vectors in FOLDED.values() if not set(vectors) & set(layers)]
    return done + [f"transposed {n}" for n in TRANSPOSES if n + "_t" in layers]


def inference_params(params: dict, cfg: DiffusionGemmaConfig, donate: bool = False) -> dict:
    """The params generate() runs fastest with on one device: fused_expert_params where moe_impl resolves to
    "pallas" (on a GPU) and the expert shapes fit the fused kernel's tiles (moe.fuse_gate_up); else, and for expert
    stacks sharded over several devices (expert parallelism keeps the model's layout), params unchanged. With
    FOLD_ATTENTION_NORMS / FOLD_FFW_NORMS, a bf16 / fp16 model's params also go through `fold_attention_norms` /
    `fold_ffw_norms` (any backend; float32 models stay as they are), and under TRANSPOSED_PROJECTIONS (on a GPU by
    default, any dtype) through `transposed_projections`.
    Memory: the expert stacks are rewritten one layer at a time (layerwise.map_layers), in a copy of each, or with
    donate in `params`' own buffers: `params` is then consumed (its expert gate/up stacks deleted) and the 26B (50.5
    GB) reaches this layout within a 56 GB peak on an H100 (benchmarks/results/2026-12-05_dg_long_tiles_h100.md),
    where a copy of its stacks needs ~81 (more than an 80 GB GPU holds)."""
    if TRANSPOSED_PROJECTIONS not in (True, False, "auto"):
        raise ValueError(f"TRANSPOSED_PROJECTIONS must be True, False or 'auto', got {TRANSPOSED_PROJECTIONS!r}")
    stack = params["sliding"]["experts_gate_up"]
    sharded = len(getattr(stack, "sharding", None) and stack.sharding.device_set or ()) > 1
    low = cfg.dtype in ("bfloat16", "float16")
    if FOLD_ATTENTION_NORMS and low and "attn_norm" in params["sliding"]:
        params = fold_attention_norms(params)
    fuse = moe_impl(cfg) == "pallas" and fusable(cfg.hidden_size, cfg.moe_intermediate_size) and not sharded
    if fuse:
        params = fused_expert_params(params, donate)
    if FOLD_FFW_NORMS and low and "moe_norm" in params["sliding"]:
        params = fold_ffw_norms(params, donate_experts=fuse or donate)  # fused stacks: this function's own
    transpose = jax.default_backend() == "gpu" if TRANSPOSED_PROJECTIONS == "auto" else TRANSPOSED_PROJECTIONS
    if transpose and not sharded:
        params = transposed_projections(params)
    return params
