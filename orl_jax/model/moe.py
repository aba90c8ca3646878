"""Mixture of experts: a softmax top-k router and expert MLPs that run only on the tokens routed to them.

Dispatch, by size (experts_mlp); every path is exact (nothing is dropped) and equals the reference loop:
- decode sizes (T <= BUCKETED_MAX_TOKENS): bucketed. Each expert gathers its routed tokens into `capacity` slots and
  one batched product per projection runs [E, C, D] x [E, D, 2F]: every expert's weights are read once and the work
  is E x C rows instead of E x T. An expert routed more tokens than it has slots takes the rest in further rounds
  of C slots (a `while_loop` that runs no trip unless some expert overflows; on GPU its predicate is one small
  device-to-host copy per MoE layer);
- moe_impl "pallas" (the GPU default): at any size the T * k rows sorted by expert go through kernels/grouped_gemm,
  one program per (expert, column tile) reading its expert's weights in place once, only the routed rows
  loaded: no buckets, no rounds, no data-dependent loop. It replaced "pallas_bucketed" (the buckets through
  kernels/small_m_gemm): 22.7 against 29.9 ms per 26B forward (benchmarks/results/2026-11-30_dg_in_place_h200x2.md).
  With the gate/up stack in `fuse_gate_up`'s layout (inference), the whole expert MLP is one launch
  (kernels/grouped_gemm/mlp.py): ~-0.2 ms per 26B forward (benchmarks/results/2026-12-04_dg_fused_expert_mlp_h200.md);
- larger T: the T * k assignments are sorted by expert into contiguous rows and `grouped_matmul` multiplies each
  group by its own expert's matrix (`jax.lax.ragged_dot`); rows are weighted, put back in token order and summed.

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
from orl_jax.model.layerwise import map_layers
from orl_jax.model.streamed import StackedWeight, as_stacked, xla_ragged_dot

ROUTER_TOPK_F32 = True  # read at trace time; see route


# The pallas path (route(kernel=True)) picks the top-k and computes the weights with kernels/expert_sort/router_topk:
# one launch after the router GEMM instead of XLA's cast, top-k (a sort), conversion, slice and the weights' fusion.
# Read at trace time; ROUTER_TOPK_ROWS / _METHOD / _WARPS are the kernel's settings (benchmarks' sweeps set them).
# On an H200, with EXPERT_SORT_BY_TOKEN, the 26B forward took 14.729 ms against 14.841-14.885 with XLA's top-k and the
# per-assignment sort, alternating in one process; 14.636 / 14.651 against 14.785 / 14.761 on a second machine;
# rank / 2 rows / 2 warps 14.649 against 14.728-14.756 on a third; rank at 4 rows / 4 warps spills: 35 ms
# (benchmarks/results/2026-12-03_dg_router_topk_h200.md).
ROUTER_TOPK_KERNEL = True
ROUTER_TOPK_ROWS = 1
ROUTER_TOPK_METHOD = "rounds"
ROUTER_TOPK_WARPS = 1


def route(x: jax.Array, scale: jax.Array | None, proj, expert_scale: jax.Array, top_k: int, eps: float,
          kernel: bool = False, row_scale: jax.Array | None = None):
    """Gemma 4 router. x [T, D] -> (weights [T, k] float32, experts [T, k] int32).

    RMSNorm without weight, times `scale` [D] and D^-1/2 -> logits over E -> softmax (float32) -> top-k ->
    renormalized to sum 1 -> times the chosen experts' `expert_scale` [E].

    Computed as top-k of the logits, then a softmax over those k in float32: the same choice (softmax is monotonic)
    and the same weights (the renormalization cancels the softmax's denominator over E), without the [T, E]
    softmax pass on the MoE's serial routing chain (5.6 us per 26B layer on an H200). ROUTER_TOPK_F32 = False runs
    the top-k on the logits in their own dtype (bf16 values are exact in float32: the same order, ties and weights;
    tested), without the [T, E] cast kernel before XLA's sort (2.0 us per 26B layer in the profile). Timed in the 26B
    forward on an H200 (benchmarks/dg_router_topk_dtype_sweep.json): 15.589 / 15.602 against 15.605 / 15.590 ms,
    equal, so the measured float32 cast stays (2026-12-01_dg_attention_order_h200.md).
    kernel (moe_impl "pallas", not differentiable, as its expert kernels are not): with ROUTER_TOPK_KERNEL the top-k
    and weights from the logits in one kernel, the same values (experts exact, weights to float32 rounding).
    scale None: a folded router (diffusion_gemma_inference.fold_ffw_norms: scale and D^-1/2 are in proj), x
    unnormed and row_scale [T] its tokens' rsqrt(mean(x^2) + eps) in float32: logits = (x @ proj) * row_scale, the
    same up to rounding (the kernel applies row_scale itself).
    """
    if (scale is None) != (row_scale is not None):
        raise ValueError("route: a folded router (scale None) takes row_scale, an unfolded one does not")
    h = x if scale is None else rms_norm_fp32(x, None, eps) * scale.astype(x.dtype)[None] * (x.shape[-1] ** -0.5)
    logits = einsum("td,de->te", h, proj)
    if kernel and ROUTER_TOPK_KERNEL:
        from orl_jax_kernels.expert_sort.router_topk import router_topk

        return router_topk(logits, expert_scale, top_k, ROUTER_TOPK_ROWS, ROUTER_TOPK_METHOD, ROUTER_TOPK_WARPS,
                           interpret=jax.default_backend() == "cpu", row_scale=row_scale)
    if row_scale is not None:
        logits = logits.astype(jnp.float32) * row_scale[:, None]
    return topk_weights(logits, expert_scale, top_k)


def topk_weights(logits: jax.Array, expert_scale: jax.Array, top_k: int):
    """route's XLA path from its logits [T, E]: (softmax over the top-k logits (float32) times the chosen experts'
    expert_scale [T, k], experts [T, k] int32); also the router_topk kernel's oracle."""
    top, e = jax.lax.top_k(logits.astype(jnp.float32) if ROUTER_TOPK_F32 else logits, top_k)  # [T, k]
    e = e.astype(jnp.int32)
    w = jax.nn.softmax(top.astype(jnp.float32), axis=-1)
    return w * in_bounds_take(expert_scale, e).astype(jnp.float32), e


