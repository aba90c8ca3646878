"""recipes/train_qwendlm.py end to end on its `smoke` preset: tokenizer, stage 0, stage 1, evaluation, report,
and `--resume` reusing finished stages."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "recipes"))

import train_qwendlm  # noqa: E402


def test_recipe_smoke_end_to_end_and_resume(tmp_path):
    out = tmp_path / "run"
    train_qwendlm.main(["--preset", "smoke", "--out", str(out)])
    for f in ("report.md", "results.jsonl", "accuracy_vs_tpf.png", "stage0/params/config.json",
              "stage1/params/config.json", "stage0/logs/metrics.jsonl", "tokenizer/tokenizer.json"):
        assert (out / f).exists(), f
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [r["method"] for r in rows] == ["AR (greedy)", "QwenDLM"]
    assert all(0.0 <= r["accuracy"] <= 1.0 and r["tpf"] > 0 for r in rows)
    steps = [json.loads(line)["step"] for line in (out / "stage0/logs/metrics.jsonl").read_text().splitlines()]
    assert steps[-1] == 6
    with pytest.raises(SystemExit, match="--resume"):
        train_qwendlm.main(["--preset", "smoke", "--out", str(out)])
    before = (out / "stage1/params/config.json").stat().st_mtime
    train_qwendlm.main(["--preset", "smoke", "--out", str(out), "--resume"])  # stages reused, eval re-run
    assert (out / "stage1/params/config.json").stat().st_mtime == before
