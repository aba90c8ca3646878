"""The masked softmax kernel (kernels/masked_softmax) against its oracle in interpret mode, through attention() at
wide heads, its Triton IR at DiffusionGemma's full layers, and compiled on a GPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from triton_ir import verified_triton_modules

from orl_jax.model import attention as A
from orl_jax_kernels.masked_softmax.kernel import masked_softmax, supported
from orl_jax_kernels.masked_softmax.reference import masked_softmax_reference


def _scores(key, b=2, kv=2, g=3, l=16, s=64):
    ks = jax.random.split(key, 2)
    scores = 4.0 * jax.random.normal(ks[0], (b, kv, g, l, s), jnp.float32)
    mask = jax.random.bernoulli(ks[1], 0.7, (b, l, s))
    return scores, mask.at[1, 5].set(False)  # row (1, 5) sees no key: uniform, finite


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_equals_the_reference_in_interpret_mode(dtype):
    scores, mask = _scores(jax.random.key(0))
    got = masked_softmax(scores, mask, scale=0.5, dtype=dtype, interpret=True)
    want = masked_softmax_reference(scores, mask, 0.5, dtype)
    assert got.dtype == dtype
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               atol=1e-6 if dtype == jnp.float32 else 8e-3, rtol=0)
    # the mask rows belong to their (b, l): another row's mask changes the result
    other = masked_softmax(scores, jnp.roll(mask, 1, axis=1), scale=0.5, dtype=dtype, interpret=True)
    assert float(jnp.abs(other.astype(jnp.float32) - want.astype(jnp.float32)).max()) > 0.05
    assert np.isfinite(np.asarray(got, np.float32)).all()


def test_refuses_shapes_it_does_not_take():
    scores, mask = _scores(jax.random.key(1), s=48)
    assert not supported(16, 48) and supported(16, 64) and not supported(12, 64)
    with pytest.raises(ValueError, match="S=48"):
        masked_softmax(scores, mask, scale=1.0, dtype=jnp.float32, interpret=True)
    with pytest.raises(ValueError, match="mask"):
        masked_softmax(scores, mask[:, :8], scale=1.0, dtype=jnp.float32, interpret=True)


def test_attention_of_wide_heads_with_the_kernel_equals_the_einsums(monkeypatch):
    """attention(impl="pallas") on heads wider than cuDNN's (cache + self parts joined) with WIDE_SOFTMAX_KERNEL
    (the products query-major), two kv heads."""
    ks = jax.random.split(jax.random.key(2), 6)
    b, l, s, n, kv, h = 2, 128, 128, 4, 2, 512  # a long pass: not the attention kernel's (preferred)
    q = jax.random.normal(ks[0], (b, l, n, h))
    kc, vc = (jax.random.normal(k, (b, s, kv, h)) for k in ks[1:3])
    kself, vself = (jax.random.normal(k, (b, l, kv, h)) for k in ks[3:5])
    cm = A.cache_mask(jnp.array([0, 20]), 100, s, l)
    sm = A.self_mask(A.full_segments(b, l))
    parts = [(kc, vc, cm), (kself, vself, sm)]
    want = A.attention(q, parts, "orl_jax", scale=1.0)
    calls, real = [], masked_softmax
    from orl_jax_kernels.masked_softmax import kernel

    monkeypatch.setattr(kernel, "masked_softmax", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(A, "WIDE_SOFTMAX_KERNEL", True)
    got = A.attention(q, parts, "pallas", scale=1.0)
    assert calls
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=0)


def test_lowers_to_verified_triton_on_any_machine():
    """At DiffusionGemma's full layers: 2 kv heads x 8 query heads, 256 queries over 768 + 256 keys."""
    sd = jax.ShapeDtypeStruct
    verified_triton_modules(lambda s, m: masked_softmax(s, m, scale=1.0, dtype=jnp.bfloat16),
                            sd((1, 2, 8, 256, 1024), jnp.float32), sd((1, 256, 1024), jnp.int8))


@pytest.mark.gpu
def test_compiled_on_gpu():
    scores, mask = _scores(jax.random.key(3), b=1, kv=2, g=8, l=256, s=1024)
    got = masked_softmax(scores, mask, scale=1.0, dtype=jnp.bfloat16)
    want = masked_softmax_reference(scores, mask, 1.0, jnp.bfloat16)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=8e-3, rtol=0)
