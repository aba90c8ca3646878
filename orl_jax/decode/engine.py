"""generate(): the whole block-diffusion generation as one jitted, device-side `lax.while_loop`.

One loop iteration = one denoising forward over the active block's canvas (reading the KV cache of the committed
prefix) + the sampler's decision. When every active row has finished the block (or the step cap is reached),
the same iteration finalizes the block, writes it to the output, marks rows that produced EOS, and — if another
block will follow — runs the commit forward that writes the block's K/V into the cache (under `lax.cond`, so
only when needed). Models with fused passes (DiffusionGemma) run the prefill together with the first step's forward
(that step runs before the loop, through the same body), and each commit together with the next step's forward
(FUSED_FIRST_STEP, FUSED_COMMIT). Nothing returns to the host until the loop ends; prompts are left-padded to a
bucket length so a new prompt length inside a bucket reuses the compiled program. Plain calls on a GPU run the
loop's start (_start: the prefill, the fused first step) and the loop (_finish) as two programs (SPLIT_START);
elsewhere they are one (_generate_loop).

Capture mode (static flag, a separate compiled program; the plain path carries no buffers) also records every
step's input canvas, the residual (z, a) it consumed, the step's normalized entropies and resolved positions:
what the ORL trainer replays.
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from orl_jax import params as P
from orl_jax.checks import int_at_least
from orl_jax.config import ModelConfig, xla_for_auto
from orl_jax.decode.residual import NoResidual, ORLResidual, RCDResidual, Residual, soft_embed
from orl_jax.decode.samplers import MaskSampler, Sampler, UniformSampler
from orl_jax.decode.softcapped import SoftCapped
from orl_jax.decode.state import DecodeState, GenerateOutput
from orl_jax.diffusion_gemma_config import DiffusionGemmaConfig
from orl_jax.model.registry import model_module
from orl_jax.runtime import DG_COMPILER_OPTIONS, ENGINE_COMPILER_OPTIONS, xla_flags_set
from orl_jax.sharding import named_sharding

MIN_BUCKET = 16
# Models with a `prefill_decode` (DiffusionGemma) run the prompt's prefill and the first denoising forward as one
# pass: each layer's weights are read once for both (the 26B's expert stacks, ~11 ms of a forward). False: a
# separate prefill, then every forward inside the loop (a benchmark switch; the same tokens up to rounding). Read
# at trace time.
FUSED_FIRST_STEP = True
# ... and `commit_decode` (DiffusionGemma): a finished block's commit forward and the next block's first denoising
# forward as one pass, taken by the step after the block finished (its forward then runs under a lax.cond: the fused
# pass or the plain one). False: the commit under its own lax.cond in the step that finished the block. Read at trace
# time.
FUSED_COMMIT = True
# Plain calls (one device, no streaming, no capture) run the loop into a workspace the engine keeps per compiled
# program and donates to each call, so the program's outputs, which XLA's buffer assignment shares with the loop's
# own values, sit at the same addresses every time; the caller gets copies from a second, small program. Why: XLA
# updates a command buffer on the host whenever an allocation it holds moves, and the outputs' allocations are
# fresh at each call. On an H100 host the graph holding DiffusionGemma's loop (230 commands) was updated at every
# call, 8 allocations (generate()'s 8 outputs), median 1.68 ms (XLA's log, session 56,
# benchmarks/results/2026-12-05_dg_one_pass_stats_h200.md). With the workspace the 26B's generate() ran 2.3 ms
# faster on an H100, 6 of 6 alternating rounds, the same tokens (session 58,
# benchmarks/results/2026-12-06_dg_output_workspace_h100.md). "auto": on where the backend is a GPU (CUDA graphs);
# True / False: on / off everywhere. Read at call time.
OUTPUT_WORKSPACE: bool | str = "auto"
# With the workspace, a plain call runs as two programs (True): the loop's start (the prompt's prefill, with the first
# denoising step where the model fuses them) and then the loop, the start's state in a donated workspace too, so
# neither program's CUDA graph sees new addresses. Why: before XLA submits a program's graph it prepares every
# command of it on the host, updates the graph where an input moved (the prompt's buffer is new at every call) and
# launches it; as one program the 26B's generate() spent ~1.8 ms dispatching it on an H100 host, with nothing queued
# on the GPU (session 61's host probe). As two, the host prepares the loop's program while the GPU runs the prefill.
# The 26B's generate(), median of 6 alternating rounds, the same tokens: -2.16 ms on an H100 (6 of 6 faster), +0.19
# ms for one program on an H200 (3 of 6: neutral) (session 61, benchmarks/results/2026-12-06_dg_split_start_h100.md,
# 2026-12-06_dg_split_start_h200.md). The cost: the last call's state (its KV cache included) stays on the device
# per compiled program, beside the output workspace. False: one program. Read at call time.
SPLIT_START: bool = True
# ... and with SPLIT_START, the loop's program takes the start's state donated and hands back its last state in the
# same buffers (kept for the next call's start), so the loop runs in them. Without it the loop's program copies every
# carried buffer the loop updates at entry, since a while loop cannot update an input it does not own: at the 26B,
# where blocks are committed in the loop, the KV caches (~175 MB at 768 slots, ~0.09 ms on an H200 by bandwidth;
# tests/test_loop_copies.py). Read at call time.
DONATE_STATE: bool = True
# ... and with SPLIT_START, the fused first pass's first N layer groups as a program of their own (DiffusionGemma:
# prefill_decode_first / _rest; 0: not split). The GPU then waits only for that small program's host-side
# preparation, and runs its groups while the host prepares the start's and the loop's. N = 1 on an H100: -0.60 ms,
# 4 of 6 rounds, within the keys' 1.1 ms spread (2026-12-06_dg_split_start_h200.md, call 2). Off until an H200
# measures it; read at call time.
SPLIT_START_GROUPS: int = 0


@dataclass(frozen=True)
class DecodeConfig:
    """Static decoding settings (hashable: part of the compiled program's identity)."""

    sampler: Sampler
    residual: Residual
    block_length: int
    num_blocks: int
    max_steps: int  # cap on denoising steps per block
    eos_token_ids: tuple[int, ...]
    pad_token_id: int
    capture: bool = False
    stream: bool = False


# --- streaming: a host callback per finished block ------------------------------------------------------------
_stream_lock = threading.Lock()
_stream_fn: list[Callable | None] = [None]


def _emit(block_tokens, block_index):
    fn = _stream_fn[0]
    if fn is not None:
        fn(np.asarray(block_tokens), int(block_index))


# --- the device-side loop --------------------------------------------------------------------------------------

def _select(pred, a, b):
    return jax.tree.map(lambda x, y: jnp.where(pred, x, y), a, b)


def _finalize_block(dcfg: DecodeConfig, tokens_block, seq_done):
    """Pad rows already finished and everything after a row's first EOS; report which rows hit EOS."""
    pad = dcfg.pad_token_id
    tokens_block = jnp.where(seq_done[:, None], pad, tokens_block)
    if not dcfg.eos_token_ids:
        return tokens_block, jnp.zeros_like(seq_done)
    is_eos = jnp.isin(tokens_block, jnp.asarray(dcfg.eos_token_ids, jnp.int32)) & ~seq_done[:, None]
    before = jnp.cumsum(is_eos, axis=-1) - is_eos  # EOS strictly before this position
    return jnp.where(before > 0, pad, tokens_block), jnp.any(is_eos, axis=-1)


def _generate(params, prompt, lengths, key, *, cfg: ModelConfig, dcfg: DecodeConfig, devices: int) -> GenerateOutput:
    """Run the compiled loop. Where the options were measured on an H200 (one device, no streaming, no capture,
    called from Python: jax.jit's compiler_options apply to top-level programs only), Qwen3 / QwenDLM take
    runtime.ENGINE_COMPILER_OPTIONS (the loop in CUDA graphs) and DiffusionGemma runtime.DG_COMPILER_OPTIONS
    (the same, with concurrent graph branches), each unless XLA_FLAGS sets the same thing itself. Everything else
    compiles with XLA's defaults: a mesh's collectives, the streaming host callback and the capture buffers in the
    loop (not measured). The graphed program on a GPU also unrolls the layer stack unless cfg.layer_unroll says
    otherwise (config.py)."""
    plain = (devices == 1 and not dcfg.stream and not dcfg.capture
             and not any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves((params, key))))
    if plain and isinstance(cfg, ModelConfig) and "--xla_gpu_enable_command_buffer" not in xla_flags_set():
        cfg, run, run_into = graphed_config(cfg, jax.default_backend()), _run_graphed, _run_graphed_into
    elif plain and isinstance(cfg, DiffusionGemmaConfig) and not (
            {"--xla_gpu_command_buffer_scheduling_mode", "--xla_gpu_enable_command_buffer"} & xla_flags_set()):
        run, run_into = _run_concurrent, _run_concurrent_into
    else:
        return _run(params, prompt, lengths, key, cfg=cfg, dcfg=dcfg)
    if not _use_workspace():
        return run(params, prompt, lengths, key, cfg=cfg, dcfg=dcfg)
    # the workspace leaves the table while the call runs: a concurrent call of the same program makes its own
    slot = (run_into, cfg, dcfg, prompt.shape)
    workspace = _workspaces.pop(slot, None)
    if workspace is None:
        workspace = output_workspace(prompt.shape[0], dcfg)
        # the copy compiled before the loop's program first runs: XLA drops every other program's recorded CUDA
        # graphs whenever it builds a new program (CommandBufferThunk's constructor), so a copy compiled after it
        # would cost the loop's next call a fresh recording of its graphs on the host
        _copy_out(workspace)
    if _split_start():
        start, finish, start_first, in_place = _split_concurrent if run_into is _run_concurrent_into else _split_graphed
        first, groups = None, _start_groups(cfg, dcfg)
        if groups:  # the fused first pass's first layer groups as a program of their own, before the start's
            first_slot = (start_first, cfg, dcfg, prompt.shape, groups)
            first = _workspaces.pop(first_slot, None)
            if first is None:
                first = _workspace_like(functools.partial(_start_first, cfg=cfg, dcfg=dcfg, groups=groups), key,
                                        params, prompt, lengths, key)
            first = start_first(first, params, prompt, lengths, key, cfg=cfg, dcfg=dcfg, groups=groups)
        start_slot = (start, cfg, dcfg, prompt.shape, groups)
        state = _workspaces.pop(start_slot, None)
        if state is None:
            state = _workspace_like(functools.partial(_start, cfg=cfg, dcfg=dcfg), key,
                                    params, prompt, lengths, key, first)
        # the loop's program reads the state that the next call's start overwrites: jax orders the two on the device
        state = start(state, params, prompt, lengths, key, first, cfg=cfg, dcfg=dcfg)
        if groups:
            _workspaces[first_slot] = first
        if _donate_state():  # the loop runs in the state's buffers and hands them back for the next call's start
            out, state = in_place(workspace, params, state, cfg=cfg, dcfg=dcfg)
        else:
            out = finish(workspace, params, state, cfg=cfg, dcfg=dcfg)
        _workspaces[start_slot] = state
    else:
        out = run_into(workspace, params, prompt, lengths, key, cfg=cfg, dcfg=dcfg)
    _workspaces[slot] = out
    return _copy_out(out)


