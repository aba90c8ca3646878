"""Directories that appear whole or not at all: exports are built under a temporary sibling and renamed into
place, so an interrupted save never leaves a half-written checkpoint where a loader would find it."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def atomic_directory(directory: str | os.PathLike, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary directory; on success it replaces `directory`, on any error it is removed.

    Raises ValueError (before anything is written) if `directory` is non-empty and overwrite is False."""
    directory = Path(directory)
    if directory.exists() and any(directory.iterdir()) and not overwrite:
        raise ValueError(f"output directory {str(directory)!r} exists and is not empty (pass overwrite=True)")
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.tmp-", dir=directory.parent))
    try:
        yield tmp
        if directory.exists():
            shutil.rmtree(directory)
        os.replace(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
