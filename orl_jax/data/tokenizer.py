"""Tokenizers load through transformers' AutoTokenizer from local files only (tokenizer.json etc.), the same path
for a real Qwen3 tokenizer and for the embedded one trained by the recipes."""

from __future__ import annotations

import os
from pathlib import Path


def load_tokenizer(directory: str | os.PathLike):
    from transformers import AutoTokenizer

    directory = Path(directory)
    if not (directory / "tokenizer.json").exists() and not (directory / "tokenizer_config.json").exists():
        raise ValueError(f"{directory}: no tokenizer.json or tokenizer_config.json")
    return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)


def mask_token_id(tokenizer) -> int | None:
    """The tokenizer's mask token id, if it defines one (used for noise='mask' models)."""
    return getattr(tokenizer, "mask_token_id", None)
