"""The fused cached-pass attention kernel against orl_jax's attention: interpret mode on CPU, compiled on a GPU;
and generate() with cached_attention_impl="pallas" against the default, token for token."""

import dataclasses

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest
from triton_ir import verified_triton_modules

from orl_jax.model.attention import attention, block_segments, cache_mask, full_segments, self_mask, window_mask
from orl_jax_kernels.decode_attention.kernel import (
    Blocks,
    blocks_for,
    cache_extent,
    cached_attention,
    masked_attention,
    supported,
)


def _inputs(key, b=2, l=32, s=96, n=4, kv=2, h=32, dtype=jnp.float32):
    ks = jax.random.split(key, 5)
    q = jax.random.normal(ks[0], (b, l, n, h), dtype)
    kc, vc = (jax.random.normal(k, (b, s, kv, h), dtype) for k in ks[1:3])
    kself, vself = (jax.random.normal(k, (b, l, kv, h), dtype) for k in ks[3:5])
    start, length = jnp.array([0, 40]), 70  # row 1: left padding; slots >= 70: not filled yet
    cm = cache_mask(start, length, s, l)
    valid = jnp.arange(l)[None] < jnp.array([[l], [l - 8]])  # row 1: the last 8 canvas keys invalid
    sm = self_mask(full_segments(b, l), valid)
    sm = sm.at[1, 3].set(False)  # a query row with no visible self key ...
    cm = cm.at[1, 3].set(False)  # ... and no cache key: the reference averages all values
    return q, kc, vc, cm, kself, vself, sm


def _assert_close_but_the_blind_row(got, want, tol):
    """Every query row but [1, 3] of _inputs, which sees no key at all: there the kernel averages the values it
    streams for the tile, the reference every value (the kernel's docstring). That row must be finite."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    seen = np.ones(want.shape[:2], bool)
    seen[1, 3] = False
    np.testing.assert_allclose(got[seen], want[seen], atol=tol, rtol=tol)
    assert np.isfinite(got[1, 3]).all()


GROUPED = Blocks(bl=16, bs=32, chunks_per_split=1, group_heads=True)


@pytest.mark.parametrize("blocks", [Blocks(), Blocks(bl=16, bs=32), Blocks(bl=16, bs=16, chunks_per_split=1),
                                    Blocks(group_heads=True), GROUPED,
                                    Blocks(bl=16, bs=32, chunks_per_split=4),  # the whole cache in one split
                                    dataclasses.replace(GROUPED, chunks_per_split=4),
                                    # the visible keys evenly over the splits: 2 (a split of cache and own keys),
                                    # 4 of one chunk each, one split holding everything
                                    Blocks(bl=16, bs=32, chunks_per_split=2, balanced=True),
                                    dataclasses.replace(GROUPED, balanced=True),
                                    Blocks(bl=16, bs=32, chunks_per_split=4, balanced=True)])
def test_kernel_equals_reference_in_interpret_mode(blocks):
    q, kc, vc, cm, kself, vself, sm = _inputs(jax.random.key(0))
    want = attention(q, [(kc, vc, cm), (kself, vself, sm)])
    got = cached_attention(q, kc, vc, cm, kself, vself, sm, scale=q.shape[-1] ** -0.5, blocks=blocks, interpret=True)
    _assert_close_but_the_blind_row(got, want, 2e-5)
    # the check can fail: a mask the kernel ignored would show
    bad = cached_attention(q, kc, vc, cm.at[0, :, 5].set(False), kself, vself, sm, scale=q.shape[-1] ** -0.5,
                           blocks=blocks, interpret=True)
    assert float(jnp.abs(bad - want).max()) > 1e-3


@pytest.mark.parametrize("in_input_dtype", [False, True])
@pytest.mark.parametrize("blocks", [Blocks(bl=16, bs=16, chunks_per_split=1), GROUPED,
                                    Blocks(bl=16, bs=16, chunks_per_split=4, balanced=True)])
def test_bf16_splits_in_either_dtype_equal_the_reference(monkeypatch, blocks, in_input_dtype):
    """bf16 queries over several key splits, their partial outputs kept in float32 or normalized in bf16
    (SPLITS_IN_INPUT_DTYPE): within bf16's rounding of the reference. The cache is filled to slot 30, so the balanced
    blocks' 4 visible chunks fall on 3 splits of 2: the last split streams no key (its normalized output must not
    be 0 / 0)."""
    from orl_jax_kernels.decode_attention import kernel

    monkeypatch.setattr(kernel, "SPLITS_IN_INPUT_DTYPE", in_input_dtype)
    jax.clear_caches()
    q, kc, vc, cm, kself, vself, sm = _inputs(jax.random.key(2), s=128, dtype=jnp.bfloat16)
    cm = cache_mask(jnp.array([0, 10]), 30, kc.shape[1], q.shape[1]).at[1, 3].set(False)
    f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
    want = attention(f32(q), [(f32(kc), f32(vc), cm), (f32(kself), f32(vself), sm)])
    got = cached_attention(q, kc, vc, cm, kself, vself, sm, scale=q.shape[-1] ** -0.5, blocks=blocks, interpret=True)
    assert got.dtype == jnp.bfloat16
    _assert_close_but_the_blind_row(got, want, 3e-2)
    err = np.abs(np.asarray(got, np.float32) - np.asarray(want))
    err[1, 3] = 0  # the blind row (see _assert_close_but_the_blind_row)
    assert err.mean() < 4e-3, err.mean()
    jax.clear_caches()


@pytest.mark.parametrize("blocks", [Blocks(bl=16, bs=32, chunks_per_split=1), Blocks(bl=16, bs=32, chunks_per_split=4),
                                    dataclasses.replace(GROUPED, chunks_per_split=1),
                                    Blocks(bl=16, bs=32, chunks_per_split=1, balanced=True)])
def test_cache_chunks_past_the_visible_slots_are_not_read(blocks):
    """Slots 64.. are past every query's cache (a generation has not filled them): NaN there changes nothing."""
    q, kc, vc, _, kself, vself, sm = _inputs(jax.random.key(1))
    cm = cache_mask(jnp.array([0, 40]), 64, kc.shape[1], q.shape[1])
    want = attention(q, [(kc.at[:, 64:].set(0.0), vc.at[:, 64:].set(0.0), cm), (kself, vself, sm)])
    got = cached_attention(q, kc.at[:, 64:].set(jnp.nan), vc.at[:, 64:].set(jnp.nan), cm, kself, vself, sm,
                           scale=q.shape[-1] ** -0.5, blocks=blocks, interpret=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("blocks", [Blocks(bl=16, bs=16, chunks_per_split=1),
                                    Blocks(bl=16, bs=16, chunks_per_split=2, balanced=True),
                                    dataclasses.replace(GROUPED, bs=16)])
def test_each_query_tile_streams_to_its_furthest_query(blocks):
    """Queries of one tile see different cache extents (query i: slots < 8 + 2 i): the tile streams up to its
    furthest query's, given or computed, and NaN past it (from the next 16-slot chunk on) changes nothing."""
    q, kc, vc, _, kself, vself, sm = _inputs(jax.random.key(3))
    b, l, s = q.shape[0], q.shape[1], kc.shape[1]
    cm = jnp.arange(s)[None, None, :] < (8 + 2 * jnp.arange(l))[None, :, None]
    cm = jnp.broadcast_to(cm, (b, l, s))  # the furthest query (31) sees slots < 70
    want = attention(q, [(kc.at[:, 80:].set(0.0), vc.at[:, 80:].set(0.0), cm), (kself, vself, sm)])
    extent = cache_extent(cm.astype(jnp.int8))
    np.testing.assert_array_equal(np.asarray(extent), np.broadcast_to(8 + 2 * np.arange(l), (b, l)))
    nan_k, nan_v = kc.at[:, 80:].set(jnp.nan), vc.at[:, 80:].set(jnp.nan)
    for given in (None, extent):
        got = cached_attention(q, nan_k, nan_v, cm, kself, vself, sm, scale=q.shape[-1] ** -0.5, blocks=blocks,
                               interpret=True, extent=given)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)
    with pytest.raises(ValueError, match="extent"):
        cached_attention(q, kc, vc, cm, kself, vself, sm, scale=1.0, blocks=blocks, interpret=True,
                         extent=extent[:, :8])


