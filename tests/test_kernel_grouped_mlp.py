"""kernels/grouped_gemm/mlp.py (a whole expert MLP in one launch, work items by atomic ticket) against the two
grouped GEMMs it replaces: interpret mode on CPU, Triton IR verified at DiffusionGemma's shapes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from triton_ir import verified_triton_modules

from orl_jax_kernels.grouped_gemm.kernel import grouped_matmul, tile_gated
from orl_jax_kernels.grouped_gemm.mlp import grouped_mlp
from orl_jax_kernels.small_m_gemm.kernel import Blocks

ACT = staticmethod(lambda v: jax.nn.gelu(v, approximate=True)).__func__
GU, DN = Blocks(bn=128, bk=64, splits=1), Blocks(bn=64, bk=64, splits=1)


def _case(dtype, key=0):
    ks = jax.random.split(jax.random.key(key), 4)
    e, d, f, t, bm = 5, 128, 128, 23, 16
    sizes = jnp.array([3, 2 * bm + 5, 0, 11, 1])  # a group over several row tiles, an empty one
    offsets = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(sizes).astype(jnp.int32)])
    x = jax.random.normal(ks[0], (t, d)).astype(dtype)
    rows = jax.random.randint(ks[1], (int(sizes.sum()) + 4,), 0, t, jnp.int32)  # 4 rows past the groups
    gu = (jax.random.normal(ks[2], (2, e, d, 2 * f)) * 0.1).astype(dtype)
    dn = (jax.random.normal(ks[3], (2, e, f, d)) * 0.1).astype(dtype)
    return sizes, offsets, x, rows, gu, dn, bm


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_matches_the_two_grouped_gemms_in_interpret_mode(dtype):
    sizes, offsets, x, rows, gu, dn, bm = _case(dtype)
    layer = jnp.int32(1)
    got = grouped_mlp(x, rows, tile_gated(gu, GU.bn // 2), dn, offsets, layer, ACT, GU, DN, bm=bm, interpret=True)
    h = grouped_matmul(x, tile_gated(gu, GU.bn // 2), sizes, layer, GU, interpret=True, offsets=offsets,
                       rows=rows, gated=ACT, bm=bm)
    want = grouped_matmul(h, dn, sizes, layer, DN, interpret=True, offsets=offsets, bm=bm)
    assert got.shape == (rows.shape[0], x.shape[1]) and got.dtype == dtype
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tol, atol=tol)
    assert not np.asarray(got[-4:], np.float32).any()
    # the check can fail: the other layer's weights give other rows
    other = grouped_mlp(x, rows, tile_gated(gu, GU.bn // 2), dn, offsets, jnp.int32(0), ACT, GU, DN, bm=bm,
                        interpret=True)
    assert np.abs(np.asarray(other, np.float32) - np.asarray(want, np.float32)).max() > 0.01


def test_rejects_mismatched_inputs():
    sizes, offsets, x, rows, gu, dn, bm = _case(jnp.float32)
    tgu = tile_gated(gu, 64)
    with pytest.raises(ValueError, match="tile_gated stack"):
        grouped_mlp(x, rows, gu, dn, offsets, jnp.int32(0), ACT, GU, DN, interpret=True)
    with pytest.raises(ValueError, match="do not match"):
        grouped_mlp(x, rows, tgu, dn, offsets, jnp.int32(0), ACT, Blocks(bn=64, bk=64, splits=1), DN,
                    interpret=True)
    with pytest.raises(ValueError, match="offsets"):
        grouped_mlp(x, rows, tgu, dn, offsets[1:], jnp.int32(0), ACT, GU, DN, interpret=True)


def test_triton_ir_at_diffusion_gemma_shapes():
    sd = jax.ShapeDtypeStruct
    verified_triton_modules(
        lambda x, r, gu, dn, o, i: grouped_mlp(x, r, gu, dn, o, i, ACT, GU, Blocks(bn=128, bk=64, splits=1)),
        sd((256, 2816), jnp.bfloat16), sd((2048,), jnp.int32), sd((25, 128, 11, 2816, 128), jnp.bfloat16),
        sd((25, 128, 704, 2816), jnp.bfloat16), sd((129,), jnp.int32), sd((), jnp.int32))
