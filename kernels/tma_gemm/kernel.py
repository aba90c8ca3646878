"""Small-M weight-streaming GEMM through Pallas Mosaic GPU (Hopper: TMA loads into swizzled shared memory, wgmma).

y [M, N] = x [M, K] @ w [K, N] for decoding shapes (M = block length <= 64): the weight is read once from HBM, so
the time floor is its bytes over the read bandwidth. Each program owns one `tn`-wide column tile and one of
`splits` contiguous ranges of the contraction; `emit_pipeline` streams [tk, tn] weight tiles and [64, tk] x tiles
by TMA, `stages` deep, into a float32 wgmma accumulator. wgmma takes 64 rows: x is padded to 64 (the padding is
multiplied too; at these shapes the tensor cores are far from busy). splits > 1 writes float32 partials
[S, M, N] that XLA sums (it fuses the sum into the consumer).

Stacked weights: `w` may be a layer stack [L, K, N] with `layer` an int32 scalar array; the kernel reads that
layer where it lies (a slice handed to a custom call would be a copy of the weight).

This is the Mosaic GPU counterpart of kernels/small_m_gemm (Triton lowering). Runs in interpret mode on CPU.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

ROWS = 64  # wgmma's M per warpgroup


def _pipeline_takes_delay() -> bool:
    import inspect

    import jax.experimental.pallas.mosaic_gpu as plgpu

    return "delay_release" in inspect.signature(plgpu.emit_pipeline).parameters


_PIPELINE_DELAY = None  # resolved at the first trace


@dataclass(frozen=True)
class Blocks:
    tn: int = 128  # output columns per program (a multiple of 64)
    tk: int = 64  # contraction depth per pipeline step (a multiple of 64: 128-byte swizzled rows)
    splits: int = 1  # programs sharing one column tile (split-K)
    stages: int = 4  # pipeline depth (concurrent TMA steps)


def check(m: int, k: int, n: int, blocks: Blocks) -> None:
    """ValueError naming the first shape / block constraint that does not hold."""
    if not 0 < m <= ROWS:
        raise ValueError(f"tma_gemm: x has {m} rows; it takes 1..{ROWS}")
    if blocks.tn % 64 or n % blocks.tn:
        raise ValueError(f"tma_gemm: tn={blocks.tn} must be a multiple of 64 dividing N={n}")
    if blocks.tk % 64 or k % (blocks.tk * blocks.splits):
        raise ValueError(f"tma_gemm: tk={blocks.tk} x splits={blocks.splits} must divide K={k} (tk a multiple of 64)")
    if blocks.stages < 2:
        raise ValueError(f"tma_gemm: stages={blocks.stages} must be >= 2")


@functools.partial(jax.jit, static_argnames=("blocks", "interpret"))
def tma_gemm(x: jax.Array, w: jax.Array, layer: jax.Array | None = None, *, blocks: Blocks = Blocks(),
             interpret: bool = False) -> jax.Array:
    """x [M, K] @ w [K, N] (or w[layer] of a stack [L, K, N]) -> [M, N] in x's dtype (splits == 1) or float32
    partials [S, M, N] (splits > 1: the caller sums axis 0, where it fuses best)."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    global _PIPELINE_DELAY
    if _PIPELINE_DELAY is None:
        _PIPELINE_DELAY = _pipeline_takes_delay()
    m, k = x.shape
    stacked = w.ndim == 3
    n = w.shape[-1]
    check(m, k, n, blocks)
    tn, tk, s = blocks.tn, blocks.tk, blocks.splits
    steps = k // (tk * s)
    out_dtype = x.dtype if s == 1 else jnp.float32
    elems = 128 // x.dtype.itemsize  # a 128-byte swizzled row
    transforms = (plgpu.TilingTransform((8, elems)), plgpu.SwizzleTransform(128))
    xp = jnp.pad(x, ((0, ROWS - m), (0, 0))) if m < ROWS else x
    idx = jnp.zeros((1,), jnp.int32) if layer is None else jnp.reshape(layer, (1,)).astype(jnp.int32)

    def kernel(x_gmem, w_gmem, idx_gmem, o_gmem, o_smem):
        j, split = jax.lax.axis_index("n"), jax.lax.axis_index("split")
        w_ref = w_gmem.at[idx_gmem[0]] if stacked else w_gmem

        def product(acc):
            def step(_, x_smem, w_smem):
                plgpu.wgmma(acc, x_smem, w_smem)
                plgpu.wgmma_wait(1)

            # one wgmma stays in flight (wgmma_wait(1)), so a stage is released one step late: `delay_release`, an
            # argument of emit_pipeline in newer jax and of each BlockSpec in older
            late = {} if _PIPELINE_DELAY else {"delay_release": 1}
            plgpu.emit_pipeline(
                step,
                in_specs=[plgpu.BlockSpec((ROWS, tk), lambda i: (0, split * steps + i), transforms=transforms, **late),
                          plgpu.BlockSpec((tk, tn), lambda i: (split * steps + i, j), transforms=transforms, **late)],
                grid=(steps,), max_concurrent_steps=blocks.stages,
                **({"delay_release": 1} if _PIPELINE_DELAY else {}),
            )(x_gmem, w_ref)
            plgpu.wgmma_wait(0)
            return acc[...]

        o_smem[...] = pl.run_scoped(product, plgpu.ACC((ROWS, tn), jnp.float32)).astype(out_dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, m)], o_gmem.at[split, :, pl.ds(j * tn, tn)])
        plgpu.wait_smem_to_gmem(0)

    out = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((s, m, n), out_dtype),
        scratch_types=dict(o_smem=plgpu.SMEM((ROWS, tn), out_dtype)),
        grid=(n // tn, s), grid_names=("n", "split"),
        **({"interpret": _interpret_params()} if interpret else {}),
    )(xp, w, idx)
    return out[0] if s == 1 else out


def _interpret_params():
    """The Mosaic GPU interpreter's parameters (CPU tests): jax's own GPU interpreter, not the generic discharge."""
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    return InterpretGPUParams()
