"""benchmarks/block_confidence.py on a smoke-preset base package: the decoding it replays is the evaluation's."""

import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "recipes"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import block_confidence  # noqa: E402
import train_qwendlm  # noqa: E402


def test_counts_come_from_the_evaluated_decoding(tmp_path):
    from orl_jax.data.tokenizer import load_tokenizer
    from orl_jax.decode.residual import NoResidual
    from orl_jax.decode.samplers import MaskSampler
    from orl_jax.train import base_package, stages
    from orl_jax.train.evaluate import evaluate

    pkg = tmp_path / "pkg"
    train_qwendlm.main(["--preset", "smoke", "--noise", "mask", "--out", str(tmp_path / "run"), "--skip-stage2",
                        "--no-eval", "--export-package", str(pkg)])
    out = tmp_path / "c.json"
    res = block_confidence.main(["--package", str(pkg), "--preset", "smoke", "--examples", "4", "--threshold", "0.7",
                                 "--max-steps", "4", "--out", str(out)])
    assert json.loads(out.read_text()) == res
    # the same examples through the recipe's evaluation: same accuracy and TPF
    r = train_qwendlm.PRESETS["smoke"]
    tok = load_tokenizer(pkg)
    cfg, params = base_package.read_package(pkg)
    cfg = cfg.replace(dtype="float32", attention_impl="xla")
    params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params)
    examples = stages.heldout_examples(r, tok, 7)[:4]
    row = evaluate(params, cfg, tok, examples, method="base", setting="-", max_new_tokens=r.eval_max_new,
                   sampler=MaskSampler(mask_token_id=cfg.mask_token_id, threshold=0.7), max_steps=4,
                   residual=NoResidual())
    assert res["accuracy"] == pytest.approx(row.accuracy) and res["tpf"] == pytest.approx(row.tpf)
    for part in ("first step of a block", "every step"):
        shares = res[part]
        assert shares["unresolved positions"] > 0
        assert all(0.0 <= v <= 1.0 for k, v in shares.items() if k != "unresolved positions")
        assert shares["not final, confident"] == 0.0  # greedy fills: a confident position is filled with its argmax
        assert shares["final, not confident"] <= shares["argmax is the final token"]
    per_block = res["per block at its first step"]
    assert 0 < per_block["positions to fill"] <= cfg.block_length
    assert res["denoising steps per block"] >= 1.0
    for bad in (["--examples", "0"], ["--threshold", "1.5"], ["--max-steps", "0"]):
        with pytest.raises(SystemExit):
            block_confidence.main(["--package", str(pkg), "--preset", "smoke"] + bad)
    with pytest.raises(SystemExit):
        block_confidence.main(["--package", str(tmp_path / "nope")])