def _fused_pass_inputs(key, b=2, p=48, c=16, n=4, kv=2, h=32, window=40):
    """q, k, v and the visibility of a cache-free fused pass (diffusion_gemma_vis.fused_vis): p prompt tokens causal
    within a window, then a canvas of c seeing every valid prompt token and itself; row 1 (if b > 1) left-padded by
    10."""
    ks = jax.random.split(key, 3)
    q = jax.random.normal(ks[0], (b, p + c, n, h))
    k, v = (jax.random.normal(x, (b, p + c, kv, h)) for x in ks[1:])
    seg = block_segments(b, p + c, p, c)
    mask = self_mask(seg, jnp.arange(p + c)[None] >= jnp.array([[0], [10]])[:b]) & window_mask(seg, jnp.arange(p + c),
                                                                                            window)
    return q, k, v, mask


@pytest.mark.parametrize("blocks", [Blocks(bl=16, bs=16, chunks_per_split=1), Blocks(bl=32, bs=16, chunks_per_split=8),
                                    Blocks(bl=16, bs=16, chunks_per_split=2, balanced=True),
                                    dataclasses.replace(GROUPED, bs=16, balanced=True),
                                    Blocks(bl=16, bs=32, chunks_per_split=4)])  # one split: no partials, no merge
def test_masked_attention_equals_the_reference_in_interpret_mode(blocks):
    """The cache-free passes' kernel (the keys one part: fixed or balanced splits, grouped heads, one split) under a
    fused pass's visibility; the check fails on a mask the kernel ignored."""
    q, k, v, mask = _fused_pass_inputs(jax.random.key(4))
    want = attention(q, [(k, v, mask)])
    got = masked_attention(q, k, v, mask, scale=q.shape[-1] ** -0.5, blocks=blocks, interpret=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)
    bad = masked_attention(q, k, v, mask.at[:, :, 40:48].set(False), scale=q.shape[-1] ** -0.5, blocks=blocks,
                           interpret=True)
    assert float(jnp.abs(bad - want).max()) > 1e-3


@pytest.mark.parametrize("blocks", [Blocks(bl=16, bs=16, chunks_per_split=1),
                                    Blocks(bl=16, bs=16, chunks_per_split=2, balanced=True)])
def test_masked_attention_skips_keys_past_a_tiles_reach(blocks):
    """The prompt's query tiles stream keys up to their furthest visible one: NaN keys and values in the canvas
    (slots 48..) leave every prompt row exact, while the canvas rows, which see them, turn NaN."""
    q, k, v, mask = _fused_pass_inputs(jax.random.key(5))
    want = attention(q, [(k, v, mask)])
    got = masked_attention(q, k.at[:, 48:].set(jnp.nan), v.at[:, 48:].set(jnp.nan), mask, scale=q.shape[-1] ** -0.5,
                           blocks=blocks, interpret=True)
    np.testing.assert_allclose(np.asarray(got[:, :48]), np.asarray(want[:, :48]), atol=2e-5, rtol=2e-5)
    assert np.isnan(np.asarray(got[:, 48:])).all()


