"""Optimizer: schedule, weight-decay mask, parameter groups, and non-finite updates skipped and counted."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from toy_lm import TOY_SPECS, V, toy_loss

from orl_jax import params as P
from orl_jax.config import preset
from orl_jax.model import qwen3
from orl_jax.sharding import make_mesh
from orl_jax.train.optim import (
    OptimConfig,
    ParamGroup,
    decay_mask,
    keep_if_finite,
    lr_schedule,
    make_optimizer,
)
from orl_jax.train.step import make_train_step


def test_schedule_warmup_then_cosine():
    cfg = OptimConfig(lr=1.0, warmup_steps=10, total_steps=110, min_lr_ratio=0.1)
    s = lr_schedule(cfg)
    np.testing.assert_allclose([s(0), s(5), s(10)], [0.0, 0.5, 1.0], atol=1e-6)
    np.testing.assert_allclose(s(60), 0.1 + 0.9 * 0.5, atol=1e-6)  # half way down the cosine
    np.testing.assert_allclose([s(110), s(500)], [0.1, 0.1], atol=1e-6)


def test_stage2_rate_is_constant_after_its_warmup():
    from types import SimpleNamespace

    from orl_jax.train.stage2 import stage2_optim

    optim = stage2_optim(SimpleNamespace(lr2=1e-5, orl_rounds=100, adapter_lr_scale=3.0))
    s = lr_schedule(optim)
    np.testing.assert_allclose([s(0), s(5)], [0.0, 5e-6], rtol=1e-5)
    np.testing.assert_allclose([s(10), s(55), s(99), s(400)], [1e-5] * 4, rtol=1e-5)
    assert optim.groups["adapter"].lr_scale == 3.0  # --adapter-lr-scale
    # the warmup is capped, so a run continued from 150 to 2000 rounds stays at the full rate
    assert stage2_optim(SimpleNamespace(lr2=1e-5, orl_rounds=2000, adapter_lr_scale=1.0)).warmup_steps == 20
    # --orl-rounds 1 (how a resumed run ends a stage stopped early, to evaluate it) builds: warmup of 1, no decay
    one = lr_schedule(stage2_optim(SimpleNamespace(lr2=1e-5, orl_rounds=1, adapter_lr_scale=1.0)))
    np.testing.assert_allclose([one(0), one(1), one(50)], [0.0, 1e-5, 1e-5], rtol=1e-5)


def test_decay_mask_skips_norms_and_vectors():
    mask = decay_mask(P.abstract(qwen3.param_specs(preset("tiny-qwendlm"))))
    assert mask["embed"] and mask["layers"]["qkv"] and mask["layers"]["down"] and mask["adapter"]["gate"]
    # stacked per-layer norms are 2-D ([layers, D]) but still excluded by name
    assert not mask["layers"]["attn_norm"] and not mask["layers"]["q_norm"] and not mask["final_norm"]
    assert not mask["adapter"]["norm"]


def test_param_group_has_own_lr_and_clip():
    cfg = OptimConfig(lr=0.1, warmup_steps=0, total_steps=10, clip_norm=1.0, weight_decay=0.0,
                      groups={"adapter": ParamGroup(lr_scale=0.1, clip_norm=0.01)})
    opt = make_optimizer(cfg)
    params = P.init(TOY_SPECS, jax.random.key(0))
    grads = jax.tree.map(lambda x: jnp.full_like(x, 3.0), params)
    updates, _ = opt.update(grads, opt.init(params), params)

    def alone(sub, lr, clip):
        tx = optax.chain(optax.clip_by_global_norm(clip), optax.adamw(lr, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                                                                       weight_decay=0.0))
        return tx.update(jax.tree.map(lambda x: jnp.full_like(x, 3.0), sub), tx.init(sub), sub)[0]

    exp_adapter = alone(params["adapter"], 0.01, 0.01)
    exp_rest = alone({k: v for k, v in params.items() if k != "adapter"}, 0.1, 1.0)
    np.testing.assert_allclose(updates["adapter"]["w"], exp_adapter["w"], rtol=1e-6)
    np.testing.assert_allclose(updates["embed"], exp_rest["embed"], rtol=1e-6)
    assert abs(float(updates["adapter"]["w"][0, 0])) == pytest.approx(0.01, rel=1e-3)


def test_optim_config_errors():
    with pytest.raises(ValueError, match="warmup_steps"):
        OptimConfig(warmup_steps=20, total_steps=10)
    with pytest.raises(ValueError, match="lr"):
        OptimConfig(lr=0.0)
    with pytest.raises(ValueError, match="reserved"):
        OptimConfig(groups={"default": ParamGroup()})
    with pytest.raises(TypeError, match="ParamGroup"):
        OptimConfig(groups={"adapter": 0.1})
    with pytest.raises(TypeError, match="OptimConfig"):
        make_optimizer({"lr": 1.0})


def test_keep_if_finite_selects_whole_tree():
    new, old = {"a": jnp.ones(3), "b": jnp.int32(5)}, {"a": jnp.zeros(3), "b": jnp.int32(1)}
    assert int(keep_if_finite(jnp.bool_(False), new, old)["b"]) == 1
    np.testing.assert_array_equal(keep_if_finite(jnp.bool_(True), new, old)["a"], np.ones(3))


def test_nonfinite_updates_are_skipped_and_counted():
    mesh = make_mesh(1, 1, 1, devices=jax.devices()[:1])
    opt = make_optimizer(OptimConfig(lr=1e-2, warmup_steps=0, total_steps=100,
                                     groups={"adapter": ParamGroup(lr_scale=0.5, clip_norm=0.1)}))
    step = make_train_step(toy_loss, opt, mesh, TOY_SPECS)
    state = step.init_state(jax.device_get(P.init(TOY_SPECS, jax.random.key(1))), jax.random.key(2))
    rng = np.random.default_rng(0)
    good = lambda: {"tokens": rng.integers(0, V, (2, 6)).astype(np.int32), "loss_mask": np.ones((2, 6), np.int32)}
    bad = lambda: {"tokens": rng.integers(0, V, (2, 6)).astype(np.int32), "loss_mask": np.zeros((2, 6), np.int32)}
    seen = []
    for batch in (good(), bad(), bad(), good()):
        state, m = step(state, step.shard_batch(batch))
        seen.append((jax.device_get(state.params), jax.device_get(state.opt_state), jax.device_get(m)))
    assert [int(s[2]["skipped"]) for s in seen] == [0, 1, 1, 0]
    assert [int(s[2]["consecutive_nonfinite"]) for s in seen] == [0, 1, 2, 0]
    assert [int(s[2]["nonfinite_count"]) for s in seen] == [0, 1, 2, 2]
    assert not np.isfinite(seen[1][2]["loss"])
    for i in (1, 2):  # skipped: params and optimizer state bit-identical to after the last applied update
        jax.tree.map(np.testing.assert_array_equal, seen[i][0], seen[0][0])
        jax.tree.map(np.testing.assert_array_equal, seen[i][1], seen[0][1])
    assert not np.array_equal(seen[3][0]["embed"], seen[0][0]["embed"])
    assert int(state.step) == 4 and int(state.nonfinite_count) == 2 and int(state.consecutive_nonfinite) == 0
    # the lr reported follows the optimizer's own count (applied updates only)
    assert seen[3][2]["lr"] == pytest.approx(float(lr_schedule(OptimConfig(lr=1e-2, warmup_steps=0,
                                                                           total_steps=100))(1)))
