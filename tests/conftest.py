"""Shared test setup: 4 fake CPU devices, strict numerics, and tiny Hugging Face Qwen3 checkpoints.

The jax settings must be applied before any backend is initialized, so they live at the top of this file
(pytest imports conftest.py before collecting the test modules).
"""

from __future__ import annotations

import os
import shutil

# The models here are tiny, so XLA compile time dominates the suite: compile without LLVM optimization, about twice
# as fast on CPU. Not quite the same numerics: LLVM's optimizations contract a multiply and an add into one FMA
# (unrounded product), which hid a sampler bug until session 50, so the tests that hinge on it run in a fresh
# process without this flag (tests/fresh_process.py: test_categorical, test_cli_generate_dg), and a machine with a
# GPU (the `gpu` tests) compiles as a user would. Set before the backend starts; an explicit setting wins.
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", "") and shutil.which("nvidia-smi") is None:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()

import jax  # noqa: E402

try:
    jax.config.update("jax_num_cpu_devices", 4)
except Exception:  # older jax: fall back to the XLA flag (read when the CPU backend starts)
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()
jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_default_matmul_precision", "highest")

import dataclasses  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from orl_jax import params as P  # noqa: E402
from orl_jax.config import ModelConfig, preset  # noqa: E402
from orl_jax.model import qwen3  # noqa: E402

# Token ids written into the tiny HF configs (the loaders must carry them through).
BOS, EOS, PAD = 1, 2, 0


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop every compiled program after each test module. The whole suite in one process otherwise segfaulted
    inside XLA's CPU compiler (jax 0.10.2) at test_train_step's 4-device programs, ~400 tests in, though every
    module passes on its own; the cause was not found (not memory: ~6 GB of 24)."""
    yield
    jax.clear_caches()


@dataclasses.dataclass
class HFCheckpoint:
    name: str  # preset name
    cfg: ModelConfig  # the preset
    dir: Path  # save_pretrained output (single model.safetensors)
    model: object  # the torch Qwen3ForCausalLM (eval mode, float32)


def hf_config_for(cfg: ModelConfig):
    """A transformers Qwen3Config written out by hand from a preset (independent of orl_jax.config.to_hf_config)."""
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=cfg.rms_norm_eps,
        tie_word_embeddings=cfg.tie_word_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD,
        attn_implementation="eager",
    )


def build_hf_model(cfg: ModelConfig, seed: int):
    """A Qwen3ForCausalLM with every weight (norms included) re-randomized so no weight is a trivial 0 / 1."""
    import torch
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(hf_config_for(cfg)).eval()
    with torch.no_grad():
        for p in model.parameters():  # a tied lm_head is the embedding Parameter, visited once
            if p.ndim == 1:
                p.data.normal_(0, 0.5).add_(1.0)
            else:
                p.data.normal_(0, 0.05)
    return model


def _make_checkpoint(name: str, seed: int, tmp_path_factory) -> HFCheckpoint:
    cfg = preset(name)
    model = build_hf_model(cfg, seed)
    d = tmp_path_factory.mktemp(name)
    model.save_pretrained(d)
    assert (d / "model.safetensors").exists()
    return HFCheckpoint(name=name, cfg=cfg, dir=d, model=model)


@pytest.fixture(scope="session")
def hf_tied(tmp_path_factory) -> HFCheckpoint:
    """tiny-qwen3: tied embeddings, GQA 2:1."""
    return _make_checkpoint("tiny-qwen3", 0, tmp_path_factory)


@pytest.fixture(scope="session")
def hf_untied(tmp_path_factory) -> HFCheckpoint:
    """tiny-qwen3-untied: separate lm_head, 6 q heads over 2 kv heads (GQA 3:1), 3 layers."""
    return _make_checkpoint("tiny-qwen3-untied", 1, tmp_path_factory)


@pytest.fixture(scope="session", params=["tiny-qwen3", "tiny-qwen3-untied"])
def hf_ckpt(request) -> HFCheckpoint:
    return request.getfixturevalue("hf_tied" if request.param == "tiny-qwen3" else "hf_untied")


_LOADED: dict = {}


def load_cached(ckpt: HFCheckpoint, dtype: str = "float32"):
    """orl_jax.convert.hf.load_hf of a session checkpoint, loaded once per (checkpoint, dtype)."""
    from orl_jax.convert.hf import load_hf

    key = (str(ckpt.dir), dtype)
    if key not in _LOADED:
        _LOADED[key] = load_hf(ckpt.dir, dtype=dtype)
    return _LOADED[key]


# --- pure-JAX random params (for model tests that do not need the torch oracle) ---------------------------------

def random_params(cfg: ModelConfig, seed: int = 0, *, adapter_down_zero: bool = True) -> dict:
    """Params with every weight random (norm weights around 1, matrices N(0, 0.05^2)), so that every dependency
    of the output on an input is visible numerically. The adapter's down projection stays zero unless asked."""
    rng = np.random.default_rng(seed)
    specs = qwen3.param_specs(cfg)

    def make(path, s):
        name = jax.tree_util.keystr(path)
        if "norm" in name:
            a = 1.0 + 0.5 * rng.standard_normal(s.shape)
        elif adapter_down_zero and "adapter" in name and "down" in name:
            a = np.zeros(s.shape)
        else:
            a = 0.05 * rng.standard_normal(s.shape)
        return jax.numpy.asarray(a.astype(np.float32)).astype(s.dtype)

    out = jax.tree_util.tree_map_with_path(make, specs, is_leaf=lambda x: isinstance(x, P.ParamSpec))
    P.check_tree(out, specs)
    return out


# One jitted forward shared by all tests (cfg is static; compiled once per shape / config).
jit_forward = jax.jit(qwen3.forward, static_argnums=(1,), static_argnames=("remat",))


def hf_logits(model, tokens: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.as_tensor(np.asarray(tokens), dtype=torch.long)).logits.float().numpy()
