"""benchmarks/hlo_describe.py: a kernel name from a trace resolves to its fusion in the compiled module, with its
shapes, the ops fused into it and the source line of the JAX op (inside a loop body too)."""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from hlo_describe import describe  # noqa: E402


def _body(i, x):
    return jnp.tanh(x * 2.0 + 1.0)  # the fused elementwise op of the loop body


def test_kernel_names_resolve_to_their_fusions_with_shapes_and_source():
    f = jax.jit(lambda x, n: jax.lax.fori_loop(0, n, _body, x) @ x.T)
    text = f.lower(jnp.ones((48, 24), jnp.float32), 3).compile().as_text()
    fusions = [ln.split(" = ")[0].strip().removeprefix("ROOT ").lstrip("%") for ln in text.splitlines()
               if " fusion(" in ln]
    kernels = [n.replace(".", "_") for n in fusions]
    got = describe(text, kernels + ["no_such_kernel"])
    assert set(got) == set(kernels) and kernels
    body = [d for d in got.values() if "tanh" in d["fused"]]
    assert len(body) == 1
    d = body[0]
    assert d["opcode"] == "fusion" and d["result"].startswith("f32[48,24]")
    assert d["operands"] and all(o.startswith("f32[48,24]") for o in d["operands"])
    assert d["source"] == f"{__file__}:{_body.__code__.co_firstlineno + 1}"
    assert "tanh" in d["op_name"] or "add" in d["op_name"] or "mul" in d["op_name"]
