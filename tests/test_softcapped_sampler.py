"""The uniform sampler given the LM head's product (softcapped.SoftCapped): SOFTCAP_STATS "raw_max" (the row max and
argmax over the raw bf16 product), "kernel" and "one_pass" (kernels/softcap_softmax in interpret mode) against the
"xla" path on
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
from orl_jax_kernels.softcap_softmax.kernel import (
    MAX_CAP_OVER_T,
    one_pass_totals,
    softcap_chunk_stats,
    softcap_one_pass_stats,
    supported,
)

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


def _step(mode, raw, step=3, sampler=None):
    key = jax.random.key(1)
    sampler = sampler or UniformSampler(confidence=0.0)
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


@pytest.mark.parametrize("mode", ["raw_max", "kernel", "one_pass"])
def test_modes_decide_as_the_xla_path(mode):
    raw = _raw()
    want, got = _step("xla", raw), _step(mode, raw)
    for k in ("argmax",):
        np.testing.assert_array_equal(np.asarray(got.state[k]), np.asarray(want.state[k]))
    assert int(want.state["argmax"][0, 1]) == 300 and int(want.state["argmax"][0, 2]) == 4091
    np.testing.assert_array_equal(np.asarray(got.canvas), np.asarray(want.canvas))
    np.testing.assert_array_equal(np.asarray(got.resolved), np.asarray(want.resolved))
    assert 0 < int(want.resolved.sum()) < want.resolved.size
    np.testing.assert_allclose(np.asarray(got.entropy), np.asarray(want.entropy), atol=1e-5)
    if mode != "one_pass":  # its probabilities are relative to a shift, not to the row max
        np.testing.assert_allclose(np.asarray(got.probs_scale), np.asarray(want.probs_scale), rtol=1e-5)  # x: 1 ulp
    p_got, p_want = (np.asarray(o.probs, np.float32) * np.asarray(o.probs_scale)[..., None] for o in (got, want))
    np.testing.assert_allclose(p_got, p_want, rtol=1e-2, atol=1e-9)  # the kernel's are bf16
    np.testing.assert_allclose(p_got.sum(-1), 1.0, rtol=1e-2)
    assert (got.probs.dtype == jnp.bfloat16) == (mode in ("kernel", "one_pass"))


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


def test_kernel_equals_a_direct_computation():
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


@pytest.mark.parametrize("fast_math", [False, True])
def test_one_pass_equals_a_direct_computation(fast_math):
    """The one-pass form against float64: its chunks relative to their own maxima, e relative to the shift, and the
    merged row statistics, at cap / T = 75.3 (just inside its bound: e spans e^-86.6 .. e^64), 75 (DiffusionGemma at
    T = 0.4) and 30. fast_math: FAST_MATH's formula (in exact float32 operations here; PTX's approximations in
    test_one_pass_fast_math_on_gpu)."""
    raw = _raw(v=1024).reshape(-1, 1024)
    raw = raw.at[3].set(-300.0).at[4, :512].set(300.0)  # a row at the cap's floor; one half at its top
    w = _chunk_width(1024)
    chunks = lambda a: a.reshape(a.shape[0], -1, w)  # noqa: E731
    for t in (CAP / MAX_CAP_OVER_T + 1e-3, 0.4, 1.0):
        e, mass, tsum, first, chunk_raw_max, x_max, shift = softcap_one_pass_stats(
            raw, jnp.float32(1 / t), cap=CAP, width=w, interpret=True, fast_math=fast_math)
        x = np.tanh(np.asarray(raw, np.float64) / CAP) * CAP / t
        assert float(shift) == pytest.approx(CAP / t - 64.0, rel=1e-6)
        np.testing.assert_allclose(np.asarray(e, np.float64), np.exp(x - float(shift)), rtol=8e-3)
        assert np.isfinite(np.asarray(e, np.float32)).all() and (np.asarray(e, np.float32) > 0).all()
        xm = chunks(x).max(-1)
        np.testing.assert_allclose(np.asarray(x_max), xm, rtol=1e-6, atol=1e-5)
        d = chunks(x) - xm[..., None]
        np.testing.assert_allclose(np.asarray(mass), np.exp(d).sum(-1), rtol=2e-5)
        np.testing.assert_allclose(np.asarray(tsum), (np.exp(d) * d).sum(-1), rtol=2e-5, atol=1e-5)
        r = np.asarray(raw, np.float32)
        np.testing.assert_array_equal(np.asarray(chunk_raw_max, np.float32), chunks(r).max(-1))
        np.testing.assert_array_equal(np.asarray(first), chunks(r).argmax(-1) + np.arange(1024 // w) * w)
        m, log_s, entropy, masses = one_pass_totals(mass, tsum, x_max)
        p = np.exp(x - x.max(-1, keepdims=True))
        s = p.sum(-1)
        np.testing.assert_allclose(np.asarray(m), x.max(-1), rtol=1e-6, atol=1e-5)
        np.testing.assert_allclose(np.asarray(log_s), np.log(s), rtol=1e-5, atol=1e-6)
        want_h = -(p / s[:, None] * (np.log(p) - np.log(s)[:, None])).sum(-1)
        np.testing.assert_allclose(np.asarray(entropy), want_h, rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(np.asarray(masses), chunks(p).sum(-1) / s[:, None], rtol=1e-5, atol=1e-9)
        # the probabilities as the sampler hands them on: e * exp(shift - M - log s)
        scale = np.exp(float(shift) - np.asarray(m, np.float64) - np.asarray(log_s))
        probs = np.asarray(e, np.float64) * scale[:, None]
        np.testing.assert_allclose(probs, p / s[:, None], rtol=8e-3, atol=1e-12)
    with pytest.raises(ValueError, match="V=1000"):
        softcap_one_pass_stats(raw[:, :1000], 1.0, cap=CAP, width=8, interpret=True)


def _spy_kernels(monkeypatch) -> list:
    """The names of the statistics kernels called from here on (each still runs), in order."""
    from orl_jax_kernels.softcap_softmax import kernel as sk

    calls = []
    for name in ("softcap_chunk_stats", "softcap_one_pass_stats"):
        real = getattr(sk, name)
        monkeypatch.setattr(sk, name, lambda *a, name=name, real=real, **k: calls.append(name) or real(*a, **k))
    return calls


def test_one_pass_needs_a_temperature_floor(monkeypatch):
    """"one_pass" below the temperature it can take (cap / T > 75.5: e would leave float32's normal range) and
    without a floor takes the two-pass kernel."""
    calls = _spy_kernels(monkeypatch)
    monkeypatch.setattr(softcapped, "SOFTCAP_STATS", "one_pass")
    raw = SoftCapped(_raw(v=1024), CAP)
    for floor, want in ((0.4, "softcap_one_pass_stats"), (0.39, "softcap_chunk_stats"), (None, "softcap_chunk_stats")):
        calls.clear()
        jax.make_jaxpr(lambda r, floor=floor: softcapped.softcapped_parts(r, 0.5, floor))(raw)
        assert calls == [want], floor
    calls.clear()
    _step("one_pass", raw.raw, sampler=UniformSampler(t_min=0.3))
    assert calls == ["softcap_chunk_stats"]


def test_kernel_lowers_to_verified_triton_at_the_26b():
    sd = jax.ShapeDtypeStruct
    verified_triton_modules(lambda r, m, rm, t: softcap_chunk_stats(r, m, rm, t, cap=CAP, width=512),
                            sd((256, 262144), jnp.bfloat16), sd((256,), jnp.float32), sd((256,), jnp.bfloat16),
                            sd((), jnp.float32))


@pytest.mark.parametrize("fast_math", [False, True])
def test_one_pass_lowers_to_verified_triton_at_the_26b(fast_math):
    sd = jax.ShapeDtypeStruct
    verified_triton_modules(lambda r, t: softcap_one_pass_stats(r, t, cap=CAP, width=512, fast_math=fast_math),
                            sd((256, 262144), jnp.bfloat16), sd((), jnp.float32))


@pytest.mark.gpu
def test_one_pass_fast_math_on_gpu():
    """FAST_MATH's PTX approximations at the 26B's canvas against the libdevice form: the same argmax, maxima and
    (up to a bf16 rounding step) probabilities; the chunk sums and maxima within 1e-4."""
    raw = _raw(b=1, l=256, v=262144).reshape(256, -1)
    for t in (0.4, 0.8):
        want = softcap_one_pass_stats(raw, jnp.float32(1 / t), cap=CAP, width=512)
        got = softcap_one_pass_stats(raw, jnp.float32(1 / t), cap=CAP, width=512, fast_math=True)
        for name, a, b in zip(("e", "mass", "t", "first", "raw_max", "x_max"), got, want):
            a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
            if name in ("first", "raw_max"):
                np.testing.assert_array_equal(a, b, err_msg=name)
            elif name == "e":
                np.testing.assert_allclose(a, b, rtol=8e-3, err_msg=name)
            else:
                # x within ~2.4e-7 * 2 cap / T (~4e-5 at T = 0.4) of the exact soft-cap
                np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-4, err_msg=name)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["raw_max", "kernel", "auto", "one_pass"])
def test_modes_on_gpu_at_the_26b(mode):
    """The 26B's canvas (256 x 262144, bf16) compiled on a GPU: the same decisions as the float32 logits' path."""
    assert _chunk_width(262144) == 512
    raw = _raw(b=1, l=256, v=262144)
    want, got = _step("xla", raw), _step(mode, raw)
    for a, b in ((got.state["argmax"], want.state["argmax"]), (got.canvas, want.canvas),
                 (got.resolved, want.resolved)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_allclose(np.asarray(got.entropy), np.asarray(want.entropy), atol=1e-5)
    p_got, p_want = (o.probs.astype(jnp.float32) * o.probs_scale[..., None] for o in (got, want))
    assert float(jnp.max(jnp.abs(p_got - p_want) / (p_want + 1e-12))) < 1e-2


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
    "xla"; with "kernel" / "one_pass" its program calls that kernel."""
    from orl_jax.decode.engine import generate

    cfg, params = tiny_dg
    calls = _spy_kernels(monkeypatch)
    kw = dict(key=jax.random.key(3), max_new_tokens=16, sampler=UniformSampler(max_denoising_steps=4),
              eos_token_id=())
    outs = {}
    kernels = {"kernel": {"softcap_chunk_stats"}, "one_pass": {"softcap_one_pass_stats"}}
    for mode in ("xla", "raw_max", "kernel", "one_pass"):
        monkeypatch.setattr(softcapped, "SOFTCAP_STATS", mode)
        jax.clear_caches()
        calls.clear()
        outs[mode] = np.asarray(generate(params, cfg, [[5, 6, 7, 8, 9]], **kw).tokens)
        assert set(calls) == kernels.get(mode, set()), mode
    # "one_pass" writes its bf16 probabilities relative to another shift: they round differently, and the bf16
    # model's tokens drift apart through the residual. With normalized float32 probabilities (which neither kernel
    # writes) the decisions alone are compared
    from orl_jax.decode import samplers

    monkeypatch.setattr(samplers, "UNNORMALIZED_PROBS", False)
    from orl_jax_kernels.softcap_softmax import kernel as sk

    for mode, stats, fast_math in (("xla_normalized", "xla", False), ("one_pass_normalized", "one_pass", False),
                                   ("one_pass_fast_math_normalized", "one_pass", True)):
        monkeypatch.setattr(softcapped, "SOFTCAP_STATS", stats)
        monkeypatch.setattr(sk, "FAST_MATH", fast_math)  # its formula, in exact operations on a CPU
        jax.clear_caches()
        outs[mode] = np.asarray(generate(params, cfg, [[5, 6, 7, 8, 9]], **kw).tokens)
    jax.clear_caches()
    assert outs["xla"].max() < cfg.vocab_size
    for mode in ("raw_max", "kernel"):
        np.testing.assert_array_equal(outs[mode], outs["xla"])
    np.testing.assert_array_equal(outs["one_pass_normalized"], outs["xla_normalized"])
    np.testing.assert_array_equal(outs["one_pass_fast_math_normalized"], outs["xla_normalized"])


def test_bad_mode_named():
    prev = softcapped.SOFTCAP_STATS
    softcapped.SOFTCAP_STATS = "fast"
    try:
        with pytest.raises(ValueError, match="SOFTCAP_STATS.*'fast'"):
            softcapped.softcapped_parts(SoftCapped(_raw(v=256), CAP), 0.5)
    finally:
        softcapped.SOFTCAP_STATS = prev
