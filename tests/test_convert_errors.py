"""load_hf / save_hf refuse bad checkpoints with a ValueError that names the problem."""

from __future__ import annotations

import json
import os
import shutil

import jax
import numpy as np
import pytest
import torch
from conftest import load_cached
from safetensors.torch import load_file, save_file

from orl_jax.convert.hf import load_hf, read_config, save_hf
from orl_jax.convert.safetensors_io import read_safetensors


def _copy_with_tensors(src, dst, edit):
    """dst = src's config.json + a model.safetensors whose tensor dict went through `edit(dict) -> dict`."""
    dst.mkdir(parents=True, exist_ok=True)
    shutil.copy(src / "config.json", dst / "config.json")
    tensors = edit(dict(load_file(str(src / "model.safetensors"))))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst / "model.safetensors"),
              metadata={"format": "pt"})
    return dst


def _copy_with_config(src, dst, edit):
    dst.mkdir(parents=True, exist_ok=True)
    shutil.copy(src / "model.safetensors", dst / "model.safetensors")
    cfg = json.loads((src / "config.json").read_text())
    edit(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _assert_same_params(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    jax.tree.map(np.testing.assert_array_equal, a, b)


# --- pickle ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("which", ["hf_tied", "hf_untied"])
def test_pickle_refused_by_default_and_loads_when_allowed(which, request, tmp_path):
    ckpt = request.getfixturevalue(which)
    shutil.copy(ckpt.dir / "config.json", tmp_path / "config.json")
    # the full state dict: for the tied model it also holds lm_head.weight (== the embedding)
    torch.save(ckpt.model.state_dict(), tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"pickle.*pytorch_model\.bin|pytorch_model\.bin.*pickle"):
        load_hf(tmp_path, dtype="float32")
    cfg, params = load_hf(tmp_path, dtype="float32", allow_pickle=True)
    cfg_ref, params_ref = load_cached(ckpt)
    assert cfg == cfg_ref
    _assert_same_params(params, params_ref)


def test_pickle_bf16_loads_when_allowed(hf_untied, tmp_path):
    shutil.copy(hf_untied.dir / "config.json", tmp_path / "config.json")
    sd = {k: v.to(torch.bfloat16) for k, v in hf_untied.model.state_dict().items()}
    torch.save(sd, tmp_path / "pytorch_model.bin")
    _, params = load_hf(tmp_path, dtype="bfloat16", allow_pickle=True)
    _, ref = load_cached(hf_untied, "bfloat16")
    _assert_same_params(params, ref)


def test_safetensors_preferred_over_pickle(hf_untied, tmp_path):
    """With both present, the safetensors file is read and the pickle never touched (even when not allowed)."""
    shutil.copytree(hf_untied.dir, tmp_path / "d")
    (tmp_path / "d" / "pytorch_model.bin").write_bytes(b"not a pickle at all")
    _, params = load_hf(tmp_path / "d", dtype="float32")
    _assert_same_params(params, load_cached(hf_untied)[1])


# --- shard index -----------------------------------------------------------------------------------------------

def _write_index(directory, weight_map):
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}))


def test_index_shard_outside_directory_refused(hf_tied, tmp_path):
    d = tmp_path / "ckpt"
    d.mkdir()
    shutil.copy(hf_tied.dir / "config.json", d / "config.json")
    # the outside file exists and is a valid checkpoint: only its location is wrong
    shutil.copy(hf_tied.dir / "model.safetensors", tmp_path / "outside.safetensors")
    names = load_file(str(hf_tied.dir / "model.safetensors")).keys()
    _write_index(d, {n: "../outside.safetensors" for n in names})
    with pytest.raises(ValueError, match=r"outside\.safetensors.*leaves"):
        load_hf(d, dtype="float32")


