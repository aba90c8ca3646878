"""The router's top-k, weights and counting sort in one kernel (kernels/expert_sort/topk_sort) against model/moe.route's
top-k and weights followed by the stable argsort: interpret mode on CPU, Triton IR at DiffusionGemma's canvas, on a
GPU; and inside the 26B's MoE path (tests/test_diffusion_gemma_vs_hf.py has the model-level check)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from triton_ir import verified_triton_modules

from orl_jax.model import moe
from orl_jax_kernels.expert_sort.topk_sort import MAX_TOKENS, topk_sort, topk_sort_reference

NAMES = ("weights", "experts", "tokens", "pos", "offsets")


def _inputs(seed, tokens, experts, dtype=jnp.bfloat16):
    logits = jax.random.normal(jax.random.key(seed), (tokens, experts), jnp.float32).astype(dtype)
    scale = jax.random.uniform(jax.random.key(seed + 1), (experts,), jnp.float32, 0.5, 1.5)
    return logits, scale


def _assert_equal(got, want):
    for name, g, w in zip(NAMES, got, want):
        g, w = np.asarray(g), np.asarray(w)
        assert g.shape == w.shape, name
        if name == "weights":  # a float32 softmax over k values: the sum's order may differ in the last bit
            np.testing.assert_allclose(g, w, rtol=1e-6, atol=0, err_msg=name)
        else:
            np.testing.assert_array_equal(g, w, err_msg=name)


@pytest.mark.parametrize("tokens,experts,k,per_program", [
    (24, 16, 4, 4),  # powers of two, T not a whole chunk
    (70, 12, 3, 2),  # E and k padded, two chunks
    (7, 8, 3, 1),  # one program per expert
    (130, 128, 8, 8),  # the 26B's experts, three chunks
])
def test_equals_route_then_a_stable_argsort(tokens, experts, k, per_program):
    logits, scale = _inputs(tokens, tokens, experts)
    _assert_equal(topk_sort(logits, scale, k, per_program, interpret=True), topk_sort_reference(logits, scale, k))


def test_ties_take_the_lowest_expert_as_top_k_does():
    """Integer logits: many equal values per row; the choices, their order and the sort follow jax.lax.top_k."""
    logits = jax.random.randint(jax.random.key(3), (40, 16), 0, 4).astype(jnp.float32)
    scale = jnp.linspace(0.5, 2.0, 16).astype(jnp.bfloat16)
    got = topk_sort(logits, scale, 4, 2, interpret=True)
    _assert_equal(got, topk_sort_reference(logits, scale, 4))
    assert np.all(np.diff(np.asarray(jax.lax.top_k(logits, 4)[0]), axis=1) <= 0)


def test_route_sorted_equals_route_and_the_sort(monkeypatch):
    """moe.route_sorted on the pallas path: the kernel's weights and experts equal moe.route's and its sorted rows
    equal _sorted_rows' of those experts; off the pallas path, or with the switch off, route's and no rows."""
    ks = jax.random.split(jax.random.key(11), 3)
    x = jax.random.normal(ks[0], (40, 32))
    scale, proj = jax.random.uniform(ks[1], (32,), minval=0.5, maxval=1.5), jax.random.normal(ks[2], (32, 16))
    es = jnp.linspace(0.5, 1.5, 16)
    w, e, rows = moe.route_sorted(x, scale, proj, es, 4, 1e-6, "pallas")
    w_ref, e_ref = moe.route(x, scale, proj, es, 4, 1e-6)
    np.testing.assert_array_equal(np.asarray(e), np.asarray(e_ref))
    np.testing.assert_allclose(np.asarray(w), np.asarray(w_ref), rtol=1e-6)
    for got, want in zip(rows, moe._sorted_rows(e_ref, 16, kernel=True)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert moe.route_sorted(x, scale, proj, es, 4, 1e-6, "bucketed")[2] is None
    monkeypatch.setattr(moe, "TOPK_SORT_KERNEL", False)
    assert moe.route_sorted(x, scale, proj, es, 4, 1e-6, "pallas")[2] is None


def test_rejects_wrong_inputs():
    logits, scale = _inputs(0, 16, 8)
    with pytest.raises(ValueError, match="do not match"):
        topk_sort(logits, scale[:4], 2, interpret=True)
    with pytest.raises(ValueError, match="do not match"):
        topk_sort(logits[0], scale, 2, interpret=True)
    with pytest.raises(ValueError, match="k=9"):
        topk_sort(logits, scale, 9, interpret=True)
    with pytest.raises(ValueError, match="k=0"):
        topk_sort(logits, scale, 0, interpret=True)
    with pytest.raises(ValueError, match=f"T={MAX_TOKENS + 1}"):
        topk_sort(jnp.zeros((MAX_TOKENS + 1, 8)), scale, 2, interpret=True)
    with pytest.raises(ValueError, match="per_program=3"):
        topk_sort(logits, scale, 2, 3, interpret=True)


def test_lowers_to_verified_triton_at_the_canvas():
    """Pallas -> Triton IR for 256 tokens x top-8 of 128 experts (bf16 logits), and a padded shape."""
    for t, e, k in ((256, 128, 8), (100, 12, 3)):
        verified_triton_modules(lambda lg, s, k=k: topk_sort(lg, s, k),
                                jax.ShapeDtypeStruct((t, e), jnp.bfloat16), jax.ShapeDtypeStruct((e,), jnp.float32))


@pytest.mark.gpu
def test_compiled_on_gpu_equals_route_then_the_sort():
    for per_program in (1, 4, 16):
        logits, scale = _inputs(5, 256, 128)
        _assert_equal(topk_sort(logits, scale, 8, per_program), topk_sort_reference(logits, scale, 8))
    logits, scale = _inputs(6, 512, 128)  # a 512-token prefill's routing
    _assert_equal(topk_sort(logits, scale, 8), topk_sort_reference(logits, scale, 8))
    ties = jnp.round(logits[:256] * 2) / 2  # many equal logits
    _assert_equal(topk_sort(ties, scale, 8), topk_sort_reference(ties, scale, 8))
