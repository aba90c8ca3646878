"""GPU benchmark of the fused expert MLP (kernel.expert_mlp) against the MoE's two grouped GEMMs with XLA's
activation between them (what moe.grouped_experts_mlp runs today), at DiffusionGemma 26B-A4B's expert shapes.

  python kernels/expert_mlp/bench.py [--out expert_mlp.jsonl] [--tiles "bf,bn,bk1,bk2,warps,stages[,p];..."]

An entry ending in ",p" reads the weights in the model's layout ([L, E, D, 2F] and [L, E, F, D]); the others in the
tiled layout of tile_gate_up / tile_down.

256 canvas tokens routed uniformly to top-8 of 128 experts (2048 rows, ~16 per expert). Weights: a stack of LAYERS
layers (12 GB, far past L2), each variant once per layer in one jitted program, CALLS programs per sync (the
forward's conditions: kernels/NOTES.md, session 23). Each variant is checked against the two-kernel path first.
Also timed: XLA's sum over the same weight bytes (what the chip reads under load).
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))

from orl_jax import runtime  # noqa: E402

runtime.configure(None)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from bench_io import recorder  # noqa: E402
from timing import chip_rates, median_seconds  # noqa: E402

from orl_jax.model.layers import ACTIVATIONS  # noqa: E402
from orl_jax_kernels.expert_mlp.kernel import Tiles, expert_mlp, tile_down, tile_gate_up  # noqa: E402
from orl_jax_kernels.grouped_gemm.kernel import grouped_matmul  # noqa: E402

INTERPRET = os.environ.get("ORL_BENCH_INTERPRET") == "1"  # CPU smoke run (tiny shapes, no timing sense)
E, T, TOPK, D, F, LAYERS, CALLS = 128, 256, 8, 2816, 704, 8, 20
if INTERPRET:
    E, T, TOPK, D, F, LAYERS, CALLS = 4, 8, 2, 128, 64, 2, 1
ACT = ACTIVATIONS["gelu_tanh"]
DEFAULT_TILES = "64,128,64,64,4,6;64,128,64,64,4,6,p;64,128,64,64,4,4,p;64,128,64,64,4,8,p;64,256,64,64,4,4,p"


def parse_tiles(text: str) -> list[tuple[Tiles, bool]]:
    """(tiles, plain layout) per entry."""
    out = []
    for item in filter(None, text.split(";")):
        fields = item.split(",")
        plain = fields[-1] == "p"
        bf, bn, bk1, bk2, warps, stages = (int(v) for v in fields[:6 if plain else None])
        out.append((Tiles(bf, bn, bk1, bk2, warps, stages), plain))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="expert_mlp.jsonl")
    ap.add_argument("--tiles", default=DEFAULT_TILES, help="bf,bn,bk1,bk2,warps,stages entries separated by ;")
    args = ap.parse_args()
    record = recorder(args.out)
    if not INTERPRET:
        record(variant="chip", **chip_rates())

    ks = jax.random.split(jax.random.key(0), 4)
    experts = jax.lax.top_k(jax.random.normal(ks[0], (T, E)), TOPK)[1].reshape(-1)
    order = jnp.argsort(experts, stable=True).astype(jnp.int32)
    tokens = order // TOPK
    sizes = jnp.bincount(experts, length=E).astype(jnp.int32)
    offsets = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(sizes).astype(jnp.int32)])
    x = jax.random.normal(ks[1], (T, D), jnp.bfloat16)
    gu = (jax.random.normal(ks[2], (LAYERS, E, D, 2 * F), jnp.float32) * D ** -0.5).astype(jnp.bfloat16)
    dn = (jax.random.normal(ks[3], (LAYERS, E, F, D), jnp.float32) * F ** -0.5).astype(jnp.bfloat16)
    layer_bytes = gu[0].nbytes + dn[0].nbytes

    def timed(label, f, ws, **extra):  # f(*ws, i) on layer i; microseconds per layer over the unrolled stack
        g = jax.jit(lambda *ws: [f(*ws, i) for i in range(LAYERS)])
        try:
            us = median_seconds(g, *ws, reps=2 if INTERPRET else 5, calls=CALLS) / LAYERS * 1e6
        except Exception as ex:  # a tiling the lowering or the chip rejects
            record(variant=label, error=repr(ex)[:300], **extra)
            print(f"{label}: {repr(ex)[:300]}", flush=True)
            return None
        record(variant=label, us=us, tb_s=layer_bytes / us / 1e6, calls=CALLS, **extra)
        print(f"{label}: {us:.1f} us per layer, {layer_bytes / us / 1e6:.2f} TB/s", flush=True)
        return us

    def two_kernels(gu, dn, i):  # moe.grouped_experts_mlp's products
        g, u = jnp.split(grouped_matmul(x, gu, sizes, i, offsets=offsets, rows=tokens, interpret=INTERPRET), 2, -1)
        return grouped_matmul(ACT(g) * u, dn, sizes, i, offsets=offsets, interpret=INTERPRET)

    want = two_kernels(gu, dn, jnp.int32(1)).astype(jnp.float32)
    scale = float(jnp.linalg.norm(want))
    timed("xla_read", lambda gu, dn, i: (jnp.sum(gu[i].astype(jnp.float32), axis=1),
                                         jnp.sum(dn[i].astype(jnp.float32), axis=1)), (gu, dn))
    timed("two_kernels", two_kernels, (gu, dn))
    layout = None
    for tiles, plain in parse_tiles(args.tiles):
        if plain:
            layout = ("plain", gu, dn)
        elif layout is None or layout[0] != (tiles.bf, tiles.bn):
            layout = None  # free the previous tiled copy first
            layout = ((tiles.bf, tiles.bn), tile_gate_up(gu, tiles.bf), tile_down(dn, tiles.bn))
        label = f"fused {'plain' if plain else 'tiled'} {tiles}"

        def fused(gut, dnt, i, tiles=tiles):
            return expert_mlp(x, tokens, offsets, gut, dnt, i, ACT, tiles, interpret=INTERPRET)

        try:
            err = float(jnp.linalg.norm(fused(*layout[1:], jnp.int32(1)).astype(jnp.float32) - want) / scale)
        except Exception as ex:
            record(variant=label, error=repr(ex)[:300])
            print(f"{label}: {repr(ex)[:300]}", flush=True)
            continue
        if not err < 2e-2:
            record(variant=label, error=f"relative error {err:.3g} against the two kernels")
            print(f"{label}: relative error {err:.3g}", flush=True)
            continue
        timed(label, fused, layout[1:], rel_err=err)
    timed("two_kernels (again)", two_kernels, (gu, dn))


if __name__ == "__main__":
    main()
