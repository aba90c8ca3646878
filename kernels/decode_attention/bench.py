"""GPU benchmark of the cached-pass attention kernel's block choices against XLA's einsums, at the engine's
shapes (Qwen3-4B: 32 query heads, 8 kv heads, head dim 128, batch 1, prompt 512): block 32 over a 544-slot cache
and canvas 256 over 768; and at DiffusionGemma 26B-A4B's decoder pass (canvas 256 over 768 slots, score scale
1.0): sliding layers (16 heads, 8 kv heads, head dim 256, 25 layers) and full layers (16 heads, 2 kv heads, head
dim 512, 5 layers); and masked_attention at the 26B's cache-free passes' sliding layers (dg_prefill_decode: prompt
512 + canvas 256; dg_prefill: 512). Writes the tuned table that `kernel.load_tuned` reads.

  python kernels/decode_attention/bench.py [--shapes block32,canvas256,dg_sliding,dg_full,dg_prefill_decode,
      dg_prefill] [--out attn.jsonl] [--table attn_tuned.json]

Why: a profile of the engine step (benchmarks/results/2026-11-30_engine_profile_h200x2.md) puts the kernel at
6.9 us per layer at block 32 and 30 us at canvas 256, where its default blocks give 7 key splits x 4 query tiles x
32 heads = 896 programs and 7 partial outputs to merge. The sweep includes `group_heads` (the G query heads of a
kv head in one program: K/V read once per kv head, G x more rows per dot).

Every variant is checked against orl_jax's einsum attention on the same inputs, then timed on 36 layers' distinct
caches passed as separate arguments (the kernel alone, no slicing). The best variant and XLA are also timed as the
model runs them, a `lax.scan` over a stack of 36 layers' caches ("*_scan" rows), the kernel both on the scan's
slices and reading each layer of the stacks in place ("*_in_place"); the table keeps the faster of the two.
"""

import argparse
import itertools
import os
import sys
import time
from dataclasses import dataclass

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))

from orl_jax import runtime  # noqa: E402

runtime.configure(None)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from bench_io import recorder, write_table  # noqa: E402

from orl_jax.model.attention import (  # noqa: E402
    block_segments,
    cache_mask,
    full_segments,
    scaled_attention,
    self_mask,
)
from orl_jax_kernels.decode_attention.kernel import (  # noqa: E402
    SMEM_LIMIT,
    Blocks,
    blocks_for,
    cached_attention,
    masked_attention,
    smem_bytes,
    supported,
    tile,
)

INTERPRET = os.environ.get("ORL_BENCH_INTERPRET") == "1"  # CPU smoke run of the script (tiny shapes, no timing sense)


@dataclass(frozen=True)
class Shape:
    l: int  # queries
    s: int  # cache slots
    n: int  # query heads
    kv: int  # kv heads
    h: int  # head dim
    layers: int  # distinct caches timed per call (the model's layer count of this kind)
    scale: float | None = None  # score scale; None: h ** -0.5
    # > 0: a cache-free pass (masked_attention) over l = s tokens, the first `uncached` a causal prompt, the rest a
    # canvas seeing all of them (DiffusionGemma's prefill_decode; the prefill alone: uncached = l)
    uncached: int = 0


SHAPES = {"block32": Shape(32, 544, 32, 8, 128, 36), "canvas256": Shape(256, 768, 32, 8, 128, 36),
          "dg_sliding": Shape(256, 768, 16, 8, 256, 25, 1.0), "dg_full": Shape(256, 768, 16, 2, 512, 5, 1.0),
          "dg_prefill_decode": Shape(768, 768, 16, 8, 256, 25, 1.0, uncached=512),
          "dg_prefill": Shape(512, 512, 16, 8, 256, 25, 1.0, uncached=512)}
PROMPT = 512  # filled cache slots
if INTERPRET:
    SHAPES, PROMPT = {"tiny": Shape(32, 96, 4, 2, 32, 2), "tiny_uncached": Shape(48, 48, 4, 2, 32, 2, uncached=32)}, 64