def test_index_absolute_shard_path_refused(hf_tied, tmp_path):
    d = tmp_path / "ckpt"
    d.mkdir()
    shutil.copy(hf_tied.dir / "config.json", d / "config.json")
    outside = tmp_path / "abs.safetensors"
    shutil.copy(hf_tied.dir / "model.safetensors", outside)
    names = load_file(str(outside)).keys()
    _write_index(d, {n: str(outside) for n in names})
    with pytest.raises(ValueError, match="leaves"):
        load_hf(d, dtype="float32")


def test_index_missing_shard(hf_tied, tmp_path):
    shutil.copy(hf_tied.dir / "config.json", tmp_path / "config.json")
    _write_index(tmp_path, {"model.embed_tokens.weight": "model-00001-of-00002.safetensors"})
    with pytest.raises(ValueError, match=r"model-00001-of-00002\.safetensors.*does not exist"):
        load_hf(tmp_path, dtype="float32")


def test_index_without_weight_map(hf_tied, tmp_path):
    shutil.copy(hf_tied.dir / "config.json", tmp_path / "config.json")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))
    with pytest.raises(ValueError, match="weight_map"):
        load_hf(tmp_path, dtype="float32")


def test_tensor_in_two_shards_refused(hf_tied, tmp_path):
    shutil.copy(hf_tied.dir / "config.json", tmp_path / "config.json")
    t = load_file(str(hf_tied.dir / "model.safetensors"))
    names = sorted(t)
    save_file(dict(t), str(tmp_path / "a.safetensors"))
    save_file({names[0]: t[names[0]]}, str(tmp_path / "b.safetensors"))
    _write_index(tmp_path, {n: "a.safetensors" for n in names} | {"dup": "b.safetensors"})
    with pytest.raises(ValueError, match=f"{names[0]}.*more than one shard"):
        load_hf(tmp_path, dtype="float32")


def test_sharded_checkpoint_in_hub_cache_layout_loads(hf_untied, tmp_path):
    """The hub cache layout: files in snapshots/<rev>/ are relative symlinks into blobs/."""
    staged = tmp_path / "staged"
    hf_untied.model.save_pretrained(staged, max_shard_size="20KB")
    assert (staged / "model.safetensors.index.json").exists()
    blobs, snap = tmp_path / "repo" / "blobs", tmp_path / "repo" / "snapshots" / "abc123"
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    for i, f in enumerate(sorted(staged.iterdir())):
        blob = blobs / f"blob{i}"
        shutil.copy(f, blob)
        os.symlink(os.path.join("..", "..", "blobs", blob.name), snap / f.name)
    cfg, params = load_hf(snap, dtype="float32")
    assert cfg == load_cached(hf_untied)[0]
    _assert_same_params(params, load_cached(hf_untied)[1])


def test_single_file_in_hub_cache_layout_loads(hf_untied, tmp_path):
    blobs, snap = tmp_path / "blobs", tmp_path / "snapshots" / "rev"
    blobs.mkdir()
    snap.mkdir(parents=True)
    for f in ("config.json", "model.safetensors"):
        shutil.copy(hf_untied.dir / f, blobs / f)
        os.symlink(os.path.join("..", "..", "blobs", f), snap / f)
    _assert_same_params(load_hf(snap, dtype="float32")[1], load_cached(hf_untied)[1])


# --- tensor set and shapes ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["model.layers.1.self_attn.k_norm.weight", "model.embed_tokens.weight",
                                  "lm_head.weight", "model.norm.weight"])
def test_missing_tensor_named(hf_untied, tmp_path, name):
    def drop(t):
        del t[name]
        return t

    d = _copy_with_tensors(hf_untied.dir, tmp_path / "d", drop)
    with pytest.raises(ValueError, match=rf"missing tensor '{name}'"):
        load_hf(d, dtype="float32")


def test_missing_layer_named(hf_untied, tmp_path):
    """Dropping the whole last layer is caught (the config still says 3 layers)."""
    d = _copy_with_tensors(hf_untied.dir, tmp_path / "d",
                           lambda t: {k: v for k, v in t.items() if not k.startswith("model.layers.2.")})
    with pytest.raises(ValueError, match=r"missing tensor 'model\.layers\.2\."):
        load_hf(d, dtype="float32")


