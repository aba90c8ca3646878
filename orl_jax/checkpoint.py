"""Orbax export / import of model params (plus the config they belong to).

Layout of an exported directory: `config.json` (the HF-style config, see config.to_hf_config) and `params/`
(an orbax StandardCheckpointer tree). Restores go straight to the requested shardings. The whole directory is
built under a temporary name and renamed into place, so it is either complete or absent.
Training checkpoints (optimizer, data iterator, RNG) are managed by train/ckpt.py (an orbax CheckpointManager).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import jax
import orbax.checkpoint as ocp
from jax.sharding import Mesh

from orl_jax import params as P
from orl_jax.atomic import atomic_directory
from orl_jax.config import ModelConfig, from_hf_config, to_hf_config
from orl_jax.model import qwen3


def save_params(directory: str | os.PathLike, cfg: ModelConfig, params: dict, *, overwrite: bool = False) -> Path:
    directory = Path(directory).absolute()
    P.check_tree(params, qwen3.param_specs(cfg))
    with atomic_directory(directory, overwrite) as tmp:
        with ocp.StandardCheckpointer() as ckptr:
            ckptr.save(tmp / "params", params)
            ckptr.wait_until_finished()
        meta = {"dtype": cfg.dtype, "param_dtype": cfg.param_dtype}
        (tmp / "config.json").write_text(json.dumps(to_hf_config(cfg) | meta, indent=2))
    return directory


def load_params(directory: str | os.PathLike, *, dtype: str | None = None, param_dtype: str | None = None,
                mesh: Mesh | None = None) -> tuple[ModelConfig, dict]:
    """Restore (config, params); `dtype` / `param_dtype` override the saved compute / storage dtypes (a
    `dtype` alone stores the weights in it too), `mesh` shards the restored arrays."""
    directory = Path(directory).absolute()
    cfg_file = directory / "config.json"
    if not cfg_file.exists() or not (directory / "params").exists():
        raise ValueError(f"{str(directory)!r} is not an orl_jax params export (needs config.json and params/)")
    hf = json.loads(cfg_file.read_text())
    cfg = from_hf_config(hf, dtype=dtype or hf.get("dtype", "bfloat16"))
    cfg = cfg.replace(param_dtype=param_dtype or (None if dtype else hf.get("param_dtype")))
    specs = qwen3.param_specs(cfg)
    target = P.abstract(specs)
    if mesh is not None:
        target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                              target, P.shardings(specs, mesh))
    else:
        dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=dev), target)
    with ocp.StandardCheckpointer() as ckptr:
        params = ckptr.restore(directory / "params", target)
    P.check_tree(params, specs, where=str(directory))
    return cfg, params
