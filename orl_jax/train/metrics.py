"""Training metrics sinks: a JSONL file (always) and TensorBoard event files (when tensorboardX is installed).

One line per logged step in `<logdir>/metrics.jsonl`: {"step": int, "time": unix seconds, <name>: float, ...}.
The file is opened in append mode so a resumed run continues the same log. Only process 0 writes (every host
sees the same replicated metrics). tensorboardX is optional (the `[train]` extra); without it only the JSONL is
written and a warning says so once.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np

log = logging.getLogger(__name__)


def to_host(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """Device metrics -> plain Python (floats for scalars, lists otherwise); one transfer for the whole dict."""
    out = {}
    for k, v in jax.device_get(dict(metrics)).items():
        a = np.asarray(v)
        out[k] = a.item() if a.size == 1 else a.tolist()
        if isinstance(out[k], bool | np.bool_):
            out[k] = int(out[k])
    return out


class MetricsWriter:
    """Append metrics to `<logdir>/metrics.jsonl` and, optionally, TensorBoard event files in `logdir`."""

    def __init__(self, logdir: str | os.PathLike, *, tensorboard: bool = True, filename: str = "metrics.jsonl"):
        self.logdir = Path(logdir)
        self.primary = jax.process_index() == 0
        self._jsonl = None
        self._tb = None
        if not self.primary:
            return
        self.logdir.mkdir(parents=True, exist_ok=True)
        self._jsonl = open(self.logdir / filename, "a", buffering=1)  # noqa: SIM115 - closed in close()
        if tensorboard:
            try:
                from tensorboardX import SummaryWriter
            except ImportError:
                log.warning("tensorboardX is not installed: metrics go to %s only (pip install tensorboardX)",
                            self.logdir / filename)
            else:
                self._tb = SummaryWriter(str(self.logdir))

    @property
    def path(self) -> Path:
        return self.logdir / "metrics.jsonl"

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        if not self.primary:
            return
        if not isinstance(step, int | np.integer):
            raise TypeError(f"step must be an int, got {type(step).__name__}")
        values = to_host(metrics)
        row = {"step": int(step), "time": time.time(), **values}
        self._jsonl.write(json.dumps(row, allow_nan=True) + "\n")
        if self._tb is not None:
            for k, v in values.items():
                if isinstance(v, int | float) and not isinstance(v, bool):
                    self._tb.add_scalar(k, v if math.isfinite(v) else float("nan"), int(step))

    def flush(self) -> None:
        if self._jsonl is not None:
            self._jsonl.flush()
        if self._tb is not None:
            self._tb.flush()

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """The rows of a metrics.jsonl (for tests and plotting)."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