@pytest.mark.parametrize("name", ["model.layers.0.self_attn.q_proj.bias", "model.layers.3.mlp.up_proj.weight",
                                  "something_else"])
def test_extra_tensor_named(hf_untied, tmp_path, name):
    d = _copy_with_tensors(hf_untied.dir, tmp_path / "d", lambda t: t | {name: torch.zeros(4)})
    with pytest.raises(ValueError, match=rf"unexpected tensor '{name}'"):
        load_hf(d, dtype="float32")


def test_untied_lm_head_in_tied_checkpoint(hf_tied, tmp_path):
    """tie_word_embeddings=true with an lm_head that differs from the embedding is refused."""
    d = _copy_with_tensors(hf_tied.dir, tmp_path / "d",
                           lambda t: t | {"lm_head.weight": t["model.embed_tokens.weight"] + 1.0})
    with pytest.raises(ValueError, match="lm_head.weight differs"):
        load_hf(d, dtype="float32")
    # an lm_head equal to the embedding is redundant but accepted
    d2 = _copy_with_tensors(hf_tied.dir, tmp_path / "d2",
                            lambda t: t | {"lm_head.weight": t["model.embed_tokens.weight"].clone()})
    _assert_same_params(load_hf(d2, dtype="float32")[1], load_cached(hf_tied)[1])


@pytest.mark.parametrize("name,bad_shape", [
    ("model.layers.0.mlp.up_proj.weight", lambda s: s[::-1]),  # transposed
    ("model.layers.2.self_attn.k_proj.weight", lambda s: (s[0] * 3, s[1])),  # k_proj sized as q_proj
    ("model.embed_tokens.weight", lambda s: (s[0] - 1, s[1])),
    ("model.layers.1.self_attn.q_norm.weight", lambda s: (s[0] + 2,)),
])
def test_wrong_shape_named(hf_untied, tmp_path, name, bad_shape):
    def reshape(t):
        shape = bad_shape(tuple(t[name].shape))
        t[name] = torch.randn(shape)
        return t

    d = _copy_with_tensors(hf_untied.dir, tmp_path / "d", reshape)
    with pytest.raises(ValueError, match=rf"tensor '{name}' has shape"):
        load_hf(d, dtype="float32")


def test_truncated_safetensors(hf_tied, tmp_path):
    shutil.copy(hf_tied.dir / "config.json", tmp_path / "config.json")
    data = (hf_tied.dir / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="model.safetensors"):
        load_hf(tmp_path, dtype="float32")
    (tmp_path / "model.safetensors").write_bytes(data[:5])
    with pytest.raises(ValueError, match="not a safetensors file"):
        read_safetensors(tmp_path / "model.safetensors")


def test_no_weights(hf_tied, tmp_path):
    shutil.copy(hf_tied.dir / "config.json", tmp_path / "config.json")
    with pytest.raises(ValueError, match="no model.safetensors"):
        load_hf(tmp_path, dtype="float32")


# --- config.json -------------------------------------------------------------------------------------------------

def _set_rope(c, **kw):
    c["rope_parameters"] = dict(c["rope_parameters"], **kw)


@pytest.mark.parametrize("edit,match", [
    (lambda c: _set_rope(c, rope_type="yarn", factor=4.0), "rope_type='yarn'"),
    (lambda c: c.pop("rope_parameters") and c.update(rope_scaling={"type": "linear", "factor": 2.0}),
     "rope_type='linear'"),
    (lambda c: c.update(attention_bias=True), "attention_bias"),
    (lambda c: c.update(model_type="llama"), "model_type='llama'"),
    (lambda c: c.update(use_sliding_window=True), "use_sliding_window"),
    (lambda c: c.update(hidden_act="gelu"), "hidden_act='gelu'"),
    (lambda c: c.update(orl_jax={"block_size": 4}), "block_size"),
    (lambda c: c.update(num_key_value_heads=4), "num_kv_heads"),  # 6 heads over 4 kv heads
])
def test_unsupported_config(hf_untied, tmp_path, edit, match):
    d = _copy_with_config(hf_untied.dir, tmp_path / "d", edit)
    with pytest.raises(ValueError, match=match):
        load_hf(d, dtype="float32")


