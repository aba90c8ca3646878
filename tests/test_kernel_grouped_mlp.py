"""kernels/grouped_gemm/mlp.py (a whole expert MLP in one launch, work items by atomic ticket) against the two
grouped GEMMs it replaces: interpret mode on CPU, Triton IR verified at DiffusionGemma's shapes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from triton_ir import verified_triton_modules

from orl_jax.model.layers import ACTIVATIONS
from orl_jax_kernels.grouped_gemm.kernel import group_offsets, grouped_matmul
from orl_jax_kernels.grouped_gemm.mlp import grouped_mlp, tile_gated
from orl_jax_kernels.small_m_gemm.kernel import Blocks

ACT = ACTIVATIONS["gelu_tanh"]  # DiffusionGemma's experts' activation
GU, DN = Blocks(bn=128, bk=64, splits=1), Blocks(bn=64, bk=64, splits=1)


def _case(dtype, key=0):
    ks = jax.random.split(jax.random.key(key), 4)
    e, d, f, t, bm = 5, 128, 128, 23, 16
    sizes = jnp.array([3, 2 * bm + 5, 0, 11, 1])  # a group over several row tiles, an empty one
    offsets = group_offsets(sizes)
    x = jax.random.normal(ks[0], (t, d)).astype(dtype)
    rows = jax.random.randint(ks[1], (int(sizes.sum()) + 4,), 0, t, jnp.int32)  # 4 rows past the groups
    gu = (jax.random.normal(ks[2], (2, e, d, 2 * f)) * 0.1).astype(dtype)
    dn = (jax.random.normal(ks[3], (2, e, f, d)) * 0.1).astype(dtype)
    return sizes, offsets, x, rows, gu, dn, bm


@pytest.mark.parametrize("dtype,one_dot", [(jnp.float32, False), (jnp.bfloat16, False), (jnp.float32, True),
                                           (jnp.bfloat16, True)])
def test_matches_the_two_grouped_gemms_in_interpret_mode(dtype, one_dot):
    sizes, offsets, x, rows, gu, dn, bm = _case(dtype)
    layer = jnp.int32(1)
    tiles = tile_gated(gu, GU.bn // 2)
    assert tiles.shape == (2, 5, 2, 128, 128)  # tile j: gate columns [64 j, 64 j + 64), then the same up columns
    np.testing.assert_array_equal(np.asarray(tiles[1, 2, 1, :, 64:]), np.asarray(gu[1, 2, :, 128 + 64:]))
    got = grouped_mlp(x, rows, tiles, dn, offsets, layer, ACT, GU, DN, bm=bm, one_dot=one_dot, interpret=True)
    # the two grouped GEMMs, the activation between them on the rounded products
    g, u = jnp.split(grouped_matmul(x, gu, sizes, layer, GU, interpret=True, offsets=offsets, rows=rows, bm=bm), 2, -1)
    h = (ACT(g.astype(jnp.float32)) * u.astype(jnp.float32)).astype(dtype)
    want = grouped_matmul(h, dn, sizes, layer, DN, interpret=True, offsets=offsets, bm=bm)
    assert got.shape == (rows.shape[0], x.shape[1]) and got.dtype == dtype
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tol, atol=tol)
    assert not np.asarray(got[-4:], np.float32).any()
    # the check can fail: the other layer's weights give other rows
    other = grouped_mlp(x, rows, tile_gated(gu, GU.bn // 2), dn, offsets, jnp.int32(0), ACT, GU, DN, bm=bm,
                        interpret=True)
    assert np.abs(np.asarray(other, np.float32) - np.asarray(want, np.float32)).max() > 0.01


def test_row_scale_scales_each_rows_gate_up_products():
    """row_scale (moe.experts_mlp of folded norms): each row's gate/up products times its token's factor before the
    activation, as if x's rows had been scaled first (float32, interpret mode); a wrong length is refused."""
    sizes, offsets, x, rows, gu, dn, bm = _case(jnp.float32, key=2)
    tiles, layer = tile_gated(gu, GU.bn // 2), jnp.int32(1)
    r = jax.random.uniform(jax.random.key(9), (x.shape[0],), jnp.float32, 0.2, 5.0)
    run = lambda x, **kw: grouped_mlp(x, rows, tiles, dn, offsets, layer, ACT, GU, DN, bm=bm, one_dot=True,  # noqa
                                      interpret=True, **kw)
    got, want = run(x, row_scale=r), run(x * r[:, None])
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    assert np.abs(np.asarray(run(x)) - np.asarray(want)).max() > 0.01  # the scale matters
    with pytest.raises(ValueError, match="row_scale"):
        run(x, row_scale=r[1:])


def test_order_takes_the_experts_in_that_order_with_the_same_values():
    """order (moe.FUSED_HEAVY_FIRST): the work items in another expert order (interpret mode runs them in ticket
    order, so the group of several row tiles now runs first); each item's arithmetic is unchanged, so the values are
    equal; a wrong order is refused."""
    sizes, offsets, x, rows, gu, dn, bm = _case(jnp.bfloat16, key=3)
    tiles, layer = tile_gated(gu, GU.bn // 2), jnp.int32(0)
    run = lambda **kw: grouped_mlp(x, rows, tiles, dn, offsets, layer, ACT, GU, DN, bm=bm, one_dot=True,  # noqa
                                   interpret=True, **kw)
    order = jnp.argsort(-sizes, stable=True).astype(jnp.int32)
    assert int(order[0]) == 1  # the group over several row tiles
    np.testing.assert_array_equal(np.asarray(run(order=order), np.float32), np.asarray(run(), np.float32))
    with pytest.raises(ValueError, match="order"):
        run(order=order[1:])


def test_rejects_mismatched_inputs():
    sizes, offsets, x, rows, gu, dn, bm = _case(jnp.float32)
    tgu = tile_gated(gu, 64)
    with pytest.raises(ValueError, match="not a multiple"):
        tile_gated(gu, 48)
    with pytest.raises(ValueError, match="tile_gated stack"):
        grouped_mlp(x, rows, gu, dn, offsets, jnp.int32(0), ACT, GU, DN, interpret=True)
    with pytest.raises(ValueError, match="do not match"):
        grouped_mlp(x, rows, tgu, dn, offsets, jnp.int32(0), ACT, Blocks(bn=64, bk=64, splits=1), DN,
                    interpret=True)
    with pytest.raises(ValueError, match="offsets"):
        grouped_mlp(x, rows, tgu, dn, offsets[1:], jnp.int32(0), ACT, GU, DN, interpret=True)


@pytest.mark.parametrize("one_dot,scaled,ordered,tokens,bm,warps", [
    (False, False, False, 256, 64, 4), (True, False, False, 256, 64, 4), (True, True, True, 256, 64, 4),
    (True, True, True, 768, 128, 8)])  # the last: prefill_decode's rows with moe.FUSED_LONG_BM's tiles
def test_triton_ir_at_diffusion_gemma_shapes(one_dot, scaled, ordered, tokens, bm, warps):
    sd = jax.ShapeDtypeStruct
    verified_triton_modules(
        lambda x, r, gu, dn, o, i, s, order: grouped_mlp(
            x, r, gu, dn, o, i, ACT, GU, Blocks(bn=128, bk=64, splits=1), one_dot=one_dot,
            row_scale=s if scaled else None, order=order if ordered else None, bm=bm, num_warps=warps),
        sd((tokens, 2816), jnp.bfloat16), sd((8 * tokens,), jnp.int32), sd((25, 128, 11, 2816, 128), jnp.bfloat16),
        sd((25, 128, 704, 2816), jnp.bfloat16), sd((129,), jnp.int32), sd((), jnp.int32), sd((tokens,), jnp.float32),
        sd((128,), jnp.int32))


def test_moe_fused_path_equals_the_dense_path():
    """experts_mlp(impl="pallas") with gate/up in moe.fuse_gate_up's layout: one launch (plus the sort), the same
    values as every token through every expert; the layout refuses shapes the kernel does not tile, and any other
    impl."""
    from orl_jax.model import moe
    from orl_jax.model.streamed import StackedWeight

    ks = jax.random.split(jax.random.key(3), 4)
    t, d, e, f, k = 40, 128, 8, 64, 2
    x = jax.random.normal(ks[0], (t, d))
    gate_up, down = jax.random.normal(ks[1], (2, e, d, 2 * f)) * 0.1, jax.random.normal(ks[2], (2, e, f, d)) * 0.1
    experts = jnp.stack([jnp.zeros(t, jnp.int32), jnp.arange(t, dtype=jnp.int32) % (e - 1) + 1], axis=1)
    weights = jax.nn.softmax(jax.random.normal(ks[3], (t, k)), axis=-1)
    tiles = moe.fuse_gate_up(gate_up)
    assert moe.fused_stack(StackedWeight(tiles, 1)) and not moe.fused_stack(StackedWeight(gate_up, 1))

    def run(g, impl="pallas"):  # layer 1 of the stacks
        return moe.experts_mlp(x, weights, experts, StackedWeight(g, jnp.int32(1)), StackedWeight(down, jnp.int32(1)),
                               "gelu_tanh", impl)

    got = jax.jit(run)(tiles)
    want = moe.dense_experts_mlp(x, weights, experts, gate_up[1], down[1], "gelu_tanh")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    assert str(jax.make_jaxpr(run)(tiles)).count("pallas_call") == 2  # the sort, the whole MLP
    with pytest.raises(ValueError, match="takes impl 'pallas'"):
        run(tiles, "bucketed")
    with pytest.raises(ValueError, match="multiple of"):
        moe.fuse_gate_up(gate_up[..., :96])


@pytest.mark.parametrize("bm", [64, 16])
def test_moe_fused_path_with_narrower_tiles(bm, monkeypatch):
    """moe.FUSED_TILE (the layout's gate and up tile width) and moe.FUSED_DOWN_BN (down's columns per program) at half
    the defaults: the kernel takes its gate/up tiles from the stack, and the values stay the dense path's; also with
    moe.FUSED_BM = 16 rows per tile, where each expert's 20 rows take two tiles."""
    from orl_jax.model import moe
    from orl_jax.model.streamed import StackedWeight

    ks = jax.random.split(jax.random.key(4), 4)
    t, d, e, f, k = 40, 128, 4, 64, 2
    x = jax.random.normal(ks[0], (t, d))
    gate_up, down = jax.random.normal(ks[1], (1, e, d, 2 * f)) * 0.1, jax.random.normal(ks[2], (1, e, f, d)) * 0.1
    experts = jnp.stack([jnp.arange(t, dtype=jnp.int32) % e, (jnp.arange(t, dtype=jnp.int32) + 1) % e], axis=1)
    weights = jax.nn.softmax(jax.random.normal(ks[3], (t, k)), axis=-1)
    monkeypatch.setattr(moe, "FUSED_TILE", 32)
    monkeypatch.setattr(moe, "FUSED_DOWN_BN", 64)
    monkeypatch.setattr(moe, "FUSED_BM", bm)
    tiles = moe.fuse_gate_up(gate_up)
    assert tiles.shape == (1, e, f // 32, d, 64)
    gu, dn = moe.fused_blocks(tiles)
    assert (gu.bn, dn.bn) == (64, 64)
    run = lambda: moe.experts_mlp(x, weights, experts, StackedWeight(tiles, jnp.int32(0)),  # noqa: E731
                                  StackedWeight(down, jnp.int32(0)), "gelu_tanh", "pallas")
    want = moe.dense_experts_mlp(x, weights, experts, gate_up[0], down[0], "gelu_tanh")
    np.testing.assert_allclose(np.asarray(run()), np.asarray(want), rtol=1e-5, atol=1e-5)
    monkeypatch.setattr(moe, "FUSED_HEAVY_FIRST", True)
    monkeypatch.setattr(moe, "FUSED_LONG_ROWS", 20)  # 80 rows over 4 experts: a long pass, taken most rows first
    assert "sort" in str(jax.make_jaxpr(run)())
    np.testing.assert_allclose(np.asarray(run()), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_moe_fused_path_long_passes_take_their_own_tiles(monkeypatch):
    """moe.FUSED_LONG_BM / FUSED_LONG_WARPS: a pass with at least FUSED_LONG_ROWS rows per expert on average runs the
    kernel with those tiles (here 32 rows, where FUSED_BM = 16 splits each expert's 20 rows over two tiles), a
    shorter one with FUSED_BM / FUSED_WARPS; the values stay the dense path's either way."""
    import orl_jax_kernels.grouped_gemm.mlp as mlp
    from orl_jax.model import moe
    from orl_jax.model.streamed import StackedWeight

    ks = jax.random.split(jax.random.key(5), 4)
    t, d, e, f, k = 40, 128, 4, 64, 2  # 80 rows, 20 per expert
    x = jax.random.normal(ks[0], (t, d))
    gate_up, down = jax.random.normal(ks[1], (1, e, d, 2 * f)) * 0.1, jax.random.normal(ks[2], (1, e, f, d)) * 0.1
    experts = jnp.stack([jnp.arange(t, dtype=jnp.int32) % e, (jnp.arange(t, dtype=jnp.int32) + 1) % e], axis=1)
    weights = jax.nn.softmax(jax.random.normal(ks[3], (t, k)), axis=-1)
    tiles = moe.fuse_gate_up(gate_up)
    want = moe.dense_experts_mlp(x, weights, experts, gate_up[0], down[0], "gelu_tanh")
    seen, real = [], mlp.grouped_mlp
    monkeypatch.setattr(mlp, "grouped_mlp", lambda *a, **kw: seen.append((kw["bm"], kw["num_warps"])) or real(*a, **kw))
    monkeypatch.setattr(moe, "FUSED_BM", 16)
    monkeypatch.setattr(moe, "FUSED_LONG_BM", 32)
    monkeypatch.setattr(moe, "FUSED_LONG_WARPS", 8)
    for long_rows, tiles_used in ((20, (32, 8)), (21, (16, moe.FUSED_WARPS))):
        monkeypatch.setattr(moe, "FUSED_LONG_ROWS", long_rows)
        got = moe.experts_mlp(x, weights, experts, StackedWeight(tiles, jnp.int32(0)),
                              StackedWeight(down, jnp.int32(0)), "gelu_tanh", "pallas")
        assert seen.pop() == tiles_used
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_diffusion_gemma_decoder_with_fused_expert_params():
    """diffusion_gemma_inference.fused_expert_params: the decoder (moe_impl pallas, interpret mode) with both expert
    gate/up stacks in the fused layout gives the logits of the model's layout (fp32), with one pallas_call fewer per
    layer; and with the feed-forward norms folded into the fused stacks as well."""
    from orl_jax import params as P
    from orl_jax.diffusion_gemma_config import DG_PRESETS
    from orl_jax.model import diffusion_gemma as dg
    from orl_jax.model import diffusion_gemma_inference as dgi

    cfg = DG_PRESETS["tiny-dg"].replace(hidden_size=128, moe_intermediate_size=64, moe_impl="pallas")
    params = P.init(dg.param_specs(cfg), jax.random.key(0))
    prompt = jax.random.randint(jax.random.key(1), (1, 16), 0, 240)
    canvas = jax.random.randint(jax.random.key(2), (1, cfg.block_length), 0, 240)
    _, cache = dg.prefill(params, cfg, prompt, jnp.array([13]), 32)
    fused = dgi.fused_expert_params(params)
    assert fused["sliding"]["experts_gate_up"].ndim == 5 and fused["full"]["experts_down"] is params["full"][
        "experts_down"]
    want = dg.decode(params, cfg, canvas, cache)
    got = dg.decode(fused, cfg, canvas, cache)
    assert float(want.std()) > 0.01
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-4, rtol=1e-4)
    calls = [str(jax.make_jaxpr(lambda p: dg.decode(p, cfg, canvas, cache))(p)).count("pallas_call")
             for p in (params, fused)]
    assert calls[1] < calls[0]
    # the feed-forward norms folded into the fused stacks (the kernel scales its gate/up products per token)
    folded = dgi.fold_ffw_norms(fused)
    np.testing.assert_allclose(np.asarray(dg.decode(folded, cfg, canvas, cache)), np.asarray(want), atol=1e-4,
                               rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("one_dot,tile,down_bn,bm,bk,stages", [
    (False, 64, 128, 64, 64, 3), (True, 64, 128, 64, 64, 3), (True, 32, 64, 64, 64, 3), (True, 64, 128, 32, 32, 4),
    (True, 64, 128, 16, 64, 3)])
def test_compiled_on_gpu_at_the_26b_expert_shapes_every_layer(one_dot, tile, down_bn, bm, bk, stages, monkeypatch):
    """On a GPU at DiffusionGemma 26B's expert shapes (2048 rows sorted by kernels/expert_sort, a 5-layer stack: 64-bit
    offsets), the MoE's fused path equals its two-GEMM path at every layer of a loop over the stack (the tickets and
    counters start afresh in every call)."""
    from orl_jax.model import moe
    from orl_jax.model.streamed import StackedWeight

    monkeypatch.setattr(moe, "FUSED_ONE_DOT", one_dot)
    monkeypatch.setattr(moe, "FUSED_TILE", tile)
    monkeypatch.setattr(moe, "FUSED_DOWN_BN", down_bn)
    monkeypatch.setattr(moe, "FUSED_BM", bm)  # 16: experts with more than 16 of the 2048 rows take several tiles
    monkeypatch.setattr(moe, "FUSED_GU_BK", bk)
    monkeypatch.setattr(moe, "FUSED_DN_BK", bk)
    monkeypatch.setattr(moe, "FUSED_STAGES", stages)
    ks = jax.random.split(jax.random.key(11), 5)
    t, d, e, f, k, n_layers = 256, 2816, 128, 704, 8, 5  # gate/up 5.1 GB
    x = jax.random.normal(ks[0], (t, d), jnp.bfloat16)
    gate_up = jax.random.normal(ks[1], (n_layers, e, d, 2 * f), jnp.bfloat16) * 0.02
    down = jax.random.normal(ks[2], (n_layers, e, f, d), jnp.bfloat16) * 0.02
    experts = jax.lax.top_k(jax.random.normal(ks[3], (t, e)), k)[1].astype(jnp.int32)
    weights = jax.nn.softmax(jax.random.normal(ks[4], (t, k)), axis=-1)
    tiles = moe.fuse_gate_up(gate_up)

    def every_layer(g, down, x, weights, experts):  # arrays as arguments: a closure would embed them as constants
        return jax.lax.map(lambda i: moe.experts_mlp(x, weights, experts, StackedWeight(g, i), StackedWeight(down, i),
                                                     "gelu_tanh", "pallas", distinct=True),
                           jnp.arange(n_layers, dtype=jnp.int32))

    run = jax.jit(every_layer)
    want = np.asarray(run(gate_up, down, x, weights, experts), np.float32)
    for _ in range(2):  # twice: a counter left over from a call would show
        got = np.asarray(run(tiles, down, x, weights, experts), np.float32)
        for i in range(n_layers):
            err = np.linalg.norm(got[i] - want[i]) / np.linalg.norm(want[i])
            assert err < 1e-2, (i, err)


@pytest.mark.gpu
def test_row_scale_and_order_on_gpu_at_the_26b_expert_shapes():
    """The fused path with row_scale (folded feed-forward norms) against the same kernel on x scaled first, at a 26B
    layer's shapes (2048 sorted rows); both bf16, so within a rounding of the products. With the experts taken most
    rows first (order), exactly the same values."""
    from orl_jax.model import moe
    from orl_jax.model.streamed import StackedWeight

    ks = jax.random.split(jax.random.key(12), 6)
    t, d, e, f, k = 256, 2816, 128, 704, 8
    x = jax.random.normal(ks[0], (t, d), jnp.bfloat16) * 30  # an unnormed residual stream
    r = jax.lax.rsqrt(jnp.mean(jnp.square(x.astype(jnp.float32)), axis=-1) + 1e-6)
    tiles = moe.fuse_gate_up(jax.random.normal(ks[1], (1, e, d, 2 * f), jnp.bfloat16) * 0.02)
    down = jax.random.normal(ks[2], (1, e, f, d), jnp.bfloat16) * 0.02
    experts = jax.lax.top_k(jax.random.normal(ks[3], (t, e)), k)[1].astype(jnp.int32)
    weights = jax.nn.softmax(jax.random.normal(ks[4], (t, k)), axis=-1)
    # arrays as arguments: a closure would embed them as constants
    run = jax.jit(lambda x, rs, g, dn, w, ex: moe.experts_mlp(x, w, ex, StackedWeight(g, jnp.int32(0)),
                                                              StackedWeight(dn, jnp.int32(0)), "gelu_tanh", "pallas",
                                                              distinct=True, row_scale=rs))
    got = np.asarray(run(x, r, tiles, down, weights, experts), np.float32)
    xs = (x.astype(jnp.float32) * r[:, None]).astype(jnp.bfloat16)
    want = np.asarray(run(xs, None, tiles, down, weights, experts), np.float32)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-2
    # the experts most rows first (moe.FUSED_HEAVY_FIRST): each work item's arithmetic is unchanged
    from unittest import mock

    with mock.patch.object(moe, "FUSED_HEAVY_FIRST", True), mock.patch.object(moe, "FUSED_LONG_ROWS", 1):
        jax.clear_caches()
        ordered = np.asarray(run(x, r, tiles, down, weights, experts), np.float32)
    jax.clear_caches()
    np.testing.assert_array_equal(ordered, got)


@pytest.mark.gpu
def test_long_pass_tiles_on_gpu_at_prefill_decode_shapes(monkeypatch):
    """moe.FUSED_LONG_BM = 128 with 8 warps at prefill_decode's 768 tokens (6144 sorted rows, 48 per expert on
    average: many experts past 64 rows; the default) against 64-row tiles (FUSED_LONG_BM None), both bf16: within a
    rounding."""
    from orl_jax.model import moe
    from orl_jax.model.streamed import StackedWeight

    ks = jax.random.split(jax.random.key(13), 5)
    t, d, e, f, k = 768, 2816, 128, 704, 8
    x = jax.random.normal(ks[0], (t, d), jnp.bfloat16)
    tiles = moe.fuse_gate_up(jax.random.normal(ks[1], (1, e, d, 2 * f), jnp.bfloat16) * 0.02)
    down = jax.random.normal(ks[2], (1, e, f, d), jnp.bfloat16) * 0.02
    experts = jax.lax.top_k(jax.random.normal(ks[3], (t, e)), k)[1].astype(jnp.int32)
    weights = jax.nn.softmax(jax.random.normal(ks[4], (t, k)), axis=-1)
    run = lambda: np.asarray(jax.jit(  # noqa: E731 (arrays as arguments: a closure would embed them as constants)
        lambda x, g, dn, w, ex: moe.experts_mlp(x, w, ex, StackedWeight(g, jnp.int32(0)),
                                                StackedWeight(dn, jnp.int32(0)), "gelu_tanh", "pallas",
                                                distinct=True))(x, tiles, down, weights, experts), np.float32)
    monkeypatch.setattr(moe, "FUSED_LONG_BM", None)
    want = run()
    monkeypatch.setattr(moe, "FUSED_LONG_BM", 128)
    jax.clear_caches()
    got = run()
    jax.clear_caches()
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-2


def test_inference_params_fuse_only_where_the_kernel_runs(monkeypatch):
    """diffusion_gemma_inference.inference_params (the CLI's generate): fused where moe_impl resolves to pallas and
    the shapes fit; unchanged on the other impls (a CPU's "auto") and for experts the kernel does not tile (the tiny
    preset).
    With the norm folds on, a bf16 model's norms go into its matrices (the fused stacks folded in place)."""
    from orl_jax import params as P
    from orl_jax.diffusion_gemma_config import DG_PRESETS
    from orl_jax.model import diffusion_gemma as dg
    from orl_jax.model import diffusion_gemma_inference as dgi

    fits = DG_PRESETS["tiny-dg"].replace(hidden_size=128, moe_intermediate_size=64)
    params = P.init(dg.param_specs(fits), jax.random.key(0))
    assert dgi.inference_params(params, fits.replace(moe_impl="pallas"))["sliding"]["experts_gate_up"].ndim == 5
    monkeypatch.setattr(dgi, "FOLD_ATTENTION_NORMS", True)
    monkeypatch.setattr(dgi, "FOLD_FFW_NORMS", True)
    low = fits.replace(moe_impl="pallas", dtype="bfloat16")
    bf16 = jax.tree.map(lambda a: a.astype(jnp.bfloat16), params)
    folded = dgi.inference_params(bf16, low)
    assert folded["sliding"]["experts_gate_up"].ndim == 5 and bf16["sliding"]["experts_gate_up"].ndim == 4
    assert not {"attn_norm", "mlp_norm", "router_scale", "moe_norm"} & set(folded["full"])
    assert dgi.inference_params(params, fits.replace(moe_impl="pallas"))["full"].keys() >= {"attn_norm", "moe_norm"}
    monkeypatch.setattr(dgi, "FOLD_ATTENTION_NORMS", False)
    monkeypatch.setattr(dgi, "FOLD_FFW_NORMS", False)
    assert dgi.inference_params(params, fits.replace(moe_impl="bucketed")) is params
    assert dgi.inference_params(params, fits) is params  # "auto" on a CPU: not the kernel
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array(jax.devices()[:2]), ("tensor",))  # experts over two devices (conftest makes 4 CPU ones)
    split = jax.device_put(params["sliding"]["experts_gate_up"], NamedSharding(mesh, PartitionSpec(None, "tensor")))
    sharded = params | {"sliding": params["sliding"] | {"experts_gate_up": split}}
    assert dgi.inference_params(sharded, fits.replace(moe_impl="pallas")) is sharded
    tiny = DG_PRESETS["tiny-dg"].replace(moe_impl="pallas")
    small = P.init(dg.param_specs(tiny), jax.random.key(0))
    assert dgi.inference_params(small, tiny) is small
