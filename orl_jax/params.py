"""Each weight is declared once as a ParamSpec; abstract shapes, shardings and random init all derive from it.

A model file exposes `param_specs(cfg) -> pytree of ParamSpec`; everything here works on such a tree.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from orl_jax.sharding import named_sharding

Init = Callable[[jax.Array, tuple[int, ...], jnp.dtype], jax.Array]


def normal(std: float = 0.02) -> Init:
    return lambda key, shape, dtype: (std * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


def ones(key, shape, dtype):
    return jnp.ones(shape, dtype)


def zeros(key, shape, dtype):
    return jnp.zeros(shape, dtype)


@dataclass(frozen=True)
class ParamSpec:
    shape: tuple[int, ...]
    dtype: jnp.dtype
    axes: tuple[str | None, ...]  # logical axis names, one per dim (see sharding.RULES)
    init: Init = normal()

    def __post_init__(self):
        if len(self.shape) != len(self.axes):
            raise ValueError(f"ParamSpec shape {self.shape} and axes {self.axes} differ in rank")


def _is_spec(x) -> bool:
    return isinstance(x, ParamSpec)


def abstract(specs) -> dict:
    """Pytree of jax.ShapeDtypeStruct (no memory)."""
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype), specs, is_leaf=_is_spec)


def shardings(specs, mesh: Mesh) -> dict:
    """Pytree of NamedSharding from each weight's logical axes."""
    return jax.tree.map(lambda s: named_sharding(mesh, s.axes, s.shape), specs, is_leaf=_is_spec)


def init(specs, key: jax.Array, mesh: Mesh | None = None) -> dict:
    """Random parameters; with a mesh they are created already sharded (never whole on one device)."""
    leaves, treedef = jax.tree.flatten(specs, is_leaf=_is_spec)

    def make(key):
        keys = jax.random.split(key, len(leaves))
        return jax.tree.unflatten(treedef, [s.init(k, s.shape, s.dtype) for s, k in zip(leaves, keys)])

    out_shardings = None if mesh is None else shardings(specs, mesh)
    return jax.jit(make, out_shardings=out_shardings)(key)


def count(specs) -> int:
    return sum(math.prod(s.shape) for s in jax.tree.leaves(specs, is_leaf=_is_spec))


def check_tree(params, specs, where: str = "params") -> None:
    """Raise ValueError naming the first missing, extra or wrongly shaped weight."""
    flat_p = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_leaves_with_path(params)}
    flat_s = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_leaves_with_path(specs, is_leaf=_is_spec)}
    missing, extra = sorted(set(flat_s) - set(flat_p)), sorted(set(flat_p) - set(flat_s))
    if missing:
        raise ValueError(f"{where}: missing weight(s) {missing[:5]}")
    if extra:
        raise ValueError(f"{where}: unexpected weight(s) {extra[:5]}")
    for k, s in flat_s.items():
        if tuple(flat_p[k].shape) != tuple(s.shape):
            raise ValueError(f"{where}: weight {k} has shape {tuple(flat_p[k].shape)}, expected {s.shape}")
