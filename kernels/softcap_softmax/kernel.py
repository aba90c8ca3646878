"""The uniform sampler's statistics pass over soft-capped logits, read from the LM head's bf16 product: one pass
that writes the unnormalized probabilities and each vocabulary chunk's sums.

Why: at DiffusionGemma's [256, 262144] logits the sampler's two XLA passes took ~100 us each per denoising step
(benchmarks/results/2026-12-04_dg_sampler_tail_h200.md), ~200 us against ~100 for their bytes (a max over the 134
MB product, then the product read again and the bf16 probabilities written). Each recomputes the soft-cap's tanh per
entry. With the row max taken over the raw product (no tanh; orl_jax/decode/softcapped.py), this kernel is the
second pass: per (row, chunk of W entries), with x = cap * tanh(raw / cap) * inv_t (the processed logits) and m
their row max,
- e = exp(x - m), written in bf16 (the probabilities the soft embedding's GEMM reads, unnormalized),
- mass = sum e and t = sum e * (x - m) (the softmax's sum and entropy terms, as samplers.softmax_parts),
- first: the chunk's first index where raw equals its row max (the argmax), else V.

`softcap_one_pass_stats` needs no row max first (see its docstring): each program takes its chunks' own maxima.

Semantics: samplers.softmax_parts' chunk pass on x with the argmax taken on the raw product (softcapped.py says when
they agree); tanh and exp are Triton's (libdevice), so x differs from XLA's by float32 rounding. Pallas, Triton
lowering; interpret mode on CPU for tests.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from orl_jax_kernels.pallas_args import triton_params

# Chunks of W entries per program and its warps, read at trace time. At the 26B ([256, 262144], W = 512), alone
# (bench.py, session 56; us for the one-pass kernel / the row max + the two-pass kernel): 4 chunks and 4 warps
# 143.7 / 159.9 on an H200 and 146.6 / 176.1 on an H100; 8 and 8 (the default before) 153.2 / 165.8 and 156.2 /
# 176.4; 16 chunks 170-231 on both.
CHUNKS_PER_PROGRAM = 4
NUM_WARPS = 4
# A branch-free tanh (one exp2 and one division, constants folded into base-2 exponents; session 55's BRANCH_FREE,
# 482 PTX instructions per thread against 1056) made the row max + this kernel 12-39 us faster alone at 5 of 6 tile
# settings on an H200, but the one-pass kernel not (149.5 against 143.7 us at 4 chunks and 4 warps), and the step's
# tail on an H100 not at all: removed in session 56 (2026-12-05_dg_one_pass_stats_h200.md; git 1481256).


def supported(v: int, width: int, chunks_per_program: int | None = None) -> bool:
    """Vocabulary v in chunks of `width` entries, both powers of two (Triton blocks), the chunks a multiple of the
    chunks per program (CHUNKS_PER_PROGRAM unless given)."""
    chunks_per_program = chunks_per_program or CHUNKS_PER_PROGRAM
    pow2 = lambda n: n >= 1 and not n & (n - 1)  # noqa: E731
    return (pow2(width) and pow2(chunks_per_program) and v % width == 0
            and (v // width) % min(chunks_per_program, v // width) == 0)


def _kernel(inv_t_ref, m_ref, raw_max_ref, raw_ref, e_ref, mass_ref, t_ref, first_ref, *, cap: float, v: int):
    r = raw_ref[0]  # [chunks, W] in the product's dtype
    cpp, w = r.shape
    x = jnp.tanh(r.astype(jnp.float32) / cap) * cap * inv_t_ref[0]  # layers.soft_cap, then / T
    d = x - m_ref[0]
    e = jnp.exp(d)
    e_ref[0] = e.astype(e_ref.dtype)
    mass_ref[0] = jnp.sum(e, axis=1)
    t_ref[0] = jnp.sum(jnp.where(e > 0, e * d, 0.0), axis=1)
    index = ((pl.program_id(1) * cpp + jax.lax.broadcasted_iota(jnp.int32, (cpp, w), 0)) * w
             + jax.lax.broadcasted_iota(jnp.int32, (cpp, w), 1))
    first_ref[0] = jnp.min(jnp.where(r == raw_max_ref[0], index, v), axis=1)


@functools.partial(jax.jit, static_argnames=("cap", "width", "chunks_per_program", "interpret"))
def softcap_chunk_stats(raw: jax.Array, m: jax.Array, raw_max: jax.Array, inv_t: jax.Array, *, cap: float,
                        width: int, chunks_per_program: int | None = None, interpret: bool = False):
    """raw [R, V] (the LM head's product); m [R] float32, the row max of x = cap * tanh(raw / cap) * inv_t;
    raw_max [R] raw's row max (raw's dtype); inv_t: a float32 scalar (1 / temperature) ->
    (e [R, V] in raw's dtype, mass [R, C], t [R, C] float32, first [R, C] int32), C = V / width chunks.
    chunks_per_program: CHUNKS_PER_PROGRAM unless given."""
    rows, v = raw.shape
    chunks_per_program = chunks_per_program or CHUNKS_PER_PROGRAM
    if not supported(v, width, chunks_per_program):
        raise ValueError(f"softcap_chunk_stats: V={v} in chunks of width={width}, {chunks_per_program} per "
                         "program, is not supported (powers of two, V a multiple of the chunks a program takes)")
    if m.shape != (rows,) or raw_max.shape != (rows,):
        raise ValueError(f"softcap_chunk_stats: m {m.shape} and raw_max {raw_max.shape} must be [R] = [{rows}]")
    c = v // width
    cpp = min(chunks_per_program, c)
    row = pl.BlockSpec((1,), lambda i, j: (i,))
    stat = pl.BlockSpec((1, cpp), lambda i, j: (i, j))
    tile = pl.BlockSpec((1, cpp, width), lambda i, j: (i, j, 0))
    e, mass, t, first = pl.pallas_call(
        functools.partial(_kernel, cap=float(cap), v=v),
        out_shape=(jax.ShapeDtypeStruct((rows, c, width), raw.dtype),
                   jax.ShapeDtypeStruct((rows, c), jnp.float32), jax.ShapeDtypeStruct((rows, c), jnp.float32),
                   jax.ShapeDtypeStruct((rows, c), jnp.int32)),
        grid=(rows, c // cpp),
        in_specs=[pl.BlockSpec((1,), lambda i, j: (0,)), row, row, tile],
        out_specs=(tile, stat, stat, stat),
        interpret=interpret,
        **triton_params(NUM_WARPS, 1, interpret),
    )(jnp.reshape(jnp.asarray(inv_t, jnp.float32), (1,)), m.astype(jnp.float32), raw_max,
      raw.reshape(rows, c, width))
    return e.reshape(rows, v), mass, t, first


# The one pass's probabilities e = exp(x - shift) with shift = cap / T - E_TOP: e <= e^E_TOP whatever the row, and
# e >= e^(E_TOP - 2 cap / T) >= e^-E_FLOOR (normal in float32 and bf16, whose smallest normal is e^-87.3) wherever
# cap / T <= (E_TOP + E_FLOOR) / 2 = 75.5: DiffusionGemma's cap 30 at its lowest temperature 0.4 is 75. The soft
# embedding's float32 sums stay below V e^E_TOP max|E| (~2e33 max|E| at V = 262144).
E_TOP, E_FLOOR = 64.0, 87.0
MAX_CAP_OVER_T = (E_TOP + E_FLOOR) / 2


# The one-pass kernel's soft-cap and exponentials from PTX's approximate base-2 exponential and reciprocal (True):
# x = c - 2c / (1 + 2^(r 2 log2(e) / cap)) with c = cap / T, e = 2^((x - shift) log2(e)), the chunk sums taken on e and
# divided once per chunk by e at its maximum. Three MUFU operations and ~15 others per entry against libdevice's tanhf
# and expf. Its x is within ~4e-7 c of the exact soft-cap (the reciprocal's and exponential's relative errors,
# ~2^-22), four orders below the bf16 probabilities' own rounding; it is an approximation all the same (README).
# On an H100 (session 62, benchmarks/results/2026-12-06_dg_fast_math_h100.md): alone 114.8 against 140.7 us at 4
# chunks / 4 warps; Nsight Compute: 101 against 133 us, issue slots 68% against 84% busy (the libdevice form is
# instruction-bound), DRAM 75% against 57%, 48 against 64 registers; generate() -0.74 ms (median of 6 alternating
# rounds, 5 faster, 1 equal). Read at trace time (the caller passes it: the function is jitted). In interpret mode
# (CPU) the same formula runs in exact float32 operations.
FAST_MATH = True
LOG2E = 1.4426950408889634


def _ptx(instruction: str, x):
    """x [float32] through one PTX instruction per entry (Pallas Triton's inline assembly)."""
    from jax.experimental.pallas import triton as pltriton

    return pltriton.elementwise_inline_asm(f"{instruction} $0, $1;", args=[x], constraints="=f,f", pack=1,
                                           result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, jnp.float32)])[0]


