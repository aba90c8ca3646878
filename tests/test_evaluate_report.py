"""The evaluation report's paired comparison against the base method (hand-computed toy cases)."""

import numpy as np
import pytest

from orl_jax.train.evaluate import EvalRow, paired_vs_base, write_report


def _row(method, setting, hits, tpf):
    return EvalRow(method=method, setting=setting, accuracy=float(np.mean(hits)), tpf=tpf, tokens_per_s=1.0,
                   n=len(hits), hits=hits)


def test_paired_difference_and_interval_by_hand(tmp_path):
    base = _row("QwenDLM", "s1", [1, 1, 0, 0], 2.0)
    other = _row("QwenDLM+ORL", "s1", [1, 0, 1, 1], 3.0)  # differences 0, -1, +1, +1: mean 0.25
    unmatched = _row("QwenDLM+ORL", "s2", [1, 1, 1, 1], 3.0)  # no base row at s2: left out
    (p,) = paired_vs_base([base, other, unmatched], "QwenDLM")
    d = np.array([0, -1, 1, 1])
    assert p["delta"] == pytest.approx(0.25)
    assert p["ci95"] == pytest.approx(1.96 * d.std(ddof=1) / 2)  # sd 0.9574 over sqrt(4)
    assert p["tpf_ratio"] == pytest.approx(1.5) and p["setting"] == "s1"
    text = write_report([base, other, unmatched], tmp_path, "t", base="QwenDLM").read_text()
    assert "| QwenDLM+ORL | s1 | +25.0 +- 93.8 points | 1.50x |" in text
    assert "| QwenDLM+ORL | s2 |" not in text.split("paired 95% interval")[1]


def test_identical_answers_have_no_spread():
    base = _row("QwenDLM", "s", [1, 0, 1], 1.0)
    (p,) = paired_vs_base([base, _row("B", "s", [1, 0, 1], 1.0)], "QwenDLM")
    assert p["delta"] == 0 and p["ci95"] == 0


def test_tpf_at_matched_accuracy_by_hand(tmp_path):
    """Reference: the base's most accurate setting (80% @ 3.0). Each method's best TPF within 1 point of it."""
    from orl_jax.train.evaluate import tpf_at_matched_accuracy

    def row(method, setting, acc, tpf):
        return EvalRow(method=method, setting=setting, accuracy=acc, tpf=tpf, tokens_per_s=1.0, n=100)

    rows = [row("AR (greedy)", "-", 0.9, 1.0),
            row("QwenDLM", "strict", 0.80, 3.0), row("QwenDLM", "loose", 0.70, 6.0),
            row("QwenDLM+ORL", "strict", 0.81, 3.5), row("QwenDLM+ORL", "mid", 0.795, 7.5),
            row("QwenDLM+ORL", "loose", 0.60, 9.0), row("QwenDLM+RCD", "strict", 0.75, 4.0)]
    got = {m["method"]: m for m in tpf_at_matched_accuracy(rows, "QwenDLM")}
    assert set(got) == {"QwenDLM", "QwenDLM+ORL", "QwenDLM+RCD"}  # AR has no decoding setting
    assert got["QwenDLM"]["tpf_ratio"] == pytest.approx(1.0)
    assert got["QwenDLM+ORL"]["setting"] == "mid" and got["QwenDLM+ORL"]["tpf_ratio"] == pytest.approx(2.5)
    assert got["QwenDLM+RCD"]["setting"] is None  # 75% is more than a point below 80%
    text = write_report(rows, tmp_path, "t", base="QwenDLM").read_text()
    assert "| QwenDLM+ORL | mid | 79.5% | 7.50 | 2.50x |" in text
    assert "| QwenDLM+RCD | none that accurate |" in text
