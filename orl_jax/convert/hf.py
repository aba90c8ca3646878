"""Hugging Face checkpoint directory <-> (ModelConfig, params), one name-map table per architecture.

A table row is (HF name(s), our path, n_in): `{i}` in the HF name is the layer index (our tensor is stacked over
layers), and n_in says how the tensor is laid out — 0: the same array; k > 0: an nn.Linear weight [out, in]
whose `in` part is our first k dims (ours: [*in, *out]). A row with several HF names is a fused weight: the HF
tensors are concatenated along the axis FUSED[path] gives (of the per-layer tensor), each taking the number of
entries FUSED's sizes function says (q/k/v -> [D, K, G+2, H]; gate/up -> [D, 2, F]).

config.json's model_type picks the table: "qwen3" (Qwen3 / QwenDLM: QWEN3_MAP) or "diffusion_gemma"
(DiffusionGemmaForBlockDiffusion: DG_MAP). A `{i}` row fills a stack of layers in order: Qwen3's "layers" holds
all of them, DiffusionGemma's "sliding" / "full" stacks hold the HF layers of that type. DG_MAP also uses the
layout "expert": a stack of per-expert linear weights [E, out, in] (ours: [E, in, out]).
DiffusionGemma checkpoints carry a vision tower, which orl_jax does not support: tensors under
DG_SKIPPED_PREFIXES are skipped by name, and an export writes the text weights only. A tensor that transformers
ties to another (an encoder copy of a decoder weight, a tied lm_head) is accepted only when equal to its twin.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
from jax.sharding import Mesh

from orl_jax import params as P
from orl_jax.atomic import atomic_directory
from orl_jax.config import ModelConfig, from_hf_config, to_hf_config
from orl_jax.convert.safetensors_io import read_checkpoint, write_checkpoint
from orl_jax.diffusion_gemma_config import FULL, SLIDING, DiffusionGemmaConfig
from orl_jax.model.registry import model_module

QWEN3_MAP: list[tuple[str, str, int]] = [
    ("model.embed_tokens.weight", "embed", 0),
    ("model.norm.weight", "final_norm", 0),
    ("lm_head.weight", "lm_head", 0),
    ("model.layers.{i}.input_layernorm.weight", "layers.attn_norm", 0),
    (("model.layers.{i}.self_attn.q_proj.weight", "model.layers.{i}.self_attn.k_proj.weight",
      "model.layers.{i}.self_attn.v_proj.weight"), "layers.qkv", 1),
    ("model.layers.{i}.self_attn.o_proj.weight", "layers.o", 2),
    ("model.layers.{i}.self_attn.q_norm.weight", "layers.q_norm", 0),
    ("model.layers.{i}.self_attn.k_norm.weight", "layers.k_norm", 0),
    ("model.layers.{i}.post_attention_layernorm.weight", "layers.mlp_norm", 0),
    (("model.layers.{i}.mlp.gate_proj.weight", "model.layers.{i}.mlp.up_proj.weight"), "layers.gate_up", 1),
    ("model.layers.{i}.mlp.down_proj.weight", "layers.down", 1),
    # QwenDLM's residual adapter g_phi; transformers' Qwen3ForCausalLM ignores these names when loading.
    ("orl_jax.adapter.norm.weight", "adapter.norm", 0),
    ("orl_jax.adapter.gate_proj.weight", "adapter.gate", 1),
    ("orl_jax.adapter.up_proj.weight", "adapter.up", 1),
    ("orl_jax.adapter.down_proj.weight", "adapter.down", 1),
]

# fused path -> (axis of the per-layer tensor, cfg -> entries each HF tensor takes along it)
FUSED = {
    "layers.qkv": (2, lambda cfg: (cfg.num_heads // cfg.num_kv_heads, 1, 1)),
    "layers.gate_up": (1, lambda cfg: (1, 1)),
    "sliding.qkv": (2, lambda cfg: (cfg.num_heads // cfg.num_kv_heads, 1, 1)),
    "full.qk": (2, lambda cfg: (cfg.num_heads // cfg.num_global_kv_heads, 1)),  # K = V: no v_proj
    "sliding.gate_up": (1, lambda cfg: (1, 1)),
    "full.gate_up": (1, lambda cfg: (1, 1)),
}

# DiffusionGemma: one row per tensor of a decoder layer (HF name under model.decoder.layers.{i}.). The encoder
# shares all of them (transformers ties them) but layer_scalar, a buffer HF does not tie: it has its own row below.
# q / k (/ v) are fused per layer type: full layers have no v_proj (K = V).
_DG_QKV = {"sliding": (("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"), "qkv", 1),
           "full": (("self_attn.q_proj.weight", "self_attn.k_proj.weight"), "qk", 1)}
_DG_LAYER: list[tuple[str | tuple[str, ...], str, int | str]] = [
    ("input_layernorm.weight", "attn_norm", 0),
    ("self_attn.o_proj.weight", "o", 2),
    ("self_attn.q_norm.weight", "q_norm", 0),
    ("self_attn.k_norm.weight", "k_norm", 0),
    ("post_attention_layernorm.weight", "post_attn_norm", 0),
    ("pre_feedforward_layernorm.weight", "mlp_norm", 0),
    (("mlp.gate_proj.weight", "mlp.up_proj.weight"), "gate_up", 1),
    ("mlp.down_proj.weight", "down", 1),
    ("post_feedforward_layernorm_1.weight", "post_mlp_norm", 0),
    ("router.scale", "router_scale", 0),
    ("router.proj.weight", "router", 1),
    ("router.per_expert_scale", "expert_scale", 0),
    ("pre_feedforward_layernorm_2.weight", "moe_norm", 0),
    ("experts.gate_up_proj", "experts_gate_up", "expert"),
    ("experts.down_proj", "experts_down", "expert"),
    ("post_feedforward_layernorm_2.weight", "post_moe_norm", 0),
    ("post_feedforward_layernorm.weight", "post_ffw_norm", 0),
    ("layer_scalar", "layer_scalar", 0),
]


def _dg_layer_names(names: str | tuple[str, ...]) -> str | tuple[str, ...]:
    full = lambda n: f"model.decoder.layers.{{i}}.{n}"  # noqa: E731
    return full(names) if isinstance(names, str) else tuple(map(full, names))


DG_MAP: list[tuple[str | tuple[str, ...], str, int | str]] = [
    ("model.decoder.embed_tokens.weight", "embed", 0),
    ("model.decoder.norm.weight", "final_norm", 0),
    ("lm_head.weight", "lm_head", 0),
    ("model.decoder.self_conditioning.pre_norm.weight", "self_cond.norm", 0),
    ("model.decoder.self_conditioning.gate_proj.weight", "self_cond.gate", 1),
    ("model.decoder.self_conditioning.up_proj.weight", "self_cond.up", 1),
    ("model.decoder.self_conditioning.down_proj.weight", "self_cond.down", 1),
] + [(_dg_layer_names(names), f"{stack}.{ours}", layout)
     for stack in ("sliding", "full") for names, ours, layout in [_DG_QKV[stack], *_DG_LAYER]] + [
    ("model.encoder.language_model.layers.{i}.layer_scalar", f"{stack}.encoder_layer_scalar", 0)
    for stack in ("sliding", "full")]
# The vision tower and its projection into the text model: not supported, skipped by name when loading.
DG_SKIPPED_PREFIXES = ("model.encoder.vision_tower.", "model.encoder.embed_vision.")


@dataclass(frozen=True)
class _Arch:
    table: list
    stacks: Callable  # cfg -> {top-level key of a layer stack: the HF layer indices it holds, in order}
    embed_name: str  # the HF embedding that a tied lm_head.weight must equal
    skipped: tuple[str, ...] = ()  # HF name prefixes deliberately not loaded
    tied: tuple[tuple[str, str], ...] = ()  # (prefix of a redundant HF copy, prefix of the tensor it duplicates)


_QWEN3 = _Arch(QWEN3_MAP, lambda cfg: {"layers": tuple(range(cfg.num_layers))},
               "model.embed_tokens.weight")
_DG = _Arch(DG_MAP, lambda cfg: {"sliding": cfg.layer_indices(SLIDING), "full": cfg.layer_indices(FULL)},
            "model.decoder.embed_tokens.weight", DG_SKIPPED_PREFIXES,
            (("model.encoder.language_model.", "model.decoder."),))


def _arch(cfg) -> _Arch:
    if isinstance(cfg, ModelConfig):
        return _QWEN3
    if isinstance(cfg, DiffusionGemmaConfig):
        return _DG
    raise TypeError(f"no Hugging Face name map for config type {type(cfg).__name__}")


_NP_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


def _get(tree: dict, path: str):
    for k in path.split("."):
        if not isinstance(tree, dict) or k not in tree:
            return None
        tree = tree[k]
    return tree


def _set(tree: dict, path: str, value) -> None:
    *head, last = path.split(".")
    for k in head:
        tree = tree.setdefault(k, {})
    tree[last] = value


def _to_ours(a: np.ndarray, n_in: int | str, shape: tuple[int, ...]) -> np.ndarray:
    if n_in == "expert":
        return np.swapaxes(a, -1, -2).reshape(shape)
    return a if n_in == 0 else a.T.reshape(shape)


def _to_hf(a: np.ndarray, n_in: int | str) -> np.ndarray:
    if n_in == "expert":
        return np.swapaxes(a, -1, -2)
    return a if n_in == 0 else a.reshape(math.prod(a.shape[:n_in]), -1).T


def read_config(directory: str | os.PathLike, dtype: str = "bfloat16") -> ModelConfig | DiffusionGemmaConfig:
    directory = Path(directory)
    cfg_path = directory / "config.json"
    if not cfg_path.exists():
        raise ValueError(f"{directory}: no config.json (not a Hugging Face checkpoint directory)")
    hf = json.loads(cfg_path.read_text())
    gen_path = directory / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.exists() else {}
    if hf.get("model_type") == "diffusion_gemma":
        if dtype not in _NP_DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_NP_DTYPES)}, got {dtype!r}")
        return DiffusionGemmaConfig.from_hf_config(hf, gen, dtype=dtype)
    if "eos_token_id" in gen:
        hf["eos_token_id"] = gen["eos_token_id"]  # generation_config's EOS list is the one generation uses
    return from_hf_config(hf, dtype=dtype)


def load_hf(directory: str | os.PathLike, dtype: str = "bfloat16", *, mesh: Mesh | None = None,
            allow_pickle: bool = False) -> tuple[ModelConfig | DiffusionGemmaConfig, dict]:
    """Load a local HF Qwen3 / QwenDLM / DiffusionGemma directory into (config, params) in `dtype`.

    Raises ValueError naming any missing, unexpected or wrongly shaped tensor. With a mesh, each weight is placed
    sharded by its logical axes.
    """
    directory = Path(directory)
    if dtype not in _NP_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_NP_DTYPES)}, got {dtype!r}")
    if not directory.is_dir():
        raise ValueError(f"checkpoint directory {str(directory)!r} does not exist")
    cfg = read_config(directory, dtype)
    tensors = read_checkpoint(directory, allow_pickle)
    arch = _arch(cfg)
    specs = model_module(cfg).param_specs(cfg)
    stacks = arch.stacks(cfg)
    shardings = None if mesh is None else P.shardings(specs, mesh)
    np_dtype = _NP_DTYPES[dtype]
    used: set[str] = set()
    out: dict = {}
    for hf_names, path, n_in in arch.table:
        spec = _get(specs, path)
        if spec is None:
            continue
        hf_names = (hf_names,) if isinstance(hf_names, str) else hf_names
        layered = "{i}" in hf_names[0]
        one_shape = spec.shape[1:] if layered else spec.shape
        axis, sizes = (FUSED[path][0], FUSED[path][1](cfg)) if path in FUSED else (0, None)
        per_layer = []
        for i in stacks[path.split(".")[0]] if layered else (0,):
            parts = []
            for j, hf_name in enumerate(hf_names):
                name = hf_name.format(i=i)
                if name not in tensors:
                    raise ValueError(f"{directory}: checkpoint is missing tensor {name!r}")
                shape = one_shape if sizes is None else one_shape[:axis] + (sizes[j],) + one_shape[axis + 1:]
                hf_shape = _to_hf(np.empty(shape, np.int8), n_in).shape
                a = tensors[name]
                if tuple(a.shape) != tuple(hf_shape):
                    raise ValueError(f"{directory}: tensor {name!r} has shape {tuple(a.shape)}, expected "
                                     f"{tuple(hf_shape)} for this config.json")
                parts.append(_to_ours(a, n_in, shape).astype(np_dtype))
                used.add(name)
            per_layer.append(parts[0] if sizes is None else np.concatenate(parts, axis=axis))
        arr = np.stack(per_layer) if layered else per_layer[0]
        sharding = None if shardings is None else _get(shardings, path)
        _set(out, path, jax.device_put(arr, sharding) if sharding is not None else jax.numpy.asarray(arr))
    extra = sorted(n for n in set(tensors) - used if not n.startswith(arch.skipped or ("\0",)))
    if cfg.tie_word_embeddings and "lm_head.weight" in extra:
        if not np.array_equal(tensors["lm_head.weight"], tensors[arch.embed_name]):
            raise ValueError(f"{directory}: tie_word_embeddings=true but lm_head.weight differs from the embedding")
        extra.remove("lm_head.weight")
    for copy_prefix, twin_prefix in arch.tied:
        for name in [n for n in extra if n.startswith(copy_prefix)]:
            twin = twin_prefix + name[len(copy_prefix):]
            if twin in used:
                if not np.array_equal(tensors[name], tensors[twin]):
                    raise ValueError(f"{directory}: tensor {name!r} differs from {twin!r}, which transformers ties "
                                     "it to")
                extra.remove(name)
    if extra:
        raise ValueError(f"{directory}: checkpoint has unexpected tensor {extra[0]!r} ({len(extra)} in all)")
    P.check_tree(out, specs, where=str(directory))
    return cfg, out


def hf_tensors(cfg: ModelConfig | DiffusionGemmaConfig, params: dict) -> dict[str, np.ndarray]:
    """Our params as HF-named host arrays (inverse of load_hf)."""
    arch = _arch(cfg)
    if isinstance(cfg, DiffusionGemmaConfig):
        from orl_jax.model.diffusion_gemma_inference import applied

        if done := applied(params):
            raise ValueError(f"params are DiffusionGemma inference params (diffusion_gemma_inference: "
                             f"{', '.join(done)}): export the model's params, as loaded or trained")
    P.check_tree(params, model_module(cfg).param_specs(cfg))
    stacks = arch.stacks(cfg)
    out = {}
    for hf_names, path, n_in in arch.table:
        leaf = _get(params, path)
        if leaf is None:
            continue
        hf_names = (hf_names,) if isinstance(hf_names, str) else hf_names
        layered = "{i}" in hf_names[0]
        a = np.asarray(jax.device_get(leaf))
        for at, i in enumerate(stacks[path.split(".")[0]] if layered else (0,)):
            t = a[at] if layered else a
            if path in FUSED:
                axis, sizes = FUSED[path][0], FUSED[path][1](cfg)
                parts = np.split(t, np.cumsum(sizes)[:-1], axis=axis)
            else:
                parts = [t]
            for hf_name, part in zip(hf_names, parts):
                out[hf_name.format(i=i)] = _to_hf(part, n_in)
    return out


def save_hf(directory: str | os.PathLike, cfg: ModelConfig | DiffusionGemmaConfig, params: dict, *,
            tokenizer_dir: str | None = None, max_shard_bytes: int = 5 * 2**30, overwrite: bool = False) -> Path:
    """Write an HF directory that transformers' Qwen3ForCausalLM / DiffusionGemmaForBlockDiffusion loads (a
    DiffusionGemma export holds the text weights only). Written to a temporary sibling and renamed into place, so
    an interrupted save never leaves a half-written checkpoint."""
    directory = Path(directory)
    with atomic_directory(directory, overwrite) as tmp:
        write_checkpoint(tmp, hf_tensors(cfg, params), max_shard_bytes)
        if isinstance(cfg, DiffusionGemmaConfig):
            (tmp / "config.json").write_text(json.dumps(cfg.to_hf_config(), indent=2))
            (tmp / "generation_config.json").write_text(json.dumps(cfg.to_hf_generation_config(), indent=2))
        else:
            (tmp / "config.json").write_text(json.dumps(to_hf_config(cfg), indent=2))
        if tokenizer_dir is not None:
            for f in Path(tokenizer_dir).iterdir():
                if f.name.startswith("tokenizer") or f.name in ("special_tokens_map.json", "vocab.json",
                                                                "merges.txt", "chat_template.jinja"):
                    shutil.copy(f, tmp / f.name)
    return directory
