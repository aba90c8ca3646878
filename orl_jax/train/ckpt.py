"""Training checkpoints: one orbax composite per step holding the TrainState, the data-iterator state and metadata.

Layout of `<directory>/<step>/`: `state/` (orbax StandardSave of the whole TrainState: step, params, optimizer
state, RNG key, non-finite counters), `data/` (the grain iterator state, JSON) and `meta/` (JSON: step, RNG key
implementation, format version). Saves are asynchronous (training continues while the arrays are written); orbax
writes each step under a temporary name and commits it by rename (plus a commit marker on object stores), so a
process killed mid-save leaves no restorable half checkpoint: `latest_step()` only ever sees committed steps and
stale temporaries are cleaned up on the next start.

Preemption: `should_stop(step)` is true after SIGTERM reached this process (our handler only sets a flag; the
loop then saves and returns) or at orbax's multi-host preemption sync point (`reached_preemption`, which needs
jax.distributed with its preemption service; with several hosts rely on that one, since a SIGTERM flag is
per-process). `deadline` (a time.monotonic() value) also ends the run there: a job with a time limit stops with a
checkpoint instead of being killed.

Typed PRNG keys are stored as their raw uint32 key data (orbax writes plain arrays) and re-wrapped on restore.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from orl_jax.train.step import TrainState

log = logging.getLogger(__name__)
FORMAT = 1


def _is_typed_key(x) -> bool:
    return jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _json_safe(tree: Any, name: str) -> Any:
    def default(o):
        if isinstance(o, np.integer | np.floating | np.bool_):
            return o.item()
        if isinstance(o, np.ndarray):
            return o.tolist()
        raise TypeError(f"{type(o).__name__} is not JSON-serializable")

    try:
        return json.loads(json.dumps(tree, default=default))
    except (TypeError, ValueError) as e:
        raise ValueError(f"{name} must be JSON-serializable (a grain iterator state is): {e}") from e


def _abstract(x):
    if isinstance(x, jax.ShapeDtypeStruct):
        return x
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))


def latest_saved_step(directory: str | os.PathLike) -> int | None:
    """The newest step checkpointed under `directory` (None when there is none), restoring nothing."""
    if not Path(directory).is_dir():
        return None
    with CheckpointManager(directory, handle_sigterm=False) as ck:
        return ck.latest_step()


class CheckpointManager:
    """Keep-N async checkpoints of (TrainState, data-iterator state) under `directory`, preemption aware."""

    def __init__(self, directory: str | os.PathLike, *, max_to_keep: int | None = 3, async_save: bool = True,
                 handle_sigterm: bool = True, deadline: float | None = None):
        if max_to_keep is not None and (not isinstance(max_to_keep, int) or max_to_keep <= 0):
            raise ValueError(f"max_to_keep must be a positive int or None, got {max_to_keep!r}")
        self.directory = Path(directory).absolute()
        self.directory.mkdir(parents=True, exist_ok=True)
        options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, enable_async_checkpointing=async_save,
                                               create=True)
        self._mgr = ocp.CheckpointManager(self.directory, options=options)
        self._sigterm = threading.Event()
        self._deadline = deadline
        self._prev_handler = None
        if handle_sigterm and threading.current_thread() is threading.main_thread():
            self._prev_handler = signal.signal(signal.SIGTERM, self._on_sigterm)

    # --- preemption --------------------------------------------------------------------------------------------
    def _on_sigterm(self, signum, frame):
        log.warning("SIGTERM received: a final checkpoint will be saved after the current step")
        self._sigterm.set()

    def request_stop(self) -> None:
        """What SIGTERM does: ask the loop to save and stop after the current step."""
        self._sigterm.set()

    def should_stop(self, step: int) -> bool:
        """True once SIGTERM arrived, the deadline passed, or all hosts reached orbax's preemption sync point for
        `step`."""
        if self._sigterm.is_set() or (self._deadline is not None and time.monotonic() >= self._deadline):
            return True
        try:
            return bool(self._mgr.reached_preemption(step))
        except RuntimeError:  # jax.distributed without its preemption service
            return False

    # --- save / restore -------------------------------------------------------------------------------------------
    def latest_step(self) -> int | None:
        return self._mgr.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._mgr.all_steps())

    def save(self, state: TrainState, data_state: Any = None, *, step: int | None = None) -> bool:
        """Start an (async) save of `state` and the data-iterator state at `step` (default: state.step).

        Returns False if that step is already saved. The arrays are copied off the device before this returns, so
        the caller may donate / overwrite `state` at once.
        """
        if not isinstance(state, TrainState):
            raise TypeError(f"state must be a TrainState, got {type(state).__name__}")
        step = int(state.step) if step is None else int(step)
        if step in self._mgr.all_steps():
            return False
        rng_impl = None
        if _is_typed_key(state.rng):
            rng_impl = jax.random.key_impl(state.rng)
            if not isinstance(rng_impl, str):
                raise ValueError(f"state.rng uses a custom PRNG implementation {rng_impl!r}; only named ones "
                                 f"(threefry2x32, rbg, unsafe_rbg) can be checkpointed")
            state = state.replace(rng=jax.random.key_data(state.rng))
        meta = {"format": FORMAT, "step": step, "rng_impl": rng_impl, "has_data_state": data_state is not None}
        data = {} if data_state is None else _json_safe(data_state, "data_state")
        args = ocp.args.Composite(state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data),
                                  meta=ocp.args.JsonSave(meta))
        return bool(self._mgr.save(step, args=args, force=True))

    def restore(self, step: int, target: TrainState) -> tuple[TrainState, Any]:
        """(state, data_state) of `step`, each array placed like `target` (arrays or ShapeDtypeStructs)."""
        if not isinstance(target, TrainState):
            raise TypeError(f"target must be a TrainState (of arrays or ShapeDtypeStructs), got "
                            f"{type(target).__name__}")
        if step not in self._mgr.all_steps():
            raise ValueError(f"step={step} has no checkpoint in {str(self.directory)!r} "
                             f"(have {self.all_steps()})")
        meta = self._mgr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
        if meta.get("format") != FORMAT:
            raise ValueError(f"checkpoint {step} in {str(self.directory)!r} has format {meta.get('format')}, "
                             f"expected {FORMAT}")
        abstract = jax.tree.map(_abstract, target)
        typed = _is_typed_key(abstract.rng)
        if typed:
            if meta["rng_impl"] is None:
                raise ValueError(f"checkpoint {step} stores a raw uint32 RNG key but target.rng is a typed key")
            kd = jax.eval_shape(jax.random.key_data, abstract.rng)
            abstract = abstract.replace(rng=jax.ShapeDtypeStruct(kd.shape, kd.dtype, sharding=abstract.rng.sharding))
        out = self._mgr.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract), data=ocp.args.JsonRestore()))
        state = out.state
        if typed:
            state = state.replace(rng=jax.random.wrap_key_data(state.rng, impl=meta["rng_impl"]))
        data = out.data if meta.get("has_data_state", True) else None
        return state, data

    def restore_latest(self, target: TrainState) -> tuple[TrainState, Any] | None:
        """(state, data_state) of the newest committed checkpoint, placed like `target`; None when there is none."""
        self._mgr.wait_until_finished()
        step = self.latest_step()
        return None if step is None else self.restore(step, target)

    def wait_until_finished(self) -> None:
        self._mgr.wait_until_finished()

    def close(self) -> None:
        """Finish pending saves and restore the previous SIGTERM handler."""
        self._mgr.wait_until_finished()
        self._mgr.close()
        if self._prev_handler is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._prev_handler)
            self._prev_handler = None

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
