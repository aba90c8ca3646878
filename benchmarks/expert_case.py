"""The expert probes' shared case (l2_expert_prefix_probe, read_ceiling_probe, ncu_read_kernels): DiffusionGemma
26B's expert stacks with random bf16 weights and 256 tokens routed top-8 uniformly, sorted by expert as the MoE sorts
them; tiny shapes on a CPU (smoke runs in interpret mode)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from orl_jax.model import moe
from orl_jax_kernels.grouped_gemm.kernel import group_offsets

CPU = jax.default_backend() == "cpu"
E, T, TOPK, D, F = (4, 16, 2, 128, 64) if CPU else (128, 256, 8, 2816, 704)


def routed_case(layers: int, key=0) -> dict:
    """{x [T, D], rows [T * k] (each sorted row's token), offsets [E + 1], tiles (gate/up stack [layers, ...] in
    moe.fuse_gate_up's layout), down [layers, E, F, D]}."""
    ks = jax.random.split(jax.random.key(key), 4)
    experts = jax.lax.top_k(jax.random.normal(ks[0], (T, E)), TOPK)[1].reshape(-1)
    order = jnp.argsort(experts, stable=True)
    return dict(x=jax.random.normal(ks[1], (T, D), jnp.bfloat16), rows=(order // TOPK).astype(jnp.int32),
                offsets=group_offsets(jnp.bincount(experts, length=E)),
                tiles=moe.fuse_gate_up(jax.random.normal(ks[2], (layers, E, D, 2 * F), jnp.bfloat16) * 0.02),
                down=jax.random.normal(ks[3], (layers, E, F, D), jnp.bfloat16) * 0.02)


def experts(a: dict, layer, x=None) -> jax.Array:
    """The case's layer `layer` through moe.fused_expert_mlp (the model's settings); x: another input than a["x"]."""
    return moe.fused_expert_mlp(a["x"] if x is None else x, a["rows"], a["tiles"], a["down"], a["offsets"], layer,
                                "gelu_tanh")
