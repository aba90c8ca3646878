"""What every kernel wrapper here hands pallas_call the same way: Triton's compiler settings (none in interpret
mode) and the layer index of a weight or cache stack read in place (a [1] int32 operand; 0 when unstacked)."""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp


def pow2(n: int, least: int = 1) -> int:
    """The smallest power of two >= n and >= least: Triton's tensor sizes are powers of two (pad up to it)."""
    return max(least, 1 << (n - 1).bit_length())


def triton_params(num_warps: int, num_stages: int, interpret: bool) -> dict:
    """pallas_call keyword arguments: the Triton compiler params on a GPU, nothing in interpret mode."""
    if interpret:
        return {}
    from jax.experimental.pallas import triton as pltriton

    return {"compiler_params": pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)}


def layer_operand(fn: str, stacked: bool, layer, shape) -> jax.Array:
    """The layer index as a [1] int32 array; a stack (stacked) must come with `layer`, a single weight without."""
    if stacked != (layer is not None):
        raise ValueError(f"{fn}: an operand of shape {shape} with layer={'given' if layer is not None else None}: "
                         f"a stack needs `layer` and a single one none")
    return jnp.reshape(jnp.asarray(0 if layer is None else layer, jnp.int32), (1,))


@contextlib.contextmanager
def triton_modules():
    """The Triton modules (MLIR) Pallas lowers while the block runs, collected as they are made: what the tests verify
    and benchmarks/kernel_registers.py compiles. jax offers no public hook for them, so this wraps its private Pallas
    lowering (a dev aid: it needs a change when jax moves that function)."""
    from jax._src.pallas.triton import pallas_call_registration as registration

    lower = registration.lowering.lower_jaxpr_to_triton_module
    modules = []

    def capture(*args, **kwargs):
        result = lower(*args, **kwargs)
        modules.append(result.module)
        return result

    registration.lowering.lower_jaxpr_to_triton_module = capture
    try:
        yield modules
    finally:
        registration.lowering.lower_jaxpr_to_triton_module = lower


@contextlib.contextmanager
def h200_target():
    """Lower Pallas' Triton kernels for an H200 on a machine without one (the IR tests, benchmarks' register counts):
    from jax 0.11 the lowering asks the device for its compute capability and, without a GPU, takes the abstract
    mesh's device (jax 0.10 assumes one)."""
    device = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), axis_types=(jax.sharding.AxisType.Auto,), abstract_device=device)
    with jax.sharding.use_abstract_mesh(mesh):  # Auto: no sharding in the types (Explicit would check every op)
        yield