def _use_workspace() -> bool:
    """OUTPUT_WORKSPACE resolved for this backend; another value is refused by name (generate() checks it before
    anything compiles, whichever path the call takes)."""
    if OUTPUT_WORKSPACE not in (True, False, "auto"):
        raise ValueError(f"engine.OUTPUT_WORKSPACE must be True, False or 'auto', got {OUTPUT_WORKSPACE!r}")
    return jax.default_backend() == "gpu" if OUTPUT_WORKSPACE == "auto" else OUTPUT_WORKSPACE


def _split_start() -> bool:
    """SPLIT_START, checked (generate() refuses another value by name before anything compiles)."""
    if SPLIT_START not in (True, False):
        raise ValueError(f"engine.SPLIT_START must be True or False, got {SPLIT_START!r}")
    return SPLIT_START


def _donate_state() -> bool:
    """DONATE_STATE, checked (generate() refuses another value by name before anything compiles)."""
    if not isinstance(DONATE_STATE, bool):
        raise ValueError(f"engine.DONATE_STATE must be True or False, got {DONATE_STATE!r}")
    return DONATE_STATE


def _start_groups(cfg, dcfg: DecodeConfig) -> int:
    """SPLIT_START_GROUPS where it applies (a model with the fused first pass in two parts, the pass taken), else 0;
    a value outside [0, layer groups) is refused by name."""
    g = SPLIT_START_GROUPS
    if not isinstance(g, int) or isinstance(g, bool) or g < 0:
        raise ValueError(f"engine.SPLIT_START_GROUPS must be an int >= 0, got {g!r}")
    if not g or not _passes(cfg, dcfg)[0] or not hasattr(model_module(cfg), "prefill_decode_first"):
        return 0
    if g >= cfg.num_groups:
        raise ValueError(f"engine.SPLIT_START_GROUPS must be < the model's {cfg.num_groups} layer groups, got {g}")
    return g


