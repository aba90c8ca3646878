"""Training loop: resume is bit-identical, SIGTERM saves and stops, divergence aborts cleanly, metrics logged.

A toy bigram model with dropout (so the RNG matters) on a data=2 x fsdp=2 mesh, fed by the grain pipeline;
the step compiles once for the module.
"""

from __future__ import annotations

import os
import signal

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("grain")

from toy_lm import TOY_SPECS, V, toy_loss  # noqa: E402, I001

from orl_jax import params as P  # noqa: E402
from orl_jax.data.pipeline import make_dataset  # noqa: E402
from orl_jax.sharding import make_mesh  # noqa: E402
from orl_jax.train.ckpt import CheckpointManager  # noqa: E402
from orl_jax.train.loop import NonFiniteError, resume, train  # noqa: E402
from orl_jax.train.metrics import MetricsWriter, read_jsonl  # noqa: E402
from orl_jax.train.optim import OptimConfig, ParamGroup, make_optimizer  # noqa: E402
from orl_jax.train.step import make_train_step

SEQ, B, N = 12, 4, 6


def examples():
    rng = np.random.default_rng(0)
    return [{"tokens": rng.integers(1, V, n).astype(np.int32), "loss_mask": np.ones(n, np.int32)}
            for n in rng.integers(2, 9, 40)]


def data_iter():
    return iter(make_dataset(examples(), seq_len=SEQ, batch_size=B, seed=11))


class Recording:
    """Wraps a data iterator, keeping the batches it hands out (get_state / set_state pass through)."""

    def __init__(self, it, on_batch=None):
        self.it, self.seen, self.on_batch = it, [], on_batch

    def __next__(self):
        b = next(self.it)
        self.seen.append(b)
        if self.on_batch:
            self.on_batch(len(self.seen))
        return b

    def get_state(self):
        return self.it.get_state()

    def set_state(self, s):
        self.it.set_state(s)


@pytest.fixture(scope="module")
def step():
    opt = make_optimizer(OptimConfig(lr=1e-2, warmup_steps=2, total_steps=N,
                                     groups={"adapter": ParamGroup(lr_scale=0.3, clip_norm=0.5)}))
    return make_train_step(toy_loss, opt, make_mesh(2, 2, 1), TOY_SPECS)


def fresh_state(step, seed=0):
    return step.init_state(jax.device_get(P.init(TOY_SPECS, jax.random.key(seed))), jax.random.key(42))


def leaves(state):
    return [np.asarray(jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x)
            for x in jax.tree.leaves(state)]


def test_resume_is_bit_identical(step, tmp_path):
    straight_data = Recording(data_iter())
    straight = train(fresh_state(step), step, straight_data, num_steps=N, log_every=0, progress=False)

    first_data = Recording(data_iter())
    with CheckpointManager(tmp_path / "ck") as ck, MetricsWriter(tmp_path / "logs", tensorboard=False) as w:
        half = train(fresh_state(step), step, first_data, num_steps=N // 2, ckpt=ck, log_every=1, writer=w,
                     progress=True)
        assert int(half.step) == N // 2 and ck.latest_step() == N // 2
    del half  # "killed": nothing survives but the checkpoint directory

    second_data = Recording(data_iter())
    with CheckpointManager(tmp_path / "ck") as ck, MetricsWriter(tmp_path / "logs", tensorboard=False) as w:
        state = resume(ck, step.abstract_state(jax.random.key(0)), second_data)
        assert int(state.step) == N // 2
        state = train(state, step, second_data, num_steps=N, ckpt=ck, save_every=2, log_every=2, writer=w,
                      progress=False)
        assert ck.all_steps() == [N // 2, 4, N]
    for a, b in zip(leaves(straight), leaves(state)):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(straight_data.seen, first_data.seen + second_data.seen):
        for k in a:
            np.testing.assert_array_equal(a[k], b[k])
    rows = read_jsonl(tmp_path / "logs" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 6]
    for k in ("loss", "lr", "grad_norm", "grad_norm/adapter", "lr/adapter", "tokens_per_s", "nonfinite_count",
              "consecutive_nonfinite", "skipped", "targets"):
        assert k in rows[-1], k
    assert all(np.isfinite(r["loss"]) for r in rows) and rows[-1]["tokens_per_s"] > 0


def test_resume_without_checkpoint_returns_none(step, tmp_path):
    with CheckpointManager(tmp_path / "empty") as ck:
        assert resume(ck, step.abstract_state(), data_iter()) is None


def test_sigterm_saves_and_stops(step, tmp_path):
    data = Recording(data_iter(), on_batch=lambda n: n == 2 and os.kill(os.getpid(), signal.SIGTERM))
    with CheckpointManager(tmp_path / "ck") as ck:
        state = train(fresh_state(step), step, data, num_steps=N, ckpt=ck, save_every=0, log_every=0,
                      progress=False)
        assert int(state.step) == 2 and ck.all_steps() == [2]


def test_divergence_aborts_after_consecutive_nonfinite(step, tmp_path):
    def poisoned():
        it = data_iter()
        yield next(it)
        while True:
            b = next(it)
            yield dict(b, loss_mask=np.zeros_like(b["loss_mask"]))

    with CheckpointManager(tmp_path / "ck", async_save=True) as ck:
        with pytest.raises(NonFiniteError, match="3 consecutive") as e:
            train(fresh_state(step), step, poisoned(), num_steps=N, ckpt=ck, save_every=1,
                  max_consecutive_nonfinite=3, log_every=0, progress=False)
        assert e.value.consecutive == 3
        assert ck.all_steps() == [1, 2, 3]  # the loop stopped before saving step 4; all saves committed
        restored, _ = ck.restore_latest(step.abstract_state())
        after_first, _ = ck.restore(1, step.abstract_state())
    assert int(restored.nonfinite_count) == 2 and int(restored.consecutive_nonfinite) == 2
    for a, b in zip(leaves(restored.params), leaves(after_first.params)):
        np.testing.assert_array_equal(a, b)  # skipped updates changed nothing


def test_train_argument_errors(step):
    with pytest.raises(ValueError, match="num_steps"):
        train(fresh_state(step), step, data_iter(), num_steps=-1)
    with pytest.raises(TypeError, match="state"):
        train({}, step, data_iter(), num_steps=1)


def test_metrics_writer_jsonl_and_tensorboard(tmp_path):
    pytest.importorskip("tensorboardX")
    with MetricsWriter(tmp_path, tensorboard=True) as w:
        w.write(3, {"loss": jnp.float32(1.5), "skipped": jnp.int32(0), "vec": jnp.arange(2)})
    assert read_jsonl(w.path)[0] | {"time": 0} == {"step": 3, "time": 0, "loss": 1.5, "skipped": 0, "vec": [0, 1]}
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(tmp_path))
