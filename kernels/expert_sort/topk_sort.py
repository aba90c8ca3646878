"""The router's top-k, its softmax over the k chosen and the counting sort of the assignments, in one launch.

Why: at DiffusionGemma's canvas the MoE's routing between the router GEMM and the first expert kernel ran as six
launches on the layer's dependency chain: the logits' float32 cast, XLA's top-k (a sort, 4.9 us), a conversion and
a slice of its outputs, kernels/expert_sort (7.5 us) and the weights' softmax and scale: 22 us per 26B layer from
the router GEMM's end to the gate/up experts' start in an H200 trace, 30 MoE layers per forward
(benchmarks/results/2026-12-03_dg_topk_sort_h200.md). Every launch on that chain costs ~1.2-2 us before it does
anything (benchmarks/results/2026-12-03_engine_launch_tax_h200.md).

Here each program takes the whole [T, E] logits (64 KB at the 26B's 256 x 128 in bf16, from L2) and picks every
token's top k itself, by k rounds of a row maximum (ties: the lowest expert, as jax.lax.top_k), in chunks of rows;
the programs repeat that work rather than wait for each other. Program p then sorts for its experts as
kernels/expert_sort does: an expert's first row is the number of assignments to lower experts, its assignments'
ranks a cumsum over the tokens (a token chooses an expert at most once), so (token, choice) order is kept (stable).
Program 0 also writes the weights: a float32 softmax over each token's k chosen logits times the chosen experts'
scale (model/moe.route's order: top-k of the logits, then the softmax over those k).

Semantics: model/moe.route's top-k of `logits` then kernels/expert_sort's (tokens, pos, offsets) of the choices
(reference: `topk_sort_reference`). Triton's tensor sizes are powers of two: E is padded with experts whose logit
is -inf (never chosen) and k with choices that take no expert and weigh 0. T * k <= MAX_ASSIGNMENTS. Pallas, Triton
lowering; interpret mode on CPU for tests.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from orl_jax_kernels.expert_sort.kernel import MAX_ASSIGNMENTS
from orl_jax_kernels.pallas_args import triton_params

ROWS = 64  # tokens per chunk of the top-k: [64, 128] float32 logits over 8 warps, 32 values a thread
MAX_TOKENS = 1024  # the chunks' choices stay in registers until the sort: 16 chunks at most


def supported(tokens: int, num_experts: int, k: int) -> bool:
    return 1 <= k <= num_experts and 0 < tokens <= MAX_TOKENS and tokens * k <= MAX_ASSIGNMENTS


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def _topk_sort_kernel(l_ref, es_ref, w_ref, e_ref, pos_ref, off_ref, src_ref, *, t: int, k: int, per_program: int):
    from jax.experimental.pallas import triton as plt

    n, kp = l_ref.shape[1], e_ref.shape[1]  # experts and choices, padded to powers of two
    m = t * k
    pid, last = pl.program_id(0), pl.num_programs(0) - 1  # read here: interpret mode has no program_id in a loop
    col = jax.lax.broadcasted_iota(jnp.int32, (ROWS, n), 1)
    kcol = jax.lax.broadcasted_iota(jnp.int32, (ROWS, kp), 1)
    chunks = []
    for c in range(-(-t // ROWS)):  # every token's top k, a chunk of rows at a time
        rows = c * ROWS + jax.lax.broadcasted_iota(jnp.int32, (ROWS,), 0)
        live = rows < t
        logit = plt.load(l_ref.at[pl.ds(c * ROWS, ROWS), :], mask=live[:, None], other=0).astype(jnp.float32)
        ids, vals = jnp.full((ROWS, kp), n, jnp.int32), jnp.full((ROWS, kp), -jnp.inf, jnp.float32)
        for r in range(k):  # choices past k keep no expert and a -inf logit: weight 0
            top = jnp.max(logit, axis=1)
            i = jnp.min(jnp.where(logit == top[:, None], col, n), axis=1)  # the lowest expert among equal maxima
            ids, vals = jnp.where(kcol == r, i[:, None], ids), jnp.where(kcol == r, top[:, None], vals)
            logit = jnp.where(col == i[:, None], -jnp.inf, logit)
        chunks.append((c, rows, live, jnp.where(live[:, None], ids, n), vals))

    @pl.when(pid == 0)
    def _weights():
        for c, _, live, ids, vals in chunks:
            p = jnp.exp(vals - vals.max(axis=1, keepdims=True))  # vals[:, 0] is the maximum; as jax.nn.softmax
            p = p / jnp.sum(p, axis=1, keepdims=True)
            scale = plt.load(es_ref.at[jnp.minimum(ids, n - 1)]).astype(jnp.float32)
            plt.store(w_ref.at[pl.ds(c * ROWS, ROWS), :], p * scale, mask=live[:, None])
            plt.store(e_ref.at[pl.ds(c * ROWS, ROWS), :], ids, mask=live[:, None])

    def sort_expert(j, carry):  # kernels/expert_sort for expert e, over the chunks' choices
        e = pid * per_program + j
        start = sum(jnp.sum((ids < e).astype(jnp.int32)) for _, _, _, ids, _ in chunks)
        count = sum(jnp.sum((ids == e).astype(jnp.int32)) for _, _, _, ids, _ in chunks)
        past = (start + count) % m  # where lanes of other experts aim their masked scatter (kernels/expert_sort)
        run = start
        for c, rows, _, ids, _ in chunks:
            hit = ids == e  # [ROWS, k], at most one per row
            row_hit = jnp.sum(hit.astype(jnp.int32), axis=1)
            dest = jnp.broadcast_to((run + jnp.cumsum(row_hit) - 1)[:, None], (ROWS, kp))
            plt.store(pos_ref.at[pl.ds(c * ROWS, ROWS), :], dest, mask=hit)
            plt.store(src_ref.at[jnp.where(hit, dest, past)], jnp.broadcast_to(rows[:, None], (ROWS, kp)), mask=hit)
            run = run + jnp.sum(row_hit)
        off_ref[pl.ds(e, 1)] = jnp.full((1,), start, jnp.int32)
        return carry

    jax.lax.fori_loop(0, per_program, sort_expert, 0)

    @pl.when(pid == last)
    def _():
        off_ref[pl.ds(n, 1)] = jnp.full((1,), m, jnp.int32)


@functools.partial(jax.jit, static_argnames=("k", "per_program", "interpret"))
def topk_sort(logits: jax.Array, expert_scale: jax.Array, k: int, per_program: int = 4, interpret: bool = False):
    """logits [T, E] (any float dtype), expert_scale [E] -> (weights [T, k] float32, experts [T, k] int32,
    tokens [T * k]: the token of each sorted row, pos [T * k]: the sorted row of each (token, choice), offsets
    [E + 1]: each expert's first row, then T * k). per_program: experts sorted by each program (E / per_program
    programs, each repeating the top-k)."""
    if logits.ndim != 2 or expert_scale.shape != logits.shape[1:]:
        raise ValueError(f"topk_sort: logits {logits.shape} and expert_scale {expert_scale.shape} do not match")
    t, e = logits.shape
    if not isinstance(k, int) or not supported(t, e, k):
        raise ValueError(f"topk_sort: T={t}, E={e}, k={k!r} not supported (1 <= k <= E, T <= {MAX_TOKENS}, "
                         f"T * k <= {MAX_ASSIGNMENTS})")
    n, kp = _pow2(e), _pow2(k)
    if per_program < 1 or n % per_program:
        raise ValueError(f"topk_sort: per_program={per_program} does not divide E={e} padded to {n}")
    tp = -(-t // ROWS) * ROWS  # whole chunks: the rows past T are masked
    m = t * k
    if (tp, n) != (t, e):  # padded experts never win a row's maximum
        logits = jnp.pad(logits, ((0, tp - t), (0, n - e)), constant_values=-jnp.inf)
        expert_scale = jnp.pad(expert_scale, (0, n - e))
    whole = lambda *s: pl.BlockSpec(s, lambda p: (0,) * len(s))  # noqa: E731
    mat = lambda dt: jax.ShapeDtypeStruct((tp, kp), dt)  # noqa: E731
    vec = lambda size: jax.ShapeDtypeStruct((size,), jnp.int32)  # noqa: E731
    weights, experts, pos, offsets, tokens = pl.pallas_call(
        functools.partial(_topk_sort_kernel, t=t, k=k, per_program=per_program),
        out_shape=(mat(jnp.float32), mat(jnp.int32), mat(jnp.int32), vec(n + 1), vec(m)),
        grid=(n // per_program,),
        in_specs=[whole(tp, n), whole(n)],
        out_specs=(whole(tp, kp), whole(tp, kp), whole(tp, kp), whole(n + 1), whole(m)),
        interpret=interpret,
        **triton_params(8, 1, interpret),
    )(logits, expert_scale)
    return weights[:t, :k], experts[:t, :k], tokens, pos[:t, :k].reshape(-1), offsets[:e + 1]


def topk_sort_reference(logits, expert_scale, k: int):
    """model/moe.route's top-k and weights on the logits, then kernels/expert_sort's reference sort."""
    from orl_jax_kernels.expert_sort.reference import expert_sort_reference

    top, experts = jax.lax.top_k(logits.astype(jnp.float32), k)
    experts = experts.astype(jnp.int32)
    weights = jax.nn.softmax(top, axis=-1) * expert_scale[experts].astype(jnp.float32)
    tokens, pos, offsets = expert_sort_reference(experts.reshape(-1), logits.shape[1], k)
    return weights, experts, tokens, pos, offsets
