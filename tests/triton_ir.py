"""Pallas -> Triton IR on any machine (no GPU): export a jitted function for CUDA and run MLIR's verifier on every
Triton module it lowers to. Catches what the CPU interpreter cannot, e.g. loop bounds of mixed integer types that
XLA's GPU compiler would refuse ("Failed to parse Triton module"). Triton -> PTX still happens on a GPU only."""

import jax
from jax import export

from orl_jax_kernels.pallas_args import h200_target, triton_modules

TRITON_CALL = "__gpu$xla.gpu.triton"


def verified_triton_modules(fn, *args) -> int:
    """Export fn(*args) for CUDA; assert it calls Triton and that each Triton module verifies. Returns the count."""
    with triton_modules() as modules, h200_target():
        exp = export.export(jax.jit(fn), platforms=["cuda"],
                            disabled_checks=[export.DisabledSafetyCheck.custom_call(TRITON_CALL)])(*args)
    assert TRITON_CALL in exp.mlir_module()
    assert modules, "no Pallas Triton kernel was lowered"
    for m in modules:
        assert m.operation.verify()
    return len(modules)
