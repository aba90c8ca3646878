"""The grouped (ragged) GEMM kernel against jax.lax.ragged_dot: interpret mode on CPU, Triton IR verified at
DiffusionGemma's expert shapes, and the MoE's "pallas" path through it against the dense path."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from triton_ir import verified_triton_modules

from orl_jax_kernels.grouped_gemm.kernel import BM, grouped_matmul, supported
from orl_jax_kernels.grouped_gemm.reference import grouped_matmul_reference
from orl_jax_kernels.small_m_gemm.kernel import Blocks

BLOCKS = Blocks(bn=128, bk=64, splits=1)


@pytest.mark.parametrize("stacked,bm,columns_inner", [(False, BM, False), (True, BM, False), (True, 32, False),
                                                      (True, BM, True)])
def test_matches_ragged_dot_in_interpret_mode(stacked, bm, columns_inner, monkeypatch):
    from orl_jax_kernels.grouped_gemm import kernel

    monkeypatch.setattr(kernel, "COLUMNS_INNER", columns_inner)
    jax.clear_caches()  # the program order is read at trace time
    ks = jax.random.split(jax.random.key(0), 2)
    e, k, n = 6, 128, 256
    sizes = jnp.array([0, bm + 6, 3, 0, bm, 1])  # a group over bm rows (two tiles), exactly bm, empty groups
    m = int(sizes.sum()) + 5  # rows past the last group
    x = jax.random.normal(ks[0], (m, k))
    w = jax.random.normal(ks[1], (2, e, k, n))
    got = (grouped_matmul(x, w, sizes, jnp.int32(1), BLOCKS, interpret=True, bm=bm) if stacked
           else grouped_matmul(x, w[1], sizes, None, BLOCKS, interpret=True, bm=bm))
    want = grouped_matmul_reference(x, w[1], sizes)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-4)
    assert not np.asarray(got[-5:]).any()  # rows past the groups are 0
    # the check can fail: the other layer's weights give other rows
    other = grouped_matmul(x, w, sizes, jnp.int32(0), BLOCKS, interpret=True)
    assert np.abs(np.asarray(other) - np.asarray(want)).max() > 1.0


@pytest.mark.parametrize("stacked,columns_inner", [(False, True), (True, True), (True, False)])
def test_gathered_rows_in_interpret_mode(stacked, columns_inner, monkeypatch):
    """rows: each sorted row read from its source row of x (any number of rows, repeats), against ragged_dot on
    the gathered rows."""
    from orl_jax_kernels.grouped_gemm import kernel

    monkeypatch.setattr(kernel, "COLUMNS_INNER", columns_inner)
    jax.clear_caches()
    ks = jax.random.split(jax.random.key(4), 3)
    e, k, n, t = 5, 128, 256, 23
    sizes = jnp.array([BM + 3, 0, 7, 1, 12])
    m = int(sizes.sum()) + 4  # rows past the last group
    x = jax.random.normal(ks[0], (t, k))
    rows = jax.random.randint(ks[1], (m,), 0, t, jnp.int32)  # tokens repeat, as the top-k choices do
    w = jax.random.normal(ks[2], (2, e, k, n)) * 0.1
    layer, one = (jnp.int32(1), w) if stacked else (None, w[1])
    got = grouped_matmul(x, one, sizes, layer, BLOCKS, interpret=True, rows=rows)
    want = grouped_matmul_reference(jnp.take(x, rows, axis=0), w[1], sizes)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-4)
    assert not np.asarray(got[-4:]).any()
    # the check can fail: other rows give other values
    shifted = grouped_matmul(x, one, sizes, layer, BLOCKS, interpret=True, rows=(rows + 1) % t)
    assert np.abs(np.asarray(shifted) - np.asarray(want)).max() > 0.1
    with pytest.raises(ValueError, match="rows must be"):
        grouped_matmul(x, one, sizes, layer, BLOCKS, interpret=True, rows=rows.astype(jnp.float32))


def test_given_offsets_replace_the_cumsum_of_the_group_sizes():
    ks = jax.random.split(jax.random.key(2), 2)
    sizes = jnp.array([3, 0, BM + 1, 5])
    x = jax.random.normal(ks[0], (int(sizes.sum()), 128))
    w = jax.random.normal(ks[1], (4, 128, 128))
    offsets = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(sizes).astype(jnp.int32)])
    got = grouped_matmul(x, w, sizes, None, BLOCKS, interpret=True, offsets=offsets)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(grouped_matmul(x, w, sizes, None, BLOCKS,
                                                                             interpret=True)))
    with pytest.raises(ValueError, match="offsets"):
        grouped_matmul(x, w, sizes, None, BLOCKS, interpret=True, offsets=offsets[1:])


def test_bf16_rows_of_one_expert_and_an_all_empty_call():
    ks = jax.random.split(jax.random.key(1), 2)
    x = jax.random.normal(ks[0], (40, 64), jnp.bfloat16)
    w = jax.random.normal(ks[1], (3, 64, 128), jnp.bfloat16)
    blocks = Blocks(bn=128, bk=64, splits=1)
    sizes = jnp.array([0, 40, 0])
    got = grouped_matmul(x, w, sizes, None, blocks, interpret=True)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32),
                               np.asarray(grouped_matmul_reference(x, w, sizes), np.float32), rtol=2e-2, atol=5e-2)
    none = grouped_matmul(x, w, jnp.zeros(3, jnp.int32), None, blocks, interpret=True)
    assert not np.asarray(none, np.float32).any()


def test_rejects_mismatched_inputs():
    x, w = jnp.ones((8, 64)), jnp.ones((2, 3, 64, 128))
    with pytest.raises(ValueError, match="needs `layer`"):
        grouped_matmul(x, w, jnp.ones(3, jnp.int32), None, BLOCKS, interpret=True)
    with pytest.raises(ValueError, match="do not match"):
        grouped_matmul(x, w, jnp.ones(4, jnp.int32), jnp.int32(0), BLOCKS, interpret=True)
    with pytest.raises(ValueError, match="bm must be"):
        grouped_matmul(x, w, jnp.ones(3, jnp.int32), jnp.int32(0), BLOCKS, interpret=True, bm=48)
    with pytest.raises(ValueError, match="not supported"):
        grouped_matmul(jnp.ones((8, 100)), jnp.ones((3, 100, 128)), jnp.ones(3, jnp.int32), None, BLOCKS,
                       interpret=True)
    assert supported(2816, 1408) and supported(704, 2816)  # DiffusionGemma's gate/up and down


def test_default_tiles_take_64_row_chunks_and_long_k_2_stages_unless_a_table_says_otherwise(monkeypatch):
    from orl_jax_kernels.grouped_gemm.kernel import default_blocks
    from orl_jax_kernels.small_m_gemm import kernel as small_m

    assert default_blocks(2816, 1408) == Blocks(bn=128, bk=64, splits=1, num_stages=2)  # DiffusionGemma's gate/up
    down = default_blocks(704, 2816)  # 11 chunks: the small-M rule's stages
    assert down.bk == 64 and down.num_stages == Blocks(bn=128, bk=64, splits=1).num_stages
    assert default_blocks(96, 256).bk == 32  # K's own divisor when smaller
    tuned = Blocks(bn=128, bk=128, splits=1, num_warps=8)
    monkeypatch.setitem(small_m.TUNED, (2816, 1408), tuned)
    assert default_blocks(2816, 1408) == tuned


def test_kernel_lowers_to_verified_triton_at_the_expert_shapes():
    """Pallas -> Triton IR at DiffusionGemma's shapes (2048 routed rows, a stack of 128 experts), no GPU needed."""
    sd = jax.ShapeDtypeStruct
    for k, n, bm in ((2816, 1408, BM), (704, 2816, BM), (2816, 1408, 32)):
        verified_triton_modules(lambda x, w, s, i, bm=bm: grouped_matmul(x, w, s, i, bm=bm),
                                sd((2048, k), jnp.bfloat16), sd((25, 128, k, n), jnp.bfloat16),
                                sd((128,), jnp.int32), sd((), jnp.int32))
    # gate/up as the MoE calls it: the 256 tokens' rows gathered by the kernel
    verified_triton_modules(lambda x, w, s, i, r: grouped_matmul(x, w, s, i, rows=r),
                            sd((256, 2816), jnp.bfloat16), sd((25, 128, 2816, 1408), jnp.bfloat16),
                            sd((128,), jnp.int32), sd((), jnp.int32), sd((2048,), jnp.int32))


