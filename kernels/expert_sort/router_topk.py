"""The MoE router's top-k and its weights in one launch: each program takes a few tokens' logits.

Why: at DiffusionGemma's canvas the router's top-k runs on each MoE layer's dependency chain as five launches after
the router GEMM: the logits' float32 cast (2.1 us), XLA's top-k (a sort, 4.9), a conversion (2.2) and a slice (1.9)
of its outputs, and the weights' softmax and scale (1.7): 12.8 us per 26B layer in an H200 trace, 30 MoE layers per
forward (benchmarks/results/2026-12-03_dg_topk_sort_h200.md). Session 34's kernel that also sorted had every program
repeat all 256 tokens' top-k (78 us per layer); here each token's top-k is done once, by the program that owns it.

Two ways to pick, both exact and with jax.lax.top_k's order (descending, ties to the lower expert):
- "rounds" (default): k rounds of a row maximum (the lowest expert among equal maxima), each masking its choice out.
- "rank": every logit's rank in its row, rank_i = #{j: x_j > x_i, or x_j == x_i and j < i}, as one [R, E, E]
  comparison and a sum: no chain of dependent reductions. Logit i is chosen iff rank_i < k and lands in slot rank_i.
  Its [R, E, E] comparison spills registers at 4 rows and 4 warps (35 ms per 26B forward against ~14.7).
In the 26B forward on an H200, 1 token per program and 1 warp with "rounds" was the best measured
(benchmarks/results/2026-12-03_dg_router_topk_h200.md): the wrapper's defaults.
The weights are computed per logit and scattered to the slots with it: softmax over the chosen (float32; the row's
maximum is the rank-0 logit) times expert_scale, which lies along the same axis as the logits (no gather).

Semantics: model/moe.route after its logits: (softmax(top-k values) * expert_scale[experts], experts) (reference:
model/moe.topk_weights, route's XLA path). Triton's tensor sizes are powers of two: E is padded with -inf logits
(never chosen while k <= E), k with slots that stay empty and are sliced off, T with rows that are sliced off.
Pallas, Triton lowering; interpret mode on CPU for tests.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from orl_jax_kernels.pallas_args import pow2, triton_params

METHODS = ("rank", "rounds")


def _ranks(x):
    """x [R, E] -> each logit's place in its row's descending order, ties to the lower index: [R, E] int32."""
    e = x.shape[1]
    i = jax.lax.broadcasted_iota(jnp.int32, (1, e, e), 1)  # the logit ranked
    j = jax.lax.broadcasted_iota(jnp.int32, (1, e, e), 2)  # the logits it is compared with
    xi, xj = x[:, :, None], x[:, None, :]
    ahead = (xj > xi) | ((xj == xi) & (j < i))
    return jnp.sum(ahead.astype(jnp.int32), axis=2)


def _rounds_ranks(x, k: int):
    """The same ranks for the k chosen (others get k) by k rounds of a row maximum."""
    col = jax.lax.broadcasted_iota(jnp.int32, x.shape, 1)
    rank = jnp.full(x.shape, k, jnp.int32)
    for r in range(k):
        top = jnp.max(x, axis=1)
        i = jnp.min(jnp.where(x == top[:, None], col, x.shape[1]), axis=1)  # the lowest expert among equal maxima
        pick = col == i[:, None]
        rank = jnp.where(pick, r, rank)
        x = jnp.where(pick, -jnp.inf, x)
    return rank


def _router_topk_kernel(l_ref, s_ref, *refs, k: int, method: str, scaled: bool):
    r_ref, w_ref, e_ref = refs if scaled else (None, *refs)
    x = l_ref[...].astype(jnp.float32)  # [R, E]
    if scaled:  # the logits of folded weights times each token's norm factor (positive: the same choice)
        x = x * r_ref[...][:, None]
    e = x.shape[1]
    kp = w_ref.shape[1]
    rank = _ranks(x) if method == "rank" else _rounds_ranks(x, k)
    chosen = rank < k
    p = jnp.where(chosen, jnp.exp(x - jnp.max(x, axis=1, keepdims=True)), 0.0)  # the max is the rank-0 logit
    w = p / jnp.sum(p, axis=1, keepdims=True) * s_ref[...].astype(jnp.float32)[None, :]  # [R, E]
    slot = jnp.where(chosen, rank, kp)[:, :, None] == jax.lax.broadcasted_iota(jnp.int32, (1, 1, kp), 2)  # [R, E, kp]
    col = jax.lax.broadcasted_iota(jnp.int32, (1, e, 1), 1)
    e_ref[...] = jnp.sum(jnp.where(slot, col, 0), axis=1)
    w_ref[...] = jnp.sum(jnp.where(slot, w[:, :, None], 0.0), axis=1)


@functools.partial(jax.jit, static_argnames=("k", "rows", "method", "num_warps", "interpret"))
def router_topk(logits: jax.Array, expert_scale: jax.Array, k: int, rows: int = 1, method: str = "rounds",
                num_warps: int = 1, interpret: bool = False, row_scale: jax.Array | None = None):
    """logits [T, E] (any float dtype), expert_scale [E] -> (weights [T, k] float32, experts [T, k] int32), as
    model/moe.route computes them from its logits. rows: tokens per program (a power of two). row_scale [T] (> 0,
    float32): the logits are logits * row_scale[:, None] in float32 (a router whose input norm was folded into its
    weight: moe.route)."""
    if logits.ndim != 2 or expert_scale.shape != logits.shape[1:]:
        raise ValueError(f"router_topk: logits {logits.shape} and expert_scale {expert_scale.shape} do not match")
    if row_scale is not None and row_scale.shape != logits.shape[:1]:
        raise ValueError(f"router_topk: row_scale {row_scale.shape} does not match logits {logits.shape}")
    t, e = logits.shape
    if not isinstance(k, int) or not 1 <= k <= e:
        raise ValueError(f"router_topk: k={k!r} must be an int in [1, E={e}]")
    if not isinstance(rows, int) or rows < 1 or rows & (rows - 1):
        raise ValueError(f"router_topk: rows={rows!r} must be a power of two")
    if method not in METHODS:
        raise ValueError(f"router_topk: method={method!r} not in {METHODS}")
    n, kp, tp = pow2(e), pow2(k), -(-t // rows) * rows
    if (tp, n) != (t, e):
        logits = jnp.pad(logits, ((0, tp - t), (0, n - e)), constant_values=-jnp.inf)
        expert_scale = jnp.pad(expert_scale, (0, n - e))
    operands = [logits, expert_scale]
    specs = [pl.BlockSpec((rows, n), lambda i: (i, 0)), pl.BlockSpec((n,), lambda i: (0,))]
    if row_scale is not None:
        operands.append(jnp.pad(row_scale.astype(jnp.float32), (0, tp - t), constant_values=1.0))
        specs.append(pl.BlockSpec((rows,), lambda i: (i,)))
    out = lambda dt: jax.ShapeDtypeStruct((tp, kp), dt)  # noqa: E731
    weights, experts = pl.pallas_call(
        functools.partial(_router_topk_kernel, k=k, method=method, scaled=row_scale is not None),
        out_shape=(out(jnp.float32), out(jnp.int32)),
        grid=(tp // rows,),
        in_specs=specs,
        out_specs=(pl.BlockSpec((rows, kp), lambda i: (i, 0)),) * 2,
        interpret=interpret,
        name="router_topk",
        **triton_params(num_warps, 1, interpret),
    )(*operands)
    if (tp, kp) != (t, k):
        weights, experts = weights[:t, :k], experts[:t, :k]
    return weights, experts