@pytest.mark.parametrize("blocks", [None, Blocks(bl=64, bs=64, chunks_per_split=2),
                                    Blocks(bl=64, bs=64, chunks_per_split=2, group_heads=True, balanced=True)],
                         ids=["library", "fixed_splits", "grouped_balanced"])
@pytest.mark.parametrize("p", [512, 0], ids=["prefill_decode", "prefill"])
def test_masked_attention_lowers_to_verified_triton_at_the_26b(p, blocks):
    """DiffusionGemma 26B's sliding layers in its cache-free passes: prefill_decode (prompt 512 + canvas 256) and
    the prefill alone (512), bf16: the blocks the library picks, and fixed splits (no own keys: under jax 0.11 a
    constant `~False` there reached Triton's lowering as a literal and failed every such candidate of the block
    sweep, session 54) and grouped balanced ones."""
    l = p + 256 if p else 512
    blocks = blocks or blocks_for(l, l, 256, 2)
    assert supported(l, l, 256, blocks, 2)
    sd = jax.ShapeDtypeStruct
    verified_triton_modules(lambda *a: masked_attention(*a, scale=1.0, blocks=blocks),
                            sd((1, l, 16, 256), jnp.bfloat16), sd((1, l, 8, 256), jnp.bfloat16),
                            sd((1, l, 8, 256), jnp.bfloat16), sd((1, l, l), jnp.int8))


def test_supported_shapes():
    assert supported(32, 544, 128) and supported(256, 768, 128) and supported(16, 16, 16)
    assert not supported(8, 64, 64)  # a block of 8 queries: below the 16-row dot
    assert not supported(32, 40, 64) and not supported(32, 64, 96)
    assert supported(32, 64, 64, Blocks(group_heads=True), g=4) and not supported(32, 64, 64, Blocks(group_heads=True),
                                                                                    g=3)
    with pytest.raises(ValueError, match="not supported"):
        q, kc, vc, cm, kself, vself, sm = _inputs(jax.random.key(0), l=8)
        cached_attention(q, kc, vc, cm, kself, vself, sm, scale=1.0, interpret=True)


@pytest.mark.parametrize("in_place", [False, True])
def test_generate_with_the_kernel_equals_the_default(in_place, monkeypatch):
    """With in_place, the kernel reads each layer of the cache stacks where it lies (Blocks.cache_in_place)."""
    from orl_jax import params as P
    from orl_jax.config import preset
    from orl_jax.decode.engine import generate
    from orl_jax.decode.residual import ORLResidual
    from orl_jax.decode.samplers import UniformSampler
    from orl_jax.model import qwen3

    cfg = preset("tiny-qwendlm").replace(block_length=16)
    params = P.init(qwen3.param_specs(cfg), jax.random.key(0))
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12]]
    kw = dict(key=jax.random.key(1), max_new_tokens=32, sampler=UniformSampler(max_denoising_steps=4),
              residual=ORLResidual(), eos_token_id=(), pad_token_id=0)
    want = generate(params, cfg, prompts, **kw)
    fused = cfg.replace(cached_attention_impl="pallas")
    layers_read = []
    from orl_jax_kernels.decode_attention import kernel

    monkeypatch.setattr(kernel, "blocks_for", lambda *shape: Blocks(cache_in_place=in_place))
    real = kernel.cached_attention
    monkeypatch.setattr(kernel, "cached_attention",
                        lambda *a, **k: (k["layer"] is not None and layers_read.append(k["layer"])) or real(*a, **k))
    from orl_jax_kernels.qk_norm_rope import kernel as qk_kernel

    monkeypatch.setattr(qwen3, "FUSED_QK_ATTENTION", False)  # the norm kernel, then the attention kernel
    norms_read = []  # the q/k norm kernel takes its weights from the packed vector stack, in place
    real_qk = qk_kernel.qk_norm_rope_stacked
    monkeypatch.setattr(qk_kernel, "qk_norm_rope_stacked",
                        lambda qkv, cos, sin, vectors, *a: norms_read.append(vectors.shape) or
                        real_qk(qkv, cos, sin, vectors, *a))
    jax.clear_caches()  # trace again: the blocks are not part of generate()'s cache key
    assert "pallas_call" in str(jax.make_jaxpr(lambda p: generate(p, fused, prompts, **kw).tokens)(params))
    got = generate(params, fused, prompts, **kw)
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    assert int(got.total_forwards) == int(want.total_forwards)
    assert bool(layers_read) == in_place and all(layer is not None for layer in layers_read)
    assert norms_read and all(shape[0] == cfg.num_layers for shape in norms_read)


@pytest.mark.gpu
@pytest.mark.parametrize("l,s,n,kv,h", [(32, 544, 32, 8, 128), (256, 768, 32, 8, 128), (32, 864, 8, 4, 64)],
                         ids=["qwen3_4b_block32", "qwen3_4b_canvas256", "h200_recipe"])