def per_call(g, *args, calls=10):
    """Median seconds of one call of the jitted g (calls queued back to back, so host dispatch overlaps)."""
    jax.block_until_ready(g(*args))
    ts = []
    for _ in range(3 if INTERPRET else 5):
        t = time.perf_counter()
        jax.block_until_ready([g(*args) for _ in range(1 if INTERPRET else calls)])
        ts.append((time.perf_counter() - t) / (1 if INTERPRET else calls))
    return float(np.median(ts))


def configs(sh: Shape):
    """Block candidates the kernel supports at the shape, one per distinct effective tiling: query tile, key chunk of
    the cache and of the own keys, cache chunks per split, heads per program; 4 warps up to 64 rows per program,
    8 above, within the shared memory estimate (kernel.smem_bytes: 512 rows asked for more than an H200 has in the
    2026-11-30 sweep). Plus the dataclass defaults and the library's rule (kernel.blocks_for), the baselines."""
    l, s, h, g = sh.l, sh.s, sh.h, sh.n // sh.kv
    out, seen = [], set()
    # cache-free passes: their tiles see different key counts (a causal prompt), so balanced splits too
    grid = (((32, 64, 128), (32, 64), (1, 2, 4, 8), (False, True), (False, True)) if sh.uncached else
            ((16, 32, 64, 128), (32, 64, 128), (1, 2, 4, 8), (False, True), (False,)))
    for bl, bs, cps, grouped, balanced in itertools.product(*grid):
        rows = min(bl, l) * (g if grouped else 1)
        b = Blocks(bl=bl, bs=bs, chunks_per_split=cps, num_warps=4 if rows <= 64 else 8, num_stages=2,
                   group_heads=grouped, balanced=balanced)
        eff = (tile(l, bl), tile(s, bs), tile(l, bs), cps, grouped, balanced)
        if bl <= l and smem_bytes(b, h, g) <= SMEM_LIMIT and supported(l, s, h, b, g) and eff not in seen:
            seen.add(eff)
            out.append(b)
    for b in (Blocks(), library_blocks(sh)):  # the default's query tile: the kernel shrinks it to fit l
        if supported(l, s, h, b, g) and b not in out:
            out.append(b)
    return out


