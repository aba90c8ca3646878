"""Qwen3 decoder as a pure function of (params, tokens).

Architecture (matches transformers' Qwen3ForCausalLM): token embedding; per layer pre-RMSNorm -> GQA attention
with RMSNorm on each q and k head before RoPE (rotate-half layout, theta from config), no biases -> residual;
pre-RMSNorm -> SwiGLU MLP -> residual; final RMSNorm; LM head tied to the embedding or separate.

Differences from the HF reference, all layout-only: projections are stored as einsum operands instead of
nn.Linear [out, in], with q/k/v fused into one [D, K, G+2, H] weight and gate/up into one [D, 2, F] weight; the
layers are stacked along a leading axis and run under `lax.scan` (one compiled layer body, so compile time does
not grow with depth); attention reads the KV cache and the current tokens as two parts of one softmax, with
visibility masks from model/attention.py (causal, block-causal, canvas over a cached prefix) instead of HF's
causal-only mask. Sliding-window layers and attention biases (absent in Qwen3) are not supported.

The adapter g_phi of QwenDLM (RMSNorm -> gated MLP -> added to the token embedding) is declared here so that
one param tree covers the backbone and its adapter; model/qwendlm.py uses it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from orl_jax.config import ModelConfig, kernel_choice
from orl_jax.model.attention import (
    attention,
    attention_normed,
    cache_mask,
    causal_segments,
    kernel_masks,
    self_mask,
)
from orl_jax.model.cache import KVCache
from orl_jax.model.layers import einsum, fused_gated_mlp, gated_mlp, qk_norm_rope, rms_norm, rope_angles
from orl_jax.model.streamed import StackedWeight, pack_vectors, unpack_vectors, vector_offsets
from orl_jax.params import ParamSpec, ones, zeros
from orl_jax.sharding import constrain

ACTIVATION_AXES = ("batch", "length", None)  # the residual stream [B, L, D]: rows over the data axes, D whole
MATRICES = ("qkv", "o", "gate_up", "down")  # the per-layer weights multiplied by `einsum`
# Cached passes of at most FUSED_QK_MAX_TOKENS tokens (block decoding) with the Pallas attention: the q/k norms and
# RoPE inside the attention kernel (model/attention.attention_normed), one launch per layer fewer than the norm
# kernel + attention. A Qwen3-4B block-32 step: 3.38-3.41 against 3.44-3.48 ms (while loop), 427 -> 391 kernels
# (benchmarks/results/2026-12-03_engine_launch_tax_h200.md). Longer passes (canvas 256) keep the two kernels: their
# attention blocks group the heads, which the normed entry does not take.
FUSED_QK_ATTENTION = True
FUSED_QK_MAX_TOKENS = 64


def param_specs(cfg: ModelConfig) -> dict:
    V, D, N, K, H, F, Ly = (cfg.vocab_size, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                            cfg.intermediate_size, cfg.num_layers)
    dt = cfg.jnp_param_dtype
    specs = {
        "embed": ParamSpec((V, D), dt, ("vocab", "embed")),
        "layers": {
            "attn_norm": ParamSpec((Ly, D), dt, ("layers", "embed"), ones),
            # q, k, v as one weight grouped by kv head: [.., k, t, h] holds q heads k*G .. k*G+G-1 at t < G, then
            # k at t = G and v at t = G+1. One GEMM per layer, and a tensor-parallel split over kv heads keeps
            # each group's q, k and v together.
            "qkv": ParamSpec((Ly, D, K, N // K + 2, H), dt, ("layers", "embed", "kv_heads", "qkv", "head_dim")),
            "o": ParamSpec((Ly, N, H, D), dt, ("layers", "heads", "head_dim", "embed")),
            "q_norm": ParamSpec((Ly, H), dt, ("layers", "head_dim"), ones),
            "k_norm": ParamSpec((Ly, H), dt, ("layers", "head_dim"), ones),
            "mlp_norm": ParamSpec((Ly, D), dt, ("layers", "embed"), ones),
            "gate_up": ParamSpec((Ly, D, 2, F), dt, ("layers", "embed", "gate_up", "mlp")),
            "down": ParamSpec((Ly, F, D), dt, ("layers", "mlp", "embed")),
        },
        "final_norm": ParamSpec((D,), dt, ("embed",), ones),
    }
    if not cfg.tie_word_embeddings:
        specs["lm_head"] = ParamSpec((V, D), dt, ("vocab", "embed"))
    if cfg.has_adapter:
        A = cfg.adapter_hidden
        specs["adapter"] = {
            "norm": ParamSpec((D,), dt, ("embed",), ones),
            "gate": ParamSpec((D, A), dt, ("embed", "adapter")),
            "up": ParamSpec((D, A), dt, ("embed", "adapter")),
            "down": ParamSpec((A, D), dt, ("adapter", "embed"), zeros),  # zero: starts as the AR model
        }
    return specs


def check_tokens(tokens, cfg: ModelConfig, name: str = "tokens") -> None:
    """Rank, dtype and (for concrete arrays) vocabulary range of a [B, L] token array."""
    if not hasattr(tokens, "shape") or not hasattr(tokens, "dtype"):
        raise TypeError(f"{name} must be an integer array of shape [batch, length], got {type(tokens).__name__}")
    if tokens.ndim != 2:
        raise ValueError(f"{name} must have shape [batch, length], got shape {tuple(tokens.shape)}")
    if not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise TypeError(f"{name} must have an integer dtype, got {tokens.dtype}")
    if tokens.shape[0] == 0 or tokens.shape[1] == 0:
        raise ValueError(f"{name} must be non-empty, got shape {tuple(tokens.shape)}")
    try:
        t = np.asarray(tokens)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return  # traced: values are checked by the un-jitted entry points
    lo, hi = int(t.min()), int(t.max())
    if lo < 0 or hi >= cfg.vocab_size:
        bad = lo if lo < 0 else hi
        raise ValueError(f"{name} contains id {bad}, outside the vocabulary [0, {cfg.vocab_size})")


def adapter(params: dict, cfg: ModelConfig, z: jax.Array) -> jax.Array:
    """g_phi(z): RMSNorm -> gated MLP; z [B, L, D] (the pre-adapter residual) -> [B, L, D]."""
    h = rms_norm(z.astype(cfg.jnp_dtype), params["norm"], cfg.rms_norm_eps)
    return gated_mlp(h, params["gate"], params["up"], params["down"], cfg.adapter_act)


def embed(params: dict, cfg: ModelConfig, tokens: jax.Array, residual: jax.Array | None = None) -> jax.Array:
    """Token embedding [B, L, D], plus g_phi(residual) when a residual is given."""
    x = jnp.take(params["embed"], tokens, axis=0).astype(cfg.jnp_dtype)  # [B, L, D]
    if residual is not None:
        if not cfg.has_adapter:
            raise ValueError("residual was given but the model has no adapter (ModelConfig.adapter_hidden=0)")
        x = x + adapter(params["adapter"], cfg, residual)
    return x


def cached_attention_impl(cfg) -> str:
    """cfg.cached_attention_impl (a ModelConfig's or DiffusionGemmaConfig's) with "auto" resolved
    (config.kernel_choice)."""
    return kernel_choice(cfg.cached_attention_impl, "pallas", "orl_jax")


def _layer(cfg: ModelConfig, x, w, cos, sin, self_vis, cache_part):
    eps = cfg.rms_norm_eps
    h = rms_norm(x, w["attn_norm"], eps)
    b, l, _ = x.shape
    g = cfg.num_heads // cfg.num_kv_heads
    qkv = einsum("bld,dkth->blkth", h, w["qkv"])  # [B, L, K, G+2, H]
    impl = cfg.attention_impl if cache_part is None else cached_attention_impl(cfg)
    from orl_jax_kernels.qk_norm_rope import kernel as qk_kernel

    pallas = cache_part is not None and impl == "pallas" and qk_kernel.supported(cfg.num_kv_heads, g, cfg.head_dim)
    attn = None
    if pallas and FUSED_QK_ATTENTION and "packed_vectors" in w and l <= FUSED_QK_MAX_TOKENS:
        attn = attention_normed(qkv, cache_part, self_vis, cos, sin, w["packed_vectors"], eps, gemma=False)
    if attn is not None:  # k and v for a commit pass's cache write (XLA drops them, and q, where they are unused)
        _, k, v = qk_norm_rope(qkv, cos, sin, w["q_norm"], w["k_norm"], eps)
    else:
        if pallas:
            # the Pallas path of cached passes: q/k norm + RoPE and the v slice in one kernel (four XLA kernels);
            # the norm weights read in place from the packed vector stack where the layer loop passes it (backbone)
            interpret = jax.default_backend() == "cpu"
            if "packed_vectors" in w:
                q, k, v = qk_kernel.qk_norm_rope_stacked(qkv, cos, sin, *w["packed_vectors"], eps, interpret)
            else:
                q, k, v = qk_kernel.qk_norm_rope(qkv, cos, sin, w["q_norm"], w["k_norm"], eps, interpret)
        else:
            q, k, v = qk_norm_rope(qkv, cos, sin, w["q_norm"], w["k_norm"], eps)
        q = q.reshape(b, l, cfg.num_heads, cfg.head_dim)  # [B, L, N, H]
        parts = [(k, v, self_vis)] if cache_part is None else [cache_part, (k, v, self_vis)]
        attn = attention(q, parts, impl)
    x = x + einsum("blnh,nhd->bld", attn, w["o"])
    x = x + fused_gated_mlp(rms_norm(x, w["mlp_norm"], eps), w["gate_up"], w["down"])
    return x, k, v


def layer_in_place(layers: dict, i: jax.Array, sliced: dict | None = None) -> dict:
    """Layer i's weights from the stacks: the matrices as StackedWeight (read in place by the small-M kernel),
    the rest sliced. sliced: layer i's weights as the layer scan delivers them (XLA reads those in place), the
    operands of whatever the kernel does not take."""
    if sliced is None:
        sliced = {name: a[i] for name, a in layers.items()}
    return {name: StackedWeight(a, i, sliced[name]) if name in MATRICES else sliced[name] for name, a in layers.items()}


def backbone(params: dict, cfg: ModelConfig, x: jax.Array, positions: jax.Array, self_vis: jax.Array,
             cache: KVCache | None = None, remat: bool = False):
    """Run all layers. x [B, L, D]; positions [B, L]; self_vis [B, L, L] visibility among the current tokens.

    With a cache, the tokens also see its filled slots (start <= slot < length). Returns (hidden after the final
    norm [B, L, D], k, v of the current tokens [layers, B, L, K, H]); the cache itself is not written here.
    """
    cos, sin = rope_angles(positions, cfg.head_dim, cfg.rope_theta)
    cvis = None if cache is None else cache_mask(cache.start, cache.length, cache.size, x.shape[1])
    if cache is not None and cached_attention_impl(cfg) == "pallas":  # int8, the extent: once, not per layer
        vis = kernel_masks({"cache": cvis, "self": self_vis}, ("cache",))
        cvis, self_vis = vis["cache"], vis["self"]

    streamed = cache is not None and cfg.cached_matmul_impl == "pallas"
    # the attention kernel may read layer i of the cache stacks in place (decode_attention Blocks.cache_in_place)
    cache_stacked = cache is not None and cached_attention_impl(cfg) == "pallas"

    # cached passes (inference) slice the layer's vectors from one packed array: one copy per layer, not four
    layers, packed, layout = (params["layers"], None, ()) if cache is None else pack_vectors(params["layers"])
    norm_offsets = vector_offsets(layout, "q_norm", "k_norm")

    def body(x, xs):
        (w, row, i), ck, cv = xs
        if row is not None:
            w = w | unpack_vectors(row, layout)
        if streamed:
            w = layer_in_place(params["layers"], i, w)
        if cache_stacked:
            ck, cv = StackedWeight(cache.k, i, ck), StackedWeight(cache.v, i, cv)
            if norm_offsets is not None:  # the q/k norm kernel reads them where they lie (no copies)
                w = w | {"packed_vectors": (packed, i, norm_offsets)}
        cache_part = None if ck is None else (ck, cv, cvis)
        x, k, v = _layer(cfg, x, w, cos, sin, self_vis, cache_part)
        return constrain(x, ACTIVATION_AXES), (k, v)

    if remat:
        body = jax.checkpoint(body, prevent_cse=False)
    # the layer indices as a literal, not jnp.arange: XLA unrolls the loop in the engine's graph and a slice of an
    # iota stays a kernel launch per layer (36 per Qwen3-4B step), a slice of a constant folds away
    index = np.arange(cfg.num_layers, dtype=np.int32)
    ws = (layers, packed, jnp.asarray(index) if streamed or cache_stacked else None)
    xs = (ws, None, None) if cache is None else (ws, cache.k, cache.v)
    unroll = 1 if cache is None or cfg.layer_unroll is None else min(cfg.layer_unroll, cfg.num_layers)
    x, (k, v) = jax.lax.scan(body, constrain(x, ACTIVATION_AXES), xs, unroll=unroll)
    return rms_norm(x, params["final_norm"], cfg.rms_norm_eps), k, v


def logits(params: dict, cfg: ModelConfig, h: jax.Array) -> jax.Array:
    """[B, L, D] -> float32 logits [B, L, V]."""
    head = params["embed"] if cfg.tie_word_embeddings else params["lm_head"]
    return jnp.einsum("bld,vd->blv", h, head.astype(h.dtype), preferred_element_type=jnp.float32)


def forward(params: dict, cfg: ModelConfig, tokens: jax.Array, *, seg_start: jax.Array | None = None,
            positions: jax.Array | None = None, residual: jax.Array | None = None,
            embeds: jax.Array | None = None, mask: jax.Array | None = None, remat: bool = False) -> jax.Array:
    """Cache-free pass over whole sequences -> float32 logits [B, L, V].

    Visibility: seg_start [B, L] (model/attention.py; default causal), or a whole boolean mask [B, L, L].
    positions default to 0..L-1; embeds [B, L, D] replaces the token embedding (residual forms build it).
    """
    check_tokens(tokens, cfg)
    b, l = tokens.shape
    if mask is None:
        mask = self_mask(causal_segments(b, l) if seg_start is None else seg_start)
    positions = causal_segments(b, l) if positions is None else positions
    x = embed(params, cfg, tokens, residual) if embeds is None else embeds.astype(cfg.jnp_dtype)
    h, _, _ = backbone(params, cfg, x, positions, mask, remat=remat)
    return logits(params, cfg, h)
