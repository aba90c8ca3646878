"""UniformSampler against transformers' DiffusionGemma sampling pieces, step for step.

Both sides get the same logits and the same random draws: HF's own `_denoising_step` (with
LinearTemperatureScheduleLogitsProcessor, EntropyBoundSampler and StableAndConfidentStoppingCriteria) runs with a
stand-in decoder that returns our logits, and torch.multinomial / torch.randint replaced by the draws our sampler
makes from its step key (samplers.categorical with the sampler's rng, on HF's probabilities; then the re-noise
tokens). Compared at every step:
the processed distribution (temperature schedule), the accepted positions, the next (re-noised) canvas, the argmax
canvas and the stop decisions, with rows that stop at different steps and one that never does.
"""

from __future__ import annotations

import types
import unittest.mock as um

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hf_compat import CACHE
from transformers.generation import LogitsProcessorList
from transformers.models.diffusion_gemma.generation_diffusion_gemma import (
    DiffusionGemmaGenerationConfig,
    DiffusionGemmaGenerationMixin,
    EntropyBoundSampler,
    EntropyBoundSamplerConfig,
    LinearTemperatureScheduleLogitsProcessor,
    StableAndConfidentStoppingCriteria,
)

from orl_jax.decode.engine import make_sampler
from orl_jax.decode.samplers import UniformSampler, categorical
from orl_jax.diffusion_gemma_config import DG_PRESETS

pytestmark = pytest.mark.hf

B, L, V = 3, 12, 64


class _StepDraws:
    """torch.multinomial / torch.randint for one HF step, drawn as UniformSampler.step draws from `key`."""

    def __init__(self, key, rng: str):
        self.k_sample, self.k_noise = jax.random.split(key)
        self.rng = rng

    def multinomial(self, probs, num_samples, **kw):
        logp = jnp.log(jnp.asarray(probs.numpy()).reshape(B, L, V))
        return torch.from_numpy(np.array(categorical(self.k_sample, logp, self.rng)).reshape(-1, 1)).long()

    def randint(self, low=0, high=None, size=None, **kw):
        return torch.from_numpy(np.array(jax.random.randint(self.k_noise, tuple(size), low, high, jnp.int32))).long()


def _logits(steps: int, seed: int) -> np.ndarray:
    """[steps, B, L, V]. Row 0: one dominant token per position from the start (stable + confident early);
    row 1: dominant tokens that keep changing until step 4, then settle; row 2: flat (never confident)."""
    rng = np.random.default_rng(seed)
    out = rng.normal(0, 1, (steps, B, L, V)).astype(np.float32)
    top0, top1 = rng.integers(0, V, L), rng.integers(0, V, (steps, L))
    top1[4:] = top1[4]
    for s in range(steps):
        out[s, 0, np.arange(L), top0] += 14.0
        out[s, 1, np.arange(L), top1[s]] += 12.0 + s
        out[s, 2] *= 0.3
    # a few lower-confidence positions, so the entropy bound accepts only part of a row
    out[:, 0, :3] *= 0.6
    out[:, 1, :3] *= 0.35
    return out


def _fake_model():
    return types.SimpleNamespace(config=types.SimpleNamespace(text_config=types.SimpleNamespace(vocab_size=V)),
                                 model=types.SimpleNamespace(decoder=types.SimpleNamespace(
                                     embed_tokens=types.SimpleNamespace(weight=torch.zeros(1)))))


def _decoder(logits: torch.Tensor):
    """A stand-in for the model's forward that returns fixed logits."""
    return lambda **kw: types.SimpleNamespace(logits=logits)


_step = jax.jit(lambda s, logits, canvas, state, key, step, active: s.step(logits, canvas, state, key, step, active),
                static_argnums=0)


