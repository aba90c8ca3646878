"""A fresh Python process on the CPU backend with XLA's LLVM optimizations on, which this suite's conftest turns off
for compile time: for what hinges on them (an FMA contraction hid session 50's sampler bug from the suite)."""

from __future__ import annotations

import os
import subprocess
import sys


def run_optimized(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """`python *args` without this process's XLA_FLAGS, on the CPU; output captured as text."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {"JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=timeout)
