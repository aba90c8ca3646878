"""benchmarks/triton_tma_probe.py (issue #4's expert-read question, timed on the device): its gate/up kernels (four
load paths, and the balanced routing's gather and static kernels) agree with torch in Triton's interpreter, and each
compiles for sm_90 with the load path it is there to time. Needs the `triton` package (the cuda extras; CI's CPU
install has none, so these skip there)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def test_kernels_match_torch_in_the_interpreter(tmp_path):
    triton = pytest.importorskip("triton")
    if tuple(int(p) for p in triton.__version__.split(".")[:2]) < (3, 7):
        pytest.skip("Triton < 3.7's interpreter takes no loop bound loaded from memory (int() of a 1-element array)")
    out = subprocess.run([sys.executable, str(BENCH / "triton_tma_probe.py"), "--tiny", "--out", str(tmp_path / "o")],
                         env=os.environ | {"TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    checks = [line for line in out.stdout.splitlines() if '"what": "check"' in line]
    assert len(checks) == 6 and all('"ok": true' in line for line in checks), out.stdout


def test_each_variant_compiles_for_hopper_with_its_load_path():
    pytest.importorskip("triton")
    sys.path.insert(0, str(BENCH))
    import triton_tma_probe as probe

    for v in probe.variants(tiny=False):
        k = probe.compiled(v)
        ptx = k.asm["ptx"]
        assert "wgmma.mma_async" in ptx, v
        assert ("cp.async.bulk.tensor" in ptx) == (v["w"] == "tma"), v  # TMA loads
        if v["x"] in ("gather", "static") and not v["WS"]:
            assert "cp.async.cg.shared.global" in ptx, v  # the pointer loads software-pipelined, as Pallas' are
        assert ("setmaxnreg" in ptx) == v["WS"], v  # warp specialization: register budgets per warp group
        assert k.metadata.shared <= 232448, v  # a Hopper block's shared memory
