"""AdamW with warmup + cosine decay, global-norm clipping, a weight-decay mask and optional parameter groups.

Why this shape:
- Parameter groups are keyed by the *top-level* param key (e.g. "adapter": the ORL adapter g_phi gets its own
  lower learning rate and its own clipping norm, so a burst of adapter gradients cannot shrink the backbone's
  step through a shared global norm and vice versa). Everything not named in `groups` is the "default" group,
  clipped by `OptimConfig.clip_norm`. Groups are an `optax.multi_transform`.
- Weight decay skips norms and every 1-D parameter. Norms are matched by name as well as by rank because the
  layer stack makes a per-layer norm weight 2-D ([layers, D]).
- Non-finite updates are handled by the train step (step.py), not here: a step whose loss or gradient norm is
  not finite keeps the old params *and* the old optimizer state (`keep_if_finite`), and the step counts it. We
  do not use `optax.apply_if_finite` because it hides its counters inside the optimizer state and would still
  advance nothing else consistently (step counter, RNG); one `where` in the step covers the whole TrainState.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import optax

DEFAULT_GROUP = "default"


@dataclass(frozen=True)
class ParamGroup:
    """Overrides for the params under one top-level key."""

    lr_scale: float = 1.0  # multiplies the scheduled learning rate
    clip_norm: float | None = None  # this group's own global-norm clip (None: no clipping)
    weight_decay: float | None = None  # None: OptimConfig.weight_decay


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 3e-4  # peak learning rate (reached at the end of warmup)
    warmup_steps: int = 100
    total_steps: int = 10_000  # warmup + cosine decay; the rate stays at the floor afterwards
    min_lr_ratio: float = 0.1  # floor of the cosine, as a fraction of `lr`
    b1: float = 0.9
    b2: float = 0.95  # 0.95 rather than 0.999: the usual LLM choice, reacts faster to loss spikes
    eps: float = 1e-8
    weight_decay: float = 0.1
    clip_norm: float | None = 1.0  # global-norm clip of the default group
    groups: Mapping[str, ParamGroup] = field(default_factory=dict)

    def __post_init__(self):
        for name in ("lr", "eps"):
            if not getattr(self, name) > 0:
                raise ValueError(f"OptimConfig.{name} must be > 0, got {getattr(self, name)!r}")
        if self.warmup_steps < 0 or self.total_steps <= 0 or self.warmup_steps > self.total_steps:
            raise ValueError(f"OptimConfig needs 0 <= warmup_steps <= total_steps and total_steps > 0, got "
                             f"warmup_steps={self.warmup_steps}, total_steps={self.total_steps}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"OptimConfig.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.weight_decay < 0:
            raise ValueError(f"OptimConfig.weight_decay must be >= 0, got {self.weight_decay}")
        if self.clip_norm is not None and not self.clip_norm > 0:
            raise ValueError(f"OptimConfig.clip_norm must be > 0 or None, got {self.clip_norm}")
        if not isinstance(self.groups, Mapping):
            raise TypeError(f"OptimConfig.groups must be a mapping name -> ParamGroup, got "
                            f"{type(self.groups).__name__}")
        for name, g in self.groups.items():
            if name == DEFAULT_GROUP:
                raise ValueError(f"OptimConfig.groups may not use the reserved name {DEFAULT_GROUP!r}")
            if not isinstance(g, ParamGroup):
                raise TypeError(f"OptimConfig.groups[{name!r}] must be a ParamGroup, got {type(g).__name__}")
            if not g.lr_scale >= 0 or (g.clip_norm is not None and not g.clip_norm > 0):
                raise ValueError(f"OptimConfig.groups[{name!r}] needs lr_scale >= 0 and clip_norm > 0 or None, "
                                 f"got {g}")

    def replace(self, **kw) -> OptimConfig:
        return dataclasses.replace(self, **kw)


@dataclass(frozen=True)
class Optimizer:
    """An optax transformation plus what the train step reports about it (learning rates, group names)."""

    tx: optax.GradientTransformation
    schedule: Callable[[jax.Array], jax.Array]  # step -> learning rate of the default group
    lr_scales: Mapping[str, float]  # group name -> multiplier of `schedule` ("default" included)
    group_of: Callable[[dict], dict]  # params -> pytree of group names (same structure)

    def init(self, params):
        return self.tx.init(params)

    def update(self, grads, opt_state, params=None):
        return self.tx.update(grads, opt_state, params)


def lr_schedule(cfg: OptimConfig) -> optax.Schedule:
    """Linear warmup 0 -> lr over warmup_steps, then cosine lr -> lr * min_lr_ratio at total_steps (with nothing
    left to decay over, warmup_steps == total_steps, the rate stays at lr)."""
    if cfg.warmup_steps == cfg.total_steps:  # optax's cosine refuses zero decay steps
        return optax.join_schedules([optax.linear_schedule(0.0, cfg.lr, cfg.warmup_steps),
                                     optax.constant_schedule(cfg.lr)], [cfg.warmup_steps])
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=cfg.lr, warmup_steps=cfg.warmup_steps,
        decay_steps=cfg.total_steps, end_value=cfg.lr * cfg.min_lr_ratio)


def _key_name(k) -> str:
    return str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))))


def decay_mask(params) -> dict:
    """True where weight decay applies: rank >= 2 and no path component containing "norm"."""
    def keep(path, x):
        return bool(jnp.ndim(x) >= 2 and not any("norm" in _key_name(k).lower() for k in path))

    return jax.tree_util.tree_map_with_path(keep, params)


def _group_labels(groups: Mapping[str, ParamGroup]) -> Callable[[dict], dict]:
    def labels(params):
        if not isinstance(params, Mapping):
            raise TypeError(f"params must be a dict keyed by top-level names to use OptimConfig.groups, "
                            f"got {type(params).__name__}")
        return {k: jax.tree.map(lambda _, k=k: k if k in groups else DEFAULT_GROUP, v) for k, v in params.items()}

    return labels


def _adamw(cfg: OptimConfig, lr_scale: float, clip: float | None, wd: float) -> optax.GradientTransformation:
    base = lr_schedule(cfg)
    sched = base if lr_scale == 1.0 else (lambda step: base(step) * lr_scale)
    parts = [] if clip is None else [optax.clip_by_global_norm(clip)]
    parts.append(optax.adamw(sched, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=wd, mask=decay_mask))
    return optax.chain(*parts)


def make_optimizer(cfg: OptimConfig) -> Optimizer:
    """The AdamW optimizer of `cfg` (one group, or an optax.multi_transform over `cfg.groups`)."""
    if not isinstance(cfg, OptimConfig):
        raise TypeError(f"cfg must be an OptimConfig, got {type(cfg).__name__}")
    default = _adamw(cfg, 1.0, cfg.clip_norm, cfg.weight_decay)
    scales = {DEFAULT_GROUP: 1.0}
    if not cfg.groups:
        return Optimizer(default, lr_schedule(cfg), scales, lambda p: jax.tree.map(lambda _: DEFAULT_GROUP, p))
    labels = _group_labels(cfg.groups)
    txs = {DEFAULT_GROUP: default}
    for name, g in cfg.groups.items():
        wd = cfg.weight_decay if g.weight_decay is None else g.weight_decay
        txs[name] = _adamw(cfg, g.lr_scale, g.clip_norm, wd)
        scales[name] = g.lr_scale
    return Optimizer(optax.multi_transform(txs, labels), lr_schedule(cfg), scales, labels)


def group_grad_norms(optimizer: Optimizer | optax.GradientTransformation, grads) -> dict[str, jax.Array]:
    """{"grad_norm": global norm} plus {"grad_norm/<group>": norm} per named group (before clipping)."""
    out = {"grad_norm": optax.global_norm(grads)}
    if isinstance(optimizer, Optimizer) and len(optimizer.lr_scales) > 1:
        names = optimizer.group_of(grads)
        for g in optimizer.lr_scales:
            sel = jax.tree.map(lambda x, n, g=g: x if n == g else jnp.zeros((), x.dtype), grads, names)
            out[f"grad_norm/{g}"] = optax.global_norm(sel)
    return out


def learning_rates(optimizer: Optimizer | optax.GradientTransformation, step: jax.Array) -> dict[str, jax.Array]:
    """{"lr": default-group rate} plus {"lr/<group>": rate} per named group, at `step` (the update's index)."""
    if not isinstance(optimizer, Optimizer):
        return {}
    lr = jnp.asarray(optimizer.schedule(step), jnp.float32)
    out = {"lr": lr}
    for g, s in optimizer.lr_scales.items():
        if g != DEFAULT_GROUP:
            out[f"lr/{g}"] = lr * s
    return out


def keep_if_finite(ok: jax.Array, new, old):
    """`new` where ok (a scalar bool) else `old`, leaf by leaf: a skipped update leaves the tree bit-identical."""
    return jax.tree.map(lambda n, o: jax.lax.select(ok, n, o), new, old)
