"""The LM head's GEMM with the sampler's one-pass statistics in its epilogue: h [R, K] @ w [V, K]^T (the embedding's
own layout), each output tile soft-capped, exponentiated and reduced while it is still in registers.

Why it was built: at DiffusionGemma's canvas the head (cuBLAS, ~545 us per step on an H200) writes the [256, 262144]
bf16 product and `kernel.softcap_one_pass_stats` (~144 us) reads it back to write the probabilities and the chunk
sums. Here the GEMM's programs do both: the product is written as before (the draw reads one chunk of it per row),
the probabilities e beside it, and the statistics per BN-wide piece of a row, which `merge_pieces` folds into the
samplers' W-wide chunks exactly as `one_pass_totals` folds chunks into rows (every term relative to a maximum).

Measured (benchmarks/results/2026-12-06_dg_head_stats_h100.md, H100): slower, so the engine does not use it. Triton's
GEMM alone runs the head at best 741 us against cuBLAS' 646, and the epilogue costs 285 us or more inside it (its
best setting 1083 us against 771 for cuBLAS + the one-pass kernel). Kept with its tests and
`head_bench.py` so the probe can be repeated on a later Triton.

Semantics: `softcap_one_pass_stats(bf16(h @ w^T), ...)` merged into W-wide chunks: the product is rounded to the
output dtype before the soft-cap, as transformers rounds its lm_head output; the float32 accumulation order is
Triton's (a GEMM's rounding, not the same bits as cuBLAS'). Pallas, Triton lowering; interpret mode on CPU for
tests.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from orl_jax_kernels.pallas_args import triton_params
from orl_jax_kernels.softcap_softmax.kernel import E_TOP, one_pass_terms


@dataclass(frozen=True)
class Tiles:
    bm: int = 128  # rows of h per program
    bn: int = 128  # vocabulary entries per program (a piece of a chunk: W % bn == 0)
    bk: int = 64  # contraction depth per pipelined step
    num_warps: int = 8
    num_stages: int = 4


TILES = Tiles()  # read at trace time


def supported(rows: int, k: int, v: int, width: int, tiles: Tiles | None = None) -> bool:
    """Row, contraction and vocabulary sizes in whole tiles, the samplers' chunk width in whole pieces."""
    t = tiles or TILES
    return rows % t.bm == 0 and k % t.bk == 0 and v % t.bn == 0 and width % t.bn == 0 and v % width == 0


