"""layerwise.map_layers: a layer stack's transform one layer at a time in the stack's buffer (what lets the 26B
reach its inference layout on an 80 GB GPU), and inference_params' donated path built on it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from orl_jax.model.layerwise import _put, _reshape, map_layers


def _stack(shape=(3, 4, 8, 16), key=0):
    return jax.random.normal(jax.random.key(key), shape, jnp.bfloat16)


def _fold(w, g):
    return (g[None, :, None] * w).astype(w.dtype)


@pytest.mark.parametrize("donate", [False, True])
def test_map_layers_equals_lax_map_and_donates_only_when_asked(donate):
    x, g = _stack(), jax.random.normal(jax.random.key(1), (3, 8))
    want = np.asarray(jax.lax.map(lambda a: _fold(*a), (x, g)), np.float32)
    got = map_layers(x, _fold, g, donate=donate)
    np.testing.assert_array_equal(np.asarray(got, np.float32), want)
    assert x.is_deleted() == donate and not g.is_deleted()


def test_map_layers_stores_another_shape_row_major_in_each_layer():
    x = _stack()
    want = np.asarray(jax.lax.map(lambda w: w.transpose(0, 2, 1), x), np.float32)  # [3, 4, 16, 8]
    got = map_layers(x, lambda w: w.transpose(0, 2, 1), out_shape=(3, 4, 16, 8), donate=True)
    assert got.shape == (3, 4, 16, 8) and x.is_deleted()
    np.testing.assert_array_equal(np.asarray(got, np.float32), want)


def test_map_layers_refuses_what_does_not_fit_a_layer():
    x = _stack()
    with pytest.raises(ValueError, match="fn must return 512 elements of bfloat16"):
        map_layers(x, lambda w: w[:2])
    with pytest.raises(ValueError, match="fn must return .* got .* float32"):
        map_layers(x, lambda w: w.astype(jnp.float32))
    with pytest.raises(ValueError, match="out_shape"):
        map_layers(x, lambda w: w, out_shape=(3, 4, 8, 8))
    with pytest.raises(ValueError, match="per_layer"):
        map_layers(x, _fold, jnp.ones((2, 8)))
    assert not x.is_deleted()  # refused before any work


def test_the_layer_writes_and_the_final_reshape_need_no_second_stack():
    """The two programs map_layers runs over the whole stack alias it (the donated buffer is the output) and need
    no temporaries: memory_analysis of the compiled programs (CPU backend). A whole-stack jax.lax.map, for
    contrast, holds at least a second stack beside its result."""
    x = _stack((6, 4, 64, 64))
    size = x.size * x.dtype.itemsize
    for prog in (_put.lower(x, x[0], 0), _reshape.lower(x, (6, 4, 64, 2, 32))):
        m = prog.compile().memory_analysis()
        assert m.alias_size_in_bytes == size and m.temp_size_in_bytes <= 64, m
    whole = jax.jit(lambda s: jax.lax.map(lambda w: w.transpose(0, 2, 1), s), donate_argnums=0)
    assert whole.lower(x).compile().memory_analysis().temp_size_in_bytes >= size


def test_inference_params_donated_equal_the_copied_and_consume_the_stacks(monkeypatch):
    """inference_params(donate=True) (the CLI, the benchmark): the same params as without, the caller's expert
    gate/up stacks consumed (rewritten in place), the rest of the caller's params left valid."""
    from orl_jax import params as P
    from orl_jax.diffusion_gemma_config import DG_PRESETS
    from orl_jax.model import diffusion_gemma as dg
    from orl_jax.model import diffusion_gemma_inference as dgi

    monkeypatch.setattr(dgi, "FOLD_ATTENTION_NORMS", True)
    monkeypatch.setattr(dgi, "FOLD_FFW_NORMS", True)
    cfg = DG_PRESETS["tiny-dg"].replace(hidden_size=128, moe_intermediate_size=64, moe_impl="pallas",
                                        dtype="bfloat16")
    fresh = lambda: P.init(dg.param_specs(cfg), jax.random.key(3))  # noqa: E731
    want = dgi.inference_params(fresh(), cfg)
    params = fresh()
    got = dgi.inference_params(params, cfg, donate=True)
    assert got["sliding"]["experts_gate_up"].ndim == 5
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    assert all(params[t]["experts_gate_up"].is_deleted() for t in ("sliding", "full"))
    assert not params["sliding"]["experts_down"].is_deleted() and not params["embed"].is_deleted()
