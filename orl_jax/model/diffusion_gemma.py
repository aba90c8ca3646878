"""DiffusionGemma (the Gemma 4 text backbone as a block-diffusion model) as pure functions of (params, tokens).

Architecture (transformers' DiffusionGemmaForBlockDiffusion, text part; 26B-A4B sizes in brackets):
- input: E[x] * sqrt(D), the scale cast to the weight dtype first (as HF);
- layers [30] repeat k sliding-window layers then one full-attention layer [5:1]. Each layer:
    x += post_attn_norm(attention(attn_norm(x)))
    m  = post_mlp_norm(MLP(mlp_norm(x)))                  dense gelu_tanh MLP [F 2112]
    e  = post_moe_norm(MoE(moe_norm(x); router(x)))        [128 experts, top 8, F 704] beside the dense MLP
    x  = (x + post_ffw_norm(m + e)) * layer_scalar
  RMSNorms scale in float32 and use their weight as is (Gemma 4, not Gemma 1-3's 1 + w);
- attention: RMSNorm on q and k (weights) and on v (no weight), score scale 1.0, GQA, no biases.
  Sliding layers [K 8, H 256]: own V projection, default RoPE [theta 1e4], window W [1024] keys.
  Full layers [K 2, H 512]: V is the K projection (K = V; k gets k_norm + RoPE, v the weightless norm),
  proportional RoPE [theta 1e6] rotating only the first quarter of the frequency pairs;
- router: weightless RMSNorm * scale * D^-1/2 -> logits -> softmax (float32) -> top-k -> renormalize ->
  * per-expert scale; experts only run on their routed tokens (model/moe.py: capacity buckets, ragged_dot);
- final RMSNorm, LM head tied to E, logits soft-capped: 30 * tanh(z / 30).

Two modes over one set of weights (HF's encoder and decoder share every weight but two):
- encoder (prefill, commit, `forward`): causal; writes K/V into the cache; uses the encoder's own layer_scalar
  buffers (HF saves them separately: "model.encoder.language_model.layers.{i}.layer_scalar");
- decoder (`decode`): the canvas, bidirectional inside itself and over the cached prefix; reads the cache, never
  writes it. Its input is post_norm(E[x] sqrt(D) + SC(z)): the self-conditioning block
  SC(z) = down(gelu_tanh(gate(n)) * up(n)), n = pre_norm(z), z = softmax(previous step's temperature-processed
  logits) @ E * sqrt(D), and a weightless post_norm. A block's first step has z = 0 and SC(0) = 0 exactly, so
  `embed` = post_norm(E[x] sqrt(D)) is HF's decoder input without self-conditioning logits.

Sliding window: in the encoder, query slot q sees key slot j iff q - W < j <= q (HF's sliding_window_overlay). In
the decoder every canvas token sees the last W - 1 committed tokens plus the whole canvas: what HF's decoder sees
through the sliding layers of its DynamicCache, which keep the last W - 1 tokens, under no mask. These rules, as the
visibility dicts `backbone` takes, are model/diffusion_gemma_vis.py.

Fused passes (what generate() runs): `prefill_decode` and `commit_decode` run an encoder pass (the prompt; a
finished block) and the next canvas's first decoder pass as one pass over both token sets, each row with its own
mode's visibility and layer_scalar, so each layer's weights are read once for both (the 26B's experts: ~11 ms).

Layer stacking: two stacks, params["sliding"] [G * k, ...] and params["full"] [G, ...] (G = 5 groups of 5 + 1),
run in HF's layer order: the G groups unrolled, each a loop over its k sliding layers, then its full layer. Why:
the two types differ in parameter and cache shapes, so one stack per type is the natural layout (and the
loader's); the loop over sliding layers reads each layer's matrices in place (see `backbone`). The KV cache is a
HybridKVCache of the same two stacks.

Differences from HF (layout, memory and scheduling only): projections are einsum operands, q / k (/ v) fused per
layer [D, K, G + 2 or G + 1, H], o [N, H, D], the dense gate / up fused [D, 2, F], down [F, D]; experts are
[E, D, 2F] (gate | up, HF's packing, transposed) and [E, F, D]; the sliding layers' cache holds every slot and
the window is a mask (HF keeps a W - 1 ring: same values, more memory here); left-padded rows get positions from 0
(HF's generate shifts padded rows). Not supported: image inputs and the vision tower (prompts
holding image_token_id are refused; the loader skips the vision weights by name), use_bidirectional_attention="all".
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from orl_jax.config import kernel_choice
from orl_jax.diffusion_gemma_config import FULL, SLIDING, DiffusionGemmaConfig
from orl_jax.model import qwen3
from orl_jax.model.attention import attention, causal_segments, kernel_masks, window_mask
from orl_jax.model.cache import HybridKVCache, KVCache
from orl_jax.model.diffusion_gemma_vis import decoder_vis, encoder_vis, fused_vis
from orl_jax.model.layers import (
    apply_rope,
    einsum,
    fused_gated_mlp,
    gated_mlp,
    rms_factor,
    rms_norm_fp32,
    rope_angles_inv_freq,
    rope_inv_freq,
    soft_cap,
)
from orl_jax.model.moe import experts_mlp, route
from orl_jax.model.streamed import StackedWeight, pack_vectors, unpack_vectors, vector_offsets
from orl_jax.params import ParamSpec, ones

ACT = "gelu_tanh"  # HF: gelu_pytorch_tanh


EXPERT_WEIGHTS = ("experts_gate_up", "experts_down")  # [layers, E, ...] per layer type

# Cached passes (the denoising steps inside generate()'s loop) run each group's sliding layers at static indices
# ("unrolled", the default; static weight slices reach cuBLAS in place) or as a while_loop ("while"). Both give the
# same forward (session 21, 2026-12-01_dg_graph_loops_h200.md), but with the loops XLA keeps generate()'s own while
# loop on the host: its body holds dynamic-slice fusions whose offsets follow an inner loop, which XLA's command
# buffers take only in loops of a known trip count ("WhileThunk is not convertible", its log says), so every
# denoising step copied the loop's predicate to the host and the host launched the next step's graph. Unrolled, the
# whole loop is one device-side WHILE command: generate() returns after ~5 ms instead of when the device is done,
# and on an H100 it ran 1.7 ms faster per 26B generate() (median of 6 alternating rounds, 5 faster, the same
# tokens), for a first compile of ~33 s instead of ~23 (2026-12-05_dg_device_loop_h100.md). Read at trace time.
SLIDING_LOOP = "unrolled"

# The cache-free inference passes' self-attention (the prompt's `prefill`, `prefill_decode`: hundreds of queries
# over as many keys). "auto": cuDNN's flash attention (jax.nn.dot_product_attention, the visibility mask passed
# whole) on the layers it takes (head dim <= 256: the sliding layers) where it runs (a GPU of compute capability
# >= 8.0, bf16 / fp16) and the config's cached_attention_impl allows kernels ("auto", "pallas", "cudnn"; the
# multi-device "auto" -> "orl_jax" keeps the einsums); elsewhere, and with "orl_jax", the float32 einsums (HF
# eager's order). On an H200 "auto" made generate(max_steps=1) 0.53 ms slower (median of 8 rounds alternating,
# benchmarks/results/2026-12-05_dg_norm_folds_h200.md). "pallas", where the config's cached_attention_impl resolves
# to "pallas": the sliding layers on kernels/decode_attention's masked_attention (online softmax, each query tile
# streaming the keys up to its furthest visible one), their q/k/v norms and RoPE in kernels/qk_norm_rope as in
# cached passes; the full layers (512-wide heads) keep the einsums. The default: on an H200 it made the 26B's first
# step, generate(max_steps=1), 1.57 ms faster (6 of 6 alternating rounds,
# benchmarks/results/2026-12-05_dg_softcap_masked_h200.md). Read at trace time.
UNCACHED_ATTENTION = "pallas"
UNCACHED_ATTENTION_CHOICES = ("orl_jax", "auto", "pallas")

# The passes that keep only some rows of their output (`prefill_decode` and `commit_decode` the canvas rows,
# `prefill` the last prompt token's): True runs the last layer's attention output, MLP and MoE for those rows
# alone; every row's K/V is still computed and cached. At the 26B's first step that leaves 512 of 768 rows out of
# the last layer's o projection, dense MLP and experts; the experts still read all their weights, so ~0.1 ms by
# estimate. On an H100 generate(max_steps=1) was unchanged within its rounds' spread (-0.03 ms median, +-0.55;
# benchmarks/results/2026-12-06_dg_trim_last_layer_h100.md). The kept rows' products run at fewer rows, so their
# rounding may differ, as between the fused pass and the two passes it fuses. Read at trace time.
TRIM_LAST_LAYER = True


def _layer_specs(cfg: DiffusionGemmaConfig, n: int, kv: int, hd: int, own_v: bool) -> dict:
    """One layer type's stacked weights. Each layer's query, key and value projections are one matrix [D, K, G + 2,
    H] (full layers, where K = V: [D, K, G + 1, H]): the G query heads of each kv head, then its key (and value);
    the dense MLP's gate and up are one [D, 2, F]. One GEMM per fused matrix: at canvas 256 three separate q / k /
    v GEMMs fill few of the GPU's SMs, and XLA's dot merger, which joined them, copied the weights into a
    concatenation in every forward (runtime.py turns it off; fused: -0.37 ms of GEMMs per 26B forward,
    benchmarks/results/2026-11-30_dg_fused_qkv_h200x2.md)."""
    D, N, F, E, Fe, dt = (cfg.hidden_size, cfg.num_heads, cfg.intermediate_size, cfg.num_experts,
                          cfg.moe_intermediate_size, cfg.jnp_dtype)
    norm = lambda size, axis: ParamSpec((n, size), dt, ("layers", axis), ones)
    return {
        "attn_norm": norm(D, "embed"),
        "qkv" if own_v else "qk": ParamSpec((n, D, kv, N // kv + (2 if own_v else 1), hd), dt,
                                            ("layers", "embed", "kv_heads", "qkv", "head_dim")),
        "o": ParamSpec((n, N, hd, D), dt, ("layers", "heads", "head_dim", "embed")),
        "q_norm": norm(hd, "head_dim"),
        "k_norm": norm(hd, "head_dim"),
        "post_attn_norm": norm(D, "embed"),
        "mlp_norm": norm(D, "embed"),
        "gate_up": ParamSpec((n, D, 2, F), dt, ("layers", "embed", "gate_up", "mlp")),
        "down": ParamSpec((n, F, D), dt, ("layers", "mlp", "embed")),
        "post_mlp_norm": norm(D, "embed"),
        "router_scale": norm(D, "embed"),
        "router": ParamSpec((n, D, E), dt, ("layers", "embed", "experts")),
        "expert_scale": norm(E, "experts"),
        "moe_norm": norm(D, "embed"),
        "experts_gate_up": ParamSpec((n, E, D, 2 * Fe), dt, ("layers", "experts", "embed", "mlp")),
        "experts_down": ParamSpec((n, E, Fe, D), dt, ("layers", "experts", "mlp", "embed")),
        "post_moe_norm": norm(D, "embed"),
        "post_ffw_norm": norm(D, "embed"),
        "layer_scalar": ParamSpec((n, 1), dt, ("layers", None), ones),  # decoder's
        "encoder_layer_scalar": ParamSpec((n, 1), dt, ("layers", None), ones),  # encoder's (a separate HF buffer)
    }


def param_specs(cfg: DiffusionGemmaConfig) -> dict:
    V, D, F, dt = cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.jnp_dtype
    G, k = cfg.num_groups, cfg.sliding_per_group
    specs = {
        "embed": ParamSpec((V, D), dt, ("vocab", "embed")),
        "sliding": _layer_specs(cfg, G * k, cfg.num_kv_heads, cfg.head_dim, own_v=True),
        "full": _layer_specs(cfg, G, cfg.num_global_kv_heads, cfg.global_head_dim, own_v=False),
        "final_norm": ParamSpec((D,), dt, ("embed",), ones),
        "self_cond": {
            "norm": ParamSpec((D,), dt, ("embed",), ones),
            "gate": ParamSpec((D, F), dt, ("embed", "adapter")),
            "up": ParamSpec((D, F), dt, ("embed", "adapter")),
            "down": ParamSpec((F, D), dt, ("adapter", "embed")),
        },
    }
    if not cfg.tie_word_embeddings:
        specs["lm_head"] = ParamSpec((V, D), dt, ("vocab", "embed"))
    return specs


# --- inputs ------------------------------------------------------------------------------------------------------

def check_tokens(tokens, cfg: DiffusionGemmaConfig, name: str = "tokens", prompt: bool = False) -> None:
    """Rank, dtype, vocabulary range and, for a concrete prompt, no image placeholders (a canvas may hold any id:
    it starts uniformly random)."""
    qwen3.check_tokens(tokens, cfg, name)
    if not prompt:
        return
    try:
        t = np.asarray(tokens)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return
    check_prompt_ids(list(t), cfg, name)


def check_prompt_ids(rows, cfg: DiffusionGemmaConfig, name: str = "prompt_ids") -> None:
    """Image inputs are not supported: refuse image placeholder tokens before anything is traced."""
    if cfg.image_token_id is None:
        return
    for i, r in enumerate(rows):
        if np.any(np.asarray(r) == cfg.image_token_id):
            raise ValueError(f"{name}[{i}] contains image_token_id={cfg.image_token_id}: image inputs are not "
                             "supported by orl_jax's DiffusionGemma (text only; the vision tower is not loaded)")


def _embed_scale(cfg: DiffusionGemmaConfig):
    return jnp.asarray(math.sqrt(cfg.hidden_size), jnp.float32).astype(cfg.jnp_dtype)


def token_embed(params: dict, cfg: DiffusionGemmaConfig, tokens: jax.Array) -> jax.Array:
    """E[x] * sqrt(D) [B, L, D]: the encoder's input."""
    return jnp.take(params["embed"], tokens, axis=0).astype(cfg.jnp_dtype) * _embed_scale(cfg)


