"""DiffusionGemma 26B-A4B at full size on one GPU: random bf16 weights, batch 1, prompt 512, 256 new tokens
(one canvas), the uniform sampler with DiffusionGemma's defaults except confidence=0 (random weights never converge,
so every canvas runs the 48-step maximum, as in the transformers peer).

The decoder forward is timed two ways: `ms`, one forward per call (5 calls per sync), and `ms_looped`, --looped
forwards in one device loop as generate() runs them. They differ by the host-side update of the forward's CUDA
graph, which the first call after each sync waits for (0.4-0.6 ms per forward measured per call since the layer
loops run inside the graph; benchmarks/results/2026-12-01_dg_graph_loops_h200.md).

  python benchmarks/diffusion_gemma_generate.py --out dg.jsonl [--profile]
Run side by side with ../shared/peers/hf_diffusion_gemma_generate.py (benchmarks/run_dg_bench.sh).
"""

from __future__ import annotations

import argparse
import functools
import gzip
import importlib
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from orl_jax import runtime  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--out", default="dg_bench.jsonl")
ap.add_argument("--preset", default="diffusiongemma-26b-a4b")
ap.add_argument("--prompt", type=int, default=512)
ap.add_argument("--new", type=int, default=256, help="the canvas: block length and timed forwards' tokens")
ap.add_argument("--blocks", type=int, default=1, help="generate() runs BLOCKS blocks of --new tokens")
ap.add_argument("--rng", choices=["threefry", "rbg", "inverse_cdf"], default="inverse_cdf",
                help="the sampler's draw (samplers.categorical)")
ap.add_argument("--expert", type=int, default=1, help="expert-parallel over the first N devices (mesh tensor=N)")
ap.add_argument("--moe-impl", default="bucketed",
                help="DiffusionGemmaConfig.moe_impl; a comma-separated list (bucketed, pallas, dense): "
                     "each in turn")
ap.add_argument("--profile", action="store_true",
                help="also trace 5 decoder forwards per impl: GPU kernel time vs idle, top kernels (xplane_summary.py);"
                     " the compiled decoder's HLO goes beside --out (OUT.IMPL.hlo.txt.gz)")
ap.add_argument("--profile-top", type=int, default=40, help="--profile: how many kernels to describe")
ap.add_argument("--gemm-table", help="tuned expert GEMM tiles for moe_impl pallas (kernels/small_m_gemm/bench.py "
                                    "or kernels/grouped_gemm/bench.py --table)")
ap.add_argument("--gemm-sweep", help="a JSON list [{'name':, 'table': [rows as in --gemm-table], "
                                    "'attention_table': [rows as in --attention-table], 'gather_in_kernel': bool, "
                                    "'compiler_options': {XLA option: value, added to runtime.DG_COMPILER_OPTIONS}, "
                                    "'set': {'orl_jax.model.attention.JOIN_WIDE_PARTS': value, ...: trace-time "
                                    "switches, back to their defaults after the entry}, 'fused_experts': bool "
                                    "(the expert gate/up stacks in moe.fuse_gate_up's layout, laid out afresh "
                                    "where an entry's moe.FUSED_TILE differs: one launch per layer's experts; "
                                    "its logits are compared with the defaults')}, ...] (all but the name "
                                    "optional; missing ones take the flags'): only the "
                                    "decoder forward (moe_impl pallas), timed once per entry in this process, each "
                                    "traced afresh (an empty table: the kernels' defaults). Example: "
                                    "benchmarks/dg_gather_rows_sweep.json")
ap.add_argument("--cached-attention", choices=["auto", "orl_jax", "pallas", "xla", "cudnn"], default="auto",
                help="DiffusionGemmaConfig.cached_attention_impl: the einsums, kernels/decode_attention, "
                     "jax.nn.dot_product_attention (xla / cudnn; heads > 256 take the einsums), or auto")
ap.add_argument("--attention-table", help="tuned attention blocks for --cached-attention pallas "
                                         "(kernels/decode_attention/bench.py --table)")
ap.add_argument("--xla-sort", action="store_true",
                help="moe.SORT_KERNEL = False: the pallas path sorts with XLA (moe.sort_by_expert) instead of "
                     "kernels/expert_sort")
ap.add_argument("--grouped-bm", type=int, help="kernels/grouped_gemm BM: rows per tile (a power of two >= 16)")
ap.add_argument("--experts-inner", action="store_true",
                help="kernels/grouped_gemm COLUMNS_INNER = False: the expert varies fastest in the program order "
                     "(before session 17)")
ap.add_argument("--sorted-copy", action="store_true",
                help="moe.GATHER_IN_KERNEL = False: XLA writes the sorted copy of the MoE input for the gate/up kernel")
ap.add_argument("--set", action="append", default=[], metavar="MODULE.NAME=JSON",
                help="set a trace-time switch before anything is traced, e.g. "
                     "orl_jax.model.attention.WIDE_LATE_NORMALIZE=false (repeatable; the value is JSON, or @FILE "
                     "holding it)")
ap.add_argument("--looped", type=int, default=8, metavar="N",
                help="also time N decoder forwards in one program (a fori_loop on the device, as generate() runs "
                     "them): ms per forward without host dispatch or per-call command-buffer updates between them "
                     "(the number issue #4's target is judged by since session 21; 0: skip)")
ap.add_argument("--parts", action="store_true",
                help="also time what generate() runs besides the decoder forwards: the prefill, the fused first "
                     "pass (prefill_decode, and a trace of its kernels), and per step the "
                     "self-conditioning input, the sampler and the soft embedding, each in a device loop; then a "
                     "trace of one generate() call (top kernels per step; timeline beside --out). The trace's idle "
                     "gaps are the profiler's: traced, each loop step has a ~2 ms gap with the host inside Execute, "
                     "which the untraced loop does not (sessions 31, 48)")
ap.add_argument("--generate-hlo", action="store_true",
                help="also write the compiled generate() program's HLO beside --out (OUT.generate.hlo.txt.gz): which "
                     "of the loop's instructions XLA left outside its command buffers")
