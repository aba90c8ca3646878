"""generate() against the literal Python-loop oracle (decode/reference.py), plus loop mechanics."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from orl_jax import params as P
from orl_jax.config import preset
from orl_jax.decode import engine
from orl_jax.decode.engine import generate
from orl_jax.decode.reference import reference_generate
from orl_jax.decode.residual import NoResidual, ORLResidual, RCDResidual
from orl_jax.decode.samplers import MaskSampler, UniformSampler
from orl_jax.model import qwen3, qwendlm

PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]]


def compiled() -> int:
    """Programs generate() has compiled so far (its two jitted variants: with and without the engine options)."""
    return engine._run._cache_size() + engine._run_graphed._cache_size()


def _sharpen(params, scale):
    """Random tiny models have nearly flat logits; a larger embedding makes decisions non-trivial."""
    p = dict(params)
    p["embed"] = params["embed"] * scale
    a = dict(params["adapter"])
    a["down"] = jax.random.normal(jax.random.key(7), a["down"].shape) * 0.3  # a live adapter
    p["adapter"] = a
    return p


@pytest.fixture(scope="session")
def uniform_model():
    cfg = preset("tiny-qwendlm").replace(block_length=4)
    return cfg, _sharpen(P.init(qwen3.param_specs(cfg), jax.random.key(0)), 40.0)


@pytest.fixture(scope="session")
def mask_model():
    cfg = preset("tiny-qwendlm").replace(block_length=4, noise="mask")
    return cfg, _sharpen(P.init(qwen3.param_specs(cfg), jax.random.key(1)), 60.0)


def _check(cfg, params, prompts, sampler, residual, key=3, max_new=8, eos=(), max_steps=None):
    out = generate(params, cfg, prompts, key=jax.random.key(key), max_new_tokens=max_new, sampler=sampler,
                   residual=residual, eos_token_id=eos, pad_token_id=0, max_steps=max_steps)
    ref, fwd, steps = reference_generate(params, cfg, prompts, key=jax.random.key(key), max_new_tokens=max_new,
                                         sampler=sampler, residual=residual, eos_token_ids=tuple(eos),
                                         pad_token_id=0, max_steps=max_steps)
    np.testing.assert_array_equal(np.asarray(out.tokens), ref)
    np.testing.assert_array_equal(np.asarray(out.forwards), fwd)
    np.testing.assert_array_equal(np.asarray(out.steps_per_block)[:len(steps)], steps)
    return out


UNIFORM_CASES = [
    ("sampled", UniformSampler(max_denoising_steps=5, entropy_bound=1.0, confidence=0.5), NoResidual()),
    ("greedy", UniformSampler(max_denoising_steps=5, entropy_bound=2.0, confidence=0.5, greedy=True), NoResidual()),
    ("orl", UniformSampler(max_denoising_steps=4, entropy_bound=1.0, stability=2, confidence=1.0), ORLResidual()),
    ("rbg", UniformSampler(max_denoising_steps=4, entropy_bound=1.0, rng="rbg"), NoResidual()),
    ("threefry", UniformSampler(max_denoising_steps=4, entropy_bound=1.0, rng="threefry"), NoResidual()),
]


@pytest.mark.parametrize("name,sampler,residual", UNIFORM_CASES, ids=[c[0] for c in UNIFORM_CASES])
@pytest.mark.parametrize("batch", [1, 3])
def test_uniform_matches_reference(uniform_model, name, sampler, residual, batch):
    cfg, params = uniform_model
    _check(cfg, params, PROMPTS[:batch], sampler, residual)


MASK_CASES = [
    ("threshold", MaskSampler(mask_token_id=255, threshold=0.5), NoResidual()),
    ("per_step", MaskSampler(mask_token_id=255, threshold=None, tokens_per_step=2), NoResidual()),
    ("edit_sampled", MaskSampler(mask_token_id=255, threshold=0.3, edit_threshold=0.3, max_edit_steps=3,
                                 temperature=0.7), NoResidual()),
    ("sampled_threefry", MaskSampler(mask_token_id=255, threshold=0.3, temperature=0.7, rng="threefry"),
     NoResidual()),
    ("rcd", MaskSampler(mask_token_id=255, threshold=0.5), RCDResidual()),
    ("orl", MaskSampler(mask_token_id=255, threshold=0.4, edit_threshold=0.5, max_edit_steps=2), ORLResidual()),
]
CAPPED = MaskSampler(mask_token_id=255, threshold=None, tokens_per_step=1)  # max_steps=2 leaves 2 of 4 masked


@pytest.mark.parametrize("name,sampler,residual", MASK_CASES, ids=[c[0] for c in MASK_CASES])
@pytest.mark.parametrize("batch", [1, 3])
def test_mask_matches_reference(mask_model, name, sampler, residual, batch):
    cfg, params = mask_model
    out = _check(cfg, params, PROMPTS[:batch], sampler, residual)
    assert not np.any(np.asarray(out.tokens) == 255), "a [MASK] token was committed"


SHIFT_CASES = [("uniform_sampled", UNIFORM_CASES[0]), ("uniform_orl", UNIFORM_CASES[2]),
               ("mask_threshold", MASK_CASES[0]), ("mask_orl", MASK_CASES[4])]


@pytest.mark.parametrize("name,case", SHIFT_CASES, ids=[c[0] for c in SHIFT_CASES])
def test_logit_shift_matches_reference(uniform_model, mask_model, name, case):
    """The AR shift: every canvas position reads the row before it, the first one the last committed token's
    hidden state, which the loop carries from prefill and each commit (3 blocks, so commits feed it)."""
    cfg, params = uniform_model if name.startswith("uniform") else mask_model
    _, sampler, residual = case
    _check(cfg.replace(logit_shift=True), params, PROMPTS, sampler, residual, max_new=12)


def test_logit_shift_first_position_is_the_ar_prediction(uniform_model):
    cfg, params = uniform_model
    cfg = cfg.replace(logit_shift=True)
    prompt = jnp.asarray([PROMPTS[0]], jnp.int32)
    _, cache, prev = qwendlm.prefill(params, cfg, prompt, jnp.asarray([5]), 5 + 4, return_hidden=True)
    canvas = jnp.asarray([[1, 2, 3, 4]], jnp.int32)
    got = qwendlm.decode(params, cfg, canvas, cache, prev_hidden=prev)[0, 0]
    ar = qwen3.forward(params, cfg, prompt)[0, -1]
    np.testing.assert_allclose(np.asarray(got), np.asarray(ar), atol=1e-4)
    with pytest.raises(ValueError, match="prev_hidden"):
        qwendlm.decode(params, cfg, canvas, cache)


def test_step_cap_commits_latest_predictions_not_masks(mask_model):
    cfg, params = mask_model
    out = _check(cfg, params, PROMPTS, CAPPED, NoResidual(), max_steps=2)
    assert np.asarray(out.steps_per_block).tolist() == [2, 2]
    assert not np.any(np.asarray(out.tokens) == 255)


def test_eos_stops_row_and_it_stays_frozen(mask_model):
    cfg, params = mask_model
    sampler = MaskSampler(mask_token_id=255, threshold=0.5)
    free = generate(params, cfg, PROMPTS, key=jax.random.key(3), max_new_tokens=12, sampler=sampler, pad_token_id=0)
    toks = np.asarray(free.tokens)
    eos = int(toks[0, 0])  # a token row 0 produces in its first block
    out = _check(cfg, params, PROMPTS, sampler, NoResidual(), max_new=12, eos=(eos,))
    row = np.asarray(out.tokens)[0]
    first = int(np.argmax(row == eos))
    assert first < 4 and np.all(row[first + 1:] == 0), row
    assert int(out.lengths[0]) == first + 1
    assert int(out.forwards[0]) < int(free.forwards[0])  # the finished row ran no more forwards


def test_same_key_same_output_and_keys_matter(uniform_model):
    cfg, params = uniform_model
    s = UniformSampler(max_denoising_steps=3, entropy_bound=1.0)
    a = generate(params, cfg, PROMPTS, key=jax.random.key(5), max_new_tokens=8, sampler=s)
    b = generate(params, cfg, PROMPTS, key=jax.random.key(5), max_new_tokens=8, sampler=s)
    c = generate(params, cfg, PROMPTS, key=jax.random.key(6), max_new_tokens=8, sampler=s)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    assert not np.array_equal(a.tokens, c.tokens)


def test_new_prompt_length_inside_bucket_does_not_recompile(uniform_model):
    cfg, params = uniform_model
    s = UniformSampler(max_denoising_steps=2)
    generate(params, cfg, [[1, 2, 3]], key=jax.random.key(0), max_new_tokens=4, sampler=s)
    n = compiled()
    generate(params, cfg, [[1, 2, 3, 4, 5, 6, 7]], key=jax.random.key(0), max_new_tokens=4, sampler=s)
    generate(params, cfg, np.array([[9] * 12]), key=jax.random.key(1), max_new_tokens=4, sampler=s)
    assert compiled() == n
    generate(params, cfg, [[1] * 20], key=jax.random.key(0), max_new_tokens=4, sampler=s)  # next bucket
    assert compiled() == n + 1


def test_statistics(uniform_model):
    cfg, params = uniform_model
    s = UniformSampler(max_denoising_steps=3, entropy_bound=1.0, confidence=0.0)  # never stops early
    out = generate(params, cfg, PROMPTS[:2], key=jax.random.key(0), max_new_tokens=12, sampler=s)
    assert np.asarray(out.steps_per_block).tolist() == [3, 3, 3]
    assert int(out.total_forwards) == 9 and int(out.commits) == 2
    np.testing.assert_allclose(np.asarray(out.tpf), 12 / 11)


def test_streamer_gets_each_block(uniform_model):
    cfg, params = uniform_model
    got = []
    s = UniformSampler(max_denoising_steps=2)
    out = generate(params, cfg, PROMPTS[:2], key=jax.random.key(0), max_new_tokens=12, sampler=s,
                   streamer=lambda toks, i: got.append((i, toks.copy())))
    assert [i for i, _ in got] == [0, 1, 2]
    np.testing.assert_array_equal(np.concatenate([t for _, t in got], axis=1), np.asarray(out.tokens))


def test_capture_mode_records_every_step_and_changes_nothing(uniform_model):
    cfg, params = uniform_model
    s = UniformSampler(max_denoising_steps=3, entropy_bound=1.0)
    plain = generate(params, cfg, PROMPTS, key=jax.random.key(2), max_new_tokens=8, sampler=s, residual=ORLResidual())
    cap = generate(params, cfg, PROMPTS, key=jax.random.key(2), max_new_tokens=8, sampler=s, residual=ORLResidual(),
                   capture=True)
    np.testing.assert_array_equal(plain.tokens, cap.tokens)
    n = int(cap.total_forwards)
    c = jax.tree.map(np.asarray, cap.capture)
    assert c["canvas"].shape[0] >= n and np.all(c["active"][:n].any(axis=1))
    starts = np.where(c["step"][:n] == 0)[0]
    assert len(starts) == 2 and np.all(c["z"][starts] == 0)  # a block's first step has no residual
    later = np.setdiff1d(np.arange(n), starts)
    assert np.all(np.abs(c["z"][later]).sum(axis=(1, 2, 3)) > 0)
    assert np.all((c["entropy"][:n] >= 0) & (c["entropy"][:n] <= 1 + 1e-6))


BAD = [
    (dict(prompt_ids=[]), ValueError, "prompt_ids"),
    (dict(prompt_ids=[[1, 2], []]), ValueError, r"prompt_ids\[1\]"),
    (dict(prompt_ids=np.zeros((1, 2, 3), np.int32)), ValueError, "prompt_ids"),
    (dict(prompt_ids=np.zeros((1, 3), np.float32)), TypeError, "integer"),
    (dict(prompt_ids=[[1, 999]]), ValueError, "999"),
    (dict(prompt_ids=[[-1, 2]]), ValueError, "-1"),
    (dict(prompt_ids="hello"), TypeError, "prompt_ids"),
    (dict(prompt_ids=[[1] * 600]), ValueError, "max_position_embeddings"),
    (dict(max_new_tokens=0), ValueError, "max_new_tokens"),
    (dict(max_new_tokens=-4), ValueError, "max_new_tokens"),
    (dict(max_new_tokens=2.5), ValueError, "max_new_tokens"),
    (dict(block_length=0), ValueError, "block_length"),
    (dict(t_max=0.0), ValueError, "t_max"),
    (dict(t_max=float("nan")), ValueError, "t_max"),
    (dict(t_min=-1.0), ValueError, "t_min"),
    (dict(entropy_bound=0.0), ValueError, "entropy_bound"),
    (dict(max_denoising_steps=0), ValueError, "max_denoising_steps"),
    (dict(threshold=0.5), TypeError, "unknown sampler option"),
    (dict(bogus=1), TypeError, "bogus"),
    (dict(max_steps=0), ValueError, "max_steps"),
    (dict(eos_token_id=4096), ValueError, "eos_token_id"),
    (dict(pad_token_id=-3), ValueError, "pad_token_id"),
    (dict(key=0), TypeError, "key"),
    (dict(residual=RCDResidual()), ValueError, "RCDResidual"),
    (dict(residual="orl"), TypeError, "residual"),
    (dict(sampler=MaskSampler(mask_token_id=255)), ValueError, "MaskSampler"),
    (dict(sampler=UniformSampler(), greedy=True), ValueError, "sampler options"),
    (dict(streamer=3), TypeError, "streamer"),
    (dict(rng="mt19937"), ValueError, "rng"),
]

MASK_BAD = [
    (dict(threshold=0.0), ValueError, "threshold"),
    (dict(threshold=1.5), ValueError, "threshold"),
    (dict(threshold=float("nan")), ValueError, "threshold"),
    (dict(edit_threshold=0.0), ValueError, "edit_threshold"),
    (dict(temperature=-0.5), ValueError, "temperature"),
    (dict(temperature=float("nan")), ValueError, "temperature"),
    (dict(tokens_per_step=3), ValueError, "tokens_per_step"),  # 3 does not divide block_length 4
    (dict(tokens_per_step=0), ValueError, "tokens_per_step"),
    (dict(max_edit_steps=-1), ValueError, "max_edit_steps"),
    (dict(t_max=0.5), TypeError, "unknown sampler option"),
]


@pytest.mark.parametrize("kw,exc,match", BAD, ids=[f"u{i}" for i in range(len(BAD))])
def test_bad_inputs_uniform(uniform_model, kw, exc, match):
    cfg, params = uniform_model
    args = dict(prompt_ids=[[1, 2, 3]], key=jax.random.key(0), max_new_tokens=4) | kw
    n = compiled()
    with pytest.raises(exc, match=match):
        generate(params, cfg, **args)
    assert compiled() == n  # rejected before compiling anything


@pytest.mark.parametrize("kw,exc,match", MASK_BAD, ids=[f"m{i}" for i in range(len(MASK_BAD))])
def test_bad_inputs_mask(mask_model, kw, exc, match):
    cfg, params = mask_model
    with pytest.raises(exc, match=match):
        generate(params, cfg, [[1, 2, 3]], key=jax.random.key(0), max_new_tokens=4, **kw)


def test_bad_model_arguments(uniform_model):
    cfg, params = uniform_model
    with pytest.raises(TypeError, match="cfg"):
        generate(params, {"vocab_size": 3}, [[1]], key=jax.random.key(0))
    with pytest.raises(TypeError, match="params"):
        generate([1, 2], cfg, [[1]], key=jax.random.key(0))
    no_adapter = cfg.replace(adapter_hidden=0)
    with pytest.raises(ValueError, match="ORLResidual"):
        generate(params, no_adapter, [[1]], key=jax.random.key(0), residual=ORLResidual())
    # cuDNN's fused attention: bf16/fp16 only, and only on a GPU backend (refused before anything compiles)
    with pytest.raises(ValueError, match="cached_attention_impl='cudnn' needs dtype bfloat16"):
        generate(params, cfg.replace(cached_attention_impl="cudnn"), [[1]], key=jax.random.key(0))
    if jax.default_backend() != "gpu":
        with pytest.raises(ValueError, match="cached_attention_impl='cudnn' needs a GPU backend"):
            generate(params, cfg.replace(cached_attention_impl="cudnn", dtype="bfloat16"), [[1]],
                     key=jax.random.key(0))
