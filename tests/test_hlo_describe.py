"""benchmarks/hlo_describe.py: a kernel name from a trace resolves to its fusion in the compiled module, with its
shapes, the ops fused into it and the source line of the JAX op (inside a loop body too); and the copies a
compiled module makes, where they run."""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from hlo_describe import copies, describe  # noqa: E402


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


def _grow(x, n):  # a while loop that updates its carry in place
    return jax.lax.fori_loop(0, n, lambda i, c: jax.lax.dynamic_update_slice(c, c[:1] + 1.0, (i % 4, 0)), x)


def test_copies_finds_the_entry_copy_of_an_input_the_loop_does_not_own():
    x = jnp.ones((64, 128), jnp.float32)
    read = [c for c in copies(jax.jit(_grow).lower(x, 3).compile().as_text()) if c["result"] == "f32[64,128]"]
    assert [(c["entry"], c["bytes"], c["operand"].startswith("x") or c["operand"].startswith("Arg")) for c in read] \
        == [(True, 64 * 128 * 4, True)], read
    donated = jax.jit(_grow, donate_argnums=0).lower(x, 3).compile().as_text()
    assert not [c for c in copies(donated) if c["result"] == "f32[64,128]"]
