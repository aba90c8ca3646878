"""DiffusionGemma's frozen config, its presets, and its Hugging Face config.json / generation_config.json mapping.

The Gemma 4 text backbone as a block-diffusion model (orl_jax/model/diffusion_gemma.py). Hashable, so it is passed to
jitted functions as a static argument, as ModelConfig is (orl_jax/config.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from orl_jax.checks import int_at_least
from orl_jax.config import CACHED_ATTENTION_IMPLS, DTYPES

SLIDING, FULL = "sliding_attention", "full_attention"


@dataclass(frozen=True)
class RopeConfig:
    """One layer type's RoPE, as in config.json's rope_parameters[layer_type]."""

    rope_type: str = "default"  # "default" | "proportional" (Gemma 4 full layers: only a fraction rotates)
    theta: float = 10_000.0
    partial_rotary_factor: float = 1.0
    factor: float = 1.0  # frequency divisor of proportional RoPE

    def __post_init__(self):
        if self.rope_type not in ("default", "proportional"):
            raise ValueError(f"rope_type={self.rope_type!r} is not supported (only 'default' and 'proportional')")
        if not self.theta > 0 or not self.factor > 0:
            raise ValueError(f"rope theta and factor must be > 0, got theta={self.theta}, factor={self.factor}")
        if not 0.0 < self.partial_rotary_factor <= 1.0:
            raise ValueError(f"partial_rotary_factor must be in (0, 1], got {self.partial_rotary_factor}")
        if self.rope_type == "default" and (self.partial_rotary_factor != 1.0 or self.factor != 1.0):
            # transformers' default RoPE with partial < 1 yields cos/sin shorter than the head: unusable in Gemma 4
            raise ValueError("rope_type='default' supports only partial_rotary_factor=1 and factor=1")

    @classmethod
    def from_hf(cls, d: dict, layer_type: str) -> RopeConfig:
        if not isinstance(d, dict):
            raise ValueError(f"config.json rope_parameters[{layer_type!r}] must be a dict, got {d!r}")
        unknown = set(d) - {"rope_type", "type", "rope_theta", "partial_rotary_factor", "factor"}
        if unknown:
            raise ValueError(f"config.json rope_parameters[{layer_type!r}] has unsupported keys {sorted(unknown)}")
        return cls(rope_type=d.get("rope_type", d.get("type", "default")), theta=float(d.get("rope_theta", 10_000.0)),
                   partial_rotary_factor=float(d.get("partial_rotary_factor", 1.0)), factor=float(d.get("factor", 1.0)))

    def to_hf(self) -> dict:
        d: dict[str, Any] = {"rope_type": self.rope_type, "rope_theta": self.theta}
        if self.rope_type == "proportional":
            d["partial_rotary_factor"] = self.partial_rotary_factor
            if self.factor != 1.0:
                d["factor"] = self.factor
        return d


_DG_DEFAULT_LAYERS = ((SLIDING,) * 5 + (FULL,)) * 5


@dataclass(frozen=True)
class DiffusionGemmaConfig:
    """DiffusionGemma-26B-A4B by default (METHOD.md §5). Field names follow transformers' DiffusionGemmaTextConfig
    where they exist; the full-attention layers' shape lives in `global_*` (HF: global_head_dim /
    num_global_key_value_heads, or per_layer_config in newer transformers)."""

    vocab_size: int = 262_144
    hidden_size: int = 2816  # D
    num_layers: int = 30
    num_heads: int = 16  # N (both layer types)
    num_kv_heads: int = 8  # K of the sliding layers
    head_dim: int = 256  # H of the sliding layers
    num_global_kv_heads: int = 2  # K of the full layers (their K projection doubles as V: K = V)
    global_head_dim: int = 512  # H of the full layers
    # Kept for config.json; DiffusionGemma's full layers share K and V whatever it says (transformers' DG attention
    # has no v_proj on full layers), and num_global_kv_heads is used ungated, as transformers >= 5.24 does.
    attention_k_eq_v: bool = True
    intermediate_size: int = 2112  # F of the dense MLP and of the self-conditioning block
    num_experts: int = 128  # E
    top_k_experts: int = 8
    moe_intermediate_size: int = 704  # F of each expert
    # Expert dispatch (model/moe.py): "bucketed" (capacity buckets at decode sizes, further rounds on overflow),
    # "pallas" (rows sorted by expert through kernels/grouped_gemm, expert weights read in place from the layer
    # stack), "dense" (every token through every expert) or "auto": pallas on a GPU, bucketed elsewhere and in
    # generate() over a multi-device mesh (see kernel_choice). All exact; a runtime choice, not saved to
    # config.json. At full size on one H200 a 256-token decoder forward took 22.7 ms with "pallas", 29.9 with the
    # buckets through the small-M kernel (removed), 53.1 bucketed
    # (benchmarks/results/2026-11-30_dg_in_place_h200x2.md, 2026-11-30_diffusion_gemma_h200x2.md).
    moe_impl: str = "auto"
    # Attention of the cached passes (decoder over the prompt's cache, commit): "orl_jax" (the einsums), "pallas"
    # (kernels/decode_attention, scale 1.0, head dims 256 and 512) or "auto": the kernel on a GPU. At full size
    # on an H200 the forward took 19.22 ms with the kernel's wide-head blocks against 19.60 with the einsums
    # (benchmarks/results/2026-11-30_dg_in_place_h200x2.md). "xla" / "cudnn" as for ModelConfig (cudnn: the sliding
    # layers; the 512-wide full heads take the einsums).
    cached_attention_impl: str = "auto"
    sliding_window: int = 1024  # keys per query in sliding layers, the query included
    layer_types: tuple[str, ...] = _DG_DEFAULT_LAYERS  # must repeat (k sliding, 1 full); see diffusion_gemma.py
    rope_sliding: RopeConfig = RopeConfig("default", 10_000.0)
    rope_full: RopeConfig = RopeConfig("proportional", 1_000_000.0, 0.25)
    rms_norm_eps: float = 1e-6
    final_logit_softcapping: float | None = 30.0
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 262_144
    block_length: int = 256  # HF canvas_length: the canvas of the diffusion decoder
    dtype: str = "bfloat16"
    # Generation defaults (generation_config.json; transformers' global defaults when absent).
    max_denoising_steps: int = 48
    t_max: float = 0.8
    t_min: float = 0.4
    entropy_bound: float = 0.1
    stability_threshold: int = 1
    confidence_threshold: float = 0.005
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = 0
    bos_token_id: int | None = 2
    # Multimodal ids of the checkpoint. Image inputs are not supported: prompts holding image_token_id are refused.
    image_token_id: int | None = 258_880
    boi_token_id: int | None = 255_999
    eoi_token_id: int | None = 258_882
    # The checkpoint's vision_config, carried through untouched (JSON text, hashable) so an export's config.json
    # loads in transformers; the vision tower itself is not loaded.
    vision_config_json: str | None = None

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                     "num_global_kv_heads", "global_head_dim", "intermediate_size", "num_experts", "top_k_experts",
                     "moe_intermediate_size", "sliding_window", "max_position_embeddings", "block_length",
                     "max_denoising_steps"):
            int_at_least(f"DiffusionGemmaConfig.{name}", getattr(self, name))
        for name in ("num_kv_heads", "num_global_kv_heads"):
            if self.num_heads % getattr(self, name):
                raise ValueError(f"DiffusionGemmaConfig.num_heads={self.num_heads} must be a multiple of "
                                 f"{name}={getattr(self, name)}")
        for name in ("head_dim", "global_head_dim"):
            if getattr(self, name) % 2:
                raise ValueError(f"DiffusionGemmaConfig.{name} must be even for RoPE, got {getattr(self, name)}")
        if self.moe_impl not in ("auto", "bucketed", "pallas", "dense"):
            raise ValueError(f"DiffusionGemmaConfig.moe_impl must be 'auto', 'bucketed', 'pallas' or 'dense', "
                             f"got {self.moe_impl!r}")
        if self.cached_attention_impl not in CACHED_ATTENTION_IMPLS:
            raise ValueError(f"DiffusionGemmaConfig.cached_attention_impl must be one of {CACHED_ATTENTION_IMPLS}, "
                             f"got {self.cached_attention_impl!r}")
        if self.top_k_experts > self.num_experts:
            raise ValueError(f"DiffusionGemmaConfig.top_k_experts={self.top_k_experts} exceeds "
                             f"num_experts={self.num_experts}")
        if not isinstance(self.layer_types, tuple) or len(self.layer_types) != self.num_layers:
            raise ValueError(f"DiffusionGemmaConfig.layer_types must be a tuple of num_layers={self.num_layers} "
                             f"entries, got {self.layer_types!r}")
        k = self.layer_types.index(FULL) if FULL in self.layer_types else -1
        if k < 1 or self.layer_types != ((SLIDING,) * k + (FULL,)) * (self.num_layers // (k + 1)):
            raise ValueError("DiffusionGemmaConfig.layer_types must repeat k >= 1 'sliding_attention' layers followed "
                             f"by one 'full_attention' layer (5:1 in DiffusionGemma), got {self.layer_types!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"DiffusionGemmaConfig.dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.final_logit_softcapping is not None and not self.final_logit_softcapping > 0:
            raise ValueError(f"DiffusionGemmaConfig.final_logit_softcapping must be > 0 or None, "
                             f"got {self.final_logit_softcapping!r}")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"DiffusionGemmaConfig.rms_norm_eps must be > 0, got {self.rms_norm_eps!r}")
        if not (isinstance(self.t_min, (int, float)) and isinstance(self.t_max, (int, float))
                and 0 < self.t_min <= self.t_max):
            raise ValueError(f"DiffusionGemmaConfig needs 0 < t_min <= t_max, got t_min={self.t_min!r}, "
                             f"t_max={self.t_max!r}")
        if not self.entropy_bound > 0:
            raise ValueError(f"DiffusionGemmaConfig.entropy_bound must be > 0, got {self.entropy_bound!r}")
        if not isinstance(self.stability_threshold, int) or self.stability_threshold < 0:
            raise ValueError(f"DiffusionGemmaConfig.stability_threshold must be an int >= 0, "
                             f"got {self.stability_threshold!r}")
        if not self.confidence_threshold >= 0:
            raise ValueError(f"DiffusionGemmaConfig.confidence_threshold must be >= 0, "
                             f"got {self.confidence_threshold!r}")
        for name in ("pad_token_id", "bos_token_id"):
            t = getattr(self, name)
            if t is not None and not 0 <= t < self.vocab_size:
                raise ValueError(f"DiffusionGemmaConfig.{name}={t} is outside the vocabulary [0, {self.vocab_size})")
        for t in self.eos_token_ids:
            if not 0 <= t < self.vocab_size:
                raise ValueError(f"DiffusionGemmaConfig.eos_token_ids contains {t}, outside [0, {self.vocab_size})")

    # --- what the engine and the residual forms read (same names as ModelConfig) ---
    noise = "uniform"  # the canvas starts as uniform random tokens and is re-noised
    mask_token_id = None
    prefix_attention = "causal"  # committed blocks are encoded causally (DiffusionGemma's encoder)
    has_adapter = True  # the self-conditioning block plays the adapter g_phi
    self_conditioning = True  # generate() defaults to feeding the previous step back (ORLResidual, w = 1)

    @property
    def jnp_dtype(self):
        return DTYPES[self.dtype]

    @property
    def sliding_per_group(self) -> int:
        """k: sliding layers before each full layer."""
        return self.layer_types.index(FULL)

    @property
    def num_groups(self) -> int:
        return self.num_layers // (self.sliding_per_group + 1)

    def layer_indices(self, layer_type: str) -> tuple[int, ...]:
        """HF layer indices of one type, in stacking order."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == layer_type)

    def sampler_options(self) -> dict[str, Any]:
        """UniformSampler arguments from the generation defaults."""
        return {"t_max": self.t_max, "t_min": self.t_min, "max_denoising_steps": self.max_denoising_steps,
                "entropy_bound": self.entropy_bound, "stability": self.stability_threshold,
                "confidence": self.confidence_threshold}

    def replace(self, **kw) -> DiffusionGemmaConfig:
        return dataclasses.replace(self, **kw)

    # --- config.json / generation_config.json ---
    @classmethod
    def from_hf_config(cls, hf: dict[str, Any], generation: dict[str, Any] | None = None,
                       dtype: str = "bfloat16") -> DiffusionGemmaConfig:
        """From a parsed DiffusionGemmaForBlockDiffusion config.json (+ generation_config.json, optional)."""
        if not isinstance(hf, dict):
            raise TypeError(f"hf config must be a dict (parsed config.json), got {type(hf).__name__}")
        if hf.get("model_type") != "diffusion_gemma":
            raise ValueError(f"config.json model_type={hf.get('model_type')!r} is not 'diffusion_gemma'")
        tc = hf.get("text_config")
        if not isinstance(tc, dict):
            raise ValueError("config.json of a diffusion_gemma model needs a text_config section")
        if tc.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
            raise ValueError(f"config.json text_config.hidden_activation={tc['hidden_activation']!r} is not "
                             "supported (only 'gelu_pytorch_tanh')")
        if tc.get("attention_bias", False):
            raise ValueError("config.json text_config.attention_bias=true is not supported")
        if tc.get("use_bidirectional_attention") not in (None, "vision"):
            raise ValueError(f"config.json text_config.use_bidirectional_attention="
                             f"{tc['use_bidirectional_attention']!r} is not supported (None or 'vision': text is "
                             "causal either way)")
        for key in ("num_experts", "top_k_experts", "moe_intermediate_size"):
            if tc.get(key) is None:
                raise ValueError(f"config.json text_config.{key} is missing (DiffusionGemma always runs its MoE)")
        n = tc.get("num_hidden_layers", 30)
        layer_types = list(tc.get("layer_types") or [SLIDING if (i + 1) % 6 else FULL for i in range(n)])
        if layer_types:
            layer_types[-1] = FULL  # transformers forces the last layer to full attention
        bad = sorted(set(layer_types) - {SLIDING, FULL})
        if bad:
            raise ValueError(f"config.json text_config.layer_types has unsupported entries {bad}")
        heads, kv = tc.get("num_attention_heads", 8), tc.get("num_key_value_heads", 4)
        head_dim = tc.get("head_dim", 256)
        g_head_dim = tc.get("global_head_dim", 512)
        g_kv = tc.get("num_global_key_value_heads") or kv
        if "per_layer_config" in tc:  # transformers >= 5.24 writes the overrides per layer index
            per = {int(i): v for i, v in tc["per_layer_config"].items()}
            full = [i for i, t in enumerate(layer_types) if t == FULL]
            if set(per) - set(full):
                raise ValueError("config.json per_layer_config overrides sliding layers "
                                 f"{sorted(set(per) - set(full))}")
            shapes = {(per.get(i, {}).get("head_dim", head_dim), per.get(i, {}).get("num_key_value_heads", kv))
                      for i in full}
            if len(shapes) != 1:
                raise ValueError(f"config.json per_layer_config gives full layers different shapes {sorted(shapes)}")
            (g_head_dim, g_kv), = shapes
        rope = tc.get("rope_parameters") or {}
        rope_s = RopeConfig.from_hf(rope.get(SLIDING, {"rope_type": "default", "rope_theta": 10_000.0}), SLIDING)
        rope_f = RopeConfig.from_hf(rope.get(FULL, {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                                    "rope_theta": 1_000_000.0}), FULL)
        gen = dict(generation or {})
        sampler = gen.get("sampler_config") or {}
        eos = gen.get("eos_token_id")
        if eos is None:
            eos = tc.get("eos_token_id", hf.get("eos_token_id"))
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        import json

        pick = lambda d, k, default: default if d.get(k) is None else d[k]
        vision = hf.get("vision_config")
        return cls(
            vocab_size=tc.get("vocab_size", 262_144), hidden_size=tc.get("hidden_size", 2304), num_layers=n,
            num_heads=heads, num_kv_heads=kv, head_dim=head_dim, num_global_kv_heads=g_kv, global_head_dim=g_head_dim,
            attention_k_eq_v=bool(tc.get("attention_k_eq_v", True)),
            intermediate_size=tc.get("intermediate_size", 9216), num_experts=tc["num_experts"],
            top_k_experts=tc["top_k_experts"], moe_intermediate_size=tc["moe_intermediate_size"],
            sliding_window=tc.get("sliding_window", 512), layer_types=tuple(layer_types), rope_sliding=rope_s,
            rope_full=rope_f, rms_norm_eps=float(tc.get("rms_norm_eps", 1e-6)),
            final_logit_softcapping=tc.get("final_logit_softcapping", 30.0),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", tc.get("tie_word_embeddings", True))),
            max_position_embeddings=tc.get("max_position_embeddings", 131_072),
            block_length=hf.get("canvas_length") or 256, dtype=dtype,
            max_denoising_steps=pick(gen, "max_denoising_steps", 48), t_max=pick(gen, "t_max", 0.8),
            t_min=pick(gen, "t_min", 0.4), entropy_bound=pick(sampler, "entropy_bound", 0.1),
            stability_threshold=pick(gen, "stability_threshold", 1),
            confidence_threshold=pick(gen, "confidence_threshold", 0.005), eos_token_ids=eos_ids,
            pad_token_id=pick(gen, "pad_token_id", tc.get("pad_token_id", 0)),
            bos_token_id=pick(gen, "bos_token_id", tc.get("bos_token_id", 2)),
            image_token_id=hf.get("image_token_id", 258_880), boi_token_id=hf.get("boi_token_id", 255_999),
            eoi_token_id=hf.get("eoi_token_id", 258_882),
            vision_config_json=None if vision is None else json.dumps(vision, sort_keys=True))

    def to_hf_config(self) -> dict[str, Any]:
        """config.json of a DiffusionGemmaForBlockDiffusion (release-style keys: global_head_dim,
        num_global_key_value_heads; every transformers >= 5.17 reads them)."""
        import json

        eos = list(self.eos_token_ids)
        rope = {SLIDING: self.rope_sliding.to_hf(), FULL: self.rope_full.to_hf()}
        text = {
            "model_type": "diffusion_gemma_text", "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim, "global_head_dim": self.global_head_dim,
            "num_global_key_value_heads": self.num_global_kv_heads, "attention_k_eq_v": self.attention_k_eq_v,
            "enable_moe_block": True, "num_experts": self.num_experts, "top_k_experts": self.top_k_experts,
            "moe_intermediate_size": self.moe_intermediate_size, "hidden_activation": "gelu_pytorch_tanh",
            "sliding_window": self.sliding_window, "layer_types": list(self.layer_types), "rope_parameters": rope,
            "rms_norm_eps": self.rms_norm_eps, "final_logit_softcapping": self.final_logit_softcapping,
            "max_position_embeddings": self.max_position_embeddings, "attention_bias": False,
            "use_bidirectional_attention": None, "tie_word_embeddings": self.tie_word_embeddings,
            "pad_token_id": self.pad_token_id, "bos_token_id": self.bos_token_id,
            "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
        }
        return {
            "architectures": ["DiffusionGemmaForBlockDiffusion"], "model_type": "diffusion_gemma",
            "text_config": text,
            "vision_config": None if self.vision_config_json is None else json.loads(self.vision_config_json),
            "canvas_length": self.block_length, "tie_word_embeddings": self.tie_word_embeddings,
            "image_token_id": self.image_token_id, "boi_token_id": self.boi_token_id,
            "eoi_token_id": self.eoi_token_id, "dtype": self.dtype,
        }

    def to_hf_generation_config(self) -> dict[str, Any]:
        """generation_config.json of transformers' DiffusionGemmaGenerationConfig."""
        eos = list(self.eos_token_ids)
        return {
            "max_denoising_steps": self.max_denoising_steps, "t_max": self.t_max, "t_min": self.t_min,
            "sampler_config": {"_cls_name": "EntropyBoundSamplerConfig", "entropy_bound": float(self.entropy_bound)},
            "stability_threshold": self.stability_threshold,
            "confidence_threshold": float(self.confidence_threshold),
            "eos_token_id": eos[0] if len(eos) == 1 else (eos or None), "pad_token_id": self.pad_token_id,
            "bos_token_id": self.bos_token_id,
        }


DG_PRESETS: dict[str, DiffusionGemmaConfig] = {"diffusiongemma-26b-a4b": DiffusionGemmaConfig()}
# Tiny test preset: 2 groups of (2 sliding + 1 full), a window of 4 (shorter than the canvas and the prompts, so the
# window matters), 8 experts top-3, full layers with fewer and wider K/V heads than the sliding ones.
DG_PRESETS["tiny-dg"] = DG_PRESETS["diffusiongemma-26b-a4b"].replace(
    vocab_size=256, hidden_size=32, num_layers=6, num_heads=4, num_kv_heads=2, head_dim=8, num_global_kv_heads=1,
    global_head_dim=16, intermediate_size=48, num_experts=8, top_k_experts=3, moe_intermediate_size=16,
    sliding_window=4, layer_types=((SLIDING,) * 2 + (FULL,)) * 2, max_position_embeddings=512, block_length=8,
    dtype="float32", image_token_id=250, boi_token_id=251, eoi_token_id=252)
