"""Fused attention for passes with a KV cache (denoising steps, commits, prefill): [cache | own tokens], one
softmax, without materializing the scores.

Why: in a batch-1 denoising forward of Qwen3-4B at block 32, XLA's attention (scores, mask, softmax, values as
separate kernels) costs ~37 us per layer for 32 queries over ~544 keys, 27% of the layer
(benchmarks/results/2026-11-29_profile_h200.md). Here one program per (batch row, query head, query tile, key
split) streams a few chunks of its kv head's cache, or the pass's own keys (the last split), through two
tensor-core dots with an online (running-max) softmax, reading the visibility masks as int8 tiles; XLA then
combines the splits' partial results (flash-decoding; each split's output normalized in the queries' dtype beside its
float32 max and sum: SPLITS_IN_INPUT_DTYPE). The splits are what fills the chip at batch 1: the first
version ran one program per (row, head, query tile) over all keys, 32 programs for 132 SMs at block 32, and was
slower than XLA's einsums (benchmarks/results/2026-11-29_engine_step_h200.md). Cache chunks past the last slot a
tile sees are not streamed.

Semantics equal orl_jax.model.attention.attention with two parts (cache, self): scores in float32, masked keys at
a finite large negative value, the probabilities cast to the value dtype for the second dot. The online softmax
rescales partial sums, so results differ from the reference by rounding only. One exception: a query row with no
visible key at all (the engine never makes one: every row sees itself) averages the values the kernel streams for
its tile (the own keys, and the cache up to the tile's last visible slot), where the reference averages every
value. When the whole cache fits one program's chunks, that program also takes the own keys and writes the
normalized output: no partial results and no merge.

`cached_attention_normed` is the same kernel fed the raw fused projection: it applies the q/k RMSNorms and RoPE
(kernels/qk_norm_rope's orders) as it loads q and the own keys, one launch per layer fewer for block decoding.
`masked_attention` is the same kernel over one key sequence (the "cache" part alone, no own keys), for passes
without a cache: DiffusionGemma's prompt prefill and `prefill_decode`.

Pallas, Triton lowering (pallas.triton); interpret mode on CPU for tests.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from orl_jax.model.attention import _NEG as NEG  # masked keys score exactly as in the reference
from orl_jax_kernels.pallas_args import layer_operand, triton_params
from orl_jax_kernels.qk_norm_rope.kernel import norm_rope_halves


@dataclass(frozen=True)
class Blocks:
    bl: int = 64  # queries per program (fewer when the pass is shorter)
    bs: int = 64  # keys per chunk (fewer when a part is shorter)
    chunks_per_split: int = 2  # cache chunks per program (the own keys are one more split)
    num_warps: int = 4
    num_stages: int = 2
    # True: one program serves the G query heads of a kv head, their queries stacked as G x bl rows of one dot, so
    # each K/V chunk is read once per kv head instead of G times (needs G a power of two)
    group_heads: bool = False
    # True: in a layer loop, read layer i of the whole cache stacks in place (the caller passes them with `layer`)
    # instead of the loop's slices, which reach a custom call as copies (likely the two ~2 us memcpy per layer of
    # benchmarks/results/2026-11-30_engine_profile_h200x2.md). Used by attention() when its cache part is a
    # StackedWeight.
    cache_in_place: bool = False
    # True (where the cache and own keys share one chunk size): the keys a query tile sees, its visible cache chunks
    # then its own, are divided evenly over ceil((cache chunks + own chunks) / chunks_per_split) splits, at run
    # time from the visible extent. False: each split holds chunks_per_split cache chunks of fixed slots (those past
    # the extent stream nothing) and the own keys are one more split, so a partly filled cache leaves whole splits
    # idle while the longest one sets the kernel's time.
    balanced: bool = False


TUNED: dict[tuple[int, int, int, int], Blocks] = {}  # (queries, cache slots, head dim, heads per kv head)

# Where the keys are split: True, each split writes its output normalized by its own softmax sum, in the queries'
# dtype (bf16 in the models; as vLLM's paged attention v2 keeps its partial outputs), and combine() weighs it back by
# that sum in float32; False, each writes its unnormalized float32 sums. True halves the partials' bytes written and
# read back by the merge (DiffusionGemma's sliding layers: 16.8 MB per layer in float32) at the cost of one bf16
# rounding of each split's output before the merge (the merged output is rounded to bf16 anyway). On an H200
# (benchmarks/results/2026-12-01_balanced_splits_h200.md, call 8): DiffusionGemma's forward 14.835 / 14.847 ms
# against 14.948 / 14.926, alternating in one process; the Qwen3-4B step equal to -0.08 ms. float32 queries (the
# parity tests) keep float32 partials. Read at trace time.
SPLITS_IN_INPUT_DTYPE = True

# The library's blocks where the table has no entry, from the H200 sweep at the engine's two shapes (Qwen3-4B, 36
# layers in a scan; benchmarks/results/2026-11-30_attention_sweep_h200x2.md): 16-query tiles, 4 warps and the cache
# read in place won at both. Block 32 over 544 slots: 16.1 us per layer (the dataclass defaults 20.5). Canvas 256
# over 768: the heads of a kv head grouped, 8 chunks of 64 keys per split, 31.9 us (defaults 50.6). Other shapes
# take the rule of the nearer of the two by pass length: a heuristic, measured at those two shapes only.
# Both long-pass rules divide the visible keys evenly over their splits (balanced; session 23, same call,
# 2026-12-01_balanced_splits_h200.md): canvas 256 5.31 / 5.29 ms per step against 5.58 / 5.49, DiffusionGemma's
# forward 14.882 / 14.898 ms against 14.943 / 14.953. Block 32 was equal with it (3.48 / 3.49 against 3.50 / 3.46).
SHORT_PASS = Blocks(bl=16, bs=32, chunks_per_split=4, cache_in_place=True)
LONG_PASS = Blocks(bl=16, bs=64, chunks_per_split=8, group_heads=True, cache_in_place=True, balanced=True)
# Long passes of wide heads (h >= 256), where they fit shared memory, from the sweep at DiffusionGemma's sliding
# layers (256 queries over 768 slots, head dim 256, 2 heads per kv head; 2026-11-30_dg_in_place_h200x2.md):
# 128-query tiles, 8 warps, 4 chunks of 64 keys per split, 32.2 us per layer against 43.1 for LONG_PASS and 64.4
# for XLA's einsums. The 512-wide full-attention heads do not fit it and keep the fallbacks below (not swept).
WIDE_HEADS = Blocks(bl=128, bs=64, chunks_per_split=4, num_warps=8, cache_in_place=True, balanced=True)


def load_tuned(path) -> dict[tuple[int, int, int, int], Blocks]:
    """Fill TUNED from a JSON table [{"l":, "s":, "h":, "g":, "blocks": {...}}, ...] (kernels/decode_attention/
    bench.py --table); call before the first trace."""
    import json
    from pathlib import Path

    return set_tuned(json.loads(Path(path).read_text()), replace=False)


def set_tuned(rows, replace: bool = True) -> dict[tuple[int, int, int, int], Blocks]:
    """TUNED from table rows as load_tuned reads them (replace: drop the entries there were). Traces made before
    keep their blocks: jax.clear_caches() makes the next call trace again."""
    if replace:
        TUNED.clear()
    for row in rows:
        TUNED[(int(row["l"]), int(row["s"]), int(row["h"]), int(row["g"]))] = Blocks(**row["blocks"])
    return TUNED


SMEM_LIMIT = 200 * 1024  # of the H200's 227 KB per block; the estimate below undercounts by ~6%


def smem_bytes(blocks: Blocks, h: int, g: int, itemsize: int = 2) -> int:
    """Shared memory of a program, estimated: its query rows and num_stages buffers of one K and one V chunk, of
    itemsize bytes per element (bf16: 2; the H200 refused 128 queries x 4 grouped heads with 128-key chunks at h
    128: 278,528 bytes asked; this gives 262,144)."""
    rows = blocks.bl * (g if blocks.group_heads else 1)
    return itemsize * h * (rows + blocks.num_stages * 2 * blocks.bs)


def blocks_for(l: int, s: int, h: int = 128, g: int = 1, itemsize: int = 2) -> Blocks:
    """The blocks for l queries over s cache slots (head dim h, g query heads per kv head, elements of itemsize
    bytes): the tuned table's entry (bf16), else the measured rule (SHORT_PASS up to 64 queries; above, WIDE_HEADS
    for heads >= 256 wide, else LONG_PASS) where the kernel supports it, made to fit shared memory at large head dims
    or elements (heads ungrouped, then shorter key chunks: DiffusionGemma's 512-wide full-attention heads), else the
    dataclass defaults (`fits` tells whether those fit)."""
    if (l, s, h, g) in TUNED and itemsize == 2:
        return TUNED[(l, s, h, g)]
    rule = SHORT_PASS if l <= 64 else LONG_PASS
    ungrouped = dataclasses.replace(rule, group_heads=False)
    wide = [WIDE_HEADS] if l > 64 and h >= 256 else []
    for b in (*wide, rule, ungrouped, dataclasses.replace(ungrouped, bs=32), dataclasses.replace(ungrouped, bs=16)):
        if supported(l, s, h, b, g) and fits(b, h, g, itemsize):
            return b
    return Blocks()


def fits(blocks: Blocks, h: int, g: int, itemsize: int = 2) -> bool:
    """Whether a program's shared memory (smem_bytes) is within SMEM_LIMIT."""
    return smem_bytes(blocks, h, g, itemsize) <= SMEM_LIMIT


def preferred(l: int, s: int, h: int, g: int) -> bool:
    """Whether the library takes the kernel over XLA's einsums at this shape (given blocks that fit): always for a
    shape in the tuned table; otherwise not for long passes (l > 64) of heads wider than 256, where only ungrouped
    blocks with 32-key chunks fit shared memory. At DiffusionGemma's full-attention layers (256 queries over 768
    slots, head dim 512, 8 heads per kv head) those took 111-123 us per layer against 76-83 us for the einsums
    (benchmarks/results/2026-11-30_dg_full_attention_sweep_h200x2.jsonl)."""
    return (l, s, h, g) in TUNED or not (l > 64 and h > 256)


def tile(n: int, want: int) -> int:
    """The largest power of two <= want dividing n (0 if below 16: tensor-core dots need 16)."""
    t = want
    while t >= 16 and n % t:
        t //= 2
    return t if t >= 16 else 0


def supported(l: int, s: int, h: int, blocks: Blocks = Blocks(), g: int = 1) -> bool:
    """Queries per pass l, cache slots s, head dim h, query heads per kv head g: tiles of >= 16 must divide l, s;
    h a power of two >= 16; with group_heads, g a power of two."""
    pow2 = lambda x: x >= 1 and not x & (x - 1)  # noqa: E731
    return (bool(tile(l, blocks.bl) and tile(s, blocks.bs) and tile(l, blocks.bs)) and h >= 16 and pow2(h)
            and (not blocks.group_heads or pow2(g)))


def _kernel(layer_ref, extent_ref, q_ref, kc_ref, vc_ref, mc_ref, *refs, scale: float, cs: int, ss: int, cps: int,
            grouped: bool, stacked: bool, balanced: bool, own: bool = True, norm: tuple | None = None):
    # own: the pass's own keys come as a second part (ks, vs, ms); False: the keys are the first part alone
    # (masked_attention, the cache-free passes)
    ks_ref, vs_ref, ms_ref, *refs = refs if own else (None, None, None, *refs)
    if norm is not None:  # q, own k and v raw from the projection [1, rows, 1, 1, H] (ungrouped programs only)
        cos_ref, sin_ref, vec_ref, vec_layer_ref, *refs = refs
    o_ref, *stats = refs
    if grouped:  # [BL, G, H] -> rows (query, head) of one dot
        bl, g, h = q_ref.shape[1:]
    else:
        (bl, h), g = (q_ref.shape[1], q_ref.shape[-1]), 1
    split = pl.program_id(3)
    layer = layer_ref[0]
    extent = jnp.max(extent_ref[0, :])  # one past the last cache slot any query of the tile sees
    n_cache = ((extent + cs - 1) // cs).astype(jnp.int32)  # chunks up to it
    n_self = ks_ref.shape[1] // ss if own else 0
    self_first = jnp.int32(0)
    if not stats:  # one split: the cache, then the own keys, normalized here
        first, cache_trips, self_trips = jnp.int32(0), n_cache, jnp.int32(n_self)
    elif balanced:  # chunks [first, hi) of the sequence (visible cache chunks, then own chunks); cs == ss
        total = n_cache + n_self
        per = (total + pl.num_programs(3) - 1) // pl.num_programs(3)
        first = (split * per).astype(jnp.int32)
        hi = jnp.minimum(first + per, total)
        cache_trips = jnp.maximum(jnp.minimum(hi, n_cache) - first, 0).astype(jnp.int32)
        self_first = jnp.maximum(first - n_cache, 0).astype(jnp.int32)
        self_trips = jnp.maximum(hi - jnp.maximum(first, n_cache), 0).astype(jnp.int32)
    else:
        first = split * cps
        cache_trips = jnp.clip(n_cache - first, 0, cps).astype(jnp.int32)
        self_trips = jnp.int32(0)
        if own:  # the last split holds the pass's own keys, the others the cache
            last = split == pl.num_programs(3) - 1
            # int32 loop bounds: Triton's scf.for needs bounds of one type (where(last, 1, 0) otherwise lowers to i1)
            cache_trips = ((~last).astype(jnp.int32) * cache_trips).astype(jnp.int32)
            self_trips = last.astype(jnp.int32) * n_self

    if norm is None:
        q = (q_ref[0].reshape(bl * g, h),) if grouped else (q_ref[0, :, 0, :],)  # one dot over all of H
        load_cache = lambda s0, n: ((_kv(kc_ref, layer, s0, n, stacked),), _kv(vc_ref, layer, s0, n, stacked))  # noqa
        load_self = lambda s0, n: ((_kv(ks_ref, layer, s0, n, False),), _kv(vs_ref, layer, s0, n, False))  # noqa
    else:  # the two halves of H as separate dots (Triton has no register slicing; RoPE pairs the halves)
        q_off, k_off, eps, gemma = norm
        half = h // 2
        lo, hi = pl.ds(0, half), pl.ds(half, half)
        vec_layer = vec_layer_ref[0]
        dt = q_ref.dtype

        def norm_rope(x1, x2, rows, off):  # kernels/qk_norm_rope's norm + RoPE on rows [n, half] per half
            w1, w2 = vec_ref[vec_layer, pl.ds(off, half)][None], vec_ref[vec_layer, pl.ds(off + half, half)][None]
            c1, c2 = cos_ref[0, rows, lo].astype(dt), cos_ref[0, rows, hi].astype(dt)
            s1, s2 = sin_ref[0, rows, lo].astype(dt), sin_ref[0, rows, hi].astype(dt)
            return norm_rope_halves(x1, x2, w1, w2, c1, c2, s1, s2, eps, gemma)

        t0 = pl.multiple_of(pl.program_id(2) * bl, bl)
        q = norm_rope(q_ref[0, :, 0, 0, lo], q_ref[0, :, 0, 0, hi], pl.ds(t0, bl), q_off)

        def load_cache(s0, n):
            if stacked:
                k1, k2 = kc_ref[layer, 0, pl.ds(s0, n), 0, lo], kc_ref[layer, 0, pl.ds(s0, n), 0, hi]
            else:
                k1, k2 = kc_ref[0, pl.ds(s0, n), 0, lo], kc_ref[0, pl.ds(s0, n), 0, hi]
            return (k1, k2), _kv(vc_ref, layer, s0, n, stacked)

        def load_self(s0, n):
            rows = pl.ds(s0, n)
            k = norm_rope(ks_ref[0, rows, 0, 0, lo], ks_ref[0, rows, 0, 0, hi], rows, k_off)
            v = vs_ref[0, rows, 0, 0, :]
            if gemma:  # v: the weightless norm
                f = v.astype(jnp.float32)
                v = (f * jax.lax.rsqrt(jnp.mean(f * f, axis=1, keepdims=True) + eps)).astype(dt)
            return k, v

    def stream(load, m_ref, chunk, start, trips, carry):
        def body(j, carry):
            m, l, acc = carry
            s0 = pl.multiple_of((start + j) * chunk, chunk)
            k, v = load(s0, chunk)  # k: the parts of H matching q's
            vis = m_ref[0, :, pl.ds(s0, chunk)] != 0  # [BL, C]
            if grouped:  # every head of the group sees what its query sees
                vis = jnp.broadcast_to(vis[:, None, :], (bl, g, chunk)).reshape(bl * g, chunk)
            s = sum(jax.lax.dot_general(qp, kp, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
                    for qp, kp in zip(q, k)) * scale
            s = jnp.where(vis, s, NEG)
            m_new = jnp.maximum(m, jnp.max(s, axis=1))
            alpha = jnp.exp(m - m_new)
            p = jnp.exp(s - m_new[:, None])
            acc = acc * alpha[:, None] + jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
            return m_new, l * alpha + jnp.sum(p, axis=1), acc

        return jax.lax.fori_loop(jnp.int32(0), trips, body, carry)

    rows = bl * g
    carry = (jnp.full((rows,), -jnp.inf, jnp.float32), jnp.zeros((rows,), jnp.float32),
             jnp.zeros((rows, h), jnp.float32))
    m, l, acc = stream(load_cache, mc_ref, cs, first, cache_trips, carry)
    if own:
        m, l, acc = stream(load_self, ms_ref, ss, self_first, self_trips, (m, l, acc))
    if not stats:  # o_ref: the block of the [B, L, N, H] output
        out = (acc / l[:, None]).astype(o_ref.dtype)
        if grouped:
            o_ref[0] = out.reshape(bl, g, h)
        else:
            o_ref[0, :, 0, :] = out
        return
    m_out, l_out = stats
    if o_ref.dtype != jnp.float32:  # normalized by this split's sum (SPLITS_IN_INPUT_DTYPE); a split with no keys: 0
        acc = acc / jnp.where(l > 0, l, 1.0)[:, None]
    part = acc.astype(o_ref.dtype)
    if grouped:  # m, l laid out [P, B, L, N] either way: combine() reads them without a transpose
        o_ref[0, 0] = part.reshape(bl, g, h)
        m_out[0, 0] = m.reshape(bl, g)
        l_out[0, 0] = l.reshape(bl, g)
    else:
        o_ref[0, 0, :, 0, :] = part  # the splits are combined outside
        m_out[0, 0, :, 0] = m
        l_out[0, 0, :, 0] = l


def _kv(ref, layer, s0, n, stacked):
    """Rows s0 .. s0 + n of a K or V block: [layers, 1, S, 1, H] at `layer` when stacked, else [1, S, 1, H]."""
    return ref[layer, 0, pl.ds(s0, n), 0, :] if stacked else ref[0, pl.ds(s0, n), 0, :]


def combine(o, m, l, dtype, normalized: bool = False):
    """Merge the key splits' partial softmaxes: o [P, B, L, N, H] (unnormalized float32 sums, or each normalized by
    its own sum l when `normalized`), m and l [P, B, L, N].

    The P splits are few and static, so the merge is written elementwise over them: XLA fuses it into one kernel
    that reads o once. As reductions over P it took three launches per layer (two transposing reductions, then the
    merge: ~0.18 ms per Qwen3-4B block-32 step, benchmarks/results/2026-11-30_engine_blocks_h200x2.md). Not yet
    timed in this form."""
    mx = functools.reduce(jnp.maximum, list(m))  # [B, L, N]
    w = [jnp.exp(m_p - mx)[..., None] for m_p in m]  # [B, L, N, 1]; a split whose keys were all masked weighs 0
    wl = [w_p * l_p[..., None] for w_p, l_p in zip(w, l)]
    if normalized:  # o_p = sum_p / l_p: weighed by its sum
        w, o = wl, [o_p.astype(jnp.float32) for o_p in o]
    return (sum(w_p * o_p for w_p, o_p in zip(w, o)) / sum(wl)).astype(dtype)


@functools.partial(jax.jit, static_argnames=("scale", "blocks", "interpret"))
def cached_attention(q, k_cache, v_cache, cache_mask, k_self, v_self, self_mask, *, scale: float,
                     blocks: Blocks = Blocks(), interpret: bool = False, layer=None, extent=None):
    """q [B, L, N, H]; k/v_cache [B, S, K, H], or whole stacks [layers, B, S, K, H] read at int32 scalar `layer`;
    cache_mask [B, L, S]; k/v_self [B, L, K, H]; self_mask [B, L, L] (bool or int8; int8 avoids a conversion per
    call); extent [B, L]: cache_extent(cache_mask), computed here when None -> [B, L, N, H]. Shapes: see
    `supported`."""
    if k_self.shape != v_self.shape:
        raise ValueError(f"cached_attention: k_self {k_self.shape} and v_self {v_self.shape} differ")
    return _attend(q, k_cache, v_cache, cache_mask, k_self, v_self, self_mask, (), n=q.shape[2], scale=scale,
                   blocks=blocks, interpret=interpret, layer=layer, extent=extent)


@functools.partial(jax.jit, static_argnames=("offsets", "eps", "gemma", "scale", "blocks", "interpret"))
def cached_attention_normed(proj, k_cache, v_cache, cache_mask, self_mask, cos, sin, vectors, vec_layer, *,
                            offsets: tuple[int, int], eps: float, gemma: bool, scale: float,
                            blocks: Blocks = Blocks(), interpret: bool = False, layer=None, extent=None):
    """cached_attention straight from the fused projection, kernels/qk_norm_rope's q/k norms and RoPE (and with
    `gemma`, its order and v's weightless norm) done in the kernel: proj [B, L, K, G + 2, H] (per kv head its G query
    heads, k, v; raw), cos / sin [B, L, H], the norm weights at vectors[vec_layer, q:q + H] and [k:k + H] for
    offsets (q, k) (int32 scalar vec_layer) -> [B, L, K * G, H]. The cache holds normed, rotated keys already.
    Why: one kernel launch fewer per layer; at decode sizes each launch costs more than the work it does
    (benchmarks/results/2026-12-03_engine_launch_tax_h200.md). Programs serve one query head each (group_heads
    False); the scores are two dots over the halves of H (RoPE's pairs), so they round differently from one dot;
    q, k and v equal the norm kernel's bit for bit."""
    b, l, kv, slots, h = proj.shape
    if blocks.group_heads or h % 2 or (h // 2) & (h // 2 - 1):
        raise ValueError(f"cached_attention_normed: H={h} (half a power of two needed) with {blocks} "
                         f"(group_heads unsupported)")
    if cos.shape != (b, l, h) or sin.shape != (b, l, h) or vectors.ndim != 2 or \
            not all(0 <= o <= vectors.shape[1] - h for o in offsets):
        raise ValueError(f"cached_attention_normed: proj {proj.shape}, cos {cos.shape}, sin {sin.shape}, vectors "
                         f"{vectors.shape} and offsets {offsets} do not match")
    vec_layer = layer_operand("cached_attention_normed", True, vec_layer, vectors.shape)
    return _attend(proj, k_cache, v_cache, cache_mask, proj, proj, self_mask, (cos, sin, vectors, vec_layer),
                   n=kv * (slots - 2), scale=scale, blocks=blocks, interpret=interpret, layer=layer, extent=extent,
                   norm=(*offsets, eps, gemma))


@functools.partial(jax.jit, static_argnames=("scale", "blocks", "interpret"))
def masked_attention(q, k, v, mask, *, scale: float, blocks: Blocks = Blocks(), interpret: bool = False,
                     extent=None):
    """The kernel over one key sequence, for the cache-free inference passes (DiffusionGemma's prompt `prefill`
    and `prefill_decode`: hundreds of queries over as many keys, on XLA's einsums ~100 us per 26B sliding layer at
    768 tokens, the float32 scores written and read four times). q [B, L, N, H]; k, v [B, S, K, H]; mask [B, L, S]
    (bool or int8); extent [B, L]: cache_extent(mask), computed here when None. Each query tile streams the keys up
    to its furthest visible one, so a causal prompt's early tiles read few chunks. The keys are the kernel's
    "cache" part: the same splits, balancing and merge (`supported` and `blocks_for` as for a cache of S slots).
    A query row with no visible key averages the values its tile streams (the engine never makes one)."""
    if k.shape != v.shape or k.ndim != 4:
        raise ValueError(f"masked_attention: k {k.shape} and v {v.shape} must be equal [B, S, K, H]")
    return _attend(q, k, v, mask, None, None, None, (), n=q.shape[2], scale=scale, blocks=blocks,
                   interpret=interpret, layer=None, extent=extent)


def cache_extent(cache_mask: jax.Array) -> jax.Array:
    """[B, L, S] visibility (bool or int8) -> [B, L] int32: per query, one past the last cache slot it sees (0:
    none). The kernel's `extent` operand; a layer loop computes it once per pass, not once per layer (XLA left the
    two reductions in each DiffusionGemma sliding layer: benchmarks/results/2026-12-03_engine_invariants_h200.md)."""
    s = cache_mask.shape[-1]
    return jnp.max(jnp.where(cache_mask != 0, jnp.arange(1, s + 1, dtype=jnp.int32), 0), axis=-1)


def _attend(q, k_cache, v_cache, cache_mask, k_self, v_self, self_mask, norm_args, *, n: int, scale: float,
            blocks: Blocks, interpret: bool, layer, extent=None, norm: tuple | None = None):
    """The kernel's launch for both entry points; norm: (q offset, k offset, eps, gemma) when q, k_self and v_self
    are the raw projection [B, L, K, G + 2, H] and norm_args (cos, sin, vectors, vector layer)."""
    stacked = k_cache.ndim == 5  # [layers, B, S, K, H]
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"cached_attention: k_cache {k_cache.shape} and v_cache {v_cache.shape} differ")
    layer_arr = layer_operand("cached_attention", stacked, layer, k_cache.shape)
    b, l, h = q.shape[0], q.shape[1], q.shape[-1]
    s, kv = k_cache.shape[-3], k_cache.shape[-2]
    g = n // kv
    if not supported(l, s, h, blocks, g):
        raise ValueError(f"cached_attention: L={l}, S={s}, H={h}, G={g} not supported with {blocks}")
    own = k_self is not None  # False: masked_attention, the keys are the cache part alone
    bl, cs, ss = tile(l, blocks.bl), tile(s, blocks.bs), tile(l, blocks.bs)
    # One split (that program also takes the own keys and normalizes: no partials, no merge), or: balanced, the
    # visible cache and own chunks evenly over the splits (Blocks.balanced); else fixed cache splits and the own keys
    # one more
    balanced = blocks.balanced and (cs == ss or not own)
    if balanced:
        splits = -(-(s // cs + (l // ss if own else 0)) // blocks.chunks_per_split)
    else:
        cache_splits = -(-(s // cs) // blocks.chunks_per_split)
        splits = 1 if cache_splits == 1 else cache_splits + own
    # Per query: one past the last cache slot it sees; each program streams the cache up to its tile's maximum, so
    # slots a generation has not filled yet (a third of a 768-slot cache at a 512-token prompt's first canvas) cost
    # nothing. Callers in a layer loop pass it in, computed once per pass (`cache_extent`).
    extent = cache_extent(cache_mask) if extent is None else extent
    if extent.shape != (b, l):
        raise ValueError(f"cached_attention: extent {extent.shape} is not [B, L] = {(b, l)}")
    f32 = jnp.float32
    grouped = blocks.group_heads
    kvh = (lambda j: j) if grouped else (lambda j: j // g)  # grid axis 1: kv heads (grouped) or query heads
    nh = g if grouped else 1  # query heads per program
    cache_spec = (pl.BlockSpec((k_cache.shape[0], 1, s, 1, h), lambda i, j, t, p: (0, i, 0, kvh(j), 0)) if stacked
                  else pl.BlockSpec((1, s, 1, h), lambda i, j, t, p: (i, 0, kvh(j), 0)))
    if norm is None:
        q_spec = pl.BlockSpec((1, bl, nh, h), lambda i, j, t, p: (i, t, j, 0))
        self_specs = [pl.BlockSpec((1, l, 1, h), lambda i, j, t, p: (i, 0, kvh(j), 0))] * 2 * own
        norm_specs = []
    else:  # slots of the projection: query head j % g of kv head j // g, then k (slot g) and v (slot g + 1)
        q_spec = pl.BlockSpec((1, bl, 1, 1, h), lambda i, j, t, p: (i, t, j // g, j % g, 0))
        self_specs = [pl.BlockSpec((1, l, 1, 1, h), lambda i, j, t, p, o=o: (i, 0, j // g, g + o, 0)) for o in (0, 1)]
        vectors = norm_args[2]
        norm_specs = [pl.BlockSpec((1, l, h), lambda i, j, t, p: (i, 0, 0))] * 2 + [
            pl.BlockSpec(vectors.shape, lambda i, j, t, p: (0, 0)), pl.BlockSpec((1,), lambda i, j, t, p: (0,))]
    if splits == 1:  # the normalized output
        out_shape = (jax.ShapeDtypeStruct((b, l, n, h), q.dtype),)
        out_specs = (pl.BlockSpec((1, bl, nh, h), lambda i, j, t, p: (i, t, j, 0)),)
    else:  # per split: its output (SPLITS_IN_INPUT_DTYPE), then its max and sum [P, B, L, N] (combine()'s layout)
        stat = jax.ShapeDtypeStruct((splits, b, l, n), f32)
        stat_spec = pl.BlockSpec((1, 1, bl, nh), lambda i, j, t, p: (p, i, t, j))
        part_dtype = q.dtype if SPLITS_IN_INPUT_DTYPE and q.dtype != f32 else f32
        out_shape = (jax.ShapeDtypeStruct((splits, b, l, n, h), part_dtype), stat, stat)
        out_specs = (pl.BlockSpec((1, 1, bl, nh, h), lambda i, j, t, p: (p, i, t, j, 0)), stat_spec, stat_spec)
    outs = pl.pallas_call(
        functools.partial(_kernel, scale=scale, cs=cs, ss=ss, cps=blocks.chunks_per_split, grouped=grouped,
                          stacked=stacked, balanced=balanced, own=own, norm=norm),
        out_shape=out_shape,
        grid=(b, kv if grouped else n, l // bl, splits),
        in_specs=[pl.BlockSpec((1,), lambda i, j, t, p: (0,)),
                  pl.BlockSpec((1, bl), lambda i, j, t, p: (i, t)),
                  q_spec, cache_spec, cache_spec,
                  pl.BlockSpec((1, bl, s), lambda i, j, t, p: (i, t, 0)),
                  *self_specs,
                  *[pl.BlockSpec((1, bl, l), lambda i, j, t, p: (i, t, 0))] * own,
                  *norm_specs],
        out_specs=out_specs,
        interpret=interpret,
        **triton_params(blocks.num_warps, blocks.num_stages, interpret),
    )(layer_arr, extent.astype(jnp.int32), q, k_cache, v_cache, cache_mask.astype(jnp.int8),
      *((k_self, v_self, self_mask.astype(jnp.int8)) if own else ()), *norm_args)
    return outs[0] if splits == 1 else combine(*outs, q.dtype, normalized=outs[0].dtype != f32)
