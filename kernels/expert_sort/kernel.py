"""The MoE's counting sort in one launch: the T * k (token, choice) assignments in expert order, stable.

Why: at DiffusionGemma's canvas (2048 assignments over 128 experts) model/moe.sort_by_expert runs as ~6 small XLA
fusions per layer (per-token counts, a cumsum over the tokens, the within-token ties, the row of each assignment,
the inverse scatter) and the grouped kernel's wrapper adds a cumsum and a concatenation for its group offsets:
~13 us per 26B layer in an H200 profile (benchmarks/results/2026-12-01_dg_concurrent_graphs_h200.md), ~0.4 ms
per forward.

Here one program per expert e reads all M expert ids (8 KB at M = 2048, from L2) and computes, for its own
assignments only: the expert's first row (how many assignments chose an expert below e), each one's rank among
them (a cumsum of the hits, which keeps (token, choice) order: stable) and so its sorted row `pos` (a masked
store). Program e also writes offsets[e], the last one offsets[E] = M. Every assignment belongs to exactly one
program, so every element of `pos` is written once. The inverse permutation `order` is one XLA scatter after it
(a masked scatter in the kernel would write rows through the masked lanes' indices in interpret mode).

Semantics: model/moe.sort_by_expert's (order, pos) and the group offsets [0, cumsum(sizes)] (reference.py). Expert
ids must lie in [0, E) (a router's top-k does). Pallas, Triton lowering; interpret mode on CPU for tests.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from orl_jax_kernels.pallas_args import triton_params

# Every program holds all the assignments' ids in registers: DiffusionGemma's canvas has 2048. Longer passes (training
# batches) take model/moe.sort_by_expert's XLA path.
MAX_ASSIGNMENTS = 1 << 13


def _kernel(e_ref, pos_ref, off_ref, *, m: int, total: int, num_experts: int):
    from jax.experimental.pallas import triton as plt

    e = pl.program_id(0)
    ids = e_ref[...]  # [M]
    hit = ids == e
    start = jnp.sum((ids < e).astype(jnp.int32))
    row = start + jnp.cumsum(hit.astype(jnp.int32)) - 1  # [M]: the sorted row of each of this expert's assignments
    plt.store(pos_ref.at[pl.ds(0, m)], row, mask=hit)
    off_ref[pl.ds(e, 1)] = jnp.full((1,), start, jnp.int32)

    @pl.when(e == num_experts - 1)
    def _():
        off_ref[pl.ds(num_experts, 1)] = jnp.full((1,), total, jnp.int32)


@functools.partial(jax.jit, static_argnames=("num_experts", "interpret"))
def expert_sort(experts: jax.Array, num_experts: int, interpret: bool = False):
    """experts [M] int32 in [0, E), M <= MAX_ASSIGNMENTS -> (order [M]: the assignment in each sorted row, pos [M]:
    the sorted row of each assignment, offsets [E + 1]: each expert's first row, then M)."""
    if experts.ndim != 1 or experts.dtype != jnp.int32:
        raise ValueError(f"expert_sort: experts must be a 1-D int32 array, got {experts.dtype}{list(experts.shape)}")
    m = experts.shape[0]
    mp = max(16, 1 << (m - 1).bit_length())  # Triton's vectors have power-of-two sizes: pad with id E, no expert's
    if mp > MAX_ASSIGNMENTS:
        raise ValueError(f"expert_sort: {m} assignments, more than MAX_ASSIGNMENTS={MAX_ASSIGNMENTS}")
    ids = jnp.pad(experts, (0, mp - m), constant_values=num_experts) if mp > m else experts
    vec = lambda n: jax.ShapeDtypeStruct((n,), jnp.int32)  # noqa: E731
    whole = lambda n: pl.BlockSpec((n,), lambda e: (0,))  # noqa: E731
    pos, offsets = pl.pallas_call(
        functools.partial(_kernel, m=mp, total=m, num_experts=num_experts),
        out_shape=(vec(mp), vec(num_experts + 1)),
        grid=(num_experts,),
        in_specs=[whole(mp)],
        out_specs=(whole(mp), whole(num_experts + 1)),
        interpret=interpret,
        **triton_params(4, 1, interpret),
    )(ids)
    pos = pos[:m]
    order = jnp.zeros_like(pos).at[pos].set(jnp.arange(m, dtype=jnp.int32), unique_indices=True)
    return order, pos, offsets
