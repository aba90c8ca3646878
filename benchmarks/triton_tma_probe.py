"""Does a TMA-fed (and warp-specialized) Triton kernel read DiffusionGemma's expert bytes faster than pointer loads?
(issue #4)

The one-launch expert kernel (kernels/grouped_gemm/mlp.py, Pallas lowered to Triton) reads a 26B layer's 1.52 GB at
92-94% of XLA's flat read (benchmarks/results/2026-12-04_dg_l2_prefetch_h200.md): ~0.6 ms per forward. Its loads are
Triton pointer loads (cp.async, software-pipelined); no tile, stage count, occupancy or layout moved it (sessions
39-48). Pallas' Triton lowering cannot emit TMA loads or warp specialization; native Triton can, through jax-triton.
Before building that, this probe asks whether it pays, with the device image's own torch and Triton (no JAX):

  flat_sum          torch's float32 sum (and a Triton one) over the same bytes: what a plain stream reads
  x=gather w=ptr    the experts' gate/up product act(x @ gate) * (x @ up) per (expert, 64-column tile) as the
                    Pallas kernel reads it: each sorted row of x from its token's row, weight tiles by pointer
                    loads (64 rows, K step 64, [gate | up] as one 128-wide tile_gated product)
  x=gather w=tma    the same, the weight tiles through a TMA descriptor (the x gather kept: TMA cannot gather)
  x=tma w=tma       both through TMA descriptors made on the device per expert (rows past the expert's end read as
                    zeros and are never stored); x gathered in sorted order beforehand, outside the timed kernel
  WS=True           the K loop warp-specialized (tl.range(warp_specialize=True): a producer warp group issuing the
                    loads ahead of the MMA warps)
  balanced=True     every expert t k / E rows (16 at the 26B), x=gather as above, and x=static: the same product
                    without the gather's two dependent loads before its first weight load (offsets, then row ids):
                    rows at e R, x in sorted order. Session 53's question: does that chain cost the read?

Each variant is checked against a float32 torch reference first, then timed alternately with the others (rounds of
triton.testing.do_bench medians) on 256 tokens x top-8 routed uniformly, sorted by expert.

  python3 benchmarks/triton_tma_probe.py --out $BENCH/triton_tma.jsonl        (device: torch, Triton >= 3.4)
  TRITON_INTERPRET=1 python benchmarks/triton_tma_probe.py --tiny              (CPU: Triton's interpreter, tiny)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import triton
import triton.language as tl

GELU_C = tl.constexpr(0.7978845608028654)  # sqrt(2 / pi); a jitted function reads only constexpr globals


@triton.jit
def _gelu_tanh(g):
    y = GELU_C * (g + 0.044715 * g * g * g)
    return 0.5 * g * (2.0 - 2.0 / (tl.exp(2.0 * y) + 1.0))  # 0.5 g (1 + tanh y), tanh through exp


@triton.jit
def _gated(acc, BM: tl.constexpr, BW: tl.constexpr):
    """[BM, 2 BW] ([gate | up] columns) -> act(gate) * up [BM, BW]."""
    gate, up = tl.split(tl.permute(tl.reshape(acc, (BM, 2, BW)), (0, 2, 1)))
    return _gelu_tanh(gate) * up


@triton.jit
def _gate_up_gather(x_ptr, rows_ptr, w_ptr, h_ptr, off_ptr, E, D: tl.constexpr, F: tl.constexpr, BM: tl.constexpr,
                    BK: tl.constexpr, BW: tl.constexpr, STAGES: tl.constexpr, W_TMA: tl.constexpr, WS: tl.constexpr):
    """As the Pallas kernel: each sorted row's x read from its token's row (rows_ptr), by pointer loads; the weight
    tiles by pointer loads too, or (W_TMA) through a TMA descriptor."""
    tiles: tl.constexpr = F // BW
    pid = tl.program_id(0)
    e, j = pid // tiles, pid % tiles
    start = tl.load(off_ptr + e)
    n = tl.load(off_ptr + e + 1) - start
    rm, rk, rn = tl.arange(0, BM), tl.arange(0, BK), tl.arange(0, 2 * BW)
    row0 = (e * tiles + j) * D
    w_tile = w_ptr + row0.to(tl.int64) * 2 * BW
    if W_TMA:
        w = tl.make_tensor_descriptor(w_ptr, shape=[E * tiles * D, 2 * BW], strides=[2 * BW, 1],
                                      block_shape=[BK, 2 * BW])
    for m0 in range(0, n, BM):
        r = m0 + rm
        live = r < n
        tok = tl.load(rows_ptr + start + r, mask=live, other=0)
        acc = tl.zeros((BM, 2 * BW), tl.float32)
        for k in tl.range(0, D, BK, num_stages=STAGES, warp_specialize=WS):
            xt = tl.load(x_ptr + tok[:, None].to(tl.int64) * D + (k + rk)[None, :], mask=live[:, None], other=0.0)
            if W_TMA:
                wt = w.load([row0 + k, 0])
            else:
                wt = tl.load(w_tile + (k + rk)[:, None] * (2 * BW) + rn[None, :])
            acc = tl.dot(xt, wt, acc)
        h = _gated(acc, BM, BW)
        cols = j * BW + tl.arange(0, BW)
        tl.store(h_ptr + (start + r)[:, None].to(tl.int64) * F + cols[None, :], h.to(h_ptr.dtype.element_ty),
                 mask=live[:, None])


@triton.jit
def _gate_up_tma(x_ptr, w_ptr, h_ptr, off_ptr, E, D: tl.constexpr, F: tl.constexpr, BM: tl.constexpr,
                 BK: tl.constexpr, BW: tl.constexpr, STAGES: tl.constexpr, WS: tl.constexpr):
    tiles: tl.constexpr = F // BW
    pid = tl.program_id(0)
    e, j = pid // tiles, pid % tiles
    start = tl.load(off_ptr + e)
    n = tl.load(off_ptr + e + 1) - start
    if n > 0:
        w = tl.make_tensor_descriptor(w_ptr, shape=[E * tiles * D, 2 * BW], strides=[2 * BW, 1],
                                      block_shape=[BK, 2 * BW])
        x = tl.make_tensor_descriptor(x_ptr + start.to(tl.int64) * D, shape=[n, D], strides=[D, 1],
                                      block_shape=[BM, BK])
        h = tl.make_tensor_descriptor(h_ptr + start.to(tl.int64) * F, shape=[n, F], strides=[F, 1],
                                      block_shape=[BM, BW])
        row0 = (e * tiles + j) * D
        for m0 in range(0, n, BM):
            acc = tl.zeros((BM, 2 * BW), tl.float32)
            for k in tl.range(0, D, BK, num_stages=STAGES, warp_specialize=WS):
                acc = tl.dot(x.load([m0, k]), w.load([row0 + k, 0]), acc)
            h.store([m0, j * BW], _gated(acc, BM, BW).to(h_ptr.dtype.element_ty))


@triton.jit
def _gate_up_static(x_ptr, w_ptr, h_ptr, D: tl.constexpr, F: tl.constexpr, R: tl.constexpr, BM: tl.constexpr,
                    BK: tl.constexpr, BW: tl.constexpr, STAGES: tl.constexpr):
    """The gather kernel without its dependent loads: every expert has R rows (a balanced routing), so a program's
    rows start at e R (no offsets to load) and x comes in sorted order (no row ids to load): its first weight loads
    issue at once, where the gather kernel's wait for two dependent loads (offsets, then row ids)."""
    tiles: tl.constexpr = F // BW
    pid = tl.program_id(0)
    e, j = pid // tiles, pid % tiles
    rm, rk, rn = tl.arange(0, BM), tl.arange(0, BK), tl.arange(0, 2 * BW)
    w_tile = w_ptr + ((e * tiles + j) * D).to(tl.int64) * 2 * BW
    for m0 in range(0, R, BM):
        r = m0 + rm
        live = r < R
        x_rows = x_ptr + (e * R + r)[:, None].to(tl.int64) * D
        acc = tl.zeros((BM, 2 * BW), tl.float32)
        for k in tl.range(0, D, BK, num_stages=STAGES):
            xt = tl.load(x_rows + (k + rk)[None, :], mask=live[:, None], other=0.0)
            acc = tl.dot(xt, tl.load(w_tile + (k + rk)[:, None] * (2 * BW) + rn[None, :]), acc)
        cols = j * BW + tl.arange(0, BW)
        tl.store(h_ptr + (e * R + r)[:, None].to(tl.int64) * F + cols[None, :],
                 _gated(acc, BM, BW).to(h_ptr.dtype.element_ty), mask=live[:, None])


