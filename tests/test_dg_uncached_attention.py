"""DiffusionGemma's cache-free inference passes (the prompt's `prefill`, `prefill_decode`) under UNCACHED_ATTENTION
"pallas": kernels/decode_attention's masked_attention and the q/k norm kernel (interpret mode on CPU) against the
float32 einsums, in a float32 model with head dims the kernels take. The einsum passes are held to transformers in
test_diffusion_gemma_vs_hf.py; this holds the kernel passes to them."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from orl_jax import params as P
from orl_jax.diffusion_gemma_config import DG_PRESETS
from orl_jax.model import diffusion_gemma as dg

# prompt 32 and canvas 16: pass lengths (32, 48) the kernel's 16-row tiles divide; a window of 16 cuts into both
CFG = DG_PRESETS["tiny-dg"].replace(head_dim=16, global_head_dim=32, sliding_window=16, block_length=16,
                                    cached_attention_impl="pallas", moe_impl="bucketed")


@pytest.fixture(scope="module")
def setup():
    params = P.init(dg.param_specs(CFG), jax.random.key(0))
    leaves, tree = jax.tree.flatten(params)  # norms and scalars away from 1, so a misplaced weight shows
    keys = jax.random.split(jax.random.key(1), len(leaves))
    params = jax.tree.unflatten(tree, [a * (1 + 0.3 * jax.random.normal(k, a.shape)) for a, k in zip(leaves, keys)])
    rng = np.random.default_rng(0)
    prompt = jnp.asarray(rng.integers(3, 240, (2, 32)), jnp.int32)
    lengths = jnp.asarray([32, 13], jnp.int32)  # row 1 left-padded
    canvas = jnp.asarray(rng.integers(3, 240, (2, 16)), jnp.int32)
    return params, prompt, lengths, canvas


def _run(monkeypatch, choice, fn, *args):
    """fn's jitted result under UNCACHED_ATTENTION = choice, and whether its program calls masked_attention."""
    monkeypatch.setattr(dg, "UNCACHED_ATTENTION", choice)
    jax.clear_caches()
    f = jax.jit(fn, static_argnums=(1, 4))
    return f(*args), "masked_attention" in str(jax.make_jaxpr(fn, static_argnums=(1, 4))(*args))


@pytest.mark.parametrize("fused", [True, False], ids=["prefill_decode", "prefill"])
def test_kernel_passes_equal_the_einsums(setup, monkeypatch, fused):
    params, prompt, lengths, canvas = setup
    if fused:
        fn, args = (lambda p, c, t, n, s, x: dg.prefill_decode(p, c, t, n, s, x)), (canvas,)
    else:
        fn, args = dg.prefill, ()
    args = (params, CFG, prompt, lengths, 64, *args)
    (got, got_cache), used = _run(monkeypatch, "pallas", fn, *args)
    (want, want_cache), unused = _run(monkeypatch, "orl_jax", fn, *args)
    assert used and not unused
    assert float(jnp.std(want)) > 0.1
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-4, rtol=0)
    for a, b in zip(jax.tree.leaves(got_cache), jax.tree.leaves(want_cache)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4, rtol=0)
    jax.clear_caches()


def test_choice_resolves_and_is_checked(monkeypatch):
    monkeypatch.setattr(dg, "UNCACHED_ATTENTION", "pallas")
    assert dg._uncached_attention(CFG) == "pallas"
    assert dg._uncached_attention(CFG.replace(cached_attention_impl="orl_jax")) == "orl_jax"  # no kernels allowed
    monkeypatch.setattr(dg, "UNCACHED_ATTENTION", "flash")
    with pytest.raises(ValueError, match="UNCACHED_ATTENTION.*'flash'"):
        dg._uncached_attention(CFG)


def test_generate_with_the_kernel_equals_the_einsums(setup, monkeypatch):
    """generate() (the fused first step, two blocks: a fused commit too) under "pallas" against "orl_jax", token for
    token, the kernel called in the prompt's pass."""
    from orl_jax.decode.engine import generate
    from orl_jax.decode.samplers import UniformSampler
    from orl_jax_kernels.decode_attention import kernel as dk

    params = setup[0]
    calls, real = [], dk.masked_attention
    monkeypatch.setattr(dk, "masked_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    kw = dict(key=jax.random.key(4), max_new_tokens=32, sampler=UniformSampler(max_denoising_steps=3),
              eos_token_id=())
    out = {}
    for choice in ("orl_jax", "pallas"):
        monkeypatch.setattr(dg, "UNCACHED_ATTENTION", choice)
        jax.clear_caches()
        out[choice] = np.asarray(generate(params, CFG, [list(range(3, 19)), list(range(40, 49))], **kw).tokens)
        assert bool(calls) == (choice == "pallas")
    jax.clear_caches()
    np.testing.assert_array_equal(out["pallas"], out["orl_jax"])