def _workspace_like(fn, key, *args):
    """Values in the shapes and dtypes of fn(*args) (what SPLIT_START first donates to its programs): zeros, and keys
    derived from `key` where the output holds keys (never the caller's own key, which donation would delete)."""
    shapes = jax.eval_shape(fn, *args)

    def fill(s):
        if not jnp.issubdtype(s.dtype, jax.dtypes.prng_key):
            return jnp.zeros(s.shape, s.dtype)
        return jax.random.split(key, math.prod(s.shape)).reshape(s.shape) if s.shape else jax.random.fold_in(key, 0)

    return jax.tree.map(fill, shapes)


def output_workspace(batch: int, dcfg: DecodeConfig) -> GenerateOutput:
    """Zeros in the shapes and dtypes of a plain call's GenerateOutput (what OUTPUT_WORKSPACE donates)."""
    i32, f32 = jnp.int32, jnp.float32
    b, nb = batch, dcfg.num_blocks
    return GenerateOutput(tokens=jnp.zeros((b, nb * dcfg.block_length), i32), lengths=jnp.zeros((b,), i32),
                          forwards=jnp.zeros((b,), i32), total_forwards=jnp.zeros((), i32),
                          commits=jnp.zeros((), i32), steps_per_block=jnp.zeros((nb,), i32),
                          tpf=jnp.zeros((b,), f32), tpf_hf=jnp.zeros((b,), f32))


def _loop_into(workspace, params, prompt, lengths, key, *, cfg, dcfg: DecodeConfig) -> GenerateOutput:
    """_generate_loop, its outputs in `workspace` (donated, and kept as an argument though unread: XLA then aliases
    each output with its buffer)."""
    del workspace
    return _generate_loop(params, prompt, lengths, key, cfg=cfg, dcfg=dcfg)


def graphed_config(cfg: ModelConfig, backend: str) -> ModelConfig:
    """The config the graphed program compiles: on a GPU the layer stack unrolled, unless cfg.layer_unroll is set."""
    return cfg.replace(layer_unroll=cfg.num_layers) if cfg.layer_unroll is None and backend == "gpu" else cfg


def _passes(cfg: ModelConfig, dcfg: DecodeConfig) -> tuple[bool, bool, bool]:
    """(fused, fused_commits, shift): whether the prompt's prefill and the first denoising forward run as one pass,
    whether a finished block's commit and the next block's first forward do, and whether the canvas' first logits
    come from the last committed token (logit_shift)."""
    model = model_module(cfg)
    shift = getattr(cfg, "logit_shift", False)
    fused = FUSED_FIRST_STEP and hasattr(model, "prefill_decode") and not shift
    fused_commits = FUSED_COMMIT and dcfg.num_blocks > 1 and hasattr(model, "commit_decode") and not shift
    return fused, fused_commits, shift


def _head(cfg: ModelConfig, out):
    """A pass's output as the samplers take it: a soft-capped model (DiffusionGemma) hands them its LM head's
    product and the cap (softcapped.py)."""
    return SoftCapped(out, cfg.final_logit_softcapping) if hasattr(model_module(cfg), "cap_logits") else out


def _raw_out(cfg: ModelConfig) -> dict:
    """The passes' keyword for the head's product (soft-capped models)."""
    return {"capped": False} if hasattr(model_module(cfg), "cap_logits") else {}


