"""The Mosaic GPU small-M GEMM against a float32 product: jax's Mosaic GPU interpreter on CPU, compiled on a GPU."""

import jax
import jax.numpy as jnp
import pytest

from orl_jax_kernels.tma_gemm.kernel import Blocks, tma_gemm


def _rel(out, ref):
    out = out.sum(0) if out.ndim == 3 else out
    return float(jnp.linalg.norm(out.astype(jnp.float32) - ref) / jnp.linalg.norm(ref))


def _inputs(m, k, n, layers, seed):
    kx, kw = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (m, k), jnp.float32).astype(jnp.bfloat16)
    w = jax.random.normal(kw, (layers, k, n), jnp.float32).astype(jnp.bfloat16)
    return x, w


@pytest.mark.parametrize("m,k,n,blocks", [
    (32, 256, 128, Blocks(tn=64, tk=64, splits=2, stages=2)),  # padded rows, split-K partials
    (64, 256, 128, Blocks(tn=128, tk=128, splits=1, stages=2)),  # bf16 out, two 64-wide swizzle tiles per step
    (5, 384, 64, Blocks(tn=64, tk=64, splits=3, stages=2)),  # few rows, three splits
])
def test_matches_float32_product_in_interpret_mode(m, k, n, blocks):
    x, w = _inputs(m, k, n, 3, m + k)
    for layer in (0, 2):  # the stack read at its layer, and a plain 2-D weight
        ref = jnp.dot(x.astype(jnp.float32), w[layer].astype(jnp.float32))
        out = tma_gemm(x, w, jnp.int32(layer), blocks=blocks, interpret=True)
        assert out.shape == ((m, n) if blocks.splits == 1 else (blocks.splits, m, n))
        assert out.dtype == (jnp.bfloat16 if blocks.splits == 1 else jnp.float32)
        assert _rel(out, ref) < 1e-2, (layer, _rel(out, ref))
    plain = tma_gemm(x, w[2], blocks=blocks, interpret=True)
    assert _rel(plain, ref) < 1e-2


@pytest.mark.parametrize("m,k,n,blocks,match", [
    (65, 256, 128, Blocks(), "rows"), (0, 256, 128, Blocks(), "rows"),
    (32, 256, 96, Blocks(tn=64), "tn=64"), (32, 256, 128, Blocks(tn=96), "tn=96"),
    (32, 192, 128, Blocks(tn=64, tk=64, splits=2), "splits=2"), (32, 256, 128, Blocks(tk=32), "tk=32"),
    (32, 256, 128, Blocks(stages=1), "stages=1"),
])
def test_rejects_shapes_it_cannot_tile(m, k, n, blocks, match):
    x, w = jnp.zeros((m, k), jnp.bfloat16), jnp.zeros((k, n), jnp.bfloat16)
    with pytest.raises(ValueError, match=match):
        tma_gemm(x, w, blocks=blocks, interpret=True)


@pytest.mark.gpu
def test_compiled_on_gpu_at_qwen3_shapes():
    for k, n, blocks in [(2560, 6144, Blocks(tn=128, tk=64, splits=2)), (4096, 2560, Blocks(tn=64, tk=128, splits=4)),
                         (9728, 2560, Blocks(tn=64, tk=64, splits=8, stages=6))]:
        x, w = _inputs(32, k, n, 2, k)
        ref = jnp.dot(x.astype(jnp.float32), w[1].astype(jnp.float32))
        assert _rel(tma_gemm(x, w, jnp.int32(1), blocks=blocks), ref) < 1e-2