def self_conditioning(params: dict, cfg: DiffusionGemmaConfig, z: jax.Array) -> jax.Array:
    """SC(z) = down(gelu_tanh(gate(n)) * up(n)), n = pre_norm(z); z [B, L, D] -> [B, L, D]."""
    w = params["self_cond"]
    n = rms_norm_fp32(z.astype(cfg.jnp_dtype), w["norm"], cfg.rms_norm_eps)
    return gated_mlp(n, w["gate"], w["up"], w["down"], ACT)


def embed(params: dict, cfg: DiffusionGemmaConfig, tokens: jax.Array) -> jax.Array:
    """The decoder's input embedding of a canvas without self-conditioning: post_norm(E[x] sqrt(D)) [B, L, D]."""
    return rms_norm_fp32(token_embed(params, cfg, tokens), None, cfg.rms_norm_eps)


def residual_embed(params: dict, cfg: DiffusionGemmaConfig, tokens: jax.Array, z: jax.Array,
                   w: jax.Array) -> jax.Array:
    """post_norm(E[x] sqrt(D) + w * SC(z)): the decoder input with self-conditioning on z, weighted per position by
    w [B, L] (w = 1: DiffusionGemma's own decoder; w = 0: `embed`)."""
    sc = self_conditioning(params, cfg, z)
    x = token_embed(params, cfg, tokens) + w[..., None].astype(sc.dtype) * sc
    return rms_norm_fp32(x, None, cfg.rms_norm_eps)


