"""How fast can a kernel of ours stream DiffusionGemma's expert bytes, against XLA's flat read of the same bytes?
(issue #4)

Session 45's L2 probe (l2_expert_prefix_probe.py) timed XLA's sum over a flat 512 MiB bf16 buffer at 117 us in a
trace (4.59 TB/s) on the machine where the one-launch expert kernel read its 1.52 GB layer in 347-348 us (4.37 TB/s);
`timing.chip_rates` (an int32 sum over 2 GiB, wall clock) reads 4.0-4.2 TB/s on these machines. If the chip streams at
~4.6 TB/s, the expert kernel leaves ~17 us per layer (0.5 ms per forward). This probe asks what reads of these bytes
reach. Per layer of a 4-layer stack, timed per layer with 20 programs per sync (wall clock):

  xla_flat          XLA's sum over one layer's gate/up bytes (float32)
  tma tn/tk/st      a Pallas Mosaic GPU product x [64, 2816] @ w [2816, 180224] (one layer's gate/up bytes, 1.01
                    GB) streamed by TMA into swizzled shared memory, st steps in flight, one wgmma in flight (the
                    tma_gemm kernel removed in session 32, git 9c8292e): what Hopper's copy engine reads per layer
                    with the expert kernel's [tk, tn] weight tiles, beside XLA's flat read of the same array
  ws tn/tk/st       jax's library Hopper matmul (jax.experimental.pallas.ops.gpu.hopper_matmul_mgpu: Mosaic GPU,
                    a TMA producer warpgroup feeding two wgmma warpgroups, st steps in flight, persistent over the
                    SMs) on the same x [64, 2816] @ w [2816, 180224]: whether a warp-specialized pipeline, the one
                    design no expert kernel of ours has tried, reads nearer XLA's flat sum (if it does, an expert
                    kernel of that design is worth building; if not, the Triton kernel's 92-94% stands)
  experts           the fused expert kernel (mlp.grouped_mlp, the model's settings) on a 26B layer, 256 tokens x
                    top-8 routed uniformly

  python benchmarks/read_ceiling_probe.py --out $BENCH/read_ceiling.jsonl
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from orl_jax import runtime  # noqa: E402

runtime.configure(None)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from bench_io import recorder  # noqa: E402
from expert_case import CPU, D, E, F, experts, routed_case  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from timing import chip_rates, median_seconds  # noqa: E402

LAYERS, CALLS = (2, 1) if CPU else (4, 20)  # a CPU run is a smoke run: tiny shapes, interpret mode, no timing sense


ROWS = 64  # wgmma's M per warpgroup


def tma_product(x, w, *, tn: int, tk: int, stages: int):
    """x [64, K] @ w [K, N] -> [64, N] bf16: each program one tn-wide column tile, [tk, tn] weight tiles and [64, tk]
    x tiles by TMA into 128-byte swizzled shared memory, `stages` steps in flight, a float32 wgmma accumulator."""
    import inspect

    import jax.experimental.pallas.mosaic_gpu as plgpu

    (m, k), n = x.shape, w.shape[1]
    transforms = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    delay = "delay_release" in inspect.signature(plgpu.emit_pipeline).parameters

    def kernel(x_gmem, w_gmem, o_gmem, o_smem):
        j = jax.lax.axis_index("n")

        def product(acc):
            def step(_, x_smem, w_smem):
                plgpu.wgmma(acc, x_smem, w_smem)
                plgpu.wgmma_wait(1)

            late = {} if delay else {"delay_release": 1}
            plgpu.emit_pipeline(
                step,
                in_specs=[plgpu.BlockSpec((ROWS, tk), lambda i: (0, i), transforms=transforms, **late),
                          plgpu.BlockSpec((tk, tn), lambda i: (i, j), transforms=transforms, **late)],
                grid=(k // tk,), max_concurrent_steps=stages, **({"delay_release": 1} if delay else {}),
            )(x_gmem, w_gmem)
            plgpu.wgmma_wait(0)
            return acc[...]

        o_smem[...] = pl.run_scoped(product, plgpu.ACC((ROWS, tn), jnp.float32)).astype(o_smem.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[:, pl.ds(j * tn, tn)])
        plgpu.wait_smem_to_gmem(0)

    return plgpu.kernel(kernel, out_type=jax.ShapeDtypeStruct((m, n), x.dtype),
                        scratch_types=dict(o_smem=plgpu.SMEM((ROWS, tn), x.dtype)),
                        grid=(n // tn,), grid_names=("n",))(x, w)


# (tile_n, tile_k, steps): the CTA takes 2 x tile_n columns (two compute warpgroups along N); a step holds a
# [64, tk] x tile and a [tk, 2 tn] weight tile, so tn 128 / tk 64 fits 4 steps in shared memory, tn 64 / tk 64 six
WS_TILES = [(64, 64, 4), (64, 64, 6), (128, 64, 3), (128, 64, 4), (64, 128, 3), (64, 128, 4)]


def ws_product(x, w, *, tn: int, tk: int, steps: int):
    """x [64, K] @ w [K, N] by jax's warp-specialized Hopper matmul (one row tile; columns over the SMs)."""
    from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm

    cfg = hm.TuningConfig(tile_m=ROWS, tile_n=tn, tile_k=tk, max_concurrent_steps=steps, epi_tile_m=64,
                          epi_tile_n=64, wg_dimension=hm.MatmulDimension.N)
    return hm.matmul(x, w, None, cfg)


