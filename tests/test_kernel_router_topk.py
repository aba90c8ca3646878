"""The router's top-k and weights in one kernel (kernels/expert_sort/router_topk) against model/moe.route's XLA path:
interpret mode on CPU, Triton IR at DiffusionGemma's canvas, on a GPU (tests/test_diffusion_gemma_vs_hf.py has the
model-level check)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from triton_ir import verified_triton_modules

from orl_jax.model import moe
from orl_jax_kernels.expert_sort.router_topk import METHODS, router_topk


def _inputs(seed, tokens, experts, dtype=jnp.bfloat16):
    logits = jax.random.normal(jax.random.key(seed), (tokens, experts), jnp.float32).astype(dtype)
    scale = jax.random.uniform(jax.random.key(seed + 1), (experts,), jnp.float32, 0.5, 1.5)
    return logits, scale


def _assert_equal(got, want, rtol=1e-6):
    (w, e), (w_ref, e_ref) = got, want
    assert w.shape == w_ref.shape and w.dtype == jnp.float32 and e.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(e), np.asarray(e_ref))
    # a float32 softmax over k values: the sum's order may differ in the last bit
    np.testing.assert_allclose(np.asarray(w), np.asarray(w_ref), rtol=rtol, atol=0)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("tokens,experts,k,rows", [
    (24, 16, 4, 2),  # powers of two
    (70, 12, 3, 4),  # E, k and T padded
    (7, 8, 3, 1),  # one token per program
    (64, 128, 8, 2),  # the 26B's experts and top-k
])
def test_equals_route_on_the_logits(method, tokens, experts, k, rows):
    logits, scale = _inputs(tokens, tokens, experts)
    _assert_equal(router_topk(logits, scale, k, rows, method, interpret=True), moe.topk_weights(logits, scale, k))


@pytest.mark.parametrize("method", METHODS)
def test_ties_take_the_lowest_expert_as_top_k_does(method):
    """Integer logits: many equal values per row; the choices and their order follow jax.lax.top_k."""
    logits = jax.random.randint(jax.random.key(3), (40, 16), 0, 4).astype(jnp.float32)
    scale = jnp.linspace(0.5, 2.0, 16).astype(jnp.bfloat16)
    _assert_equal(router_topk(logits, scale, 4, 2, method, interpret=True), moe.topk_weights(logits, scale, 4))
    e = np.asarray(router_topk(logits, scale, 4, 2, method, interpret=True)[1])
    assert np.all(np.diff(np.asarray(logits)[np.arange(40)[:, None], e], axis=1) <= 0)  # descending


def test_route_kernel_equals_route():
    """moe.route(kernel=True): the kernel's weights and experts equal the XLA path's; with the switch off, the XLA
    path's own (same jaxpr as kernel=False)."""
    ks = jax.random.split(jax.random.key(11), 3)
    x = jax.random.normal(ks[0], (40, 32))
    scale, proj = jax.random.uniform(ks[1], (32,), minval=0.5, maxval=1.5), jax.random.normal(ks[2], (32, 16))
    es = jnp.linspace(0.5, 1.5, 16)
    _assert_equal(moe.route(x, scale, proj, es, 4, 1e-6, kernel=True), moe.route(x, scale, proj, es, 4, 1e-6))
    jaxpr = lambda kernel: str(jax.make_jaxpr(lambda a: moe.route(a, scale, proj, es, 4, 1e-6, kernel))(x))  # noqa
    assert "name=router_topk" in jaxpr(True) and "top_k[" not in jaxpr(True)
    assert "name=router_topk" not in jaxpr(False) and "top_k[" in jaxpr(False)


