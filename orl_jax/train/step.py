"""The sharded train step: TrainState, explicit shardings, donation, non-finite skipping.

`make_train_step(loss_fn, optimizer, mesh, param_specs)` jits one update for any loss
`loss_fn(params, batch, key) -> (loss, metrics)`; it knows nothing about the objective. Placement is explicit:
params follow their logical axes (params.shardings), optimizer-state leaves that mirror a param (Adam's mu/nu
under any optax nesting) take that param's sharding and everything else (counts, scalars) is replicated, the
batch is split on dim 0 over `batch_axes`. The state is donated, so an update needs no second copy of params and
optimizer state.

Randomness: the key of update `t` is `fold_in(state.rng, t)` unless the caller passes one, so a run resumed from
a checkpoint draws exactly the keys the uninterrupted run would have drawn.

A non-finite loss or gradient norm skips the update: params and optimizer state stay bit-identical, `step` still
advances (the batch was consumed) and the counters `nonfinite_count` / `consecutive_nonfinite` are updated. The
loop (loop.py) aborts after too many in a row.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from orl_jax import params as P
from orl_jax.train.optim import Optimizer, group_grad_norms, keep_if_finite, learning_rates

LossFn = Callable[[Any, Any, jax.Array], tuple[jax.Array, dict]]


@struct.dataclass
class TrainState:
    step: jax.Array  # [] int32: updates attempted (applied + skipped) = batches consumed
    params: Any
    opt_state: Any
    rng: jax.Array  # base key (typed or raw uint32); update t uses fold_in(rng, t)
    nonfinite_count: jax.Array  # [] int32: skipped updates in total
    consecutive_nonfinite: jax.Array  # [] int32: skipped updates since the last applied one


def _path_key(path) -> tuple:
    return tuple(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def opt_state_shardings(abstract_opt_state, abstract_params, param_shardings, mesh: Mesh):
    """Shardings for an optimizer state: a leaf whose key path ends with a param's path and has that param's shape
    gets the param's sharding (mu, nu, ... under any optax nesting); other leaves are replicated."""
    by_path = {}
    for (path, a), s in zip(jax.tree_util.tree_leaves_with_path(abstract_params), jax.tree.leaves(param_shardings)):
        by_path[_path_key(path)] = (tuple(a.shape), s)
    replicated = NamedSharding(mesh, PartitionSpec())
    longest = max((len(k) for k in by_path), default=0)

    def pick(path, leaf):
        key = _path_key(path)
        for n in range(min(longest, len(key)), 0, -1):
            hit = by_path.get(key[-n:])
            if hit is not None and hit[0] == tuple(leaf.shape):
                return hit[1]
        return replicated

    return jax.tree_util.tree_map_with_path(pick, abstract_opt_state)


