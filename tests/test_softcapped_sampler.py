"""The uniform sampler given the LM head's product (softcapped.SoftCapped): SOFTCAP_STATS "raw_max" (the row max and
argmax over the raw bf16 product) and "kernel" (kernels/softcap_softmax in interpret mode) against the "xla" path on
the float32 logits: the same decisions, statistics within float32 rounding, the probabilities within bf16's; the
default "auto" ("kernel" on a GPU, "xla" elsewhere); the kernel against a direct computation; and generate() token
for token in each mode."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from triton_ir import verified_triton_modules

from orl_jax.decode import softcapped
from orl_jax.decode.samplers import UniformSampler, _chunk_width
from orl_jax.decode.softcapped import SoftCapped
from orl_jax.diffusion_gemma_config import DG_PRESETS
from orl_jax_kernels.softcap_softmax.kernel import softcap_chunk_stats, supported

CAP = 30.0


def test_raw_argmax_is_the_processed_argmax_below_200():
    """The documented range: over every bf16 value with 4e-37 < |raw| < 200, the processed logits
    cap * tanh(raw / cap) / T (float32, this backend's tanh) strictly increase, so the first index of the raw maximum
    is the first index of the processed one. Above it they do not (the check can fail)."""
    pos = jax.lax.bitcast_convert_type(jnp.arange(1, 0x7F80, dtype=jnp.uint16), jnp.bfloat16)
    raw = jnp.concatenate([-pos[::-1], pos])  # ascending
    r = np.asarray(raw.astype(jnp.float32))
    inside = (np.abs(r[:-1]) > 4e-37) & (np.abs(r[1:]) > 4e-37) & (np.abs(r[:-1]) < 200) & (np.abs(r[1:]) < 200)
    for t in (0.4, 0.8, 1.0):
        x = np.asarray(jax.jit(lambda a, t=t: SoftCapped(a, CAP).logits() / t)(raw))
        rises = np.diff(x) > 0
        assert rises[inside].all(), t
        assert not rises[np.abs(r[:-1]) > 230].all()


def _raw(b=2, l=16, v=4096, seed=0):
    """A bf16 head product: flat rows, half of them with one dominant entry (low entropy, accepted), ties of the row
    max in two chunks of row (0, 1), and a maximum in the last chunk of row (0, 2)."""
    raw = 3.0 * jax.random.normal(jax.random.key(seed), (b, l, v), jnp.float32)
    raw = raw.at[:, : l // 2, 17 % v].set(40.0)
    raw = raw.at[0, 1, [300, 3000]].set(45.0)
    raw = raw.at[0, 2, v - 5].set(50.0)
    return raw.astype(jnp.bfloat16)


def _step(mode, raw, step=3):
    key = jax.random.key(1)
    sampler = UniformSampler(confidence=0.0)
    canvas, state = sampler.init(jax.random.key(2), raw.shape[0], raw.shape[1], DG_PRESETS["tiny-dg"])
    prev = softcapped.SOFTCAP_STATS
    softcapped.SOFTCAP_STATS = mode
    try:
        jax.clear_caches()
        return jax.jit(lambda r: sampler.step(SoftCapped(r, CAP), canvas, state, key, step,
                                              jnp.ones((raw.shape[0],), bool)))(raw)
    finally:
        softcapped.SOFTCAP_STATS = prev
        jax.clear_caches()


@pytest.mark.parametrize("mode", ["raw_max", "kernel", "kernel_branch_free"])
def test_modes_decide_as_the_xla_path(mode, monkeypatch):
    from orl_jax_kernels.softcap_softmax import kernel as sk

    monkeypatch.setattr(sk, "BRANCH_FREE", mode == "kernel_branch_free")
    mode = mode.removesuffix("_branch_free")
    raw = _raw()
    want, got = _step("xla", raw), _step(mode, raw)
    for k in ("argmax",):
        np.testing.assert_array_equal(np.asarray(got.state[k]), np.asarray(want.state[k]))
    assert int(want.state["argmax"][0, 1]) == 300 and int(want.state["argmax"][0, 2]) == 4091
    np.testing.assert_array_equal(np.asarray(got.canvas), np.asarray(want.canvas))
    np.testing.assert_array_equal(np.asarray(got.resolved), np.asarray(want.resolved))
    assert 0 < int(want.resolved.sum()) < want.resolved.size
    np.testing.assert_allclose(np.asarray(got.entropy), np.asarray(want.entropy), atol=1e-5)
    np.testing.assert_allclose(np.asarray(got.probs_scale), np.asarray(want.probs_scale), rtol=1e-5)  # x: 1 ulp
    p_got, p_want = (np.asarray(o.probs, np.float32) for o in (got, want))
    np.testing.assert_allclose(p_got, p_want, rtol=1e-2, atol=1e-6)  # the kernel's are bf16
    assert (got.probs.dtype == jnp.bfloat16) == (mode == "kernel")


def test_auto_takes_the_kernel_on_a_gpu_only():
    """The default "auto": the kernel (bf16 probabilities) on a GPU; elsewhere the float32 logits' path, exactly
    (on a CPU the kernel would run in Pallas' interpreter)."""
    assert softcapped.SOFTCAP_STATS == "auto"
    raw = _raw(v=1024)
    got, want = _step("auto", raw), _step("xla", raw)
    on_gpu = jax.default_backend() == "gpu"
    assert (got.probs.dtype == jnp.bfloat16) == on_gpu
    if not on_gpu:
        for a, b in ((got.canvas, want.canvas), (got.probs, want.probs), (got.entropy, want.entropy)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_float32_products_keep_the_xla_path():
    """A float32 product (the parity tests' models) takes the float32 logits in every mode: no kernel."""
    raw = _raw(v=256).astype(jnp.float32)
    sampler = UniformSampler()
    canvas, state = sampler.init(jax.random.key(2), 2, 16, DG_PRESETS["tiny-dg"])
    prev = softcapped.SOFTCAP_STATS
    softcapped.SOFTCAP_STATS = "kernel"
    try:
        jaxpr = str(jax.make_jaxpr(lambda r: sampler.step(SoftCapped(r, CAP), canvas, state, jax.random.key(1), 3,
                                                          jnp.ones((2,), bool)))(raw))
    finally:
        softcapped.SOFTCAP_STATS = prev
    assert "pallas_call" not in jaxpr


@pytest.fixture(params=[False, True], ids=["libdevice", "branch_free"])
def form(request, monkeypatch):
    """softcap_softmax.kernel.BRANCH_FREE (read at trace time: jax's caches cleared around it)."""
    from orl_jax_kernels.softcap_softmax import kernel as sk

    monkeypatch.setattr(sk, "BRANCH_FREE", request.param)
    jax.clear_caches()
    yield request.param
    jax.clear_caches()


def test_kernel_equals_a_direct_computation(form):
    raw = _raw(v=1024).reshape(-1, 1024)
    w = _chunk_width(1024)
    assert supported(1024, w) and not supported(1000, 8) and not supported(1024, 24)
    t = 0.6
    x = np.tanh(np.asarray(raw, np.float64) / CAP) * CAP / t
    m = x.max(-1)
    raw_max = jnp.max(raw, axis=-1)
    e, mass, tsum, first = softcap_chunk_stats(raw, jnp.asarray(m, jnp.float32), raw_max, jnp.float32(1 / t),
                                               cap=CAP, width=w, interpret=True)
    d = x - m[:, None]
    ex = np.exp(d)
    np.testing.assert_allclose(np.asarray(e, np.float32), ex, rtol=8e-3, atol=1e-7)
    chunks = lambda a: a.reshape(a.shape[0], -1, w)  # noqa: E731
    np.testing.assert_allclose(np.asarray(mass), chunks(ex).sum(-1), rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(tsum), chunks(ex * d).sum(-1), rtol=2e-5, atol=1e-5)
    r = np.asarray(raw, np.float32)
    hit = chunks(r == r.max(-1, keepdims=True))
    want_first = np.where(hit.any(-1), hit.argmax(-1) + np.arange(hit.shape[1]) * w, 1024)
    np.testing.assert_array_equal(np.asarray(first), want_first)
    assert (np.asarray(first).min(-1) == r.argmax(-1)).all()
    with pytest.raises(ValueError, match="V=1000"):
        softcap_chunk_stats(raw[:, :1000], m, raw_max, 1.0, cap=CAP, width=8, interpret=True)


def test_kernel_lowers_to_verified_triton_at_the_26b(form):
    sd = jax.ShapeDtypeStruct
    verified_triton_modules(lambda r, m, rm, t: softcap_chunk_stats(r, m, rm, t, cap=CAP, width=512),
                            sd((256, 262144), jnp.bfloat16), sd((256,), jnp.float32), sd((256,), jnp.bfloat16),
                            sd((), jnp.float32))


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["raw_max", "kernel", "auto", "kernel_branch_free"])
def test_modes_on_gpu_at_the_26b(mode, monkeypatch):
    """The 26B's canvas (256 x 262144, bf16) compiled on a GPU: the same decisions as the float32 logits' path."""
    from orl_jax_kernels.softcap_softmax import kernel as sk

    monkeypatch.setattr(sk, "BRANCH_FREE", mode == "kernel_branch_free")
    mode = mode.removesuffix("_branch_free")
    assert _chunk_width(262144) == 512
    raw = _raw(b=1, l=256, v=262144)
    want, got = _step("xla", raw), _step(mode, raw)
    for a, b in ((got.state["argmax"], want.state["argmax"]), (got.canvas, want.canvas),
                 (got.resolved, want.resolved)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_allclose(np.asarray(got.entropy), np.asarray(want.entropy), atol=1e-5)
    np.testing.assert_allclose(np.asarray(got.probs_scale), np.asarray(want.probs_scale), rtol=1e-5)


@pytest.fixture(scope="module")
def tiny_dg():
    from orl_jax import params as P
    from orl_jax.model import diffusion_gemma as dg

    cfg = DG_PRESETS["tiny-dg"].replace(dtype="bfloat16", vocab_size=1024, image_token_id=None, boi_token_id=None,
                                        eoi_token_id=None)
    params = jax.tree.map(lambda a: a.astype(jnp.bfloat16), P.init(dg.param_specs(cfg), jax.random.key(0)))
    return cfg, params


def test_generate_equal_in_every_mode(tiny_dg, monkeypatch):
    """generate() of a bf16 DiffusionGemma (both fused passes: two blocks), token for token, each mode against
    "xla"; with "kernel" its program calls the kernel."""
    from orl_jax.decode.engine import generate
    from orl_jax_kernels.softcap_softmax import kernel as sk

    cfg, params = tiny_dg
    calls, real = [], sk.softcap_chunk_stats
    monkeypatch.setattr(sk, "softcap_chunk_stats", lambda *a, **k: calls.append(1) or real(*a, **k))
    kw = dict(key=jax.random.key(3), max_new_tokens=16, sampler=UniformSampler(max_denoising_steps=4),
              eos_token_id=())
    outs = {}
    for mode in ("xla", "raw_max", "kernel"):
        monkeypatch.setattr(softcapped, "SOFTCAP_STATS", mode)
        jax.clear_caches()
        outs[mode] = np.asarray(generate(params, cfg, [[5, 6, 7, 8, 9]], **kw).tokens)
        assert bool(calls) == (mode == "kernel"), mode
    jax.clear_caches()
    assert outs["xla"].max() < cfg.vocab_size
    for mode in ("raw_max", "kernel"):
        np.testing.assert_array_equal(outs[mode], outs["xla"])


def test_bad_mode_named():
    prev = softcapped.SOFTCAP_STATS
    softcapped.SOFTCAP_STATS = "fast"
    try:
        with pytest.raises(ValueError, match="SOFTCAP_STATS.*'fast'"):
            softcapped.softcapped_parts(SoftCapped(_raw(v=256), CAP), 0.5)
    finally:
        softcapped.SOFTCAP_STATS = prev