def soft_embed(params: dict, cfg: DiffusionGemmaConfig, probs: jax.Array, scale: jax.Array | None = None) -> jax.Array:
    """z = p @ E * sqrt(D): [B, L, V] -> [B, L, D] in the model dtype (HF's soft embeddings). scale [B, L]: p is
    probs * scale[..., None], the scale applied to the float32 product (one rounding)."""
    e = params["embed"]
    z = jnp.einsum("blv,vd->bld", probs.astype(e.dtype), e, preferred_element_type=jnp.float32)
    if scale is not None:
        return (z * (scale * math.sqrt(cfg.hidden_size))[..., None]).astype(e.dtype)
    return z.astype(e.dtype) * _embed_scale(cfg)


# --- the layer stack ---------------------------------------------------------------------------------------------

# The dense projections' [out, in] layout (diffusion_gemma_inference.transposed_projections stores NAME + "_t"): the
# axes of each stack in the new order, the layer axis first. o [L, N, H, D] -> [L, D, N, H], down [L, F, D] -> [L, D,
# F]. (qkv / qk and the dense gate/up as [out, in] too: +0.042 ms per 26B forward on an H100, 0 of 6 rounds faster,
# removed in session 55: 2026-12-05_dg_device_loop_h100.md.)
TRANSPOSES = {"o": (0, 3, 1, 2), "down": (0, 2, 1)}


def _weight(w: dict, name: str, letters: str) -> tuple:
    """A layer's weight `name` with its einsum letters (one per axis), or its [out, in] copy NAME_t with the letters
    in that copy's order."""
    if name + "_t" not in w:
        return w[name], letters
    return w[name + "_t"], "".join(letters[i - 1] for i in TRANSPOSES[name][1:])


