"""Probe: how XLA on this GPU runs jax.lax.ragged_dot at DiffusionGemma's MoE shape (canvas 256 x top-8 = 2048
rows, 128 experts, D=2816 -> 2F=1408), against the dense GEMMs that bound it.

  python benchmarks/ragged_dot_probe.py
"""
import jax
import jax.numpy as jnp
from timing import median_seconds

M, E, K, N = 2048, 128, 2816, 1408


def bench(f, *a):
    return median_seconds(f, *a) * 1e3


x = jax.random.normal(jax.random.key(0), (M, K), jnp.bfloat16)
w = jax.random.normal(jax.random.key(1), (E, K, N), jnp.bfloat16) * 0.02
sizes = jnp.full((E,), M // E, jnp.int32)
rd = jax.jit(lambda x, w, s: jax.lax.ragged_dot(x, w, s, preferred_element_type=jnp.float32))
one = jax.jit(lambda x, w: jnp.dot(x, w[0], preferred_element_type=jnp.float32))
allx = jax.jit(lambda x, w: jnp.einsum("mk,ekn->emn", x[:256], w, preferred_element_type=jnp.float32))
bw_ms = E * K * N * 2 / 4.2e12 * 1e3
print(f"weights {E * K * N * 2 / 1e9:.2f} GB -> {bw_ms:.2f} ms at 4.2 TB/s; useful FLOPs {2 * M * K * N / 1e9:.1f} G")
print(f"ragged_dot [{M},{K}] x [{E},{K},{N}]: {bench(rd, x, w, sizes):.2f} ms")
print(f"one dense GEMM [{M},{K}] x [{K},{N}]: {bench(one, x, w):.3f} ms")
print(f"all experts on 256 rows (dense, 16x the useful FLOPs of top-8): {bench(allx, x, w):.2f} ms")
