"""benchmarks/pdl_probe.py lowers for CUDA on a machine without a GPU (--export), each kernel of a PDL chain holding
one `griddepcontrol.wait` and the same kernel without PDL none."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_pdl_probe_exports_its_kernels_for_cuda():
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks/pdl_probe.py"), "--export", "--programs", "2",
                          "--work", "0,10"], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    assert [(r["work"], r["pdl"]) for r in rows] == [(0, False), (0, True), (10, False), (10, True)]
    for r in rows:  # a chain of two kernels: one wait each with PDL, none without
        assert r["waits"] == (2 if r["pdl"] else 0), r


def test_pdl_probe_refuses_bad_lists():
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks/pdl_probe.py"), "--export", "--programs", "0"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert res.returncode == 2 and "--programs values must be >= 1" in res.stderr
