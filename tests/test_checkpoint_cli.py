"""Orbax params export / import, the `orl-jax convert` CLI, and tokenizer loading."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import load_cached
from jax.sharding import PartitionSpec as PS
from safetensors.torch import load_file

from orl_jax import checkpoint, cli, sharding
from orl_jax.convert.hf import load_hf
from orl_jax.data.tokenizer import load_tokenizer, mask_token_id

SENTENCES = [
    "the quick brown fox jumps over the lazy dog",
    "a diffusion language model denoises a whole block of tokens at once",
    "JAX compiles the decoder loop on the device; the host only reads results.",
    "Qwen3 uses grouped-query attention with RMSNorm on queries and keys",
] * 4


@pytest.fixture(scope="module")
def orbax_export(hf_untied, tmp_path_factory):
    cfg, params = load_cached(hf_untied)
    d = tmp_path_factory.mktemp("orbax") / "export"
    assert checkpoint.save_params(d, cfg, params) == d.absolute()
    return d, cfg, params


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<pad>", "<eos>", "<mask>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(SENTENCES, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", mask_token="<mask>")
    d = tmp_path_factory.mktemp("tokenizer")
    fast.save_pretrained(d)
    return d, tok, fast


def _hf_tensors(directory):
    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


# --- orbax ------------------------------------------------------------------------------------------------------

def test_orbax_round_trip_exact(orbax_export):
    d, cfg, params = orbax_export
    assert (d / "config.json").exists() and (d / "params").is_dir()
    assert json.loads((d / "config.json").read_text())["dtype"] == "float32"
    cfg2, params2 = checkpoint.load_params(d)
    assert cfg2 == cfg
    assert jax.tree.structure(params2) == jax.tree.structure(params)
    for a, b in zip(jax.tree.leaves(params2), jax.tree.leaves(params), strict=True):
        assert a.dtype == b.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_orbax_load_as_bf16(orbax_export):
    d, cfg, params = orbax_export
    cfg16, p16 = checkpoint.load_params(d, dtype="bfloat16")
    assert cfg16 == cfg.replace(dtype="bfloat16")
    for a, b in zip(jax.tree.leaves(p16), jax.tree.leaves(params), strict=True):
        assert a.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b.astype(jnp.bfloat16)))


def test_orbax_load_with_mesh_is_sharded(orbax_export):
    d, cfg, params = orbax_export
    mesh = sharding.make_mesh(data=1, fsdp=2, tensor=2)
    _, ps = checkpoint.load_params(d, mesh=mesh)
    q, head = ps["layers"]["qkv"], ps["lm_head"]
    assert q.sharding.spec == PS(None, "fsdp", "tensor", None, None)
    assert head.sharding.spec == PS("tensor", "fsdp")
    Ly, D, K, T, H = q.shape
    assert {s.data.shape for s in q.addressable_shards} == {(Ly, D // 2, K // 2, T, H)}
    assert len(q.sharding.device_set) == 4
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), ps, params)


def test_load_hf_with_mesh_is_sharded(hf_untied):
    mesh = sharding.make_mesh(data=1, fsdp=2, tensor=2)
    _, ps = load_hf(hf_untied.dir, dtype="float32", mesh=mesh)
    assert ps["layers"]["gate_up"].sharding.spec == PS(None, "fsdp", None, "tensor")
    assert len(ps["embed"].sharding.device_set) == 4
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), ps,
                 load_cached(hf_untied)[1])


def test_orbax_errors(orbax_export, hf_tied, tmp_path):
    d, cfg, params = orbax_export
    with pytest.raises(ValueError, match="not empty"):
        checkpoint.save_params(d, cfg, params)
    with pytest.raises(ValueError, match="not an orl_jax params export"):
        checkpoint.load_params(tmp_path)
    cfg_t, params_t = load_cached(hf_tied)
    with pytest.raises(ValueError):  # params of another config
        checkpoint.save_params(tmp_path / "x", cfg, params_t)
    assert not (tmp_path / "x").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary left behind
    # overwrite replaces the export
    out = checkpoint.save_params(tmp_path / "y", cfg_t, params_t)
    checkpoint.save_params(out, cfg_t, params_t, overwrite=True)
    assert checkpoint.load_params(out)[0] == cfg_t


# --- CLI --------------------------------------------------------------------------------------------------------

def test_cli_round_trip_fp32(hf_untied, tokenizer_dir, tmp_path, capsys):
    orb, hf2 = tmp_path / "orbax", tmp_path / "hf"
    assert cli.main(["convert", "--hf", str(hf_untied.dir), "--out", str(orb), "--dtype", "float32"]) == 0
    assert cli.main(["convert", "--orbax", str(orb), "--out", str(hf2), "--tokenizer", str(tokenizer_dir[0])]) == 0
    assert "wrote" in capsys.readouterr().out
    orig, back = _hf_tensors(hf_untied.dir), _hf_tensors(hf2)
    assert sorted(orig) == sorted(back)
    for k, t in orig.items():
        assert back[k].dtype == t.dtype == torch.float32, k
        assert torch.equal(back[k], t), k
    assert load_hf(hf2, dtype="float32")[0] == load_cached(hf_untied)[0]
    tok = load_tokenizer(hf2)
    assert tok.decode(tok.encode(SENTENCES[1])) == SENTENCES[1]


def test_cli_default_dtype_is_bf16(hf_untied, tmp_path):
    orb, hf2 = tmp_path / "orbax", tmp_path / "hf"
    assert cli.main(["convert", "--hf", str(hf_untied.dir), "--out", str(orb)]) == 0
    cfg, params = checkpoint.load_params(orb)
    assert cfg.dtype == "bfloat16" and all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(params))
    assert cli.main(["convert", "--orbax", str(orb), "--out", str(hf2)]) == 0
    orig, back = _hf_tensors(hf_untied.dir), _hf_tensors(hf2)
    assert sorted(orig) == sorted(back)
    for k, t in orig.items():
        assert back[k].dtype == torch.bfloat16
        assert torch.equal(back[k], t.to(torch.bfloat16)), k


def test_cli_errors(hf_tied, tmp_path, capsys):
    missing = tmp_path / "no_such_checkpoint"
    assert cli.main(["convert", "--hf", str(missing), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "orl-jax convert: error:" in err and "no_such_checkpoint" in err and "does not exist" in err
    assert not (tmp_path / "o").exists()

    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "f").write_text("x")
    assert cli.main(["convert", "--hf", str(hf_tied.dir), "--out", str(busy), "--dtype", "float32"]) == 2
    assert "not empty" in capsys.readouterr().err
    assert cli.main(["convert", "--hf", str(hf_tied.dir), "--out", str(busy), "--dtype", "float32",
                     "--overwrite"]) == 0
    assert not (busy / "f").exists() and (busy / "params").is_dir()

    assert cli.main(["convert", "--orbax", str(tmp_path), "--out", str(tmp_path / "o2")]) == 2
    assert "not an orl_jax params export" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["convert", "--hf", str(hf_tied.dir), "--orbax", str(busy), "--out", str(tmp_path / "o3")])
    with pytest.raises(SystemExit):
        cli.main(["convert", "--out", str(tmp_path / "o4")])
    with pytest.raises(SystemExit):
        cli.main(["convert", "--hf", str(hf_tied.dir), "--out", str(tmp_path / "o5"), "--dtype", "float64"])


def test_cli_pickle_needs_flag(hf_tied, tmp_path, capsys):
    import shutil

    src = tmp_path / "pickled"
    src.mkdir()
    shutil.copy(hf_tied.dir / "config.json", src / "config.json")
    torch.save(hf_tied.model.state_dict(), src / "pytorch_model.bin")
    assert cli.main(["convert", "--hf", str(src), "--out", str(tmp_path / "o"), "--dtype", "float32"]) == 2
    assert "pickle" in capsys.readouterr().err
    assert cli.main(["convert", "--hf", str(src), "--out", str(tmp_path / "o"), "--dtype", "float32",
                     "--allow-pickle"]) == 0
    _, params = checkpoint.load_params(tmp_path / "o")
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), params,
                 load_cached(hf_tied)[1])


# --- tokenizer --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text", [SENTENCES[0], SENTENCES[2], "unseen wörds, ünïcode ✓ and  double  spaces\n"])
def test_tokenizer_round_trip(tokenizer_dir, text):
    d, raw, fast = tokenizer_dir
    tok = load_tokenizer(d)
    ids = tok.encode(text, add_special_tokens=False)
    assert ids == raw.encode(text).ids == fast.encode(text, add_special_tokens=False)
    assert len(ids) > 1 and max(ids) < raw.get_vocab_size()
    assert tok.decode(ids) == text
    assert raw.decode(ids) == text


def test_tokenizer_special_tokens(tokenizer_dir):
    d, raw, _ = tokenizer_dir
    tok = load_tokenizer(d)
    assert mask_token_id(tok) == raw.token_to_id("<mask>") is not None
    assert tok.eos_token_id == raw.token_to_id("<eos>")
    assert tok.pad_token_id == raw.token_to_id("<pad>")
    assert tok.decode([tok.eos_token_id], skip_special_tokens=False) == "<eos>"


def test_tokenizer_missing(tmp_path):
    with pytest.raises(ValueError, match="no tokenizer.json"):
        load_tokenizer(tmp_path)