def in_bounds_take(a: jax.Array, idx: jax.Array) -> jax.Array:
    """a[idx] along axis 0 for indices known to lie in [0, len(a)): a bare gather, without jnp.take's
    negative-index select and out-of-bounds fill (each a small kernel of its own when the index comes from a
    custom call)."""
    return a.at[idx.astype(jnp.uint32)].get(mode="promise_in_bounds")


def grouped_matmul(x: jax.Array, w, group_sizes: jax.Array, offsets: jax.Array | None = None,
                   rows: jax.Array | None = None) -> jax.Array:
    """x [M, K] whose rows come in contiguous groups (sizes [E]) times w [E, K, N]: row r of group e gets x_r @ w_e.
    offsets [E + 1] (the groups' first rows, then their end), when known, spare the grouped kernel their cumsum.
    rows [M]: sorted row r is x[rows[r]] (x then has any number of rows)."""
    if hasattr(w, "ragged_dot"):
        return w.ragged_dot(x, group_sizes, offsets, rows=rows)
    return xla_ragged_dot(x, w, group_sizes, rows=rows)


# Up to this many tokens the experts run bucketed: each expert gathers its routed tokens into `capacity` slots and
# one batched product per projection reads every expert's weights once. Exact: an expert with more tokens than
# slots takes them in further rounds. On an H200, XLA's GPU ragged_dot took 3.2 ms per gate/up product at
# DiffusionGemma's canvas (256 tokens x top-8, 128 experts) against 0.7 ms for the dense product
# (benchmarks/ragged_dot_probe.py): it does not skip unused groups' work. Bucketing at 4x the mean load computes 4x
# less than dense at that size. The overflow used to take the dense path: with random weights 4 of the 5 full
# layers of DiffusionGemma 26B did, each copying its 1.5 GB of experts for XLA's GEMMs and computing every expert on
# every token, ~1.4 ms per layer (benchmarks/results/2026-11-30_dg_profile_h200x2.md).
BUCKETED_MAX_TOKENS = 512
CAPACITY_FACTOR = 4


