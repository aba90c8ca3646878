"""benchmarks/kernel_registers.py: the Triton IR it hands to `triton` is the kernel's, captured from jax's Pallas
lowering (a private jax module; this catches it moving). Compiling and ptxas need the `triton` package, which CI
does not install: that half runs where triton is present."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import pytest  # noqa: E402
from kernel_registers import triton_ir  # noqa: E402

from orl_jax_kernels.decode_attention.kernel import Blocks  # noqa: E402


def test_captures_the_kernels_triton_ir_for_its_blocks():
    wide = triton_ir((1, 256, 16, 8, 256, 768), Blocks(bl=128, bs=64, chunks_per_split=4, num_warps=8))
    narrow = triton_ir((1, 256, 16, 8, 256, 768), Blocks(bl=64, bs=64, chunks_per_split=4, num_warps=8))
    assert "tt.func" in wide and "tt.dot" in wide
    assert "128x256" in wide and "128x256" not in narrow  # the query tile's [BL, H] shape follows the blocks


def test_registers_and_spills_where_triton_is_installed():
    pytest.importorskip("triton")
    from kernel_registers import allocation

    blocks = Blocks(bl=16, bs=32, chunks_per_split=4)
    got = allocation(triton_ir((1, 32, 32, 8, 128, 544), blocks), blocks)
    assert 0 < got["registers"] <= 255 and got["spill_stores"] >= 0 and got["fits"]


def test_expert_kernel_ir_and_resident_blocks():
    """benchmarks/expert_kernel_registers.py: the fused expert kernel's IR is captured per variant, and the blocks per
    SM follow Hopper's allocation: the device's 164 registers and 72 KB give ncu's 3 blocks."""
    from expert_kernel_registers import VARIANTS, resident_blocks, triton_ir

    _, gu, dn, warps, stages, one_dot, _ = VARIANTS[0]
    assert "tt.dot" in triton_ir(gu, dn, warps, stages, one_dot)
    assert resident_blocks(164, 73728, 4) == 3  # Nsight Compute on the device: 3 by registers and by shared memory
    assert resident_blocks(96, 49152, 4) == 4  # shared memory limits
    assert resident_blocks(203, 73728, 4) == 2  # registers limit
