"""The MoE's counting sort as one kernel (kernels/expert_sort) against a stable argsort: interpret mode on CPU,
Triton IR verified at DiffusionGemma's canvas, and on a GPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from triton_ir import verified_triton_modules

from orl_jax_kernels.expert_sort.kernel import MAX_ASSIGNMENTS, expert_sort
from orl_jax_kernels.expert_sort.reference import expert_sort_reference


def _routed(seed, tokens, top_k, experts):
    scores = jax.random.normal(jax.random.key(seed), (tokens, experts))
    return jax.lax.top_k(scores, top_k)[1].reshape(-1).astype(jnp.int32)


def _assert_equal(got, want):
    for name, g, w in zip(("source", "pos", "offsets"), got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=name)


@pytest.mark.parametrize("tokens,top_k,experts", [(24, 3, 8), (7, 2, 16), (64, 8, 128)])
def test_equals_a_stable_argsort(tokens, top_k, experts):
    """Random top-k routings, M a power of two or not (7 x 2 = 14 pads to 16), experts without rows; the sorted
    rows' source as assignments (k = 1) and as tokens (k = top_k)."""
    ids = _routed(tokens + experts, tokens, top_k, experts)
    _assert_equal(expert_sort(ids, experts, interpret=True), expert_sort_reference(ids, experts))
    _assert_equal(expert_sort(ids, experts, top_k, interpret=True), expert_sort_reference(ids, experts, top_k))


@pytest.mark.parametrize("tokens,top_k,experts", [(24, 3, 8), (7, 2, 16), (64, 8, 128), (5, 1, 4)])
def test_by_token_equals_a_stable_argsort(tokens, top_k, experts):
    """by_token (distinct choices per token, ranks over the tokens): the same rows, tokens and offsets; T and k
    padded (24 x 3, 7 x 2, 5 x 1) or not."""
    ids = _routed(2 * tokens + experts, tokens, top_k, experts)
    _assert_equal(expert_sort(ids, experts, top_k, by_token=True, interpret=True),
                  expert_sort_reference(ids, experts, top_k))


def test_one_expert_takes_almost_everything():
    """Ties keep (token, choice) order: the rows of one heavy expert come out in assignment order."""
    ids = jnp.array([3, 3, 0, 3, 3, 3, 1, 3, 3, 3], jnp.int32)
    order, pos, offsets = expert_sort(ids, 4, interpret=True)
    np.testing.assert_array_equal(np.asarray(offsets), [0, 1, 2, 2, 10])
    np.testing.assert_array_equal(np.asarray(order), [2, 6, 0, 1, 3, 4, 5, 7, 8, 9])
    _assert_equal((order, pos, offsets), expert_sort_reference(ids, 4))


def test_rejects_wrong_inputs():
    with pytest.raises(ValueError, match="1-D int32"):
        expert_sort(jnp.zeros((4, 2), jnp.int32), 8, interpret=True)
    with pytest.raises(ValueError, match="1-D int32"):
        expert_sort(jnp.zeros((8,), jnp.float32), 8, interpret=True)
    with pytest.raises(ValueError, match="MAX_ASSIGNMENTS"):
        expert_sort(jnp.zeros((MAX_ASSIGNMENTS + 1,), jnp.int32), 8, interpret=True)
    with pytest.raises(ValueError, match="k must be a positive int, got 0"):
        expert_sort(jnp.zeros((8,), jnp.int32), 8, 0, interpret=True)
    with pytest.raises(ValueError, match="M=9 a multiple of k=2"):
        expert_sort(jnp.zeros((9,), jnp.int32), 8, 2, by_token=True, interpret=True)
    with pytest.raises(ValueError, match="more than MAX_ASSIGNMENTS"):
        expert_sort(jnp.zeros((MAX_ASSIGNMENTS + 8,), jnp.int32), 8, 8, by_token=True, interpret=True)


def test_lowers_to_verified_triton_at_the_canvas():
    """Pallas -> Triton IR for 256 tokens x top-8 of 128 experts, and a length that pads, no GPU needed."""
    for m in (2048, 1000):
        for by_token in (False, True):
            verified_triton_modules(lambda e, by_token=by_token: expert_sort(e, 128, 8, by_token=by_token),
                                    jax.ShapeDtypeStruct((m,), jnp.int32))


@pytest.mark.gpu
def test_compiled_on_gpu_equals_a_stable_argsort():
    ids = _routed(5, 256, 8, 128)
    _assert_equal(expert_sort(ids, 128), expert_sort_reference(ids, 128))
    _assert_equal(expert_sort(ids, 128, 8), expert_sort_reference(ids, 128, 8))
    skewed = jnp.where(jnp.arange(2048) % 3 == 0, 7, ids).astype(jnp.int32)  # one expert over BM rows
    _assert_equal(expert_sort(skewed, 128, 8), expert_sort_reference(skewed, 128, 8))
    odd = ids[:1000]  # pads to 1024
    _assert_equal(expert_sort(odd, 128, 8), expert_sort_reference(odd, 128, 8))
    for routed in (ids, odd, _routed(6, 512, 8, 128)):  # by_token: distinct choices per token (not `skewed`)
        _assert_equal(expert_sort(routed, 128, 8, by_token=True), expert_sort_reference(routed, 128, 8))
