"""kernels/l2_prefetch: the maxima it reads equal the reference (interpret mode), bad arguments are refused, Triton IR
verifies at DiffusionGemma's gate/up stack, and the MoE with moe.PREFETCH_EXPERTS gives the same result as without."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from triton_ir import verified_triton_modules

from orl_jax_kernels.l2_prefetch.kernel import prefetch_experts
from orl_jax_kernels.l2_prefetch.reference import prefetch_reference


@pytest.mark.parametrize("chunks,after", [(2, True), (1, False)])
def test_maxima_equal_the_reference(chunks, after):
    w = jax.random.normal(jax.random.key(0), (3, 4, 256, 256), jnp.float32).astype(jnp.bfloat16)
    dep = jnp.ones((8, 16), jnp.bfloat16) if after else None
    got = prefetch_experts(w, jnp.int32(1), 3, dep, chunks=chunks, interpret=True)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(prefetch_reference(w, 1, 3, 128, 64 * chunks)))


def test_refuses_bad_arguments():
    w = jnp.zeros((2, 4, 256, 256), jnp.bfloat16)
    with pytest.raises(ValueError, match="experts"):
        prefetch_experts(w, jnp.int32(0), 5, interpret=True)
    with pytest.raises(ValueError, match="stack"):
        prefetch_experts(w[0], jnp.int32(0), 1, interpret=True)
    with pytest.raises(ValueError, match="bn"):
        prefetch_experts(w, jnp.int32(0), 1, bn=96, interpret=True)
    with pytest.raises(ValueError, match="policy"):
        prefetch_experts(w, jnp.int32(0), 1, policy="keep", interpret=True)


def test_lowers_to_verified_triton_at_the_gate_up_stack(monkeypatch):
    sd = jax.ShapeDtypeStruct
    verified_triton_modules(monkeypatch, lambda w, i, a: prefetch_experts(w, i, 4, a),
                            sd((25, 128, 2816, 1408), jnp.bfloat16), sd((), jnp.int32), sd((256, 2816), jnp.bfloat16))


def test_moe_with_prefetch_equals_without(monkeypatch):
    """The pallas MoE path with PREFETCH_EXPERTS: one more kernel, whose output the gate/up kernel takes; the same
    values."""
    from orl_jax.model import moe
    from orl_jax_kernels.grouped_gemm import kernel as grouped

    ks = jax.random.split(jax.random.key(3), 4)
    t, d, e, f, k = 32, 128, 8, 128, 2
    x = jax.random.normal(ks[0], (t, d))
    gate_up, down = jax.random.normal(ks[1], (e, d, 2 * f)) * 0.2, jax.random.normal(ks[2], (e, f, d)) * 0.2
    experts = jnp.stack([jnp.arange(t, dtype=jnp.int32) % e, (jnp.arange(t, dtype=jnp.int32) + 3) % e], axis=1)
    weights = jax.nn.softmax(jax.random.normal(ks[3], (t, k)), axis=-1)
    run = lambda: moe.experts_mlp(x, weights, experts, gate_up, down, "gelu_tanh", "pallas")  # noqa: E731
    want = run()
    monkeypatch.setattr(moe, "PREFETCH_EXPERTS", 3)
    afters, real = [], grouped.grouped_matmul
    monkeypatch.setattr(grouped, "grouped_matmul", lambda *a, **kw: afters.append(kw.get("after")) or real(*a, **kw))
    got = run()
    assert [a is not None for a in afters] == [True, False]  # gate/up waits for the prefetch, down does not
    assert afters[0].shape == (3, 2, 1)  # 3 experts x 256 / 128 column tiles x one 128-row part
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert str(jax.make_jaxpr(run)()).count("pallas_call") == 4  # sort, prefetch, gate/up, down


@pytest.mark.gpu
def test_compiled_on_gpu():
    w = (jax.random.normal(jax.random.key(1), (2, 6, 2816, 1408), jnp.float32) * 0.05).astype(jnp.bfloat16)
    got = prefetch_experts(w, jnp.int32(1), 4, jnp.ones((256, 2816), jnp.bfloat16))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(prefetch_reference(w, 1, 4, 128, 128)))
