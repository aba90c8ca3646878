"""The LM head's GEMM with the one-pass statistics in its epilogue (kernels/softcap_softmax/head_stats.py, interpret
mode): against the one-pass kernel on the product and a float64 computation; its refusals; its Triton lowering at
the 26B's shapes. (Not used by the engine: slower than cuBLAS + the one-pass kernel on an H100,
benchmarks/results/2026-12-06_dg_head_stats_h100.md.)"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from triton_ir import verified_triton_modules

from orl_jax.decode.samplers import _chunk_width
from orl_jax_kernels.softcap_softmax import head_stats as hs
from orl_jax_kernels.softcap_softmax import kernel as sk

CAP = 30.0
NAMES = ("e", "mass", "t", "first", "raw_max", "x_max", "shift")


def _operands(rows=32, k=64, v=1024, exact=True, seed=0):
    """h [rows, k], w [v, k] in bf16. exact: small integers, so every order of the float32 sums gives the same
    product, itself exact in bf16 (|raw| <= 4 k), with many ties for the argmax."""
    kh, kw = jax.random.split(jax.random.key(seed))
    if exact:
        return (jax.random.randint(kh, (rows, k), -2, 3).astype(jnp.bfloat16),
                jax.random.randint(kw, (v, k), -2, 3).astype(jnp.bfloat16))
    return (jax.random.normal(kh, (rows, k), jnp.bfloat16),
            (0.3 * jax.random.normal(kw, (v, k), jnp.float32)).astype(jnp.bfloat16))


@pytest.mark.parametrize("tiles", [hs.Tiles(bm=16, bn=16, bk=16), hs.Tiles(bm=32, bn=32, bk=32),
                                   hs.Tiles(bm=8, bn=8, bk=64)], ids=lambda t: f"{t.bm}x{t.bn}x{t.bk}")
@pytest.mark.parametrize("t", [0.4, 1.0])
def test_equals_the_one_pass_kernel_on_the_product(tiles, t):
    """Exact operands: the product, the probabilities, the argmax and the maxima bit for bit; the sums merged from
    BN-wide pieces into 32-wide chunks within float32 rounding."""
    h, w = _operands()
    width = _chunk_width(w.shape[0])
    assert width == 32
    raw, *got = hs.head_one_pass_stats(h, w, jnp.float32(1 / t), cap=CAP, width=width, tiles=tiles, interpret=True)
    product = jnp.dot(h, w.T, preferred_element_type=jnp.float32).astype(jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(raw, np.float32), np.asarray(product, np.float32))
    want = sk.softcap_one_pass_stats(product, jnp.float32(1 / t), cap=CAP, width=width, chunks_per_program=1,
                                     interpret=True)
    for name, a, b in zip(NAMES, got, want):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert a.shape == b.shape, name
        if name in ("e", "first", "raw_max", "shift"):
            np.testing.assert_array_equal(a, b, err_msg=name)
        else:
            np.testing.assert_allclose(a, b, rtol=2e-5, atol=4e-5, err_msg=name)  # x: 1 ulp at 75 is 8e-6


def test_merge_pieces_against_float64():
    """Random operands, 8-wide pieces folded into 32-wide chunks: each chunk's sums relative to its maximum, as a
    direct float64 computation on the kernel's own product."""
    h, w = _operands(exact=False)
    t = 0.5
    raw, e, mass, tsum, first, raw_max, x_max, shift = hs.head_one_pass_stats(
        h, w, jnp.float32(1 / t), cap=CAP, width=32, tiles=hs.Tiles(bm=16, bn=8, bk=16), interpret=True)
    r = np.asarray(raw, np.float64)
    x = np.tanh(r / CAP) * CAP / t
    chunks = lambda a: a.reshape(a.shape[0], -1, 32)  # noqa: E731
    xm = chunks(x).max(-1)
    d = chunks(x) - xm[..., None]
    np.testing.assert_allclose(np.asarray(x_max), xm, rtol=1e-6, atol=1e-5)
    np.testing.assert_allclose(np.asarray(mass), np.exp(d).sum(-1), rtol=2e-5)
    np.testing.assert_allclose(np.asarray(tsum), (np.exp(d) * d).sum(-1), rtol=2e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(raw_max, np.float64), chunks(r).max(-1))
    np.testing.assert_array_equal(np.asarray(first), chunks(r).argmax(-1) + np.arange(r.shape[1] // 32) * 32)
    np.testing.assert_allclose(np.asarray(e, np.float64), np.exp(x - float(shift)), rtol=8e-3)
    np.testing.assert_allclose(np.asarray(raw, np.float32),
                               np.asarray(h, np.float32) @ np.asarray(w, np.float32).T, rtol=1e-2, atol=1e-2)


def test_refusals_name_the_shape():
    h, w = _operands(rows=24)
    with pytest.raises(ValueError, match="R=24"):
        hs.head_one_pass_stats(h, w, 1.0, cap=CAP, width=32, tiles=hs.Tiles(bm=16, bn=16, bk=16), interpret=True)
    h, w = _operands()
    with pytest.raises(ValueError, match="width=32"):
        hs.head_one_pass_stats(h, w, 1.0, cap=CAP, width=32, tiles=hs.Tiles(bm=16, bn=64, bk=16), interpret=True)
    with pytest.raises(ValueError, match="K"):
        hs.head_one_pass_pieces(h, w[:, :32], 1.0, cap=CAP, interpret=True)
    with pytest.raises(ValueError, match="per_chunk=3"):
        hs.merge_pieces(3, *(jnp.zeros((2, 8)),) * 5)
    assert not hs.supported(256, 2816, 262144, 512, hs.Tiles(bk=512)) and hs.supported(256, 2816, 262144, 512)


def test_lowers_to_verified_triton_at_the_26b():
    sd = jax.ShapeDtypeStruct
    verified_triton_modules(lambda h, w, t: hs.head_one_pass_pieces(h, w, t, cap=CAP),
                            sd((256, 2816), jnp.bfloat16), sd((262144, 2816), jnp.bfloat16), sd((), jnp.float32))
