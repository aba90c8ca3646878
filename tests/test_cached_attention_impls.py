"""cached_attention_impl "xla" / "cudnn": jax.nn.dot_product_attention over the cache and the pass's own keys,
concatenated (model/attention.py), against orl_jax's einsums. On CPU the "xla" implementation runs the same
concatenation and mask that cuDNN gets on a GPU; the cuDNN run itself is marked gpu."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from orl_jax import params as P
from orl_jax.config import preset
from orl_jax.diffusion_gemma_config import DG_PRESETS
from orl_jax.model import attention as attn
from orl_jax.model import diffusion_gemma as dg
from orl_jax.model import qwen3, qwendlm


@pytest.fixture
def dpa_calls(monkeypatch):
    """The implementations jax.nn.dot_product_attention was traced with, and its key lengths."""
    calls, real = [], jax.nn.dot_product_attention

    def spy(q, k, v, *a, implementation=None, **kw):
        calls.append((implementation, k.shape[1]))
        return real(q, k, v, *a, implementation=implementation, **kw)

    monkeypatch.setattr(jax.nn, "dot_product_attention", spy)
    return calls


def test_generate_with_xla_dot_product_attention_equals_the_default(dpa_calls):
    from orl_jax.decode.engine import generate
    from orl_jax.decode.residual import ORLResidual
    from orl_jax.decode.samplers import UniformSampler

    cfg = preset("tiny-qwendlm").replace(block_length=16)
    params = P.init(qwen3.param_specs(cfg), jax.random.key(0))
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12]]  # left padding: prefill has pad rows
    kw = dict(key=jax.random.key(1), max_new_tokens=32, sampler=UniformSampler(max_denoising_steps=4),
              residual=ORLResidual(), eos_token_id=(), pad_token_id=0)
    want = generate(params, cfg, prompts, **kw)
    got = generate(params, cfg.replace(cached_attention_impl="xla"), prompts, **kw)
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    assert int(got.total_forwards) == int(want.total_forwards)
    # prefill, denoising steps and commits (a layer scan each, traced once) all went through it
    assert len(dpa_calls) >= 3 and all(impl == "xla" for impl, _ in dpa_calls)


def test_cached_passes_agree_with_the_einsums_and_pad_rows_stay_finite():
    cfg = preset("tiny-qwendlm")
    params = P.init(qwen3.param_specs(cfg), jax.random.key(2))
    prompt = jax.random.randint(jax.random.key(3), (2, 16), 4, cfg.vocab_size)
    lengths = jnp.array([16, 9])
    canvas = jax.random.randint(jax.random.key(4), (2, 8), 4, cfg.vocab_size)
    out = {}
    for impl in ("orl_jax", "xla"):
        c = cfg.replace(cached_attention_impl=impl)
        last, cache = qwendlm.prefill(params, c, prompt, lengths, 32)
        out[impl] = last, qwendlm.decode(params, c, canvas, cache), cache
    for a, b in zip(out["xla"][:2], out["orl_jax"][:2]):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4, rtol=1e-4)
    # pad rows see themselves (attention.self_mask): their cache slots are finite under every implementation
    for impl in out:
        assert np.isfinite(np.asarray(out[impl][2].k)).all() and np.isfinite(np.asarray(out[impl][2].v)).all()


def test_diffusion_gemma_decoder_with_xla_dot_product_attention_equals_the_einsums(dpa_calls):
    cfg = DG_PRESETS["tiny-dg"].replace(head_dim=16, global_head_dim=32, block_length=16)
    params = P.init(dg.param_specs(cfg), jax.random.key(0))
    prompt = jax.random.randint(jax.random.key(1), (2, 16), 0, 240)
    canvas = jax.random.randint(jax.random.key(2), (2, 16), 0, 240)
    out = {}
    for impl in ("orl_jax", "xla"):
        c = cfg.replace(cached_attention_impl=impl)
        _, cache = dg.prefill(params, c, prompt, jnp.array([16, 11]), 48)
        out[impl] = dg.decode(params, c, canvas, cache)
    np.testing.assert_allclose(np.asarray(out["xla"]), np.asarray(out["orl_jax"]), atol=2e-4, rtol=2e-4)
    assert dpa_calls and float(out["orl_jax"].std()) > 0.01


def test_cudnn_leaves_heads_wider_than_it_takes_to_the_einsums(dpa_calls):
    """DiffusionGemma's 512-wide full layers: cuDNN takes head dims <= 256, so those stay on orl_jax's path (this
    runs on CPU, where a cuDNN call would fail)."""
    b, l, s, kv, g, h = 1, 4, 8, 2, 2, 2 * attn.CUDNN_MAX_HEAD_DIM
    ks = jax.random.split(jax.random.key(0), 5)
    q = jax.random.normal(ks[0], (b, l, kv * g, h))
    parts = [(jax.random.normal(ks[1], (b, s, kv, h)), jax.random.normal(ks[2], (b, s, kv, h)),
              jnp.ones((b, l, s), bool)),
             (jax.random.normal(ks[3], (b, l, kv, h)), jax.random.normal(ks[4], (b, l, kv, h)),
              jnp.ones((b, l, l), bool))]
    got = attn.attention(q, parts, "cudnn", scale=1.0)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(attn.attention(q, parts, "orl_jax", scale=1.0)))
    # orl_jax's path joins wide parts (JOIN_WIDE_PARTS): the same softmax in another summation order than two parts
    # (scores of std ~22 at this head dim: float32 differences up to ~1e-5, machine-dependent)
    np.testing.assert_allclose(np.asarray(got), np.asarray(attn.scaled_attention(q, parts, 1.0)), atol=5e-5)
    assert not dpa_calls


@pytest.mark.gpu
def test_cudnn_cached_attention_on_gpu_bf16():
    """Qwen3-shaped cached passes in bf16 through cuDNN: prefill + a denoising step close to the einsums."""
    cfg = preset("tiny-qwendlm").replace(dtype="bfloat16", head_dim=128, num_heads=8, num_kv_heads=2)
    params = P.init(qwen3.param_specs(cfg), jax.random.key(0))
    prompt = jax.random.randint(jax.random.key(1), (2, 64), 4, cfg.vocab_size)
    canvas = jax.random.randint(jax.random.key(2), (2, 32), 4, cfg.vocab_size)
    out = {}
    for impl in ("orl_jax", "cudnn"):
        c = cfg.replace(cached_attention_impl=impl)
        fn = jax.jit(lambda p, c=c: (lambda lc: qwendlm.decode(p, c, canvas, lc[1]))(
            qwendlm.prefill(p, c, prompt, jnp.array([64, 40]), 128)))
        out[impl] = np.asarray(fn(params), np.float32)
        if impl == "cudnn":
            assert "cudnn" in fn.lower(params).compile().as_text().lower()
    assert np.isfinite(out["cudnn"]).all()
    np.testing.assert_allclose(out["cudnn"], out["orl_jax"], atol=0.1, rtol=0.05)


def test_wide_heads_join_their_parts_with_the_same_result(monkeypatch):
    """Heads wider than cuDNN's (DiffusionGemma's full layers) take one score GEMM over [cache | self] on the einsum
    path (attention.JOIN_WIDE_PARTS); the same values as a score GEMM per part, masks and a fully masked cache slot
    included. Narrower heads keep their parts apart."""
    ks = jax.random.split(jax.random.key(7), 6)
    b, l, s, kv, g = 2, 8, 12, 2, 3
    parts_for = lambda h: [  # noqa: E731
        (jax.random.normal(ks[1], (b, s, kv, h)), jax.random.normal(ks[2], (b, s, kv, h)),
         jax.random.bernoulli(ks[3], 0.7, (b, l, s)).at[:, :, 0].set(False)),
        (jax.random.normal(ks[4], (b, l, kv, h)), jax.random.normal(ks[5], (b, l, kv, h)),
         jnp.ones((b, l, l), bool))]
    for h, joined in ((384, True), (128, False)):
        q, parts = jax.random.normal(ks[0], (b, l, kv * g, h)), parts_for(h)
        seen = []
        monkeypatch.setattr(attn, "scaled_attention", lambda q, p, sc, seen=seen, real=attn.scaled_attention, **kw: (
            seen.append(len(p)), real(q, p, sc, **kw))[1])
        got = attn.attention(q, parts, "orl_jax", scale=1.0)
        monkeypatch.undo()
        want = attn.scaled_attention(q, parts, 1.0)
        assert seen == [1 if joined else 2]
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)


def test_late_normalization_equals_the_softmax_first():
    """scaled_attention(late_normalize=True): PV over exp(s - max), then divided by the row sums; the same values,
    a fully masked cache slot and several parts included."""
    ks = jax.random.split(jax.random.key(9), 6)
    b, l, s, kv, g, h = 2, 8, 12, 2, 3, 16
    q = jax.random.normal(ks[0], (b, l, kv * g, h))
    parts = [(jax.random.normal(ks[1], (b, s, kv, h)), jax.random.normal(ks[2], (b, s, kv, h)),
              jax.random.bernoulli(ks[3], 0.7, (b, l, s)).at[:, :, 0].set(False)),
             (jax.random.normal(ks[4], (b, l, kv, h)), jax.random.normal(ks[5], (b, l, kv, h)),
              jnp.ones((b, l, l), bool))]
    for p in (parts, parts[:1]):
        np.testing.assert_allclose(np.asarray(attn.scaled_attention(q, p, 0.5, late_normalize=True)),
                                   np.asarray(attn.scaled_attention(q, p, 0.5)), atol=1e-5, rtol=1e-5)


def test_einsum_head_dims_send_the_kernel_path_to_the_joined_einsums(monkeypatch):
    """attention.EINSUM_HEAD_DIMS: a head dim listed there takes the joined einsum path with impl "pallas" (the
    kernel is never traced), with the kernel's values; other head dims keep the kernel."""
    from orl_jax_kernels.decode_attention import kernel as da

    ks = jax.random.split(jax.random.key(8), 6)
    b, l, s, kv, g, h = 1, 16, 32, 2, 2, 64
    q = jax.random.normal(ks[0], (b, l, kv * g, h))
    parts = [(jax.random.normal(ks[1], (b, s, kv, h)), jax.random.normal(ks[2], (b, s, kv, h)),
              jnp.arange(s)[None, None, :] < jnp.full((b, l, 1), 20)),
             (jax.random.normal(ks[4], (b, l, kv, h)), jax.random.normal(ks[5], (b, l, kv, h)),
              jnp.ones((b, l, l), bool))]
    kernel_calls = []
    monkeypatch.setattr(da, "cached_attention", lambda *a, real=da.cached_attention, **kw: (
        kernel_calls.append(1), real(*a, **kw))[1])
    want = attn.attention(q, parts, "pallas", scale=1.0)
    assert kernel_calls == [1]
    monkeypatch.setattr(attn, "EINSUM_HEAD_DIMS", (h,))
    got = attn.attention(q, parts, "pallas", scale=1.0)
    assert kernel_calls == [1]
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)