def _kernel(inv_t_ref, shift_ref, h_ref, w_ref, raw_ref, e_ref, mass_ref, t_ref, first_ref, raw_max_ref, x_max_ref,
            *, cap: float, bk: int, stats: bool):
    bm, k = h_ref.shape
    bn = w_ref.shape[0]

    def body(j, acc):
        k0 = pl.multiple_of(j * bk, bk)
        return acc + jax.lax.dot_general(h_ref[:, pl.ds(k0, bk)], w_ref[:, pl.ds(k0, bk)], (((1,), (1,)), ((), ())),
                                         preferred_element_type=jnp.float32)

    r = jax.lax.fori_loop(0, k // bk, body, jnp.zeros((bm, bn), jnp.float32)).astype(raw_ref.dtype)
    raw_ref[...] = r
    if not stats:  # the bare GEMM (benchmarks: what the epilogue costs)
        return
    # the one-pass kernel's own terms on the tile's rows (libdevice's form: this kernel was measured with it)
    e, mass_ref[0], t_ref[0], local, raw_max_ref[0], x_max_ref[0] = one_pass_terms(
        r, inv_t_ref[0], shift_ref[0], cap=cap, fast_math=False, asm=False)
    e_ref[...] = e.astype(e_ref.dtype)
    first_ref[0] = pl.program_id(1) * bn + local


@functools.partial(jax.jit, static_argnames=("cap", "tiles", "stats", "interpret"))
def head_one_pass_pieces(h: jax.Array, w: jax.Array, inv_t: jax.Array, *, cap: float, tiles: Tiles | None = None,
                         stats: bool = True, interpret: bool = False):
    """h [R, K] @ w [V, K]^T in h's dtype (raw), and per BN-wide piece of each row what softcap_one_pass_stats gives
    per chunk: (raw [R, V], e [R, V] = exp(x - shift) in raw's dtype, then [R, P] each with P = V / BN: mass, t,
    first (global index), raw_max, x_max; shift). stats=False: raw alone (the others None)."""
    t = tiles or TILES
    (rows, k), v = h.shape, w.shape[0]
    if w.shape[1] != k or w.dtype != h.dtype:
        raise ValueError(f"head_one_pass_pieces: h {h.shape} {h.dtype} and w {w.shape} {w.dtype} must share K and "
                         "dtype")
    if not supported(rows, k, v, t.bn, t):
        raise ValueError(f"head_one_pass_pieces: R={rows}, K={k}, V={v} not in whole tiles of {t}")
    inv_t = jnp.reshape(jnp.asarray(inv_t, jnp.float32), (1,))
    shift = cap * inv_t - E_TOP
    p = v // t.bn
    scalar = pl.BlockSpec((1,), lambda i, j: (0,))
    tile = pl.BlockSpec((t.bm, t.bn), lambda i, j: (i, j))
    piece = pl.BlockSpec((1, t.bm), lambda i, j: (j, i))  # [P, R]: a program writes one piece of bm rows
    per_piece = lambda dtype: jax.ShapeDtypeStruct((p, rows), dtype)  # noqa: E731
    out_shape = [jax.ShapeDtypeStruct((rows, v), h.dtype)]
    out_specs = [tile]
    if stats:
        out_shape += [jax.ShapeDtypeStruct((rows, v), h.dtype), per_piece(jnp.float32), per_piece(jnp.float32),
                      per_piece(jnp.int32), per_piece(h.dtype), per_piece(jnp.float32)]
        out_specs += [tile, piece, piece, piece, piece, piece]

    def kernel(inv_t_ref, shift_ref, h_ref, w_ref, raw_ref, *rest):
        refs = rest if stats else (None,) * 6
        _kernel(inv_t_ref, shift_ref, h_ref, w_ref, raw_ref, *refs, cap=float(cap), bk=t.bk, stats=stats)

    out = pl.pallas_call(
        kernel,
        out_shape=tuple(out_shape),
        grid=(rows // t.bm, p),  # rows fastest: the programs sharing a weight tile run side by side (L2)
        in_specs=[scalar, scalar, pl.BlockSpec((t.bm, k), lambda i, j: (i, 0)),
                  pl.BlockSpec((t.bn, k), lambda i, j: (j, 0))],
        out_specs=tuple(out_specs),
        interpret=interpret,
        **triton_params(t.num_warps, t.num_stages, interpret),
    )(inv_t, shift, h, w)
    if not stats:
        return out[0], None, None, None, None, None, None, shift[0]
    raw, e, *pieces = out
    return raw, e, *(a.T for a in pieces), shift[0]


def merge_pieces(per_chunk: int, mass, t, first, raw_max, x_max):
    """Pieces [R, P] (consecutive along the vocabulary) folded into chunks of `per_chunk` pieces: what
    softcap_one_pass_stats returns per chunk ([R, C] each, C = P / per_chunk). A chunk's maximum is its pieces'
    largest (the soft-cap is monotone: the largest x_max is the one at the largest raw_max); each piece's sums are
    rescaled by exp(x_max_piece - x_max_chunk) <= 1 and its entropy term shifted by that difference times its mass
    (as one_pass_totals); the argmax is the first piece holding the chunk's raw maximum."""
    rows, p = mass.shape
    if per_chunk < 1 or p % per_chunk:
        raise ValueError(f"merge_pieces: {p} pieces per row do not fold into chunks of per_chunk={per_chunk}")
    if per_chunk == 1:
        return mass, t, first, raw_max, x_max
    mass, t, first, raw_max, x_max = (a.reshape(rows, p // per_chunk, per_chunk)
                                      for a in (mass, t, first, raw_max, x_max))
    chunk_x = jnp.max(x_max, axis=-1)
    d = x_max - chunk_x[..., None]
    scale = jnp.exp(d)
    chunk_raw = jnp.max(raw_max, axis=-1)
    chunk_first = jnp.min(jnp.where(raw_max == chunk_raw[..., None], first, jnp.iinfo(jnp.int32).max), axis=-1)
    return (jnp.sum(scale * mass, axis=-1), jnp.sum(scale * (t + d * mass), axis=-1), chunk_first, chunk_raw,
            chunk_x)


def head_one_pass_stats(h: jax.Array, w: jax.Array, inv_t: jax.Array, *, cap: float, width: int,
                        tiles: Tiles | None = None, interpret: bool = False):
    """(raw [R, V], then softcap_one_pass_stats' outputs for the product bf16(h @ w^T): e [R, V], mass, t, first,
    raw_max, x_max [R, C] per chunk of `width` entries, shift)."""
    t = tiles or TILES
    if width % t.bn:
        raise ValueError(f"head_one_pass_stats: width={width} is not a whole number of BN={t.bn} pieces")
    raw, e, *pieces, shift = head_one_pass_pieces(h, w, inv_t, cap=cap, tiles=t, interpret=interpret)
    return raw, e, *merge_pieces(width // t.bn, *pieces), shift