@dataclasses.dataclass(frozen=True, eq=False)
class TrainStep:
    """A compiled-on-first-call update `(state, batch, key=None) -> (state, metrics)` plus its placements."""

    fn: Callable  # the jitted step
    mesh: Mesh
    optimizer: Optimizer | optax.GradientTransformation
    param_specs: Any
    param_shardings: Any
    batch_sharding: NamedSharding
    replicated: NamedSharding
    frozen_specs: Any = None
    frozen: Any = None  # the bound frozen arrays (see bind)

    def __call__(self, state: TrainState, batch, key: jax.Array | None = None):
        return self.fn(state, batch, key, self.frozen)

    def bind(self, frozen) -> TrainStep:
        """This step with `frozen` (a pytree matching frozen_specs) placed on its shardings and passed each call."""
        if self.frozen_specs is None:
            raise ValueError("bind() needs a step made with make_train_step(..., frozen_specs=...)")
        P.check_tree(frozen, self.frozen_specs, where="frozen")
        # never donated, so a single process may alias the caller's arrays; several processes need _place
        put = _place if jax.process_count() > 1 else jax.device_put
        placed = jax.tree.map(put, frozen, P.shardings(self.frozen_specs, self.mesh))
        return dataclasses.replace(self, frozen=placed)

    def state_shardings(self, rng: jax.Array | None = None) -> TrainState:
        abstract = self.abstract_state(rng)
        return jax.tree.map(lambda a: a.sharding, abstract)

    def abstract_state(self, rng: jax.Array | None = None) -> TrainState:
        """TrainState of ShapeDtypeStructs carrying the shardings (a restore target; no memory)."""
        params = P.abstract(self.param_specs)
        opt = jax.eval_shape(self.optimizer.init, params)
        opt_sh = opt_state_shardings(opt, params, self.param_shardings, self.mesh)
        rng = jax.random.key(0) if rng is None else rng
        sds = lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
        scalar = jax.ShapeDtypeStruct((), jnp.int32, sharding=self.replicated)
        return TrainState(
            step=scalar, params=jax.tree.map(sds, params, self.param_shardings),
            opt_state=jax.tree.map(sds, opt, opt_sh), rng=sds(rng, self.replicated),
            nonfinite_count=scalar, consecutive_nonfinite=scalar)

    def init_state(self, params, rng: jax.Array) -> TrainState:
        """A fresh TrainState at step 0: params moved to their shardings, optimizer state created sharded."""
        P.check_tree(params, self.param_specs)
        target = self.abstract_state(rng)
        # A copy even when already placed: the step donates the state, and the caller's arrays must survive it.
        params = jax.tree.map(_place, params, self.param_shardings)
        opt_sh = jax.tree.map(lambda a: a.sharding, target.opt_state)
        opt_state = jax.jit(self.optimizer.init, out_shardings=opt_sh)(params)
        zero = lambda: _place(np.zeros((), np.int32), self.replicated)  # distinct buffers (donation)
        return TrainState(step=zero(), params=params, opt_state=opt_state, rng=_place(rng, self.replicated),
                          nonfinite_count=zero(), consecutive_nonfinite=zero())

    def shard_batch(self, batch):
        """Host batch (numpy leaves, this process's rows) -> global jax.Arrays split on dim 0."""
        n = math.prod(self.batch_sharding.mesh.shape[a] for a in _axes(self.batch_sharding.spec[0]))
        local = jax.process_count() > 1
        for path, x in jax.tree_util.tree_leaves_with_path(batch):
            rows = np.shape(x)[0] * (jax.process_count() if local else 1) if np.ndim(x) else None
            if rows is None or rows % n:
                raise ValueError(f"batch{jax.tree_util.keystr(path)} has shape {np.shape(x)}: dim 0 must divide "
                                 f"by the {n} devices of batch axes {self.batch_sharding.spec[0]}")
        if not local:
            return jax.device_put(batch, self.batch_sharding)
        return jax.tree.map(lambda x: jax.make_array_from_process_local_data(self.batch_sharding, np.asarray(x)),
                            batch)


def _place(x, sharding):
    """A fresh copy of x laid out by `sharding`. In a multi-process job every process holds the same host value and
    contributes the shards on its own devices (device_put cannot target other processes' devices)."""
    if jax.process_count() == 1:
        if isinstance(x, jax.Array):
            # device_put(..., may_alias=False) still hands back x's own buffer as the device-0 shard of a replicated
            # multi-device layout (seen with jax 0.10); the step would then donate, i.e. delete, the caller's array.
            # An explicit device-side copy first (jnp.array(copy=True) always writes a new buffer).
            return jax.device_put(jnp.array(x, copy=True), sharding)
        return jax.device_put(x, sharding, may_alias=False)
    if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        data = np.asarray(jax.random.key_data(x))
        impl = jax.random.key_impl(x)
        return jax.random.wrap_key_data(jax.make_array_from_callback(data.shape, sharding, lambda i: data[i]),
                                        impl=impl)
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda i: host[i])


def _axes(p) -> tuple[str, ...]:
    return () if p is None else (p,) if isinstance(p, str) else tuple(p)


