"""The split-K small-M GEMM kernel against its jnp reference: interpret mode on CPU, compiled on a GPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from triton_ir import verified_triton_modules

from orl_jax.model.streamed import gemm_dims
from orl_jax_kernels.small_m_gemm.kernel import Blocks, batched_small_m_matmul, small_m_matmul, supported
from orl_jax_kernels.small_m_gemm.reference import matmul_reference

CASES = [(32, 512, 256, Blocks(bn=128, bk=128, splits=2)), (5, 768, 384, Blocks(bn=128, bk=256, splits=4)),
         (64, 256, 128, Blocks(bn=64, bk=128, splits=8)), (1, 384, 128, Blocks(bn=128, bk=128, splits=3))]


@pytest.mark.parametrize("m,k,n,blocks", CASES)
def test_matches_reference_in_interpret_mode(m, k, n, blocks):
    kx, kw = jax.random.split(jax.random.key(m * 7 + k))
    x = jax.random.normal(kx, (m, k), jnp.float32)
    w = jax.random.normal(kw, (k, n), jnp.float32)
    out = small_m_matmul(x, w, None, blocks, interpret=True)
    ref = matmul_reference(x, w)
    assert out.shape == (m, n)
    rel = float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))
    assert rel < 1e-5, rel


def test_stacked_weight_is_read_at_its_layer():
    kx, kw = jax.random.split(jax.random.key(3))
    x = jax.random.normal(kx, (32, 256), jnp.float32)
    w = jax.random.normal(kw, (3, 256, 256), jnp.float32)
    blocks = Blocks(bn=128, bk=128, splits=2)
    for layer in range(3):
        out = small_m_matmul(x, w, jnp.int32(layer), blocks, interpret=True)
        rel = float(jnp.linalg.norm(out - matmul_reference(x, w[layer])) / jnp.linalg.norm(out))
        assert rel < 1e-5, (layer, rel)
    with pytest.raises(ValueError, match="needs `layer`"):
        small_m_matmul(x, w, None, blocks, interpret=True)


def test_batched_groups_read_their_own_weight_and_skip_empty_ones():
    ks = jax.random.split(jax.random.key(5), 2)
    x = jax.random.normal(ks[0], (3, 24, 256), jnp.float32)  # 3 groups of 24 rows
    w = jax.random.normal(ks[1], (2, 3, 256, 128), jnp.float32)  # a stack of 2 layers of 3 group weights
    rows = jnp.array([24, 0, 5])
    out = batched_small_m_matmul(x, w, jnp.int32(1), rows, Blocks(bn=128, bk=128, splits=2), interpret=True)
    want = jnp.einsum("emk,ekn->emn", x, w[1]) * (rows > 0)[:, None, None]
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-5, atol=1e-4)


def test_gemm_dims_of_the_model_specs():
    assert gemm_dims("bld,dkth->blkth", (1, 32, 2560), (2560, 8, 6, 128)) == (1, 32, 2560, 6144, (1, 32, 8, 6, 128))
    assert gemm_dims("blnh,nhd->bld", (1, 32, 32, 128), (32, 128, 2560)) == (1, 32, 4096, 2560, (1, 32, 2560))
    assert gemm_dims("bld,dtf->bltf", (1, 32, 2560), (2560, 2, 9728)) == (1, 32, 2560, 19456, (1, 32, 2, 9728))
    assert gemm_dims("ecd,edf->ecf", (128, 64, 2816), (128, 2816, 1408)) == (128, 64, 2816, 1408, (128, 64, 1408))
    assert gemm_dims("bld,vd->blv", (1, 32, 64), (100, 64)) is None  # contraction last in w: not a plain GEMM
    assert gemm_dims("td,edf->tef", (16, 64), (4, 64, 32)) is None  # every token through every expert


def test_generate_with_the_kernel_equals_the_default():
    """Every projection of the cached passes through the kernel (layer read in place from the stack)."""
    from orl_jax import params as P
    from orl_jax.config import preset
    from orl_jax.decode.engine import generate
    from orl_jax.decode.samplers import MaskSampler
    from orl_jax.model import qwen3

    cfg = preset("tiny-qwendlm").replace(block_length=16, hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=32,
                                         intermediate_size=384, noise="mask", mask_token_id=3)
    params = P.init(qwen3.param_specs(cfg), jax.random.key(0))
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12]]
    kw = dict(key=jax.random.key(1), max_new_tokens=32, sampler=MaskSampler(mask_token_id=3, threshold=0.5),
              eos_token_id=(), pad_token_id=0)
    want = generate(params, cfg, prompts, **kw)
    streamed = cfg.replace(cached_matmul_impl="pallas")
    jaxpr = str(jax.make_jaxpr(lambda p: generate(p, streamed, prompts, **kw).tokens)(params))
    assert jaxpr.count("pallas_call") >= 4  # the 4 projections of the cached layer body
    got = generate(params, streamed, prompts, **kw)
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))


def test_pipeline_depth_fits_shared_memory():
    from orl_jax_kernels.small_m_gemm.kernel import pipeline_stages

    assert pipeline_stages(Blocks(bn=64, bk=64, num_stages=4), 32) == 4
    assert pipeline_stages(Blocks(bn=128, bk=256, num_stages=4), 32) == 3  # 4 stages: 245760 B, over the limit


def test_rejects_unsupported_shapes():
    assert not supported(128, 512, 256)
    with pytest.raises(ValueError, match="not supported"):
        small_m_matmul(jnp.ones((8, 100)), jnp.ones((100, 128)), None, Blocks(), interpret=True)


@pytest.mark.gpu
def test_compiled_on_gpu_bf16():
    x = jax.random.normal(jax.random.key(0), (32, 2560), jnp.bfloat16)
    w = jax.random.normal(jax.random.key(1), (2560, 6144), jnp.bfloat16) * 0.02
    out = small_m_matmul(x, w, None, Blocks(bn=128, bk=256, splits=4)).astype(jnp.float32)
    ref = matmul_reference(x.astype(jnp.float32), w.astype(jnp.float32), jnp.float32)
    assert float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref)) < 1e-2
    assert np.all(np.isfinite(np.asarray(out)))
    # the expert form: a layer of a [L, E, K, N] stack, 64 rows per group, one group without rows
    xs = jax.random.normal(jax.random.key(2), (8, 64, 2816), jnp.bfloat16)
    ws = jax.random.normal(jax.random.key(3), (3, 8, 2816, 1408), jnp.bfloat16) * 0.02
    rows = jnp.array([64, 3, 0, 64, 1, 64, 64, 10])
    got = batched_small_m_matmul(xs, ws, jnp.int32(2), rows).astype(jnp.float32)
    want = jnp.einsum("emk,ekn->emn", xs.astype(jnp.float32), ws[2].astype(jnp.float32))
    want = want * (rows > 0)[:, None, None]
    assert float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want)) < 1e-2


@pytest.mark.parametrize("stacked", [False, True])
def test_kernel_lowers_to_verified_triton_on_any_machine(stacked):
    """Pallas -> Triton IR at the Qwen3-4B gate/up shape (cross-platform export, MLIR verifier, no GPU needed)."""
    sd = jax.ShapeDtypeStruct
    w = sd((36, 2560, 19456) if stacked else (2560, 19456), jnp.bfloat16)
    layer = sd((), jnp.int32) if stacked else None
    verified_triton_modules(lambda x, w, i: small_m_matmul(x, w, i, Blocks(bn=128, bk=128, splits=2)),
                            sd((32, 2560), jnp.bfloat16), w, layer)


def test_tuned_table_picks_blocks_or_declines(tmp_path, monkeypatch):
    import json

    from orl_jax_kernels.small_m_gemm import kernel

    monkeypatch.setattr(kernel, "TUNED", {})
    path = tmp_path / "t.json"
    path.write_text(json.dumps([{"k": 256, "n": 512, "blocks": {"bn": 64, "bk": 64, "splits": 2, "num_warps": 4,
                                                                 "num_stages": 3}},
                                {"k": 512, "n": 256, "blocks": None}]))
    kernel.load_tuned(path)
    assert kernel.blocks_for(256, 512) == Blocks(64, 64, 2, 4, 3)
    assert supported(32, 256, 512) and not supported(32, 512, 256)  # None: XLA was faster there
    assert kernel.blocks_for(1024, 1024) == Blocks()


def test_fallback_multiplies_the_scan_slice_not_a_slice_of_the_stack():
    """Passes the kernel does not take (here 96 rows > 64) multiply the weight as the layer scan delivers it, which
    XLA reads in place; indexing the stack by a traced layer number would be a dynamic slice, i.e. a copy."""
    from orl_jax import params as P
    from orl_jax.config import preset
    from orl_jax.model import qwen3, qwendlm

    cfg = preset("tiny-qwendlm").replace(cached_matmul_impl="pallas")
    params = P.init(qwen3.param_specs(cfg), jax.random.key(0))
    _, cache = qwendlm.prefill(params, cfg, jnp.ones((1, 8), jnp.int32), jnp.asarray([8]), 8 + 96)
    jaxpr = jax.make_jaxpr(lambda p: qwendlm.decode(p, cfg, jnp.ones((1, 96), jnp.int32), cache))(params)
    stacks = {a.shape for name, a in params["layers"].items() if name in qwen3.MATRICES}

    def sliced_operands(jx):
        for eqn in jx.eqns:
            if eqn.primitive.name in ("dynamic_slice", "gather", "slice"):
                yield eqn.invars[0].aval.shape
            for p in eqn.params.values():
                if hasattr(p, "jaxpr"):
                    yield from sliced_operands(p.jaxpr)

    assert "pallas_call" not in str(jaxpr)  # every projection fell back
    assert not stacks & set(sliced_operands(jaxpr.jaxpr))


def test_many_groups_run_unsplit_and_write_the_output_dtype(monkeypatch):
    """Enough groups x column tiles fill the chip without split-K: no float32 partials, the kernel writes bf16."""
    from orl_jax_kernels.small_m_gemm import kernel

    monkeypatch.setattr(kernel, "TUNED", {})
    assert kernel.blocks_for(704, 2816, groups=128).splits == 1  # DiffusionGemma's experts (down)
    assert kernel.blocks_for(2560, 6144).splits == Blocks().splits  # one dense weight: split-K
    ks = jax.random.split(jax.random.key(6), 2)
    x = jax.random.normal(ks[0], (4, 16, 256), jnp.bfloat16)
    w = jax.random.normal(ks[1], (4, 256, 128), jnp.bfloat16)
    rows = jnp.array([16, 0, 3, 16])
    f = lambda x, w: batched_small_m_matmul(x, w, None, rows, Blocks(bn=128, bk=64, splits=1),  # noqa: E731
                                            interpret=True)
    out = f(x, w)
    want = jnp.einsum("emk,ekn->emn", x, w, preferred_element_type=jnp.float32) * (rows > 0)[:, None, None]
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want.astype(jnp.bfloat16), np.float32),
                               rtol=2e-2, atol=5e-2)
    jaxpr = str(jax.make_jaxpr(f)(x, w))
    assert "reduce_sum" not in jaxpr and "f32[1,4" not in jaxpr  # no partial sums to add


def test_unsplit_expert_kernel_lowers_to_verified_triton():
    sd = jax.ShapeDtypeStruct
    verified_triton_modules(
        lambda x, w, i, r: batched_small_m_matmul(x, w, i, r, Blocks(bn=128, bk=64, splits=1)),
        sd((128, 64, 704), jnp.bfloat16), sd((5, 128, 704, 2816), jnp.bfloat16), sd((), jnp.int32),
        sd((128,), jnp.int32))
