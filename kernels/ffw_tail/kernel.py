"""DiffusionGemma's feed-forward tail in one launch: the MoE's weighted sum of its sorted expert rows, the post-MLP,
post-MoE and post-FFW norms, the residual and the layer scalar,

    x' = (x + post_ffw_norm(post_mlp_norm(mlp) + post_moe_norm(sum_j w_j y[pos_j]))) * scalar.

Why: XLA runs this as two kernels per layer after the expert kernel: the gather-weighted sum (a loop fusion with a
float32 [T, D] output, ~9.4 us per 26B layer at canvas 256) and a block-level fusion of the norms (~4.2 us), both on
the critical path between one layer's experts and the next layer's attention (the profile in
benchmarks/results/2026-12-04_dg_ffw_tail_h200.md). One program per token row reads its k expert rows (written by
the expert kernel just before, mostly still in L2), the dense MLP's row and the residual once, and writes x'.

Semantics: reference.ffw_tail_reference (the model's cast order: the k products summed in float32 in choice order,
the MoE output rounded to x's dtype, each norm's weight multiplied in float32 before its cast). The mean over D is a
product with 1 / D, as XLA's GPU compiler makes it. D need not be a power of two: a row is loaded as the next power
of two with a mask (padded instead in interpret mode, where a masked store past the array is not dropped). Pallas,
Triton lowering; interpret mode on CPU for tests.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from orl_jax_kernels.pallas_args import pow2, triton_params


def _kernel(pos_ref, wt_ref, y_ref, mlp_ref, x_ref, wm_ref, we_ref, wf_ref, s_ref, o_ref, *, rows: int, t: int,
            k: int, d: int, eps: float):
    from jax.experimental.pallas import triton as plt

    f32, dt = jnp.float32, o_ref.dtype
    tok = pl.program_id(0) * rows + jnp.arange(rows)  # [R]
    cols = jnp.arange(pow2(d))
    live = tok < t
    mask = live[:, None] & (cols < d)[None, :]  # [R, DP]

    def row_load(ref, r):  # rows r [R] of a [., D] operand -> [R, DP] (0 past D)
        return plt.load(ref.at[r[:, None], cols[None, :]], mask=mask, other=0)

    def norm(v, w_ref):  # layers.rms_norm_fp32 of float32 rows [R, DP] -> dt
        inv = jax.lax.rsqrt(jnp.sum(v * v, axis=1, keepdims=True) * (1.0 / d) + eps)
        w = plt.load(w_ref.at[cols], mask=cols < d, other=0).astype(f32)[None, :]
        return (w * (v * inv)).astype(dt)

    moe = jnp.zeros((rows, cols.shape[0]), f32)
    for j in range(k):  # the choices in order, as the reference's sum
        at = tok * k + j
        p = plt.load(pos_ref.at[at], mask=live, other=0)
        wj = plt.load(wt_ref.at[at], mask=live, other=0)
        moe = moe + row_load(y_ref, p).astype(f32) * wj[:, None]
    ffw = norm(row_load(mlp_ref, tok).astype(f32), wm_ref) + norm(moe.astype(dt).astype(f32), we_ref)
    out = (row_load(x_ref, tok) + norm(ffw.astype(f32), wf_ref)) * s_ref[0].astype(dt)
    plt.store(o_ref.at[tok[:, None], cols[None, :]], out, mask=mask)


@functools.partial(jax.jit, static_argnames=("eps", "rows", "num_warps", "interpret"))
def ffw_tail(x: jax.Array, mlp: jax.Array, y: jax.Array, pos: jax.Array, weights: jax.Array,
             post_mlp_norm: jax.Array, post_moe_norm: jax.Array, post_ffw_norm: jax.Array, scalar: jax.Array,
             eps: float, rows: int = 1, num_warps: int = 4, interpret: bool = False) -> jax.Array:
    """x, mlp [T, D]; y [M, D] (the expert rows in sorted order); pos [T, k] int32 (each choice's row of y);
    weights [T, k] float32; the three norm weights [D]; scalar [1] -> [T, D] in x's dtype, equal to
    reference.ffw_tail_reference. rows: token rows per program (a power of two)."""
    t, d = x.shape
    k = pos.shape[1] if pos.ndim == 2 else 0
    if mlp.shape != (t, d) or y.ndim != 2 or y.shape[1] != d or pos.shape != (t, k) or weights.shape != (t, k):
        raise ValueError(f"ffw_tail: x {x.shape}, mlp {mlp.shape}, y {y.shape}, pos {pos.shape} and weights "
                         f"{weights.shape} do not match")
    if any(w.shape != (d,) for w in (post_mlp_norm, post_moe_norm, post_ffw_norm)) or scalar.shape != (1,):
        raise ValueError(f"ffw_tail: norms {post_mlp_norm.shape}, {post_moe_norm.shape}, {post_ffw_norm.shape} "
                         f"(want ({d},)) and scalar {scalar.shape} (want (1,))")
    if pos.dtype != jnp.int32 or rows < 1 or rows & (rows - 1):
        raise ValueError(f"ffw_tail: pos must be int32 (got {pos.dtype}) and rows a power of two (got {rows})")
    pad = pow2(d) - d if interpret else 0
    wide = (lambda a: jnp.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, pad)])) if pad else (lambda a: a)  # noqa: E731
    operands = (pos.reshape(-1), weights.reshape(-1).astype(jnp.float32), wide(y), wide(mlp), wide(x),
                wide(post_mlp_norm), wide(post_moe_norm), wide(post_ffw_norm), scalar)
    whole = lambda a: pl.BlockSpec(a.shape, lambda i, n=a.ndim: (0,) * n)  # noqa: E731
    out = pl.pallas_call(
        functools.partial(_kernel, rows=rows, t=t, k=k, d=d, eps=eps),
        out_shape=jax.ShapeDtypeStruct((t, d + pad), x.dtype),
        grid=(pl.cdiv(t, rows),),
        in_specs=[whole(a) for a in operands],
        out_specs=pl.BlockSpec((t, d + pad), lambda i: (0, 0)),
        interpret=interpret,
        **triton_params(num_warps, 1, interpret),
    )(*operands)
    return out[:, :d] if pad else out
