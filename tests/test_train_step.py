"""Sharded train step: a real Qwen3 causal-LM loss gives the same loss and updates on 1 device and on 4.

The single-device run and the two 4-device meshes (data=2 x fsdp=2, fsdp=4) each compile the step once
(module-scoped fixture); two updates are compared so the optimizer state's placement is exercised too.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import random_params

from orl_jax.config import preset
from orl_jax.data.pipeline import segment_mask
from orl_jax.model import qwen3
from orl_jax.sharding import make_mesh
from orl_jax.train.optim import OptimConfig, ParamGroup, make_optimizer
from orl_jax.train.step import TrainState, make_train_step

CFG = preset("tiny-qwen3")
B, L = 4, 16
MESHES = {"single": (1, 1), "data2_fsdp2": (2, 2), "fsdp4": (1, 4)}


def lm_loss(params, batch, key):
    """Next-token cross-entropy inside each packed example (segment_ids / positions from the data pipeline)."""
    tokens, seg = batch["tokens"], batch["segment_ids"]
    logits = qwen3.forward(params, CFG, tokens, positions=batch["positions"], mask=segment_mask(seg))
    logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)  # [B, L-1, V]
    nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
    valid = (batch["loss_mask"][:, 1:] > 0) & (seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] > 0)
    n = jnp.maximum(valid.sum(), 1)
    return jnp.where(valid, nll, 0.0).sum() / n, {"num_targets": n}


def make_batch(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    seg = np.repeat(np.array([[1] * 6 + [2] * 7 + [0] * 3]), B, axis=0).astype(np.int32)
    pos = np.where(seg == 1, np.arange(L), np.arange(L) - 6) * (seg > 0)
    return {"tokens": rng.integers(0, CFG.vocab_size, (B, L)).astype(np.int32) * (seg > 0),
            "loss_mask": (seg > 0).astype(np.int32), "segment_ids": seg, "positions": pos.astype(np.int32)}


@pytest.fixture(scope="module")
def params0():
    return jax.device_get(random_params(CFG, seed=3))


@pytest.fixture(scope="module")
def runs(params0):
    opt = make_optimizer(OptimConfig(lr=1e-3, warmup_steps=1, total_steps=10, groups={"final_norm": ParamGroup(0.5)}))
    out = {}
    for name, (data, fsdp) in MESHES.items():
        devices = jax.devices()[: data * fsdp]
        mesh = make_mesh(data, fsdp, 1, devices=devices)
        step = make_train_step(lm_loss, opt, mesh, qwen3.param_specs(CFG))
        state = step.init_state(params0, jax.random.key(0))
        metrics = []
        for i in range(2):
            state, m = step(state, step.shard_batch(make_batch(i)))
            metrics.append(jax.device_get(m))
        out[name] = (step, state, metrics)
    return out


@pytest.mark.parametrize("name", ["data2_fsdp2", "fsdp4"])
def test_sharded_step_matches_single_device(runs, name):
    _, ref_state, ref_m = runs["single"]
    _, state, m = runs[name]
    for a, b in zip(ref_m, m):
        np.testing.assert_allclose(b["loss"], a["loss"], rtol=0, atol=1e-6)
        np.testing.assert_allclose(b["grad_norm"], a["grad_norm"], rtol=1e-5)
    assert int(state.step) == 2 and int(state.nonfinite_count) == 0
    flat_ref = jax.tree_util.tree_leaves_with_path(jax.device_get(ref_state.params))
    for (path, a), b in zip(flat_ref, jax.tree.leaves(jax.device_get(state.params))):
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-6, err_msg=jax.tree_util.keystr(path))
    for a, b in zip(jax.tree.leaves(jax.device_get(ref_state.opt_state)),
                    jax.tree.leaves(jax.device_get(state.opt_state))):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-8)


def test_loss_decreases_and_metrics(runs):
    _, _, m = runs["single"]
    assert m[1]["loss"] != m[0]["loss"]
    for k in ("loss", "grad_norm", "grad_norm/final_norm", "grad_norm/default", "lr", "lr/final_norm",
              "skipped", "nonfinite_count", "consecutive_nonfinite", "num_targets"):
        assert k in m[0], k
    assert m[0]["lr"] == 0.0 and m[1]["lr"] == pytest.approx(1e-3)  # warmup: 0 at the first update
    assert m[1]["lr/final_norm"] == pytest.approx(5e-4)
    assert int(m[0]["num_targets"]) == B * (5 + 6)


def test_state_shardings_follow_logical_axes(runs):
    step, state, _ = runs["data2_fsdp2"]
    qkv = state.params["layers"]["qkv"]  # [layers, embed, kv_heads, qkv, head_dim]; embed -> fsdp
    assert tuple(qkv.sharding.spec)[:2] == (None, "fsdp")
    mus = [x for p, x in jax.tree_util.tree_leaves_with_path(state.opt_state)
           if jax.tree_util.keystr(p).endswith("['layers']['qkv']")]
    assert mus and all(x.sharding.is_equivalent_to(qkv.sharding, qkv.ndim) for x in mus)
    assert state.step.sharding.is_fully_replicated
    assert isinstance(state, TrainState)
    abstract = step.abstract_state(jax.random.key(0))
    assert abstract.params["embed"].sharding.is_equivalent_to(state.params["embed"].sharding, 2)


def test_errors(runs):
    step, _, _ = runs["fsdp4"]
    with pytest.raises(ValueError, match="dim 0 must divide"):
        step.shard_batch({"tokens": np.zeros((3, L), np.int32)})
    with pytest.raises(ValueError, match="batch_axes"):
        make_train_step(lm_loss, step.optimizer, step.mesh, qwen3.param_specs(CFG), batch_axes=("rows",))
    with pytest.raises(TypeError, match="mesh"):
        make_train_step(lm_loss, step.optimizer, None, qwen3.param_specs(CFG))


def test_frozen_model_is_an_argument_of_the_step(params0):
    """A frozen pytree (RCD's reference model) reaches the loss as a sharded argument: the same step function
    gives different losses for different frozen models, matching the closure version, and must be bound."""
    mesh = make_mesh(1, 2, 1, devices=jax.devices()[:2])
    opt = make_optimizer(OptimConfig(lr=1e-3, warmup_steps=1, total_steps=10))
    specs = qwen3.param_specs(CFG)

    def loss(params, batch, key, frozen):  # the plain LM loss plus a pull towards the frozen model's embedding
        base, aux = lm_loss(params, batch, key)
        return base + jnp.mean((params["embed"] - frozen["embed"]) ** 2), aux

    step = make_train_step(loss, opt, mesh, specs, frozen_specs=specs)
    with pytest.raises(ValueError, match="bind"):
        step(step.init_state(params0, jax.random.key(0)), step.shard_batch(make_batch(0)))
    batch = make_batch(0)
    other = jax.tree.map(lambda x: x * 1.5, params0)
    got = [float(step.bind(f)(step.init_state(params0, jax.random.key(0)), step.shard_batch(batch))[1]["loss"])
           for f in (params0, other)]
    closure = make_train_step(lambda p, b, k: loss(p, b, k, other), opt, mesh, specs)
    want = float(closure(closure.init_state(params0, jax.random.key(0)), closure.shard_batch(batch))[1]["loss"])
    assert got[0] < got[1]
    np.testing.assert_allclose(got[1], want, rtol=1e-6)


def test_init_state_copies_so_donation_never_deletes_the_callers_params(params0):
    """The step donates its state; the state must hold copies, also of replicated weights on a multi-device mesh
    (jax's device_put(may_alias=False) returned the caller's buffer as the device-0 shard there)."""
    mesh = make_mesh(1, 4, 1)
    step = make_train_step(lm_loss, make_optimizer(OptimConfig(lr=1e-3, warmup_steps=1, total_steps=10)), mesh,
                           qwen3.param_specs(CFG))
    params = jax.tree.map(jnp.asarray, params0)  # on device 0, like a freshly loaded model
    state, _ = step(step.init_state(params, jax.random.key(0)), step.shard_batch(make_batch(0)))
    jax.block_until_ready(state)
    assert not any(a.is_deleted() for a in jax.tree.leaves(params))


def test_activations_stay_split_over_the_batch(params0):
    """Under the step's mesh (jax.set_mesh, as the step traces) the model constrains its residual stream to the
    data axes, so no device holds whole-batch activations next to FSDP-sharded weights."""
    from orl_jax import params as P

    mesh = make_mesh(1, 4, 1)
    params = jax.device_put(params0, P.shardings(qwen3.param_specs(CFG), mesh))
    rows = {k: np.concatenate([v, make_batch(1)[k]]) for k, v in make_batch(0).items()}  # 8 rows: no shape clash
    batch = jax.device_put(rows, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp")))
    grad = jax.jit(lambda p, b: jax.grad(lambda p: lm_loss(p, b, None)[0])(p))
    whole, split = f"[{2 * B},{L},{CFG.intermediate_size}]", f"[{2 * B // 4},{L},{CFG.intermediate_size}]"  # MLP
    with jax.set_mesh(mesh):
        hlo = grad.lower(params, batch).compile().as_text()
    assert whole not in hlo and split in hlo
    assert whole in grad.lower(params, batch).compile().as_text()  # without the mesh: the check can fail
