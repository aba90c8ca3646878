"""Issue #3: can one persistent kernel run a chain of dependent decode-size GEMMs cheaper than one launch each?

Session 32 found a dependent cuBLAS call in the engine's CUDA graph costs ~3.6-4 us before it reads a byte
(benchmarks/launch_tax_probe.py: [32, 4096] x [4096, 4096] took 11.44 us, 2.93 TB/s), and sessions 32-33 that at
block 32 only fewer kernels on the dependency chain can take that off. The way the seeds' engine does it is one
kernel whose programs stay resident (one per SM) and wait at a grid-wide barrier between phases. This probe measures
what that costs in Pallas (Triton lowering) before anything is built on it:

  barrier     a persistent grid that only passes R grid barriers: the cost of one barrier
  chain       L dependent GEMMs y_i = y_{i-1} @ W_(i mod 16) at [32, 4096] x [4096, 4096] bf16 (16 distinct
              weights, 537 MB, each read from HBM), each program owning bn output columns, a grid barrier after each
              layer; against the same chain as L cuBLAS calls in the engine's command buffers (launch_tax_probe's
              gemm_4096). Per layer = the difference between two chain lengths over the extra layers.

The barrier: every program counts itself in with an acquire-release atomic add on one int32 in global memory (after
a block barrier, so the release covers all its threads' stores) and spins on atomic reads until the count reaches
programs x phases; a spin cap keeps a grid that is not all resident from hanging (its rows then report the spins and
are not valid). Activations written by other programs are read with volatile loads (not from a possibly stale L1;
jax 0.10-0.11 map Triton's ".cg" modifier to a missing key).

Session 37 added `--k-mult` (weights of K = m x 4096 rows, constant activations: the time per layer at several K fits
a fixed cost per layer plus a streaming rate) and flag f, one flat loop over every layer's K steps with the barrier
inside it, so the weight pipeline does not drain at a layer's end
(benchmarks/results/2026-12-03_persistent_chain_h200.md).

  python benchmarks/persistent_chain_probe.py --out probe.jsonl
  python benchmarks/persistent_chain_probe.py --k-mult 4 --configs 32:128:4:16:pbxc,32:256:8:8:bcf
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
from dataclasses import dataclass

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

ap = argparse.ArgumentParser()
ap.add_argument("--out", default="persistent_chain.jsonl")
ap.add_argument("--lengths", default="16,64", help="two chain lengths, comma-separated")
ap.add_argument("--configs", default="32:128:4:8:pbx,32:256:4:4:pbx,32:128:4:8:bl,32:256:4:4:bl,32:128:4:8:pbxc,"
                "32:256:4:4:pbxc,32:128:8:8:pbx,32:64:4:12:pbx",
                help="chain kernel configs bn:bk:warps:stages:flags, flags from p (prefetch: the next W's first tile "
                     "loaded before the barrier), b (W blocked [P, K, bn]: each program's columns contiguous), x "
                     "(plain loads of the activations instead of volatile ones), c (constant activations, no loads: "
                     "the weights' streaming alone; wrong products), l (one launch per layer, no barrier), f (one flat "
                     "loop over every layer's K steps, the barrier inside it at each layer's last step, so the weight "
                     "pipeline never drains at a layer boundary; activations by volatile loads unless c)")
ap.add_argument("--k-mult", type=int, default=1,
                help="K = this x 4096 rows per weight, constant-activation (c) configs only: the per-layer time at "
                     "two K separates the streaming rate inside a layer from the fixed cost at each layer's start")
ap.add_argument("--interpret", action="store_true", help="export for CUDA and verify the Triton IR only (any machine)")
args = ap.parse_args()
sys.path.insert(0, os.path.dirname(__file__))
from bench_io import chain_lengths  # noqa: E402

lengths = chain_lengths(ap, args.lengths)
if args.k_mult < 1:
    ap.error(f"--k-mult must be >= 1, got {args.k_mult}")
@dataclass(frozen=True)
class Chain:
    bn: int  # output columns per program (programs: D // bn, all resident)
    bk: int  # K rows per step
    warps: int
    stages: int
    flags: str  # p: prefetch, b: blocked weights, x: plain activation loads, c: constant activations, l: launches,
    # f: flat loop

    @staticmethod
    def parse(text: str) -> Chain:
        bn, bk, warps, stages, *flags = text.split(":")
        return Chain(int(bn), int(bk), int(warps), int(stages), flags[0] if flags else "")

    def build(self, n_layers: int):
        """The chain of n_layers as this config runs it: one launch per layer (l) or one persistent kernel."""
        return (launches_fn if "l" in self.flags else chain_fn)(n_layers, self)


configs = [Chain.parse(c) for c in args.configs.split(",")]
if any("f" in c.flags and "l" in c.flags for c in configs):
    ap.error("flag f (flat loop) is a persistent chain: it does not combine with l")
if args.k_mult > 1 and any("c" not in c.flags or "l" in c.flags for c in configs):
    ap.error("--k-mult > 1 takes persistent constant-activation configs only (flag c, no l): the chain's y is "
             "[32, 4096], not [32, K]")

from orl_jax import runtime  # noqa: E402

runtime.configure(None)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import triton as pltriton  # noqa: E402
from timing import median_seconds  # noqa: E402

from orl_jax_kernels.pallas_args import triton_params  # noqa: E402

MAX_SPIN = 1 << 20  # ~a second of spinning: a grid that cannot be resident finishes (wrongly) instead of hanging
M, D, N_W = 32, 4096, 16
K = D * args.k_mult  # rows of each weight (= D for the real chain)


def grid_barrier(count_ref, target):
    """Wait until `target` arrivals are counted in count_ref[0] (this program's included); -> spins taken."""
    pltriton.debug_barrier()  # the program's stores before thread 0's release
    seen = pltriton.atomic_add(count_ref, (0,), jnp.int32(1)) + 1
    seen, spins = jax.lax.while_loop(
        lambda c: (c[0] < target) & (c[1] < MAX_SPIN),
        lambda c: (pltriton.atomic_add(count_ref, (0,), jnp.int32(0)), c[1] + 1), (seen, jnp.int32(0)))
    pltriton.debug_barrier()  # every thread after thread 0's acquire
    return spins


def _barrier_kernel(count_in, count_ref, spins_ref, *, rounds: int):
    nprog = pl.num_programs(0)
    spins = jax.lax.fori_loop(0, rounds, lambda r, s: jnp.maximum(s, grid_barrier(count_ref, (r + 1) * nprog)),
                              jnp.int32(0))
    spins_ref[pl.program_id(0)] = spins


def k_rows(k, bk: int):
    """Rows k * bk .. k * bk + bk of K (k a Python int or a traced step)."""
    return pl.ds(k * bk if isinstance(k, int) else pl.multiple_of(k * bk, bk), bk)


def weight_tile(w_ref, w_i, k, bn: int, bk: int, blocked: bool):
    """K tile k of this program's bn columns of weight w_i: from the blocked layout [N_W, P, K, bn] or the plain one."""
    pid = pl.program_id(0)
    if blocked:
        return w_ref[w_i, pid, k_rows(k, bk), :]
    return w_ref[w_i, k_rows(k, bk), pl.ds(pl.multiple_of(pid * bn, bn), bn)]


def column_gemm(load_x, load_w, bk: int, w0=None):
    """One program's columns of x @ W over K = D in bk-row steps, float32: load_x(rows of K) -> [M, bk], load_w(step)
    -> [bk, bn]; w0, when given, the first step's weight tile (loaded earlier by the caller)."""
    acc = jnp.dot(load_x(k_rows(0, bk)), load_w(0) if w0 is None else w0, preferred_element_type=jnp.float32)

    def body(k, acc):
        return acc + jnp.dot(load_x(k_rows(k, bk)), load_w(k), preferred_element_type=jnp.float32)

    return jax.lax.fori_loop(1, K // bk, body, acc)


def _flat_chain_kernel(x_ref, w_ref, count_in, ys_ref, count_ref, spins_ref, *, bn: int, bk: int, blocked: bool,
                       const_x: bool):
    """One loop over (layer, K step): Triton's pipeliner keeps loading the next layer's weight tiles (they do not
    depend on the barrier) while a program waits at the barrier of the layer it just finished. The activations (unless
    const_x) are volatile loads of the previous layer's output, x itself in layer 0: exact only if the pipeliner does
    not hoist them above the barrier (the error check against cuBLAS says)."""
    pid = pl.program_id(0)
    nprog = pl.num_programs(0)
    cols = pl.ds(pl.multiple_of(pid * bn, bn), bn)
    n_layers, steps = ys_ref.shape[0], K // bk
    const = jnp.full((M, bk), 0.01, jnp.bfloat16)

    def body(t, acc):
        i, k = t // steps, jax.lax.rem(t, steps)
        w = weight_tile(w_ref, jax.lax.rem(i, jnp.int32(N_W)), k, bn, bk, blocked)
        if const_x:
            x = const
        else:  # both loads issued, one kept: layer 0 reads x, layer i the output of layer i - 1
            prev = pltriton.load(ys_ref.at[jnp.maximum(i - 1, 0), :, k_rows(k, bk)], volatile=True)
            x = jnp.where(i == 0, x_ref[:, k_rows(k, bk)], prev)
        acc = acc + jnp.dot(x, w, preferred_element_type=jnp.float32)
        last = k == steps - 1

        @pl.when(last)
        def _():
            ys_ref[i, :, cols] = acc.astype(ys_ref.dtype)
            spins_ref[pid] = jnp.maximum(spins_ref[pid], grid_barrier(count_ref, (i + 1) * nprog))

        return jnp.where(last, 0.0, acc)

    spins_ref[pid] = jnp.int32(0)
    jax.lax.fori_loop(0, n_layers * steps, body, jnp.zeros((M, bn), jnp.float32))


def _chain_kernel(x_ref, w_ref, count_in, ys_ref, count_ref, spins_ref, *, bn: int, bk: int, prefetch: bool,
                  blocked: bool, plain_x: bool, const_x: bool):
    pid = pl.program_id(0)
    nprog = pl.num_programs(0)
    cols = pl.ds(pl.multiple_of(pid * bn, bn), bn)
    n_layers = ys_ref.shape[0]

    def w_tile(i, k):  # K tile k of this program's columns of W_(i mod N_W)
        return weight_tile(w_ref, jax.lax.rem(i, jnp.int32(N_W)), k, bn, bk, blocked)

    def gemm(load_x, i, w0):  # w0: the first K tile of W_i, loaded before this layer's barrier (prefetch)
        if const_x:  # no activation loads (wrong products): what streaming the weights alone costs
            load_x = lambda ks: jnp.full((M, bk), 0.01, jnp.bfloat16)  # noqa: E731
        return column_gemm(load_x, lambda k: w_tile(i, k), bk, w0 if prefetch else None)

    i0 = jnp.int32(0)
    ys_ref[0, :, cols] = gemm(lambda ks: x_ref[:, ks], i0, None).astype(ys_ref.dtype)
    w0 = w_tile(i0 + 1, 0) if prefetch else None  # issued before the wait: its latency hides behind the barrier
    spins = grid_barrier(count_ref, nprog)

    def layer(i, carry):
        spins, w0 = carry
        load = (lambda ks: ys_ref[i - 1, :, ks]) if plain_x else (
            lambda ks: pltriton.load(ys_ref.at[i - 1, :, ks], volatile=True))
        acc = gemm(load, i, w0)
        ys_ref[i, :, cols] = acc.astype(ys_ref.dtype)
        w0 = w_tile(i + 1, 0) if prefetch else w0
        return jnp.maximum(spins, grid_barrier(count_ref, (i + 1) * nprog)), w0

    spins_ref[pid] = jax.lax.fori_loop(1, n_layers, layer, (spins, w0))[0]


def full(shape):
    return pl.BlockSpec(shape, lambda i: (0,) * len(shape))


def barrier_fn(nprog: int, rounds: int):
    def run():
        count = jnp.zeros((1,), jnp.int32)
        return pl.pallas_call(
            functools.partial(_barrier_kernel, rounds=rounds),
            out_shape=(jax.ShapeDtypeStruct((1,), jnp.int32), jax.ShapeDtypeStruct((nprog,), jnp.int32)),
            grid=(nprog,), in_specs=[full((1,))], out_specs=(full((1,)), full((nprog,))),
            input_output_aliases={0: 0}, interpret=False, **triton_params(4, 1, False))(count)[1]
    return run


def chain_fn(n_layers: int, c: Chain):
    bn = c.bn

    def run(x, ws):  # ws [N_W, K, D], or blocked [N_W, D // bn, K, bn]
        count = jnp.zeros((1,), jnp.int32)
        kernel = (functools.partial(_flat_chain_kernel, bn=bn, bk=c.bk, blocked="b" in c.flags,
                                    const_x="c" in c.flags) if "f" in c.flags
                  else functools.partial(_chain_kernel, bn=bn, bk=c.bk, prefetch="p" in c.flags,
                                         blocked="b" in c.flags, plain_x="x" in c.flags, const_x="c" in c.flags))
        ys, _, spins = pl.pallas_call(
            kernel,
            out_shape=(jax.ShapeDtypeStruct((n_layers, M, D), x.dtype), jax.ShapeDtypeStruct((1,), jnp.int32),
                       jax.ShapeDtypeStruct((D // bn,), jnp.int32)),
            grid=(D // bn,), in_specs=[full(x.shape), full(ws.shape), full((1,))],
            out_specs=(full((n_layers, M, D)), full((1,)), full((D // bn,))),
            input_output_aliases={2: 1}, **triton_params(c.warps, c.stages, False))(x, ws, count)
        return ys[-1], ys[0], jnp.max(spins)
    return run


def _layer_kernel(i_ref, x_ref, w_ref, y_ref, *, bn: int, bk: int, blocked: bool):
    """One layer of the chain as its own launch: y[:, this program's columns] = x @ W_i[:, those columns]."""
    pid = pl.program_id(0)
    cols = pl.ds(pl.multiple_of(pid * bn, bn), bn)
    i = i_ref[0]
    y_ref[:, cols] = column_gemm(lambda ks: x_ref[:, ks], lambda k: weight_tile(w_ref, i, k, bn, bk, blocked),
                                 bk).astype(y_ref.dtype)


def launches_fn(n_layers: int, c: Chain):
    """The same GEMM code launched once per layer (no barrier): against `chain_fn`, a launch against a barrier."""
    def run(x, ws):
        call = pl.pallas_call(
            functools.partial(_layer_kernel, bn=c.bn, bk=c.bk, blocked="b" in c.flags),
            out_shape=jax.ShapeDtypeStruct((M, D), x.dtype), grid=(D // c.bn,),
            in_specs=[full((1,)), full(x.shape), full(ws.shape)], out_specs=full((M, D)),
            **triton_params(c.warps, c.stages, False))
        first = x = call(jnp.zeros((1,), jnp.int32), x, ws)
        for i in range(1, n_layers):
            x = call(jnp.full((1,), i % N_W, jnp.int32), x, ws)
        return x, first, jnp.int32(0)
    return run


def cublas_fn(n_layers: int):
    """The chain as one cuBLAS call per layer; at K > D each layer's [M, D] output is tiled to [M, K] first (one small
    extra kernel per layer: it moves the fixed cost per layer, not the streaming rate)."""
    def widen(y):
        return y if K == D else jnp.tile(y, (1, K // D))

    def run(x, ws):
        first = x = jax.lax.optimization_barrier(jnp.dot(x, ws[0]))
        for i in range(1, n_layers):
            x = jax.lax.optimization_barrier(jnp.dot(widen(x), ws[i % N_W]))
        return x, first
    return run


def graphed(fn):
    """Compiled as the engine's programs are: in CUDA graphs (command buffers)."""
    return jax.jit(fn, compiler_options=runtime.ENGINE_COMPILER_OPTIONS)


def per_layer(t) -> dict:
    """Timings of the two chain lengths -> the cost of one layer and the weight read rate it implies."""
    per = (t[1] - t[0]) / (lengths[1] - lengths[0])
    return {"ms": [s * 1e3 for s in t], "us_per_layer": per * 1e6, "weight_tb_s": K * D * 2 / per / 1e12}


def rel_err(a, b):
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


key = jax.random.key(0)
x = jax.random.normal(key, (M, K), jnp.bfloat16)
ws = (jax.random.normal(jax.random.key(1), (N_W, K, D), jnp.float32) * K**-0.5).astype(jnp.bfloat16)


def weights_for(c: Chain):
    """The weights as config c reads them: blocked, each program's bn columns of every W one contiguous [D, bn]."""
    return ws.reshape(N_W, K, D // c.bn, c.bn).transpose(0, 2, 1, 3) if "b" in c.flags else ws


if args.interpret:  # export for CUDA on any machine and verify the Triton IR (no GPU: nothing is compiled or timed)
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    from triton_ir import verified_triton_modules

    n = verified_triton_modules(barrier_fn(128, 3))
    for c in configs:
        n += verified_triton_modules(c.build(lengths[0]), x, weights_for(c))
    print(f"verified {n} Triton modules", flush=True)
    sys.exit(0)

meta = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "k": K}
with open(args.out, "a") as f:
    def emit(row):
        row.update(meta)
        f.write(json.dumps(row) + "\n")
        f.flush()
        print(json.dumps(row), flush=True)

    for nprog in (128, 132):
        spins = int(jnp.max(graphed(barrier_fn(nprog, 3))()))
        if spins >= MAX_SPIN:  # not all resident: timing it would only time the spin cap
            emit({"what": "grid_barrier", "programs": nprog, "max_spins": spins, "valid": False})
            continue
        fns = [graphed(barrier_fn(nprog, r)) for r in (100, 1100)]
        t = [median_seconds(fn, reps=10) for fn in fns]
        emit({"what": "grid_barrier", "programs": nprog, "rounds": [100, 1100], "ms": [s * 1e3 for s in t],
              "us_per_barrier": (t[1] - t[0]) / 1000 * 1e6, "max_spins": spins, "valid": True})

    ref = [graphed(cublas_fn(n)) for n in lengths]
    ref_out = [fn(x, ws) for fn in ref]
    emit({"what": "chain", "impl": "cublas", "lengths": lengths,
          **per_layer([median_seconds(fn, x, ws, reps=20, calls=10) for fn in ref])})

    for c in configs:
        row = {"what": "chain", "impl": "launches" if "l" in c.flags else "persistent", **dataclasses.asdict(c),
               "programs": D // c.bn, "lengths": lengths}
        try:
            wc = jax.block_until_ready(weights_for(c))
            fns = [graphed(c.build(n)) for n in lengths]
            outs = [fns[0](x, wc)]
            if int(outs[0][2]) < MAX_SPIN:
                outs.append(fns[1](x, wc))
            spins = max(int(o[2]) for o in outs)
            if spins >= MAX_SPIN:
                row.update(max_spins=spins, valid=False)
                emit(row)
                continue
            row.update(max_spins=spins, valid=True)
            if K == D:
                row.update(rel_err_first=rel_err(outs[0][1], ref_out[0][1]),
                           rel_err_last=[rel_err(o[0], r[0]) for o, r in zip(outs, ref_out)])
            row.update(per_layer([median_seconds(fn, x, wc, reps=20, calls=10) for fn in fns]))
            del wc
        except Exception as e:  # noqa: BLE001 - one config failing to compile must not end the sweep
            row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
        emit(row)