@pytest.mark.parametrize("in_input_dtype", [False, True], ids=["f32_splits", "bf16_splits"])
def test_kernel_compiled_on_gpu_bf16(monkeypatch, l, s, n, kv, h, in_input_dtype):
    """The shapes generate() meets with cached_attention_impl "auto" on a GPU: Qwen3-4B, the recipe's model; the
    splits' outputs in float32 or bf16 (SPLITS_IN_INPUT_DTYPE)."""
    from orl_jax_kernels.decode_attention import kernel

    monkeypatch.setattr(kernel, "SPLITS_IN_INPUT_DTYPE", in_input_dtype)
    jax.clear_caches()
    q, kc, vc, cm, kself, vself, sm = _inputs(jax.random.key(0), l=l, s=s, n=n, kv=kv, h=h, dtype=jnp.bfloat16)
    want = attention(q, [(kc, vc, cm), (kself, vself, sm)])
    # the default splits, grouped heads, and the whole cache in one split (normalized in the kernel)
    for blocks in (Blocks(), Blocks(group_heads=True), Blocks(bs=64, chunks_per_split=32), Blocks(balanced=True),
                   Blocks(bl=16, bs=64, chunks_per_split=4, group_heads=True, balanced=True)):
        got = cached_attention(q, kc, vc, cm, kself, vself, sm, scale=q.shape[-1] ** -0.5, blocks=blocks)
        _assert_close_but_the_blind_row(got, want, 2e-2)
    stack = lambda a: jnp.stack([a * 0, a, a * 0])  # noqa: E731  (layer 1 of a stack, read in place)
    got = cached_attention(q, stack(kc), stack(vc), cm, kself, vself, sm, scale=q.shape[-1] ** -0.5,
                           layer=jnp.int32(1))
    _assert_close_but_the_blind_row(got, want, 2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("p", [512, 0], ids=["prefill_decode", "prefill"])
def test_masked_attention_compiled_on_gpu_at_the_26b(p):
    """The cache-free passes' kernel compiled, bf16, at the 26B's sliding layers (16 heads, 8 kv heads, head dim 256)
    under prefill_decode's visibility (prompt 512 causal, canvas 256) or the prefill's (512), the library's blocks,
    against the float32 einsums on the same bf16 inputs."""
    l, c = (p + 256, 256) if p else (512, 0)
    q, k, v, mask = _fused_pass_inputs(jax.random.key(6), b=1, p=l - c, c=c, n=16, kv=8, h=256, window=1024)
    q, k, v = (a.astype(jnp.bfloat16) for a in (q, k, v))
    f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
    want = attention(f32(q), [(f32(k), f32(v), mask)], scale=256 ** -0.5)
    got = masked_attention(q, k, v, mask.astype(jnp.int8), scale=256 ** -0.5, blocks=blocks_for(l, l, 256, 2))
    rel = float(jnp.linalg.norm(got.astype(jnp.float32) - want) / jnp.linalg.norm(want))
    assert rel < 1e-2, rel


@pytest.mark.gpu
def test_kernel_compiled_on_gpu_at_diffusion_gemma_sliding_layers():
    """DiffusionGemma's sliding layers (256 queries over 768 slots, head dim 256, 2 heads per kv head): the library's
    blocks and the tiles that fit 255 registers without spills (benchmarks/kernel_registers.py)."""
    q, kc, vc, cm, kself, vself, sm = _inputs(jax.random.key(0), l=256, s=768, n=16, kv=8, h=256, dtype=jnp.bfloat16)
    want = attention(q, [(kc, vc, cm), (kself, vself, sm)])
    wide = dict(bs=64, num_warps=8, cache_in_place=True, balanced=True)
    for blocks in (blocks_for(256, 768, 256, 2), Blocks(bl=64, chunks_per_split=8, **wide),
                   Blocks(bl=32, chunks_per_split=8, group_heads=True, **wide),
                   Blocks(bl=64, chunks_per_split=16, **dict(wide, bs=32, num_stages=3))):
        got = cached_attention(q, kc, vc, cm, kself, vself, sm, scale=256 ** -0.5, blocks=blocks)
        _assert_close_but_the_blind_row(got, want, 2e-2)


@pytest.mark.parametrize("group_heads,stacked", [(False, False), (True, False), (False, True)])
def test_kernel_lowers_to_verified_triton_on_any_machine(group_heads, stacked):
    """Pallas -> Triton IR at the Qwen3-4B decode shape, cross-platform, through MLIR's verifier (no GPU needed):
    catches an op the Triton lowering does not support, or mixed-type loop bounds, before a GPU session."""
    sd = jax.ShapeDtypeStruct
    b, l, n, kv, h, s = 1, 32, 32, 8, 128, 544
    args = (sd((b, l, n, h), jnp.bfloat16), sd((b, s, kv, h), jnp.bfloat16), sd((b, s, kv, h), jnp.bfloat16),
            sd((b, l, s), jnp.int8), sd((b, l, kv, h), jnp.bfloat16), sd((b, l, kv, h), jnp.bfloat16),
            sd((b, l, l), jnp.int8))
    blocks = Blocks(group_heads=group_heads)
    if stacked:  # 36 layers of cache, read at a traced layer index
        args = (args[0], sd((36, b, s, kv, h), jnp.bfloat16), sd((36, b, s, kv, h), jnp.bfloat16), *args[3:],
                sd((), jnp.int32))
        verified_triton_modules(lambda *a: cached_attention(*a[:-1], scale=h ** -0.5, blocks=blocks, layer=a[-1]),
                                *args)
        return
    verified_triton_modules(lambda *a: cached_attention(*a, scale=h ** -0.5, blocks=blocks), *args)


@pytest.mark.parametrize("l,s,n,kv,h,blocks", [
    (256, 768, 16, 8, 256, Blocks(bl=128, bs=64, chunks_per_split=4, num_warps=8, cache_in_place=True, balanced=True)),
    (256, 768, 32, 8, 128, Blocks(bl=16, bs=64, chunks_per_split=4, group_heads=True, cache_in_place=True,
                                  balanced=True))], ids=["dg_sliding", "qwen3_canvas256"])
@pytest.mark.parametrize("in_input_dtype", [False, True])
def test_balanced_splits_lower_to_verified_triton(monkeypatch, l, s, n, kv, h, blocks, in_input_dtype):
    """Blocks.balanced at DiffusionGemma's sliding layers and Qwen3-4B's canvas, the cache stacks read in place, the
    splits' outputs in float32 or bf16 (SPLITS_IN_INPUT_DTYPE)."""
    from orl_jax_kernels.decode_attention import kernel

    monkeypatch.setattr(kernel, "SPLITS_IN_INPUT_DTYPE", in_input_dtype)
    jax.clear_caches()
    sd = jax.ShapeDtypeStruct
    verified_triton_modules(
        lambda *a: cached_attention(*a[:-1], scale=1.0, blocks=blocks, layer=a[-1]),
        sd((1, l, n, h), jnp.bfloat16), sd((4, 1, s, kv, h), jnp.bfloat16), sd((4, 1, s, kv, h), jnp.bfloat16),
        sd((1, l, s), jnp.int8), sd((1, l, kv, h), jnp.bfloat16), sd((1, l, kv, h), jnp.bfloat16),
        sd((1, l, l), jnp.int8), sd((), jnp.int32))


def test_kernel_reads_a_layer_of_the_cache_stacks_in_place():
    q, kc, vc, cm, kself, vself, sm = _inputs(jax.random.key(2))
    kst = jnp.stack([kc * 0.5, kc, kc * 2.0])
    vst = jnp.stack([vc * 0.5, vc, vc * 3.0])
    kw = dict(scale=q.shape[-1] ** -0.5, interpret=True)
    for blocks in (Blocks(), GROUPED):
        want = cached_attention(q, kst[2], vst[2], cm, kself, vself, sm, blocks=blocks, **kw)
        got = cached_attention(q, kst, vst, cm, kself, vself, sm, blocks=blocks, layer=jnp.int32(2), **kw)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="needs `layer`"):
        cached_attention(q, kst, vst, cm, kself, vself, sm, **kw)


