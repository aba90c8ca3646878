"""Probe: the copies XLA's compiled loop program makes, per call (ENTRY) and per iteration (the while loop's body, a
conditional's branches), on this machine's backend, for a tiny model generating several blocks.

  python benchmarks/hlo_copies.py [--model tiny-dg|tiny-qwendlm] [--blocks 2] [--out copies.jsonl]

Runs one plain generate() through the engine's own programs (OUTPUT_WORKSPACE, SPLIT_START, DONATE_STATE as set),
then compiles the loop's program with the state it kept and lists its copies by computation, with their bytes. A
copy whose size is the KV cache's, in the loop's body, runs at every step: at the 26B the cache is ~175 MB for a
768-token context (~85 us per copy on an H200, by bandwidth). Copy insertion is XLA's shared pass, so the CPU shows
the same copies as a GPU unless a backend's own passes differ: this probe on the device says which.
"""

import argparse
import os
import sys
from collections import defaultdict

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from bench_io import recorder  # noqa: E402
from hlo_describe import copies  # noqa: E402

from orl_jax import params as P  # noqa: E402
from orl_jax import runtime  # noqa: E402
from orl_jax.config import preset  # noqa: E402
from orl_jax.decode import engine  # noqa: E402
from orl_jax.decode.samplers import UniformSampler  # noqa: E402
from orl_jax.diffusion_gemma_config import DG_PRESETS  # noqa: E402
from orl_jax.model import diffusion_gemma as dg  # noqa: E402
from orl_jax.model import qwen3  # noqa: E402

MODELS = ("tiny-dg", "tiny-qwendlm")


def _model(name: str):
    if name == "tiny-dg":
        cfg = DG_PRESETS[name].replace(dtype="bfloat16", image_token_id=None, boi_token_id=None, eoi_token_id=None)
        params = P.init(dg.param_specs(cfg), jax.random.key(0))
        return cfg, jax.tree.map(lambda a: a.astype(jnp.bfloat16), params), 16
    cfg = preset(name).replace(block_length=4)
    return cfg, P.init(qwen3.param_specs(cfg), jax.random.key(0)), 4


def loop_program_copies(cfg, params, block: int, blocks: int) -> tuple[engine.DecodeState, dict]:
    """After one plain generate() of `blocks` blocks of `block` tokens through the split programs (the caller sets
    engine.OUTPUT_WORKSPACE on and empties engine._workspaces): the state the engine kept, and the copies of the
    loop's program that reads it ("finish") and of the one it is donated to ("in_place", DONATE_STATE)."""
    engine.generate(params, cfg, [[5, 6, 7, 8, 9], [10, 11]], key=jax.random.key(3), eos_token_id=(),
                    sampler=UniformSampler(max_denoising_steps=4), max_new_tokens=blocks * block, block_length=block)
    (slot, state), = [(k, v) for k, v in engine._workspaces.items() if isinstance(v, engine.DecodeState)]
    (workspace,) = [v for v in engine._workspaces.values() if isinstance(v, engine.GenerateOutput)]
    _, finish, _, in_place = [p for p in (engine._split_concurrent, engine._split_graphed) if slot[0] is p[0]][0]
    return state, {name: copies(p.lower(workspace, params, state, cfg=slot[1], dcfg=slot[2]).compile().as_text())
                   for name, p in (("finish", finish), ("in_place", in_place))}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-dg", choices=MODELS)
    ap.add_argument("--blocks", type=int, default=2)
    ap.add_argument("--out", default="hlo_copies.jsonl")
    args = ap.parse_args()
    if args.blocks < 1:
        raise ValueError(f"--blocks must be >= 1, got {args.blocks}")
    runtime.configure(None)  # before the backend starts (the first generate())
    record = recorder(args.out)
    engine.OUTPUT_WORKSPACE, engine._workspaces = True, {}
    program = "in_place" if engine.DONATE_STATE else "finish"  # the one generate() runs
    found = loop_program_copies(*_model(args.model), args.blocks)[1][program]
    per = defaultdict(lambda: [0, 0])
    for c in found:
        per[c["computation"]][0] += 1
        per[c["computation"]][1] += c["bytes"]
        record(kind="copy", model=args.model, blocks=args.blocks, backend=jax.default_backend(), **c)
    for comp, (n, size) in sorted(per.items(), key=lambda kv: -kv[1][1]):
        record(kind="summary", model=args.model, blocks=args.blocks, backend=jax.default_backend(),
               donate_state=engine.DONATE_STATE, computation=comp, copies=n, bytes=size)


if __name__ == "__main__":
    main()
