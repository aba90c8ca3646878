"""A converted base (stage 1's QwenDLM and its tokenizer) as a small Hugging Face directory, to start stage 2 later.

Why: on the lent GPU a run's outputs die with the machine, and stages 0-1 of the h200 preset take ~8 of the 10
minutes a device call may run. Exported as bfloat16 safetensors shards of at most SHARD_BYTES (what a device call
returns), the base comes back, and later runs start stage 2 from that same base, in another session too. Two bases
trained by the same commands differed by 2.7 points (benchmarks/results/2026-11-30_orl_variants_h200x2).

Approximation: the float32 master weights are rounded to bfloat16 once; stage 2 trains float32 copies of those, and
the run's evaluation measures the imported base itself. An imported run has no stage-0 AR model, so its report has no
"AR (greedy)" row.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import jax
import ml_dtypes
import numpy as np

from orl_jax import checkpoint
from orl_jax.config import ModelConfig

SHARD_BYTES = 15 * 2**20  # a device call returns files of at most 16 MiB
MARKER = "base_package.json"  # in a run's --out: its stage 1 came from a package (later --resume runs read it)


def export_package(dest: str | os.PathLike, cfg: ModelConfig, params: dict, tokenizer_dir: Path) -> Path:
    """Write `params` (a QwenDLM of config `cfg`) in bfloat16 with the tokenizer to the new directory `dest`."""
    from orl_jax.convert.hf import save_hf

    half = jax.tree.map(lambda a: np.asarray(jax.device_get(a), np.float32).astype(ml_dtypes.bfloat16), params)
    return save_hf(dest, cfg.replace(dtype="bfloat16", param_dtype=None), half, tokenizer_dir=str(tokenizer_dir),
                   max_shard_bytes=SHARD_BYTES)


def check_package(path: str | os.PathLike) -> Path:
    """A readable package directory, else ValueError naming it (before any compilation)."""
    path = Path(path)
    missing = [f for f in ("config.json", "tokenizer.json") if not (path / f).is_file()]
    if missing:
        raise ValueError(f"--base-package {str(path)!r} is not a base package (missing {', '.join(missing)}): write "
                         "one with --export-package")
    return path


def read_package(path: str | os.PathLike) -> tuple[ModelConfig, dict]:
    """(the package's config, its weights as float32 params)."""
    from orl_jax.convert.hf import load_hf

    return load_hf(check_package(path), dtype="float32")


def install(path: str | os.PathLike, out: Path, cfg: ModelConfig, params: dict) -> None:
    """Make a package's params the run's stage-1 export under `out`, with its tokenizer and the marker, so later
    --resume runs reuse them."""
    path = Path(path)
    checkpoint.save_params(out / "stage1" / "params", cfg, params)
    tok_dir = out / "tokenizer"
    tok_dir.mkdir(parents=True, exist_ok=True)
    for f in path.iterdir():
        if f.name.startswith("tokenizer") or f.name == "chat_template.jinja":
            shutil.copy(f, tok_dir / f.name)
    (out / MARKER).write_text(json.dumps({"source": str(path.resolve())}))


def imported_from(out: Path) -> str | None:
    """The package a run's stage 1 came from, if any."""
    marker = out / MARKER
    return json.loads(marker.read_text())["source"] if marker.exists() else None
