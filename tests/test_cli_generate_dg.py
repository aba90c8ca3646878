"""`orl-jax generate` on a DiffusionGemma checkpoint end to end: transformers' tiny random
DiffusionGemmaForBlockDiffusion saved with save_pretrained beside a word-level tokenizer, loaded through the real
loader, its generation defaults (uniform sampler) from generation_config.json, streamed block by block."""

import json
import re

import pytest
from fresh_process import run_optimized

from orl_jax.diffusion_gemma_config import DG_PRESETS


@pytest.fixture(scope="module")
def dg_dir(tmp_path_factory):
    from test_diffusion_gemma_vs_hf import random_hf_model
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    cfg = DG_PRESETS["tiny-dg"]
    model = random_hf_model(cfg, seed=1)
    d = tmp_path_factory.mktemp("dg-cli")
    model.save_pretrained(d)
    # ids 0 / 1 / 2 are the config's pad / eos / bos; every other id is a word, so any token the random model
    # samples decodes to text
    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3} | {f"w{i}": i for i in range(4, cfg.vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>",
                            unk_token="<unk>").save_pretrained(d)
    return d, cfg


def test_generate_a_diffusion_gemma_checkpoint(dg_dir):
    """In a fresh process with XLA's LLVM optimizations on (this suite turns them off for compile time): the
    samplers' argmax bug of session 50, every committed token id V, showed only there."""
    d, cfg = dg_dir
    steps = json.loads((d / "generation_config.json").read_text()).get("max_denoising_steps")
    out = run_optimized("-m", "orl_jax.cli", "generate", "--model", str(d), "--prompt", "w5 w6 w7",
                        "--max-new-tokens", str(2 * cfg.block_length), "--dtype", "float32", "--seed", "3")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "uniform noise" in out.stderr  # DiffusionGemma's sampler family, from its config
    report = out.stderr.strip().splitlines()[-1]  # "[N tokens, F denoising + C commit forwards, TPF ...; ...]"
    tokens, forwards = (int(report[1:].split(" tokens")[0]),
                        int(report.split(", ")[1].split(" denoising")[0]))
    assert 0 < tokens <= 2 * cfg.block_length
    assert 1 <= forwards <= 2 * (steps or 48)
    # the streamed text: one word per generated token but a stop token (blocks are printed back to back)
    words = re.findall(r"w\d+", out.stdout)
    assert len(words) in (tokens, tokens - 1) and "".join(words) == "".join(out.stdout.split()), out.stdout
