"""One process of the two-process CPU test (tests/test_multiprocess.py): joins the job, builds the global mesh over
both processes' devices, feeds its share of the batch and runs two sharded train steps; prints the losses."""

import json
import sys

from orl_jax import runtime

coordinator, nproc, pid = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
runtime.initialize_distributed(coordinator, nproc, pid, local_device_count=2)

import jax  # noqa: E402
import numpy as np  # noqa: E402

from orl_jax import params as P  # noqa: E402
from orl_jax.config import preset  # noqa: E402
from orl_jax.model import qwen3  # noqa: E402
from orl_jax.sharding import make_mesh  # noqa: E402
from orl_jax.train.objectives import causal_lm_loss  # noqa: E402
from orl_jax.train.optim import OptimConfig, make_optimizer  # noqa: E402
from orl_jax.train.step import make_train_step  # noqa: E402

cfg = preset("tiny-qwen3")
mesh = make_mesh(data=2, fsdp=2, tensor=1)  # the 4 devices of both processes
step = make_train_step(lambda p, b, k: causal_lm_loss(p, cfg, b), make_optimizer(OptimConfig(lr=1e-2, warmup_steps=0,
                       total_steps=10)), mesh, qwen3.param_specs(cfg))
state = step.init_state(jax.device_get(P.init(qwen3.param_specs(cfg), jax.random.key(0))), jax.random.key(1))
rng = np.random.default_rng(0)
full = rng.integers(0, cfg.vocab_size, (8, 16)).astype(np.int32)  # the global batch, same on every process
losses = []
for _ in range(2):
    local = full[pid * 4:(pid + 1) * 4]  # this host's share
    batch = step.shard_batch({"tokens": local, "loss_mask": np.ones_like(local)})
    state, m = step(state, batch)
    losses.append(float(m["loss"]))
print("RESULT " + json.dumps({"pid": pid, "devices": jax.device_count(), "local": jax.local_device_count(),
                              "losses": losses}), flush=True)
jax.distributed.shutdown()
