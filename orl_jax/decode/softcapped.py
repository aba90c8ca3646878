"""Logits handed to the samplers as the LM head's product before its soft-cap (DiffusionGemma's
final_logit_softcapping): logits = cap * tanh(raw / cap) in float32, the product rounded to the model dtype first
(as transformers rounds its lm_head output).

Why: the uniform sampler reads the [256, 262144] logits of a 26B step in two passes of ~100 us each on an H200
(benchmarks/results/2026-12-04_dg_sampler_tail_h200.md), each recomputing the tanh per entry from the bf16 product,
against ~100 us for the bytes of both. With the product itself (SOFTCAP_STATS, read at trace time):
- "xla": the float32 logits, computed where XLA's passes read them (what samplers do with plain logits);
- "raw_max": the row max over the raw product (a bf16 max, no tanh: 37-40 against 59 us alone in session 48's probe,
  2026-12-04_dg_swapped_products_h200.md), capped once per row; the argmax is the first index of the raw maximum;
- "kernel": that, and the statistics pass in kernels/softcap_softmax (one pass writing the bf16 probabilities and
  the chunk sums) where its shapes fit, else "raw_max". On an H200 it made the 26B's generate() 1.6 ms faster (6 of
  6 alternating rounds, benchmarks/results/2026-12-05_dg_softcap_masked_h200.md);
- "one_pass": the statistics kernel's one-pass form (`softcap_one_pass_stats`), no row max before it: each chunk's
  sums are relative to its own maximum, merged without cancellation, and the probabilities are exp(x - shift) with
  a shift fixed by cap / T, which the soft-cap's bound keeps in float32's normal range where cap / T <= 75.5 (the
  caller's lowest temperature says; else "kernel"). Alone at the 26B's [256, 262144] (kernels/softcap_softmax/
  bench.py, session 56): 143.7 us against 165.8 for the row max + "kernel" on an H200, 146.6 against 176.4 on an
  H100. Its bf16 probabilities round differently (another shift), so the random-weight model samples other tokens.
  With the kernel's FAST_MATH (default) its soft-cap and exponentials come from PTX's approximate ex2 / rcp
  (114.8 against 140.7 us alone on an H100, session 62): the logits within ~4e-7 of cap / T of the exact ones;
- "auto" (default): "one_pass" on a GPU (the caller's temperatures permitting, else "kernel"), "xla" elsewhere (on a
  CPU the kernels would run in Pallas' interpreter).
Approximation of all but "xla": the argmax is the raw product's. It equals the argmax of the processed logits (HF's)
wherever distinct raw values stay distinct after the soft-cap and the temperature in float32: for bf16 products,
every raw maximum with 4e-37 < |raw| < 200 (tests/test_softcapped_sampler.py enumerates them on the CPU backend;
above ~200 the float32 tanh saturates and XLA's is not even monotone there). Only bf16 / fp16 products take them;
float32 products (the parity tests' models) always take "xla".
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from orl_jax.model.layers import soft_cap

SOFTCAP_STATS = "auto"
SOFTCAP_STATS_CHOICES = ("auto", "xla", "raw_max", "kernel", "one_pass")


@struct.dataclass
class SoftCapped:
    """The LM head's product [..., V] (the model dtype) and its soft-cap (static: a pytree of one array leaf, so it
    may cross jit boundaries): the logits are `logits()`."""
    raw: jax.Array
    cap: float | None = struct.field(pytree_node=False)

    def logits(self) -> jax.Array:
        return soft_cap(self.raw.astype(jnp.float32), self.cap)


def as_logits(logits) -> jax.Array:
    """float32 logits from either form a sampler is given."""
    return logits.logits() if isinstance(logits, SoftCapped) else logits


def softcapped_parts(logits: SoftCapped, t, t_floor: float | None = None) -> tuple:
    """samplers.softmax_parts of logits.logits() / t under SOFTCAP_STATS, then the probabilities when a kernel wrote
    them (bf16, unnormalized; else None: the caller computes exp(z)) and their offset: the normalized
    probabilities are e * exp(offset - log s) (0 unless "one_pass"). t: the temperature (a traced scalar); t_floor:
    the lowest it can be (static; "one_pass" needs it)."""
    from orl_jax.decode.samplers import _chunk_width, chunk_totals, softmax_parts

    if SOFTCAP_STATS not in SOFTCAP_STATS_CHOICES:
        raise ValueError(f"SOFTCAP_STATS must be one of {SOFTCAP_STATS_CHOICES}, got {SOFTCAP_STATS!r}")
    stats = SOFTCAP_STATS
    if stats == "auto":
        stats = "one_pass" if jax.default_backend() == "gpu" else "xla"
    raw = logits.raw
    x = logits.logits() / t
    if stats == "xla" or raw.dtype not in (jnp.bfloat16, jnp.float16):
        return (*softmax_parts(x), None, 0.0)
    from orl_jax_kernels.softcap_softmax import kernel as sk

    *lead, v = raw.shape
    width = _chunk_width(v)  # samplers' chunks (0: none near sqrt(V), padded there)
    fits = logits.cap is not None and width and sk.supported(v, width)
    unflat = lambda a: a.reshape(*lead, a.shape[-1])  # noqa: E731
    interpret = jax.default_backend() == "cpu"
    if stats == "one_pass" and fits and t_floor is not None and logits.cap / t_floor <= sk.MAX_CAP_OVER_T:
        *chunked, shift = sk.softcap_one_pass_stats(raw.reshape(-1, v), 1.0 / t, cap=logits.cap, width=width,
                                                    interpret=interpret, fast_math=sk.FAST_MATH)
        e, mass, tsum, first, chunk_raw_max, x_max = map(unflat, chunked)
        raw_max = jnp.max(chunk_raw_max, axis=-1, keepdims=True)
        argmax = jnp.min(jnp.where(chunk_raw_max == raw_max, first, v), axis=-1)
        m_kernel, log_s, entropy, mass = sk.one_pass_totals(mass, tsum, x_max)
        m = soft_cap(raw_max.astype(jnp.float32), logits.cap) / t  # as below: z's maximum in x's own expression
        return argmax, x - m, log_s, entropy, mass, e, shift - m_kernel
    raw_max = jnp.max(raw, axis=-1, keepdims=True)  # exact in any dtype
    m = soft_cap(raw_max.astype(jnp.float32), logits.cap) / t  # x's own expression at its maximal entry
    if stats == "raw_max" or not fits:
        return (*softmax_parts(x, m, key=raw, key_max=raw_max), None, 0.0)
    e, mass, tsum, first = sk.softcap_chunk_stats(raw.reshape(-1, v), m.reshape(-1), raw_max.reshape(-1), 1.0 / t,
                                                  cap=logits.cap, width=width, interpret=interpret)
    return (*chunk_totals(unflat(first), x - m, unflat(mass), unflat(tsum)), unflat(e), 0.0)
