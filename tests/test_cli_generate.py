"""`orl-jax generate` end to end on a tiny HF directory with a real (trained-in-process) tokenizer."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "recipes"))

import demo  # noqa: E402

from orl_jax.cli import main  # noqa: E402


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli") / "hf"
    demo.build_hf_dir(d)
    return d


def test_generate_streams_and_reports(hf_dir, capsys):
    rc = main(["generate", "--model", str(hf_dir), "--prompt", "Tom has 3 apples", "--max-new-tokens", "16",
               "--block-length", "8", "--noise", "mask", "--threshold", "0.5", "--dtype", "float32"])
    err = capsys.readouterr().err
    assert rc == 0
    assert "denoising" in err and "commit forwards" in err and "TPF" in err


def test_generate_rejects_bad_threshold(hf_dir, capsys):
    rc = main(["generate", "--model", str(hf_dir), "--prompt", "x", "--noise", "mask", "--threshold", "1.5"])
    assert rc == 2 and "threshold" in capsys.readouterr().err


def test_generate_picks_the_trained_residual(hf_dir, tmp_path, capsys):
    """A uniform-family QwenDLM export with an adapter (as the recipe writes it) decodes with its self-conditioning
    residual by default; an AR checkpoint run as the mask family gets none."""
    import jax

    from orl_jax import checkpoint
    from orl_jax import params as P
    from orl_jax.convert.hf import load_hf
    from orl_jax.model import qwen3

    cfg, params = load_hf(hf_dir, dtype="float32")
    cfg = cfg.replace(adapter_hidden=cfg.hidden_size, block_length=8, noise="uniform")
    params = dict(params, adapter=P.init(qwen3.param_specs(cfg)["adapter"], jax.random.key(0)))
    checkpoint.save_params(tmp_path / "dlm", cfg, params)
    rc = main(["generate", "--model", str(tmp_path / "dlm"), "--tokenizer", str(hf_dir), "--prompt", "Tom has 3",
               "--max-new-tokens", "8"])
    assert rc == 0 and "uniform noise, residual orl" in capsys.readouterr().err
    rc = main(["generate", "--model", str(hf_dir), "--prompt", "Tom has 3", "--max-new-tokens", "8",
               "--block-length", "8", "--noise", "mask"])
    assert rc == 0 and "mask noise, residual none" in capsys.readouterr().err
