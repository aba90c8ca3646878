"""benchmarks/xplane_summary.py: busy time is the union of kernel intervals (overlaps count once), idle the rest."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from xplane_summary import summarize_events  # noqa: E402


def test_busy_time_is_the_union_of_kernel_intervals():
    # (kernel, hlo op, start ns, duration ns) over 2 steps: [0, 100) and [50, 150) overlap -> 150 busy; a gap of 50;
    # [200, 300) contains [220, 240); busy 250 of a 300 ns span
    ev = [("gemm", "dot.1", 0, 100), ("fusion", "add.2", 50, 100), ("gemm", "dot.1", 200, 100),
          ("copy", "copy.3", 220, 20)]
    s = summarize_events(ev, steps=2, top=2)
    assert s["kernels_per_step"] == 2
    assert s["span_ms_per_step"] == pytest.approx(300 / 2 / 1e6)
    assert s["busy_ms_per_step"] == pytest.approx(250 / 2 / 1e6)
    assert s["idle_pct"] == pytest.approx(100 * 50 / 300)
    assert [r["kernel"] for r in s["top"]] == ["gemm", "fusion"]  # by total time, cut at `top`
    assert s["top"][0]["calls_per_step"] == 1 and s["top"][0]["us_per_call"] == pytest.approx(0.1)
    # the one idle gap: after fusion (the kernel that ended last, at 150), before the gemm at 200
    assert s["gaps"] == [{"after": "fusion", "before": "gemm", "per_step": 0.5, "us_per_step": pytest.approx(0.025)}]


def test_kernels_in_several_command_buffers_add_up():
    ev = [("gemm", "command_buffer_3", 0, 10), ("gemm", "command_buffer_9", 20, 30), ("gemm", "fusion.1", 60, 5)]
    top = summarize_events(ev, steps=1)["top"]
    rows = {(r["kernel"], r["hlo_op"]): r for r in top}
    assert rows[("gemm", "command_buffer")]["calls_per_step"] == 2
    assert rows[("gemm", "command_buffer")]["us_per_step"] == 40 / 1e3
    assert rows[("gemm", "fusion.1")]["calls_per_step"] == 1


def test_time_alone_excludes_what_overlaps_other_kernels():
    # gemm [0, 100) overlaps fusion [50, 150): 50 ns alone each; copy [220, 240) inside gemm [200, 300): gemm alone
    # 80 there, copy never alone; back-to-back kernels [400, 410) and [410, 420) are each alone
    ev = [("gemm", "dot.1", 0, 100), ("fusion", "add.2", 50, 100), ("gemm", "dot.1", 200, 100),
          ("copy", "copy.3", 220, 20), ("a", "x", 400, 10), ("b", "y", 410, 10)]
    rows = {r["kernel"]: r for r in summarize_events(ev, steps=1, top=5)["top"]}
    assert {k: r["alone_us_per_step"] * 1e3 for k, r in rows.items()} == pytest.approx(
        {"gemm": 130, "fusion": 50, "copy": 0, "a": 10, "b": 10})


def test_call_duration_percentiles_show_two_shapes_under_one_name():
    # one cuBLAS kernel name for two GEMMs: 5 calls of 7 us and 5 of 19 us, back to back
    ev = [("gemm", "command_buffer_1", i * 100_000, 7_000 if i % 2 else 19_000) for i in range(10)]
    row = summarize_events(ev, steps=1)["top"][0]
    assert row["us_per_call"] == pytest.approx(13.0)
    assert (row["us_p10"], row["us_p50"], row["us_p90"]) == (7.0, 19.0, 19.0)
