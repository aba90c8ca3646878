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
program, so every element of `pos` is written once. The same program also scatters the inverse permutation: at
each of its rows, the assignment it holds divided by k (with k = the router's top-k: the token whose row of x the
gate/up kernel gathers). Before, that was an XLA scatter plus an index normalization and a division after the
kernel: four ~1.5 us launches per 26B layer between the sort and the expert GEMM. Lanes of other experts aim their
(masked) scatter at the first row past this expert's (mod M), never at one of its rows: interpret mode writes masked
lanes too (their old value back, harmless unless an unmasked lane shares the index).

Semantics: model/moe.sort_by_expert's (order // k, pos) and the group offsets [0, cumsum(sizes)] (reference.py).
Expert ids must lie in [0, E) (a router's top-k does). Pallas, Triton lowering; interpret mode on CPU for tests.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from orl_jax_kernels.pallas_args import pow2, triton_params

# Every program holds all the assignments' ids in registers: DiffusionGemma's canvas has 2048. Longer passes (training
# batches) take model/moe.sort_by_expert's XLA path.
MAX_ASSIGNMENTS = 1 << 13


def _kernel(e_ref, pos_ref, off_ref, src_ref, *, m: int, total: int, num_experts: int, k: int):
    from jax.experimental.pallas import triton as plt

    e = pl.program_id(0)
    ids = e_ref[...]  # [M]
    hit = ids == e
    start = jnp.sum((ids < e).astype(jnp.int32))
    row = start + jnp.cumsum(hit.astype(jnp.int32)) - 1  # [M]: the sorted row of each of this expert's assignments
    plt.store(pos_ref.at[pl.ds(0, m)], row, mask=hit)
    # the inverse: row -> assignment // k; other experts' lanes aim at a row outside this expert's (see above)
    past = (start + jnp.sum(hit.astype(jnp.int32))) % m
    plt.store(src_ref.at[jnp.where(hit, row, past)], jnp.arange(m, dtype=jnp.int32) // k, mask=hit)
    _offsets(off_ref, e, start, total, num_experts)


def _offsets(off_ref, e, start, total: int, num_experts: int):
    """offsets[e] = expert e's first row; the last program also writes offsets[E] = the number of assignments."""
    off_ref[pl.ds(e, 1)] = jnp.full((1,), start, jnp.int32)

    @pl.when(e == num_experts - 1)
    def _():
        off_ref[pl.ds(num_experts, 1)] = jnp.full((1,), total, jnp.int32)


def _token_kernel(e_ref, pos_ref, off_ref, src_ref, *, m: int, num_experts: int):
    """by_token: ids [T, k] whose rows hold distinct experts. A token holds at most one of expert e's assignments, so
    their ranks are a cumsum over the T tokens instead of the T * k assignments, and the token is the row's source."""
    from jax.experimental.pallas import triton as plt

    e = pl.program_id(0)
    ids = e_ref[...]  # [T, k]
    hit = ids == e
    start = jnp.sum((ids < e).astype(jnp.int32))
    token_hit = jnp.sum(hit.astype(jnp.int32), axis=1)  # [T]: 0 or 1
    row = start + jnp.cumsum(token_hit) - 1  # [T]: the sorted row of each of this expert's tokens
    plt.store(pos_ref, jnp.broadcast_to(row[:, None], ids.shape), mask=hit)
    past = (start + jnp.sum(token_hit)) % m  # as in _kernel: other tokens' lanes aim outside this expert's rows
    has = token_hit > 0
    plt.store(src_ref.at[jnp.where(has, row, past)], jax.lax.broadcasted_iota(jnp.int32, row.shape, 0), mask=has)
    _offsets(off_ref, e, start, m, num_experts)


@functools.partial(jax.jit, static_argnames=("num_experts", "k", "by_token", "interpret"))
def expert_sort(experts: jax.Array, num_experts: int, k: int = 1, by_token: bool = False, interpret: bool = False):
    """experts [M] int32 in [0, E), M <= MAX_ASSIGNMENTS -> (source [M]: the assignment in each sorted row divided by
    k (k = choices per token: the row's token; k = 1: the assignment), pos [M]: the sorted row of each assignment,
    offsets [E + 1]: each expert's first row, then M). by_token: the M / k tokens' k choices are distinct experts (a
    router's top-k): ranks counted over the tokens (`_token_kernel`), the same results."""
    if experts.ndim != 1 or experts.dtype != jnp.int32:
        raise ValueError(f"expert_sort: experts must be a 1-D int32 array, got {experts.dtype}{list(experts.shape)}")
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"expert_sort: k must be a positive int, got {k!r}")
    m = experts.shape[0]
    if by_token:
        return _by_token(experts, num_experts, k, interpret)
    mp = pow2(m, 16)  # Triton's vectors have power-of-two sizes: pad with id E, no expert's
    if mp > MAX_ASSIGNMENTS:
        raise ValueError(f"expert_sort: {m} assignments, more than MAX_ASSIGNMENTS={MAX_ASSIGNMENTS}")
    ids = jnp.pad(experts, (0, mp - m), constant_values=num_experts) if mp > m else experts
    vec = lambda n: jax.ShapeDtypeStruct((n,), jnp.int32)  # noqa: E731
    whole = lambda n: pl.BlockSpec((n,), lambda e: (0,))  # noqa: E731
    pos, offsets, source = pl.pallas_call(
        functools.partial(_kernel, m=mp, total=m, num_experts=num_experts, k=k),
        out_shape=(vec(mp), vec(num_experts + 1), vec(mp)),
        grid=(num_experts,),
        in_specs=[whole(mp)],
        out_specs=(whole(mp), whole(num_experts + 1), whole(mp)),
        interpret=interpret,
        **triton_params(4, 1, interpret),
    )(ids)
    return source[:m], pos[:m], offsets


def _token_tile(t: int, k: int) -> tuple[int, int]:
    """by_token's [T, k] ids padded to powers of two (with id E, no expert's)."""
    return pow2(t, 16), pow2(k)


def by_token_fits(tokens: int, k: int) -> bool:
    """Whether expert_sort(by_token=True) takes `tokens` tokens of k choices."""
    tp, kp = _token_tile(tokens, k)
    return tp * kp <= MAX_ASSIGNMENTS


def _by_token(experts: jax.Array, num_experts: int, k: int, interpret: bool):
    m = experts.shape[0]
    if m % k:
        raise ValueError(f"expert_sort: by_token needs M={m} a multiple of k={k}")
    t = m // k
    tp, kp = _token_tile(t, k)
    if not by_token_fits(t, k):
        raise ValueError(f"expert_sort: {t} tokens x {k} (padded {tp} x {kp}), "
                         f"more than MAX_ASSIGNMENTS={MAX_ASSIGNMENTS}")
    ids = experts.reshape(t, k)
    if (tp, kp) != (t, k):
        ids = jnp.pad(ids, ((0, tp - t), (0, kp - k)), constant_values=num_experts)
    mp = pow2(m, 16)
    whole = lambda *n: pl.BlockSpec(n, lambda e: (0,) * len(n))  # noqa: E731
    pos, offsets, source = pl.pallas_call(
        functools.partial(_token_kernel, m=m, num_experts=num_experts),
        out_shape=(jax.ShapeDtypeStruct((tp, kp), jnp.int32), jax.ShapeDtypeStruct((num_experts + 1,), jnp.int32),
                   jax.ShapeDtypeStruct((mp,), jnp.int32)),
        grid=(num_experts,),
        in_specs=[whole(tp, kp)],
        out_specs=(whole(tp, kp), whole(num_experts + 1), whole(mp)),
        interpret=interpret,
        name="expert_sort_by_token",
        **triton_params(4, 1, interpret),
    )(ids)
    pos = pos[:t, :k] if (tp, kp) != (t, k) else pos
    return (source[:m] if mp > m else source), pos.reshape(-1), offsets
