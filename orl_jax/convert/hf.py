"""Hugging Face checkpoint directory <-> (ModelConfig, params), one name-map table per architecture.

A table row is (HF name, our path, n_in): `{i}` in the HF name is the layer index (our tensor is stacked over
layers), and n_in says how the tensor is laid out — 0: the same array; k > 0: an nn.Linear weight [out, in]
whose `in` part is our first k dims (ours: [*in, *out]).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
from jax.sharding import Mesh

from orl_jax import params as P
from orl_jax.config import ModelConfig, from_hf_config, to_hf_config
from orl_jax.convert.safetensors_io import read_checkpoint, write_checkpoint
from orl_jax.model import qwen3

QWEN3_MAP: list[tuple[str, str, int]] = [
    ("model.embed_tokens.weight", "embed", 0),
    ("model.norm.weight", "final_norm", 0),
    ("lm_head.weight", "lm_head", 0),
    ("model.layers.{i}.input_layernorm.weight", "layers.attn_norm", 0),
    ("model.layers.{i}.self_attn.q_proj.weight", "layers.q", 1),
    ("model.layers.{i}.self_attn.k_proj.weight", "layers.k", 1),
    ("model.layers.{i}.self_attn.v_proj.weight", "layers.v", 1),
    ("model.layers.{i}.self_attn.o_proj.weight", "layers.o", 2),
    ("model.layers.{i}.self_attn.q_norm.weight", "layers.q_norm", 0),
    ("model.layers.{i}.self_attn.k_norm.weight", "layers.k_norm", 0),
    ("model.layers.{i}.post_attention_layernorm.weight", "layers.mlp_norm", 0),
    ("model.layers.{i}.mlp.gate_proj.weight", "layers.gate", 1),
    ("model.layers.{i}.mlp.up_proj.weight", "layers.up", 1),
    ("model.layers.{i}.mlp.down_proj.weight", "layers.down", 1),
    # QwenDLM's residual adapter g_phi; transformers' Qwen3ForCausalLM ignores these names when loading.
    ("orl_jax.adapter.norm.weight", "adapter.norm", 0),
    ("orl_jax.adapter.gate_proj.weight", "adapter.gate", 1),
    ("orl_jax.adapter.up_proj.weight", "adapter.up", 1),
    ("orl_jax.adapter.down_proj.weight", "adapter.down", 1),
]

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


def _to_ours(a: np.ndarray, n_in: int, shape: tuple[int, ...]) -> np.ndarray:
    return a if n_in == 0 else a.T.reshape(shape)


def _to_hf(a: np.ndarray, n_in: int) -> np.ndarray:
    return a if n_in == 0 else a.reshape(math.prod(a.shape[:n_in]), -1).T


def read_config(directory: str | os.PathLike, dtype: str = "bfloat16") -> ModelConfig:
    directory = Path(directory)
    cfg_path = directory / "config.json"
    if not cfg_path.exists():
        raise ValueError(f"{directory}: no config.json (not a Hugging Face checkpoint directory)")
    hf = json.loads(cfg_path.read_text())
    gen = directory / "generation_config.json"
    if gen.exists() and "eos_token_id" in (g := json.loads(gen.read_text())):
        hf["eos_token_id"] = g["eos_token_id"]  # generation_config's EOS list is the one generation uses
    return from_hf_config(hf, dtype=dtype)


def load_hf(directory: str | os.PathLike, dtype: str = "bfloat16", *, mesh: Mesh | None = None,
            allow_pickle: bool = False) -> tuple[ModelConfig, dict]:
    """Load a local HF Qwen3 / QwenDLM directory into (config, params) in `dtype` ("bfloat16" or "float32").

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
    specs = qwen3.param_specs(cfg)
    shardings = None if mesh is None else P.shardings(specs, mesh)
    np_dtype = _NP_DTYPES[dtype]
    used: set[str] = set()
    out: dict = {}
    for hf_name, path, n_in in QWEN3_MAP:
        spec = _get(specs, path)
        if spec is None:
            continue
        names = [hf_name.format(i=i) for i in range(cfg.num_layers)] if "{i}" in hf_name else [hf_name]
        one_shape = spec.shape[1:] if "{i}" in hf_name else spec.shape
        parts = []
        for name in names:
            if name not in tensors:
                raise ValueError(f"{directory}: checkpoint is missing tensor {name!r}")
            a = tensors[name]
            hf_shape = _to_hf(np.empty(one_shape, np.int8), n_in).shape
            if tuple(a.shape) != tuple(hf_shape):
                raise ValueError(f"{directory}: tensor {name!r} has shape {tuple(a.shape)}, expected "
                                 f"{tuple(hf_shape)} for this config.json")
            parts.append(_to_ours(a, n_in, one_shape).astype(np_dtype))
            used.add(name)
        arr = np.stack(parts) if "{i}" in hf_name else parts[0]
        sharding = None if shardings is None else _get(shardings, path)
        _set(out, path, jax.device_put(arr, sharding) if sharding is not None else jax.numpy.asarray(arr))
    extra = sorted(set(tensors) - used)
    if cfg.tie_word_embeddings and "lm_head.weight" in extra:
        if not np.array_equal(tensors["lm_head.weight"], tensors["model.embed_tokens.weight"]):
            raise ValueError(f"{directory}: tie_word_embeddings=true but lm_head.weight differs from the embedding")
        extra.remove("lm_head.weight")
    if extra:
        raise ValueError(f"{directory}: checkpoint has unexpected tensor {extra[0]!r} ({len(extra)} in all)")
    P.check_tree(out, specs, where=str(directory))
    return cfg, out


def hf_tensors(cfg: ModelConfig, params: dict) -> dict[str, np.ndarray]:
    """Our params as HF-named host arrays (inverse of load_hf)."""
    P.check_tree(params, qwen3.param_specs(cfg))
    out = {}
    for hf_name, path, n_in in QWEN3_MAP:
        leaf = _get(params, path)
        if leaf is None:
            continue
        a = np.asarray(jax.device_get(leaf))
        if "{i}" in hf_name:
            for i in range(cfg.num_layers):
                out[hf_name.format(i=i)] = _to_hf(a[i], n_in)
        else:
            out[hf_name] = _to_hf(a, n_in)
    return out


def save_hf(directory: str | os.PathLike, cfg: ModelConfig, params: dict, *, tokenizer_dir: str | None = None,
            max_shard_bytes: int = 5 * 2**30, overwrite: bool = False) -> Path:
    """Write an HF directory that transformers' Qwen3ForCausalLM loads. Written to a temporary sibling and renamed
    into place, so an interrupted save never leaves a half-written checkpoint."""
    directory = Path(directory)
    if directory.exists() and any(directory.iterdir()) and not overwrite:
        raise ValueError(f"output directory {str(directory)!r} exists and is not empty (pass overwrite=True)")
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.tmp-", dir=directory.parent))
    try:
        write_checkpoint(tmp, hf_tensors(cfg, params), max_shard_bytes)
        (tmp / "config.json").write_text(json.dumps(to_hf_config(cfg), indent=2))
        if tokenizer_dir is not None:
            for f in Path(tokenizer_dir).iterdir():
                if f.name.startswith("tokenizer") or f.name in ("special_tokens_map.json", "vocab.json",
                                                                "merges.txt", "chat_template.jinja"):
                    shutil.copy(f, tmp / f.name)
        if directory.exists():
            shutil.rmtree(directory)
        os.replace(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return directory
