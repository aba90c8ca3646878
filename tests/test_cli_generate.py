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
