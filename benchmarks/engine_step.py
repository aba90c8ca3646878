"""Engine speed on one GPU: Qwen3-4B shape, random bf16 weights, batch 1, prompt 512.

  python benchmarks/engine_step.py --phase step       # ms per denoising forward (block 32, canvas 256) + loop overhead
  python benchmarks/engine_step.py --phase generate   # whole generate(): compile time, tokens/s at a forced TPF
  python benchmarks/engine_step.py --phase profile    # one traced 16-step loop: kernel time vs idle, top kernels

Run side by side (same machine, same session) with ../shared/peers/torch_graph_step.py and hf_qwen3_eager_step.py;
benchmarks/run_engine_bench.sh does all of it. Writes a JSON line per measurement to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench_io import digest, load_tables, set_switches  # noqa: E402
from timing import chip_rates, median_seconds  # noqa: E402

from orl_jax import runtime  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--phase", choices=["step", "generate", "breakdown", "profile"], required=True)
ap.add_argument("--blocks", default="32,256")
ap.add_argument("--xla-default", action="store_true", help="do not apply orl_jax's XLA flags (for comparison)")
ap.add_argument("--cache-dir", default=os.path.expanduser("~/.cache/orl_jax/xla"))
ap.add_argument("--out", default="engine_bench.jsonl")
ap.add_argument("--prompt", type=int, default=512)
ap.add_argument("--profile-top", type=int, default=25, help="--phase profile: how many kernels to describe")
ap.add_argument("--preset", default="qwen3-4b", help="model shape (tiny-qwen3 for a CPU smoke run)")
ap.add_argument("--tensor", type=int, default=1, help="tensor-parallel over the first N devices (mesh tensor=N)")
ap.add_argument("--cached-attention", choices=["auto", "orl_jax", "pallas", "xla", "cudnn"], default="auto",
                help="attention of the cached passes: the library default (auto: the kernel on a GPU), the einsum "
                     "reference, the fused kernel (kernels/decode_attention), or jax.nn.dot_product_attention "
                     "(xla / cudnn) over [cache | own keys]")
ap.add_argument("--cached-matmul", choices=["xla", "pallas"], default="xla",
                help="projections of cached passes <= 64 rows: XLA (cuBLAS) or kernels/small_m_gemm")
ap.add_argument("--layer-unroll", type=int, default=0,
                help="ModelConfig.layer_unroll (1: scan; the layer count: unrolled); 0: as generate() compiles it "
                     "(unrolled on a GPU unless --plain-compile)")
ap.add_argument("--attention-table", help="tuned attention blocks (kernels/decode_attention/bench.py --table)")
ap.add_argument("--attention-blocks", choices=["library", "dataclass"], default="library",
                help="the attention kernel's blocks without a table: the library's measured rule (blocks_for) or "
                     "the Blocks() defaults it replaced (A/B of the rule in one call)")
ap.add_argument("--plain-compile", action="store_true",
                help="compile the step loops without runtime.ENGINE_COMPILER_OPTIONS (generate() uses them for Qwen3)")
ap.add_argument("--gemm-table", help="tuned small-M GEMM blocks (kernels/small_m_gemm/bench.py --table)")
ap.add_argument("--rng", choices=["threefry", "rbg", "inverse_cdf"], default="inverse_cdf",
                help="the canvas-256 uniform sampler's draw (samplers.categorical)")
ap.add_argument("--compiler-option", action="append", default=[], metavar="NAME=VALUE",
                help="one more XLA option for the step loops (with the engine's), e.g. xla_gpu_enable_triton_gemm=true")
ap.add_argument("--set", action="append", default=[], metavar="MODULE.NAME=JSON",
                help="set a trace-time switch before anything is traced, e.g. "
                     "orl_jax_kernels.decode_attention.kernel.SPLITS_IN_INPUT_DTYPE=true (repeatable; JSON value, or "
                     "@FILE holding it)")
args = ap.parse_args()
runtime.configure(args.cache_dir, xla_flags=() if args.xla_default else runtime.DEFAULT_XLA_FLAGS)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from orl_jax import params as P  # noqa: E402
from orl_jax.config import preset  # noqa: E402
from orl_jax.decode import engine  # noqa: E402
from orl_jax.decode.engine import generate  # noqa: E402
from orl_jax.decode.samplers import MaskSampler, UniformSampler  # noqa: E402
from orl_jax.model import qwen3, qwendlm  # noqa: E402
from orl_jax.model.cache import KVCache  # noqa: E402
from orl_jax.sharding import make_mesh, named_sharding  # noqa: E402

LOOP_OPTIONS = None if args.plain_compile else runtime.ENGINE_COMPILER_OPTIONS  # as generate() compiles Qwen3
if args.compiler_option:
    LOOP_OPTIONS = dict(LOOP_OPTIONS or {}) | {k: json.loads(v) if v in ("true", "false") or v.isdigit() else v
                                               for k, v in (o.split("=", 1) for o in args.compiler_option)}
set_switches(args.set)
if args.plain_compile:
    engine._run_graphed = engine._run  # generate() then compiles with XLA's defaults (read at call time)

T0 = time.perf_counter()


def log(**kw):
    kw |= {"phase": args.phase, "rng": args.rng, "compiler_options": args.compiler_option, "set": args.set,
           "tensor": args.tensor, "cached_attention": args.cached_attention,
           "cached_matmul": args.cached_matmul, "layer_unroll": cfg.layer_unroll,
           "engine_options": not args.plain_compile,
           "attention_blocks": args.attention_blocks, "xla_flags": os.environ.get("XLA_FLAGS", ""),
           "device": jax.devices()[0].device_kind,
           "jax": jax.__version__, "t": round(time.perf_counter() - T0, 1)}
    print(json.dumps(kw), flush=True)
    with open(args.out, "a") as f:
        f.write(json.dumps(kw) + "\n")


def ceilings(calls: int) -> tuple[float, float]:
    """The chip's rates (timing.chip_rates), logged: (read bytes/s, GEMM FLOP/s), the roofline's. Rows before
    session 23 give copy_tb_s timed one program per sync, and their roofline_ms from it (too slow a rate: 3.0-3.5
    TB/s); rows before session 38 put the compute side at a nominal 790 TFLOP/s (now roofline_nominal_ms)."""
    rates = chip_rates(calls)
    log(what="ceilings", **rates)
    return rates["read_tb_s"] * 1e12, rates["gemm_tflop_s"] * 1e12


cfg = preset(args.preset).replace(noise="mask", mask_token_id=preset(args.preset).vocab_size - 1,
                                  cached_attention_impl=args.cached_attention,
                                  cached_matmul_impl=args.cached_matmul, layer_unroll=args.layer_unroll or None)
# the step loops compile what generate() compiles: with the engine options the stack unrolled on a GPU; without
# them (--plain-compile) the scan, for generate() too, which then runs the plain program
cfg = cfg.replace(layer_unroll=cfg.layer_unroll or 1) if args.plain_compile else engine.graphed_config(
    cfg, jax.default_backend())
if args.attention_blocks == "dataclass":
    from orl_jax_kernels.decode_attention import kernel as attention_kernel

    attention_kernel.blocks_for = lambda *shape: attention_kernel.Blocks()  # read by model/attention.py at trace time
load_tables(log, gemm=args.gemm_table, attention=args.attention_table)
specs = qwen3.param_specs(cfg)
MESH = None if args.tensor == 1 else make_mesh(data=1, fsdp=1, tensor=args.tensor,
                                               devices=jax.devices()[:args.tensor])
nbytes = sum(int(np.prod(s.shape)) * 2 for s in jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, P.ParamSpec)))


def sampler_for(L):
    if L == 32:
        return MaskSampler(mask_token_id=cfg.mask_token_id, threshold=None, tokens_per_step=4), cfg
    return UniformSampler(max_denoising_steps=48, confidence=0.0, rng=args.rng), cfg.replace(noise="uniform")


def step_inputs(L):
    """Sampler, config, a random KV cache holding `--prompt` committed tokens, and a fresh canvas of length L."""
    sampler, c = sampler_for(L)
    S = args.prompt + L
    k = jax.random.normal(jax.random.key(1), (c.num_layers, 1, S, c.num_kv_heads, c.head_dim), jnp.bfloat16)
    if MESH is not None:  # the cache split over kv heads, like the weights
        k = jax.device_put(k, named_sharding(MESH, ("layers", "batch", "length", "kv_heads", "head_dim"), k.shape))
    cache = KVCache(k=k, v=k * 0.5, start=jnp.zeros((1,), jnp.int32), length=jnp.asarray(args.prompt, jnp.int32))
    canvas, sstate = sampler.init(jax.random.key(2), 1, L, c)
    return sampler, c, cache, canvas, sstate


def step_loop(sampler, c, sstate):
    """jit(run)(params, cache, canvas, n, key, fixed): 16 denoising steps in a fori_loop (fixed) or n in a
    while_loop with a dynamic predicate, as generate() runs them."""
    def run(params, cache, canvas, n, key, fixed):
        def body(carry):
            i, canvas, st, key, done = carry
            key, ks = jax.random.split(key)
            logits = qwendlm.decode(params, c, canvas, cache)
            out = sampler.step(logits, canvas, st, ks, i % 8, jnp.ones((1,), bool))
            return i + 1, out.canvas, out.state, key, done + out.done.sum()
        init = (jnp.int32(0), canvas, sstate, key, jnp.int32(0))
        if fixed:
            return jax.lax.fori_loop(0, 16, lambda i, cr: body(cr), init)
        return jax.lax.while_loop(lambda cr: (cr[0] < n) & (cr[4] < 10**9), body, init)
    return jax.jit(run, static_argnames="fixed", compiler_options=LOOP_OPTIONS)


def step_phase(params, rates):
    bw, gemm_rate = rates
    for L in map(int, args.blocks.split(",")):
        sampler, c, cache, canvas, sstate = step_inputs(L)
        f = step_loop(sampler, c, sstate)
        for mode in ("while", "fori"):
            t = time.perf_counter()
            res = jax.block_until_ready(f(params, cache, canvas, 16, jax.random.key(3), mode == "fori"))
            compile_s = time.perf_counter() - t
            per = median_seconds(lambda: f(params, cache, canvas, 16, jax.random.key(3), mode == "fori"), reps=5) / 16
            flops = 2 * (nbytes / 2) * L
            roof = max(nbytes / bw, flops / gemm_rate)  # the roofline: bytes and FLOPs at the measured rates
            log(what="denoise_step", block=L, loop=mode, ms_per_forward=per * 1e3, roofline_ms=roof * 1e3,
                roofline_nominal_ms=max(nbytes / bw, flops / 790e12) * 1e3, pct_of_roofline=100 * roof / per,
                compile_s=compile_s, canvas_sha=digest(res[1]))

    if MESH is not None:
        return
    # loop overhead: a tiny body (one [32,4096]x[4096,4096] matmul) in a dynamic while_loop vs a fori_loop
    w = jax.random.normal(jax.random.key(0), (4096, 4096), jnp.bfloat16) * 0.01
    x0 = jax.random.normal(jax.random.key(1), (32, 4096), jnp.bfloat16)
    n = 2000
    wl = jax.jit(lambda x, n: jax.lax.while_loop(lambda c: (c[0] < n) & (c[1][0, 0] < 1e9),
                                                 lambda c: (c[0] + 1, jnp.tanh(c[1] @ w)), (0, x))[1],
                 compiler_options=LOOP_OPTIONS)
    fl = jax.jit(lambda x: jax.lax.fori_loop(0, n, lambda i, x: jnp.tanh(x @ w), x), compiler_options=LOOP_OPTIONS)
    tw = median_seconds(lambda: wl(x0, n), reps=5) / n
    tf = median_seconds(lambda: fl(x0), reps=5) / n
    log(what="loop_overhead", while_us=tw * 1e6, fori_us=tf * 1e6, dynamic_predicate_cost_us=(tw - tf) * 1e6)


def profile_phase(params):
    """One traced call of the 16-step fori loop per canvas length: how much of a step the GPU is busy, and with
    which kernels, each described from the compiled module (benchmarks/xplane_summary.py, hlo_describe.py)."""
    import tempfile

    from xplane_summary import summarize

    for L in map(int, args.blocks.split(",")):
        sampler, c, cache, canvas, sstate = step_inputs(L)
        f = step_loop(sampler, c, sstate)
        call = lambda: f(params, cache, canvas, 16, jax.random.key(3), True)  # noqa: E731
        jax.block_until_ready(call())
        jax.block_until_ready(call())
        d = tempfile.mkdtemp()
        with jax.profiler.trace(d):
            jax.block_until_ready(call())
        hlo = f.lower(params, cache, canvas, 16, jax.random.key(3), True).compile().as_text()
        s = summarize(d, steps=16, top=args.profile_top, hlo_text=hlo)
        top = s.pop("top", [])
        log(what="profile", block=L, **s)
        for row in top:
            log(what="profile_kernel", block=L, **row)


def generate_phase(params):
    prompt = np.random.default_rng(0).integers(0, min(150000, cfg.vocab_size - 1), (1, args.prompt)).astype(np.int32)
    for L in map(int, args.blocks.split(",")):
        sampler, c = sampler_for(L)
        kw = dict(key=jax.random.key(0), max_new_tokens=256, block_length=L, sampler=sampler, eos_token_id=(),
                  mesh=MESH)
        t = time.perf_counter()
        out = generate(params, c, prompt, **kw)
        jax.block_until_ready(out)
        first = time.perf_counter() - t
        per = median_seconds(lambda: generate(params, c, prompt, **kw), reps=5)
        fwd, com = int(out.total_forwards), int(out.commits)
        log(what="generate", block=L, first_call_s=first, seconds=per, new_tokens=256, denoise_forwards=fwd,
            commits=com, forced_tpf=256 / (fwd + com), tokens_per_s=256 / per, tokens_sha=digest(out.tokens),
            ms_per_forward_incl_prefill=per * 1e3 / (fwd + com))


def breakdown_phase(params):
    """Where a step's time goes: the forward alone, the sampler alone, the forward minus its LM head."""
    for L in map(int, args.blocks.split(",")):
        sampler, c, cache, canvas, sstate = step_inputs(L)
        fwd = jax.jit(lambda p, cache, canvas: qwendlm.decode(p, c, canvas, cache))
        hidden = jax.jit(lambda p, cache, canvas: qwendlm.decode(p, c, canvas, cache, return_hidden=True)[1])
        logits = fwd(params, cache, canvas)
        samp = jax.jit(lambda lg, canvas, st, key: sampler.step(lg, canvas, st, key, 0, jnp.ones((1,), bool)))
        for name, fn in [("forward_with_head", lambda: fwd(params, cache, canvas)),
                         ("forward_hidden_only", lambda: hidden(params, cache, canvas)),
                         ("sampler_only", lambda: samp(logits, canvas, sstate, jax.random.key(0)))]:
            log(what="breakdown", block=L, part=name, ms=median_seconds(fn, reps=20) * 1e3)


rates = ceilings(20 if jax.default_backend() == "gpu" else 1)  # a CPU smoke run: one 8192^3 GEMM per timing
t = time.perf_counter()
params = P.init(specs, jax.random.key(0), MESH)
jax.block_until_ready(params)
log(what="init", params_gb=nbytes / 1e9, seconds=time.perf_counter() - t)
if args.phase == "step":
    step_phase(params, rates)
elif args.phase == "breakdown":
    breakdown_phase(params)
elif args.phase == "profile":
    profile_phase(params)
else:
    generate_phase(params)