def _ex2(x, asm: bool):
    return _ptx("ex2.approx.ftz.f32", x) if asm else jnp.exp2(x)


def _rcp(x, asm: bool):
    return _ptx("rcp.approx.ftz.f32", x) if asm else 1.0 / x


def _fast_soft_cap(r, c, cap: float, asm: bool):
    """c tanh(r / cap) (c = cap / T) as c - 2c / (1 + 2^(2 log2(e) r / cap)): exact at both saturations."""
    return c - (2.0 * c) * _rcp(1.0 + _ex2(r.astype(jnp.float32) * (2.0 * LOG2E / cap), asm), asm)


def one_pass_terms(r, inv_t, shift, *, cap: float, fast_math: bool, asm: bool):
    """The one-pass statistics of each row of r [n, W] (raw product entries, in registers) -> (e [n, W] float32,
    mass, t, the row's first index of its raw maximum, raw_max, x_max, each [n]); also the LM head kernel's epilogue
    (head_stats.py). fast_math: FAST_MATH's formula (asm: PTX's approximations; else in exact operations)."""
    n, w = r.shape
    raw_max = jnp.max(r, axis=1)  # [n]
    if fast_math:
        x, x_max = (_fast_soft_cap(a, cap * inv_t, cap, asm) for a in (r, raw_max))
        exp_shifted = lambda a: _ex2(a * LOG2E - shift * LOG2E, asm)  # noqa: E731
        e = exp_shifted(x)
        # e <= e^E_TOP: a chunk's entries sum far below float32's range. Relative to the chunk's maximum by one
        # division per chunk by e at that maximum, computed by the same operations (its own term is then exactly 1)
        e_max = exp_shifted(x_max)
        mass = jnp.sum(e, axis=1) / e_max
        t = jnp.sum(e * (x - x_max[:, None]), axis=1) / e_max
    else:  # x_max: x's own expression at the chunk's maximum
        x, x_max = (jnp.tanh(a.astype(jnp.float32) / cap) * cap * inv_t for a in (r, raw_max))
        e = jnp.exp(x - shift)  # never under- or overflows (E_TOP)
        # relative to the chunk's maximum: <= 1 (up to the tanh's rounding above ~200, where it saturates); an entry
        # below e^-87 of it may flush to 0, where it adds nothing to the chunk's float32 sums either way
        f = e * jnp.exp(shift - x_max)[:, None]
        mass = jnp.sum(f, axis=1)
        t = jnp.sum(f * (x - x_max[:, None]), axis=1)  # finite: x is bounded by the cap
    first = jnp.min(jnp.where(r == raw_max[:, None], jax.lax.broadcasted_iota(jnp.int32, (n, w), 1), w), axis=1)
    return e, mass, t, first, raw_max, x_max