def _layer(cfg: DiffusionGemmaConfig, x, w, rope, self_vis, cache_part, scalar: str, self_impl: str = "orl_jax",
           rows_from: int = 0):
    """One layer over x [B, L, D] -> (x, k, v); rows_from > 0: every row's k and v, the output of rows rows_from ..
    L - 1 alone (TRIM_LAST_LAYER)."""
    eps = cfg.rms_norm_eps
    b, l, d = x.shape
    # folded params (diffusion_gemma_inference.fold_attention_norms): the norm's weight is in the projection, its
    # per-token scale cancels in the head norms below
    h = rms_norm_fp32(x, w["attn_norm"], eps) if "attn_norm" in w else x
    own_v = "qkv" in w  # full layers: "qk", K = V
    proj = einsum("bld,dkth->blkth", h, w["qkv" if own_v else "qk"])  # [B, L, K, G + 2 (or + 1), H]
    g = cfg.num_heads // proj.shape[2]
    if own_v and "packed_vectors" in w:  # sliding layers of cached passes on a GPU: q/k/v norms + RoPE, one kernel
        from orl_jax_kernels.qk_norm_rope import kernel as qk_kernel

        q, k, v = qk_kernel.qk_norm_rope_stacked(proj, *rope, *w["packed_vectors"], eps, gemma=True,
                                                 interpret=jax.default_backend() == "cpu")
        q = q.reshape(b, l, cfg.num_heads, -1)
    else:  # kernels/qk_norm_rope/reference.gemma_qkv_reference is this, for sliding layers
        q = rms_norm_fp32(proj[:, :, :, :g].reshape(b, l, cfg.num_heads, -1), w["q_norm"], eps)  # [B, L, N, H]
        k = rms_norm_fp32(proj[:, :, :, g], w["k_norm"], eps)  # [B, L, K, H]
        v = rms_norm_fp32(proj[:, :, :, g + 1 if own_v else g], None, eps)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
    if rows_from:  # the queries, residual and masks (a KernelMask's fields too) of the kept rows; the keys whole
        kept = lambda t: jax.tree.map(lambda a: a[:, rows_from:], t)  # noqa: E731
        q, x, self_vis = kept(q), kept(x), kept(self_vis)
        cache_part = None if cache_part is None else (*cache_part[:2], kept(cache_part[2]))
        scalar = scalar if isinstance(scalar, str) else kept(scalar)
        l = x.shape[1]
    parts = [(k, v, self_vis)] if cache_part is None else [cache_part, (k, v, self_vis)]
    impl = self_impl if cache_part is None else qwen3.cached_attention_impl(cfg)
    o, letters = _weight(w, "o", "nhd")
    attn = einsum(f"blnh,{letters}->bld", attention(q, parts, impl, scale=1.0), o)
    x = x + rms_norm_fp32(attn, w["post_attn_norm"], eps)

    flat = x.reshape(b * l, d)  # [T, D]
    impl = moe_impl(cfg)
    if "moe_norm" in w:
        mlp_in = rms_norm_fp32(x, w["mlp_norm"], eps)
        weights, experts = route(flat, w["router_scale"], w["router"], w["expert_scale"], cfg.top_k_experts, eps,
                                 kernel=impl == "pallas")
        moe_in, rs = rms_norm_fp32(flat, w["moe_norm"], eps), None
    else:  # diffusion_gemma_inference.fold_ffw_norms: the norms' weights are in the matrices, their per-token
        # factor scales the products
        rs = rms_factor(flat, eps)[:, 0]  # [T]
        weights, experts = route(flat, None, w["router"], w["expert_scale"], cfg.top_k_experts, eps,
                                 kernel=impl == "pallas", row_scale=rs)
        mlp_in, moe_in = x, flat
    moe = experts_mlp(moe_in, weights, experts, w["experts_gate_up"], w["experts_down"], ACT, impl,
                      distinct=True, row_scale=rs)  # a top-k's choices
    moe = moe.reshape(b, l, d)  # [B, L, D]
    down, down_letters = _weight(w, "down", "fd")
    mlp = fused_gated_mlp(mlp_in, w["gate_up"], down, ACT, None if rs is None else rs.reshape(b, l, 1),
                          down_letters=down_letters)
    ffw = rms_norm_fp32(mlp, w["post_mlp_norm"], eps) + rms_norm_fp32(moe, w["post_moe_norm"], eps)
    if isinstance(scalar, str):
        scale = w[scalar][0]
    else:  # a fused pass: encoder rows, then decoder rows (scalar: [1, L, 1], True = decoder)
        scale = jnp.where(scalar, w["layer_scalar"][0], w["encoder_layer_scalar"][0])
    x = (x + rms_norm_fp32(ffw, w["post_ffw_norm"], eps)) * scale
    return x, k, v


def _qk_kernel_offsets(cfg: DiffusionGemmaConfig, layout) -> tuple[int, ...] | None:
    """Where the sliding layers' q and k norm weights lie in their packed vector row, when the sliding layers of a
    cached pass (or of a cache-free one under UNCACHED_ATTENTION "pallas") take kernels/qk_norm_rope (q/k/v norms +
    RoPE in one launch instead of XLA's slices and fusions): with the Pallas attention (on a GPU by default), full
    RoPE on sliding layers, shapes the kernel takes, and both weights packed. None otherwise."""
    from orl_jax_kernels.qk_norm_rope.kernel import supported

    fits = (qwen3.cached_attention_impl(cfg) == "pallas" and cfg.rope_sliding.partial_rotary_factor == 1.0
            and supported(cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads, cfg.head_dim))
    return vector_offsets(layout, "q_norm", "k_norm") if fits else None


def moe_impl(cfg: DiffusionGemmaConfig) -> str:
    """cfg.moe_impl with "auto" resolved (config.kernel_choice)."""
    return kernel_choice(cfg.moe_impl, "pallas", "bucketed")


def _uncached_attention(cfg: DiffusionGemmaConfig) -> str:
    """The attention impl of a cache-free inference pass under UNCACHED_ATTENTION (see there)."""
    if UNCACHED_ATTENTION not in UNCACHED_ATTENTION_CHOICES:
        raise ValueError(f"UNCACHED_ATTENTION must be one of {UNCACHED_ATTENTION_CHOICES}, got {UNCACHED_ATTENTION!r}")
    if UNCACHED_ATTENTION == "pallas":
        return "pallas" if qwen3.cached_attention_impl(cfg) == "pallas" else "orl_jax"
    if (UNCACHED_ATTENTION == "orl_jax" or cfg.cached_attention_impl not in ("auto", "pallas", "cudnn")
            or cfg.dtype not in ("bfloat16", "float16") or jax.default_backend() != "gpu"):
        return "orl_jax"
    cc = getattr(jax.devices()[0], "compute_capability", "0")
    return "cudnn" if float(cc) >= 8.0 else "orl_jax"


