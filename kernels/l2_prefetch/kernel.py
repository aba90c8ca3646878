"""Read the leading experts of one layer of an expert stack through the GPU's L2 ahead of the grouped GEMM that
streams them: evict-last loads, while the MoE's routing chain (latency-bound small kernels) leaves HBM idle.

Why: DiffusionGemma's experts are read at the bandwidth floor (gate/up 1.01 GB in ~236 us per 26B layer on an H200),
and the ~28 us of routing before them read almost nothing from HBM. The grouped kernel launches the column tiles of
expert 0 first (grouped_gemm.COLUMNS_INNER), so the bytes of the first experts are read first; if they already lie
in L2 (50 MB on an H200: ~6 of the 7.9 MB experts) the grouped kernel reads that much less from HBM. Whether it does
in time is measured (benchmarks/l2_expert_prefetch_probe.py alone, moe.PREFETCH_EXPERTS in the forward).

Semantics: a float32 [experts, N / bn, splits] of each program's maximum over its part of the weight; the value
means nothing, the output only orders the read before the GEMM that takes it as a dependency (grouped_matmul's
`after`). `after` here orders the read after that array is written. Pallas, Triton lowering; interpret mode on
CPU for tests (no cache there: only the value is checked).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from orl_jax_kernels.pallas_args import layer_operand, triton_params

BN = 128  # columns per program: the grouped kernel's tiles (DiffusionGemma's gate/up and down)
BK = 64  # rows per load
CHUNKS = 2  # loads per program: 16 KB each at BK x BN bf16; many short programs keep many loads in flight


def _kernel(layer_ref, *refs, bk: int, chunks: int, policy: str | None):
    from jax.experimental.pallas import triton as plt

    w_ref, o_ref = refs[-2:]  # refs[0] is `after` when given: never read
    layer = layer_ref[0]
    k_base = pl.program_id(2) * chunks * bk

    def chunk(j, acc):
        k0 = pl.multiple_of(k_base + j * bk, bk)
        wb = plt.load(w_ref.at[layer, jnp.int32(0), pl.ds(k0, bk), :], eviction_policy=policy)
        return jnp.maximum(acc, wb.astype(jnp.float32))

    acc = jax.lax.fori_loop(0, chunks, chunk, jnp.full((bk, w_ref.shape[-1]), -jnp.inf, jnp.float32))
    o_ref[...] = jnp.full((1, 1, 1), jnp.max(acc), jnp.float32)


@functools.partial(jax.jit, static_argnames=("experts", "bn", "bk", "chunks", "policy", "interpret"))
def prefetch_experts(stack: jax.Array, layer: jax.Array, experts: int, after: jax.Array | None = None, *,
                     bn: int = BN, bk: int = BK, chunks: int = CHUNKS, policy: str | None = "evict_last",
                     interpret: bool = False) -> jax.Array:
    """Read experts [0, experts) of layer `layer` of stack [L, E, K, N] (evict-last loads unless `policy` says
    otherwise: None for the default). Returns [experts, N / bn, K / (bk chunks)] float32 maxima (see the module
    docstring); `after`: any array the read waits for."""
    if stack.ndim != 4:
        raise ValueError(f"prefetch_experts: stack must be [L, E, K, N], got shape {stack.shape}")
    _, e, k, n = stack.shape
    if not 0 < experts <= e:
        raise ValueError(f"prefetch_experts: experts must be in [1, {e}], got {experts}")
    if n % bn or k % (bk * chunks):
        raise ValueError(f"prefetch_experts: K={k}, N={n} not divisible by bk x chunks = {bk * chunks} and bn = {bn}")
    if policy not in (None, "evict_last", "evict_first", "evict_normal"):
        raise ValueError(f"prefetch_experts: policy must be None, evict_last, evict_first or evict_normal, got "
                         f"{policy!r}")
    grid = (experts, n // bn, k // (bk * chunks))
    dep = [] if after is None else [after]
    return pl.pallas_call(
        functools.partial(_kernel, bk=bk, chunks=chunks, policy=policy),
        out_shape=jax.ShapeDtypeStruct(grid, jnp.float32),
        grid=grid,
        in_specs=[pl.BlockSpec((1,), lambda g, j, s: (0,))]
                 + [pl.BlockSpec(a.shape, lambda g, j, s, nd=a.ndim: (0,) * nd) for a in dep]
                 + [pl.BlockSpec((stack.shape[0], 1, k, bn), lambda g, j, s: (0, g, 0, j))],
        out_specs=pl.BlockSpec((1, 1, 1), lambda g, j, s: (g, j, s)),
        interpret=interpret,
        **triton_params(4, 1, interpret),
    )(layer_operand("prefetch_experts", True, layer, stack.shape), *dep, stack)