ap.add_argument("--expert-loads", action="store_true",
                help="first log the rows routed to each expert in every MoE layer of the prefill and of one decoder "
                     "forward (moe_impl pallas): the grouped kernels read an expert's weights once per 64-row tile")
ap.add_argument("--fused-experts", action="store_true",
                help="the params as diffusion_gemma_inference.inference_params makes them for generate(): the "
                     "expert gate/up stacks in moe.fuse_gate_up's layout (with --moe-impl pallas each layer's "
                     "experts run in one launch, kernels/grouped_gemm/mlp.py), and the norm folds whose switches are "
                     "on (both by default; off with --set "
                     "orl_jax.model.diffusion_gemma_inference.FOLD_FFW_NORMS=false)")
ap.add_argument("--generate-ab", action="append", default=[], metavar="MODULE.NAME=JSON",
                help="also compile the whole generate() program a second time with these trace-time switches set "
                     "(repeatable, as --set) and time the two compiled programs alternately, --ab-rounds each: "
                     "an A/B of generate() in one process, free of the run-to-run spread of separate ones")
ap.add_argument("--ab-compiler-options", type=json.loads, metavar="JSON",
                help="--generate-ab's B side (or alone, the A/B's only difference): XLA compiler options added to "
                     "runtime.DG_COMPILER_OPTIONS for B's generate() program, e.g. '{\"xla_gpu_command_buffer_"
                     "update_mode\": \"SKIP_PROFILED\"}'; its outputs are compared with A's")
ap.add_argument("--ab-fold", type=lambda v: v.split(","), default=[], metavar="attention,ffw,proj_out",
                help="--generate-ab's B side (or alone, the A/B's only difference) runs on the params with these "
                     "transforms applied: norms folded into their matrices (diffusion_gemma_inference."
                     "fold_attention_norms / fold_ffw_norms; not on params that inference_params folded already), "
                     "o and the dense down (proj_out; inference_params does that on a GPU unless "
                     "TRANSPOSED_PROJECTIONS is set false) stored as [out, in] "
                     "(transposed_projections); first the decoder forward (48 per loop, --ab-rounds each, "
                     "alternating) and the two logits' gap")
ap.add_argument("--ab-fold-forward-only", action="store_true",
                help="--ab-fold: time the transforms in the decoder forward only; --generate-ab's B side then runs on "
                     "the defaults' params (two A/Bs in one process: the transforms' forward, the switches' "
                     "generate())")
ap.add_argument("--ab-rounds", type=int, default=8, help="--generate-ab: timed calls of each program")
ap.add_argument("--ab-max-steps", type=int, action="append", default=[], metavar="N",
                help="--generate-ab: then the same A/B with generate(max_steps=N) (repeatable): the difference of two "
                     "step counts is the steps' time alone, untraced; the rest is the time before and after the loop")
ap.add_argument("--ab-steps-only", action="store_true",
                help="--generate-ab: only the --ab-max-steps A/Bs, not the whole generate()'s first (switches that act "
                     "on the first step alone)")
ap.add_argument("--ab-trace", action="store_true",
                help="--generate-ab: then trace one call of each program (per step: span, busy time, the top kernels "
                     "with their time alone on the GPU; the host events inside each idle gap of >= 0.2 ms)")
ap.add_argument("--ab-workspace", action="store_true",
                help="also time generate() itself with engine.OUTPUT_WORKSPACE off (A) and on (B), alternately, "
                     "--ab-rounds each (a call-time switch: --generate-ab times the compiled programs, not the "
                     "calls)")
ap.add_argument("--ab-call", action="append", default=[], metavar="MODULE.NAME=JSON",
                help="also time generate() itself with a call-time switch at its default (A) and at JSON (B), "
                     "alternately, --ab-rounds each (e.g. orl_jax.decode.engine.SPLIT_START=true); repeatable, one "
                     "A/B per switch")
ap.add_argument("--host-probe", type=int, default=0, metavar="N",
                help="also split N generate() calls' host time until they return: the Python before the engine's "
                     "jitted program, that program's dispatch (jax's argument handling, XLA's per-call preparation "
                     "of its commands, the graph's update and submission) and the rest; beside a trivial program's "
                     "dispatch over the same arguments and the fused first pass's alone; as one program, as two "
                     "(engine.SPLIT_START) and as three (SPLIT_START_GROUPS=1)")
ap.add_argument("--key-spread", type=int, default=0, metavar="N",
                help="also time generate() with N other keys (median of 3 calls each, the same program): how far the "
                     "time moves with the trajectory alone (the sampled tokens route the MoE), the yardstick of an "
                     "A/B whose sides sample different tokens (a rounding change: tokens_differ > 0)")
ap.add_argument("--mark-calls", action="store_true",
                help="write a line in glog's time format to stderr as each generate() call starts, for "
                     "benchmarks/command_buffer_log.py (with XLA's command-buffer log on the same stderr)")
ap.add_argument("--capacity-factor", type=int,
                help="moe.CAPACITY_FACTOR (slots per expert / mean load; overflow takes further rounds)")
args = ap.parse_args()
IMPLS = args.moe_impl.split(",")
if unknown := sorted(set(IMPLS) - {"bucketed", "pallas", "dense"}):
    ap.error(f"--moe-impl: unknown {unknown}")
if args.looped < 0:
    ap.error(f"--looped must be >= 0, got {args.looped}")
if args.blocks < 1:
    ap.error(f"--blocks must be >= 1, got {args.blocks}")
if any(n < 1 for n in args.ab_max_steps):
    ap.error(f"--ab-max-steps must be >= 1, got {args.ab_max_steps}")
if args.ab_fold_forward_only and not (args.ab_fold and args.generate_ab):
    ap.error("--ab-fold-forward-only needs --ab-fold and --generate-ab")
if args.ab_steps_only and not args.ab_max_steps:
    ap.error("--ab-steps-only needs --ab-max-steps")
