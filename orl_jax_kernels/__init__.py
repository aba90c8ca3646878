"""orl_jax GPU kernels, installed as the package `orl_jax_kernels` (the PyPI name `kernels` is taken).

One folder per kernel: kernel.py (kernel, block sizes, jitted wrapper), reference.py (jnp oracle), bench.py.
GPU-only packages (jax-triton, triton) are imported lazily inside kernel code.
"""