@pytest.mark.parametrize("method", METHODS)
def test_row_scale_scales_the_logits(method):
    """row_scale (a router whose input norm is folded into its weight): the logits times each token's factor, the
    same choice and the weights of the scaled logits; route(scale=None) takes it on both paths."""
    logits, scale = _inputs(4, 40, 16, jnp.float32)
    r = jax.random.uniform(jax.random.key(8), (40,), jnp.float32, 0.2, 5.0)
    # logits up to 5x larger: the exponentials' float32 rounding reaches a few ulps
    _assert_equal(router_topk(logits, scale, 4, 2, method, interpret=True, row_scale=r),
                  moe.topk_weights(logits * r[:, None], scale, 4), rtol=1e-5)
    x, proj = jax.random.normal(jax.random.key(5), (40, 32)), jax.random.normal(jax.random.key(6), (32, 16))
    _assert_equal(moe.route(x, None, proj, scale, 4, 1e-6, kernel=True, row_scale=r),
                  moe.route(x, None, proj, scale, 4, 1e-6, row_scale=r), rtol=1e-5)
    with pytest.raises(ValueError, match="row_scale"):
        router_topk(logits, scale, 4, interpret=True, row_scale=r[1:])
    with pytest.raises(ValueError, match="folded router"):
        moe.route(x, None, proj, scale, 4, 1e-6)


def test_rejects_wrong_inputs():
    logits, scale = _inputs(0, 16, 8)
    with pytest.raises(ValueError, match="do not match"):
        router_topk(logits, scale[:4], 2, interpret=True)
    with pytest.raises(ValueError, match="do not match"):
        router_topk(logits[0], scale, 2, interpret=True)
    with pytest.raises(ValueError, match="k=9"):
        router_topk(logits, scale, 9, interpret=True)
    with pytest.raises(ValueError, match="k=0"):
        router_topk(logits, scale, 0, interpret=True)
    with pytest.raises(ValueError, match="rows=3"):
        router_topk(logits, scale, 2, 3, interpret=True)
    with pytest.raises(ValueError, match="method='sort'"):
        router_topk(logits, scale, 2, 2, "sort", interpret=True)


@pytest.mark.parametrize("method", METHODS)
def test_lowers_to_verified_triton_at_the_canvas(method):
    """Pallas -> Triton IR for 256 tokens x top-8 of 128 experts (bf16 logits) at 1, 2 and 4 rows per program, and a
    padded shape."""
    for t, e, k, rows in ((256, 128, 8, 1), (256, 128, 8, 2), (256, 128, 8, 4), (100, 12, 3, 2)):
        verified_triton_modules(lambda lg, s, k=k, rows=rows: router_topk(lg, s, k, rows, method),
                                jax.ShapeDtypeStruct((t, e), jnp.bfloat16), jax.ShapeDtypeStruct((e,), jnp.float32))
    verified_triton_modules(lambda lg, s, r: router_topk(lg, s, 8, 1, method, row_scale=r),  # folded norms
                            jax.ShapeDtypeStruct((256, 128), jnp.bfloat16), jax.ShapeDtypeStruct((128,), jnp.float32),
                            jax.ShapeDtypeStruct((256,), jnp.float32))


@pytest.mark.gpu
@pytest.mark.parametrize("method", METHODS)
def test_compiled_on_gpu_equals_route(method):
    for rows, warps in ((1, 4), (2, 4), (4, 4), (2, 1), (4, 8)):
        logits, scale = _inputs(5, 256, 128)
        _assert_equal(router_topk(logits, scale, 8, rows, method, warps), moe.topk_weights(logits, scale, 8))
    logits, scale = _inputs(6, 512, 128)  # a 512-token prefill's routing
    _assert_equal(router_topk(logits, scale, 8, 2, method), moe.topk_weights(logits, scale, 8))
    ties = jnp.round(logits[:256] * 2) / 2  # many equal logits
    _assert_equal(router_topk(ties, scale, 8, 2, method), moe.topk_weights(ties, scale, 8))
    r = jax.random.uniform(jax.random.key(7), (256,), jnp.float32, 0.2, 5.0)  # folded norms' factors
    _assert_equal(router_topk(logits[:256], scale, 8, 1, method, row_scale=r),
                  moe.topk_weights(logits[:256].astype(jnp.float32) * r[:, None], scale, 8), rtol=1e-5)