def capacity(tokens: int, top_k: int, num_experts: int) -> int:
    """Slots per expert: CAPACITY_FACTOR x the mean load, a multiple of 8, at most all tokens."""
    mean = -(-tokens * top_k // num_experts)
    return min(tokens, max(8, -(-CAPACITY_FACTOR * mean // 8) * 8))


def experts_mlp(x: jax.Array, weights: jax.Array, experts: jax.Array, gate_up, down, act: str,
                impl: str = "bucketed", distinct: bool = False, row_scale: jax.Array | None = None) -> jax.Array:
    """sum_j weights[t, j] * MLP_{experts[t, j]}(x_t). x [T, D]; gate_up [E, D, 2F] (gate | up); down [E, F, D].
    impl (decode sizes): "bucketed", "dense" or "pallas" (the sorted rows through kernels/grouped_gemm, any T, no
    buckets). See the module docstring. distinct: each token's k experts differ (a top-k router's): the pallas path
    may then sort by token (EXPERT_SORT_BY_TOKEN). row_scale [T] float32: the experts' input is x * row_scale[:, None]
    (diffusion_gemma_inference.fold_ffw_norms: an unnormed x, its norm's weight folded into gate_up); the
    one-launch kernel scales its gate/up products instead, every other path x first."""
    t, k = experts.shape
    if fused_stack(gate_up) and impl != "pallas":
        raise ValueError(f"experts_mlp: gate_up in fuse_gate_up's layout takes impl 'pallas', got impl={impl!r}")
    if row_scale is not None and not (impl == "pallas" and fused_stack(gate_up)):
        x, row_scale = (x.astype(jnp.float32) * row_scale[:, None]).astype(x.dtype), None
    if impl == "pallas":  # expert stacks as StackedWeight: their ragged_dot is the grouped kernel
        return grouped_experts_mlp(x, weights, experts, as_stacked(gate_up), as_stacked(down), act,
                                   sort_kernel=SORT_KERNEL, by_token=distinct and EXPERT_SORT_BY_TOKEN,
                                   row_scale=row_scale)
    if t > BUCKETED_MAX_TOKENS:
        return grouped_experts_mlp(x, weights, experts, gate_up, down, act)
    c = capacity(t, k, gate_up.shape[0])
    if impl == "dense" or c >= t:  # every expert could take every token: bucketing saves nothing
        return dense_experts_mlp(x, weights, experts, gate_up, down, act)
    return bucketed_experts_mlp(x, weights, experts, gate_up, down, act, c)


def bucketed_experts_mlp(x, weights, experts, gate_up, down, act: str, capacity: int) -> jax.Array:
    """Each expert's routed tokens in `capacity` slots ([E, C, D]), one batched product per projection (XLA's
    einsum over every expert). Exact for any load: round r holds the assignments of rank r*C .. r*C + C - 1 within
    their expert, and rounds after the first run only when some expert has more than C tokens (a while_loop: not
    reverse-differentiable; training passes are longer than BUCKETED_MAX_TOKENS and take grouped_experts_mlp)."""
    t, k = experts.shape
    num_experts = gate_up.shape[0]
    flat = experts.reshape(-1)  # [M]: the (token, choice) assignments
    m = flat.shape[0]
    _, pos, sizes = sort_by_expert(experts, num_experts)
    rank = pos - (jnp.cumsum(sizes) - sizes)[flat]  # [M]: place in its expert's queue
    xz = jnp.concatenate([x, jnp.zeros_like(x[:1])])  # row t: the empty slots' all-zero input
    mm = lambda a, w: einsum("ecd,edf->ecf", a, w)  # noqa: E731

    def one_round(r, acc):
        slot = rank - r * capacity
        here = (slot >= 0) & (slot < capacity)  # the assignments of this round
        slot = jnp.where(here, slot, capacity)  # others out of range: dropped from the tables
        # dispatch tables [E, C]: the token in each slot (t = the all-zero row) and its routing weight
        tok = jnp.full((num_experts, capacity), t, jnp.int32).at[flat, slot].set(jnp.arange(m) // k, mode="drop")
        wts = jnp.zeros((num_experts, capacity), jnp.float32).at[flat, slot].set(weights.reshape(-1), mode="drop")
        gu = mm(jnp.take(xz, tok, axis=0), gate_up)  # [E, C, 2F]
        g, u = jnp.split(gu, 2, axis=-1)
        h = (ACTIVATIONS[act](g) * u).astype(jnp.float32) * wts[..., None]  # [E, C, F]
        y = mm(h.astype(x.dtype), down)  # [E, C, D]
        ya = jnp.where(here[:, None], y[flat, jnp.minimum(slot, capacity - 1)], 0)  # [M, D] weighted outputs
        return acc + jnp.sum(ya.reshape(t, k, -1).astype(jnp.float32), axis=1)

    out = one_round(0, jnp.zeros((t, x.shape[-1]), jnp.float32))
    rounds = (jnp.max(sizes) + capacity - 1) // capacity
    return jax.lax.fori_loop(1, rounds, one_round, out).astype(x.dtype)  # [T, D]


def dense_experts_mlp(x, weights, experts, gate_up, down, act: str) -> jax.Array:
    """Every token through every expert; the routing weights (0 for unchosen experts) scale the down input."""
    t, k = experts.shape
    w = jnp.zeros((t, gate_up.shape[0]), jnp.float32).at[jnp.arange(t)[:, None], experts].add(weights)  # [T, E]
    gu = einsum("td,edf->tef", x, gate_up)  # [T, E, 2F]
    g, u = jnp.split(gu, 2, axis=-1)
    h = (ACTIVATIONS[act](g) * u).astype(jnp.float32) * w[..., None]  # [T, E, F]
    return einsum("tef,efd->td", h.astype(x.dtype), down)  # [T, D]


# The pallas path sorts with kernels/expert_sort (one launch instead of ~6 XLA fusions and the offsets' cumsum, ~13
# us per 26B layer) when True: on an H200 the 26B forward took 17.17 / 17.16 ms against 17.33 / 17.33 with XLA's
# sort, alternating, same tokens (benchmarks/results/2026-12-01_dg_sort_kernel_stages_h200.md). False: XLA's
# sort_by_expert (`benchmarks/diffusion_gemma_generate.py --xla-sort`). Read at trace time.
SORT_KERNEL = True
# With distinct choices per token (experts_mlp(distinct=True)) kernels/expert_sort counts ranks over the T tokens
# instead of the T * k assignments (by_token): the same rows, 2.0 us against 7.5 per 26B layer in an H200 profile
# (-0.01 to -0.05 ms per forward alone, 2026-12-03_dg_router_topk_h200.md). Read at trace time.
EXPERT_SORT_BY_TOKEN = True

# Above this many one-hot entries (assignments x experts) sort_by_expert sorts instead of counting: training passes
# (tens of thousands of assignments) would otherwise build one-hot tables of hundreds of MB.
COUNTING_SORT_MAX = 1 << 20


def sort_by_expert(experts: jax.Array, num_experts: int):
    """The T * k (token, choice) assignments in expert order, stable: (order [M]: the assignment in each sorted row,
    pos [M]: the sorted row of each assignment, sizes [E]). Up to COUNTING_SORT_MAX one-hot entries a counting sort;
    larger: a stable argsort and its inverse.

    The counting sort counts per token, not per assignment: an assignment's place within its expert is the number
    of earlier tokens that chose that expert (a cumsum over the T tokens of their [T, E] choice counts) plus the
    earlier choices of the same expert within its own token (none from a top-k router; counted for exactness). At
    DiffusionGemma's canvas the cumsum runs over 256 rows instead of 2048. The per-assignment version it replaced
    took ~16 us per layer on an H200 in six small fusions, 0.45 ms per 26B forward
    (benchmarks/results/2026-11-30_dg_fused_qkv_h200x2.md). A/B in one call, one round each: the forward 18.50 ->
    18.36 ms, its MoE alone 14.14 -> 13.87 ms (benchmarks/results/2026-11-30_dg_sort_h200x2.md). Either yields
    `pos` (the gather combine's index) without an inverse permutation."""
    flat = experts.reshape(-1)  # [M]
    m = flat.shape[0]
    if m * num_experts > COUNTING_SORT_MAX:
        order = jnp.argsort(flat, stable=True).astype(jnp.int32)
        pos = jnp.zeros_like(order).at[order].set(jnp.arange(m, dtype=jnp.int32), unique_indices=True)
        return order, pos, jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    hits = experts[:, :, None] == jnp.arange(num_experts, dtype=experts.dtype)[None, None]  # [T, k, E]
    per_token = jnp.sum(hits, axis=1, dtype=jnp.int32)  # [T, E]: how often each token chose each expert
    earlier = jnp.cumsum(per_token, axis=0) - per_token  # [T, E]: choices of the expert by earlier tokens
    sizes = earlier[-1] + per_token[-1]  # [E]
    same = jnp.sum(jnp.tril(experts[:, :, None] == experts[:, None, :], -1), axis=2, dtype=jnp.int32)  # [T, k]
    before = jnp.take_along_axis(earlier, experts, axis=1) + same  # [T, k]: earlier assignments, same expert
    pos = (jnp.cumsum(sizes) - sizes)[flat] + before.reshape(-1)
    order = jnp.zeros_like(pos).at[pos].set(jnp.arange(m, dtype=pos.dtype), unique_indices=True)
    return order, pos, sizes


def _sorted_rows(experts: jax.Array, num_experts: int, kernel: bool, by_token: bool = False):
    """experts [T, k] -> (tokens [M]: the token of each sorted row, pos, sizes as in sort_by_expert, the group
    offsets [E + 1]): from kernels/expert_sort when `kernel` and the assignments fit it (MAX_ASSIGNMENTS), else from
    XLA (offsets None: the grouped kernel derives them). by_token: each token's experts are distinct (see
    expert_sort)."""
    t, k = experts.shape
    if kernel:
        from orl_jax_kernels.expert_sort.kernel import MAX_ASSIGNMENTS, by_token_fits, expert_sort

        by_token = by_token and by_token_fits(t, k)
        if by_token or experts.size <= MAX_ASSIGNMENTS:
            tokens, pos, offsets = expert_sort(experts.reshape(-1), num_experts, k, by_token=by_token,
                                               interpret=jax.default_backend() == "cpu")
            return tokens, pos, offsets[1:] - offsets[:-1], offsets
    order, pos, sizes = sort_by_expert(experts, num_experts)
    return order // k, pos, sizes, None


# The pallas path's gate/up kernel gathers each sorted row from its token's row of x in its loads (GATHER_IN_KERNEL;
# else XLA writes the sorted copy of x first, ~8.6 us per 26B layer). On an H200, in one process each: the 26B
# forward 16.26 / 16.30 -> 15.87 / 15.88 ms, and 16.16 / 16.14 -> 15.79 in another call
# (benchmarks/results/2026-12-01_dg_gather_rows_h200.md). Read at trace time (benchmarks/diffusion_gemma_generate.py
# --sorted-copy sets False).
GATHER_IN_KERNEL = True


# The one-launch expert MLP's tiles (benchmarks/expert_tile_probe.py times them alone on a 26B layer; record:
# benchmarks/results/2026-12-04_dg_expert_tiles_h200.md). FUSED_TILE: the width of a gate (and of an up) column tile
# in `fuse_gate_up`'s layout, read when the layout is made (the kernel takes it from the stack); FUSED_DOWN_BN: down's
# output columns per program; FUSED_BM: rows per tile (a group of more rows runs its tiles one after another,
# rereading its weight tile from L2); FUSED_WARPS: warps per program; FUSED_GU_BK / FUSED_DN_BK: rows of K per step
# (D and F must be multiples). All but FUSED_TILE are read at trace time. None of the variants ran faster than these
# defaults (362-372 us per layer): tile 32 with down 64 (session 45's candidate for more blocks per SM) 382-387 us,
# 32 rows equal alone but +0.1 ms per forward, 16 rows 508-517 us, 8 warps 382 us, K step 128 365-446 us, and K step
# 32 with 32 rows and 4 stages 1-4 us faster alone but +0.25 ms per forward (14.65-14.69 against 14.40-14.42 ms).
# Also refuted: down in contiguous column tiles, multi-tile work items, persistent programs (git d70a95a, fe81d91,
# 9b6ec06), and every product transposed so that 32 or 16 rows keep wgmma (git d75c791: 32 rows equal alone, +0.08 ms
# per forward; 16 rows 507-514 us, +4 ms; benchmarks/results/2026-12-04_dg_swapped_products_h200.md).
FUSED_TILE = 64
FUSED_DOWN_BN = 128
FUSED_BM = 64
FUSED_WARPS = 4
FUSED_GU_BK = 64
FUSED_DN_BK = 64
# Pipeline stages of the one-launch expert MLP: 3 took 373 us per 26B layer in isolation, 2 / 4 stages 377 / 375; in
# the forward 2 / 4 stages were 0.15 / 0.06 ms slower (benchmarks/results/2026-12-04_dg_fused_expert_mlp_h200.md).
# Read at trace time.
FUSED_STAGES = 3
# gate/up's [gate | up] tile as one product per K step, split after the loop (mlp.grouped_mlp's one_dot), instead of
# two half-width products: 373.6-374.6 against 374.6-374.9 us per 26B layer in isolation, and in the forward
# 14.435 / 14.440 against 14.480 / 14.464 ms, alternating in one process (benchmarks/dg_fused_one_dot_sweep.json;
# benchmarks/results/2026-12-04_dg_one_dot_ffw_tail_h200.md). Read at trace time.
FUSED_ONE_DOT = True
# Long passes: at least FUSED_LONG_ROWS rows per expert on average (the 26B's prefill 32, prefill_decode 48; the
# canvas 16 never). Both switches below act on them alone. Read at trace time.
FUSED_LONG_ROWS = 32
# Long passes hand the one-launch kernel its experts in descending order of rows (`grouped_mlp(order=)`): an expert
# of several 64-row tiles runs them one after another in each of its work items (in the 512-token prefill the
# heaviest expert per layer got 51-221 rows, benchmarks/results/2026-12-03_dg_expert_loads_h200.md), so taking it
# first keeps it from setting the launch's last wave. Costs a sort of E sizes before the launch. Timed in session 51
# (then as a threshold of 32, the same passes): -0.11 ms on `generate(max_steps=1)`, range -0.46 to +0.35, noise
# (benchmarks/results/2026-12-05_dg_norm_folds_h200.md). Off.
FUSED_HEAVY_FIRST = False
# Rows per tile and warps of the one-launch expert MLP in long passes. An expert past FUSED_BM rows runs its row
# tiles one after another, each streaming the expert's weights again: in session 51's trace of prefill_decode (768
# tokens, 6144 rows) the expert launches took 458-470 us per layer against ~365 at the canvas's 2048 rows
# (benchmarks/results/2026-12-05_dg_norm_folds_h200.md). 128-row tiles read an expert of up to 128 rows once. On an
# H100, generate(max_steps=1) (the 26B's fused first step) took 30.69 against 33.77 ms, faster in 8 of 8 rounds
# alternating in one process (benchmarks/results/2026-12-05_dg_long_tiles_h100.md). None: FUSED_BM / FUSED_WARPS in
# every pass.
FUSED_LONG_BM: int | None = 128
FUSED_LONG_WARPS = 8


def fusable(d: int, f: int) -> bool:
    """Whether experts of hidden size d and width f fit the one-launch MLP's tiles (FUSED_TILE-wide gate and up
    column tiles, 128-column down tiles)."""
    return f % FUSED_TILE == 0 and d % 128 == 0


def fuse_gate_up(stack: jax.Array, donate: bool = False) -> jax.Array:
    """An expert gate/up stack [L, E, D, 2F] (gate | up) in kernels/grouped_gemm's `tile_gated` layout [L, E,
    F / FUSED_TILE, D, 2 FUSED_TILE], for the pallas path's one-launch expert MLP (kernels/grouped_gemm/mlp.py):
    the activation in gate/up's programs and down's programs waiting per expert, instead of two grouped GEMMs with
    XLA's activation between them. Inference only: the other paths, training and export take the model's layout.
    Layer by layer in one buffer (layerwise.map_layers): donate: the stack's own (consumed), else a copy of it."""
    from orl_jax_kernels.grouped_gemm.mlp import tile_gated

    if stack.ndim != 4 or stack.shape[-1] % 2 or not fusable(stack.shape[-2], stack.shape[-1] // 2):
        raise ValueError(f"fuse_gate_up: a gate/up stack [L, E, D, 2F] with F a multiple of {FUSED_TILE} and D of "
                         f"128 (the kernel's tiles), got {stack.shape}")
    n, e, d, f2 = stack.shape
    return map_layers(stack, lambda w: tile_gated(w, FUSED_TILE), donate=donate,
                      out_shape=(n, e, f2 // (2 * FUSED_TILE), d, 2 * FUSED_TILE))


def fused_blocks(stack: jax.Array):
    """grouped_mlp's (gate/up, down) tiles for a gate/up stack in `fuse_gate_up`'s layout: gate/up as wide as the
    layout's [gate | up] tile, down FUSED_DOWN_BN columns; FUSED_GU_BK / FUSED_DN_BK rows of K per step."""
    from orl_jax_kernels.small_m_gemm.kernel import Blocks

    return Blocks(bn=stack.shape[-1], bk=FUSED_GU_BK, splits=1), Blocks(bn=FUSED_DOWN_BN, bk=FUSED_DN_BK, splits=1)


def fused_expert_mlp(x: jax.Array, rows: jax.Array, gate_up: jax.Array, down: jax.Array, offsets: jax.Array, layer,
                     act: str, row_scale: jax.Array | None = None) -> jax.Array:
    """The one-launch expert MLP (kernels/grouped_gemm/mlp.grouped_mlp) with the model's settings (tiles, stages,
    one_dot, FUSED_HEAVY_FIRST, FUSED_LONG_BM; interpret mode on a CPU): sorted rows of x[rows] through their
    experts -> [M, D]. gate_up: a stack in `fuse_gate_up`'s layout, down the model's [L, E, F, D]; layer: the stacks'
    layer; row_scale: grouped_mlp's."""
    from orl_jax_kernels.grouped_gemm.mlp import grouped_mlp

    e = offsets.shape[0] - 1
    long = rows.shape[0] >= FUSED_LONG_ROWS * e
    order = None
    if long and FUSED_HEAVY_FIRST:
        order = jnp.argsort(offsets[:-1] - offsets[1:], stable=True).astype(jnp.int32)  # most rows first
    bm, warps = (FUSED_LONG_BM, FUSED_LONG_WARPS) if long and FUSED_LONG_BM is not None else (FUSED_BM, FUSED_WARPS)
    return grouped_mlp(x, rows, gate_up, down, offsets, layer, ACTIVATIONS[act], *fused_blocks(gate_up),
                       bm=bm, num_warps=warps, num_stages=FUSED_STAGES, one_dot=FUSED_ONE_DOT,
                       interpret=jax.default_backend() == "cpu", row_scale=row_scale, order=order)


def fused_stack(w) -> bool:
    """Whether a layer's gate/up weight comes in `fuse_gate_up`'s layout (a 5-D stack)."""
    return isinstance(w, StackedWeight) and w.stack.ndim == 5


def grouped_experts_mlp(x, weights, experts, gate_up, down, act: str, sort_kernel: bool = False,
                        by_token: bool = False, row_scale: jax.Array | None = None) -> jax.Array:
    """Rows sorted by expert and multiplied group by group (`grouped_matmul`): work proportional to T * k. The
    outputs come back by a gather (each assignment reads its sorted row), weighted and summed over the k choices.
    sort_kernel: sort with kernels/expert_sort (one launch, and the group offsets the grouped kernel needs) up to its
    MAX_ASSIGNMENTS, instead of sort_by_expert's XLA fusions (by_token: each token's experts distinct, see
    _sorted_rows). row_scale: experts_mlp's, taken by the one-launch kernel only."""
    t, k = experts.shape
    if row_scale is not None and not fused_stack(gate_up):
        raise ValueError("grouped_experts_mlp: row_scale needs gate_up in fuse_gate_up's layout")
    tokens, pos, sizes, offsets = _sorted_rows(experts, gate_up.shape[0], sort_kernel, by_token)
    # Indices from the sort kernel (offsets given) take bare gathers. XLA's sort keeps jnp.take: a gather whose index
    # is used once fused the whole counting sort into itself (170 us per 26B layer, session 16).
    take = in_bounds_take if offsets is not None else (lambda a, i: jnp.take(a, i, axis=0))  # noqa: E731
    if fused_stack(gate_up):  # the whole expert MLP in one launch
        from orl_jax_kernels.grouped_gemm.kernel import group_offsets

        offsets = group_offsets(sizes) if offsets is None else offsets
        y = fused_expert_mlp(x, tokens, gate_up.stack, as_stacked(down).stack, offsets, gate_up.index, act,
                             row_scale)
    else:
        xs, rows = (x, tokens) if GATHER_IN_KERNEL else (take(x, tokens), None)
        g, u = jnp.split(grouped_matmul(xs, gate_up, sizes, offsets, rows=rows), 2, axis=-1)  # [M, F] each
        y = grouped_matmul(ACTIVATIONS[act](g) * u, down, sizes, offsets)  # [M, D] in sorted order
    y = take(y, pos).astype(jnp.float32) * weights.reshape(-1, 1)  # [M, D] in (token, choice) order
    return jnp.sum(y.reshape(t, k, -1), axis=1).astype(x.dtype)  # [T, D]
