"""generate() compiles Qwen3 / QwenDLM with runtime.ENGINE_COMPILER_OPTIONS (the loop inside CUDA graphs) and
DiffusionGemma with runtime.DG_COMPILER_OPTIONS (the same plus concurrent graph branches). Command buffers change
how kernels are launched, never what they compute, so on a GPU the programs must give the same tokens."""

import jax
import numpy as np
import pytest

from orl_jax import params as P
from orl_jax.config import preset
from orl_jax.decode import engine
from orl_jax.decode.residual import ORLResidual
from orl_jax.decode.samplers import MaskSampler, UniformSampler
from orl_jax.diffusion_gemma_config import DG_PRESETS
from orl_jax.model import diffusion_gemma, qwen3
from orl_jax.runtime import DG_COMPILER_OPTIONS, ENGINE_COMPILER_OPTIONS


def _inputs():
    cfg = preset("tiny-qwendlm").replace(block_length=16, noise="mask")
    params = P.init(qwen3.param_specs(cfg), jax.random.key(0))
    kw = dict(key=jax.random.key(1), max_new_tokens=48, sampler=MaskSampler(cfg.mask_token_id, threshold=0.5),
              residual=ORLResidual(), eos_token_id=(), pad_token_id=0)
    return cfg, params, [[5, 6, 7, 8, 9], [10, 11, 12]], kw


def test_the_options_are_valid_xla_debug_options():
    """XLA rejects an unknown option or enum value when it compiles (e.g. a renamed command buffer type)."""
    for options in (ENGINE_COMPILER_OPTIONS, DG_COMPILER_OPTIONS):
        f = jax.jit(lambda x: x + 1, compiler_options=options)
        assert int(f(1)) == 2
    bad = jax.jit(lambda x: x + 1, compiler_options={**ENGINE_COMPILER_OPTIONS,
                                                     "xla_gpu_enable_command_buffer": "FUSION,NOT_A_TYPE"})
    with pytest.raises(Exception, match="not a valid enum value"):
        bad(1)
    bad = jax.jit(lambda x: x + 2, compiler_options={"xla_gpu_command_buffer_scheduling_mode": "NOT_A_MODE"})
    with pytest.raises(Exception):  # noqa: B017 (XLA's message for an enum field varies)
        bad(1)


@pytest.mark.parametrize("case", ["plain", "streaming", "capture", "traced", "user_flag"])
def test_which_program_qwen_generate_runs(monkeypatch, case):
    """The options for a plain call on one device; XLA's defaults with the streaming host callback or the capture
    buffers in the loop, inside another trace (jax.jit takes compiler_options only at the top level), or when
    XLA_FLAGS sets command buffers itself (read per call; this process's XLA is already configured)."""
    calls = []
    for name in ("_run", "_run_graphed"):
        real = getattr(engine, name)
        monkeypatch.setattr(engine, name, lambda *a, _n=name, _f=real, **k: calls.append(_n) or _f(*a, **k))
    cfg, params, prompts, kw = _inputs()
    if case == "streaming":
        kw["streamer"] = lambda tokens, index: None
    if case == "capture":
        kw["capture"] = True
    if case == "user_flag":
        monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_command_buffer=")
    if case == "traced":
        jax.make_jaxpr(lambda p: engine.generate(p, cfg, prompts, **kw).tokens)(params)
    else:
        engine.generate(params, cfg, prompts, **kw)
    assert calls == (["_run_graphed"] if case == "plain" else ["_run"])


class _Picked(Exception):
    pass


@pytest.mark.parametrize("case", ["plain", "capture", "user_flag", "user_types"])
def test_which_program_diffusion_gemma_generate_runs(monkeypatch, case):
    """DiffusionGemma: the concurrent-branch options for a plain call on one device, XLA's defaults with the capture
    buffers or when XLA_FLAGS sets the scheduling mode or the command buffer types itself. The spies stop before
    compiling."""
    calls = []
    for name in ("_run", "_run_graphed", "_run_concurrent"):
        def spy(*a, _n=name, **k):
            calls.append(_n)
            raise _Picked
        monkeypatch.setattr(engine, name, spy)
    cfg = DG_PRESETS["tiny-dg"]
    params = P.init(diffusion_gemma.param_specs(cfg), jax.random.key(0))
    if case == "user_flag":
        monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_command_buffer_scheduling_mode=LHS")
    if case == "user_types":
        monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_command_buffer=FUSION")
    with pytest.raises(_Picked):
        engine.generate(params, cfg, [[5, 6, 7]], key=jax.random.key(1), max_new_tokens=8,
                        sampler=UniformSampler(max_denoising_steps=2), eos_token_id=(), pad_token_id=0,
                        capture=case == "capture")
    assert calls == (["_run_concurrent"] if case == "plain" else ["_run"])


def test_graphed_program_unrolls_the_layers_on_gpu_only():
    cfg = _inputs()[0]
    assert cfg.layer_unroll is None
    assert engine.graphed_config(cfg, "gpu").layer_unroll == cfg.num_layers
    assert engine.graphed_config(cfg, "cpu") is cfg
    scan = cfg.replace(layer_unroll=1)  # the user's choice wins
    assert engine.graphed_config(scan, "gpu") is scan


@pytest.mark.gpu
def test_graphed_program_equals_the_plain_one_on_gpu(monkeypatch):
    """Also the unrolled layer stack (graphed) against the scan (plain)."""
    cfg, params, prompts, kw = _inputs()
    got = engine.generate(params, cfg, prompts, **kw)
    monkeypatch.setattr(engine, "_run_graphed", engine._run)
    want = engine.generate(params, cfg, prompts, **kw)
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    np.testing.assert_array_equal(np.asarray(got.steps_per_block), np.asarray(want.steps_per_block))
    assert int(got.total_forwards) == int(want.total_forwards)


@pytest.mark.gpu
def test_concurrent_program_equals_the_plain_one_on_gpu(monkeypatch):
    """DiffusionGemma's program (concurrent graph branches, its loops inside the graph) runs the same kernels on the
    same data as XLA's defaults: the same tokens."""
    cfg = DG_PRESETS["tiny-dg"]
    params = P.init(diffusion_gemma.param_specs(cfg), jax.random.key(0))
    kw = dict(key=jax.random.key(1), max_new_tokens=16, sampler=UniformSampler(max_denoising_steps=6),
              eos_token_id=(), pad_token_id=0)
    got = engine.generate(params, cfg, [[5, 6, 7, 8], [9, 10]], **kw)
    monkeypatch.setattr(engine, "_run_concurrent", engine._run)
    want = engine.generate(params, cfg, [[5, 6, 7, 8], [9, 10]], **kw)
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    assert int(got.total_forwards) == int(want.total_forwards)