def test_tuned_table_sets_the_blocks_of_its_shapes(tmp_path, monkeypatch):
    import json

    from orl_jax_kernels.decode_attention import kernel

    monkeypatch.setattr(kernel, "TUNED", {})
    tuned = Blocks(bl=16, bs=32, chunks_per_split=1, num_warps=8, num_stages=2)
    q, kc, vc, cm, kself, vself, sm = _inputs(jax.random.key(1))
    h, g = q.shape[-1], q.shape[2] // kc.shape[2]
    row = {"l": 32, "s": 96, "h": h, "g": g, "blocks": tuned.__dict__, "us": 1.0}
    (tmp_path / "t.json").write_text(json.dumps([row]))
    kernel.load_tuned(tmp_path / "t.json")
    assert kernel.blocks_for(32, 96, h, g) == tuned and kernel.blocks_for(32, 64, h, g) == kernel.SHORT_PASS
    assert kernel.blocks_for(32, 96, 2 * h, g) != tuned  # another head shape: not this entry
    got = attention(q, [(kc, vc, cm), (kself, vself, sm)], impl="pallas")  # reads the table
    want = attention(q, [(kc, vc, cm), (kself, vself, sm)])
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)


def test_untuned_shapes_take_the_measured_rule_where_supported(monkeypatch):
    from orl_jax_kernels.decode_attention import kernel

    monkeypatch.setattr(kernel, "TUNED", {})
    assert kernel.blocks_for(32, 544, 128, 4) == kernel.SHORT_PASS
    assert kernel.blocks_for(256, 768, 128, 4) == kernel.LONG_PASS
    # grouping needs a power-of-two group: the rule without it
    assert kernel.blocks_for(256, 768, 128, 3) == dataclasses.replace(kernel.LONG_PASS, group_heads=False)
    assert kernel.blocks_for(24, 544, 128, 4) == Blocks()  # no 16-query tile divides 24
    assert kernel.SHORT_PASS.cache_in_place and kernel.LONG_PASS.cache_in_place


def test_large_head_dims_get_blocks_that_fit_shared_memory(monkeypatch):
    """DiffusionGemma's heads: sliding 256 wide (2 per kv head) take the wide-head rule (swept at that shape);
    full-attention heads 512 wide, 8 per kv head, fit neither it nor the grouped long-pass rule: they lose the
    grouping and take shorter key chunks to fit an H200's shared memory."""
    from orl_jax_kernels.decode_attention import kernel

    monkeypatch.setattr(kernel, "TUNED", {})
    assert kernel.blocks_for(256, 768, 256, 2) == kernel.WIDE_HEADS
    assert kernel.smem_bytes(kernel.WIDE_HEADS, 512, 8) > kernel.SMEM_LIMIT
    full = kernel.blocks_for(256, 768, 512, 8)
    assert not full.group_heads and full.bs <= 32 and full.cache_in_place
    assert kernel.smem_bytes(kernel.LONG_PASS, 512, 8) > kernel.SMEM_LIMIT >= kernel.smem_bytes(full, 512, 8)
    # ... and lose to XLA's einsums there (measured): the library keeps the kernel for the sliding layers only,
    # unless a tuned table lists the shape
    assert not kernel.preferred(256, 768, 512, 8) and kernel.preferred(256, 768, 256, 2)
    assert kernel.preferred(32, 768, 512, 8)  # a short pass
    monkeypatch.setitem(kernel.TUNED, (256, 768, 512, 8), full)
    assert kernel.preferred(256, 768, 512, 8)
    # the configuration the H200 refused (278,528 bytes asked) is over the limit
    assert kernel.smem_bytes(Blocks(bl=128, bs=128, group_heads=True), 128, 4) > kernel.SMEM_LIMIT


