"""Frozen model configs, presets, and the Hugging Face config.json mapping.

A ModelConfig is hashable, so it is passed to jitted functions as a static argument. The same class describes a
plain Qwen3 (autoregressive) and QwenDLM (the Qwen3 backbone as a block-diffusion model): the diffusion fields
are inert for causal use.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

import jax
import jax.numpy as jnp

from orl_jax.checks import int_at_least

CACHED_ATTENTION_IMPLS = ("auto", "orl_jax", "pallas", "xla", "cudnn")  # of cached passes (model/attention.py)

NoiseMode = Literal["uniform", "mask"]
PrefixAttention = Literal["causal", "block_causal"]

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclass(frozen=True)
class ModelConfig:
    # --- backbone (Qwen3) ---
    vocab_size: int = 151936
    hidden_size: int = 2560  # D
    num_layers: int = 36
    num_heads: int = 32  # N
    num_kv_heads: int = 8  # K
    head_dim: int = 128  # H; Qwen3 sets it explicitly (hidden_size / num_heads need not equal it)
    intermediate_size: int = 9728  # F
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 40960
    dtype: str = "bfloat16"  # activation (compute) dtype; softmax and norms always run in float32
    # Storage dtype of the weights (None: same as dtype). Mixed-precision training keeps float32 master weights
    # (param_dtype="float32") and computes in bfloat16: every weight is cast to `dtype` where it is used.
    param_dtype: str | None = None
    # Attention of passes without a KV cache (training, replay): "orl_jax" (scores materialized in float32, the
    # parity reference) or jax.nn.dot_product_attention with implementation "xla" or "cudnn" (fused flash
    # attention on NVIDIA GPUs; bf16/fp16 only). Cached passes (prefill, decode, commit) use cached_attention_impl.
    attention_impl: Literal["orl_jax", "xla", "cudnn"] = "orl_jax"
    # Attention of passes with a KV cache: "orl_jax" (the reference einsums), "pallas" (the fused kernel in
    # kernels/decode_attention; interpret mode on CPU; shapes it does not support fall back to orl_jax's) or
    # "auto": pallas on a GPU, orl_jax elsewhere and in generate() over a multi-device mesh (see kernel_choice). On one
    # H200 the kernel makes a Qwen3-4B denoising step 4.24 ms instead of 4.47 (block 32) and 6.98 instead of 7.78
    # (canvas 256): benchmarks/results/2026-11-30_engine_step_h200x2.md. "xla" / "cudnn": jax.nn.dot_product_attention
    # over the cache and the pass's own keys concatenated (model/attention.py); cudnn not yet timed in the engine.
    cached_attention_impl: Literal["auto", "orl_jax", "pallas", "xla", "cudnn"] = "auto"
    # Projections (q/k/v, o, gate/up, down) of cached passes with at most 64 rows (denoising steps and commits at
    # batch 1): "xla" (jnp.einsum: cuBLAS on GPU) or "pallas" (kernels/small_m_gemm's split-K weight-streaming
    # GEMM, reading each layer's weight in place from the stack; single device, unsharded weights).
    cached_matmul_impl: Literal["xla", "pallas"] = "xla"
    # Layers per iteration of the layer scan in cached passes (lax.scan's unroll): 1 compiles one layer body;
    # num_layers unrolls the whole stack. None (default): generate() unrolls the stack where it runs the loop in CUDA
    # graphs on a GPU (one device, plain calls: engine._generate) and scans one body everywhere else. On one H200
    # (Qwen3-4B) the unrolled generate() is 4-5% faster (0.270 vs 0.282 s at block 32, 0.290 vs 0.305 s at canvas
    # 256) and its first call compiles in 11-12 s per program instead of 2.5-3 s with an empty cache, 2 s instead of
    # 1 s with a warm one (benchmarks/results/2026-11-30_engine_unroll_default_h200x2.md). Partial unrolls are
    # refused: lax.scan's unroll=4 and a scan over groups of 4 or 12 layers both took 7.1-7.3 ms at block 32
    # (benchmarks/results/2026-11-30_engine_variants_h200x2.md).
    layer_unroll: int | None = None
    # --- block diffusion (QwenDLM); inert for a causal model ---
    # uniform: the canvas starts as random tokens and is re-noised (DiffusionGemma's recipe, our reading for
    # QwenDLM); mask: the canvas starts as [MASK] tokens (LLaDA / SDAR style).
    noise: NoiseMode = "uniform"
    mask_token_id: int | None = None  # required for noise="mask"; from config.json or the tokenizer
    block_length: int = 32
    # How committed tokens attend among themselves. "causal": the encoder is the unchanged AR model
    # (DiffusionGemma's encoder). "block_causal": bidirectional inside each committed block (SDAR / BD3-LM).
    prefix_attention: PrefixAttention = "causal"
    # Residual adapter g_phi (0 = none). Its down projection starts at zero so a converted model is exactly the AR
    # model until trained.
    adapter_hidden: int = 0
    adapter_act: Literal["silu", "gelu_tanh"] = "silu"
    # Where a canvas position's logits come from. False: its own row. True ("AR shift", Dream / Fast-dLLM v2): the
    # row before it, and for a block's first position the last committed token's row, so a converted model keeps
    # its AR next-token head: that first position is predicted exactly as the AR model would.
    logit_shift: bool = False
    # Token ids from the tokenizer / generation_config (never hard-coded in the engine).
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                     "intermediate_size", "block_length", "max_position_embeddings"):
            int_at_least(f"ModelConfig.{name}", getattr(self, name))
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"ModelConfig.num_heads={self.num_heads} must be a multiple of "
                             f"num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim must be even for RoPE, got {self.head_dim}")
        if self.dtype not in DTYPES:
            raise ValueError(f"ModelConfig.dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.param_dtype is not None and self.param_dtype not in DTYPES:
            raise ValueError(f"ModelConfig.param_dtype must be None or one of {sorted(DTYPES)}, "
                             f"got {self.param_dtype!r}")
        if self.attention_impl not in ("orl_jax", "xla", "cudnn"):
            raise ValueError(f"ModelConfig.attention_impl must be 'orl_jax', 'xla' or 'cudnn', "
                             f"got {self.attention_impl!r}")
        if self.cached_attention_impl not in CACHED_ATTENTION_IMPLS:
            raise ValueError(f"ModelConfig.cached_attention_impl must be one of {CACHED_ATTENTION_IMPLS}, "
                             f"got {self.cached_attention_impl!r}")
        if self.cached_matmul_impl not in ("xla", "pallas"):
            raise ValueError(f"ModelConfig.cached_matmul_impl must be 'xla' or 'pallas', "
                             f"got {self.cached_matmul_impl!r}")
        if self.layer_unroll is not None:
            int_at_least("ModelConfig.layer_unroll", self.layer_unroll)
            if 1 < self.layer_unroll < self.num_layers:
                raise ValueError(f"ModelConfig.layer_unroll must be 1 or >= num_layers={self.num_layers} (partial "
                                 f"unrolls were 1.8x slower on GPU), got {self.layer_unroll}")
        if self.noise not in ("uniform", "mask"):
            raise ValueError(f"ModelConfig.noise must be 'uniform' or 'mask', got {self.noise!r}")
        if self.prefix_attention not in ("causal", "block_causal"):
            raise ValueError(f"ModelConfig.prefix_attention must be 'causal' or 'block_causal', "
                             f"got {self.prefix_attention!r}")
        if self.adapter_act not in ("silu", "gelu_tanh"):
            raise ValueError(f"ModelConfig.adapter_act must be 'silu' or 'gelu_tanh', got {self.adapter_act!r}")
        if not isinstance(self.logit_shift, bool):
            raise TypeError(f"ModelConfig.logit_shift must be a bool, got {self.logit_shift!r}")
        if self.adapter_hidden < 0:
            raise ValueError(f"ModelConfig.adapter_hidden must be >= 0, got {self.adapter_hidden}")
        if self.mask_token_id is not None and not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"ModelConfig.mask_token_id={self.mask_token_id} is outside the vocabulary "
                             f"[0, {self.vocab_size})")
        if self.noise == "mask" and self.mask_token_id is None:
            raise ValueError("ModelConfig.noise='mask' needs mask_token_id (from config.json or the tokenizer)")
        for t in self.eos_token_ids:
            if not 0 <= t < self.vocab_size:
                raise ValueError(f"ModelConfig.eos_token_ids contains {t}, outside [0, {self.vocab_size})")

    @property
    def jnp_dtype(self):
        return DTYPES[self.dtype]

    @property
    def jnp_param_dtype(self):
        return DTYPES[self.param_dtype or self.dtype]

    @property
    def has_adapter(self) -> bool:
        return self.adapter_hidden > 0

    def replace(self, **kw) -> ModelConfig:
        return dataclasses.replace(self, **kw)


PRESETS: dict[str, ModelConfig] = {
    "qwen3-0.6b": ModelConfig(hidden_size=1024, num_layers=28, num_heads=16, num_kv_heads=8, head_dim=128,
                              intermediate_size=3072, tie_word_embeddings=True),
    "qwen3-4b": ModelConfig(),
}
# QwenDLM-4B: the 4B backbone, uniform canvas, with the residual adapter (width = D, our choice).
PRESETS["qwendlm-4b"] = PRESETS["qwen3-4b"].replace(adapter_hidden=2560)
# Tiny test presets, derived from the real ones so they exercise the same code paths (GQA 2:1 and 3:1, tied and
# untied heads). float32 so parity with transformers is exact to ~1e-6.
PRESETS["tiny-qwen3"] = PRESETS["qwen3-0.6b"].replace(
    vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128,
    max_position_embeddings=512, dtype="float32")
PRESETS["tiny-qwen3-untied"] = PRESETS["tiny-qwen3"].replace(
    num_heads=6, num_kv_heads=2, head_dim=8, hidden_size=48, num_layers=3, tie_word_embeddings=False)
PRESETS["tiny-qwendlm"] = PRESETS["tiny-qwen3"].replace(adapter_hidden=32, block_length=8, mask_token_id=255)


def preset(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known: {sorted(PRESETS)}")
    return PRESETS[name]


def kernel_choice(impl: str, kernel: str, fallback: str) -> str:
    """An implementation setting made concrete at trace time: "auto" is the Pallas kernel on a GPU backend and the
    XLA path elsewhere (on CPU the kernels only run in the slow interpreter). generate() over a multi-device mesh
    turns "auto" into the XLA path before tracing (xla_for_auto): the kernels have no partitioning rule, so
    sharded weights would be gathered onto every device."""
    if impl != "auto":
        return impl
    return kernel if jax.default_backend() == "gpu" else fallback


def xla_for_auto(cfg):
    """cfg with its "auto" implementation settings set to the XLA paths (for weights sharded over a mesh)."""
    paths = {"cached_attention_impl": "orl_jax", "moe_impl": "bucketed"}
    kw = {name: path for name, path in paths.items() if getattr(cfg, name, None) == "auto"}
    return cfg.replace(**kw) if kw else cfg


# ---------------------------------------------------------------------------------------------------------------
# Hugging Face config.json  <->  ModelConfig
# ---------------------------------------------------------------------------------------------------------------

# Extra keys we write into config.json for a QwenDLM export; transformers ignores unknown keys.
_DLM_KEYS = ("noise", "mask_token_id", "block_length", "prefix_attention", "adapter_hidden", "adapter_act",
             "logit_shift")


def from_hf_config(hf: dict[str, Any], dtype: str = "bfloat16") -> ModelConfig:
    """Build a ModelConfig from a parsed Qwen3 config.json (optionally carrying our `orl_jax` QwenDLM section)."""
    if not isinstance(hf, dict):
        raise TypeError(f"hf config must be a dict (parsed config.json), got {type(hf).__name__}")
    model_type = hf.get("model_type")
    if model_type != "qwen3":
        raise ValueError(f"config.json model_type={model_type!r} is not supported here (expected 'qwen3')")
    if hf.get("attention_bias", False):
        raise ValueError("config.json attention_bias=true is not supported for qwen3 (Qwen3 has no biases)")
    if hf.get("use_sliding_window", False):
        raise ValueError("config.json use_sliding_window=true is not supported for qwen3")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"config.json rope_type={rope_type!r} is not supported (only 'default')")
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json hidden_act={hf.get('hidden_act')!r} is not supported (Qwen3 uses 'silu')")
    eos = hf.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    dlm = hf.get("orl_jax", {})
    unknown = set(dlm) - set(_DLM_KEYS)
    if unknown:
        raise ValueError(f"config.json orl_jax section has unknown keys {sorted(unknown)}")
    num_heads = hf["num_attention_heads"]
    return ModelConfig(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=hf.get("num_key_value_heads", num_heads),
        head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
        intermediate_size=hf["intermediate_size"],
        rope_theta=float(theta),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_position_embeddings=hf.get("max_position_embeddings", 40960),
        dtype=dtype,
        eos_token_ids=eos_ids,
        pad_token_id=hf.get("pad_token_id"),
        mask_token_id=dlm.get("mask_token_id", hf.get("mask_token_id")),
        **{k: dlm[k] for k in _DLM_KEYS if k in dlm and k != "mask_token_id"},
    )


def to_hf_config(cfg: ModelConfig) -> dict[str, Any]:
    """The config.json of a Qwen3ForCausalLM; QwenDLM fields go into an `orl_jax` section."""
    eos = list(cfg.eos_token_ids)
    hf = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "intermediate_size": cfg.intermediate_size,
        "hidden_act": "silu",
        "rope_parameters": {"rope_theta": cfg.rope_theta, "rope_type": "default"},
        "rms_norm_eps": cfg.rms_norm_eps,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "max_position_embeddings": cfg.max_position_embeddings,
        "attention_bias": False,
        "use_sliding_window": False,
        "dtype": cfg.dtype,
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
        "pad_token_id": cfg.pad_token_id,
    }
    defaults = ModelConfig()
    dlm = {k: getattr(cfg, k) for k in _DLM_KEYS if getattr(cfg, k) != getattr(defaults, k)}
    if dlm:
        hf["orl_jax"] = dlm
    return hf