def _rope(cfg: DiffusionGemmaConfig, positions):
    rs, rf = cfg.rope_sliding, cfg.rope_full
    inv_s = rope_inv_freq(cfg.head_dim, rs.theta, rs.rope_type, rs.partial_rotary_factor, rs.factor)
    inv_f = rope_inv_freq(cfg.global_head_dim, rf.theta, rf.rope_type, rf.partial_rotary_factor, rf.factor)
    return rope_angles_inv_freq(positions, inv_s), rope_angles_inv_freq(positions, inv_f)


def backbone(params: dict, cfg: DiffusionGemmaConfig, x: jax.Array, positions: jax.Array, vis: dict,
             cache: HybridKVCache | None = None, *, encoder: bool, collect_kv: bool = False, remat: bool = False,
             in_place: bool = False, decoder_from: int | None = None, groups: tuple[int, int] | None = None,
             out_from: int = 0):
    """Run all layers. x [B, L, D]; positions [B, L]; vis: {SLIDING, FULL} -> visibility among the current tokens
    [B, L, L], and with a cache also {"cache_" + type} -> visibility of the cache slots [B, L, S]. in_place: a
    cache-free pass that is never differentiated (the prefill) reads the weights in place as cached passes do.
    decoder_from (with encoder=True): tokens from this index on are decoder tokens, scaled by the decoder's
    layer_scalar (the fused passes `prefill_decode`, `commit_decode`); only the tokens before it have their K/V
    collected. groups (g0, g1): only the layer groups g0 .. g1 - 1 (a pass split over two programs,
    `prefill_decode_first` / `prefill_decode_rest`); the final norm only where g1 is the last group. out_from: only
    the hidden of tokens out_from .. L - 1 is wanted (where g1 is the last group); under TRIM_LAST_LAYER the last
    layer computes only those rows' output (every row's K/V).

    Returns (hidden after the final norm [B, L - out_from, D], sliding (k, v) [G*k, B, L', K, H], full (k, v)
    [G, B, L', K, H], L' = decoder_from or L); the K/V are None unless collect_kv. The cache itself is not written
    here.
    """
    G, k = cfg.num_groups, cfg.sliding_per_group
    rope_s, rope_f = _rope(cfg, positions)
    scalar = "encoder_layer_scalar" if encoder else "layer_scalar"
    kv_len = x.shape[1]
    if decoder_from is not None:
        kv_len = decoder_from
        scalar = (jnp.arange(x.shape[1]) >= decoder_from)[None, :, None]
    # The groups are unrolled; each runs its k sliding layers, then its full layer (weights at static index g).
    # Passes with a cache (inference) run them at static indices (SLIDING_LOOP "unrolled") or as a while_loop whose
    # counter is the sliding layer's index into the whole stacks: XLA feeds each matrix to its GEMM in place for a
    # static slice or for an offset that is the loop's own counter (dynamic-slice fusion). Offsets computed any other
    # way made XLA copy the weights: from a scan over [G, k, ...] group slices (2.6 GB per 26B forward), from
    # `g * k + j` in an unrolled body, or from a nested scan (~1.3-2 ms per forward:
    # benchmarks/results/2026-11-30_dg_in_place_h200x2.md). Cache-free passes
    # (training, `forward`) need reverse-mode autodiff, which while_loop lacks: they scan each group's slice of the
    # stacks, copies included; the prefill (`in_place`) needs none and loops as inference does (the scan copied
    # ~105 MB of weights per sliding layer: 46 copies, 1.4-1.6 ms of a ~20 ms 26B prefill,
    # benchmarks/results/2026-12-02_dg_generate_parts_s31_h200.md). The pallas moe_impl's grouped kernel reads the
    # expert stacks in place (StackedWeight).
    if SLIDING_LOOP not in ("unrolled", "while"):
        raise ValueError(f"diffusion_gemma.SLIDING_LOOP must be 'unrolled' or 'while', got {SLIDING_LOOP!r}")
    looped = cache is not None or (in_place and not remat)
    stacks = EXPERT_WEIGHTS if moe_impl(cfg) == "pallas" else ()
    sliding_w = {n: a for n, a in params["sliding"].items() if n not in stacks}
    full_w = {n: a for n, a in params["full"].items() if n not in stacks}
    self_impl = _uncached_attention(cfg) if in_place and cache is None and not remat else "orl_jax"
    if cache is not None and qwen3.cached_attention_impl(cfg) == "pallas":  # int8, the extents: once, not per layer
        vis = kernel_masks(vis, ("cache_" + SLIDING, "cache_" + FULL))
    elif self_impl == "pallas":  # the sliding layers' keys as the kernel's one part (masked_attention)
        vis = vis | kernel_masks({SLIDING: vis[SLIDING]}, (SLIDING,))
    sliding_v = full_v = None
    if looped:  # inference: each layer's vectors (norms, scales) as one slice of a packed array
        (sliding_w, sliding_v, sliding_layout), (full_w, full_v, full_layout) = map(pack_vectors, (sliding_w, full_w))
    take = lambda a, i: jax.lax.dynamic_index_in_dim(a, i, keepdims=False, allow_negative_indices=False)  # noqa
    norm_offsets = _qk_kernel_offsets(cfg, sliding_layout) if cache is not None or self_impl == "pallas" else None

    def layer(x, w, rope, kind, part, rows_from=0):  # -> (x, k, v), the K/V of the first kv_len tokens
        x, kk, vv = _layer(cfg, x, w, rope, vis[kind], part, scalar, self_impl, rows_from)
        return x, kk[:, :kv_len], vv[:, :kv_len]

    def sliding_layer(x, i, w, ck=None, cv=None):
        w = w | {n: StackedWeight(params["sliding"][n], i) for n in stacks}
        part = None if ck is None else (ck, cv, vis["cache_" + SLIDING])
        return layer(x, w, rope_s, SLIDING, part)

    def sliding_group(x, lo):  # sliding layers lo .. lo + k - 1 -> (x, (k, v) [k, B, L, K, H] or None)
        if not looped:
            def body(x, xs):
                x, kk, vv = sliding_layer(x, xs[1], xs[0])
                return x, ((kk, vv) if collect_kv else None)

            body = jax.checkpoint(body, prevent_cse=False) if remat else body
            xs = ({n: a[lo:lo + k] for n, a in sliding_w.items()}, jnp.arange(lo, lo + k, dtype=jnp.int32))
            return jax.lax.scan(body, x, xs)

        kv_shape = (k, x.shape[0], kv_len, cfg.num_kv_heads, cfg.head_dim)
        kv = (jnp.zeros(kv_shape, x.dtype), jnp.zeros(kv_shape, x.dtype)) if collect_kv else None

        def step(carry):
            i, x, kv = carry  # i: the loop's counter, or a Python int when unrolled (every slice static)
            index = jnp.int32(i) if isinstance(i, int) else i  # the kernels take the layer as an array
            w = {n: take(a, i) for n, a in sliding_w.items()}
            if sliding_v is not None:
                w |= unpack_vectors(take(sliding_v, i), sliding_layout)
            # the cache as layer i of its stacks: the attention kernel may read it in place (Blocks.cache_in_place)
            ck, cv = ((StackedWeight(c, index, take(c, i)) for c in (cache.sliding.k, cache.sliding.v))
                      if cache is not None else (None, None))
            if norm_offsets is not None:  # the q/k norm kernel reads both weights from the packed stack (no copies)
                w["packed_vectors"] = (sliding_v, index, norm_offsets)
            x, kk, vv = sliding_layer(x, index, w, ck, cv)
            if collect_kv:
                kv = (kv[0].at[i - lo].set(kk), kv[1].at[i - lo].set(vv))
            return i + 1, x, kv

        if SLIDING_LOOP == "unrolled" and cache is not None:
            carry = (lo, x, kv)
            for _ in range(k):
                carry = step(carry)
            return carry[1], carry[2]
        _, x, kv = jax.lax.while_loop(lambda c: c[0] < lo + k, step, (jnp.int32(lo), x, kv))
        return x, kv

    def full_layer(x, g, rows_from=0):
        w = {n: a[g] for n, a in full_w.items()} | {n: StackedWeight(params["full"][n], jnp.int32(g)) for n in stacks}
        part = None
        if full_v is not None:
            w |= unpack_vectors(full_v[g], full_layout)
        if cache is not None:
            ck, cv = (StackedWeight(c, jnp.int32(g), c[g]) for c in (cache.full.k, cache.full.v))
            part = (ck, cv, vis["cache_" + FULL])
        return layer(x, w, rope_f, FULL, part, rows_from)

    if remat:
        full_layer = jax.checkpoint(full_layer, prevent_cse=False, static_argnums=(1, 2))
    kv_s, kv_f = [], []
    g0, g1 = (0, G) if groups is None else groups
    for g in range(g0, g1):
        x, kv = sliding_group(x, g * k)
        x, kf, vf = full_layer(x, g, out_from if TRIM_LAST_LAYER and g == G - 1 else 0)
        kv_s.append(kv)
        kv_f.append((kf, vf))
    if g1 == G and not TRIM_LAST_LAYER:
        x = x[:, out_from:]
    h = rms_norm_fp32(x, params["final_norm"], cfg.rms_norm_eps) if g1 == G else x
    if not collect_kv:
        return h, None, None
    cat = lambda kvs, axis_op: tuple(axis_op([t[n] for t in kvs]) for n in (0, 1))  # noqa: E731
    return h, cat(kv_s, jnp.concatenate), cat(kv_f, jnp.stack)