def _forward(params, s: DecodeState, *, cfg: ModelConfig, dcfg: DecodeConfig):
    """One denoising forward over the canvas -> (logits [B, L, V], cache)."""
    model = model_module(cfg)
    L = dcfg.block_length
    _, fused_commits, shift = _passes(cfg, dcfg)
    x = dcfg.residual.embed(params, cfg, s.canvas, s.z, s.a)
    if fused_commits:  # a block finished last step: its commit and this forward in one pass
        # The loop runs on after a finished block only when the block needed its commit (another block follows,
        # some row is not done), so a new block's first step in the loop is exactly a step with a commit owed.
        pending = (s.step == 0) & (s.block > 0)

        def commit_then(c):
            block = jax.lax.dynamic_slice_in_dim(s.tokens, (s.block - 1) * L, L, axis=1)
            return model.commit_decode(params, cfg, block, c, s.canvas, embeds=x, capped=False, write=False)

        def plain(c):  # the slots a commit would write, as they are: written back below, they change nothing
            return model.decode(params, cfg, s.canvas, c, embeds=x, capped=False), c.read(L)

        # the branches hand out the head's product (bf16 at the 26B: 134 MB), soft-capped inside the sampler's
        # passes, as the plain path does; float32 logits out of the cond were written whole. They only read the
        # cache and the block's K/V is written after the cond: a branch handing the cache back made XLA copy the
        # whole cache twice per step (benchmarks/hlo_copies.py), ~0.2 ms per step at the 26B's 768 slots.
        raw, kv = jax.lax.cond(pending, commit_then, plain, s.cache)
        return _head(cfg, raw), s.cache.write(*kv, advance=pending)
    shifted = {"prev_hidden": s.prev_h} if shift else {}
    return _head(cfg, model.decode(params, cfg, s.canvas, s.cache, embeds=x, **shifted, **_raw_out(cfg))), s.cache


def _advance(params, s: DecodeState, logits, cache, *, cfg: ModelConfig, dcfg: DecodeConfig) -> DecodeState:
    """The step's decisions from its forward's output."""
    model = model_module(cfg)
    L, nb, sampler = dcfg.block_length, dcfg.num_blocks, dcfg.sampler
    _, fused_commits, shift = _passes(cfg, dcfg)
    b = s.canvas.shape[0]
    key, k_step, k_init = jax.random.split(s.key, 3)
    active = ~(s.block_done | s.seq_done)
    out = sampler.step(logits, s.canvas, s.sampler, k_step, s.step, active)
    keep = active[:, None]
    block_done = s.block_done | (out.done & active)
    step = s.step + 1
    finish = jnp.all(block_done | s.seq_done) | (step >= dcfg.max_steps)
    z, a = s.z, s.a
    if not isinstance(dcfg.residual, NoResidual):
        a = jnp.where(keep, out.entropy, s.a)
        # A block's last step computes z for nothing (it is zeroed below). Skipping it under a lax.cond on `finish`
        # made the 26B's generate() 1.2 ms slower on an H100 (session 58,
        # benchmarks/results/2026-12-06_dg_output_workspace_h100.md): every step pays the cond. Carrying the
        # distribution in the loop's state and embedding it at the next step's start (the last step then skips
        # it) made it 1.3 ms slower, 6 of 6 rounds (session 69, 2026-12-07_dg_lazy_residual_h100.md).
        z = jnp.where(keep[..., None], soft_embed(params, cfg, out.probs, out.probs_scale), s.z)
    cap = s.capture
    if cap is not None:
        i = s.total_forwards
        rec = {"canvas": s.canvas, "z": s.z, "a": s.a, "entropy": out.entropy, "resolved": out.resolved,
               "active": active, "block": s.block, "step": s.step}
        cap = {k: cap[k].at[i].set(rec[k]) for k in cap}

    final, eos = _finalize_block(dcfg, sampler.finalize(out.canvas, out.state), s.seq_done)
    seq_done = jnp.where(finish, s.seq_done | eos, s.seq_done)
    tokens = jnp.where(finish, jax.lax.dynamic_update_slice(s.tokens, final, (0, s.block * L)), s.tokens)
    need_commit = finish & (s.block + 1 < nb) & ~jnp.all(seq_done)

    def commit(c, h):  # with the shift, the block's last hidden state starts the next block
        return model.commit(params, cfg, final, c, True) if shift else (model.commit(params, cfg, final, c), h)

    prev_h = s.prev_h
    if nb > 1 and not fused_commits:  # one block never commits: no commit forward traced
        cache, prev_h = jax.lax.cond(need_commit, commit, lambda c, h: (c, h), cache, s.prev_h)
    if dcfg.stream:
        jax.lax.cond(finish, lambda: jax.debug.callback(_emit, final, s.block, ordered=True), lambda: None)

    canvas0, sstate0 = sampler.init(k_init, b, L, cfg)
    return DecodeState(
        tokens=tokens,
        canvas=jnp.where(finish, canvas0, out.canvas),
        sampler=_select(finish, sstate0, out.state),
        z=jnp.where(finish, jnp.zeros_like(z), z),
        a=jnp.where(finish, jnp.zeros_like(a), a),
        cache=cache,
        block=s.block + finish.astype(jnp.int32),
        step=jnp.where(finish, 0, step),
        block_done=jnp.where(finish, jnp.zeros_like(block_done), block_done),
        seq_done=seq_done,
        key=key,
        forwards=s.forwards + active.astype(jnp.int32),
        total_forwards=s.total_forwards + 1,
        commits=s.commits + need_commit.astype(jnp.int32),
        steps_per_block=jnp.where(finish, s.steps_per_block.at[s.block].set(step), s.steps_per_block),
        capture=cap,
        prev_h=prev_h,
    )