def test_float32_passes_get_blocks_that_fit_or_take_the_einsums(monkeypatch):
    """Elements of 4 bytes double a program's shared memory: float32 blocks are chosen for it (a tuned table's bf16
    entry is skipped), and where none fits the attention takes the einsums. The H200 refused bf16-sized blocks for
    a float32 pass of 128 queries at head dim 256 (303,616 bytes asked), a fused commit + first step's shape."""
    from orl_jax.model import attention as attn
    from orl_jax_kernels.decode_attention import kernel

    bf16 = kernel.blocks_for(128, 224, 256, 4)
    assert kernel.fits(bf16, 256, 4) and not kernel.fits(bf16, 256, 4, itemsize=4)
    f32 = kernel.blocks_for(128, 224, 256, 4, itemsize=4)
    assert kernel.fits(f32, 256, 4, itemsize=4) and kernel.supported(128, 224, 256, f32, 4)
    monkeypatch.setitem(kernel.TUNED, (128, 224, 256, 4), bf16)
    assert kernel.blocks_for(128, 224, 256, 4) == bf16 and kernel.blocks_for(128, 224, 256, 4, itemsize=4) == f32
    monkeypatch.setattr(kernel, "SMEM_LIMIT", 1024)  # nothing fits: the einsum path
    kc = jnp.zeros((1, 224, 1, 256), jnp.float32)
    assert attn._kernel_plan(kc, kc, 128, 256, 4) is None
    assert attn._kernel_plan(kc.astype(jnp.bfloat16), kc.astype(jnp.bfloat16), 128, 256, 4) is None
    monkeypatch.setattr(kernel, "SMEM_LIMIT", 200 * 1024)
    assert attn._kernel_plan(kc, kc, 128, 256, 4)[0] == f32


@pytest.mark.parametrize("l, s, kv, h", [(256, 768, 2, 512), (256, 768, 8, 256), (512, 1024, 8, 256)])
def test_diffusion_gemma_layer_shapes_lower_to_verified_triton(l, s, kv, h):
    """The 26B layers at their library blocks, scale 1.0: the full-attention layer at canvas 256 over 768 slots
    (head dim 512, 2 kv heads), the sliding layer there (WIDE_HEADS, run on the H200 in session 9) and the
    sliding layer in a 512-token prefill (the same blocks over a longer pass, not run on a GPU)."""
    from orl_jax_kernels.decode_attention.kernel import blocks_for

    sd = jax.ShapeDtypeStruct
    blocks = blocks_for(l, s, h, 16 // kv)
    verified_triton_modules(
        lambda *a: cached_attention(*a, scale=1.0, blocks=blocks),
        sd((1, l, 16, h), jnp.bfloat16), sd((1, s, kv, h), jnp.bfloat16), sd((1, s, kv, h), jnp.bfloat16),
        sd((1, l, s), jnp.int8), sd((1, l, kv, h), jnp.bfloat16), sd((1, l, kv, h), jnp.bfloat16),
        sd((1, l, l), jnp.int8))


def test_diffusion_gemma_decoder_with_the_kernel_equals_the_einsums(monkeypatch):
    """DiffusionGemmaConfig.cached_attention_impl="pallas": the decoder's cache passes (sliding and full layers,
    scale 1.0) through the kernel in interpret mode give the einsum path's logits. The sliding layers' q/k/v norms
    and RoPE go through kernels/qk_norm_rope (gemma order), their weights read from the packed vector stack."""
    from orl_jax import params as P
    from orl_jax.diffusion_gemma_config import DG_PRESETS
    from orl_jax.model import diffusion_gemma as dg
    from orl_jax_kernels.qk_norm_rope import kernel as qk_kernel

    calls = []
    real = qk_kernel.qk_norm_rope_stacked
    monkeypatch.setattr(qk_kernel, "qk_norm_rope_stacked", lambda *a, **k: calls.append(k["gemma"]) or real(*a, **k))

    cfg = DG_PRESETS["tiny-dg"].replace(head_dim=16, global_head_dim=32, block_length=16)
    params = P.init(dg.param_specs(cfg), jax.random.key(0))
    prompt = jax.random.randint(jax.random.key(1), (2, 16), 0, 240)
    _, cache = dg.prefill(params, cfg, prompt, jnp.array([16, 11]), 48)
    canvas = jax.random.randint(jax.random.key(2), (2, 16), 0, 240)
    want = dg.decode(params, cfg, canvas, cache)
    fused = cfg.replace(cached_attention_impl="pallas")
    assert "pallas_call" in str(jax.make_jaxpr(lambda p: dg.decode(p, fused, canvas, cache))(params))
    got = dg.decode(params, fused, canvas, cache)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-4, rtol=2e-4)
    assert float(want.std()) > 0.01  # non-trivial logits
    assert calls and all(calls)  # traced per sliding layer (once per group with SLIDING_LOOP "while"), gemma order
    # the masks' int8 conversion and the kernel's extents are made once per pass, not per sliding layer: none inside
    # the layers' loops (SLIDING_LOOP "while"), and no more of them with the layers unrolled (the default)
    jaxpr_of = lambda: jax.make_jaxpr(lambda p: dg.decode(p, fused, canvas, cache))(params).jaxpr  # noqa: E731
    unrolled = jaxpr_of()
    monkeypatch.setattr(dg, "SLIDING_LOOP", "while")
    jax.clear_caches()  # the switch is read at trace time
    looped = jaxpr_of()
    jax.clear_caches()
    in_loop = _in_layer_loops(looped)
    assert any(e.primitive.name == "pallas_call" for e in in_loop)
    assert not _mask_work(in_loop, 48)
    assert not _in_layer_loops(unrolled)
    assert len(_mask_work(list(_equations(unrolled)), 48)) == len(_mask_work(list(_equations(looped)), 48)) > 0


