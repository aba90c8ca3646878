"""Argument checks shared by configs and entry points: a user's bad value fails early, naming the parameter."""

from __future__ import annotations

import numpy as np


def int_at_least(name: str, v, lo: int = 1) -> int:
    """v as an int; ValueError naming `name` unless v is an int (not a bool) >= lo."""
    if not isinstance(v, int | np.integer) or isinstance(v, bool) or v < lo:
        raise ValueError(f"{name} must be {'a positive int' if lo == 1 else f'an int >= {lo}'}, got {v!r}")
    return int(v)