def make_train_step(loss_fn: LossFn, optimizer: Optimizer | optax.GradientTransformation, mesh: Mesh,
                    param_specs, batch_axes: Sequence[str] = ("data", "fsdp"), *, donate: bool = True,
                    frozen_specs=None) -> TrainStep:
    """Jit one sharded update of `loss_fn(params, batch, key) -> (loss, metrics)`.

    frozen_specs: ParamSpecs of a frozen pytree the loss also reads (e.g. the RCD reference model); the loss is then
    `loss_fn(params, batch, key, frozen)` and the step is used as `make_train_step(...).bind(frozen)`. The frozen
    arrays are a sharded argument of the jitted step, never constants baked into it.

    Metrics returned per step (replicated scalars): the loss_fn's own, `loss`, `grad_norm` (+ per group),
    `lr` (+ per group), `skipped` (1 if this update was non-finite), `nonfinite_count`, `consecutive_nonfinite`.
    """
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable (params, batch, key) -> (loss, metrics), got {type(loss_fn)}")
    if not hasattr(optimizer, "init") or not hasattr(optimizer, "update"):
        raise TypeError(f"optimizer must be an Optimizer or optax.GradientTransformation, got {type(optimizer)}")
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh (sharding.make_mesh), got {type(mesh).__name__}")
    batch_axes = (batch_axes,) if isinstance(batch_axes, str) else tuple(batch_axes)
    unknown = [a for a in batch_axes if a not in mesh.axis_names]
    if unknown:
        raise ValueError(f"batch_axes {batch_axes} name axes {unknown} not in the mesh {mesh.axis_names}")
    param_shardings = P.shardings(param_specs, mesh)
    replicated = NamedSharding(mesh, PartitionSpec())
    batch_sharding = NamedSharding(mesh, PartitionSpec(batch_axes or None))

    frozen_shardings = None if frozen_specs is None else P.shardings(frozen_specs, mesh)

    def step(state: TrainState, batch, key, frozen):
        if key is None:
            key = jax.random.fold_in(state.rng, state.step)
        extra = () if frozen_specs is None else (frozen,)
        (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params, batch, key, *extra)
        grads = jax.lax.with_sharding_constraint(grads, param_shardings)
        norms = group_grad_norms(optimizer, grads)
        ok = jnp.isfinite(loss) & jnp.isfinite(norms["grad_norm"])
        updates, new_opt = optimizer.update(grads, state.opt_state, state.params)
        new_params = optax.apply_updates(state.params, updates)
        bad = jnp.where(ok, 0, 1).astype(jnp.int32)
        new_state = state.replace(
            step=state.step + 1,
            params=keep_if_finite(ok, new_params, state.params),
            opt_state=keep_if_finite(ok, new_opt, state.opt_state),
            nonfinite_count=state.nonfinite_count + bad,
            consecutive_nonfinite=(state.consecutive_nonfinite + 1) * bad)
        # The optimizer's own schedule counts applied updates only, so the rate used is at step - skipped.
        metrics = dict(aux, loss=loss, **norms, **learning_rates(optimizer, state.step - state.nonfinite_count),
                       skipped=bad, nonfinite_count=new_state.nonfinite_count,
                       consecutive_nonfinite=new_state.consecutive_nonfinite)
        return new_state, metrics

    ts = TrainStep(fn=None, mesh=mesh, optimizer=optimizer, param_specs=param_specs,
                   param_shardings=param_shardings, batch_sharding=batch_sharding, replicated=replicated,
                   frozen_specs=frozen_specs)

    # The state's shardings depend on the rng's key type, so they are resolved at the first call (jit's cache keys
    # on the input types, so this is one compile per key type, normally one).
    compiled: dict = {}

    def call(state: TrainState, batch, key=None, frozen=None):
        if (frozen is None) != (frozen_specs is None):
            raise ValueError("this step was made with frozen_specs: call .bind(frozen) first" if frozen is None
                             else "frozen arrays given to a step made without frozen_specs")
        sig = (tuple(state.rng.shape), str(state.rng.dtype))
        if sig not in compiled:
            state_sh = ts.state_shardings(state.rng)
            compiled[sig] = jax.jit(step, in_shardings=(state_sh, batch_sharding, replicated, frozen_shardings),
                                    out_shardings=(state_sh, replicated), donate_argnums=(0,) if donate else ())
        with jax.set_mesh(mesh):  # the model splits its activations' batch dim over it (sharding.constrain)
            return compiled[sig](state, batch, key, frozen)

    return dataclasses.replace(ts, fn=call)
