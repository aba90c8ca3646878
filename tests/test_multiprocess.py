"""Multi-host readiness on one machine: two CPU processes joined by jax.distributed (gloo collectives) run the
sharded train step over their 4 devices, each feeding its own rows, and get the single-process losses."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np

from orl_jax import params as P
from orl_jax.config import preset
from orl_jax.model import qwen3
from orl_jax.sharding import make_mesh
from orl_jax.train.objectives import causal_lm_loss
from orl_jax.train.optim import OptimConfig, make_optimizer
from orl_jax.train.step import make_train_step

WORKER = Path(__file__).parent / "multiprocess" / "sharded_step_worker.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_match_one():
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_FLAGS", "JAX_"))}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
    procs = [subprocess.Popen([sys.executable, str(WORKER), f"127.0.0.1:{port}", "2", str(i)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    outs = []
    for p in procs:
        out, _ = p.communicate(timeout=240)
        assert p.returncode == 0, out[-3000:]
        outs.append(json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:]))
    assert {o["devices"] for o in outs} == {4} and {o["local"] for o in outs} == {2}
    # the same two steps in this (single) process over 4 devices
    cfg = preset("tiny-qwen3")
    mesh = make_mesh(data=2, fsdp=2, tensor=1, devices=jax.devices()[:4])
    step = make_train_step(lambda p, b, k: causal_lm_loss(p, cfg, b),
                           make_optimizer(OptimConfig(lr=1e-2, warmup_steps=0, total_steps=10)), mesh,
                           qwen3.param_specs(cfg))
    state = step.init_state(jax.device_get(P.init(qwen3.param_specs(cfg), jax.random.key(0))), jax.random.key(1))
    full = np.random.default_rng(0).integers(0, cfg.vocab_size, (8, 16)).astype(np.int32)
    losses = []
    for _ in range(2):
        state, m = step(state, step.shard_batch({"tokens": full, "loss_mask": np.ones_like(full)}))
        losses.append(float(m["loss"]))
    for o in outs:
        np.testing.assert_allclose(o["losses"], losses, rtol=1e-5)
