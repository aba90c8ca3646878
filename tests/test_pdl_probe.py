"""benchmarks/pdl_probe.py lowers for CUDA on a machine without a GPU (--export), each kernel of a PDL chain holding
one `griddepcontrol.wait` and the same kernel without PDL none, with and without independent reads before it."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_pdl_probe_exports_its_kernels_for_cuda():
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks/pdl_probe.py"), "--export", "--programs", "2",
                          "--work", "0,10", "--read-kb", "0,64"], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    assert [(r["work"], r["read_kb"], r["pdl"]) for r in rows] == [
        (w, kb, pdl) for w in (0, 10) for kb in (0, 64) for pdl in (False, True)]
    for r in rows:  # a chain of two kernels: one wait each with PDL, none without
        assert r["waits"] == (2 if r["pdl"] else 0), r


def test_pdl_probe_refuses_bad_lists():
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks/pdl_probe.py"), "--export", "--programs", "0"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert res.returncode == 2 and "--programs values must be >= 1" in res.stderr
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks/pdl_probe.py"), "--export", "--read-kb", "48"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert res.returncode == 2 and "--read-kb values must be multiples of 32" in res.stderr
