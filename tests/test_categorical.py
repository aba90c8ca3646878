"""samplers.categorical: every generator draws from the given distribution, never a zero-probability entry, and
the same key gives the same sample."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from orl_jax.decode.samplers import (
    EXCLUDED_LOGIT,
    RNGS,
    UniformSampler,
    _chunk_width,
    _chunks,
    categorical,
    softmax_stats,
)


@pytest.mark.parametrize("v,width", [(151936, 128), (262144, 512), (64, 8), (4099, 0), (2494, 43)])
def test_chunk_width_tiles_the_vocabulary(v, width):
    assert _chunk_width(v) == width
    assert width == 0 or v % width == 0


@pytest.mark.parametrize("rng", RNGS)
@pytest.mark.parametrize("v", [64, 61])  # 61 is prime: inverse_cdf pads its chunks
def test_draws_follow_the_distribution(rng, v):
    logits = 2.0 * jax.random.normal(jax.random.key(1), (v,))
    logits = logits.at[3].set(EXCLUDED_LOGIT).at[v - 1].set(-jnp.inf)
    logp = jax.nn.log_softmax(logits)
    n = 400_000
    draws = jax.jit(jax.vmap(lambda k: categorical(k, logp, rng)))(jax.random.split(jax.random.key(7), n))
    counts = np.bincount(np.asarray(draws), minlength=v)
    assert counts[3] == 0 and counts[v - 1] == 0, "a zero-probability entry was drawn"
    p = np.exp(np.asarray(logp, np.float64))
    expected = p / p.sum() * n
    big = expected > 20  # the chi-square approximation; the rest are checked by their total
    assert stats.chisquare(counts[big], expected[big] * counts[big].sum() / expected[big].sum()).pvalue > 1e-3
    assert abs(counts[~big].sum() - expected[~big].sum()) < 5 * np.sqrt(expected[~big].sum()) + 5


@pytest.mark.parametrize("rng", RNGS)
def test_same_key_same_draw_any_shape(rng):
    logp = jax.nn.log_softmax(jax.random.normal(jax.random.key(0), (2, 5, 320)))
    a = categorical(jax.random.key(3), logp, rng)
    assert a.shape == (2, 5) and a.dtype == jnp.int32
    np.testing.assert_array_equal(a, categorical(jax.random.key(3), logp, rng))
    assert not np.array_equal(a, categorical(jax.random.key(4), logp, rng))


def test_inverse_cdf_with_one_likely_entry_per_row():
    """A nearly one-hot row returns its entry whatever the uniform is (top end of the CDF included)."""
    v = 1000
    hot = jnp.asarray([0, 999, 517, 128])
    logp = jax.nn.log_softmax(jnp.where(jnp.arange(v)[None] == hot[:, None], 0.0, EXCLUDED_LOGIT))
    for s in range(20):
        np.testing.assert_array_equal(categorical(jax.random.key(s), logp, "inverse_cdf"), hot)


def test_unknown_rng_is_a_value_error():
    with pytest.raises(ValueError, match="rng"):
        UniformSampler(rng="philox")


@pytest.mark.parametrize("v", [151, 64])  # 151 is prime: the chunks are padded with -inf
def test_softmax_stats_equal_log_softmax(v):
    """The samplers' two-pass statistics against jax.nn.log_softmax's: argmax, log-probabilities, entropy and the draw's
    chunk masses, with an excluded entry, a -inf entry, and a nearly one-hot row."""
    x = 3.0 * jax.random.normal(jax.random.key(2), (3, 4, v))
    x = x.at[..., 5].set(EXCLUDED_LOGIT).at[..., 7].set(-jnp.inf).at[2, 1, 9].set(60.0)
    argmax, got_logp, ent, mass = softmax_stats(x)
    logp = jax.nn.log_softmax(x, axis=-1)
    p = jnp.exp(logp)
    want_ent = -jnp.sum(jnp.where(p > 0, p * logp, 0.0), axis=-1)
    np.testing.assert_array_equal(argmax, jnp.argmax(x, axis=-1))
    # as log_softmax computes them, (x - max) - log s; s summed in chunks: the last bit may differ
    live = np.isfinite(np.asarray(logp))
    np.testing.assert_allclose(np.asarray(got_logp)[live], np.asarray(logp)[live], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(ent, want_ent, rtol=1e-5, atol=1e-6)
    assert float(ent[2, 1]) < 1e-12 and bool(jnp.all(ent >= 0))
    np.testing.assert_allclose(mass, jnp.sum(jnp.exp(_chunks(logp)), axis=-1), rtol=1e-5, atol=1e-7)
    # the draw with the precomputed masses is the draw categorical() makes on its own (same key)
    keys = jax.random.split(jax.random.key(4), 64)
    own = jax.vmap(lambda k: categorical(k, logp, "inverse_cdf"))(keys)
    given = jax.vmap(lambda k: categorical(k, logp, "inverse_cdf", mass))(keys)
    assert float(jnp.mean(own == given)) > 0.99  # only a rounding-edge draw may differ


def test_softmax_stats_argmax_takes_the_first_of_tied_maxima():
    """The argmax found in the chunk pass (first index with x == max) is jnp.argmax's first occurrence: ties
    inside one chunk, across chunks, and a row whose only finite entry is last."""
    x = jax.random.normal(jax.random.key(5), (4, 151))
    x = x.at[0, [17, 18]].set(9.0).at[1, [3, 140]].set(9.0).at[2, :].set(-jnp.inf).at[2, 150].set(0.0)
    x = x.at[3].set(1.0)  # every entry tied
    argmax = softmax_stats(x)[0]
    np.testing.assert_array_equal(argmax, jnp.argmax(x, axis=-1))
    np.testing.assert_array_equal(argmax, [17, 3, 150, 0])


def test_argmax_where_each_pass_recomputes_scaled_logits():
    """Under jit XLA recomputes x = logits / T inside both passes, and where that becomes a product LLVM contracts
    the second pass's x - max into one FMA: a test z == 0 then found no maximum in most rows (157 of 160, index V,
    outside the vocabulary). Only with LLVM's optimizations, which this suite turns off for compile time
    (conftest), so the check runs in a fresh process with them on."""
    from fresh_process import run_optimized

    code = """
import jax, jax.numpy as jnp, numpy as np
from orl_jax.decode.samplers import softmax_stats
logits = 0.5 * jax.random.normal(jax.random.key(6), (1, 8, 256))  # batch 1: [2, 8, 256] fuses otherwise
for t in (0.73, None):
    f = lambda lg, tt: softmax_stats(lg / (tt if t is None else t))[0]
    got = jax.jit(f)(logits, jnp.float32(0.73))
    want = jnp.argmax(jax.jit(lambda lg, tt: lg / (tt if t is None else t))(logits, jnp.float32(0.73)), axis=-1)
    np.testing.assert_array_equal(got, want)
"""
    out = run_optimized("-c", code, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