def _first_canvas(prompt, key, *, cfg: ModelConfig, dcfg: DecodeConfig):
    """(key, canvas, sampler state, z0, a0): the first block's canvas and its empty residual."""
    b, L = prompt.shape[0], dcfg.block_length
    key, k_init = jax.random.split(key)
    canvas, sstate = dcfg.sampler.init(k_init, b, L, cfg)
    z0, a0 = jnp.zeros((b, L, cfg.hidden_size), cfg.jnp_dtype), jnp.zeros((b, L), jnp.float32)
    return key, canvas, sstate, z0, a0


def _start(params, prompt, lengths, key, first=None, *, cfg: ModelConfig, dcfg: DecodeConfig) -> DecodeState:
    """Everything before the loop: the first canvas, the prompt's prefill and, where the model fuses them, the first
    denoising step (its forward in the prefill's pass, its decisions through the loop's own body). first: the fused
    pass's first layer groups, run by another program (_start_first; the pass's rest runs here)."""
    b, p = prompt.shape
    L, nb = dcfg.block_length, dcfg.num_blocks
    model = model_module(cfg)
    fused, _, shift = _passes(cfg, dcfg)
    key, canvas, sstate, z0, a0 = _first_canvas(prompt, key, cfg=cfg, dcfg=dcfg)
    d = cfg.hidden_size
    first_logits = prev_h = None
    if fused and first is not None:
        first_logits, cache = model.prefill_decode_rest(params, cfg, prompt, lengths, p + nb * L, canvas, first,
                                                        **_raw_out(cfg))
        first_logits = _head(cfg, first_logits)
    elif fused:  # the prompt's prefill and the first denoising forward in one pass (each layer's weights read once)
        x0 = dcfg.residual.embed(params, cfg, canvas, z0, a0)
        first_logits, cache = model.prefill_decode(params, cfg, prompt, lengths, p + nb * L, canvas, embeds=x0,
                                                   **_raw_out(cfg))
        first_logits = _head(cfg, first_logits)
    elif shift:
        _, cache, prev_h = model.prefill(params, cfg, prompt, lengths, p + nb * L, return_hidden=True)
    else:
        _, cache = model.prefill(params, cfg, prompt, lengths, p + nb * L)
    capture = None
    if dcfg.capture:
        n = nb * dcfg.max_steps
        capture = {
            "canvas": jnp.zeros((n, b, L), jnp.int32),
            "z": jnp.zeros((n, b, L, d), cfg.jnp_dtype),
            "a": jnp.zeros((n, b, L), jnp.float32),
            "entropy": jnp.zeros((n, b, L), jnp.float32),
            "resolved": jnp.zeros((n, b, L), bool),
            "active": jnp.zeros((n, b), bool),
            "block": jnp.zeros((n,), jnp.int32),
            "step": jnp.zeros((n,), jnp.int32),
        }
    state = DecodeState(
        tokens=jnp.full((b, nb * L), dcfg.pad_token_id, jnp.int32), canvas=canvas, sampler=sstate,
        z=z0, a=a0, cache=cache,
        block=jnp.zeros((), jnp.int32), step=jnp.zeros((), jnp.int32),
        block_done=jnp.zeros((b,), bool), seq_done=jnp.zeros((b,), bool), key=key,
        forwards=jnp.zeros((b,), jnp.int32), total_forwards=jnp.zeros((), jnp.int32),
        commits=jnp.zeros((), jnp.int32), steps_per_block=jnp.zeros((nb,), jnp.int32), capture=capture,
        prev_h=prev_h)
    if fused:  # the loop's first iteration, its forward done above (cond holds: block 0, no row done)
        state = _advance(params, state, first_logits, state.cache, cfg=cfg, dcfg=dcfg)
    return state


def _loop(params, state: DecodeState, *, cfg: ModelConfig, dcfg: DecodeConfig) -> DecodeState:
    """The loop from `state` until every block is done (or every row hit EOS): its last state."""
    def cond(s: DecodeState):
        return (s.block < dcfg.num_blocks) & ~jnp.all(s.seq_done)

    def body(s: DecodeState):
        return _advance(params, s, *_forward(params, s, cfg=cfg, dcfg=dcfg), cfg=cfg, dcfg=dcfg)

    return jax.lax.while_loop(cond, body, state)


def _finish(params, state: DecodeState, *, cfg: ModelConfig, dcfg: DecodeConfig) -> GenerateOutput:
    """The loop from `state`, then the outputs."""
    return _outputs(_loop(params, state, cfg=cfg, dcfg=dcfg), dcfg)


def _outputs(s: DecodeState, dcfg: DecodeConfig) -> GenerateOutput:
    """generate()'s outputs from the loop's last state."""
    lengths_out = _valid_lengths(s.tokens, dcfg)
    tpf = lengths_out / jnp.maximum(s.forwards + s.commits, 1)
    # transformers' tokens_per_forward (DiffusionGemma generate): non-pad new tokens / denoising forwards
    tpf_hf = jnp.sum(s.tokens != dcfg.pad_token_id, axis=-1) / jnp.maximum(s.forwards, 1)
    return GenerateOutput(tokens=s.tokens, lengths=lengths_out, forwards=s.forwards, total_forwards=s.total_forwards,
                          commits=s.commits, steps_per_block=s.steps_per_block, tpf=tpf, tpf_hf=tpf_hf,
                          capture=s.capture)


