"""The split-K GEMM with in-kernel reduction against x @ w: interpret mode on CPU (splits dividing K's chunks evenly
and not, stacked and single weights, several row tiles), Triton IR verified at the canvas shapes, the table lookup
StackedWeight uses, and the compiled kernel on a GPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from triton_ir import verified_triton_modules

from orl_jax_kernels.splitk_gemm import kernel
from orl_jax_kernels.splitk_gemm.kernel import SplitBlocks, splitk_matmul, supported, table_blocks


@pytest.mark.parametrize("blocks", [SplitBlocks(bm=64, bn=128, bk=64, splits=3),  # 5 chunks over 3 splits
                                    SplitBlocks(bm=128, bn=64, bk=32, splits=1),
                                    SplitBlocks(bm=64, bn=64, bk=64, splits=5)])
def test_matches_matmul_in_interpret_mode(blocks):
    ks = jax.random.split(jax.random.key(0), 2)
    m, k, n = 128, 320, 256
    x = jax.random.normal(ks[0], (m, k))
    w = jax.random.normal(ks[1], (3, k, n))
    want = np.asarray(x @ w[2])
    np.testing.assert_allclose(np.asarray(splitk_matmul(x, w, jnp.int32(2), blocks, interpret=True)), want,
                               rtol=1e-5, atol=2e-4)
    np.testing.assert_allclose(np.asarray(splitk_matmul(x, w[2], None, blocks, interpret=True)), want,
                               rtol=1e-5, atol=2e-4)
    # the check can fail: another layer's weight gives another product
    other = np.asarray(splitk_matmul(x, w, jnp.int32(0), blocks, interpret=True))
    assert np.abs(other - want).max() > 1.0


def test_rejects():
    x, w = jnp.zeros((256, 512), jnp.bfloat16), jnp.zeros((512, 256), jnp.bfloat16)
    with pytest.raises(ValueError, match="not supported"):
        splitk_matmul(x[:200], w, None, SplitBlocks(bm=128))  # M not a multiple of bm
    with pytest.raises(ValueError, match="not supported"):
        splitk_matmul(x, w, None, SplitBlocks(bk=64, splits=9))  # more splits than chunks
    with pytest.raises(ValueError, match="does not match"):
        splitk_matmul(x, w.astype(jnp.float32), None, SplitBlocks())
    with pytest.raises(ValueError, match="layer"):
        splitk_matmul(x, w[None], None, SplitBlocks())  # a stack without its layer


def test_table_lookup(monkeypatch):
    monkeypatch.setattr(kernel, "TABLE", [{"k": 4096, "n": 2560, "blocks": {"bm": 256, "bn": 128, "splits": 6}}])
    assert table_blocks(256, 4096, 2560) == SplitBlocks(bm=256, bn=128, splits=6)
    assert table_blocks(32, 4096, 2560) is None  # block 32: not this kernel's range
    assert table_blocks(256, 9728, 2560) is None  # not listed: XLA
    assert supported(256, 4096, 2560, SplitBlocks(splits=6))


def test_canvas_pass_through_the_table_equals_xla(monkeypatch):
    """A cached canvas pass of 128 rows with o and down listed in the table (read in place from the layer stacks)
    gives the logits of the default path, and the kernel is really in it."""
    from orl_jax import params as P
    from orl_jax.config import preset
    from orl_jax.model import qwen3, qwendlm

    cfg = preset("tiny-qwendlm")
    d, f = cfg.hidden_size, cfg.intermediate_size
    blocks = {"bm": 128, "bn": 32, "bk": 16, "splits": 3}
    monkeypatch.setattr(kernel, "TABLE", [{"k": cfg.num_heads * cfg.head_dim, "n": d, "blocks": blocks},
                                          {"k": f, "n": d, "blocks": blocks}])
    params = P.init(qwen3.param_specs(cfg), jax.random.key(0))
    _, cache = qwendlm.prefill(params, cfg, jnp.ones((1, 8), jnp.int32), jnp.asarray([8]), 8 + 128)
    canvas = jax.random.randint(jax.random.key(1), (1, 128), 0, cfg.vocab_size, jnp.int32)
    want = qwendlm.decode(params, cfg, canvas, cache)
    streamed = cfg.replace(cached_matmul_impl="pallas")
    jaxpr = str(jax.make_jaxpr(lambda p: qwendlm.decode(p, streamed, canvas, cache))(params))
    assert jaxpr.count("pallas_call") == 2  # o and down (the loop body's two projections)
    got = qwendlm.decode(params, streamed, canvas, cache)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)


def test_diffusion_gemma_decoder_through_the_table_equals_xla(monkeypatch):
    """DiffusionGemma's sliding layers' o and dense down through the table (cached canvas of 128 rows): the same
    logits, the kernel in the program."""
    from orl_jax import params as P
    from orl_jax.config import DG_PRESETS
    from orl_jax.model import diffusion_gemma as dg

    cfg = DG_PRESETS["tiny-dg"]
    params = P.init(dg.param_specs(cfg), jax.random.key(0))
    _, cache = dg.prefill(params, cfg, jnp.ones((1, 8), jnp.int32), jnp.asarray([8]), 8 + 128)
    canvas = jax.random.randint(jax.random.key(1), (1, 128), 0, cfg.vocab_size, jnp.int32)
    want = dg.decode(params, cfg, canvas, cache)
    d, blocks = cfg.hidden_size, {"bm": 128, "bn": 16, "bk": 16, "splits": 2}
    monkeypatch.setattr(kernel, "TABLE", [{"k": cfg.num_heads * cfg.head_dim, "n": d, "blocks": blocks},
                                          {"k": cfg.intermediate_size, "n": d, "blocks": blocks}])
    jax.clear_caches()
    assert str(jax.make_jaxpr(lambda p: dg.decode(p, cfg, canvas, cache))(params)).count("pallas_call") >= 2
    got = dg.decode(params, cfg, canvas, cache)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)


def test_triton_ir_at_canvas_shapes():
    for k, n, blocks in ((4096, 2560, SplitBlocks(splits=6)), (9728, 2560, SplitBlocks(bm=128, bn=128, splits=3))):
        verified_triton_modules(lambda x, w, b=blocks: splitk_matmul(x, w, jnp.int32(1), b),
                                jax.ShapeDtypeStruct((256, k), jnp.bfloat16),
                                jax.ShapeDtypeStruct((2, k, n), jnp.bfloat16))


@pytest.mark.gpu
def test_compiled_on_gpu():
    ks = jax.random.split(jax.random.key(1), 2)
    x = jax.random.normal(ks[0], (256, 4096), jnp.bfloat16)
    w = jax.random.normal(ks[1], (2, 4096, 2560), jnp.bfloat16) * 0.02
    want = jnp.dot(x, w[1], preferred_element_type=jnp.float32)
    for blocks in (SplitBlocks(splits=6), SplitBlocks(bm=128, bn=64, splits=2, num_warps=4),
                   SplitBlocks(splits=1)):
        got = splitk_matmul(x, w, jnp.int32(1), blocks).astype(jnp.float32)
        rel = float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))
        assert rel < 5e-3, (blocks, rel)
        again = splitk_matmul(x, w, jnp.int32(1), blocks)  # the last program's fixed order: the same bits
        assert bool(jnp.all(again == got.astype(jnp.bfloat16))), blocks
