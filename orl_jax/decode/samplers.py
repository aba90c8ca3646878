"""Samplers of the two block-diffusion families (METHOD.md §1), as small frozen dataclasses.

A sampler is static under jit (hashable). Its methods work on the whole batch:
- `init(key, batch, length, cfg) -> (canvas [B, L], state)`: the canvas a new block starts from;
- `step(logits, canvas, state, key, step, active) -> StepOut`: one denoising decision from float32 logits, or from
  a softcapped.SoftCapped (the LM head's product and its soft-cap);
- `finalize(canvas, state) -> [B, L]`: the tokens committed when the block is done;
- `max_steps(length)`: the default step cap per block.
Rows with `active=False` (finished block or finished sequence) come out unchanged.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import struct

from orl_jax.checks import int_at_least
from orl_jax.config import ModelConfig
from orl_jax.decode.softcapped import SoftCapped, as_logits, softcapped_parts


@struct.dataclass
class StepOut:
    canvas: jax.Array  # [B, L] next canvas
    state: dict  # sampler-specific carry
    done: jax.Array  # [B] this row's block is finished
    probs: jax.Array  # [B, L, V] the step's (temperature-processed) distribution / probs_scale: the residual's source
    entropy: jax.Array  # [B, L] normalized entropy of probs, in [0, 1]
    resolved: jax.Array  # [B, L] positions decided by this step (filled/accepted)
    probs_scale: jax.Array | None = None  # [B, L]: when set, the distribution is probs * probs_scale[..., None]


def categorical(key: jax.Array, logp: jax.Array, rng: str, mass: jax.Array | None = None) -> jax.Array:
    """Sample token ids from log-probabilities [..., V]; same key -> same sample for every `rng`.

    rng="threefry": Gumbel-max with jax.random's default generator (one noise value per vocabulary entry).
    rng="rbg": the same Gumbel-max, its noise from XLA's RngBitGenerator keyed by bits drawn from `key`.
    rng="inverse_cdf": one uniform per position (threefry) and a two-level search of the cumulative distribution
    (chunk sums, then one chunk's entries). Exact in distribution like the others, but it draws no per-entry
    noise: at [256, 151936] the Gumbel noise (~39M hashed values, two logs each) is most of a uniform step's
    sampler fusion. Its samples differ from Gumbel-max's for the same key. `mass`: the chunk sums of exp(logp) if
    the caller has them already (`softmax_stats`), so the draw reads the logits for no pass of its own."""
    if rng == "inverse_cdf":
        return _inverse_cdf(key, logp, mass)
    if rng == "rbg":
        key = jax.random.wrap_key_data(jax.random.bits(key, (4,), jnp.uint32), impl="rbg")
    return jax.random.categorical(key, logp, axis=-1).astype(jnp.int32)


@functools.cache
def _chunk_width(v: int) -> int:
    """The divisor of v nearest sqrt(v) (its chunks tile the vocabulary without padding); 0 when every divisor is
    far from it (then the caller pads)."""
    root = math.isqrt(v)
    best = min((d for k in range(1, root + 1) if v % k == 0 for d in (k, v // k)), key=lambda d: abs(d - root))
    return best if root // 4 <= best <= root * 4 else 0


def _chunks(x: jax.Array) -> jax.Array:
    """x [..., V] as [..., C, W] chunks of _chunk_width(V) entries (padded with -inf where V has no such width)."""
    *lead, v = x.shape
    w = _chunk_width(v)
    if not w:
        w = 1 << (math.isqrt(v) - 1).bit_length()
        x = jnp.pad(x, [(0, 0)] * len(lead) + [(0, -v % w)], constant_values=-jnp.inf)
    return x.reshape(*lead, -1, w)


# UniformSampler.step's StepOut.probs: exp(x - max) with probs_scale = 1 / sum, the softmax's normalization left to the
# soft embedding's float32 product (one scale per row after the GEMM). The probabilities then wait for no reduction,
# and XLA writes their bf16 copy inside a statistics pass: in generate()'s trace the step's three passes over the
# [256, 262144] logits (77 + 101 + 97 us) became two (100 + 100). The step's tail alone (soft-cap, sampler, soft
# embedding; benchmarks/dg_sampler_tail.py) took 0.921-0.940 against 0.982-1.012 ms. The whole generate(), as two
# compiled programs timed alternately in one process: -0.5 and -1.2 ms per call on two machines (medians of the
# rounds' differences; 8 of 8 rounds faster on the second; a later 2-round check: +4.6, -0.2 ms), at most about
# half the kernel time the trace says is saved (~52 us per step alone on the GPU). z is nearer the float32 product
# (rel. L2 0.17% against 0.28% for transformers' order: bf16(p) @ E rounded, then scaled in bf16). False:
# transformers' order exactly.
UNNORMALIZED_PROBS = True


def softmax_stats(x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """softmax_parts as (argmax, log-probabilities z - log s, entropy, chunk masses)."""
    argmax, z, log_s, entropy, mass = softmax_parts(x)
    return argmax, z - log_s[..., None], entropy, mass


def softmax_parts(x: jax.Array, m: jax.Array | None = None, key: jax.Array | None = None,
                  key_max: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
    """What both samplers need of softmax(x) for float32 logits x [..., V], in two passes over x (XLA's
    log_softmax, entropy and the draw's chunk sums each read it once more: four passes of 155 MB per canvas-256
    step at Qwen3's vocabulary): (argmax [...], z = x - max [..., V] (elementwise, so XLA computes it where it is
    read), log s [...] (log p = z - log s), entropy in nats [...], the chunk masses of the inverse-CDF draw [..., C]
    (sums of the probabilities)). With z = x - max <= 0, s = sum exp(z) >= 1 and t = sum exp(z) z <= 0: entropy =
    log s - t / s, two non-negative terms (no cancellation; z may exceed 0 by an FMA's ~1e-8 where XLA recomputes
    x, see below); log p = z - log s, as jax.nn.log_softmax.
    Pass 1 is a plain max; pass 2 also finds the argmax as the first index with x == max (jnp.argmax's first
    occurrence, exactly), per chunk. At DiffusionGemma's [256, 262144] the argmax's own variadic reduction took 111
    us, the plain max takes 99 (benchmarks/results/2026-12-02_dg_generate_parts_s31_h200.md). One pass with each
    chunk's own max, merged online, was slower (a variadic reduction: 1.038 against 0.982 ms for the step's tail;
    benchmarks/results/2026-12-04_dg_sampler_tail_h200.md).
    m [..., 1]: x's row max when the caller has it; key / key_max [..., 1]: the argmax is the first index where key
    equals key_max instead of x equals m (softcapped.py: the LM head's product and its max)."""
    v = x.shape[-1]
    m = jnp.max(x, axis=-1, keepdims=True) if m is None else m
    key, key_max = (x, m) if key is None else (key, key_max)
    z = x - m
    xc = _chunks(x)
    zc = xc - m[..., None]  # _chunks(z): the padding's -inf stays -inf
    w = zc.shape[-1]
    e = jnp.exp(zc)
    mass = jnp.sum(e, axis=-1)  # [..., C]
    t = jnp.sum(jnp.where(e > 0, e * zc, 0.0), axis=-1)  # [..., C]; an excluded entry adds 0, not 0 * -inf
    index = jnp.arange(zc.shape[-2] * w, dtype=jnp.int32).reshape(zc.shape[-2:])
    # [..., C]: the chunk's first maximal entry, else V. x == m, not z == 0: XLA recomputes x in this pass, and
    # where x is a product (logits times 1 / T after its simplifier) LLVM contracts x - m into one FMA, whose
    # unrounded product leaves z ~1e-8 off 0 at the maximum (CPU, [1, 8, 256]: 157 of 160 rows found no maximum
    # and took index V). A comparison has nothing to contract with.
    first = jnp.min(jnp.where(_chunks(key) == key_max[..., None], index, v), axis=-1)
    # the chunk sums in one multi-output pass: without the barrier XLA folds t's and s's two-level sums into
    # whole-row reductions, which it cannot fuse with the chunk masses' (three passes, 135 us at canvas 256)
    mass, t, first = jax.lax.optimization_barrier((mass, t, first))
    return chunk_totals(first, z, mass, t)


def chunk_totals(first, z, mass, t) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
    """softmax_parts' result from its per-chunk first maxima, sums of exp(z) and of exp(z) z ([..., C] each)."""
    s, t = jnp.sum(mass, axis=-1), jnp.sum(t, axis=-1)
    log_s = jnp.log(s)
    entropy = jnp.maximum(log_s - t / s, 0.0)
    return jnp.min(first, axis=-1), z, log_s, entropy, mass / s[..., None]


def _inverse_cdf(key: jax.Array, logp: jax.Array, mass: jax.Array | None = None) -> jax.Array:
    lead = logp.shape[:-1]
    chunks = _chunks(logp)  # [..., C, W]
    n, w = chunks.shape[-2:]
    if mass is None:
        mass = jnp.sum(jnp.exp(chunks), axis=-1)  # [..., C]
    # XLA's cumsum (reduce_window); as float32 products with a triangular matrix of ones the 26B's generate() was
    # 9.2 ms slower on an H100 (session 63, 2026-12-06_dg_trim_last_layer_h100.md; in git at cb12876)
    cum = jnp.cumsum(mass, axis=-1)
    u = jax.random.uniform(key, tuple(lead), jnp.float32) * cum[..., -1]
    # the first chunk whose cumulative mass exceeds u (it has mass > 0); float rounding at the top end falls back to
    # the last chunk with mass, so a zero-probability entry is never drawn
    last = n - 1 - jnp.argmax(jnp.flip(mass > 0, axis=-1), axis=-1)
    c = jnp.minimum(jnp.sum(cum <= u[..., None], axis=-1), last)
    before = jnp.where(c > 0, jnp.take_along_axis(cum, jnp.maximum(c - 1, 0)[..., None], axis=-1)[..., 0], 0.0)
    p = jnp.exp(jnp.take_along_axis(chunks, c[..., None, None], axis=-2)[..., 0, :])  # [..., W]
    j = jnp.sum(jnp.cumsum(p, axis=-1) <= (u - before)[..., None], axis=-1)
    j = jnp.minimum(j, w - 1 - jnp.argmax(jnp.flip(p > 0, axis=-1), axis=-1))
    return (c * w + j).astype(jnp.int32)


RNGS = ("threefry", "rbg", "inverse_cdf")  # categorical's draws


def _check_rng(rng) -> None:
    if rng not in RNGS:
        raise ValueError(f"rng must be one of {RNGS}, got {rng!r}")


def _check_unit(name: str, v: float | None, allow_none: bool = False) -> None:
    if v is None and allow_none:
        return
    if not isinstance(v, (int, float)) or isinstance(v, bool) or math.isnan(v) or not 0.0 < v <= 1.0:
        raise ValueError(f"{name} must be a number in (0, 1], got {v!r}")


def _check_temperature(name: str, v: float, allow_zero: bool) -> None:
    if not isinstance(v, (int, float)) or isinstance(v, bool) or math.isnan(v) or v < 0 or (v == 0 and not allow_zero):
        raise ValueError(f"{name} must be {'>= 0' if allow_zero else '> 0'} and not NaN, got {v!r}")


# A finite stand-in for -inf where [MASK] leaves the mask family's distribution (the sampler, its replay, RCD's
# training residual): exp() of it is exactly 0 in float32, while 0 * log 0 terms and their gradients stay finite
# (with -inf they are NaN).
EXCLUDED_LOGIT = -1e9


def exclude_token(logits: jax.Array, token_id: int) -> jax.Array:
    """logits [..., V] with token_id's logit set to EXCLUDED_LOGIT (as if it were not in the vocabulary)."""
    return logits.at[..., token_id].set(EXCLUDED_LOGIT)


@dataclass(frozen=True)
class MaskSampler:
    """Mask family (LLaDA 2.x): fill masked positions above `threshold` (at least one per step), or exactly
    `tokens_per_step` lowest-uncertainty ones (LLaDA low-confidence remasking); optionally edit filled tokens whose
    prediction changed with confidence above `edit_threshold`, for up to `max_edit_steps` steps after the block is
    full (LLaDA 2.1). temperature 0 = greedy."""

    mask_token_id: int
    threshold: float | None = 0.9
    tokens_per_step: int | None = None
    edit_threshold: float | None = None
    max_edit_steps: int = 16
    temperature: float = 0.0
    rng: str = "inverse_cdf"  # see `categorical`

    def __post_init__(self):
        if (self.threshold is None) == (self.tokens_per_step is None):
            raise ValueError("MaskSampler needs exactly one of threshold or tokens_per_step, got "
                             f"threshold={self.threshold!r}, tokens_per_step={self.tokens_per_step!r}")
        _check_unit("threshold", self.threshold, allow_none=True)
        _check_unit("edit_threshold", self.edit_threshold, allow_none=True)
        _check_temperature("temperature", self.temperature, allow_zero=True)
        _check_rng(self.rng)
        if self.tokens_per_step is not None:
            int_at_least("tokens_per_step", self.tokens_per_step)
        int_at_least("max_edit_steps", self.max_edit_steps, 0)

    def check_length(self, length: int) -> None:
        if self.tokens_per_step is not None and length % self.tokens_per_step:
            raise ValueError(f"tokens_per_step={self.tokens_per_step} must divide block_length={length}")

    def max_steps(self, length: int) -> int:
        fill = length if self.tokens_per_step is None else length // self.tokens_per_step
        return fill + (self.max_edit_steps if self.edit_threshold is not None else 0)

    def init(self, key, batch: int, length: int, cfg: ModelConfig):
        canvas = jnp.full((batch, length), self.mask_token_id, jnp.int32)
        return canvas, {"edit_steps": jnp.zeros((batch,), jnp.int32), "x0": canvas}

    def finalize(self, canvas, state):
        # a block cut off by the step cap commits its latest predictions where [MASK] is left
        return jnp.where(canvas == self.mask_token_id, state["x0"], canvas)

    def step(self, logits, canvas, state, key, step, active) -> StepOut:
        # [MASK] is never a prediction: a filled position must leave the masked state.
        logits = exclude_token(as_logits(logits), self.mask_token_id)
        scaled = logits if self.temperature == 0 else logits / self.temperature
        argmax, logp, ent, mass = softmax_stats(scaled)
        x0 = argmax if self.temperature == 0 else categorical(key, logp, self.rng, mass)
        conf = jnp.exp(jnp.take_along_axis(logp, x0[..., None], axis=-1)[..., 0])  # [B, L]
        masked = canvas == self.mask_token_id
        mconf = jnp.where(masked, conf, -1.0)
        if self.tokens_per_step is not None:
            # the k most confident masked positions (ties: lowest index), never more than are masked
            rank = jnp.argsort(jnp.argsort(-mconf, axis=-1, stable=True), axis=-1, stable=True)
            fill = masked & (rank < self.tokens_per_step)
        else:
            best = jnp.argmax(mconf, axis=-1)  # at-least-one fallback
            fill = masked & ((conf > self.threshold) | (jnp.arange(canvas.shape[1])[None] == best[:, None]))
        edit = jnp.zeros_like(masked)
        if self.edit_threshold is not None:
            edit = ~masked & (x0 != canvas) & (conf > self.edit_threshold)
        new = jnp.where(fill | edit, x0, canvas)
        still_masked = jnp.any(new == self.mask_token_id, axis=-1)
        edit_steps = state["edit_steps"] + (~jnp.any(masked, axis=-1)).astype(jnp.int32)  # steps run on a full block
        if self.edit_threshold is None:
            done = ~still_masked
        else:
            done = ~still_masked & (~jnp.any(edit, axis=-1) | (edit_steps >= self.max_edit_steps))
        new = jnp.where(active[:, None], new, canvas)
        edit_steps = jnp.where(active, edit_steps, state["edit_steps"])
        x0 = jnp.where(active[:, None], x0, state["x0"])
        return StepOut(canvas=new, state={"edit_steps": edit_steps, "x0": x0}, done=done, probs=jnp.exp(logp),
                       entropy=ent / math.log(logits.shape[-1]), resolved=(fill | edit) & active[:, None])


@dataclass(frozen=True)
class UniformSampler:
    """Uniform-state family (DiffusionGemma; QwenDLM by our reading), following transformers'
    EntropyBoundSampler + StableAndConfidentStoppingCriteria + LinearTemperatureScheduleLogitsProcessor:
    temperature t_min + (t_max - t_min) * r / K at the step with r steps remaining (r = K .. 1); sample a canvas;
    accept the lowest-entropy positions whose entropy sum minus its largest term is <= entropy_bound; re-noise the
    rest with uniform random tokens; stop when the argmax canvas equals the last `stability` argmax canvases and
    the mean entropy is < `confidence`; the block commits its argmax canvas. greedy=True takes the argmax instead of
    sampling the proposal (the temperature still shapes entropies and the residual)."""

    t_max: float = 0.8
    t_min: float = 0.4
    max_denoising_steps: int = 48
    entropy_bound: float = 0.1
    stability: int = 1
    confidence: float = 0.005
    greedy: bool = False
    rng: str = "inverse_cdf"  # see `categorical`

    def __post_init__(self):
        _check_temperature("t_max (temperature)", self.t_max, allow_zero=False)
        _check_temperature("t_min", self.t_min, allow_zero=False)
        int_at_least("max_denoising_steps", self.max_denoising_steps)
        eb = self.entropy_bound
        if not isinstance(eb, (int, float)) or math.isnan(eb) or eb <= 0:
            raise ValueError(f"entropy_bound must be > 0, got {self.entropy_bound!r}")
        _check_rng(self.rng)
        if not isinstance(self.stability, int) or self.stability < 0:
            raise ValueError(f"stability must be an int >= 0, got {self.stability!r}")
        if not isinstance(self.confidence, (int, float)) or math.isnan(self.confidence) or self.confidence < 0:
            raise ValueError(f"confidence must be >= 0, got {self.confidence!r}")

    def check_length(self, length: int) -> None:
        pass

    def max_steps(self, length: int) -> int:
        return self.max_denoising_steps

    def temperature(self, step):
        remaining = self.max_denoising_steps - step  # HF counts steps down: K .. 1
        return self.t_min + (self.t_max - self.t_min) * remaining / self.max_denoising_steps

    def init(self, key, batch: int, length: int, cfg: ModelConfig):
        canvas = jax.random.randint(key, (batch, length), 0, cfg.vocab_size, jnp.int32)
        state = {"argmax": canvas, "history": jnp.full((max(self.stability, 1), batch, length), -1, jnp.int32)}
        return canvas, state

    def finalize(self, canvas, state):
        return state["argmax"]

    def step(self, logits, canvas, state, key, step, active) -> StepOut:
        k_sample, k_noise = jax.random.split(key)
        # HF's processed logits: logits / T. The argmax of them, as HF (no rounding ties); entropy [B, L] in nats.
        # Given the LM head's product (SoftCapped), softcapped.py may read it instead, the probabilities e then
        # written by its kernel
        if isinstance(logits, SoftCapped):
            argmax, z, log_s, ent, mass, e, offset = softcapped_parts(logits, self.temperature(step),
                                                                      min(self.t_min, self.t_max))
        else:
            (argmax, z, log_s, ent, mass), e, offset = softmax_parts(logits / self.temperature(step)), None, 0.0
        logp = z - log_s[..., None]  # [B, L, V]
        proposal = argmax if self.greedy else categorical(k_sample, logp, self.rng, mass)
        order = jnp.argsort(ent, axis=-1, stable=True)
        sorted_ent = jnp.take_along_axis(ent, order, axis=-1)
        keep_sorted = jnp.cumsum(sorted_ent, axis=-1) - sorted_ent <= self.entropy_bound
        accept = jnp.zeros_like(keep_sorted).at[jnp.arange(ent.shape[0])[:, None], order].set(keep_sorted)
        vocab = z.shape[-1]
        noise = jax.random.randint(k_noise, canvas.shape, 0, vocab, jnp.int32)
        new = jnp.where(accept, proposal, noise)
        hist = state["history"]
        stable = jnp.ones_like(active) if self.stability == 0 else jnp.all(hist == argmax[None], axis=(0, 2))
        confident = jnp.mean(ent, axis=-1) < self.confidence
        if self.stability > 0:
            hist = jnp.concatenate([hist[1:], argmax[None]], axis=0)
        keep = active[:, None]
        new_state = {"argmax": jnp.where(keep, argmax, state["argmax"]),
                     "history": jnp.where(keep[None], hist, state["history"])}
        return StepOut(canvas=jnp.where(keep, new, canvas), state=new_state, done=stable & confident,
                       probs=(jnp.exp(z) if e is None else e) if UNNORMALIZED_PROBS else jnp.exp(logp),
                       probs_scale=jnp.exp(offset - log_s) if UNNORMALIZED_PROBS else None,
                       entropy=ent / math.log(vocab), resolved=accept & keep)


Sampler = MaskSampler | UniformSampler