def _generate_loop(params, prompt, lengths, key, *, cfg: ModelConfig, dcfg: DecodeConfig) -> GenerateOutput:
    """The whole generation as one program."""
    return _finish(params, _start(params, prompt, lengths, key, cfg=cfg, dcfg=dcfg), cfg=cfg, dcfg=dcfg)


_run = jax.jit(_generate_loop, static_argnames=("cfg", "dcfg"))
_run_graphed = jax.jit(_generate_loop, static_argnames=("cfg", "dcfg"), compiler_options=ENGINE_COMPILER_OPTIONS)
_run_concurrent = jax.jit(_generate_loop, static_argnames=("cfg", "dcfg"), compiler_options=DG_COMPILER_OPTIONS)
_run_graphed_into = jax.jit(_loop_into, static_argnames=("cfg", "dcfg"), donate_argnums=0, keep_unused=True,
                            compiler_options=ENGINE_COMPILER_OPTIONS)
_run_concurrent_into = jax.jit(_loop_into, static_argnames=("cfg", "dcfg"), donate_argnums=0, keep_unused=True,
                               compiler_options=DG_COMPILER_OPTIONS)


def _start_first(params, prompt, lengths, key, *, cfg: ModelConfig, dcfg: DecodeConfig, groups: int) -> dict:
    """The fused first pass's first `groups` layer groups (SPLIT_START_GROUPS): its carry for _start."""
    size = prompt.shape[1] + dcfg.num_blocks * dcfg.block_length
    _, canvas, _, z0, a0 = _first_canvas(prompt, key, cfg=cfg, dcfg=dcfg)
    x0 = dcfg.residual.embed(params, cfg, canvas, z0, a0)
    return model_module(cfg).prefill_decode_first(params, cfg, prompt, lengths, size, canvas, embeds=x0,
                                                  groups=groups)


def _start_into(workspace, params, prompt, lengths, key, first=None, *, cfg, dcfg: DecodeConfig) -> DecodeState:
    """_start, its state in `workspace` (donated: the previous call's state)."""
    del workspace
    return _start(params, prompt, lengths, key, first, cfg=cfg, dcfg=dcfg)


def _start_first_into(workspace, params, prompt, lengths, key, *, cfg, dcfg: DecodeConfig, groups: int) -> dict:
    """_start_first, its carry in `workspace` (donated: the previous call's carry)."""
    del workspace
    return _start_first(params, prompt, lengths, key, cfg=cfg, dcfg=dcfg, groups=groups)


def _finish_into(workspace, params, state, *, cfg, dcfg: DecodeConfig) -> GenerateOutput:
    """_finish, its outputs in `workspace` (donated)."""
    del workspace
    return _finish(params, state, cfg=cfg, dcfg=dcfg)


def _finish_in_place(workspace, params, state, *, cfg, dcfg: DecodeConfig) -> tuple[GenerateOutput, DecodeState]:
    """_finish, its outputs in `workspace` and the loop's last state in `state`'s buffers (both donated: DONATE_STATE),
    so the loop runs in the start's buffers instead of copies of them."""
    del workspace
    s = _loop(params, state, cfg=cfg, dcfg=dcfg)
    return _outputs(s, dcfg), s


def _split_programs(options: dict) -> tuple:
    kw = dict(static_argnames=("cfg", "dcfg"), donate_argnums=0, keep_unused=True, compiler_options=options)
    first = jax.jit(_start_first_into, **kw | {"static_argnames": ("cfg", "dcfg", "groups")})
    in_place = jax.jit(_finish_in_place, **kw | {"donate_argnums": (0, 2)})
    return jax.jit(_start_into, **kw), jax.jit(_finish_into, **kw), first, in_place


_split_graphed, _split_concurrent = _split_programs(ENGINE_COMPILER_OPTIONS), _split_programs(DG_COMPILER_OPTIONS)
_copy_out = jax.jit(lambda out: jax.tree.map(jnp.copy, out))
_workspaces: dict = {}  # OUTPUT_WORKSPACE: (program, cfg, dcfg, prompt shape) -> the last call's outputs


def _valid_lengths(tokens, dcfg: DecodeConfig):
    """Valid new tokens run through the first EOS (or are all of them)."""
    if not dcfg.eos_token_ids:
        return jnp.full((tokens.shape[0],), tokens.shape[1], jnp.int32)
    is_eos = jnp.isin(tokens, jnp.asarray(dcfg.eos_token_ids, jnp.int32))
    first = jnp.argmax(is_eos, axis=-1)
    return jnp.where(jnp.any(is_eos, axis=-1), first + 1, tokens.shape[1])


# --- the public entry point: validation happens here, before any tracing ---------------------------------------

_MASK_OPTIONS = {"threshold", "tokens_per_step", "edit_threshold", "max_edit_steps", "temperature", "rng"}
_UNIFORM_OPTIONS = {"t_max", "t_min", "max_denoising_steps", "entropy_bound", "stability", "confidence", "greedy",
                    "rng"}


