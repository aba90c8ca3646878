"""Pallas -> Triton IR on any machine (no GPU): export a jitted function for CUDA and run MLIR's verifier on every
Triton module it lowers to. Catches what the CPU interpreter cannot, e.g. loop bounds of mixed integer types that
XLA's GPU compiler would refuse ("Failed to parse Triton module"). Triton -> PTX still happens on a GPU only."""

import jax
from jax import export

TRITON_CALL = "__gpu$xla.gpu.triton"


def verified_triton_modules(monkeypatch, fn, *args) -> int:
    """Export fn(*args) for CUDA; assert it calls Triton and that each Triton module verifies. Returns the count."""
    # no public hook for the module; imported here so that a jax without it fails this test, not the collection
    from jax._src.pallas.triton import pallas_call_registration as registration

    lower = registration.lowering.lower_jaxpr_to_triton_module
    modules = []

    def capture(*a, **k):
        result = lower(*a, **k)
        modules.append(result.module)
        return result

    monkeypatch.setattr(registration.lowering, "lower_jaxpr_to_triton_module", capture)
    exp = export.export(jax.jit(fn), platforms=["cuda"],
                        disabled_checks=[export.DisabledSafetyCheck.custom_call(TRITON_CALL)])(*args)
    assert TRITON_CALL in exp.mlir_module()
    assert modules, "no Pallas Triton kernel was lowered"
    for m in modules:
        assert m.operation.verify()
    return len(modules)
