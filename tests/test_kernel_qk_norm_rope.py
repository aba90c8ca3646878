"""The q/k norm + RoPE kernel: interpret mode on CPU against its oracle and the model's own layers, Triton IR
verified at the Qwen3-4B decode shapes, compiled on a GPU (marked gpu). generate() through it is covered by
test_kernel_decode_attention (cached_attention_impl="pallas" equals the default token for token)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from triton_ir import verified_triton_modules

from orl_jax.model.layers import apply_rope, rms_norm, rope_angles
from orl_jax_kernels.qk_norm_rope.kernel import qk_norm_rope, qk_norm_rope_stacked, supported
from orl_jax_kernels.qk_norm_rope.reference import gemma_qkv_reference, qk_norm_rope_reference


def _inputs(key, b, l, kv, g, h, dtype):
    ks = jax.random.split(key, 3)
    qkv = (jax.random.normal(ks[0], (b, l, kv, g + 2, h)) * 3).astype(dtype)
    positions = jnp.arange(l)[None] + 7 * jnp.arange(b)[:, None]  # rows at different offsets
    cos, sin = rope_angles(positions, h, 10000.0)
    q_norm = (1 + 0.1 * jax.random.normal(ks[1], (h,))).astype(dtype)
    k_norm = (1 + 0.1 * jax.random.normal(ks[2], (h,))).astype(dtype)
    return qkv, cos, sin, q_norm, k_norm


def test_reference_is_the_models_norm_then_rope():
    qkv, cos, sin, qn, kn = _inputs(jax.random.key(0), 2, 5, 2, 4, 16, jnp.bfloat16)
    q, k, v = qk_norm_rope_reference(qkv, cos, sin, qn, kn, 1e-6)
    b, l, kv, g, h = 2, 5, 2, 4, 16
    want_q = apply_rope(rms_norm(qkv[:, :, :, :g].reshape(b, l, kv * g, h), qn, 1e-6), cos, sin)
    want_k = apply_rope(rms_norm(qkv[:, :, :, g], kn, 1e-6), cos, sin)
    np.testing.assert_array_equal(np.asarray(q.reshape(b, l, kv * g, h), np.float32), np.asarray(want_q, np.float32))
    np.testing.assert_array_equal(np.asarray(k, np.float32), np.asarray(want_k, np.float32))
    np.testing.assert_array_equal(np.asarray(v, np.float32), np.asarray(qkv[:, :, :, g + 1], np.float32))


@pytest.mark.parametrize("dtype,shape", [(jnp.float32, (2, 5, 2, 4, 16)), (jnp.bfloat16, (1, 3, 4, 2, 32)),
                                         (jnp.bfloat16, (2, 4, 2, 1, 16))])
def test_matches_the_reference_in_interpret_mode(dtype, shape):
    qkv, cos, sin, qn, kn = _inputs(jax.random.key(1), *shape, dtype)
    got = qk_norm_rope(qkv, cos, sin, qn, kn, 1e-6, interpret=True)
    want = qk_norm_rope_reference(qkv, cos, sin, qn, kn, 1e-6)
    for a, b in zip(got, want):
        assert a.shape == b.shape and a.dtype == dtype
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=1e-6, atol=1e-6)
    # the check can fail: a swapped norm weight changes q
    other = qk_norm_rope(qkv, cos, sin, kn, kn, 1e-6, interpret=True)[0]
    assert np.abs(np.asarray(other, np.float32) - np.asarray(want[0], np.float32)).max() > 1e-3


def test_stacked_norms_are_read_from_the_layer_and_offsets_given():
    """The engine's form: both norm weights inside one packed [layers, n] vector stack (model/streamed.pack_vectors),
    at unaligned offsets, selected by a traced layer index."""
    qkv, cos, sin, _, _ = _inputs(jax.random.key(4), 1, 4, 2, 2, 16, jnp.bfloat16)
    vectors = (1 + 0.1 * jax.random.normal(jax.random.key(5), (3, 45))).astype(jnp.bfloat16)
    offsets = (5, 24)
    run = jax.jit(lambda layer: qk_norm_rope_stacked(qkv, cos, sin, vectors, layer, offsets, 1e-6, interpret=True))
    for layer in range(3):
        want = qk_norm_rope_reference(qkv, cos, sin, vectors[layer, 5:21], vectors[layer, 24:40], 1e-6)
        for a, b in zip(run(jnp.int32(layer)), want):
            np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="do not match"):
        qk_norm_rope_stacked(qkv, cos, sin, vectors, jnp.int32(0), (5, 30), 1e-6, interpret=True)  # 30 + 16 > 45


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gemma_order_matches_diffusion_gemmas_layer(dtype):
    """gemma=True: the weight multiplies in float32 before the cast, v gets the weightless norm (DiffusionGemma's
    sliding layers, head dim 256 in the real model; 2 query heads per kv head)."""
    qkv, cos, sin, qn, kn = _inputs(jax.random.key(6), 2, 3, 2, 2, 32, dtype)
    vectors = jnp.concatenate([jnp.ones((7,), dtype), qn, kn])[None].repeat(2, axis=0)
    got = qk_norm_rope_stacked(qkv, cos, sin, vectors, jnp.int32(1), (7, 39), 1e-6, interpret=True, gemma=True)
    want = gemma_qkv_reference(qkv, cos, sin, qn, kn, 1e-6)
    for a, b in zip(got, want):
        assert a.shape == b.shape and a.dtype == dtype
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=1e-6, atol=1e-6)
    qwen = qk_norm_rope_stacked(qkv, cos, sin, vectors, jnp.int32(1), (7, 39), 1e-6, interpret=True)
    assert np.abs(np.asarray(qwen[2], np.float32) - np.asarray(want[2], np.float32)).max() > 1e-2  # v differs


def test_rejects_mismatched_or_unsupported_shapes():
    qkv, cos, sin, qn, kn = _inputs(jax.random.key(2), 1, 3, 2, 2, 16, jnp.float32)
    with pytest.raises(ValueError, match="do not match"):
        qk_norm_rope(qkv, cos[:, :2], sin, qn, kn, 1e-6, interpret=True)
    with pytest.raises(ValueError, match="do not match"):
        qk_norm_rope(qkv, cos, sin, qn[:8], kn, 1e-6, interpret=True)
    with pytest.raises(ValueError, match="not supported"):
        qk_norm_rope(jnp.ones((1, 3, 2, 5, 16)), cos, sin, qn, kn, 1e-6, interpret=True)  # G = 3
    assert supported(8, 4, 128) and supported(4, 2, 64) and not supported(8, 3, 128) and not supported(6, 4, 128)


@pytest.mark.parametrize("rows", [32, 256], ids=["block32", "canvas256"])
def test_kernel_lowers_to_verified_triton_at_the_qwen3_4b_shapes(rows):
    sd = jax.ShapeDtypeStruct
    verified_triton_modules(lambda x, c, s, a, b: qk_norm_rope(x, c, s, a, b, 1e-6),
                            sd((1, rows, 8, 6, 128), jnp.bfloat16), sd((1, rows, 128), jnp.float32),
                            sd((1, rows, 128), jnp.float32), sd((128,), jnp.bfloat16), sd((128,), jnp.bfloat16))


@pytest.mark.parametrize("gemma", [False, True], ids=["qwen3", "gemma"])
def test_stacked_kernel_lowers_to_verified_triton(gemma):
    """The engine's form (norms from the packed stack by layer index) at Qwen3-4B's block-32 shape, and DiffusionGemma's
    sliding layers at canvas 256 (8 kv heads x 2 query heads, head dim 256)."""
    sd = jax.ShapeDtypeStruct
    g, h, rows, n = (2, 256, 256, 8 * 2816) if gemma else (4, 128, 32, 5376)
    verified_triton_modules(lambda x, c, s, v, i: qk_norm_rope_stacked(x, c, s, v, i, (n - 2 * h, n - h), 1e-6,
                                                                       gemma=gemma),
                            sd((1, rows, 8, g + 2, h), jnp.bfloat16), sd((1, rows, h), jnp.float32),
                            sd((1, rows, h), jnp.float32), sd((25, n), jnp.bfloat16), sd((), jnp.int32))


@pytest.mark.gpu
@pytest.mark.parametrize("gemma", [False, True], ids=["qwen3", "gemma"])
def test_stacked_compiled_on_gpu_matches_the_reference_bf16(gemma):
    qkv, cos, sin, qn, kn = _inputs(jax.random.key(7), 1, 64, 8, 2, 256, jnp.bfloat16)
    vectors = jnp.stack([jnp.concatenate([qn * 0.5, kn * 2, qn, kn]), jnp.concatenate([kn, qn, qn, kn])])
    got = qk_norm_rope_stacked(qkv, cos, sin, vectors, jnp.int32(0), (512, 768), 1e-6, gemma=gemma)
    want = (gemma_qkv_reference if gemma else qk_norm_rope_reference)(qkv, cos, sin, qn, kn, 1e-6)
    for a, b in zip(got, want):  # bf16: at most a rounding step apart (FMA contraction may differ)
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
def test_compiled_on_gpu_matches_the_reference_bf16():
    qkv, cos, sin, qn, kn = _inputs(jax.random.key(3), 1, 32, 8, 4, 128, jnp.bfloat16)
    got = qk_norm_rope(qkv, cos, sin, qn, kn, 1e-6)
    want = qk_norm_rope_reference(qkv, cos, sin, qn, kn, 1e-6)
    for a, b in zip(got, want):  # bf16: at most a rounding step apart (FMA contraction may differ)
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=2e-2, atol=2e-2)
