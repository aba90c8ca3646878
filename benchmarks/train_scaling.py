"""Data-parallel training on 1 vs N GPUs: the stage-0 AR step of `recipes/train_qwendlm.py --preset h200` (the
same model, task corpus, packing and optimizer), one global batch split over the devices (FSDP: params and
optimizer state sharded too). Same init, same data order, same global batch: the loss curves should agree within
bf16 noise, and the throughput should grow with N.

  python benchmarks/train_scaling.py --devices 1 --steps 200 --out scaling.jsonl
  python benchmarks/train_scaling.py --devices 2 --steps 200 --out scaling.jsonl
Writes one JSON line per logged step (loss) and one summary line (tokens/s after the first `--warmup` steps).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "recipes"))

from orl_jax import runtime  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--devices", type=int, default=1, help="use the first N devices (mesh fsdp=N)")
ap.add_argument("--steps", type=int, default=200)
ap.add_argument("--warmup", type=int, default=20, help="steps left out of the throughput")
ap.add_argument("--preset", default="h200", help="recipe preset whose model/batch to use")
ap.add_argument("--compute-dtype", default=None, help="override the preset's compute dtype")
ap.add_argument("--examples", type=int, default=3000, help="train examples per task")
ap.add_argument("--out", default="train_scaling.jsonl")
args = ap.parse_args()
runtime.configure(os.path.expanduser("~/.cache/orl_jax/xla"))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from train_qwendlm import PRESETS  # noqa: E402

from orl_jax import params as P  # noqa: E402
from orl_jax.data.embedded_tokenizer import task_corpus, train_tokenizer  # noqa: E402
from orl_jax.data.pipeline import make_dataset  # noqa: E402
from orl_jax.data.tokenizer import load_tokenizer  # noqa: E402
from orl_jax.model import qwen3  # noqa: E402
from orl_jax.sharding import make_mesh  # noqa: E402
from orl_jax.train import stages  # noqa: E402
from orl_jax.train.objectives import causal_lm_loss  # noqa: E402
from orl_jax.train.optim import make_optimizer  # noqa: E402
from orl_jax.train.step import make_train_step  # noqa: E402

if not 1 <= args.devices <= len(jax.devices()):
    raise SystemExit(f"--devices must be in [1, {len(jax.devices())}], got {args.devices}")
r = PRESETS[args.preset]
r = dataclasses.replace(r, compute_dtype=args.compute_dtype or r.compute_dtype, train_examples=args.examples)


def log(**kw):
    kw |= {"devices": args.devices, "device_kind": jax.devices()[0].device_kind, "compute_dtype": r.compute_dtype,
           "jax": jax.__version__}
    print(json.dumps(kw), flush=True)
    with open(args.out, "a") as f:
        f.write(json.dumps(kw) + "\n")


with tempfile.TemporaryDirectory() as tmp:
    train_tokenizer(task_corpus(n_per_task=1000, tasks=list(r.tasks)), r.vocab_size, tmp)
    tok = load_tokenizer(tmp)
cfg = stages.ar_config(r, tok)
# one host feeds the whole global batch (a single process drives every local device)
data = iter(make_dataset(stages.ar_rows(r, tok, 0), seq_len=r.seq_len, batch_size=r.batch, seed=0, shard_index=0,
                         shard_count=1))
mesh = make_mesh(data=1, fsdp=args.devices, tensor=1, devices=jax.devices()[:args.devices])
step = make_train_step(lambda p, b, k: causal_lm_loss(p, cfg, b), make_optimizer(stages.ar_optim(r)), mesh,
                       qwen3.param_specs(cfg))
state = step.init_state(P.init(qwen3.param_specs(cfg), jax.random.key(0)), jax.random.key(1))
log(what="setup", params_m=P.count(qwen3.param_specs(cfg)) / 1e6, batch=r.batch, seq_len=r.seq_len,
    mesh=dict(mesh.shape))

losses, tokens, t_start, waited = [], 0, None, 0.0
t0 = time.perf_counter()
for i in range(args.steps):
    t_data = time.perf_counter()
    batch = next(data)
    if i >= args.warmup:
        waited += time.perf_counter() - t_data
    state, m = step(state, step.shard_batch(batch))
    losses.append(m["loss"])
    if i == 0:
        jax.block_until_ready(m)
        log(what="compile", seconds=time.perf_counter() - t0)
    if i + 1 == args.warmup:
        jax.block_until_ready(m)
        t_start = time.perf_counter()
    elif i + 1 > args.warmup:
        tokens += int(np.count_nonzero(batch["segment_ids"]))
jax.block_until_ready(state)
data.close()
dt = time.perf_counter() - t_start
losses = [float(x) for x in jax.device_get(losses)]
for i in range(0, args.steps, 10):
    log(what="loss", step=i + 1, loss=losses[i])
timed = args.steps - args.warmup
log(what="summary", steps=args.steps, timed_steps=timed, step_ms=dt * 1e3 / timed, tokens_per_s=tokens / dt,
    data_wait_ms=waited * 1e3 / timed, final_loss=float(np.mean(losses[-10:])))