def test_fewer_queries_than_own_keys_leave_the_fused_kernel():
    """A pass whose last layer keeps some query rows (diffusion_gemma.TRIM_LAST_LAYER) attends with fewer queries
    than own keys: impl "pallas" then takes the einsums (the fused kernel reads as many own keys as queries), with
    the values of the untrimmed pass's kept rows."""
    ks = jax.random.split(jax.random.key(10), 6)
    b, l, s, kv, g, h, kept = 1, 32, 32, 2, 2, 64, 16
    q = jax.random.normal(ks[0], (b, l, kv * g, h))
    parts = [(jax.random.normal(ks[1], (b, s, kv, h)), jax.random.normal(ks[2], (b, s, kv, h)),
              jnp.arange(s)[None, None, :] < jnp.full((b, l, 1), 20)),
             (jax.random.normal(ks[4], (b, l, kv, h)), jax.random.normal(ks[5], (b, l, kv, h)),
              jax.random.bernoulli(ks[3], 0.6, (b, l, l)).at[:, :, 0].set(True))]
    whole = attn.attention(q, parts, "pallas", scale=1.0)  # the kernel (interpret mode)
    rows = [(k, v, m[:, l - kept:]) for k, v, m in parts]
    got = attn.attention(q[:, l - kept:], rows, "pallas", scale=1.0)
    np.testing.assert_allclose(np.asarray(got), np.asarray(whole)[:, l - kept:], atol=1e-5, rtol=1e-5)
