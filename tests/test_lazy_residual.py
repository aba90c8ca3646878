"""engine.LAZY_RESIDUAL: the step's distribution rides in the loop's state and its soft embedding is computed at the
next step's start, so the generation's last step skips it. The same generation as the eager residual (tokens, counts,
the residuals each step saw), one soft embedding fewer, on every program path; invalid values refused by name."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from orl_jax import params as P
from orl_jax.decode import engine
from orl_jax.decode.samplers import UniformSampler
from orl_jax.diffusion_gemma_config import DG_PRESETS
from orl_jax.model import diffusion_gemma as dg


@pytest.fixture(scope="module")
def model():
    cfg = DG_PRESETS["tiny-dg"].replace(dtype="bfloat16", image_token_id=None, boi_token_id=None, eoi_token_id=None)
    params = jax.tree.map(lambda a: a.astype(jnp.bfloat16), P.init(dg.param_specs(cfg), jax.random.key(0)))
    return cfg, params


def _counted_soft_embed(monkeypatch):
    """engine.soft_embed, each run (not each trace) counted on the host."""
    runs, inner = [0], engine.soft_embed

    def counted(params, cfg, probs, scale=None):
        jax.debug.callback(lambda: runs.__setitem__(0, runs[0] + 1), ordered=True)
        return inner(params, cfg, probs, scale)

    monkeypatch.setattr(engine, "soft_embed", counted)
    return runs


def _eos_for_first_row(cfg, params, prompts, kw) -> int:
    """A token of row 0's first block absent from row 1's: as EOS, row 0 stops after block 0 and row 1 goes on (the
    first block's steps do not depend on the EOS)."""
    first = np.asarray(engine.generate(params, cfg, prompts, **kw | dict(capture=False)).tokens)[:, :kw["block_length"]]
    only_row0 = sorted(set(first[0].tolist()) - set(first[1].tolist()))
    assert only_row0, first
    return only_row0[0]


@pytest.mark.parametrize("eos_row", [False, True], ids=["both_rows", "one_row_stops"])
def test_lazy_residual_same_generation_one_embedding_fewer(model, eos_row, monkeypatch):
    cfg, params = model
    kw = dict(key=jax.random.key(3), sampler=UniformSampler(max_denoising_steps=4), eos_token_id=(),
              max_new_tokens=32, block_length=16, capture=True)  # two blocks: a commit fused into a first step
    prompts = [[5, 6, 7, 8, 9], [10, 11]]
    if eos_row:
        kw["eos_token_id"] = _eos_for_first_row(cfg, params, prompts, kw)
    runs = _counted_soft_embed(monkeypatch)
    want = engine.generate(params, cfg, prompts, **kw)
    jax.effects_barrier()
    eager_runs = runs[0]
    monkeypatch.setattr(engine, "LAZY_RESIDUAL", True)
    runs[0] = 0
    got = engine.generate(params, cfg, prompts, **kw)
    jax.effects_barrier()
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    total = int(want.total_forwards)
    assert eager_runs == total and runs[0] == total - 1
    active = np.asarray(want.capture["active"])[:total]
    assert active[:, 0].all() != eos_row and active[:, 1].all()  # row 0 sat out block 1 where it hit EOS


def test_lazy_residual_on_the_split_programs(model, monkeypatch):
    """The plain call's programs (the start's state, distribution included, in a donated workspace): the same
    tokens as the eager residual."""
    cfg, params = model
    kw = dict(key=jax.random.key(3), sampler=UniformSampler(max_denoising_steps=4), eos_token_id=(),
              max_new_tokens=32, block_length=16)
    prompts = [[5, 6, 7, 8, 9], [10, 11]]
    monkeypatch.setattr(engine, "OUTPUT_WORKSPACE", True)
    monkeypatch.setattr(engine, "_workspaces", {})
    want = engine.generate(params, cfg, prompts, **kw)
    monkeypatch.setattr(engine, "LAZY_RESIDUAL", True)
    for _ in range(2):  # the second call through the workspaces the first one left
        got = engine.generate(params, cfg, prompts, **kw)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    states = [v for v in engine._workspaces.values() if isinstance(v, engine.DecodeState)]
    assert any(s.pending is not None for s in states)  # the lazy program's start state carries the distribution


def test_lazy_residual_value_checked(model, monkeypatch):
    cfg, params = model
    monkeypatch.setattr(engine, "LAZY_RESIDUAL", "yes")
    with pytest.raises(ValueError, match="LAZY_RESIDUAL must be True or False, got 'yes'"):
        engine.generate(params, cfg, [[5, 6, 7]], key=jax.random.key(0), max_new_tokens=16, block_length=16)