def _run(sampler: UniformSampler, logits: np.ndarray, key):
    K = sampler.max_denoising_steps
    k_init, key = jax.random.split(key)
    canvas, state = sampler.init(k_init, B, L, types.SimpleNamespace(vocab_size=V))
    # HF side
    hf_sampler = EntropyBoundSampler(EntropyBoundSamplerConfig(entropy_bound=float(sampler.entropy_bound)), L, V, K)
    first = lambda low=0, high=None, size=None, **kw: torch.from_numpy(
        np.array(jax.random.randint(k_init, tuple(size), low, high, jnp.int32))).long()
    with um.patch.object(torch, "randint", first):  # the block's first canvas
        hf_canvas = hf_sampler.initialize_canvas(B, "cpu")
    np.testing.assert_array_equal(hf_canvas.numpy(), np.asarray(canvas))
    processors = LogitsProcessorList([LinearTemperatureScheduleLogitsProcessor(sampler.t_min, sampler.t_max, K)])
    stopping = StableAndConfidentStoppingCriteria(sampler.stability, float(sampler.confidence))
    hf_argmax, hf_sc, hf_done = hf_canvas, None, torch.zeros(B, dtype=torch.bool)
    done = jnp.zeros((B,), bool)
    stops = []
    for step in range(K):
        k_step = jax.random.fold_in(key, step)
        active = ~done
        out = _step(sampler, jnp.asarray(logits[step]), canvas, state, k_step, jnp.int32(step), active)
        done = done | (out.done & active)
        draws = _StepDraws(k_step, sampler.rng)
        decoder = _decoder(torch.from_numpy(logits[step].copy()))
        with um.patch.object(torch, "multinomial", draws.multinomial), um.patch.object(torch, "randint", draws.randint):
            hf_canvas, hf_argmax, hf_sc, hf_done = DiffusionGemmaGenerationMixin._denoising_step(
                _fake_model(), decoder_forward=decoder, current_canvas=hf_canvas, argmax_canvas=hf_argmax,
                input_ids=torch.zeros((B, 1), dtype=torch.long), decoder_position_ids=None,
                self_conditioning_logits=hf_sc, mask_mapping=None, **{CACHE: None}, finished_denoising=hf_done.clone(),
                cur_step=K - step, sampler=hf_sampler, logits_processor=processors,
                diffusion_stopping_criteria=stopping)
        live = np.asarray(active)
        probs = out.probs if out.probs_scale is None else out.probs * out.probs_scale[..., None]
        np.testing.assert_allclose(np.asarray(probs)[live], torch.softmax(hf_sc, -1).numpy()[live], atol=1e-6,
                                   err_msg=f"step {step}: temperature-processed distribution")
        np.testing.assert_array_equal(np.asarray(out.resolved)[live], hf_sampler.accepted_token_mask.numpy()[live],
                                      err_msg=f"step {step}: accepted positions")
        np.testing.assert_array_equal(np.asarray(out.canvas), hf_canvas.numpy(), err_msg=f"step {step}: canvas")
        np.testing.assert_array_equal(np.asarray(out.state["argmax"]), hf_argmax.numpy(), err_msg=f"step {step}")
        np.testing.assert_array_equal(np.asarray(done), hf_done.numpy(), err_msg=f"step {step}: stop decisions")
        canvas, state = out.canvas, out.state
        stops.append(np.asarray(done).copy())
        if bool(done.all()):
            break
    np.testing.assert_array_equal(np.asarray(sampler.finalize(canvas, state)), hf_argmax.numpy())  # committed
    return np.array(stops)


@pytest.mark.parametrize("rng", ["inverse_cdf", "threefry"])
@pytest.mark.parametrize("stability", [0, 1, 2])
@pytest.mark.parametrize("entropy_bound", [0.1, 2.0])
def test_step_for_step(stability, entropy_bound, rng):
    sampler = UniformSampler(max_denoising_steps=10, entropy_bound=entropy_bound, stability=stability,
                             confidence=0.05, rng=rng)
    stops = _run(sampler, _logits(10, seed=stability), jax.random.key(stability))
    # rows stop at different steps and the flat row runs to the cap: the per-row freezing was exercised
    first = [int(np.argmax(stops[:, r])) if stops[:, r].any() else None for r in range(B)]
    assert first[0] is not None and first[1] is not None and first[2] is None
    assert first[0] < first[1]
    if stability:
        assert first[0] >= stability  # the history starts at -1: never stable on the first step


def test_temperature_schedule():
    """Temperature-processed logits at every step of the default 48-step schedule equal HF's to float32 rounding
    (XLA turns x / T into x * (1 / T), so the last bit may differ): 0.8 at the first step, 0.4 + 0.4 / 48 at the
    last."""
    s = UniformSampler()
    hf = LinearTemperatureScheduleLogitsProcessor(s.t_min, s.t_max, s.max_denoising_steps)
    x = np.random.default_rng(0).normal(0, 10, (4, V)).astype(np.float32)
    scale = jax.jit(lambda x, step: x / s.temperature(step))
    for step in range(s.max_denoising_steps):
        theirs = hf(None, torch.from_numpy(x), cur_step=torch.tensor(s.max_denoising_steps - step, dtype=torch.int32))
        np.testing.assert_allclose(np.asarray(scale(x, jnp.int32(step))), theirs.numpy(), rtol=3e-7, atol=0,
                                   err_msg=str(step))
    np.testing.assert_allclose([s.temperature(0), s.temperature(47)], [0.8, 0.4 + 0.4 / 48], rtol=1e-7)


def test_defaults_are_diffusiongemma_defaults():
    """canvas 256, <= 48 steps, temperature 0.8 -> 0.4, entropy bound 0.1, stability 1, confidence 0.005."""
    hf = DiffusionGemmaGenerationConfig._get_default_generation_params()
    ours = UniformSampler()
    assert (ours.max_denoising_steps, ours.t_max, ours.t_min, ours.stability, ours.confidence) == (
        hf["max_denoising_steps"], hf["t_max"], hf["t_min"], hf["stability_threshold"], hf["confidence_threshold"])
    assert ours.entropy_bound == hf["sampler_config"].entropy_bound
    cfg = DG_PRESETS["diffusiongemma-26b-a4b"]
    assert make_sampler(cfg) == ours and cfg.block_length == 256