def ws_product_check_and_time(timed, record, x, w, layer_bytes):
    """Each WS_TILES entry checked (x and w are ones: every output is K) and timed per layer."""
    k = x.shape[1]
    for tn, tk, steps in WS_TILES:
        label = f"ws tn={tn} tk={tk} steps={steps}"
        try:
            out = ws_product(x, w[0], tn=tn, tk=tk, steps=steps)
            ok = bool(jnp.all(out == k))
        except Exception as ex:  # noqa: BLE001 (a tiling the kernel or the chip refuses; the probe goes on)
            record(variant=label + " check", error=repr(ex)[:300])
            continue
        record(variant=label + " check", ok=ok)
        if ok:
            timed(label, lambda i, w, x, tn=tn, tk=tk, st=steps: ws_product(x, w[i], tn=tn, tk=tk, steps=st),
                  layer_bytes, w, x)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="read_ceiling.jsonl")
    args = ap.parse_args()
    record = recorder(args.out)
    if not CPU:
        record(variant="timing.chip_rates", **chip_rates())

    def timed(label, f, bytes_per_layer, *args):  # f(i, *args) per layer, LAYERS unrolled in one program
        g = jax.jit(lambda *a: [f(i, *a) for i in range(LAYERS)])
        try:
            us = median_seconds(g, *args, reps=5, calls=CALLS) / LAYERS * 1e6
        except Exception as ex:  # a tiling the lowering or the chip rejects
            record(variant=label, error=repr(ex)[:300])
            return
        record(variant=label, us=us, tb_s=bytes_per_layer / us / 1e6, calls=CALLS)

    k_gu = D
    n_gu = E * 2 * F  # one layer's gate/up bytes as one [D, E * 2F] matrix
    w = jnp.ones((LAYERS, k_gu, n_gu), jnp.bfloat16)
    x = jnp.ones((ROWS, k_gu), jnp.bfloat16)
    layer_bytes = k_gu * n_gu * 2
    timed("xla_flat", lambda i, w: jnp.sum(w[i].astype(jnp.float32)), layer_bytes, w)
    if not CPU:  # Mosaic GPU has no interpreter here that runs this at these shapes
        try:
            got = float(tma_product(x, w[0], tn=128, tk=64, stages=4)[0, 0])
        except Exception as ex:  # noqa: BLE001 (recorded; the rest of the probe still runs)
            got = repr(ex)[:300]
        ok = got == k_gu
        record(variant="tma check", got=got, want=k_gu, ok=ok)
        tiles = [(128, 64, 4), (128, 64, 6), (128, 128, 3), (256, 64, 4), (64, 64, 8), (128, 64, 8)]
        for tn, tk, stages in tiles if ok else []:
            timed(f"tma tn={tn} tk={tk} stages={stages}",
                  lambda i, w, x, tn=tn, tk=tk, st=stages: tma_product(x, w[i], tn=tn, tk=tk, stages=st),
                  layer_bytes, w, x)
        ws_product_check_and_time(timed, record, x, w, layer_bytes)
    timed("xla_flat, again", lambda i, w: jnp.sum(w[i].astype(jnp.float32)), layer_bytes, w)
    del w

    a = routed_case(LAYERS)
    timed("experts (grouped_mlp)", lambda i, a: experts(a, jnp.int32(i)), a["tiles"][0].nbytes + a["down"][0].nbytes,
          a)

if __name__ == "__main__":
    main()
