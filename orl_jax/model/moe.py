"""Mixture of experts: a softmax top-k router and expert MLPs that run only on the tokens routed to them.

Dispatch: the T tokens x top-k choices are sorted by expert into M = T * k rows, so each expert's rows are
contiguous; `grouped_matmul` multiplies each contiguous group by its own expert's matrix (`jax.lax.ragged_dot`),
the rows are weighted, put back in token order and summed over the k choices. Nothing is dropped (no capacity
factor), so the result equals the reference loop over experts.

Note on lowering: `ragged_dot` states "each row times its own group's matrix". On GPU and TPU jax emits XLA's
ragged-dot instruction (how it runs is the backend's choice); on CPU jax's generic lowering expands it into a
dense masked product over all experts, which is fine for the tiny test models only. A Pallas grouped GEMM can
replace `grouped_matmul` without touching the model: a weight type with a `ragged_dot` method plugs in here, as
quantized weights do in layers.einsum.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from orl_jax.model.layers import ACTIVATIONS, einsum, rms_norm_fp32


def route(x: jax.Array, scale: jax.Array, proj, expert_scale: jax.Array, top_k: int, eps: float):
    """Gemma 4 router. x [T, D] -> (weights [T, k] float32, experts [T, k] int32).

    RMSNorm without weight, times `scale` [D] and D^-1/2 -> logits over E -> softmax (float32) -> top-k ->
    renormalized to sum 1 -> times the chosen experts' `expert_scale` [E].
    """
    h = rms_norm_fp32(x, None, eps) * scale.astype(x.dtype)[None] * (x.shape[-1] ** -0.5)
    probs = jax.nn.softmax(einsum("td,de->te", h, proj).astype(jnp.float32), axis=-1)  # [T, E]
    w, e = jax.lax.top_k(probs, top_k)  # [T, k]
    w = w / jnp.sum(w, axis=-1, keepdims=True)
    return w * jnp.take(expert_scale, e).astype(jnp.float32), e.astype(jnp.int32)


def grouped_matmul(x: jax.Array, w, group_sizes: jax.Array) -> jax.Array:
    """x [M, K] whose rows come in contiguous groups (sizes [E]) times w [E, K, N]: row r of group e gets x_r @ w_e."""
    if hasattr(w, "ragged_dot"):
        return w.ragged_dot(x, group_sizes)
    return jax.lax.ragged_dot(x, w.astype(x.dtype), group_sizes, preferred_element_type=jnp.float32).astype(x.dtype)


# Up to this many tokens, every token runs through every expert and the unchosen results get weight 0. Exact, and
# on an H200 far faster than XLA's ragged_dot at decode sizes: at DiffusionGemma's canvas (256 tokens x top-8,
# 128 experts) ragged_dot took 3.2 ms per gate/up product vs 0.7 ms for the dense product over all experts
# (benchmarks/ragged_dot_probe.py), because XLA's GPU ragged_dot does not skip unused groups' work. A grouped-GEMM
# kernel that reads each expert once and computes only its rows is the real fix.
DENSE_MAX_TOKENS = 512


def experts_mlp(x: jax.Array, weights: jax.Array, experts: jax.Array, gate_up, down, act: str) -> jax.Array:
    """sum_j weights[t, j] * MLP_{experts[t, j]}(x_t). x [T, D]; gate_up [E, D, 2F] (gate | up); down [E, F, D]."""
    if experts.shape[0] <= DENSE_MAX_TOKENS:
        return dense_experts_mlp(x, weights, experts, gate_up, down, act)
    return grouped_experts_mlp(x, weights, experts, gate_up, down, act)


def dense_experts_mlp(x, weights, experts, gate_up, down, act: str) -> jax.Array:
    """Every token through every expert; the routing weights (0 for unchosen experts) scale the down input."""
    t, k = experts.shape
    w = jnp.zeros((t, gate_up.shape[0]), jnp.float32).at[jnp.arange(t)[:, None], experts].add(weights)  # [T, E]
    gu = einsum("td,edf->tef", x, gate_up)  # [T, E, 2F]
    g, u = jnp.split(gu, 2, axis=-1)
    h = (ACTIVATIONS[act](g) * u).astype(jnp.float32) * w[..., None]  # [T, E, F]
    return einsum("tef,efd->td", h.astype(x.dtype), down)  # [T, D]


def grouped_experts_mlp(x, weights, experts, gate_up, down, act: str) -> jax.Array:
    """Rows sorted by expert and multiplied group by group (`grouped_matmul`): work proportional to T * k."""
    t, k = experts.shape
    num_experts = gate_up.shape[0]
    flat = experts.reshape(-1)  # [M]
    order = jnp.argsort(flat, stable=True)  # [M]: (token, choice) pairs grouped by expert
    sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)  # [E]
    xs = jnp.take(x, order // k, axis=0)  # [M, D]
    gu = grouped_matmul(xs, gate_up, sizes)  # [M, 2F]
    g, u = jnp.split(gu, 2, axis=-1)
    y = grouped_matmul(ACTIVATIONS[act](g) * u, down, sizes)  # [M, D]
    y = y.astype(jnp.float32) * jnp.take(weights.reshape(-1), order)[:, None]
    y = jnp.zeros_like(y).at[order].set(y)  # back to (token, choice) order
    return jnp.sum(y.reshape(t, k, -1), axis=1).astype(x.dtype)  # [T, D]
