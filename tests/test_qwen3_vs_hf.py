"""Parity of orl_jax's Qwen3 with transformers' Qwen3ForCausalLM, and HF <-> orl_jax conversion round trips."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import EOS, PAD, build_hf_model, hf_logits, jit_forward, load_cached, random_params
from safetensors.torch import load_file

from orl_jax.config import PRESETS, from_hf_config, preset, to_hf_config
from orl_jax.convert.hf import load_hf, save_hf

pytestmark = pytest.mark.hf

SHAPES = [(2, 7), (3, 19)]


def _tokens(shape, vocab, seed):
    return np.random.default_rng(seed).integers(0, vocab, size=shape, dtype=np.int32)


def _all_tensors(directory):
    """Every tensor of an HF directory (single file or shards) as torch tensors."""
    files = sorted(directory.glob("*.safetensors"))
    assert files, f"no safetensors in {directory}"
    out = {}
    for f in files:
        part = load_file(str(f))
        assert not set(part) & set(out)
        out.update(part)
    return out


def test_loaded_config_matches_preset(hf_ckpt):
    cfg, _ = load_cached(hf_ckpt)
    # The HF config carries eos / pad ids the preset does not; everything else must be the preset itself.
    assert cfg.eos_token_ids == (EOS,)
    assert cfg.pad_token_id == PAD
    assert cfg.replace(eos_token_ids=(), pad_token_id=None) == hf_ckpt.cfg


@pytest.mark.parametrize("shape", SHAPES)
def test_logits_match_transformers_fp32(hf_ckpt, shape):
    cfg, params = load_cached(hf_ckpt)
    tokens = _tokens(shape, cfg.vocab_size, seed=shape[1])
    ours = np.asarray(jit_forward(params, cfg, jnp.asarray(tokens)))
    ref = hf_logits(hf_ckpt.model, tokens)
    assert ours.shape == ref.shape == (*shape, cfg.vocab_size)
    assert ours.dtype == np.float32
    assert np.abs(ref).max() > 1.0  # the randomized model produces non-trivial logits
    np.testing.assert_array_less(np.abs(ours - ref).max(), 1e-4)


def test_hf_parity_is_sensitive(hf_untied):
    """The parity check above can fail: a single perturbed norm weight breaks it."""
    cfg, params = load_cached(hf_untied)
    tokens = _tokens((2, 7), cfg.vocab_size, seed=7)
    bad = jax.tree.map(lambda x: x, params)
    bad["layers"] = dict(bad["layers"], k_norm=bad["layers"]["k_norm"].at[1, 3].add(0.1))
    diff = np.abs(np.asarray(jit_forward(bad, cfg, jnp.asarray(tokens))) - hf_logits(hf_untied.model, tokens)).max()
    assert diff > 1e-3


def test_round_trip_reproduces_tensors_and_logits(hf_ckpt, tmp_path):
    from transformers import Qwen3ForCausalLM

    cfg, params = load_cached(hf_ckpt)
    out = save_hf(tmp_path / "export", cfg, params)
    assert (out / "model.safetensors").exists()
    orig, back = _all_tensors(hf_ckpt.dir), _all_tensors(out)
    assert sorted(orig) == sorted(back)
    assert ("lm_head.weight" in back) == (not cfg.tie_word_embeddings)
    for name, t in orig.items():
        assert back[name].dtype == t.dtype, name
        assert back[name].shape == t.shape, name
        assert bool((back[name] == t).all()), name

    exported_cfg = json.loads((out / "config.json").read_text())
    assert exported_cfg["eos_token_id"] == EOS and exported_cfg["pad_token_id"] == PAD
    model = Qwen3ForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    assert model.config.tie_word_embeddings == cfg.tie_word_embeddings
    tokens = _tokens((2, 11), cfg.vocab_size, seed=3)
    np.testing.assert_array_equal(hf_logits(model, tokens), hf_logits(hf_ckpt.model, tokens))


def test_sharded_export_loads_in_transformers(hf_untied, tmp_path):
    from transformers import Qwen3ForCausalLM

    cfg, params = load_cached(hf_untied)
    out = save_hf(tmp_path / "sharded", cfg, params, max_shard_bytes=40_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1 and not (out / "model.safetensors").exists()
    assert all((out / s).exists() for s in shards)
    orig, back = _all_tensors(hf_untied.dir), _all_tensors(out)
    assert sorted(orig) == sorted(back) == sorted(index["weight_map"])
    assert all(bool((back[k] == orig[k]).all()) for k in orig)
    # orl_jax reads its own sharded export back exactly
    cfg2, params2 = load_hf(out, dtype="float32")
    assert cfg2 == cfg
    jax.tree.map(np.testing.assert_array_equal, params2, params)
    model = Qwen3ForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    tokens = _tokens((1, 9), cfg.vocab_size, seed=4)
    np.testing.assert_array_equal(hf_logits(model, tokens), hf_logits(hf_untied.model, tokens))


def test_save_hf_refuses_nonempty_and_overwrites(hf_tied, tmp_path):
    cfg, params = load_cached(hf_tied)
    out = tmp_path / "o"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(ValueError, match="not empty"):
        save_hf(out, cfg, params)
    assert (out / "keep.txt").exists()  # nothing was touched
    save_hf(out, cfg, params, overwrite=True)
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary left behind


def test_bf16_load_close_to_fp32(hf_ckpt):
    cfg32, p32 = load_cached(hf_ckpt, "float32")
    cfg16, p16 = load_cached(hf_ckpt, "bfloat16")
    assert cfg16 == cfg32.replace(dtype="bfloat16")
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(p16))
    # weights are exactly the rounded fp32 weights
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b.astype(jnp.bfloat16))),
                 p16, p32)
    tokens = jnp.asarray(_tokens((2, 13), cfg32.vocab_size, seed=5))
    l32 = np.asarray(jit_forward(p32, cfg32, tokens))
    l16 = np.asarray(jit_forward(p16, cfg16, tokens))
    assert l16.dtype == np.float32
    scale = np.abs(l32).max()
    assert np.abs(l16 - l32).max() < 0.1 * scale
    assert np.abs(l16 - l32).max() > 0  # bf16 really ran in bf16
    # the top prediction agrees almost everywhere
    assert (l16.argmax(-1) == l32.argmax(-1)).mean() >= 0.8


def test_bf16_load_of_bf16_checkpoint(tmp_path):
    """A bf16 HF checkpoint (the usual Qwen3 release dtype) loads bit-exactly."""
    import torch

    cfg = preset("tiny-qwen3-untied")
    model = build_hf_model(cfg, seed=5).to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    cfg16, p16 = load_hf(tmp_path, dtype="bfloat16")
    back = save_hf(tmp_path / "back", cfg16, p16)
    orig, again = _all_tensors(tmp_path), _all_tensors(back)
    assert sorted(orig) == sorted(again)
    for k, t in orig.items():
        assert t.dtype == again[k].dtype == torch.bfloat16
        assert bool((t == again[k]).all()), k


CONFIGS = [PRESETS[n] for n in sorted(PRESETS)] + [
    preset("tiny-qwen3").replace(eos_token_ids=(3,), pad_token_id=0),
    preset("tiny-qwen3").replace(eos_token_ids=(3, 5, 7), rope_theta=10_000.0, rms_norm_eps=1e-5),
    preset("tiny-qwendlm").replace(noise="mask", prefix_attention="block_causal", adapter_act="gelu_tanh",
                                   block_length=4, dtype="bfloat16"),
    preset("tiny-qwen3-untied").replace(max_position_embeddings=128, dtype="float16"),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c.num_layers}L-{c.hidden_size}D-{c.dtype}")
def test_config_round_trip(cfg):
    hf = json.loads(json.dumps(to_hf_config(cfg)))  # through real JSON
    assert from_hf_config(hf, dtype=cfg.dtype) == cfg


def test_transformers_reads_exported_config(hf_untied):
    from transformers import Qwen3Config

    cfg, _ = load_cached(hf_untied)
    hc = Qwen3Config(**to_hf_config(cfg))
    ref = hf_untied.model.config
    for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "rms_norm_eps", "tie_word_embeddings", "max_position_embeddings"):
        assert getattr(hc, k) == getattr(ref, k), k
    assert hc.rope_parameters["rope_theta"] == ref.rope_parameters["rope_theta"]


def test_sharded_checkpoint_loads_identically(hf_untied, tmp_path):
    hf_untied.model.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert not (tmp_path / "model.safetensors").exists()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    cfg_s, p_s = load_hf(tmp_path, dtype="float32")
    cfg, p = load_cached(hf_untied)
    assert cfg_s == cfg
    assert jax.tree.structure(p_s) == jax.tree.structure(p)
    jax.tree.map(np.testing.assert_array_equal, p_s, p)


def test_qwendlm_export_round_trip(tmp_path):
    """A QwenDLM (adapter + diffusion fields) survives save_hf -> load_hf; transformers ignores the adapter."""
    from transformers import Qwen3ForCausalLM

    cfg = preset("tiny-qwendlm").replace(eos_token_ids=(EOS,), prefix_attention="block_causal")
    params = random_params(cfg, seed=3, adapter_down_zero=False)
    out = save_hf(tmp_path / "dlm", cfg, params)
    names = set(_all_tensors(out))
    assert {"orl_jax.adapter.norm.weight", "orl_jax.adapter.down_proj.weight"} <= names
    cfg2, params2 = load_hf(out, dtype="float32")
    assert cfg2 == cfg
    jax.tree.map(np.testing.assert_array_equal, params2, params)
    # the backbone exported for transformers is the AR model: same logits as orl_jax without residual
    model = Qwen3ForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    tokens = _tokens((2, 6), cfg.vocab_size, seed=8)
    ours = np.asarray(jit_forward(params, cfg, jnp.asarray(tokens)))
    np.testing.assert_allclose(hf_logits(model, tokens), ours, atol=1e-4, rtol=0)
