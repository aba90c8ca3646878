"""Would jax's Hopper flash attention (Pallas Mosaic GPU, jax.experimental.pallas.ops.gpu.attention_mgpu: warp
groups, TMA, wgmma) beat our Triton cached-pass kernel at DiffusionGemma 26B's sliding layers? (issue #4)

The 26B forward's sliding attention is ~21 us per layer on the critical path (kernels/decode_attention at
WIDE_HEADS, 16.7 us, plus its split merge) for 3.2 GFLOP (~25% of the tensor rate). jax's kernel has no mask but
causal, so it is timed here on the keys a canvas sees when everything cached is visible (prompt <= 768 tokens: the
512 filled cache slots, then the canvas's own 256), with and without the concatenation that would put them in one
array. Scale 1.0 (DiffusionGemma's), batch 1, 256 queries x 16 heads, 8 kv heads, head dim 256; ours in bf16,
jax's in float16 (under jax 0.11.2 it refuses bf16: "src had type bfloat16 and dst had type float16"). Each
variant runs LOOP times in one device loop, its output fed back as the next queries (a per-call timing measures the
host's dispatch, ~70-80 us, not the kernel).

  python benchmarks/attention_mgpu_probe.py --out $BENCH/attention_mgpu.jsonl
"""

import argparse
import dataclasses
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from orl_jax import runtime  # noqa: E402

runtime.configure(None)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from bench_io import recorder  # noqa: E402
from timing import median_seconds  # noqa: E402

from orl_jax_kernels.decode_attention.kernel import blocks_for, cached_attention  # noqa: E402

L, N, K, H, SLOTS, FILLED, LOOP = 256, 16, 8, 256, 768, 512, 64
CONFIGS = [(64, 64, 2), (64, 128, 2), (128, 64, 2), (64, 64, 3), (128, 128, 2)]  # block_q, block_kv, steps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="attention_mgpu.jsonl")
    args = ap.parse_args()
    record = recorder(args.out)
    ks = jax.random.split(jax.random.key(0), 5)
    q = jax.random.normal(ks[0], (1, L, N, H), jnp.bfloat16)
    kc, vc = (jax.random.normal(k, (1, SLOTS, K, H), jnp.bfloat16) for k in ks[1:3])
    kself, vself = (jax.random.normal(k, (1, L, K, H), jnp.bfloat16) for k in ks[3:5])
    cmask = jnp.broadcast_to(jnp.arange(SLOTS) < FILLED, (1, L, SLOTS))
    smask = jnp.ones((1, L, L), jnp.int8)
    blocks = dataclasses.replace(blocks_for(L, SLOTS, H, N // K), cache_in_place=False)

    def timed(label, fn, q, *xs, **extra):  # fn(q, *xs) -> [1, L, N, H], LOOP times in a device loop
        f = jax.jit(fn)
        loop = jax.jit(lambda q, *xs: jax.lax.fori_loop(0, LOOP, lambda i, q: fn(q, *xs).astype(q.dtype), q))
        try:
            out = f(q, *xs)
            us = median_seconds(loop, q, *xs, reps=10) / LOOP * 1e6
        except Exception as ex:  # a config the lowering or the chip rejects
            record(variant=label, error=repr(ex)[:300], **extra)
            print(f"{label}: {repr(ex)[:300]}", flush=True)
            return None
        record(variant=label, us=us, **extra)
        print(f"{label}: {us:.1f} us", flush=True)
        return out

    ours = timed(f"ours {blocks}", lambda q, kc, vc, ks, vs: cached_attention(
        q, kc, vc, cmask, ks, vs, smask, scale=1.0, blocks=blocks), q, kc, vc, kself, vself)
    want = ours.astype(jnp.float32)
    from jax.experimental.pallas.ops.gpu import attention_mgpu as mgpu

    def visible(kc, vc, ks, vs):  # the keys and values every query sees, as one array each: [filled cache, own]
        return (jnp.concatenate([kc[:, :FILLED], ks], axis=1), jnp.concatenate([vc[:, :FILLED], vs], axis=1))

    q16, kc16, vc16, ks16, vs16 = (x.astype(jnp.float16) for x in (q, kc, vc, kself, vself))
    kk, vv = visible(kc16, vc16, ks16, vs16)
    for bq, bkv, steps in CONFIGS:
        cfg = mgpu.TuningConfig(block_q=bq, block_kv=bkv, max_concurrent_steps=steps)
        label = f"attention_mgpu float16 block_q={bq} block_kv={bkv} steps={steps}"
        out = timed(label, lambda q, k, v, cfg=cfg: mgpu.attention(q, k, v, cfg), q16, kk, vv)
        if out is not None:
            err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - want)))
            record(variant=label, max_abs_err_vs_ours=err)
            print(f"  max |mgpu - ours| = {err:.3g}", flush=True)
            timed(label + " + concatenation", lambda q, *kv, cfg=cfg: mgpu.attention(q, *visible(*kv), cfg),
                  q16, kc16, vc16, ks16, vs16)


if __name__ == "__main__":
    main()