def library_blocks(sh: Shape):
    """What the library picks at the shape without a tuned table."""
    return blocks_for(sh.l, sh.s, sh.h, sh.n // sh.kv)


def inputs(sh: Shape):
    l, s, layers = sh.l, sh.s, sh.layers
    ks = jax.random.split(jax.random.key(l + s + sh.h), 2 * layers + 3)
    q = jax.random.normal(ks[0], (1, l, sh.n, sh.h), jnp.bfloat16)
    kc = [jax.random.normal(k, (1, s, sh.kv, sh.h), jnp.bfloat16) for k in ks[3:3 + layers]]
    vc = [jax.random.normal(k, (1, s, sh.kv, sh.h), jnp.bfloat16) for k in ks[3 + layers:]]
    kself, vself = (jax.random.normal(k, (1, l, sh.kv, sh.h), jnp.bfloat16) for k in ks[1:3])
    cm = cache_mask(jnp.zeros((1,), jnp.int32), PROMPT, s, l).astype(jnp.int8)  # the prompt's slots are filled
    sm = self_mask(full_segments(1, l)).astype(jnp.int8)
    return q, kc, vc, cm, kself, vself, sm


def rel_err(out, ref) -> float:
    return float(jnp.linalg.norm(out.astype(jnp.float32) - ref) / jnp.linalg.norm(ref))


def over_layers(f):
    """f(q, k, v) over every layer's keys, each a separate argument: nothing sliced."""
    return jax.jit(lambda q, ks, vs: jnp.stack([f(q, a, b) for a, b in zip(ks, vs)]))


def sweep(name, sh: Shape, kernel, q, ks, vs, ref, record) -> list:
    """(seconds per layer, blocks, relative error) of kernel(q, k, v, blocks) for every candidate of configs(sh),
    checked against ref on the first layer, then timed over the layers; fastest first."""
    results = []
    for b in configs(sh):
        f = lambda q, k, v, b=b: kernel(q, k, v, b)  # noqa: E731
        try:
            rel = rel_err(jax.jit(f)(q, ks[0], vs[0]), ref)
            if not rel < 0.02:  # bf16 rounding is ~0.002; more is a wrong result
                record(shape=name, variant=str(b), error=f"relative error {rel:.3g}")
                continue
            results.append((per_call(over_layers(f), q, ks, vs) / sh.layers, b, rel))
        except Exception as ex:  # a block config the lowering or the chip rejects
            record(shape=name, variant=str(b), error=repr(ex)[:160])
    return sorted(results, key=lambda r: r[0])


def bench_uncached(name, sh: Shape, record) -> dict:
    """A cache-free pass's sliding-layer attention: masked_attention's block candidates against the model's einsums
    (scaled_attention, one part), each layer's keys a separate argument."""
    l, h, g, layers = sh.l, sh.h, sh.n // sh.kv, sh.layers
    ks = jax.random.split(jax.random.key(l + h), 2 * layers + 1)
    q = jax.random.normal(ks[0], (1, l, sh.n, h), jnp.bfloat16)
    kk, vv = ([jax.random.normal(k, (1, l, sh.kv, h), jnp.bfloat16) for k in ks[a:a + layers]]
              for a in (1, 1 + layers))
    mask = self_mask(block_segments(1, l, sh.uncached, max(l - sh.uncached, 1)))  # causal prompt, canvas after it
    m8 = mask.astype(jnp.int8)
    scale = h ** -0.5 if sh.scale is None else sh.scale
    f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
    ref = scaled_attention(f32(q), [(f32(kk[0]), f32(vv[0]), mask)], scale)
    xla = lambda q, k, v: scaled_attention(q, [(k, v, mask)], scale)  # noqa: E731
    t_xla = per_call(over_layers(xla), q, kk, vv) / layers
    record(shape=name, l=l, variant="xla", us_per_layer=t_xla * 1e6,
           rel_err=rel_err(jax.jit(xla)(q, kk[0], vv[0]), ref))
    results = sweep(name, sh, lambda q, k, v, b: masked_attention(q, k, v, m8, scale=scale, blocks=b,
                                                                  interpret=INTERPRET), q, kk, vv, ref, record)
    lib = library_blocks(sh)
    for t, b, rel in results[:8] + [r for r in results[8:] if r[1] == lib]:
        record(shape=name, l=l, variant=str(b), us_per_layer=t * 1e6, rel_err=rel, blocks=b.__dict__,
               library=b == lib)
    best_t, best, _ = results[0]
    print(f"{name}: L={l} (prompt {sh.uncached})  xla {t_xla * 1e6:.1f} us  best {best_t * 1e6:.1f} us {best}",
          flush=True)
    return {"l": l, "s": l, "h": h, "g": g, "blocks": best.__dict__, "us": best_t * 1e6, "xla_us": t_xla * 1e6}


def bench_shape(name, sh: Shape, record) -> dict:
    if sh.uncached:
        return bench_uncached(name, sh, record)
    l, s, h, g, layers = sh.l, sh.s, sh.h, sh.n // sh.kv, sh.layers
    q, kc, vc, cm, kself, vself, sm = inputs(sh)
    scale = h ** -0.5 if sh.scale is None else sh.scale
    xla = lambda q, kc, vc: scaled_attention(q, [(kc, vc, cm != 0), (kself, vself, sm != 0)], scale)  # noqa: E731
    f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
    ref = scaled_attention(f32(q), [(f32(kc[0]), f32(vc[0]), cm != 0), (f32(kself), f32(vself), sm != 0)], scale)

    def row(variant, seconds, rel, **kw):
        record(shape=name, l=l, s=s, variant=variant, us_per_layer=seconds * 1e6, rel_err=rel, **kw)

    t_xla = per_call(over_layers(xla), q, kc, vc) / layers
    row("xla", t_xla, rel_err(jax.jit(xla)(q, kc[0], vc[0]), ref))
    results = sweep(name, sh, lambda q, a, c, b: cached_attention(q, a, c, cm, kself, vself, sm, scale=scale,
                                                                  blocks=b, interpret=INTERPRET), q, kc, vc, ref,
                    record)
    base = [r for r in results if r[1] in (Blocks(), library_blocks(sh)) and r not in results[:8]]
    for t, b, rel in results[:8] + base:
        row(str(b), t, rel, blocks=b.__dict__, default=b == Blocks(), library=b == library_blocks(sh))
    default = next((r for r in results if r[1] == Blocks()), None)
    best_t, best, best_rel = results[0]
    # the model's situation: a scan over the layer stack hands each layer's cache slice to the kernel
    kst, vst = jnp.stack(kc), jnp.stack(vc)

    def scanned(f):
        return jax.jit(lambda q, ks, vs: jax.lax.scan(lambda c, kv: (c, f(q, *kv)), 0, (ks, vs))[1])

    def in_place(b):  # the kernel reads layer i of the stacks where they lie (Blocks.cache_in_place)
        index = jnp.arange(layers, dtype=jnp.int32)
        return jax.jit(lambda q, ks, vs: jax.lax.scan(lambda c, i: (c, cached_attention(
            q, ks, vs, cm, kself, vself, sm, scale=scale, blocks=b, layer=i, interpret=INTERPRET)), 0, index)[1])

    row("xla_scan", per_call(scanned(xla), q, kst, vst) / layers, best_rel)
    scan_t = {}
    for tag, b in (("best", best), ("library", library_blocks(sh)), ("default", Blocks())):
        if supported(l, s, h, b, g):
            f = lambda q, a, c, b=b: cached_attention(q, a, c, cm, kself, vself, sm, scale=scale,  # noqa: E731
                                                      blocks=b, interpret=INTERPRET)
            try:  # the dataclass defaults exceed shared memory at 512-wide heads (the sweep above records it)
                scan_t[tag, False] = per_call(scanned(f), q, kst, vst) / layers
                scan_t[tag, True] = per_call(in_place(b), q, kst, vst) / layers
            except Exception as ex:
                record(shape=name, variant=f"pallas_scan_{tag} {b}", error=repr(ex)[:160])
                continue
            placed = lambda yes, b=b: Blocks(**(b.__dict__ | {"cache_in_place": yes}))  # noqa: E731
            row(f"pallas_scan_{tag} {placed(False)}", scan_t[tag, False], best_rel)
            row(f"pallas_scan_{tag} {placed(True)}", scan_t[tag, True],
                rel_err(in_place(b)(q, kst, vst)[0], ref))
    best = Blocks(**(best.__dict__ | {"cache_in_place": scan_t["best", True] < scan_t["best", False]}))
    print(f"{name}: L={l} S={s}  xla {t_xla * 1e6:.1f} us  best {best_t * 1e6:.1f} us {best}  default "
          f"{default[0] * 1e6 if default else float('nan'):.1f} us", flush=True)
    return {"l": l, "s": s, "h": h, "g": g, "blocks": best.__dict__, "us": best_t * 1e6, "xla_us": t_xla * 1e6}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated subset of {', '.join(SHAPES)}")
    ap.add_argument("--out", default="attn_bench.jsonl")
    ap.add_argument("--table", default="attn_tuned.json", help="per-shape best blocks (kernel.load_tuned)")
    args = ap.parse_args()

    record, table = recorder(args.out), []
    for name in args.shapes.split(","):
        table.append(bench_shape(name, SHAPES[name], record))
        write_table(args.table, table)


if __name__ == "__main__":
    main()