def _one_pass_kernel(inv_t_ref, shift_ref, raw_ref, e_ref, mass_ref, t_ref, first_ref, raw_max_ref, x_max_ref, *,
                     cap: float, fast_math: bool, asm: bool):
    r = raw_ref[0]  # [chunks, W] in the product's dtype
    cpp, w = r.shape
    e, mass_ref[0], t_ref[0], local, raw_max_ref[0], x_max_ref[0] = one_pass_terms(
        r, inv_t_ref[0], shift_ref[0], cap=cap, fast_math=fast_math, asm=asm)
    e_ref[0] = e.astype(e_ref.dtype)
    first_ref[0] = (pl.program_id(1) * cpp + jax.lax.broadcasted_iota(jnp.int32, (cpp,), 0)) * w + local


@functools.partial(jax.jit, static_argnames=("cap", "width", "chunks_per_program", "interpret", "fast_math"))
def softcap_one_pass_stats(raw: jax.Array, inv_t: jax.Array, *, cap: float, width: int,
                           chunks_per_program: int | None = None, interpret: bool = False, fast_math: bool = False):
    """The statistics pass without the row max before it. raw [R, V] (the LM head's product); inv_t a float32 scalar
    (1 / temperature; the caller checks cap * inv_t <= MAX_CAP_OVER_T) -> per chunk of `width` entries, relative to
    the chunk's own maximum x_max of x = cap * tanh(raw / cap) * inv_t:
    (e [R, V] = exp(x - shift) in raw's dtype with shift = cap * inv_t - E_TOP (returned: the probabilities are
    e * exp(shift - row max) / sum), mass [R, C] = sum exp(x - x_max), t [R, C] = sum exp(x - x_max) (x - x_max),
    first [R, C] the chunk's first index of its raw maximum, raw_max [R, C] in raw's dtype, x_max [R, C] float32,
    shift float32). `one_pass_totals` merges them: without cancellation, as every term is relative to a maximum.
    fast_math: FAST_MATH's formula (PTX's approximations on a GPU)."""
    rows, v = raw.shape
    chunks_per_program = chunks_per_program or CHUNKS_PER_PROGRAM
    if not supported(v, width, chunks_per_program):
        raise ValueError(f"softcap_one_pass_stats: V={v} in chunks of width={width}, {chunks_per_program} per "
                         "program, is not supported (powers of two, V a multiple of the chunks a program takes)")
    c = v // width
    cpp = min(chunks_per_program, c)
    inv_t = jnp.reshape(jnp.asarray(inv_t, jnp.float32), (1,))
    shift = cap * inv_t - E_TOP
    scalar = pl.BlockSpec((1,), lambda i, j: (0,))
    stat = pl.BlockSpec((1, cpp), lambda i, j: (i, j))
    tile = pl.BlockSpec((1, cpp, width), lambda i, j: (i, j, 0))
    per_chunk = lambda dtype: jax.ShapeDtypeStruct((rows, c), dtype)  # noqa: E731
    e, mass, t, first, raw_max, x_max = pl.pallas_call(
        functools.partial(_one_pass_kernel, cap=float(cap), fast_math=fast_math, asm=fast_math and not interpret),
        out_shape=(jax.ShapeDtypeStruct((rows, c, width), raw.dtype), per_chunk(jnp.float32), per_chunk(jnp.float32),
                   per_chunk(jnp.int32), per_chunk(raw.dtype), per_chunk(jnp.float32)),
        grid=(rows, c // cpp),
        in_specs=[scalar, scalar, tile],
        out_specs=(tile, stat, stat, stat, stat, stat),
        interpret=interpret,
        **triton_params(NUM_WARPS, 1, interpret),
    )(inv_t, shift, raw.reshape(rows, c, width))
    return e.reshape(rows, v), mass, t, first, raw_max, x_max, shift[0]


def one_pass_totals(mass, t, x_max):
    """The row's statistics from softcap_one_pass_stats' chunks ([..., C] each): (x's row max M, log s with
    s = sum exp(x - M), entropy = log s - sum exp(x - M) (x - M) / s, the chunks' probability masses). Each chunk's
    terms are rescaled by exp(x_max - M) <= 1: t + (x_max - M) mass <= 0 and mass >= 0, so nothing cancels."""
    m = jnp.max(x_max, axis=-1)
    scale = jnp.exp(x_max - m[..., None])
    mass = mass * scale
    s = jnp.sum(mass, axis=-1)
    tsum = jnp.sum(scale * t + (x_max - m[..., None]) * mass, axis=-1)
    log_s = jnp.log(s)
    return m, log_s, jnp.maximum(log_s - tsum / s, 0.0), mass / s[..., None]
