"""Tensor-, expert- and data-parallel generate() on fake CPU devices equals the single-device output token for
token."""

import jax
import numpy as np
import pytest

from orl_jax import params as P
from orl_jax.config import preset
from orl_jax.decode.engine import generate
from orl_jax.decode.residual import ORLResidual
from orl_jax.decode.samplers import UniformSampler
from orl_jax.diffusion_gemma_config import DG_PRESETS
from orl_jax.model import diffusion_gemma, qwen3
from orl_jax.sharding import make_mesh

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12]]


@pytest.mark.parametrize("tensor,fsdp", [(2, 1), (2, 2)])
def test_tensor_parallel_qwendlm_equals_single_device(tensor, fsdp):
    cfg = preset("tiny-qwendlm").replace(block_length=4)
    params = P.init(qwen3.param_specs(cfg), jax.random.key(0))
    params["embed"] = params["embed"] * 4.0
    s = UniformSampler(max_denoising_steps=3, entropy_bound=1.0)
    kw = dict(key=jax.random.key(1), max_new_tokens=8, sampler=s, residual=ORLResidual())
    one = generate(params, cfg, PROMPTS, **kw)
    mesh = make_mesh(data=1, fsdp=fsdp, tensor=tensor, devices=jax.devices()[:fsdp * tensor])
    par = generate(params, cfg, PROMPTS, mesh=mesh, **kw)
    np.testing.assert_array_equal(np.asarray(one.tokens), np.asarray(par.tokens))
    np.testing.assert_array_equal(np.asarray(one.forwards), np.asarray(par.forwards))


@pytest.mark.parametrize("data,fsdp", [(2, 1), (2, 2)])
def test_data_parallel_rows_equal_single_device(data, fsdp):
    """Rollouts spread over the data axes: 4 sampled rows split 2 or 4 ways, weights FSDP-split when fsdp > 1."""
    cfg = preset("tiny-qwendlm").replace(block_length=4)
    params = P.init(qwen3.param_specs(cfg), jax.random.key(0))
    params["embed"] = params["embed"] * 4.0
    prompts = PROMPTS + [[3, 4], [20, 21, 22, 23]]
    kw = dict(key=jax.random.key(1), max_new_tokens=8, sampler=UniformSampler(max_denoising_steps=3),
              residual=ORLResidual(), capture=True)
    one = generate(params, cfg, prompts, **kw)
    mesh = make_mesh(data=data, fsdp=fsdp, tensor=1, devices=jax.devices()[:data * fsdp])
    par = generate(params, cfg, prompts, mesh=mesh, **kw)
    assert par.tokens.sharding.spec[0] is not None, "the rows were not split over the data axes"
    np.testing.assert_array_equal(np.asarray(one.tokens), np.asarray(par.tokens))
    np.testing.assert_array_equal(np.asarray(one.capture["canvas"]), np.asarray(par.capture["canvas"]))


def test_expert_parallel_diffusion_gemma_equals_single_device():
    cfg = DG_PRESETS["tiny-dg"]
    params = P.init(diffusion_gemma.param_specs(cfg), jax.random.key(0))
    kw = dict(key=jax.random.key(2), max_new_tokens=16, sampler=UniformSampler(max_denoising_steps=3),
              eos_token_id=())
    one = generate(params, cfg, PROMPTS, **kw)
    mesh = make_mesh(data=1, fsdp=1, tensor=2, devices=jax.devices()[:2])
    specs = diffusion_gemma.param_specs(cfg)
    placed = P.shardings(specs, mesh)
    assert placed["sliding"]["experts_gate_up"].spec[1] == "tensor"  # [layers, E, D, 2F]: split by expert
    par = generate(params, cfg, PROMPTS, mesh=mesh, **kw)
    np.testing.assert_array_equal(np.asarray(one.tokens), np.asarray(par.tokens))


def test_mesh_argument_is_checked():
    cfg = preset("tiny-qwendlm")
    params = P.init(qwen3.param_specs(cfg), jax.random.key(0))
    with pytest.raises(TypeError, match="mesh"):
        generate(params, cfg, PROMPTS, key=jax.random.key(0), max_new_tokens=8, mesh="tensor=2")