def test_qwen3_cached_pass_takes_its_layer_indices_as_a_literal():
    """The cached pass's layer indices (the kernels' in-place layer operand) are a constant, not an iota: XLA unrolls
    the layer loop in the engine's program and a slice of an iota stays a launch per layer there (a constant folds);
    its masks and extents are made before the loop."""
    from orl_jax import params as P
    from orl_jax.config import preset
    from orl_jax.model import qwen3
    from orl_jax.model.cache import KVCache

    cfg = preset("tiny-qwendlm").replace(cached_attention_impl="pallas")
    params = P.init(qwen3.param_specs(cfg), jax.random.key(0))
    cache = KVCache.empty(cfg.num_layers, 1, 32, cfg.num_kv_heads, cfg.head_dim, cfg.jnp_dtype)
    x = jnp.zeros((1, 16, cfg.hidden_size), cfg.jnp_dtype)
    vis = self_mask(full_segments(1, 16))
    jaxpr = jax.make_jaxpr(lambda p, c: qwen3.backbone(p, cfg, x, cache.positions(16), vis, c))(params, cache).jaxpr
    eqns = list(_equations(jaxpr))
    assert any(e.primitive.name == "pallas_call" for e in eqns)
    assert not [e for e in eqns if e.primitive.name == "iota" and e.outvars[0].aval.shape == (cfg.num_layers,)]
    in_loop = _in_layer_loops(jaxpr)
    assert in_loop and not _mask_work(in_loop, 32)


def _in_layer_loops(jaxpr) -> list:
    """The equations inside the bodies of a jaxpr's scans and while loops (the layer loops)."""
    bodies = {"scan": "jaxpr", "while": "body_jaxpr"}
    return [e for w in _equations(jaxpr) if w.primitive.name in bodies
            for e in _equations(w.params[bodies[w.primitive.name]].jaxpr)]


def _mask_work(eqns, slots: int) -> list:
    """Reductions and conversions over an array whose last axis is the cache's `slots`: a mask's, here."""
    return [e for e in eqns if e.primitive.name in ("reduce_max", "convert_element_type")
            and any(getattr(v.aval, "shape", ())[-1:] == (slots,) for v in e.invars)]


def _equations(jaxpr):
    """Every equation of a jaxpr, those of its sub-jaxprs (pjit, loops, custom calls) included; a kernel's own body
    (pallas_call) is not XLA's and is skipped."""
    for e in jaxpr.eqns:
        yield e
        if e.primitive.name == "pallas_call":
            continue
        for sub in jax.extend.core.jaxprs_in_params(e.params):
            yield from _equations(sub)


def _normed_inputs(key, dtype, b=2, l=32, s=96, kv=2, g=2, h=32, layers=3):
    """A raw fused projection, RoPE tables, a packed vector stack holding (q_norm, k_norm) at offsets (5, 5 + h) of
    layer 1, and the rest of _inputs."""
    ks = jax.random.split(key, 4)
    _, kc, vc, cm, _, _, sm = _inputs(ks[0], b=b, l=l, s=s, n=kv * g, kv=kv, h=h, dtype=dtype)
    proj = jax.random.normal(ks[1], (b, l, kv, g + 2, h), jnp.float32).astype(dtype) * 3
    from orl_jax.model.layers import rope_angles

    cos, sin = rope_angles(jnp.broadcast_to(jnp.arange(l) + 70, (b, l)), h, 1e4)
    vectors = (1 + 0.3 * jax.random.normal(ks[2], (layers, 2 * h + 9), jnp.float32)).astype(dtype)
    return proj, kc, vc, cm, sm, cos, sin, vectors


@pytest.mark.parametrize("gemma", [False, True], ids=["qwen3_order", "gemma_order"])
@pytest.mark.parametrize("blocks", [Blocks(bl=16, bs=32, chunks_per_split=4),  # SHORT_PASS: splits + own split
                                    Blocks(bl=16, bs=16, chunks_per_split=2, balanced=True),
                                    Blocks(bl=32, bs=32, chunks_per_split=8)])  # one split: no merge
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 2e-5), (jnp.bfloat16, 3e-2)])
def test_normed_kernel_equals_norm_then_attention_in_interpret_mode(gemma, blocks, dtype, tol):
    """cached_attention_normed (norms and RoPE inside) against kernels/qk_norm_rope's oracle followed by the
    plain kernel, in both orders; the cache stacks read at a traced layer."""
    from orl_jax_kernels.decode_attention.kernel import cached_attention_normed
    from orl_jax_kernels.qk_norm_rope.reference import gemma_qkv_reference, qk_norm_rope_reference

    proj, kc, vc, cm, sm, cos, sin, vectors = _normed_inputs(jax.random.key(7), dtype)
    b, l, kv, slots, h = proj.shape
    offsets, eps = (5, 5 + h), 1e-6
    q_norm, k_norm = vectors[1, 5:5 + h], vectors[1, 5 + h:5 + 2 * h]
    ref = gemma_qkv_reference if gemma else qk_norm_rope_reference
    q, k, v = ref(proj, cos, sin, q_norm, k_norm, eps)
    stack = lambda a: jnp.stack([a * 0.5, a, a * 2])  # noqa: E731  layer 1 is the cache
    want = cached_attention(q.reshape(b, l, kv * (slots - 2), h), stack(kc), stack(vc), cm, k, v, sm,
                            scale=h ** -0.5, blocks=blocks, interpret=True, layer=jnp.int32(1))
    got = cached_attention_normed(proj, stack(kc), stack(vc), cm, sm, cos, sin, vectors, jnp.int32(1),
                                  offsets=offsets, eps=eps, gemma=gemma, scale=h ** -0.5, blocks=blocks,
                                  interpret=True, layer=jnp.int32(1))
    assert got.shape == want.shape and got.dtype == want.dtype
    _assert_close_but_the_blind_row(got, want, tol)
    # the check can fail: the other layer's norm weights change the output
    other = cached_attention_normed(proj, stack(kc), stack(vc), cm, sm, cos, sin, vectors, jnp.int32(2),
                                    offsets=offsets, eps=eps, gemma=gemma, scale=h ** -0.5, blocks=blocks,
                                    interpret=True, layer=jnp.int32(1))
    assert float(jnp.abs(other.astype(jnp.float32) - want.astype(jnp.float32)).max()) > 10 * tol


