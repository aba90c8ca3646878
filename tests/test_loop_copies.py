"""What the compiled loop program copies (benchmarks/hlo_copies.py over the programs generate() runs): with
DONATE_STATE nothing of the carried state at entry, and in the loop's body no copy of the KV cache, also where a
lax.cond chooses between a block's commit pass and the plain one (the cache is only read inside the cond and the
commit's K/V written after it). The cache's read / no-op write-back that this rests on is exact."""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from orl_jax import params as P
from orl_jax.decode import engine
from orl_jax.diffusion_gemma_config import DG_PRESETS
from orl_jax.model import diffusion_gemma as dg
from orl_jax.model.cache import KVCache

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from hlo_copies import loop_program_copies  # noqa: E402

BIG = ("cache", "z", "canvas")  # the carried state larger than a few scalars per row


@pytest.fixture(scope="module")
def dg_model():
    cfg = DG_PRESETS["tiny-dg"].replace(dtype="bfloat16", image_token_id=None, boi_token_id=None, eoi_token_id=None)
    params = jax.tree.map(lambda a: a.astype(jnp.bfloat16), P.init(dg.param_specs(cfg), jax.random.key(0)))
    return cfg, params


def _loop_program_copies(cfg, params, monkeypatch, *, blocks: int) -> dict:
    """{"finish": copies of the program that reads the state, "in_place": of the one it is donated to, "cache": the
    KV cache's array types} after one plain generate() of `blocks` blocks through the split programs."""
    monkeypatch.setattr(engine, "OUTPUT_WORKSPACE", True)
    monkeypatch.setattr(engine, "_workspaces", {})
    state, found = loop_program_copies(cfg, params, 16, blocks)
    return found | {"cache": {f"{a.dtype}[{','.join(map(str, a.shape))}]".replace("bfloat16", "bf16")
                              for a in (state.cache.sliding.k, state.cache.full.k)}}


def _entry_state_copies(found) -> set[str]:
    """The carried state's leaves copied at the program's entry, by their argument name (state_cache_full_k, ...)."""
    return {c["operand"].removeprefix("state_").split(".")[0].strip("_") for c in found
            if c["entry"] and c["operand"].startswith("state_")}


def test_donated_state_is_not_copied_into_the_loop(dg_model, monkeypatch):
    """With DONATE_STATE the loop runs in the start's buffers: no entry copy of the KV caches, the residual or the
    canvas, where the program that only reads the state copies them all (a while loop cannot update an input it does
    not own). Only small values that are both an output and part of the handed-back state are copied."""
    found = _loop_program_copies(*dg_model, monkeypatch, blocks=2)
    copied, donated = _entry_state_copies(found["finish"]), _entry_state_copies(found["in_place"])
    assert {b for b in BIG for c in copied if c.startswith(b)} == set(BIG), copied
    assert not [c for c in donated if c.startswith(BIG)], donated
    assert donated <= {"tokens", "forwards", "total_forwards", "commits", "steps_per_block"}


def test_no_cache_copy_per_step_across_block_commits(dg_model, monkeypatch):
    """Two blocks: each step's forward is a lax.cond of the fused commit pass and the plain one. No computation but
    the program's entry copies a buffer of the KV cache's shapes (the body and the branches run every step)."""
    found = _loop_program_copies(*dg_model, monkeypatch, blocks=2)
    assert len(found["cache"]) == 2 and all(t.startswith("bf16[") for t in found["cache"])
    per_step = [c for c in found["in_place"] if not c["entry"] and c["result"] in found["cache"]]
    assert not per_step, per_step


def test_cache_read_then_write_back_changes_nothing():
    k = jax.random.normal(jax.random.key(0), (2, 3, 12, 2, 4), jnp.bfloat16)
    cache = KVCache(k=k, v=-k, start=jnp.zeros((3,), jnp.int32), length=jnp.asarray(5, jnp.int32))
    back = jax.jit(lambda c, go: c.write(*c.read(4), advance=go))(cache, jnp.asarray(False))
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(cache), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    new = jnp.ones((2, 3, 4, 2, 4), jnp.bfloat16)
    moved = jax.jit(lambda c, go: c.write(new, new, advance=go))(cache, jnp.asarray(True))
    assert int(moved.length) == 9
    want = np.asarray(k).copy()
    want[:, :, 5:9] = 1
    np.testing.assert_array_equal(np.asarray(moved.k), want)
    np.testing.assert_array_equal(np.asarray(cache.write(new, new).k), want)  # advance=True, the default
