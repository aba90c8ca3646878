"""The post-attention residual + norms kernel (kernels/residual_norms) against its oracle in interpret mode, inside
the DiffusionGemma decoder, its Triton IR at the 26B's shape, and compiled on a GPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from triton_ir import verified_triton_modules

from orl_jax_kernels.residual_norms.kernel import chunk, residual_norms_stacked
from orl_jax_kernels.residual_norms.reference import residual_norms_reference

EPS = 1e-6


def _inputs(key, t, d, dtype, layers=3):
    ks = jax.random.split(key, 3)
    attn = (3.0 * jax.random.normal(ks[0], (t, d))).astype(dtype)
    x = (2.0 * jax.random.normal(ks[1], (t, d))).astype(dtype)
    vectors = (1.0 + 0.5 * jax.random.normal(ks[2], (layers, 5 * d + 7))).astype(dtype)  # 4 weights + others
    return attn, x, vectors


def _check(t, d, dtype, interpret, atol):
    attn, x, vectors = _inputs(jax.random.key(d), t, d, dtype)
    offsets = (7, 7 + 2 * d, 7 + d, 7 + 4 * d)  # any order, unaligned
    got = residual_norms_stacked(attn, x, vectors, jnp.int32(1), offsets, EPS, interpret=interpret)
    row = vectors[1]
    want = residual_norms_reference(attn, x, *(row[o:o + d] for o in offsets), EPS)
    for g, w in zip(got, want):
        assert g.dtype == dtype and g.shape == (t, d)
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), atol=atol, rtol=0)
    other = residual_norms_stacked(attn, x, vectors, jnp.int32(2), offsets, EPS, interpret=interpret)
    assert float(jnp.abs(other[1].astype(jnp.float32) - want[1].astype(jnp.float32)).max()) > 0.05  # layer read
    return got, want


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("d", [48, 768])
def test_equals_the_reference_in_interpret_mode(dtype, d):
    _check(6, d, dtype, True, 2e-6 if dtype == jnp.float32 else 0.07)


def test_refuses_what_it_does_not_take():
    attn, x, vectors = _inputs(jax.random.key(0), 4, 40, jnp.float32)
    assert chunk(40) == 0 and chunk(48) == 16 and chunk(2816) == 256
    with pytest.raises(ValueError, match="D=40"):
        residual_norms_stacked(attn, x, vectors, jnp.int32(0), (0, 40, 80, 120), EPS, interpret=True)
    attn, x, vectors = _inputs(jax.random.key(0), 4, 48, jnp.float32)
    with pytest.raises(ValueError, match="offsets"):
        residual_norms_stacked(attn, x, vectors, jnp.int32(0), (0, 48, 96, 5 * 48), EPS, interpret=True)


def test_diffusion_gemma_decoder_with_the_kernel_equals_xla(monkeypatch):
    """With RESIDUAL_NORMS_KERNEL, cached passes with the Pallas attention (interpret mode here) take the kernel in
    sliding and full layers, weights read from the packed vector stacks; the logits equal XLA's expressions'."""
    from orl_jax import params as P
    from orl_jax.config import DG_PRESETS
    from orl_jax.model import diffusion_gemma as dg
    from orl_jax_kernels.residual_norms import kernel

    cfg = DG_PRESETS["tiny-dg"].replace(head_dim=16, global_head_dim=32, block_length=16,
                                        cached_attention_impl="pallas")
    params = P.init(dg.param_specs(cfg), jax.random.key(0))
    prompt = jax.random.randint(jax.random.key(1), (2, 16), 0, 240)
    _, cache = dg.prefill(params, cfg, prompt, jnp.array([16, 11]), 48)
    canvas = jax.random.randint(jax.random.key(2), (2, 16), 0, 240)
    calls, real = [], kernel.residual_norms_stacked
    monkeypatch.setattr(kernel, "residual_norms_stacked", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(dg, "RESIDUAL_NORMS_KERNEL", True)
    got = dg.decode(params, cfg, canvas, cache)
    assert len(calls) == 2 * cfg.num_groups  # each group's sliding loop (traced once) and its full layer
    monkeypatch.setattr(dg, "RESIDUAL_NORMS_KERNEL", False)
    want = dg.decode(params, cfg, canvas, cache)
    assert len(calls) == 2 * cfg.num_groups
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=0)
    assert float(want.std()) > 0.01


def test_lowers_to_verified_triton_on_any_machine(monkeypatch):
    """At the 26B's shape: 256 tokens, D = 2816 (11 chunks of 256), the sliding layers' packed row."""
    sd = jax.ShapeDtypeStruct
    verified_triton_modules(
        monkeypatch, lambda a, x, v, i: residual_norms_stacked(a, x, v, i, (0, 2816, 5632, 8448), EPS),
        sd((256, 2816), jnp.bfloat16), sd((256, 2816), jnp.bfloat16), sd((25, 20000), jnp.bfloat16),
        sd((), jnp.int32))


@pytest.mark.gpu
def test_compiled_on_gpu():
    got, want = _check(256, 2816, jnp.bfloat16, False, 0.07)
    same = np.mean([np.mean(np.asarray(g) == np.asarray(w)) for g, w in zip(got, want)])
    assert same > 0.99, same  # float32 sums in another order flip a rare rounding