def test_normed_kernel_rejects_grouped_blocks_and_mismatched_tables():
    from orl_jax_kernels.decode_attention.kernel import cached_attention_normed

    proj, kc, vc, cm, sm, cos, sin, vectors = _normed_inputs(jax.random.key(8), jnp.float32)
    kw = dict(offsets=(5, 37), eps=1e-6, gemma=False, scale=1.0, interpret=True)
    with pytest.raises(ValueError, match="group_heads"):
        cached_attention_normed(proj, kc, vc, cm, sm, cos, sin, vectors, jnp.int32(0), blocks=GROUPED, **kw)
    with pytest.raises(ValueError, match="do not match"):
        cached_attention_normed(proj, kc, vc, cm, sm, cos[:, :16], sin, vectors, jnp.int32(0), **kw)
    with pytest.raises(ValueError, match="do not match"):
        cached_attention_normed(proj, kc, vc, cm, sm, cos, sin, vectors, jnp.int32(0),
                                **{**kw, "offsets": (5, 60)})


def test_generate_with_norms_inside_the_attention_kernel_equals_the_default(monkeypatch):
    """qwen3.FUSED_QK_ATTENTION: the cached passes of a block take cached_attention_normed (norm kernel skipped), the
    commit still writes normed, rotated keys: two blocks decode token for token as the two-kernel path does."""
    from orl_jax import params as P
    from orl_jax.config import preset
    from orl_jax.decode.engine import generate
    from orl_jax.decode.samplers import UniformSampler
    from orl_jax.model import qwen3
    from orl_jax_kernels.decode_attention import kernel

    cfg = preset("tiny-qwendlm").replace(block_length=16, cached_attention_impl="pallas")
    params = P.init(qwen3.param_specs(cfg), jax.random.key(0))
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12]]
    kw = dict(key=jax.random.key(1), max_new_tokens=32, sampler=UniformSampler(max_denoising_steps=4),
              eos_token_id=(), pad_token_id=0)
    monkeypatch.setattr(kernel, "blocks_for", lambda *shape: Blocks(bl=16, bs=16, chunks_per_split=2,
                                                                    cache_in_place=True))
    monkeypatch.setattr(qwen3, "FUSED_QK_ATTENTION", False)
    jax.clear_caches()
    want = generate(params, cfg, prompts, **kw)
    calls = []
    real = kernel.cached_attention_normed
    monkeypatch.setattr(kernel, "cached_attention_normed", lambda *a, **k: calls.append(k["gemma"]) or real(*a, **k))
    monkeypatch.setattr(qwen3, "FUSED_QK_ATTENTION", True)
    jax.clear_caches()
    got = generate(params, cfg, prompts, **kw)
    assert calls and not any(calls)  # traced, in Qwen3's order
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    assert int(got.total_forwards) == int(want.total_forwards)


def test_normed_kernel_lowers_to_verified_triton_at_the_qwen3_block_shape():
    """cached_attention_normed at Qwen3-4B's block-32 shape (SHORT_PASS, the cache stacks and the packed norm
    weights read in place) through MLIR's verifier, no GPU needed."""
    from orl_jax_kernels.decode_attention.kernel import SHORT_PASS, cached_attention_normed

    sd = jax.ShapeDtypeStruct
    b, l, kv, g, h, s = 1, 32, 8, 4, 128, 544
    args = (sd((b, l, kv, g + 2, h), jnp.bfloat16), sd((36, b, s, kv, h), jnp.bfloat16),
            sd((36, b, s, kv, h), jnp.bfloat16), sd((b, l, s), jnp.int8), sd((b, l, l), jnp.int8),
            sd((b, l, h), jnp.float32), sd((b, l, h), jnp.float32), sd((36, 2 * h + 4), jnp.bfloat16),
            sd((), jnp.int32))
    verified_triton_modules(lambda *a: cached_attention_normed(
        *a, offsets=(4, 4 + h), eps=1e-6, gemma=False, scale=h ** -0.5, blocks=SHORT_PASS, layer=a[-1]), *args)


@pytest.mark.gpu
def test_normed_kernel_compiled_on_gpu_equals_norm_then_attention():
    """On a GPU, bf16, Qwen3-4B's block-32 shape: the normed kernel against the norm kernel + attention kernel."""
    from orl_jax_kernels.decode_attention.kernel import SHORT_PASS, cached_attention_normed
    from orl_jax_kernels.qk_norm_rope.kernel import qk_norm_rope_stacked

    proj, kc, vc, cm, sm, cos, sin, vectors = _normed_inputs(jax.random.key(9), jnp.bfloat16, l=32, s=544, kv=8, g=4,
                                                             h=128)
    stack = lambda a: jnp.stack([a, a * 0.5])  # noqa: E731
    offsets = (5, 133)
    q, k, v = qk_norm_rope_stacked(proj, cos, sin, vectors, jnp.int32(1), offsets, 1e-6)
    want = cached_attention(q.reshape(2, 32, 32, 128), stack(kc), stack(vc), cm, k, v, sm, scale=128 ** -0.5,
                            blocks=SHORT_PASS, layer=jnp.int32(1))
    got = cached_attention_normed(proj, stack(kc), stack(vc), cm, sm, cos, sin, vectors, jnp.int32(1),
                                  offsets=offsets, eps=1e-6, gemma=False, scale=128 ** -0.5, blocks=SHORT_PASS,
                                  layer=jnp.int32(1))
    _assert_close_but_the_blind_row(got, want, 3e-2)