def _prompts(prompt_ids, cfg: ModelConfig) -> list[np.ndarray]:
    if isinstance(prompt_ids, (list, tuple)):
        if not prompt_ids:
            raise ValueError("prompt_ids is empty")
        rows = prompt_ids if isinstance(prompt_ids[0], (list, tuple, np.ndarray, jax.Array)) else [prompt_ids]
        rows = [np.asarray(r) for r in rows]
    elif hasattr(prompt_ids, "shape") and hasattr(prompt_ids, "dtype"):
        arr = np.asarray(prompt_ids)
        if arr.ndim == 1:
            arr = arr[None]
        if arr.ndim != 2:
            raise ValueError(f"prompt_ids must have shape [batch, length] or [length], got {arr.shape}")
        rows = list(arr)
    else:
        raise TypeError(f"prompt_ids must be an int array or a list of token lists, got {type(prompt_ids).__name__}")
    for i, r in enumerate(rows):
        if r.ndim != 1:
            raise ValueError(f"prompt_ids[{i}] must be a 1-D token list, got shape {r.shape}")
        if r.size == 0:
            raise ValueError(f"prompt_ids[{i}] is empty; every prompt needs at least one token")
        if not np.issubdtype(r.dtype, np.integer):
            raise TypeError(f"prompt_ids must hold integer token ids, got dtype {r.dtype}")
        if r.min() < 0 or r.max() >= cfg.vocab_size:
            bad = int(r.min()) if r.min() < 0 else int(r.max())
            raise ValueError(f"prompt_ids[{i}] contains id {bad}, outside the vocabulary [0, {cfg.vocab_size})")
    return rows


def bucket_length(n: int, limit: int) -> int:
    """Prompt lengths are padded to powers of two (>= 16) so nearby lengths share one compiled program."""
    b = max(MIN_BUCKET, 1 << (n - 1).bit_length())
    return b if b <= limit else n


def resolve_eos_pad(cfg, eos_token_id, pad_token_id) -> tuple[tuple[int, ...], int]:
    """EOS ids (argument, else the config's) and the pad id (argument, else config, else the first EOS, else 0),
    checked against the vocabulary."""
    eos = cfg.eos_token_ids if eos_token_id is None else (
        (eos_token_id,) if isinstance(eos_token_id, (int, np.integer)) else tuple(eos_token_id))
    for t in eos:
        if not isinstance(t, (int, np.integer)) or not 0 <= t < cfg.vocab_size:
            raise ValueError(f"eos_token_id {t!r} is outside the vocabulary [0, {cfg.vocab_size})")
    pad = pad_token_id if pad_token_id is not None else cfg.pad_token_id
    pad = pad if pad is not None else (eos[0] if eos else 0)
    if not isinstance(pad, (int, np.integer)) or not 0 <= pad < cfg.vocab_size:
        raise ValueError(f"pad_token_id {pad!r} is outside the vocabulary [0, {cfg.vocab_size})")
    return tuple(int(t) for t in eos), int(pad)


def left_pad(rows: list[np.ndarray], cfg, new_tokens: int, pad: int) -> tuple[np.ndarray, np.ndarray]:
    """Prompts left-padded with `pad` to their bucket length -> (prompt [B, P] int32, lengths [B] int32)."""
    longest = max(len(r) for r in rows)
    room = cfg.max_position_embeddings - new_tokens
    if longest > room:
        raise ValueError(f"prompt of {longest} tokens + {new_tokens} new tokens exceeds max_position_embeddings="
                         f"{cfg.max_position_embeddings}")
    p = bucket_length(longest, room)
    prompt = np.full((len(rows), p), pad, np.int32)
    for i, r in enumerate(rows):
        prompt[i, p - len(r):] = r
    return prompt, np.array([len(r) for r in rows], np.int32)


def make_sampler(cfg: ModelConfig, **options) -> Sampler:
    """The default sampler of the model's family, with HF/dLLM-named options."""
    allowed = _MASK_OPTIONS if cfg.noise == "mask" else _UNIFORM_OPTIONS
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise TypeError(f"unknown sampler option(s) {unknown} for noise={cfg.noise!r}; valid: {sorted(allowed)}")
    if cfg.noise == "mask":
        if options.get("tokens_per_step") is not None and "threshold" not in options:
            options["threshold"] = None
        return MaskSampler(mask_token_id=cfg.mask_token_id, **options)
    # a config may carry its checkpoint's generation defaults (DiffusionGemma: generation_config.json)
    defaults = cfg.sampler_options() if hasattr(cfg, "sampler_options") else {}
    return UniformSampler(**{**defaults, **options})