def logits(params: dict, cfg: DiffusionGemmaConfig, h: jax.Array, capped: bool = True) -> jax.Array:
    """[B, L, D] -> soft-capped float32 logits [B, L, V] (capped=False: the head's product, `cap_logits` of it are
    the logits). The head's product (float32 sums) is rounded to the model
    dtype before the float32 soft-cap, as transformers' DiffusionGemmaForBlockDiffusion rounds its lm_head output.
    The GEMM writes that dtype itself (one rounding in its epilogue, as a bf16 lm_head in PyTorch does): the 26B's
    [256, 262144] product is then 134 MB instead of 268 of float32 sums converted after it; in the forward
    15.600 / 15.603 against 15.617 / 15.617 ms (benchmarks/results/2026-12-01_dg_graph_loops_h200.md, call 4)."""
    head = params["embed"] if cfg.tie_word_embeddings else params["lm_head"]
    z = jnp.einsum("bld,vd->blv", h, head.astype(h.dtype), preferred_element_type=h.dtype)
    return cap_logits(cfg, z) if capped else z


def cap_logits(cfg: DiffusionGemmaConfig, z: jax.Array) -> jax.Array:
    """The head's product [..., V] -> float32 soft-capped logits."""
    return soft_cap(z.astype(jnp.float32), cfg.final_logit_softcapping)


# --- the three passes of block diffusion -------------------------------------------------------------------------

def init_cache(cfg: DiffusionGemmaConfig, batch: int, size: int) -> HybridKVCache:
    dt = cfg.jnp_dtype
    return HybridKVCache(
        sliding=KVCache.empty(cfg.num_groups * cfg.sliding_per_group, batch, size, cfg.num_kv_heads, cfg.head_dim, dt),
        full=KVCache.empty(cfg.num_groups, batch, size, cfg.num_global_kv_heads, cfg.global_head_dim, dt))