def test_moe_pallas_path_equals_the_dense_path(monkeypatch):
    """experts_mlp(impl="pallas"): rows sorted by expert through the kernel (any load: one expert takes half of
    the assignments), equal to every token through every expert."""
    from orl_jax.model import moe

    ks = jax.random.split(jax.random.key(3), 4)
    t, d, e, f, k = 48, 64, 16, 64, 2
    x = jax.random.normal(ks[0], (t, d))
    gate_up, down = jax.random.normal(ks[1], (e, d, 2 * f)) * 0.2, jax.random.normal(ks[2], (e, f, d)) * 0.2
    experts = jnp.stack([jnp.zeros(t, jnp.int32), jnp.arange(t, dtype=jnp.int32) % (e - 1) + 1], axis=1)
    weights = jax.nn.softmax(jax.random.normal(ks[3], (t, k)), axis=-1)
    from orl_jax_kernels.grouped_gemm import kernel as grouped

    monkeypatch.setattr(moe, "SORT_KERNEL", True)  # the expert sort kernel (the default)
    offsets, real = [], grouped.grouped_matmul
    monkeypatch.setattr(grouped, "grouped_matmul", lambda *a, **kw: offsets.append(kw.get("offsets")) or real(*a, **kw))
    got = jax.jit(moe.experts_mlp, static_argnums=(5, 6))(x, weights, experts, gate_up, down, "gelu_tanh", "pallas")
    want = moe.dense_experts_mlp(x, weights, experts, gate_up, down, "gelu_tanh")
    assert len(offsets) == 2 and all(o is not None for o in offsets)  # from the sort kernel, not recomputed
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-4)
    jaxpr = str(jax.make_jaxpr(lambda: moe.experts_mlp(x, weights, experts, gate_up, down, "gelu_tanh",
                                                       "pallas"))())
    assert jaxpr.count("pallas_call") == 3 and "ragged_dot" not in jaxpr  # kernels/expert_sort, gate/up, down
    monkeypatch.setattr(moe, "SORT_KERNEL", False)  # sort_by_expert's XLA path: the same result
    jax.clear_caches()  # jit's trace cache is keyed by the function: the switch is read at trace time
    default = jax.jit(moe.experts_mlp, static_argnums=(5, 6))(x, weights, experts, gate_up, down, "gelu_tanh", "pallas")
    np.testing.assert_array_equal(np.asarray(default), np.asarray(got))
    from orl_jax_kernels.expert_sort import kernel as sort

    monkeypatch.setattr(moe, "SORT_KERNEL", True)
    monkeypatch.setattr(sort, "MAX_ASSIGNMENTS", t * k - 1)  # more assignments than the kernel takes: XLA sorts
    jaxpr = str(jax.make_jaxpr(lambda: moe.experts_mlp(x, weights, experts, gate_up, down, "gelu_tanh",
                                                       "pallas"))())
    assert jaxpr.count("pallas_call") == 2


