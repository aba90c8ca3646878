"""Reading and writing the tensors of a Hugging Face checkpoint directory, safely.

Reading maps each .safetensors file into memory (zero copy) and views it as numpy arrays; bfloat16 comes from
ml_dtypes (safetensors' own numpy reader rejects bf16). Writing uses safetensors.numpy. Pickle-based `.bin`
files are refused unless the caller opts in, and then load with torch's weights_only unpickler.
"""

from __future__ import annotations

import json
import mmap
import os
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
}


def read_safetensors(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """All tensors of one .safetensors file as read-only numpy views of a memory map."""
    path = Path(path)
    with open(path, "rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    if len(buf) < 8:
        raise ValueError(f"{path}: not a safetensors file (shorter than its header)")
    n = int.from_bytes(buf[:8], "little")
    if n <= 0 or 8 + n > len(buf):
        raise ValueError(f"{path}: corrupt safetensors header length {n}")
    header = json.loads(bytes(buf[8:8 + n]))
    header.pop("__metadata__", None)
    base = 8 + n
    out = {}
    for name, info in header.items():
        dt = _DTYPES.get(info["dtype"])
        if dt is None:
            raise ValueError(f"{path}: tensor {name} has unsupported dtype {info['dtype']}")
        lo, hi = info["data_offsets"]
        shape = tuple(info["shape"])
        count = int(np.prod(shape)) if shape else 1
        if hi - lo != count * np.dtype(dt).itemsize or base + hi > len(buf):
            raise ValueError(f"{path}: tensor {name} has inconsistent offsets {lo}..{hi} for shape {shape}")
        out[name] = np.frombuffer(buf, dtype=dt, count=count, offset=base + lo).reshape(shape)
    return out


def checkpoint_files(directory: Path, allow_pickle: bool = False) -> list[Path]:
    """The weight files of an HF directory: the index's shards, model.safetensors, or (opt-in) pickle files."""
    index = directory / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index}: no weight_map")
        files = []
        for shard in sorted(set(weight_map.values())):
            # Judged on the path as written, not where symlinks lead (the HF hub cache links shards to blobs/).
            parts = Path(shard).parts
            if Path(shard).is_absolute() or ".." in parts or not parts:
                raise ValueError(f"{index}: shard path {shard!r} leaves the checkpoint directory")
            p = directory / shard
            if not p.exists():
                raise ValueError(f"{index}: shard {shard!r} does not exist")
            files.append(p)
        return files
    single = directory / "model.safetensors"
    if single.exists():
        return [single]
    pickles = sorted(directory.glob("*.bin"))
    if pickles and not allow_pickle:
        raise ValueError(f"{directory} holds only pickle weights ({pickles[0].name}); pickle files can run code "
                         f"when loaded and are refused. Convert them to safetensors, or pass allow_pickle=True")
    if pickles:
        return pickles
    raise ValueError(f"{directory}: no model.safetensors, model.safetensors.index.json or weights found")


def read_checkpoint(directory: Path, allow_pickle: bool = False) -> dict[str, np.ndarray]:
    tensors: dict[str, np.ndarray] = {}
    for f in checkpoint_files(directory, allow_pickle):
        part = read_safetensors(f) if f.suffix == ".safetensors" else _read_pickle(f)
        dup = set(part) & set(tensors)
        if dup:
            raise ValueError(f"{f}: tensor {sorted(dup)[0]} appears in more than one shard")
        tensors.update(part)
    return tensors


def _read_pickle(path: Path) -> dict[str, np.ndarray]:
    try:
        import torch
    except ImportError as e:
        raise ValueError(f"{path}: reading pickle checkpoints needs torch installed") from e
    sd = torch.load(path, map_location="cpu", weights_only=True)
    out = {}
    for k, t in sd.items():
        if t.dtype == torch.bfloat16:
            out[k] = t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        else:
            out[k] = t.numpy()
    return out


def write_checkpoint(directory: Path, tensors: dict[str, np.ndarray], max_shard_bytes: int = 5 * 2**30) -> None:
    """Write model.safetensors, or shards + model.safetensors.index.json when larger than max_shard_bytes."""
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name in tensors:
        nbytes = tensors[name].nbytes
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = np.ascontiguousarray(tensors[name])
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(directory / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(directory / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in shard})
    total = sum(t.nbytes for t in tensors.values())
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
