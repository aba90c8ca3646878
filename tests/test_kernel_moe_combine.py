"""kernels/grouped_gemm/combine.py (the MoE's gather, weights and sum over k choices in one kernel) against the jnp
combine it replaces: interpret mode on CPU, Triton IR verified at DiffusionGemma's shapes, the MoE's pallas path
under moe.COMBINE_KERNEL, and compiled on a GPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from triton_ir import verified_triton_modules

from orl_jax_kernels.grouped_gemm.combine import moe_combine, supported


def _case(t, k, d, key=0, dtype=jnp.bfloat16):
    ks = jax.random.split(jax.random.key(key), 3)
    y = jax.random.normal(ks[0], (t * k, d), dtype)
    pos = jax.random.permutation(ks[1], t * k).astype(jnp.int32).reshape(t, k)
    w = jax.nn.softmax(jax.random.normal(ks[2], (t, k)), axis=-1)
    return y, pos, w


def _reference(y, pos, w, dtype):
    return (y[pos].astype(jnp.float32) * w[..., None].astype(jnp.float32)).sum(1).astype(dtype)


@pytest.mark.parametrize("t,k,d,bt,bd", [(40, 3, 512, 16, 256), (32, 8, 256, 32, 128), (5, 2, 64, 8, 64),
                                         (40, 8, 256, None, None)])  # the last: the module's tiles
def test_equals_the_gathered_sum_in_interpret_mode(t, k, d, bt, bd):
    """Token counts that fill their tiles or not (40 = 2.5 tiles of 16, 5 < 8), k 2-8; bf16 rows, float32 sums, one
    rounding; shuffled indices give other sums (the check can fail)."""
    y, pos, w = _case(t, k, d)
    got = moe_combine(y, pos, w, block_t=bt, block_d=bd, interpret=True)
    want = _reference(y, pos, w, jnp.bfloat16)
    assert got.shape == (t, d) and got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=1e-2, atol=1e-2)
    assert np.mean(np.asarray(got) == np.asarray(want)) > 0.95  # the same float32 sums up to their order
    f32 = moe_combine(y, pos, w, out_dtype=jnp.float32, block_t=bt, block_d=bd, interpret=True)
    np.testing.assert_allclose(np.asarray(f32), np.asarray(_reference(y, pos, w, jnp.float32)), rtol=1e-6, atol=1e-6)
    other = moe_combine(y, pos[::-1], w, block_t=bt, block_d=bd, interpret=True)
    assert np.abs(np.asarray(other, np.float32) - np.asarray(want, np.float32)).max() > 0.1


def test_rejects_wrong_inputs():
    y, pos, w = _case(8, 2, 128)
    with pytest.raises(ValueError, match="int32"):
        moe_combine(y, pos.astype(jnp.float32), w, interpret=True)
    with pytest.raises(ValueError, match="same shape"):
        moe_combine(y, pos, w[:, :1], interpret=True)
    with pytest.raises(ValueError, match="column tiles of 256"):
        moe_combine(y, pos, w, block_d=256, interpret=True)  # D = 128
    with pytest.raises(ValueError, match="tokens per tile"):
        moe_combine(y, pos, w, block_t=12, block_d=128, interpret=True)
    assert supported(2816) and not supported(2816, 512) and not supported(2816, 8)


def test_lowers_to_verified_triton_at_diffusion_gemma_shapes():
    """The canvas (256 tokens), prefill_decode (768), a count that leaves a tile part-filled (40); top-8 of D =
    2816."""
    sd = jax.ShapeDtypeStruct
    for t in (256, 768, 40):
        verified_triton_modules(lambda y, p, w: moe_combine(y, p, w), sd((8 * t, 2816), jnp.bfloat16),
                                sd((t, 8), jnp.int32), sd((t, 8), jnp.float32))


@pytest.mark.parametrize("distinct,xla_sort", [(True, False), (False, False), (False, True)])
def test_moe_pallas_path_with_the_combine_kernel(distinct, xla_sort, monkeypatch):
    """moe.COMBINE_KERNEL: experts_mlp(impl="pallas") with the fused expert layout combines in the kernel (called:
    a spy) and gives the gathered combine's values up to float32 rounding, with either sort's indices."""
    import orl_jax_kernels.expert_sort.kernel as sort_kernel
    import orl_jax_kernels.grouped_gemm.combine as combine
    from orl_jax.model import moe
    from orl_jax.model.streamed import StackedWeight

    if xla_sort:
        monkeypatch.setattr(sort_kernel, "MAX_ASSIGNMENTS", 8)
    ks = jax.random.split(jax.random.key(7), 4)
    t, d, e, f, k = 40, 256, 8, 64, 3
    x = jax.random.normal(ks[0], (t, d), jnp.bfloat16)
    gate_up = (jax.random.normal(ks[1], (1, e, d, 2 * f)) * 0.1).astype(jnp.bfloat16)
    down = (jax.random.normal(ks[2], (1, e, f, d)) * 0.1).astype(jnp.bfloat16)
    experts = jax.lax.top_k(jax.random.normal(ks[3], (t, e)), k)[1].astype(jnp.int32)
    weights = jax.nn.softmax(jax.random.normal(ks[3], (t, k)), axis=-1)
    tiles = moe.fuse_gate_up(gate_up)
    calls, real = [], combine.moe_combine
    monkeypatch.setattr(combine, "moe_combine", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    run = lambda: np.asarray(moe.experts_mlp(  # noqa: E731
        x, weights, experts, StackedWeight(tiles, jnp.int32(0)), StackedWeight(down, jnp.int32(0)), "gelu_tanh",
        "pallas", distinct=distinct), np.float32)
    want = run()
    assert not calls
    monkeypatch.setattr(moe, "COMBINE_KERNEL", True)
    got = run()
    assert calls
    np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-2)
    assert np.mean(got == want) > 0.95 and np.abs(want).max() > 0.05


@pytest.mark.gpu
@pytest.mark.parametrize("t", [256, 768], ids=["canvas", "prefill_decode"])
def test_compiled_on_gpu_at_the_26b_shapes(t):
    y, pos, w = _case(t, 8, 2816, key=3)
    got = np.asarray(jax.jit(moe_combine)(y, pos, w), np.float32)
    want = np.asarray(jax.jit(_reference, static_argnums=3)(y, pos, w, jnp.bfloat16), np.float32)
    np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-2)
    assert np.mean(got == want) > 0.95