def generate(params: dict, cfg: ModelConfig, prompt_ids, *, key: jax.Array, max_new_tokens: int = 256,
             block_length: int | None = None, sampler: Sampler | None = None, residual: Residual | None = None,
             max_steps: int | None = None, eos_token_id: int | Sequence[int] | None = None,
             pad_token_id: int | None = None, streamer: Callable[[np.ndarray, int], None] | None = None,
             capture: bool = False, mesh: Mesh | None = None, **sampler_options) -> GenerateOutput:
    """Generate with a block-diffusion model; the whole generation is one device-side loop.

    prompt_ids: [B, P] int array, or a list of token lists of different lengths (left-padded internally).
    max_new_tokens is rounded up to whole blocks of `block_length` (default cfg.block_length).
    sampler: a MaskSampler / UniformSampler, or None for the model family's default built from sampler_options
    (mask: threshold, tokens_per_step, edit_threshold, max_edit_steps, temperature; uniform: t_max, t_min,
    max_denoising_steps, entropy_bound, stability, confidence, greedy; both: rng, how a sample is drawn:
    "inverse_cdf" by default, or Gumbel-max with "threefry" / "rbg" noise; see samplers.categorical).
    residual: NoResidual(), RCDResidual() or ORLResidual(); default NoResidual(), or ORLResidual() for a
    self-conditioning model (DiffusionGemma: its self-conditioning block is the adapter, w = 1).
    streamer(block_tokens [B, L], block_index) is called on the host as each block is finished.
    mesh: run over a jax.sharding.Mesh (sharding.make_mesh): the weights are placed by their logical axes (tensor /
    expert parallel over "tensor", FSDP-split over "fsdp"), the rows are split over the data axes ("data" x
    "fsdp") when their count divides, and the same device-side loop runs partitioned.
    Returns GenerateOutput (tokens [B, T] with pad after EOS, lengths, forwards, commits, steps, TPF with and
    without the commit forwards).
    """
    if not isinstance(cfg, ModelConfig) and not hasattr(cfg, "noise"):
        raise TypeError(f"cfg must be a model config (ModelConfig, ...), got {type(cfg).__name__}")
    model = model_module(cfg)  # raises TypeError for a config type no model is registered for
    if not isinstance(params, dict) or "embed" not in params:
        raise TypeError("params must be the model's parameter dict (with an 'embed' entry)")
    if not (isinstance(key, jax.Array) and (jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
                                           or (key.dtype == jnp.uint32 and key.shape == (2,)))):
        raise TypeError(f"key must be a PRNG key (jax.random.key(seed)), got {type(key).__name__}")
    rows = _prompts(prompt_ids, cfg)
    if hasattr(model, "check_prompt_ids"):  # model-specific refusals (DiffusionGemma: image placeholders)
        model.check_prompt_ids(rows, cfg)
    max_new_tokens = int_at_least("max_new_tokens", max_new_tokens)
    L = int_at_least("block_length", cfg.block_length if block_length is None else block_length)
    if sampler is None:
        sampler = make_sampler(cfg, **sampler_options)
    elif sampler_options:
        raise ValueError(f"pass sampler options {sorted(sampler_options)} either inside `sampler` or without it, "
                         "not both")
    if not isinstance(sampler, (MaskSampler, UniformSampler)):
        raise TypeError(f"sampler must be a MaskSampler or UniformSampler, got {type(sampler).__name__}")
    sampler.check_length(L)
    if isinstance(sampler, MaskSampler) and cfg.noise != "mask":
        raise ValueError("a MaskSampler needs a noise='mask' model (ModelConfig.noise)")
    if isinstance(sampler, UniformSampler) and cfg.noise != "uniform":
        raise ValueError("a UniformSampler needs a noise='uniform' model (ModelConfig.noise)")
    if residual is None:  # a self-conditioning model (DiffusionGemma) feeds each step's distribution forward
        residual = ORLResidual() if getattr(cfg, "self_conditioning", False) else NoResidual()
    if not isinstance(residual, (NoResidual, RCDResidual, ORLResidual)):
        raise TypeError(f"residual must be NoResidual, RCDResidual or ORLResidual, got {type(residual).__name__}")
    if isinstance(residual, RCDResidual) and cfg.noise != "mask":
        raise ValueError("RCDResidual injects at [MASK] positions: it needs a noise='mask' model")
    if isinstance(residual, ORLResidual) and not cfg.has_adapter:
        raise ValueError("ORLResidual needs the adapter g_phi (ModelConfig.adapter_hidden > 0)")
    if cfg.cached_attention_impl == "cudnn":  # cuDNN's fused attention: bf16/fp16 on a GPU
        if cfg.dtype not in ("bfloat16", "float16"):
            raise ValueError(f"cached_attention_impl='cudnn' needs dtype bfloat16 or float16, got {cfg.dtype!r}")
        if jax.default_backend() != "gpu":
            raise ValueError(f"cached_attention_impl='cudnn' needs a GPU backend, this one is "
                             f"{jax.default_backend()!r}: use 'auto' or 'xla'")
    max_steps = int_at_least("max_steps", sampler.max_steps(L) if max_steps is None else max_steps)
    eos, pad = resolve_eos_pad(cfg, eos_token_id, pad_token_id)
    if streamer is not None and not callable(streamer):
        raise TypeError(f"streamer must be callable(block_tokens, block_index), got {type(streamer).__name__}")
    if mesh is not None and not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    _use_workspace()  # invalid engine.OUTPUT_WORKSPACE / SPLIT_START / DONATE_STATE values are refused on every path
    _split_start()
    _donate_state()

    nb = math.ceil(max_new_tokens / L)
    prompt, lengths = left_pad(rows, cfg, nb * L, pad)
    dcfg = DecodeConfig(sampler=sampler, residual=residual, block_length=L, num_blocks=nb, max_steps=max_steps,
                        eos_token_ids=eos, pad_token_id=pad, capture=bool(capture), stream=streamer is not None)
    _start_groups(cfg, dcfg)  # an invalid engine.SPLIT_START_GROUPS is refused before anything compiles
    if mesh is not None:
        # tensor (heads / MLP / vocab) and expert parallelism come from the weights' logical axes; the loop itself
        # is unchanged, XLA partitions it (GSPMD) and inserts the collectives. The Pallas kernels are single-device:
        # "auto" settings take the XLA paths
        if mesh.size > 1:
            cfg = xla_for_auto(cfg)
        params = jax.device_put(params, P.shardings(model.param_specs(cfg), mesh))
        rows_sh = named_sharding(mesh, ("batch", None), prompt.shape)  # replicated if B does not divide
        prompt, lengths = jax.device_put(prompt, rows_sh), jax.device_put(lengths, named_sharding(mesh, ("batch",),
                                                                                                   lengths.shape))
    devices = 1 if mesh is None else mesh.size
    if streamer is None:
        return _generate(params, prompt, lengths, key, cfg=cfg, dcfg=dcfg, devices=devices)
    with _stream_lock:
        _stream_fn[0] = streamer
        try:
            out = _generate(params, prompt, lengths, key, cfg=cfg, dcfg=dcfg, devices=devices)
            jax.block_until_ready(out)
            jax.effects_barrier()
        finally:
            _stream_fn[0] = None
    return out
