"""Probe: jax's own Hopper matmul (jax.experimental.pallas.ops.gpu.hopper_matmul_mgpu: Mosaic GPU, TMA, wgmma,
warp-specialized, persistent over the SMs) against XLA's GEMM (cuBLAS) at the canvas-256 projections that cuBLAS
runs at ~54% of its rate (Qwen3-4B o and down, DiffusionGemma o and dense down), M = 256, and at DiffusionGemma's LM
head (`--shapes dg_head`: 378 GFLOP per step, where a few % of the GEMM rate is ~20-60 us per step). XLA's GEMM
also with the weight as [N, K] ("xla_nt", x @ w^T: the model's LM head, the embedding [V, D]; the "xla" row takes
[K, N], the projections' layout): which layout cuBLAS runs faster. Session 54 (benchmarks/results/
2026-12-05_dg_softcap_masked_h200.md): [N, K] faster at the head, o and dense down alone (570 against 586, 16.4
against 18.0, 13.6 against 14.2 us); a [K, N] copy of the head changed nothing in the forward.

  python benchmarks/mgpu_matmul_probe.py [--shapes qwen_o,dg_o] [--xla-only] [--out mgpu_probe.jsonl]

Decides whether a library kernel could take those GEMMs (our own Triton split-K kernel could not:
benchmarks/results/2026-12-03_splitk_canvas_h200.md). Each variant is checked against the float32 product, then timed
as one program multiplying R distinct weights (> 1.5 GB: no L2 reuse), outputs returned as a tuple. Each
configuration compiles in ~15 s on the H200's host: one shape's 16 fit a device call, all four do not. Session 36's
result (Qwen3 o: 20.6 us at best against cuBLAS's 16.0) is in benchmarks/results/2026-12-03_splitk_canvas_h200.md.
"""

import argparse
import itertools
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from orl_jax import runtime  # noqa: E402

runtime.configure(None)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from bench_io import recorder  # noqa: E402
from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm  # noqa: E402
from timing import chip_rates, median_seconds  # noqa: E402

SHAPES = {"qwen_o": (4096, 2560), "qwen_down": (9728, 2560), "dg_o": (4096, 2816), "dg_dense_down": (2112, 2816),
          # DiffusionGemma's LM head over the canvas, h [256, D] @ E^T [D, V] (E^T as a [K, N] copy: the kernel
          # takes B row-major): cuBLAS runs it at ~695 TFLOP/s (544 us per step, 2026-12-04_dg_sampler_tail_h200.md)
          "dg_head": (2816, 262144)}
TIMED_BYTES = 1.5e9


def configs():
    """Tiles 64/128 x 64/128 (jax 0.11.2's kernel asserts on tile_n 32), 4 or 6 pipeline steps, the two compute
    warpgroups along M or N. Each compiles in ~15 s on the H200's host."""
    return [hm.TuningConfig(tile_m=tm, tile_n=tn, tile_k=64, max_concurrent_steps=steps, epi_tile_m=64, epi_tile_n=64,
                            wg_dimension=wg)
            for tm, tn, steps, wg in itertools.product((64, 128), (64, 128), (4, 6), hm.MatmulDimension)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, default=256)
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated subset of {', '.join(SHAPES)}")
    ap.add_argument("--out", default="mgpu_probe.jsonl")
    ap.add_argument("--xla-only", action="store_true", help="XLA's two layouts alone (no library configs to compile)")
    args = ap.parse_args()
    record = recorder(args.out)
    record(what="chip", device=jax.devices()[0].device_kind, jax=jax.__version__, **chip_rates())
    m = args.m
    for name in args.shapes.split(","):
        k, n = SHAPES[name]
        reps = max(2, int(TIMED_BYTES // (k * n * 2)))
        keys = jax.random.split(jax.random.key(len(name)), reps + 1)
        ws = [jax.random.normal(kk, (k, n), jnp.bfloat16) * 0.02 for kk in keys[1:]]
        x = jax.random.normal(keys[0], (m, k), jnp.bfloat16)
        ref = jnp.dot(x.astype(jnp.float32), ws[0].astype(jnp.float32))
        tflop = 2 * m * k * n / 1e12

        def timed(f, ws=ws):
            return median_seconds(jax.jit(lambda x, ws: tuple(f(x, w) for w in ws)), x, ws, calls=3) / reps

        def err(out):
            return float(jnp.linalg.norm(out.astype(jnp.float32) - ref) / jnp.linalg.norm(ref))

        t = timed(jnp.dot)
        record(shape=name, m=m, k=k, n=n, variant="xla", us=t * 1e6, tflop_s=tflop / t, rel_err=err(jnp.dot(x, ws[0])))
        # the weight as [N, K] (x @ w^T: how the models hold the LM head, the embedding [V, D]), the same products
        wt = [w.T for w in ws]
        nt = lambda x, w: jnp.einsum("mk,nk->mn", x, w)  # noqa: E731
        t_nt = timed(nt, wt)
        record(shape=name, m=m, k=k, n=n, variant="xla_nt", us=t_nt * 1e6, tflop_s=tflop / t_nt,
               rel_err=err(nt(x, wt[0])))
        del wt
        best = (float("inf"), None)
        for cfg in [] if args.xla_only else configs():
            f = lambda x, w, cfg=cfg: hm.matmul(x, w, None, cfg)  # noqa: E731
            try:
                rel = err(jax.jit(f)(x, ws[0]))
                tc = timed(f)
            except Exception as ex:  # a config the kernel or the chip refuses
                record(shape=name, variant=repr(cfg), error=repr(ex)[:200])
                continue
            record(shape=name, m=m, k=k, n=n, variant=repr(cfg), us=tc * 1e6, tflop_s=tflop / tc, rel_err=rel)
            if rel < 5e-3 and tc < best[0]:
                best = (tc, cfg)
        print(f"{name:14s} xla {t * 1e6:6.1f} us (weight [N, K]: {t_nt * 1e6:6.1f})  "
              f"library best {best[0] * 1e6:6.1f} us  {best[1]}", flush=True)


if __name__ == "__main__":
    main()