def test_old_style_config_rope_theta(hf_untied, tmp_path):
    """transformers 4.x config.json: top-level rope_theta and rope_scaling=null."""
    def old(c):
        theta = c.pop("rope_parameters")["rope_theta"]
        c.update(rope_theta=theta, rope_scaling=None)

    d = _copy_with_config(hf_untied.dir, tmp_path / "d", old)
    cfg = read_config(d, dtype="float32")
    assert cfg == load_cached(hf_untied)[0]
    assert cfg.rope_theta == 1_000_000.0


def test_generation_config_eos_list_wins(hf_untied, tmp_path):
    shutil.copytree(hf_untied.dir, tmp_path / "d")
    g = json.loads((tmp_path / "d" / "generation_config.json").read_text())
    g["eos_token_id"] = [2, 7]
    (tmp_path / "d" / "generation_config.json").write_text(json.dumps(g))
    assert read_config(tmp_path / "d", "float32").eos_token_ids == (2, 7)


def test_eos_outside_vocab_refused(hf_untied, tmp_path):
    d = _copy_with_config(hf_untied.dir, tmp_path / "d", lambda c: c.update(eos_token_id=[2, 151645]))
    (d / "generation_config.json").unlink(missing_ok=True)
    with pytest.raises(ValueError, match="151645"):
        load_hf(d, dtype="float32")


def test_missing_directory(tmp_path):
    with pytest.raises(ValueError, match=r"nope.*does not exist"):
        load_hf(tmp_path / "nope", dtype="float32")


def test_directory_without_config(hf_tied, tmp_path):
    shutil.copy(hf_tied.dir / "model.safetensors", tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="no config.json"):
        load_hf(tmp_path, dtype="float32")


@pytest.mark.parametrize("dtype", ["float64", "fp32", "bf16", ""])
def test_bad_dtype(hf_tied, dtype):
    with pytest.raises(ValueError, match=rf"dtype must be one of .*got '{dtype}'"):
        load_hf(hf_tied.dir, dtype=dtype)


# --- output directories ------------------------------------------------------------------------------------------

def test_nonempty_output_refused_without_overwrite(hf_tied, tmp_path):
    cfg, params = load_cached(hf_tied)
    out = tmp_path / "out"
    save_hf(out, cfg, params)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(ValueError, match=r"out.*not empty"):
        save_hf(out, cfg, params)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    # an empty existing directory is fine
    (tmp_path / "empty").mkdir()
    save_hf(tmp_path / "empty", cfg, params)
    assert (tmp_path / "empty" / "model.safetensors").exists()


def test_save_hf_rejects_wrong_params(hf_tied, hf_untied, tmp_path):
    cfg, params = load_cached(hf_tied)
    _, untied_params = load_cached(hf_untied)
    with pytest.raises(ValueError):
        save_hf(tmp_path / "x", cfg, untied_params)
    bad = dict(params)
    del bad["final_norm"]
    with pytest.raises(ValueError, match="final_norm"):
        save_hf(tmp_path / "y", cfg, bad)
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()
    assert not list(tmp_path.iterdir())  # no temporary left behind


def test_save_hf_copies_tokenizer_files(hf_tied, tmp_path):
    cfg, params = load_cached(hf_tied)
    tok = tmp_path / "tok"
    tok.mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        (tok / f).write_text(f"{{\"name\": \"{f}\"}}")
    (tok / "unrelated.txt").write_text("x")
    out = save_hf(tmp_path / "out", cfg, params, tokenizer_dir=str(tok))
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        assert (out / f).read_text() == (tok / f).read_text()
    assert not (out / "unrelated.txt").exists()
