"""benchmarks/frontier_plot.py: curves of methods from several results.jsonl files on one PNG."""

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

import frontier_plot  # noqa: E402


def _results(path, method, points):
    rows = [{"method": method, "setting": f"s{i}", "accuracy": a, "tpf": t, "tokens_per_s": 1.0, "n": 4}
            for i, (a, t) in enumerate(points)]
    rows.append({"method": "AR", "setting": "-", "accuracy": 0.9, "tpf": 1.0, "tokens_per_s": 1.0, "n": 4})
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_rows_are_picked_by_method_and_relabelled(tmp_path):
    f = _results(tmp_path / "a.jsonl", "QwenDLM+ORL", [(0.8, 3.0), (0.7, 5.0)])
    rows = frontier_plot.load_rows(f"ORL run 1={f}:QwenDLM+ORL")
    assert [(r.method, r.accuracy, r.tpf) for r in rows] == [("ORL run 1", 0.8, 3.0), ("ORL run 1", 0.7, 5.0)]
    with pytest.raises(ValueError, match="no rows of method 'QwenDLM'"):
        frontier_plot.load_rows(f"base={f}:QwenDLM")
    with pytest.raises(ValueError, match="LABEL=RESULTS:METHOD"):
        frontier_plot.load_rows(str(f))


def test_writes_one_png_and_nothing_else(tmp_path):
    a = _results(tmp_path / "a.jsonl", "QwenDLM", [(0.8, 3.0), (0.6, 6.0)])
    b = _results(tmp_path / "b.jsonl", "QwenDLM+RCD", [(0.82, 3.1)])
    out = tmp_path / "f.png"
    frontier_plot.main(["--out", str(out), "--ylim", "40", "90", "--run", f"base={a}:QwenDLM",
                        "--run", f"RCD={b}:QwenDLM+RCD"])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.jsonl", "b.jsonl", "f.png"]
    with pytest.raises(SystemExit):  # a missing file is a usage error, before anything is written
        frontier_plot.main(["--out", str(tmp_path / "g.png"), "--run", f"x={tmp_path / 'missing.jsonl'}:QwenDLM"])
    assert not (tmp_path / "g.png").exists()
