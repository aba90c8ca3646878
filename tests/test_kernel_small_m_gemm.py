"""The split-K small-M GEMM kernel against its jnp reference: interpret mode on CPU, compiled on a GPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from orl_jax_kernels.small_m_gemm.kernel import Blocks, small_m_matmul, supported
from orl_jax_kernels.small_m_gemm.reference import matmul_reference

CASES = [(32, 512, 256, Blocks(bn=128, bk=128, splits=2)), (5, 768, 384, Blocks(bn=128, bk=256, splits=4)),
         (64, 256, 128, Blocks(bn=64, bk=128, splits=8)), (1, 384, 128, Blocks(bn=128, bk=128, splits=3))]


@pytest.mark.parametrize("m,k,n,blocks", CASES)
def test_matches_reference_in_interpret_mode(m, k, n, blocks):
    kx, kw = jax.random.split(jax.random.key(m * 7 + k))
    x = jax.random.normal(kx, (m, k), jnp.float32)
    w = jax.random.normal(kw, (k, n), jnp.float32)
    out = small_m_matmul(x, w, blocks, interpret=True)
    ref = matmul_reference(x, w)
    assert out.shape == (m, n)
    rel = float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))
    assert rel < 1e-5, rel


def test_rejects_unsupported_shapes():
    assert not supported(128, 512, 256)
    with pytest.raises(ValueError, match="not supported"):
        small_m_matmul(jnp.ones((8, 100)), jnp.ones((100, 128)), Blocks(), interpret=True)


@pytest.mark.gpu
def test_compiled_on_gpu_bf16():
    x = jax.random.normal(jax.random.key(0), (32, 2560), jnp.bfloat16)
    w = jax.random.normal(jax.random.key(1), (2560, 6144), jnp.bfloat16) * 0.02
    out = small_m_matmul(x, w, Blocks(bn=128, bk=256, splits=4)).astype(jnp.float32)
    ref = matmul_reference(x.astype(jnp.float32), w.astype(jnp.float32), jnp.float32)
    assert float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref)) < 1e-2
    assert np.all(np.isfinite(np.asarray(out)))
