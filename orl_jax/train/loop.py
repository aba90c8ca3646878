"""The training loop: data -> step -> log -> checkpoint, resumable bit for bit.

`train()` runs a TrainStep (step.py) until `state.step == num_steps` (an absolute step, so a resumed run is given
the same `num_steps` as the original). Per step it pulls one host batch, places it (`step_fn.shard_batch`), runs
the update and, every `log_every` steps, writes metrics (the step's own plus `tokens_per_s`, `step_time_s` and
`data_wait_frac`, the share of wall time spent waiting for the input pipeline) to a MetricsWriter and a tqdm
bar (tokens = non-padding tokens, segment_ids > 0, of the global batch). Every
`save_every` steps, on preemption (SIGTERM / orbax sync point) and at the end it saves the TrainState with the
data iterator's state; the iterator state is taken right after the step that consumed its batch, so restore +
resume replays exactly the batches the uninterrupted run would have seen.

Host syncs are rare on purpose: the non-finite counter of step t is read after step t+1 has been dispatched (one
step in flight), and metrics are fetched only on log steps. After `max_consecutive_nonfinite` skipped updates in
a row the loop waits for pending saves (only committed checkpoints remain) and raises NonFiniteError.

`resume(ckpt, target, data_iter)` is the `--resume` half: the newest checkpoint restored into the shardings of
`target` (e.g. `step_fn.abstract_state(rng)`), and the data iterator rewound to match.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np

from orl_jax.checks import int_at_least
from orl_jax.train.ckpt import CheckpointManager
from orl_jax.train.metrics import MetricsWriter, to_host
from orl_jax.train.step import TrainState

log = logging.getLogger(__name__)


class NonFiniteError(RuntimeError):
    """Too many consecutive updates had a non-finite loss or gradient; training stopped."""

    def __init__(self, step: int, consecutive: int, total: int):
        super().__init__(f"{consecutive} consecutive non-finite updates (total {total}) at step {step}; "
                         f"stopping. The last committed checkpoint holds the state before the divergence.")
        self.step, self.consecutive, self.total = step, consecutive, total


def _count_tokens(batch: Any, tokens_key: str) -> int:
    if isinstance(batch, dict):
        if "segment_ids" in batch:
            return int(np.count_nonzero(np.asarray(batch["segment_ids"])))
        if tokens_key in batch:
            return int(np.size(batch[tokens_key]))
    leaves = jax.tree.leaves(batch)
    return int(np.size(leaves[0])) if leaves else 0


def _progress(enabled: bool, start: int, total: int):
    if not enabled or jax.process_index() != 0:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=total, initial=start, unit="step", dynamic_ncols=True)


def resume(ckpt: CheckpointManager, target: TrainState, data_iter: Any = None) -> TrainState | None:
    """Restore the newest checkpoint into `target`'s shardings and rewind `data_iter`; None if there is none."""
    if not isinstance(ckpt, CheckpointManager):
        raise TypeError(f"ckpt must be an orl_jax.train.ckpt.CheckpointManager, got {type(ckpt).__name__}")
    out = ckpt.restore_latest(target)
    if out is None:
        return None
    state, data_state = out
    if data_iter is not None and data_state is not None:
        if not hasattr(data_iter, "set_state"):
            raise TypeError(f"data_iter ({type(data_iter).__name__}) has no set_state(); cannot resume its position")
        data_iter.set_state(data_state)
    log.info("resumed from step %d of %s", int(state.step), ckpt.directory)
    return state


def train(state: TrainState, step_fn: Callable, data_iter: Iterator, *, num_steps: int,
          ckpt: CheckpointManager | None = None, save_every: int = 0, log_every: int = 10,
          writer: MetricsWriter | None = None, max_consecutive_nonfinite: int = 10, progress: bool = True,
          tokens_key: str = "tokens") -> TrainState:
    """Run updates until state.step == num_steps (or the data ends, or preemption); returns the final state.

    step_fn: a TrainStep (or any `(state, batch) -> (state, metrics)`; batches are placed with its shard_batch
    when it has one). data_iter: yields host batches; its get_state() is checkpointed when it has one.
    save_every=0 saves only at the end / on preemption. Raises NonFiniteError after max_consecutive_nonfinite
    skipped updates in a row.
    """
    if not isinstance(state, TrainState):
        raise TypeError(f"state must be a TrainState, got {type(state).__name__}")
    for name, v, lo in (("num_steps", num_steps, 0), ("save_every", save_every, 0), ("log_every", log_every, 0),
                        ("max_consecutive_nonfinite", max_consecutive_nonfinite, 1)):
        int_at_least(name, v, lo)
    if ckpt is not None and not isinstance(ckpt, CheckpointManager):
        raise TypeError(f"ckpt must be a CheckpointManager or None, got {type(ckpt).__name__}")
    shard = getattr(step_fn, "shard_batch", lambda b: b)
    get_data_state = getattr(data_iter, "get_state", lambda: None)

    def check(metrics, step: int) -> None:
        c = int(jax.device_get(metrics["consecutive_nonfinite"]))
        if c >= max_consecutive_nonfinite:
            if ckpt is not None:
                ckpt.wait_until_finished()
            raise NonFiniteError(step, c, int(jax.device_get(metrics["nonfinite_count"])))

    start = int(state.step)
    bar = _progress(progress, start, num_steps)
    pending = None  # (metrics, step) not yet checked for non-finite updates
    saved = None
    t_mark, tokens, n_steps, waited = time.perf_counter(), 0, 0, 0.0
    done = start
    try:
        for i in range(start, num_steps):
            try:
                t_data = time.perf_counter()
                host_batch = next(data_iter)
                waited += time.perf_counter() - t_data
            except StopIteration:
                log.warning("data iterator exhausted at step %d (num_steps=%d)", i, num_steps)
                break
            tokens += _count_tokens(host_batch, tokens_key) * jax.process_count()  # hosts feed equal batches
            n_steps += 1
            state, metrics = step_fn(state, shard(host_batch))
            done = i + 1
            if pending is not None:
                check(*pending)
            pending = (metrics, done)
            if i == start:  # exclude compilation from the first throughput window
                jax.block_until_ready(metrics)
                t_mark, tokens, n_steps, waited = time.perf_counter(), 0, 0, 0.0
            if log_every and (done % log_every == 0 or done == num_steps):
                values = to_host(metrics)
                now = time.perf_counter()
                dt = now - t_mark
                values |= {"tokens_per_s": tokens / dt if dt > 0 and n_steps else 0.0,
                           "step_time_s": dt / n_steps if n_steps else 0.0,
                           "data_wait_frac": waited / dt if dt > 0 else 0.0}
                t_mark, tokens, n_steps, waited = now, 0, 0, 0.0
                if writer is not None:
                    writer.write(done, values)
                if bar is not None:
                    bar.set_postfix(loss=f"{values['loss']:.4g}", tok_s=f"{values['tokens_per_s']:.3g}",
                                    refresh=False)
            if bar is not None:
                bar.update(1)
            stop = ckpt is not None and ckpt.should_stop(done)
            if ckpt is not None and (stop or (save_every and done % save_every == 0)):
                check(metrics, done)
                pending = None
                ckpt.save(state, get_data_state(), step=done)
                saved = done
            if stop:
                log.warning("preemption: saved step %d and stopped", done)
                break
        if pending is not None:
            check(*pending)
        if ckpt is not None and saved != done and done > start:
            ckpt.save(state, get_data_state(), step=done)
        if ckpt is not None:
            ckpt.wait_until_finished()
    finally:
        if bar is not None:
            bar.close()
        if writer is not None:
            writer.flush()
    return state