def prefill(params: dict, cfg: DiffusionGemmaConfig, tokens: jax.Array, lengths: jax.Array, cache_size: int):
    """Encode left-padded prompts. tokens [B, P] (row b's prompt in the last lengths[b] slots).

    Returns (float32 logits of the last prompt token [B, V], cache with slots [0, P) written).
    """
    check_tokens(tokens, cfg, prompt=True)
    b, p = tokens.shape
    if cache_size < p:
        raise ValueError(f"cache_size={cache_size} is smaller than the padded prompt length {p}")
    cache = init_cache(cfg, b, cache_size)
    start = (p - lengths).astype(jnp.int32)
    cache = HybridKVCache(sliding=cache.sliding.replace(start=start), full=cache.full.replace(start=start))
    positions = jnp.maximum(cache.positions(p), 0)
    valid = jnp.arange(p)[None] >= start[:, None]  # [B, P]: pad keys are invisible
    h, kv_s, kv_f = backbone(params, cfg, token_embed(params, cfg, tokens), positions,
                             encoder_vis(cfg, b, p, valid), encoder=True, collect_kv=True, in_place=True,
                             out_from=p - 1)
    return logits(params, cfg, h)[:, 0], cache.write(kv_s, kv_f)


def prefill_decode(params: dict, cfg: DiffusionGemmaConfig, tokens: jax.Array, lengths: jax.Array, cache_size: int,
                   canvas: jax.Array, *, embeds: jax.Array | None = None, capped: bool = True):
    """`prefill` of the prompts tokens [B, P] and the first `decode` of canvas [B, L] after them as one pass over
    P + L tokens: the prompt rows are the encoder's (causal, the window on sliding layers, the encoder's
    layer_scalar, their K/V written to the cache), the canvas rows the decoder's (every valid prompt token and the
    whole canvas visible, sliding layers the last W - 1 prompt tokens; the decoder's layer_scalar). The same
    arithmetic as the two passes, but each layer's weights are read once: the 26B's expert stacks, most of a
    forward's time, are read once for both passes instead of twice. embeds [B, L, D]: the canvas rows' input (as
    `decode`'s; default `embed`, no self-conditioning, a block's first step).

    Returns (float32 logits of the canvas [B, L, V], cache with slots [0, P) written), what `decode` after
    `prefill` returns, up to rounding (each GEMM sees P + L rows). capped=False: the head's product in place of the
    logits (`logits`).
    """
    cache, positions = _prefill_decode_setup(cfg, tokens, lengths, cache_size, canvas)
    p = tokens.shape[1]
    x = _fused_input(params, cfg, tokens, canvas, embeds)
    h, kv_s, kv_f = backbone(params, cfg, x, positions, _prefill_decode_vis(cfg, cache, tokens, canvas),
                             encoder=True, collect_kv=True, in_place=True, decoder_from=p, out_from=p)
    return logits(params, cfg, h, capped), cache.write(kv_s, kv_f)


def _prefill_decode_setup(cfg: DiffusionGemmaConfig, tokens, lengths, cache_size: int, canvas):
    """prefill_decode's checks, empty cache (its start set) and positions."""
    check_tokens(tokens, cfg, prompt=True)
    check_tokens(canvas, cfg, "canvas")
    b, p = tokens.shape
    l = canvas.shape[1]
    if cache_size < p:
        raise ValueError(f"cache_size={cache_size} is smaller than the padded prompt length {p}")
    if canvas.shape[0] != b:
        raise ValueError(f"canvas has {canvas.shape[0]} rows, tokens {b}")
    cache = init_cache(cfg, b, cache_size)
    start = (p - lengths).astype(jnp.int32)
    cache = HybridKVCache(sliding=cache.sliding.replace(start=start), full=cache.full.replace(start=start))
    positions = jnp.maximum(cache.positions(p + l), 0)  # the canvas at slots p .. p + l - 1, as after the prefill
    return cache, positions


def _prefill_decode_vis(cfg: DiffusionGemmaConfig, cache: HybridKVCache, tokens, canvas) -> dict:
    """prefill_decode's visibility: the prompt's pad keys invisible, the rest as fused_vis."""
    (b, p), l = tokens.shape, canvas.shape[1]
    valid = jnp.arange(p + l)[None] >= cache.full.start[:, None]  # [B, P + L]
    return fused_vis(cfg, b, p, l, valid)


def _check_split(cfg: DiffusionGemmaConfig, groups: int) -> None:
    if not isinstance(groups, int) or isinstance(groups, bool) or not 0 < groups < cfg.num_groups:
        raise ValueError(f"groups must be an int in [1, {cfg.num_groups - 1}] (the layer groups of the first part), "
                         f"got {groups!r}")


def prefill_decode_first(params: dict, cfg: DiffusionGemmaConfig, tokens: jax.Array, lengths: jax.Array,
                         cache_size: int, canvas: jax.Array, *, embeds: jax.Array | None = None, groups: int):
    """The first `groups` layer groups of `prefill_decode` (a program of its own: the engine's SPLIT_START_GROUPS).
    Returns the part's carry (hidden [B, P + L, D], the groups' sliding and full (k, v)) for
    `prefill_decode_rest`."""
    _check_split(cfg, groups)
    cache, positions = _prefill_decode_setup(cfg, tokens, lengths, cache_size, canvas)
    x = _fused_input(params, cfg, tokens, canvas, embeds)
    x, kv_s, kv_f = backbone(params, cfg, x, positions, _prefill_decode_vis(cfg, cache, tokens, canvas),
                             encoder=True, collect_kv=True, in_place=True, decoder_from=tokens.shape[1],
                             groups=(0, groups))
    return {"x": x, "sliding": kv_s, "full": kv_f}


