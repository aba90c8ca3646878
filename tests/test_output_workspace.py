"""engine.OUTPUT_WORKSPACE: plain generate() calls run the loop into a donated workspace the engine keeps per
compiled program, so the program's outputs (and the loop values XLA shares with them) keep their addresses from call
to call; the caller gets copies. The same outputs as without it, every output aliased (no donation left unused),
the workspace's buffers in place across calls, and the caller's arrays independent of the next call."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from orl_jax import params as P
from orl_jax.config import preset
from orl_jax.decode import engine
from orl_jax.decode.samplers import UniformSampler
from orl_jax.diffusion_gemma_config import DG_PRESETS
from orl_jax.model import diffusion_gemma as dg
from orl_jax.model import qwen3


def _qwendlm():
    cfg = preset("tiny-qwendlm").replace(block_length=4)
    return cfg, P.init(qwen3.param_specs(cfg), jax.random.key(0)), dict(max_new_tokens=8)


def _dg():
    cfg = DG_PRESETS["tiny-dg"].replace(dtype="bfloat16", image_token_id=None, boi_token_id=None, eoi_token_id=None)
    params = jax.tree.map(lambda a: a.astype(jnp.bfloat16), P.init(dg.param_specs(cfg), jax.random.key(0)))
    return cfg, params, dict(max_new_tokens=32, block_length=16)


@pytest.mark.parametrize("model", [_qwendlm, _dg], ids=["qwendlm_graphed", "dg_concurrent"])
def test_workspace_keeps_outputs_in_place(model, monkeypatch):
    cfg, params, kw = model()
    kw |= dict(key=jax.random.key(3), sampler=UniformSampler(max_denoising_steps=4), eos_token_id=())
    prompts = [[5, 6, 7, 8, 9], [10, 11]]
    monkeypatch.setattr(engine, "OUTPUT_WORKSPACE", False)
    want = engine.generate(params, cfg, prompts, **kw)
    monkeypatch.setattr(engine, "OUTPUT_WORKSPACE", True)
    monkeypatch.setattr(engine, "SPLIT_START", False)  # one program (the split's own test is below)
    monkeypatch.setattr(engine, "_workspaces", {})
    outs, places = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "Some donated buffers were not usable" fails the test
        for _ in range(3):
            outs.append(engine.generate(params, cfg, prompts, **kw))
            (workspace,) = [w for w in engine._workspaces.values() if isinstance(w, engine.GenerateOutput)]
            places.append([a.unsafe_buffer_pointer() for a in jax.tree.leaves(workspace)])
    assert places[0] == places[1] == places[2]
    for out in outs:  # each call's copies, read after the later calls
        assert not {a.unsafe_buffer_pointer() for a in jax.tree.leaves(out)} & set(places[0])
        for got, ref in zip(jax.tree.leaves(out), jax.tree.leaves(want), strict=True):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))


@pytest.mark.parametrize("model,groups,donate", [(_qwendlm, 0, True), (_dg, 0, True), (_dg, 1, True),
                                                  (_qwendlm, 0, False), (_dg, 0, False)],
                         ids=["qwendlm_graphed", "dg_concurrent", "dg_first_group_apart", "qwendlm_state_copied",
                              "dg_state_copied"])
def test_split_start_same_outputs_state_in_place(model, groups, donate, monkeypatch):
    """engine.SPLIT_START: the loop's start and the loop as two programs, the start's state in a donated workspace
    that stays in place across calls; the same outputs as one program, and the caller's key left alive. With
    SPLIT_START_GROUPS the fused first pass's first layer group runs as a third program, its carry in place too.
    DONATE_STATE (the default) or not: the loop's program takes the state donated and hands back its last state, or
    reads it."""
    cfg, params, kw = model()
    monkeypatch.setattr(engine, "SPLIT_START_GROUPS", groups)
    monkeypatch.setattr(engine, "DONATE_STATE", donate)
    kw |= dict(key=jax.random.key(3), sampler=UniformSampler(max_denoising_steps=4), eos_token_id=())
    prompts = [[5, 6, 7, 8, 9], [10, 11]]
    monkeypatch.setattr(engine, "OUTPUT_WORKSPACE", False)
    want = engine.generate(params, cfg, prompts, **kw)
    monkeypatch.setattr(engine, "OUTPUT_WORKSPACE", True)
    assert engine.SPLIT_START is True  # the default
    monkeypatch.setattr(engine, "_workspaces", {})
    places = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "Some donated buffers were not usable" fails the test
        for _ in range(3):
            out = engine.generate(params, cfg, prompts, **kw)
            kept = [v for k, v in engine._workspaces.items() if k[0] in (*engine._split_graphed,
                                                                         *engine._split_concurrent)]
            assert [type(v) for v in kept] == [dict] * bool(groups) + [engine.DecodeState]
            places.append([a.unsafe_buffer_pointer() for a in jax.tree.leaves(kept)])
            for got, ref in zip(jax.tree.leaves(out), jax.tree.leaves(want), strict=True):
                np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
    assert places[0] == places[1] == places[2]
    assert len(engine._workspaces) == 2 + bool(groups)  # (the first groups' carry,) the start's state, the outputs
    assert int(jax.random.randint(kw["key"], (), 0, 9)) >= 0  # the caller's key was not donated
    # another prompt's values through the same programs: still the one program's outputs
    other = [[9, 8, 7, 6, 5], [4, 3]]
    got = engine.generate(params, cfg, other, **kw)
    monkeypatch.setattr(engine, "SPLIT_START", False)
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(engine.generate(params, cfg, other, **kw).tokens))


def test_workspace_auto_is_gpu_only_and_values_checked(monkeypatch):
    """"auto" (the default) takes the workspace on a GPU only (the CUDA graphs it keeps in place); another value is
    refused by name before anything runs."""
    cfg, params, kw = _qwendlm()
    kw |= dict(key=jax.random.key(3), sampler=UniformSampler(max_denoising_steps=4), eos_token_id=())
    monkeypatch.setattr(engine, "_workspaces", {})
    assert engine.OUTPUT_WORKSPACE == "auto"
    engine.generate(params, cfg, [[5, 6, 7]], **kw)
    assert bool(engine._workspaces) == (jax.default_backend() == "gpu")
    monkeypatch.setattr(engine, "OUTPUT_WORKSPACE", "on")
    with pytest.raises(ValueError, match="OUTPUT_WORKSPACE.*'on'"):
        engine.generate(params, cfg, [[5, 6, 7]], **kw)
    # also where the call would not take a workspace (a streamed call), before anything runs
    blocks = []
    with pytest.raises(ValueError, match="OUTPUT_WORKSPACE.*'on'"):
        engine.generate(params, cfg, [[5, 6, 7]], streamer=lambda t, i: blocks.append(i), **kw)
    assert blocks == []
    monkeypatch.setattr(engine, "OUTPUT_WORKSPACE", "auto")
    monkeypatch.setattr(engine, "SPLIT_START", "yes")
    with pytest.raises(ValueError, match="SPLIT_START.*'yes'"):
        engine.generate(params, cfg, [[5, 6, 7]], **kw)
    monkeypatch.setattr(engine, "SPLIT_START", True)
    monkeypatch.setattr(engine, "DONATE_STATE", 1)
    with pytest.raises(ValueError, match="DONATE_STATE must be True or False, got 1"):
        engine.generate(params, cfg, [[5, 6, 7]], **kw)
    monkeypatch.setattr(engine, "DONATE_STATE", True)
    for bad in (-1, True, "2"):
        monkeypatch.setattr(engine, "SPLIT_START_GROUPS", bad)
        with pytest.raises(ValueError, match="SPLIT_START_GROUPS must be an int >= 0"):
            engine.generate(params, cfg, [[5, 6, 7]], **kw)


def test_split_start_groups_beyond_the_model_refused(monkeypatch):
    """SPLIT_START_GROUPS at the model's group count (nothing left for the start's program) is refused by name
    before anything compiles; a model without the two-part pass (Qwen) ignores it."""
    cfg, params, kw = _dg()
    kw |= dict(key=jax.random.key(3), sampler=UniformSampler(max_denoising_steps=4), eos_token_id=())
    monkeypatch.setattr(engine, "OUTPUT_WORKSPACE", True)
    monkeypatch.setattr(engine, "_workspaces", {})
    monkeypatch.setattr(engine, "SPLIT_START_GROUPS", cfg.num_groups)
    with pytest.raises(ValueError, match=f"SPLIT_START_GROUPS must be < the model's {cfg.num_groups} layer groups"):
        engine.generate(params, cfg, [[5, 6, 7]], **kw)
    assert engine._workspaces == {}  # refused before the output workspace was made
    qcfg, qparams, qkw = _qwendlm()
    qkw |= dict(key=jax.random.key(3), sampler=UniformSampler(max_denoising_steps=4), eos_token_id=())
    engine.generate(qparams, qcfg, [[5, 6, 7]], **qkw)