@triton.jit
def _flat_sum(w_ptr, out_ptr, n, BLOCK: tl.constexpr, PER: tl.constexpr):
    """Each program sums PER blocks of BLOCK contiguous elements (a plain stream of the bytes)."""
    base = tl.program_id(0).to(tl.int64) * BLOCK * PER
    acc = tl.zeros((BLOCK,), tl.float32)
    for i in tl.range(0, PER, num_stages=3):
        offs = base + i * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(w_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc))


def tile_gated(w: torch.Tensor, bw: int) -> torch.Tensor:
    """[E, D, 2F] (gate | up) -> [E, F / bw, D, 2 bw] (moe.fuse_gate_up's layout: gate then up columns per tile)."""
    e, d, f2 = w.shape
    gu = w.reshape(e, d, 2, f2 // (2 * bw), bw)  # [E, D, gate / up, tile, bw]
    return gu.permute(0, 3, 1, 2, 4).reshape(e, f2 // (2 * bw), d, 2 * bw).contiguous()


def case(e: int, t: int, k: int, d: int, f: int, device: str, dtype=torch.bfloat16, seed: int = 0,
         balanced: bool = False) -> dict:
    """256 tokens' top-k experts, routed at random, or (balanced) token i to experts (i k + c) mod E: every expert
    t k / E rows (distinct per token where E >= k), the `_gate_up_static` kernel's case."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    if balanced:
        experts = (torch.arange(t)[:, None] * k + torch.arange(k)[None, :]).reshape(-1) % e
    else:
        experts = torch.topk(torch.randn(t, e, generator=g), k).indices.reshape(-1)
    order = torch.argsort(experts, stable=True)
    counts = torch.bincount(experts, minlength=e)
    offsets = torch.zeros(e + 1, dtype=torch.int32)
    offsets[1:] = torch.cumsum(counts, 0)
    x = torch.randn(t, d, generator=g).to(dtype)
    w = (torch.randn(e, d, 2 * f, generator=g) * 0.02).to(dtype)
    rows = (order // k).to(torch.int32)  # each sorted row's token
    return dict(x=x.to(device), rows=rows.to(device), xs=x[rows.long()].to(device), w=w.to(device),
                offsets=offsets.to(device), counts=counts)


def reference(c: dict, f: int) -> torch.Tensor:
    xs, w, off = c["xs"].float(), c["w"].float(), c["offsets"].tolist()
    out = torch.zeros(xs.shape[0], f, device=xs.device)
    for e in range(w.shape[0]):
        a, b = off[e], off[e + 1]
        if b > a:
            p = xs[a:b] @ w[e]
            out[a:b] = torch.nn.functional.gelu(p[:, :f], approximate="tanh") * p[:, f:]
    return out


def variants(tiny: bool) -> list[dict]:
    """x / w: how x's rows and the weight tiles are read. x="gather", w="ptr": the Pallas kernel's loads; x="gather",
    w="tma": its gather of x by token kept (TMA cannot gather), the weights by TMA; x="tma", w="tma": both by TMA, x
    gathered in sorted order beforehand (outside the timed kernel). WS: the K loop warp-specialized."""
    bm, bk = (16, 32) if tiny else (64, 64)
    stages = (2,) if tiny else (2, 3, 4)  # 2 stages: 57 KB of shared memory, 3 blocks per SM as the Pallas kernel's
    out = [dict(x="gather", w="ptr", BM=bm, BK=bk, STAGES=s, warps=4, WS=False) for s in stages[-2:]]
    out += [dict(x="gather", w="tma", BM=bm, BK=bk, STAGES=s, warps=4, WS=False) for s in stages]
    # no x="gather" with WS: Triton 3.6 and 3.7.1 fail to warp-specialize a loop of pointer and TMA loads together
    # (NVGPUWarpSpecialization's pass fails), so a warp-specialized kernel must take x gathered beforehand
    out += [dict(x="tma", w="tma", BM=bm, BK=bk, STAGES=s, warps=4, WS=ws) for ws in (False, True) for s in stages]
    if not tiny:
        out += [dict(x="tma", w="tma", BM=64, BK=128, STAGES=3, warps=4, WS=ws) for ws in (False, True)]
    # the balanced routing (every expert t k / E rows): the gather kernel, and the same without its dependent loads
    out += [dict(x=x, w="ptr", BM=bm, BK=bk, STAGES=stages[min(1, len(stages) - 1)], warps=4, WS=False, balanced=True)
            for x in ("gather", "static")]
    return out


def compiled(v: dict, d: int = 2816, f: int = 704, bw: int = 64):
    """Variant v compiled for sm_90 without a GPU (Triton's own compiler, as a launch on an H200 would, pointers
    16-byte aligned as torch's are): the PTX (.asm["ptx"]) and shared memory (.metadata.shared) to check."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    gather, static = v["x"] == "gather", v["x"] == "static"
    args = {"x_ptr": "*bf16"} | ({"rows_ptr": "*i32"} if gather else {}) | {"w_ptr": "*bf16", "h_ptr": "*bf16"}
    if static:  # the 26B's balanced routing: 256 x 8 rows over 128 experts
        const = dict(D=d, F=f, R=16, BM=v["BM"], BK=v["BK"], BW=bw, STAGES=v["STAGES"])
    else:
        args |= {"off_ptr": "*i32", "E": "i32"}
        const = dict(D=d, F=f, BM=v["BM"], BK=v["BK"], BW=bw, STAGES=v["STAGES"])
        if gather:
            const["W_TMA"] = v["w"] == "tma"
        const["WS"] = v["WS"]
    fn = _gate_up_static if static else _gate_up_gather if gather else _gate_up_tma
    sig = args | {name: "constexpr" for name in const}
    aligned = {(i,): [["tt.divisibility", 16]] for i, t in enumerate(args.values()) if t.startswith("*")}
    return triton.compile(ASTSource(fn, sig, const, aligned), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=v["warps"]))


def launch(v: dict, c: dict, h: torch.Tensor, d: int, f: int, bw: int):
    e = c["w_t"].shape[0]
    grid = (e * (f // bw),)
    if v["x"] == "static":
        return _gate_up_static[grid](c["xs"], c["w_t"], h, d, f, c["xs"].shape[0] // e, v["BM"], v["BK"], bw,
                                     v["STAGES"], num_warps=v["warps"])
    if v["x"] == "gather":
        return _gate_up_gather[grid](c["x"], c["rows"], c["w_t"], h, c["offsets"], e, d, f, v["BM"], v["BK"], bw,
                                     v["STAGES"], v["w"] == "tma", v["WS"], num_warps=v["warps"])
    return _gate_up_tma[grid](c["xs"], c["w_t"], h, c["offsets"], e, d, f, v["BM"], v["BK"], bw, v["STAGES"],
                              v["WS"], num_warps=v["warps"])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (the CPU interpreter: TRITON_INTERPRET=1)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="triton_tma.jsonl")
    args = ap.parse_args()
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    device = "cpu" if interpret else "cuda"
    e, t, k, d, f = (4, 44, 2, 128, 64) if args.tiny else (128, 256, 8, 2816, 704)  # tiny: 2 row tiles
    bw = 32 if args.tiny else 64
    rows = []

    def record(**kw):
        kw |= dict(triton=triton.__version__, torch=torch.__version__, t=round(time.time(), 1))
        if device == "cuda":
            kw["device"] = torch.cuda.get_device_name()
        print(json.dumps(kw), flush=True)
        rows.append(kw)

    if device == "cuda":  # device-side TMA descriptors take their workspace from this allocator
        triton.set_allocator(lambda size, align, stream: torch.empty(size, device="cuda", dtype=torch.int8))
    # float16 in the interpreter, whose bf16 dots are wrong (Triton 3.7.1 on a CPU); the kernels take either
    dtype = torch.float16 if interpret else torch.bfloat16
    cases = {False: case(e, t, k, d, f, device, dtype)}
    c = cases[False]
    c["w_t"] = tile_gated(c["w"], bw)
    cases[True] = case(e, t, k, d, f, device, dtype, balanced=True) | {"w": c["w"], "w_t": c["w_t"]}  # same weights
    nbytes = c["w"].numel() * 2
    want = {b: reference(cb, f) for b, cb in cases.items()}
    for b, cb in cases.items():
        record(what="case", experts=e, tokens=t, top_k=k, d=d, f=f, bytes=nbytes, balanced=b,
               rows_per_expert=[int(cb["counts"].min()), int(cb["counts"].max())])
    ok = []
    for v in variants(args.tiny):
        b = v.get("balanced", False)
        h = torch.full((c["xs"].shape[0], f), float("nan"), dtype=c["xs"].dtype, device=device)  # poisoned
        try:
            launch(v, cases[b], h, d, f, bw)
            err = float((h.float() - want[b]).norm() / want[b].norm())
        except Exception as ex:  # noqa: BLE001 (a variant this Triton or chip refuses; the probe goes on)
            record(what="check", **v, error=repr(ex)[:300])
            continue
        good = err < 1e-2  # bf16 / fp16 products of float32 sums, rounded once
        record(what="check", **v, rel_err=err, ok=good)
        if good:
            ok.append(v)
    if interpret:
        return
    w_flat = c["w"].reshape(-1)
    block, per = 8192, 16
    partial = torch.empty(-(-w_flat.numel() // (block * per)), dtype=torch.float32, device="cuda")
    timed = [("flat_sum torch", lambda: torch.sum(w_flat, dtype=torch.float32)),
             ("flat_sum triton", lambda: _flat_sum[(partial.numel(),)](w_flat, partial, w_flat.numel(), block, per))]
    h = torch.empty((c["xs"].shape[0], f), dtype=torch.bfloat16, device="cuda")
    timed += [(" ".join(f"{a}={b}" for a, b in v.items()),
               lambda v=v: launch(v, cases[v.get("balanced", False)], h, d, f, bw)) for v in ok]
    for r in range(args.rounds):  # alternating: each round times every variant once
        for name, fn in timed:
            ms = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
            record(what="timed", variant=name, round=r, us=ms * 1e3, tb_s=nbytes / ms / 1e9)
    with open(args.out, "a") as fh:
        fh.writelines(json.dumps(row) + "\n" for row in rows)


if __name__ == "__main__":
    sys.exit(main())
