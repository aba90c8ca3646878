"""kernels/router_topk (DiffusionGemma's router in one launch) against model/moe.route: interpret mode on CPU,
Triton IR verified at the 26B shape, and on a GPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from triton_ir import verified_triton_modules

from orl_jax.model.moe import route
from orl_jax_kernels.router_topk.kernel import route_stacked, supported


def _inputs(seed, t, d, e, layers=3, dtype=jnp.float32):
    ks = jax.random.split(jax.random.key(seed), 4)
    x = (jax.random.normal(ks[0], (t, d)) * 3).astype(dtype)
    proj = jax.random.normal(ks[1], (layers, d, e)).astype(dtype)
    # packed per-layer vectors: [junk 5 | scale D | expert scale E | junk 3], as pack_vectors lays them out
    vectors = jax.random.uniform(ks[2], (layers, 5 + d + e + 3), minval=0.5, maxval=1.5).astype(dtype)
    return x, proj, vectors, (5, 5 + d)


@pytest.mark.parametrize("t,d,e,k", [(32, 64, 8, 2), (16, 96, 16, 4), (48, 256, 32, 8)])
def test_equals_moe_route_in_interpret_mode(t, d, e, k):
    x, proj, vectors, (so, eo) = _inputs(t + d, t, d, e)
    got_w, got_i = route_stacked(x, proj, jnp.int32(1), vectors, jnp.int32(2), (so, eo), k, 1e-6, interpret=True)
    want_w, want_i = route(x, vectors[2, so:so + d], proj[1], vectors[2, eo:eo + e], k, 1e-6)
    np.testing.assert_array_equal(np.asarray(got_i), np.asarray(want_i))
    np.testing.assert_allclose(np.asarray(got_w), np.asarray(want_w), rtol=1e-5, atol=1e-6)
    # the check can fail: another layer's router chooses other experts
    other_i = route_stacked(x, proj, jnp.int32(0), vectors, jnp.int32(2), (so, eo), k, 1e-6, interpret=True)[1]
    assert (np.asarray(other_i) != np.asarray(want_i)).any()


def test_bf16_keeps_the_casts_of_moe_route():
    x, proj, vectors, (so, eo) = _inputs(3, 32, 128, 16, dtype=jnp.bfloat16)
    got_w, got_i = route_stacked(x, proj, jnp.int32(2), vectors, jnp.int32(0), (so, eo), 4, 1e-6, interpret=True)
    want_w, want_i = route(x, vectors[0, so:so + 128], proj[2], vectors[0, eo:eo + 16], 4, 1e-6)
    assert (np.asarray(got_i) == np.asarray(want_i)).mean() > 0.97  # near-ties may swap under chunked sums
    np.testing.assert_allclose(np.asarray(got_w), np.asarray(want_w), rtol=2e-2, atol=2e-3)


def test_ties_pick_the_lowest_index_as_top_k():
    d, e = 32, 8
    x = jnp.ones((16, d))
    proj = jnp.zeros((1, d, e)).at[0, :, 3].set(1.0).at[0, :, 5].set(1.0)  # experts 3 and 5 tie, the rest tie
    vectors = jnp.ones((1, d + e))
    w, i = route_stacked(x, proj, jnp.int32(0), vectors, jnp.int32(0), (0, d), 4, 1e-6, interpret=True)
    want_w, want_i = route(x, vectors[0, :d], proj[0], vectors[0, d:], 4, 1e-6)
    np.testing.assert_array_equal(np.asarray(i), np.asarray(want_i))
    np.testing.assert_array_equal(np.asarray(i[0]), [3, 5, 0, 1])


def test_rejects_what_it_does_not_take():
    x, proj, vectors, offs = _inputs(0, 32, 64, 8)
    assert not supported(24, 64, 8, 2) and not supported(32, 64, 6, 2) and not supported(32, 64, 8, 3)
    with pytest.raises(ValueError, match="not supported"):
        route_stacked(x, proj, jnp.int32(0), vectors, jnp.int32(0), offs, 3, 1e-6, interpret=True)
    with pytest.raises(ValueError, match="do not match"):
        route_stacked(x, proj, jnp.int32(0), vectors, jnp.int32(0), (0, vectors.shape[1]), 2, 1e-6, interpret=True)
    with pytest.raises(ValueError, match="needs `layer`"):
        route_stacked(x, proj, None, vectors, jnp.int32(0), offs, 2, 1e-6, interpret=True)


def test_lowers_to_verified_triton_at_the_26b_shape(monkeypatch):
    sd = jax.ShapeDtypeStruct
    verified_triton_modules(monkeypatch, lambda x, w, v, i: route_stacked(x, w, i, v, i, (0, 2816), 8, 1e-6),
                            sd((256, 2816), jnp.bfloat16), sd((25, 2816, 128), jnp.bfloat16),
                            sd((25, 2816 + 128), jnp.bfloat16), sd((), jnp.int32))


@pytest.mark.gpu
def test_compiled_on_gpu_matches_moe_route():
    x, proj, vectors, (so, eo) = _inputs(5, 256, 2816, 128, dtype=jnp.bfloat16)
    got_w, got_i = route_stacked(x, proj, jnp.int32(1), vectors, jnp.int32(1), (so, eo), 8, 1e-6)
    want_w, want_i = jax.jit(route, static_argnums=(4, 5))(x, vectors[1, so:so + 2816], proj[1],
                                                           vectors[1, eo:eo + 128], 8, 1e-6)
    assert (np.asarray(got_i) == np.asarray(want_i)).mean() > 0.97
    np.testing.assert_allclose(np.asarray(got_w), np.asarray(want_w), rtol=3e-2, atol=3e-3)