def prefill_decode_rest(params: dict, cfg: DiffusionGemmaConfig, tokens: jax.Array, lengths: jax.Array,
                        cache_size: int, canvas: jax.Array, first: dict, *, capped: bool = True):
    """The layer groups after `prefill_decode_first`'s (its carry `first`), the head and the cache: what
    `prefill_decode` returns, the same arithmetic split over two programs."""
    groups = first["full"][0].shape[0]
    _check_split(cfg, groups)
    cache, positions = _prefill_decode_setup(cfg, tokens, lengths, cache_size, canvas)
    p = tokens.shape[1]
    h, kv_s, kv_f = backbone(params, cfg, first["x"], positions, _prefill_decode_vis(cfg, cache, tokens, canvas),
                             encoder=True, collect_kv=True, in_place=True, decoder_from=p,
                             groups=(groups, cfg.num_groups), out_from=p)
    kv_s, kv_f = (tuple(jnp.concatenate([a, b]) for a, b in zip(first[n], kv, strict=True))
                  for n, kv in (("sliding", kv_s), ("full", kv_f)))
    return logits(params, cfg, h, capped), cache.write(kv_s, kv_f)


def _fused_input(params: dict, cfg: DiffusionGemmaConfig, tokens: jax.Array, canvas: jax.Array,
                 embeds: jax.Array | None) -> jax.Array:
    """A fused pass's input [B, Le + L, D]: the encoder's embedding of tokens [B, Le], then the canvas's decoder
    input (`embed`, or embeds when given)."""
    x_canvas = embed(params, cfg, canvas) if embeds is None else embeds.astype(cfg.jnp_dtype)
    return jnp.concatenate([token_embed(params, cfg, tokens), x_canvas], axis=1)


def commit_decode(params: dict, cfg: DiffusionGemmaConfig, block: jax.Array, cache: HybridKVCache,
                  canvas: jax.Array, *, embeds: jax.Array | None = None, capped: bool = True, write: bool = True):
    """`commit` of the finished block [B, Lb] and the next block's first `decode` of canvas [B, L] after it as one
    pass over Lb + L tokens (as `prefill_decode` after a prompt: the block rows the encoder's, the canvas rows the
    decoder's, each layer's weights read once). Returns (float32 logits of the canvas [B, L, V], cache with the
    block's K/V written), what `decode` after `commit` returns, up to rounding. capped=False: the head's product in
    place of the logits (`logits`). write=False: the block's K/V (sliding (k, v), full (k, v)), as
    HybridKVCache.write takes them, in place of the cache."""
    check_tokens(block, cfg, "block")
    check_tokens(canvas, cfg, "canvas")
    b, lb = block.shape
    l = canvas.shape[1]
    if canvas.shape[0] != b:
        raise ValueError(f"canvas has {canvas.shape[0]} rows, block {b}")
    x = _fused_input(params, cfg, block, canvas, embeds)
    h, kv_s, kv_f = backbone(params, cfg, x, cache.positions(lb + l), fused_vis(cfg, b, lb, l, cache=cache), cache,
                             encoder=True, collect_kv=True, decoder_from=lb, out_from=lb)
    return logits(params, cfg, h, capped), cache.write(kv_s, kv_f) if write else (kv_s, kv_f)


def decode(params: dict, cfg: DiffusionGemmaConfig, canvas: jax.Array, cache: HybridKVCache, *,
           residual: jax.Array | None = None, embeds: jax.Array | None = None, return_hidden: bool = False,
           capped: bool = True):
    """One denoising forward over the canvas [B, L] -> float32 logits [B, L, V]; the cache is only read.

    residual [B, L, D]: the self-conditioning input z (soft_embed of the previous step); None = no
    self-conditioning (a block's first step). embeds [B, L, D]: the whole decoder input (decode/residual.py builds
    it with embed / residual_embed).
    """
    check_tokens(canvas, cfg, "canvas")
    b, l = canvas.shape
    if embeds is not None:
        x = embeds.astype(cfg.jnp_dtype)
    elif residual is not None:
        x = residual_embed(params, cfg, canvas, residual, jnp.ones((b, l), jnp.float32))
    else:
        x = embed(params, cfg, canvas)
    h, _, _ = backbone(params, cfg, x, cache.positions(l), decoder_vis(cfg, b, l, cache), cache, encoder=False)
    out = logits(params, cfg, h, capped)
    return (out, h) if return_hidden else out


def commit(params: dict, cfg: DiffusionGemmaConfig, block: jax.Array, cache: HybridKVCache) -> HybridKVCache:
    """Encode the finished block [B, L] causally after the cache and write its K/V (one forward)."""
    check_tokens(block, cfg, "block")
    b, l = block.shape
    _, kv_s, kv_f = backbone(params, cfg, token_embed(params, cfg, block), cache.positions(l),
                             encoder_vis(cfg, b, l, cache=cache), cache, encoder=True, collect_kv=True)
    return cache.write(kv_s, kv_f)


def forward(params: dict, cfg: DiffusionGemmaConfig, tokens: jax.Array, *, mask: jax.Array | None = None,
            sliding_mask: jax.Array | None = None, positions: jax.Array | None = None,
            embeds: jax.Array | None = None, return_hidden: bool = False, remat: bool = False):
    """Cache-free encoder pass over whole sequences -> float32 logits [B, L, V] (and the hidden states).

    Default visibility: causal, with the sliding window on sliding layers. mask [B, L, L] replaces the full layers'
    visibility; sliding_mask [B, L, L] the sliding layers' (default: mask & the window by position).
    """
    check_tokens(tokens, cfg)
    b, l = tokens.shape
    positions = causal_segments(b, l) if positions is None else positions
    if mask is None:
        vis = encoder_vis(cfg, b, l)
        if sliding_mask is not None:
            vis[SLIDING] = sliding_mask
    else:
        vis = {FULL: mask, SLIDING: mask & window_mask(positions, positions, cfg.sliding_window)
               if sliding_mask is None else sliding_mask}
    x = token_embed(params, cfg, tokens) if embeds is None else embeds.astype(cfg.jnp_dtype)
    h, _, _ = backbone(params, cfg, x, positions, vis, encoder=True, remat=remat)
    out = logits(params, cfg, h)
    return (out, h) if return_hidden else out