if args.ab_rounds < 1:
    ap.error(f"--ab-rounds must be >= 1, got {args.ab_rounds}")
if args.host_probe < 0:
    ap.error(f"--host-probe must be >= 0, got {args.host_probe}")
if args.key_spread < 0:
    ap.error(f"--key-spread must be >= 0, got {args.key_spread}")
if unknown := sorted(set(args.ab_fold) - {"attention", "ffw", "proj_out"}):
    ap.error(f"--ab-fold: unknown {unknown} (attention, ffw, proj_out)")
if args.capacity_factor is not None and args.capacity_factor < 1:
    ap.error(f"--capacity-factor must be >= 1, got {args.capacity_factor}")
runtime.configure(os.path.expanduser("~/.cache/orl_jax/xla"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from bench_io import digest, load_tables, parse_switches, set_switches, switched  # noqa: E402
from timing import chip_rates, median_seconds  # noqa: E402

from orl_jax import params as P  # noqa: E402
from orl_jax.decode.engine import generate  # noqa: E402
from orl_jax.decode.samplers import UniformSampler  # noqa: E402
from orl_jax.diffusion_gemma_config import DG_PRESETS  # noqa: E402
from orl_jax.model import diffusion_gemma, diffusion_gemma_inference, moe  # noqa: E402
from orl_jax.sharding import make_mesh  # noqa: E402

T0 = time.perf_counter()


def log(**kw):
    kw |= {"expert_parallel": args.expert, "fused_experts": args.fused_experts,
           "cached_attention": args.cached_attention, "rng": args.rng,
           "device": jax.devices()[0].device_kind,
           "jax": jax.__version__,
           "t": round(time.perf_counter() - T0, 1)}
    print(json.dumps(kw), flush=True)
    with open(args.out, "a") as f:
        f.write(json.dumps(kw) + "\n")


if args.mark_calls:
    from command_buffer_log import call_mark_line

    def generate(*a, _generate=generate, **k):  # noqa: F811
        print(call_mark_line(time.time()), file=sys.stderr, flush=True)
        return _generate(*a, **k)

if args.capacity_factor is not None:
    moe.CAPACITY_FACTOR = args.capacity_factor  # read by moe.capacity at trace time
    log(what="capacity_factor", value=args.capacity_factor)
if args.xla_sort:
    moe.SORT_KERNEL = False  # read by moe.experts_mlp at trace time
    log(what="sort_kernel", value=False)
if args.grouped_bm is not None or args.experts_inner:
    from orl_jax_kernels.grouped_gemm import kernel as grouped_kernel

    if args.grouped_bm is not None:
        grouped_kernel.BM = args.grouped_bm  # read by grouped_matmul at trace time (validated there)
        log(what="grouped_bm", value=args.grouped_bm)
    if args.experts_inner:
        grouped_kernel.COLUMNS_INNER = False  # read by grouped_matmul at trace time
        log(what="columns_inner", value=False)


def set_variant(gather_in_kernel: bool) -> dict:
    """moe's trace-time switch for the next trace (the flag, or a --gemm-sweep entry); what it is."""
    moe.GATHER_IN_KERNEL = gather_in_kernel
    return dict(gather_in_kernel=gather_in_kernel)


for name, value in set_switches(args.set).items():
    log(what="switch", name=name, value=value)
log(what="variant", **set_variant(not args.sorted_copy))
load_tables(log, gemm=args.gemm_table, attention=args.attention_table)
cfg = DG_PRESETS[args.preset].replace(dtype="bfloat16", cached_attention_impl=args.cached_attention)
specs = diffusion_gemma.param_specs(cfg)
flat, treedef = jax.tree_util.tree_flatten_with_path(specs, is_leaf=lambda s: isinstance(s, P.ParamSpec))
leaves = [s for _, s in flat]


MESH = None if args.expert == 1 else make_mesh(data=1, fsdp=1, tensor=args.expert,
                                               devices=jax.devices()[:args.expert])
SHARDINGS = jax.tree.leaves(P.shardings(specs, MESH)) if MESH is not None else [None] * len(leaves)


@functools.cache
def _maker(shape, dtype, sharding, ones: bool):
    if ones:
        return jax.jit(lambda key: jnp.ones(shape, dtype), out_shardings=sharding)
    return jax.jit(lambda key: (jax.random.normal(key, shape, jnp.bfloat16) * 0.02).astype(dtype),
                   out_shardings=sharding)


def _is_scale(path) -> bool:  # norm weights and per-layer scalars start at 1; everything else (router too) random
    name = jax.tree_util.keystr(path)
    return "norm" in name or "scale" in name


if jax.default_backend() == "gpu":  # this machine's rates, to compare runs across machines (they differ by ~3%)
    log(what="ceilings", **chip_rates())
t = time.perf_counter()
keys = jax.random.split(jax.random.key(0), len(leaves))
# one leaf at a time, straight in bf16 and already sharded (experts split over the mesh with --expert), so no
# float32 copy of a 10 GB expert stack is ever materialized
params = jax.tree.unflatten(treedef, [
    _maker(s.shape, s.dtype, sh, _is_scale(path))(k)
    for (path, s), k, sh in zip(flat, keys, SHARDINGS)])
jax.block_until_ready(params)
n = sum(int(np.prod(s.shape)) for s in leaves)
log(what="init", params_b=n / 1e9, seconds=time.perf_counter() - t)
if args.fused_experts:  # what inference_params hands generate(); the old gate/up stacks go with the old tree
    params = jax.block_until_ready(diffusion_gemma_inference.inference_params(params, cfg.replace(moe_impl="pallas"),
                                                                              donate=True))
    stats = jax.devices()[0].memory_stats() or {}  # None on a CPU
    log(what="inference_params", applied=diffusion_gemma_inference.applied(params),
        peak_gb=stats.get("peak_bytes_in_use", 0) / 1e9, in_use_gb=stats.get("bytes_in_use", 0) / 1e9)

prompt = np.random.default_rng(0).integers(0, min(200000, cfg.vocab_size) - 8, (1, args.prompt)).astype(np.int32)
sampler = UniformSampler(max_denoising_steps=48, t_max=0.8, t_min=0.4, entropy_bound=0.1, stability=1,
                         confidence=0.0, rng=args.rng)


def compile_dg(fn, options=None):
    """fn jitted with the compiler options generate() gives DiffusionGemma, plus `options`."""
    return jax.jit(fn, compiler_options=runtime.DG_COMPILER_OPTIONS | (options or {}))


def bench_canvas(cfg):
    """The timed decoder forwards' canvas: args.new random tokens."""
    return jnp.asarray(np.random.default_rng(1).integers(0, min(200000, cfg.vocab_size), (1, args.new)), jnp.int32)


def decoder(cfg):
    """The timed decoder forward: (params, canvas, cache) -> a slice of its logits (the whole [L, V] output would
    add a copy to every timing)."""
    return lambda p, toks, cache: diffusion_gemma.decode(p, cfg, toks, cache)[:, :, :8]


def one_forward(cfg, cache=None, options=None, p=None):
    """ms of one decoder forward over a 256-token canvas after the prompt (cache read only; prefilled here unless
    given), and the compiled program's temporary bytes (a scanned weight slice copied for a custom call would show
    here). options: XLA compiler options on top of runtime.DG_COMPILER_OPTIONS. p: the params (the global ones
    unless given)."""
    p = params if p is None else p
    if cache is None:
        cache = prefilled(cfg)
    canvas = bench_canvas(cfg)
    f = compile_dg(decoder(cfg), options)
    compiled = f.lower(p, canvas, cache).compile()
    mem = compiled.memory_analysis()
    sec = median_seconds(lambda: compiled(p, canvas, cache), reps=5, calls=5)
    if args.profile:
        from xplane_summary import write_timeline

        hlo = compiled.as_text()
        with gzip.open(Path(args.out).with_suffix(f".{cfg.moe_impl}.hlo.txt.gz"), "wt") as fh:  # to read the copies
            fh.write(hlo)
        d = traced("", lambda: [compiled(p, canvas, cache) for _ in range(5)], 5, hlo, args.profile_top,
                   moe_impl=cfg.moe_impl)
        write_timeline(d, Path(args.out).with_suffix(f".{cfg.moe_impl}.timeline.jsonl.gz"))
    looped = looped_forward(cfg, cache, canvas, options, args.looped, p) if args.looped else None
    return sec * 1e3, getattr(mem, "temp_size_in_bytes", None), looped


def looped_forward(cfg, cache, canvas, options, n, p=None):
    """ms per decoder forward when n of them run in one program, a fori_loop on the device as in generate()."""
    return looped_ms(decoder(cfg), canvas, n, cache, options=options, reps=3, p=p)


def prefilled(cfg):
    """The cache after the prompt."""
    return jax.jit(diffusion_gemma.prefill, static_argnums=(1, 4))(
        params, cfg, jnp.asarray(prompt), jnp.asarray([args.prompt], jnp.int32), args.prompt + args.new)[1]


def moe_only(impl):
    """ms of the MoE alone over all layers at the canvas: the sliding stack's experts, one layer after the other
    (read in place for "pallas", sliced for the XLA paths), routing fixed, scaled to the model's layer
    count."""
    from orl_jax.model.moe import experts_mlp
    from orl_jax.model.streamed import StackedWeight

    gu, dn = params["sliding"]["experts_gate_up"], params["sliding"]["experts_down"]
    n = gu.shape[0]
    x = jax.random.normal(jax.random.key(5), (args.new, cfg.hidden_size), jnp.bfloat16)
    w, e = jax.lax.top_k(jax.random.normal(jax.random.key(6), (args.new, cfg.num_experts)), cfg.top_k_experts)
    w = jax.nn.softmax(w, axis=-1)

    def run(gu, dn, x, w, e):  # weights as arguments: a closure would embed them in the program as constants
        def layer(i, y):
            g, d = (StackedWeight(gu, i), StackedWeight(dn, i)) if impl == "pallas" else (gu[i], dn[i])
            return y + experts_mlp(x + y, w, e, g, d, "gelu_tanh", impl)

        return jax.lax.fori_loop(0, n, layer, jnp.zeros_like(x))

    f = jax.jit(run)
    return median_seconds(lambda: f(gu, dn, x, w, e), reps=5) * 1e3 * cfg.num_layers / n


def looped_ms(fn, x, n=16, *operands, options=None, reps=5, p=None):
    """ms per call of fn(p, x, *operands) -> array (p: the global params unless given), n calls in one device loop,
    each input depending on the previous output through a test that is never true (nothing hoisted). Arrays go in
    as operands, not closures (a closure would embed them in the program as constants)."""
    f = looped_program(fn, n, options)
    return median_seconds(lambda: f(params if p is None else p, x, *operands), reps=reps) * 1e3 / n


def looped_program(fn, n, options=None):
    """looped_ms' jitted program: (p, x, *operands) -> x after n calls of fn in one fori_loop (one compilation per
    params tree)."""
    def run(p, x, *ops):
        return jax.lax.fori_loop(0, n, lambda _, x: x + (jnp.max(fn(p, x, *ops)) == jnp.inf).astype(x.dtype), x)

    return compile_dg(run, options)


class _Dispatched(Exception):
    """generate_call's stop: generate() reached its jitted program."""


def generate_call(c, kw):
    """The jitted program generate() dispatches for (c, kw) and its (args, kwargs), caught at the dispatch (nothing
    compiled or run: a caller that lowers for other params compiles once)."""
    from orl_jax.decode import engine

    seen, run = [], engine._run_concurrent

    def catch(*a, **k):
        seen.append((a, k))
        raise _Dispatched

    engine._run_concurrent = catch
    try:  # the loop's own program: the workspace's (OUTPUT_WORKSPACE) is another, timed by --ab-workspace
        with switched({"orl_jax.decode.engine.OUTPUT_WORKSPACE": False}):
            generate(params, c, prompt, **kw)
    except _Dispatched:
        pass
    finally:
        engine._run_concurrent = run
    if not seen:
        raise RuntimeError("generate() did not dispatch engine._run_concurrent for this config")
    return run, *seen[0]


def generate_program(c, kw, options=None, p=None):
    """generate()'s program for (c, kw) compiled afresh under the switches now set (and XLA compiler `options` on
    top of runtime.DG_COMPILER_OPTIONS), and its positional arguments (the params `p` in place of the global ones
    where given)."""
    from orl_jax.decode import engine

    jax.clear_caches()
    run, a, k = generate_call(c, kw)
    if p is not None:
        a = (p, *a[1:])
    if options:
        run = jax.jit(engine._generate_loop, static_argnames=("cfg", "dcfg"),
                      compiler_options=runtime.DG_COMPILER_OPTIONS | options)
    return run.lower(*a, **k).compile(), a


def generate_ab(c, kw, params_b=None):
    """generate()'s program under the defaults (A) and under --generate-ab's switches (B), timed alternately; B on
    params_b where given (a params transform: its own compiled program)."""
    prog_a, a = generate_program(c, kw)
    with switched(parse_switches(args.generate_ab)):
        prog_b, a_b = generate_program(c, kw, args.ab_compiler_options, params_b)
    out_a, out_b = jax.block_until_ready(prog_a(*a)), jax.block_until_ready(prog_b(*a_b))  # one untimed call each
    # and one more each: a program's first call may run its thunks one by one (XLA's warm-up) and its second record
    # its CUDA graphs on the host; in two of session 56's four A/Bs the first round ran 3-8 ms slower than the rest
    jax.block_until_ready(prog_a(*a)), jax.block_until_ready(prog_b(*a_b))
    # the two sides' outputs: a switch that changes rounding may move a sampled token in the bf16 model
    log(what="generate_ab_outputs", tokens_differ=int(np.sum(np.asarray(out_a.tokens) != np.asarray(out_b.tokens))),
        forwards_a=int(out_a.total_forwards), forwards_b=int(out_b.total_forwards), max_steps=kw.get("max_steps"))
    last = {}
    sides = (("A", prog_a, a), ("B", prog_b, a_b))
    for r in range(args.ab_rounds):
        for side, prog, operands in sides if r % 2 == 0 else sides[::-1]:
            t = time.perf_counter()
            last[side] = jax.block_until_ready(prog(*operands))
            log(what="generate_ab", side=side, set=args.generate_ab if side == "B" else [], round=r,
                compiler_options=args.ab_compiler_options if side == "B" else None,
                params_b=None if side == "A" or params_b is None else f"transforms: {args.ab_fold}",
                seconds=time.perf_counter() - t, max_steps=kw.get("max_steps"))
    # again after the rounds: a program whose command buffers kept a stale address would show it here
    log(what="generate_ab_outputs", after_rounds=True, max_steps=kw.get("max_steps"),
        tokens_differ=int(np.sum(np.asarray(last["A"].tokens) != np.asarray(last["B"].tokens))),
        b_equals_b_first=bool(np.array_equal(np.asarray(last["B"].tokens), np.asarray(out_b.tokens))))
    if args.ab_trace:
        steps = int(jax.block_until_ready(prog_a(*a)).total_forwards)
        from xplane_summary import host_during_gaps

        for side, prog, operands in sides:
            d = traced("generate_ab_", lambda prog=prog, ops=operands: prog(*ops), steps, side=side,
                       max_steps=kw.get("max_steps"))
            for row in host_during_gaps(d):
                log(what="generate_ab_idle_gap", side=side, max_steps=kw.get("max_steps"), **row)


def call_ab(c, kw, name, a, b, label="call_ab"):
    """generate() with the call-time switch `name` at `a` (A) and at `b` (B), alternately: two untimed calls each
    first."""
    def call(v):
        with switched({name: v}):
            return jax.block_until_ready(generate(params, c, prompt, **kw))

    out_a, out_b = call(a), call(b)
    # again, untimed: building B's program made XLA drop A's recorded CUDA graphs (it drops every other program's
    # when it builds one, CommandBufferThunk's constructor), so A's next call records them afresh; B's may too
    call(a), call(b)
    log(what=f"{label}_outputs", switch=name, a=a, b=b,
        tokens_differ=int(np.sum(np.asarray(out_a.tokens) != np.asarray(out_b.tokens))))
    for r in range(args.ab_rounds):
        for side in ("A", "B") if r % 2 == 0 else ("B", "A"):
            t = time.perf_counter()
            call(b if side == "B" else a)
            log(what=label, switch=name, side=side, round=r, seconds=time.perf_counter() - t)


def host_probe(c, kw, n):
    """Where a generate() call's host time goes before the GPU has work (issue #4: XLA's log put ~2 ms between a
    call's start and its graph's update, session 60). Per call, the Python before the engine's jitted program(s),
    their dispatch, the rest until generate() returns, and the whole call; then a trivial program's dispatch over
    the same arguments (jax's share) and the fused first pass's alone (a program of its own)."""
    from orl_jax.decode import engine

    real_run, real_split = engine._run_concurrent_into, engine._split_concurrent
    # one program; the start and the loop; also the fused pass's first layer group apart (SPLIT_START_GROUPS)
    for split, groups in ((False, 0), (True, 0), (True, 1)):
        marks, rows = [], []
        engine._run_concurrent_into = spied_fn(real_run, marks)
        engine._split_concurrent = tuple(spied_fn(f, marks) for f in real_split)
        try:
            with switched({"orl_jax.decode.engine.SPLIT_START": split,
                           "orl_jax.decode.engine.SPLIT_START_GROUPS": groups}):
                for _ in range(2):  # compiles where new, then records the graphs
                    jax.block_until_ready(generate(params, c, prompt, **kw))
                for _ in range(n):
                    marks.clear()
                    t0 = time.perf_counter()
                    out = generate(params, c, prompt, **kw)
                    t1 = time.perf_counter()
                    jax.block_until_ready(out)
                    rows.append([marks[0][0] - t0] + [e - s for s, e in marks]
                                + [t1 - marks[-1][1], t1 - t0, time.perf_counter() - t0])
        finally:
            engine._run_concurrent_into, engine._split_concurrent = real_run, real_split
        med = (np.median(np.asarray(rows), axis=0) * 1e3).tolist()
        parts = ["python_before_ms"] + (["first_dispatch_ms"] if groups else []) + (
            ["start_dispatch_ms", "loop_dispatch_ms"] if split else ["dispatch_ms"])
        log(what="host_probe", split_start=split, split_start_groups=groups, calls=n,
            **dict(zip(parts, med[:-3], strict=True)), after_ms=med[-3], returned_ms=med[-2], call_ms=med[-1])
    # a trivial program over generate()'s arguments: jax's own dispatch (the params' leaves, the prompt's copy)
    lengths = np.asarray([args.prompt], np.int32)
    trivial = jax.jit(lambda p, t, n_, k: t[0, 0] + n_[0])
    jax.block_until_ready(trivial(params, prompt, lengths, kw["key"]))
    log(what="host_probe_trivial", dispatch_ms=_dispatch_ms(lambda: trivial(params, prompt, lengths, kw["key"]), n))
    # the fused first pass alone, compiled as generate() compiles (its outputs fresh each call)
    x = jnp.zeros((1, args.new, c.hidden_size), c.jnp_dtype)
    canvas = bench_canvas(c)
    pd = compile_dg(lambda p, t, n_, k, x: diffusion_gemma.prefill_decode(p, c, t, n_, args.prompt + args.new, k,
                                                                          embeds=x, capped=False))
    jax.block_until_ready(pd(params, prompt, lengths, canvas, x))
    jax.block_until_ready(pd(params, prompt, lengths, canvas, x))
    log(what="host_probe_prefill_decode", dispatch_ms=_dispatch_ms(lambda: pd(params, prompt, lengths, canvas, x), n))


def spied_fn(fn, marks):
    """fn, appending (start, end) of each call's dispatch to marks."""
    def spy(*a, **k):
        t = time.perf_counter()
        out = fn(*a, **k)
        marks.append((t, time.perf_counter()))
        return out
    return spy


def _dispatch_ms(call, n):
    """Median host ms until call() returns (its result then waited for, untimed), over n calls."""
    times = []
    for _ in range(n):
        t = time.perf_counter()
        out = call()
        times.append(time.perf_counter() - t)
        jax.block_until_ready(out)
    return float(np.median(times) * 1e3)


def fold_ab(c):
    """The params with --ab-fold's transforms; first their decoder logits against the defaults' (beside how far
    another rounding of the same math moves them) and the decoder forward, 48 per loop, alternating with the
    defaults' --ab-rounds times."""
    folded = params
    if "attention" in args.ab_fold:
        folded = diffusion_gemma_inference.fold_attention_norms(folded)
    if "ffw" in args.ab_fold:  # a second copy of the expert gate/up stacks (the 26B's: 30 GB)
        folded = diffusion_gemma_inference.fold_ffw_norms(folded)
    if "proj_out" in args.ab_fold:  # copies: 1.2 GB at the 26B
        folded = diffusion_gemma_inference.transposed_projections(folded)
    cache, canvas = prefilled(c), bench_canvas(c)
    logits_of = compile_dg(lambda p, toks, k: diffusion_gemma.decode(p, c, toks, k))
    want = logits_of(params, canvas, cache)
    log(what="folded_logits", **logit_gap(logits_of(folded, canvas, cache), want))
    log_rounding_gap(c.head_dim, lambda: logits_of(params, canvas, cache), want)
    f = looped_program(decoder(c), 48)
    for r in range(args.ab_rounds):
        for side, p in (("A", params), ("B", folded)) if r % 2 == 0 else (("B", folded), ("A", params)):
            log(what="fold_ab_forward", side=side, round=r, looped_forwards=48,
                ms_looped=median_seconds(lambda p=p: f(p, canvas, cache), reps=3) * 1e3 / 48)
    return folded


def write_generate_hlo(c, kw):
    """The compiled generate() program's HLO (the program generate() dispatched, lowered again with its arguments)."""
    run, a, k = generate_call(c, kw)
    with gzip.open(Path(args.out).with_suffix(".generate.hlo.txt.gz"), "wt") as fh:
        fh.write(run.lower(*a, **k).compile().as_text())


def generate_parts(c, kw):
    """generate()'s time outside the decoder forwards, and traces of one prefill and of one generate() call."""
    from xplane_summary import write_timeline

    from orl_jax.decode.residual import soft_embed

    lengths = jnp.asarray([args.prompt], jnp.int32)
    pf = compile_dg(lambda p, t: diffusion_gemma.prefill(p, c, t, lengths, args.prompt + args.new)[1])
    log(what="part", part="prefill", ms=median_seconds(lambda: pf(params, jnp.asarray(prompt)), reps=5) * 1e3)
    V, L = c.vocab_size, args.new
    logits = 4 * jax.random.normal(jax.random.key(7), (1, L, V), jnp.float32)
    canvas = jnp.asarray(np.random.default_rng(1).integers(0, min(200000, V), (1, L)), jnp.int32)
    # generate()'s first pass (engine.FUSED_FIRST_STEP): the prefill and the first forward, weights read once
    pd = compile_dg(lambda p, t, x: diffusion_gemma.prefill_decode(p, c, t, lengths, args.prompt + args.new, x))
    log(what="part", part="prefill_decode",
        ms=median_seconds(lambda: pd(params, jnp.asarray(prompt), canvas), reps=5) * 1e3)
    # its kernels alone (one call), with what each fusion is
    traced("prefill_decode_", lambda: pd(params, jnp.asarray(prompt), canvas), 1,
           pd.lower(params, jnp.asarray(prompt), canvas).compile().as_text())
    # its logits and cache against the two passes', beside how far other roundings of the same math move them
    got, got_cache = pd(params, jnp.asarray(prompt), canvas)
    cache = pf(params, jnp.asarray(prompt))
    dec = lambda: compile_dg(lambda p, x, k: diffusion_gemma.decode(p, c, x, k))(params, canvas, cache)  # noqa: E731
    want = dec()
    log(what="prefill_decode_logits", **logit_gap(got, want),
        cache_max_abs_diff=max(float(jnp.max(jnp.abs(a - b))) for a, b in
                               zip(jax.tree.leaves(got_cache), jax.tree.leaves(cache))))
    log_rounding_gap(c.head_dim, dec, want)
    _, state = sampler.init(jax.random.key(8), 1, L, c)
    active = jnp.ones((1,), bool)
    step = lambda p, x: sampler.step(x, canvas, state, jax.random.key(9), 3, active).probs  # noqa: E731
    log(what="part", part="sampler_step", ms=looped_ms(step, logits))
    z = jnp.zeros((1, L, c.hidden_size), jnp.bfloat16) + 0.01
    sc = lambda p, x: diffusion_gemma.residual_embed(p, c, canvas, x, jnp.ones((1, L), jnp.float32))  # noqa: E731
    log(what="part", part="self_conditioning_input", ms=looped_ms(sc, z))
    probs = jax.nn.softmax(logits, axis=-1)
    log(what="part", part="soft_embed", ms=looped_ms(lambda p, x: soft_embed(p, c, x), probs))
    out = jax.block_until_ready(generate(params, c, prompt, **kw))
    d = traced("generate_", lambda: generate(params, c, prompt, **kw), int(out.total_forwards))
    write_timeline(d, Path(args.out).with_suffix(".generate.timeline.jsonl.gz"))


def log_rounding_gap(head_dim: int, logits, want) -> None:
    """How far rounding alone moves the random-weight model's logits (random weights may amplify it layer by layer):
    `logits()` computed again with the sliding layers' attention on the einsums (the same math, other roundings),
    against `want`; a `rounding_logits` row. Every program is traced afresh under the switch and after it."""
    with switched({"orl_jax.model.attention.EINSUM_HEAD_DIMS": [head_dim]}):
        jax.clear_caches()
        log(what="rounding_logits", **logit_gap(logits(), want))
    jax.clear_caches()


def logit_gap(got, reference) -> dict:
    """How far logits [.., V] are from the reference's: max |diff|, relative L2, the share of equal argmaxes."""
    return dict(max_abs_diff=float(jnp.max(jnp.abs(got - reference))),
                rel_l2=float(jnp.linalg.norm(got - reference) / jnp.linalg.norm(reference)),
                argmax_agree=float(jnp.mean(jnp.argmax(got, -1) == jnp.argmax(reference, -1))))


def traced(prefix: str, run, steps: int, hlo_text: str | None = None, top: int = 40, **fields) -> str:
    """One call of run() under the profiler, summarized (xplane_summary.summarize over `steps` steps; hlo_text names
    the top kernels' fusions) into `{prefix}profile`, `{prefix}profile_kernel` and `{prefix}profile_gap` rows, each
    with `fields`; the trace's directory."""
    import tempfile

    from xplane_summary import summarize

    d = tempfile.mkdtemp()
    with jax.profiler.trace(d):
        jax.block_until_ready(run())
    prof = summarize(d, steps=steps, top=top, hlo_text=hlo_text)
    kernels, gaps = prof.pop("top", []), prof.pop("gaps", [])
    log(what=f"{prefix}profile", **fields, **prof)
    for row in kernels:
        log(what=f"{prefix}profile_kernel", **fields, **row)
    for row in gaps:
        log(what=f"{prefix}profile_gap", **fields, **row)
    return d


def expert_loads(c):
    """Per pass (prefill, one decoder forward): the rows each expert gets in each MoE layer, summarized. Random
    weights route unevenly; an expert past BM rows has its weights read once per BM-row tile."""
    from orl_jax_kernels.grouped_gemm.kernel import BM

    seen, real = [], moe._sorted_rows

    def spy(experts, num_experts, kernel, by_token=False):
        out = real(experts, num_experts, kernel, by_token)
        jax.debug.callback(lambda sizes: seen.append(np.asarray(sizes)), out[2])
        return out

    moe._sorted_rows = spy
    jax.clear_caches()
    try:
        cache = prefilled(c)
        jax.effects_barrier()
        passes = {"prefill": list(seen)}
        seen.clear()
        jax.block_until_ready(compile_dg(decoder(c))(params, bench_canvas(c), cache))
        jax.effects_barrier()
        passes["decode"] = list(seen)
    finally:
        moe._sorted_rows = real
        jax.clear_caches()
    for name, layers in passes.items():
        s = np.stack(layers)  # [layers, E]
        tiles = np.ceil(s / BM)
        log(what="expert_loads", pass_name=name, layers=len(layers), rows_per_layer=int(s[0].sum()),
            mean=float(s.mean()), max_per_layer=s.max(axis=1).tolist(), unused=int((s == 0).sum()),
            over_bm=int((s > BM).sum()), bm=BM, weight_reads=float(tiles.sum() / (s > 0).sum()))


if args.expert_loads:
    expert_loads(cfg.replace(moe_impl="pallas"))

if args.gemm_sweep:  # the expert GEMM's tiles ranked inside the forward (the isolated bench ranks them otherwise)
    from orl_jax_kernels.small_m_gemm.kernel import set_tuned

    swept = cfg.replace(moe_impl="pallas")
    cache = prefilled(swept)  # once, under the kernels' defaults: only the decoder forward is compiled per entry
    from orl_jax_kernels.decode_attention import kernel as attention_kernel

    attention_rows = json.loads(Path(args.attention_table).read_text()) if args.attention_table else []
    entries = json.loads(Path(args.gemm_sweep).read_text())

    def logits_of(p):  # the whole [1, L, V] decoder logits under the current switches
        return jax.jit(lambda p, toks, c: diffusion_gemma.decode(p, swept, toks, c))(p, bench_canvas(swept), cache)

    def log_logit_gap(what, p, **fields):  # p's decoder logits against the defaults' (`reference`)
        log(what=what, **logit_gap(logits_of(p), reference), **fields)

    from orl_jax.model import moe

    fused_params = reference = fused_tile = None
    if any(e.get("fused_experts") for e in entries):  # a second copy of the gate/up stacks; the defaults' logits
        reference = logits_of(params)
        log_rounding_gap(cfg.head_dim, lambda: logits_of(params), reference)
    for entry in entries:
        table = set_tuned(entry.get("table", []))
        attention = attention_kernel.set_tuned(entry.get("attention_table", attention_rows))
        variant = set_variant(entry.get("gather_in_kernel", not args.sorted_copy))
        options = entry.get("compiler_options", {})
        switches = entry.get("set", {})
        with switched(switches):
            jax.clear_caches()  # every kernel wrapper and the forward trace again, under these tables and switches
            if entry.get("fused_experts") and moe.FUSED_TILE != fused_tile:  # the layout of this entry's FUSED_TILE
                p = fused_params = None  # the old copy goes first (the 26B's: 30 GB)
                fused_params, fused_tile = diffusion_gemma_inference.fused_expert_params(params), moe.FUSED_TILE
            p = fused_params if entry.get("fused_experts") else params
            try:
                if p is fused_params:
                    log_logit_gap("fused_experts_logits", p, gemm_variant=entry["name"])
                ms, temp, looped = one_forward(swept, cache, options, p)
            except Exception as ex:  # an entry the compiler or the chip refuses (shared memory): recorded, not fatal
                log(what="decode_forward", gemm_variant=entry["name"], set=switches, error=repr(ex)[:300])
                ms = None
        if ms is None:
            continue
        log(what="decode_forward", moe_impl="pallas", gemm_variant=entry["name"], table=str(table),
            attention_table=str(attention), **variant, compiler_options=options, set=switches, ms=ms,
            ms_looped=looped, looped_forwards=args.looped or None,
            temp_gb=None if temp is None else temp / 1e9)
    sys.exit(0)

for impl in IMPLS:
    c = cfg.replace(moe_impl=impl)
    ms, temp, looped = one_forward(c)
    log(what="decode_forward", moe_impl=impl, ms=ms, ms_looped=looped, looped_forwards=args.looped or None,
        temp_gb=None if temp is None else temp / 1e9,
        moe_only_ms=moe_only(impl))
    kw = dict(key=jax.random.key(0), max_new_tokens=args.new * args.blocks, block_length=args.new, sampler=sampler,
              eos_token_id=(), mesh=MESH)
    t = time.perf_counter()
    out = jax.block_until_ready(generate(params, c, prompt, **kw))
    first = time.perf_counter() - t
    sec = median_seconds(lambda: generate(params, c, prompt, **kw), reps=3)
    fwd, com = int(out.total_forwards), int(out.commits)
    log(what="generate", moe_impl=impl, first_call_s=first, seconds=sec, new_tokens=args.new * args.blocks,
        denoise_forwards=fwd, commits=com, ms_per_forward_incl_prefill=sec * 1e3 / max(fwd + com, 1),
        tokens_per_s=args.new * args.blocks / sec,
        tokens_sha=digest(out.tokens),
        # ids outside the vocabulary: the samplers' argmax found no maximum (the FMA-contraction bug of session 50)
        tokens_out_of_vocab=int(np.sum(np.asarray(out.tokens) >= c.vocab_size)),
        tpf_hf=float(np.asarray(out.tpf_hf)[0]) if getattr(out, "tpf_hf", None) is not None else None)
    # the row above (one untimed call, median of the next 3) is kept comparable with earlier sessions; a compiled
    # program's second and third calls ran 5-8 ms slower than later ones in every A/B (session 48), so also the
    # steady state: the median of 5 timed calls after 6 others (the compiling one, the row above's 4, one untimed)
    steady = median_seconds(lambda: generate(params, c, prompt, **kw), reps=5)
    # host time until generate() returns (checks, padding, dispatch), the device still running
    returned_ms = _dispatch_ms(lambda: generate(params, c, prompt, **kw), 5)
    log(what="generate_steady", moe_impl=impl, seconds=steady, calls_before=6,
        ms_per_forward_incl_prefill=steady * 1e3 / max(fwd + com, 1), returned_ms=returned_ms)
    for k in range(1, args.key_spread + 1):
        kk = kw | {"key": jax.random.key(k)}
        sec = median_seconds(lambda: generate(params, c, prompt, **kk), reps=3)
        log(what="generate_key", moe_impl=impl, seed=k, seconds=sec)
    if args.ab_workspace:
        call_ab(c, kw, "orl_jax.decode.engine.OUTPUT_WORKSPACE", False, True, "workspace_ab")
    for name, value in parse_switches(args.ab_call).items():
        module, attr = name.rsplit(".", 1)
        call_ab(c, kw, name, getattr(importlib.import_module(module), attr), value)
    if args.host_probe:
        host_probe(c, kw, args.host_probe)
    if args.generate_hlo:
        write_generate_hlo(c, kw)
    if args.generate_ab or args.ab_compiler_options or args.ab_fold:
        folded = fold_ab(c) if args.ab_fold else None
        params_b = None if args.ab_fold_forward_only else folded  # forward only: B's generate() on A's params
        # fewer steps: what a step costs apart from the rest
        for steps in ([] if args.ab_steps_only else [None]) + args.ab_max_steps:
            generate_ab(c, kw if steps is None else kw | {"max_steps": steps}, params_b)
    if args.parts:
        generate_parts(c, kw)