@pytest.mark.gpu
def test_compiled_on_gpu_matches_ragged_dot():
    """Triton-compiled on the GPU at an expert shape, bf16, one group over BM rows, empty groups, a stack read in
    place at layer 1."""
    ks = jax.random.split(jax.random.key(7), 2)
    sizes = jnp.array([0, 3, BM + 40, 16, 0, 1, 64, 20], jnp.int32)
    x = jax.random.normal(ks[0], (int(sizes.sum()) + 7, 704), jnp.bfloat16)
    w = (jax.random.normal(ks[1], (2, 8, 704, 2816), jnp.float32) * 0.05).astype(jnp.bfloat16)
    got = grouped_matmul(x, w, sizes, jnp.int32(1)).astype(jnp.float32)
    want = grouped_matmul_reference(x, w[1], sizes).astype(jnp.float32)
    assert float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want)) < 1e-2
    assert not np.asarray(got[-7:]).any()


@pytest.mark.gpu
def test_compiled_on_gpu_gathers_rows_at_the_gate_up_shape():
    """Triton-compiled at DiffusionGemma's gate/up (K 2816, N 1408), bf16, 256 tokens' rows gathered by the kernel."""
    ks = jax.random.split(jax.random.key(8), 3)
    sizes = jnp.array([0, 3, BM + 40, 16, 0, 1, 64, 20], jnp.int32)
    m = int(sizes.sum()) + 7
    x = jax.random.normal(ks[0], (256, 2816), jnp.bfloat16)
    rows = jax.random.randint(ks[1], (m,), 0, 256, jnp.int32)
    w = (jax.random.normal(ks[2], (2, 8, 2816, 1408), jnp.float32) * 0.05).astype(jnp.bfloat16)
    got = grouped_matmul(x, w, sizes, jnp.int32(1), rows=rows).astype(jnp.float32)
    want = grouped_matmul_reference(jnp.take(x, rows, axis=0), w[1], sizes).astype(jnp.float32)
    assert float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want)) < 1e-2
    assert not np.asarray(got[-7:]).any()


def test_a_new_table_takes_effect_after_clearing_the_caches():
    """benchmarks/diffusion_gemma_generate.py --gemm-sweep: set_tuned replaces the table; traces made before keep
    their tiles until the caches are cleared (the benchmark clears all; here only the kernel's, so the session's
    other compiled functions stay warm)."""
    import re

    from orl_jax_kernels.small_m_gemm import kernel as small_m

    x, w, sizes = jnp.ones((16, 128)), jnp.ones((4, 128, 256)), jnp.array([4, 4, 4, 4])
    grid = lambda: re.findall(r"grid=\(\d+, \d+\)", str(jax.make_jaxpr(  # noqa: E731
        lambda: grouped_matmul(x, w, sizes, interpret=True))()))
    saved = dict(small_m.TUNED)
    try:
        assert grid() == ["grid=(2, 4)"]  # 128-column tiles (column tiles, experts: COLUMNS_INNER)
        small_m.set_tuned([{"k": 128, "n": 256, "blocks": dict(bn=64, bk=64, splits=1, num_warps=4, num_stages=2)}])
        assert grid() == ["grid=(2, 4)"]  # the cached trace
        grouped_matmul.clear_cache()
        assert grid() == ["grid=(4, 4)"]
    finally:
        small_m.set_tuned([])
        small_m.TUNED.update(saved)
        grouped_matmul.clear_cache()
