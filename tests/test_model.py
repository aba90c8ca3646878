"""Qwen3 / QwenDLM model: sizes, visibility masks, the cached canvas, the adapter, transforms, input checks."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import jit_forward, random_params
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as PS

from orl_jax import params as P
from orl_jax import sharding
from orl_jax.config import ModelConfig, kernel_choice, preset, xla_for_auto
from orl_jax.diffusion_gemma_config import DG_PRESETS
from orl_jax.model import attention, qwen3, qwendlm

# A dependency counts as present above VISIBLE and absent at or below INVISIBLE (absent ones are exactly 0 in
# practice: a masked key gets probability exactly 0). Random weights make present ones O(0.1..1).
VISIBLE, INVISIBLE = 1e-3, 1e-6


@pytest.fixture(scope="module")
def q3():
    cfg = preset("tiny-qwen3")
    return cfg, random_params(cfg, seed=0)


@pytest.fixture(scope="module")
def dlm():
    cfg = preset("tiny-qwendlm")
    return cfg, random_params(cfg, seed=1)  # adapter down projection stays zero


@pytest.fixture(scope="module")
def dlm_init(dlm):
    """tiny-qwendlm params from the real initializer (P.init compiles slowly on CPU: done once)."""
    cfg, _ = dlm
    return P.init(qwen3.param_specs(cfg), INIT_KEY)


INIT_KEY = jax.random.key(7)


def _rand_tokens(shape, vocab, seed):
    return np.random.default_rng(seed).integers(0, vocab, size=shape).astype(np.int32)


# ---------------------------------------------------------------------------------------------------------------
# (a) sizes without memory
# ---------------------------------------------------------------------------------------------------------------

QWEN3_4B_PARAMS = 4_022_468_096  # Qwen3-4B: 4.02 B with tied embeddings
QWEN3_06B_PARAMS = 596_049_920
QWENDLM_4B_PARAMS = QWEN3_4B_PARAMS + 2560 + 3 * 2560 * 2560  # + adapter (norm, gate, up, down) of width D


def _count_by_formula(c: ModelConfig) -> int:
    D, N, K, H, F, V = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size, c.vocab_size
    per_layer = 2 * D + D * N * H + 2 * D * K * H + N * H * D + 2 * H + 3 * D * F
    n = V * D * (1 if c.tie_word_embeddings else 2) + c.num_layers * per_layer + D
    if c.adapter_hidden:
        n += D + 3 * D * c.adapter_hidden
    return n


def test_param_count_qwen3_4b():
    n = P.count(qwen3.param_specs(preset("qwen3-4b")))
    assert 4.020e9 <= n < 4.025e9
    assert n == QWEN3_4B_PARAMS


@pytest.mark.parametrize("name,expected", [("qwen3-4b", QWEN3_4B_PARAMS), ("qwen3-0.6b", QWEN3_06B_PARAMS),
                                           ("qwendlm-4b", QWENDLM_4B_PARAMS)])
def test_param_count_formula(name, expected):
    cfg = preset(name)
    assert P.count(qwen3.param_specs(cfg)) == _count_by_formula(cfg) == expected
    untied = cfg.replace(tie_word_embeddings=False)
    assert P.count(qwen3.param_specs(untied)) == expected + cfg.vocab_size * cfg.hidden_size


def test_abstract_4b_does_not_allocate():
    cfg = preset("qwen3-4b")
    specs = qwen3.param_specs(cfg)
    live_before = sum(a.nbytes for a in jax.live_arrays())
    abstract = P.abstract(specs)
    leaves = jax.tree.leaves(abstract)
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
    assert all(x.dtype == jnp.bfloat16 for x in leaves)
    assert sum(math.prod(x.shape) for x in leaves) == QWEN3_4B_PARAMS
    assert abstract["layers"]["qkv"].shape == (36, 2560, 8, 4 + 2, 128)  # q heads of a kv group, k, v
    assert abstract["layers"]["gate_up"].shape == (36, 2560, 2, 9728)
    assert "lm_head" not in abstract
    # init traced abstractly has the same tree, and a whole forward pass traces on the 4B shapes
    init_shapes = jax.eval_shape(lambda k: P.init(specs, k), jax.random.key(0))
    assert jax.tree.structure(init_shapes) == jax.tree.structure(abstract)
    assert all(a.shape == b.shape and a.dtype == b.dtype
               for a, b in zip(jax.tree.leaves(init_shapes), leaves, strict=True))
    out = jax.eval_shape(functools.partial(qwen3.forward, cfg=cfg), abstract,
                         tokens=jax.ShapeDtypeStruct((2, 16), jnp.int32))
    assert out.shape == (2, 16, cfg.vocab_size) and out.dtype == jnp.float32
    assert sum(a.nbytes for a in jax.live_arrays()) - live_before < 1 << 20  # nothing near 8 GB appeared


def test_4b_shardings():
    specs = qwen3.param_specs(preset("qwen3-4b"))
    mesh = sharding.make_mesh(data=1, fsdp=2, tensor=2)
    sh = P.shardings(specs, mesh)
    assert sh["layers"]["qkv"].spec == PS(None, "fsdp", "tensor", None, None)
    assert sh["layers"]["o"].spec == PS(None, "tensor", None, "fsdp")
    assert sh["layers"]["down"].spec == PS(None, "tensor", "fsdp")
    assert sh["embed"].spec == PS("tensor", "fsdp")
    assert sh["layers"]["q_norm"].spec == PS(None, None)


# ---------------------------------------------------------------------------------------------------------------
# (b) visibility, proven by perturbation
# ---------------------------------------------------------------------------------------------------------------

VIS_LEN = 10  # one sequence length for every visibility test (one compile)


def _influence(params, cfg, tokens, seg_start):
    """[L, L] matrix: max |change of logits at i| when token j alone is changed (one batched forward)."""
    length = tokens.shape[1]
    rows = np.repeat(tokens, length + 1, axis=0)
    for j in range(length):
        rows[1 + j, j] = (rows[1 + j, j] + 1 + 7 * j) % cfg.vocab_size
    seg = None if seg_start is None else jnp.broadcast_to(seg_start[:1], (length + 1, length))
    out = np.asarray(jit_forward(params, cfg, jnp.asarray(rows), seg_start=seg))
    return np.abs(out[1:] - out[:1]).max(-1).T  # [i, j]


def _assert_visibility(influence, expected):
    assert influence.shape == expected.shape
    assert (influence[expected] > VISIBLE).all(), np.argwhere(expected & (influence <= VISIBLE))
    assert (influence[~expected] <= INVISIBLE).all(), np.argwhere(~expected & (influence > INVISIBLE))


def _expected_block_causal(length, prompt, block):
    """Visibility written out from the definition: prompt causal; a block sees the prompt, earlier blocks and all
    of itself; nothing sees a later block."""
    def block_of(t):
        return -1 if t < prompt else (t - prompt) // block

    vis = np.zeros((length, length), bool)
    for i in range(length):
        for j in range(length):
            if i < prompt:
                vis[i, j] = j <= i
            else:
                vis[i, j] = j < prompt or block_of(j) <= block_of(i)
    return vis


def test_causal_visibility(q3):
    cfg, params = q3
    tokens = _rand_tokens((1, VIS_LEN), cfg.vocab_size, 0)
    expected = np.tril(np.ones((VIS_LEN, VIS_LEN), bool))
    _assert_visibility(_influence(params, cfg, tokens, None), expected)  # the default is causal
    _assert_visibility(_influence(params, cfg, tokens, attention.causal_segments(1, VIS_LEN)), expected)


@pytest.mark.parametrize("prompt,block", [(3, 3), (4, 2), (0, 3), (2, 8), (1, 4)])
def test_block_causal_visibility(q3, prompt, block):
    cfg, params = q3
    tokens = _rand_tokens((1, VIS_LEN), cfg.vocab_size, prompt * 10 + block)
    seg = attention.block_segments(1, VIS_LEN, prompt, block)
    _assert_visibility(_influence(params, cfg, tokens, seg), _expected_block_causal(VIS_LEN, prompt, block))


def test_block_segments_values():
    np.testing.assert_array_equal(attention.block_segments(2, 10, 3, 3),
                                  np.array([[0, 1, 2, 3, 3, 3, 6, 6, 6, 9]] * 2))
    np.testing.assert_array_equal(attention.causal_segments(1, 4), [[0, 1, 2, 3]])
    np.testing.assert_array_equal(attention.full_segments(1, 4), [[0, 0, 0, 0]])


def test_full_visibility(q3):
    cfg, params = q3
    tokens = _rand_tokens((1, VIS_LEN), cfg.vocab_size, 1)
    _assert_visibility(_influence(params, cfg, tokens, attention.full_segments(1, VIS_LEN)),
                       np.ones((VIS_LEN, VIS_LEN), bool))


def test_rope_is_relative(q3):
    """Shifting every position by a constant leaves the logits unchanged; a non-uniform change does not."""
    cfg, params = q3
    tokens = jnp.asarray(_rand_tokens((VIS_LEN + 1, VIS_LEN), cfg.vocab_size, 2))
    pos = attention.causal_segments(VIS_LEN + 1, VIS_LEN)
    base = np.asarray(jit_forward(params, cfg, tokens, positions=pos))
    np.testing.assert_array_equal(base, np.asarray(jit_forward(params, cfg, tokens)))
    shifted = np.asarray(jit_forward(params, cfg, tokens, positions=pos + 37))
    np.testing.assert_allclose(shifted, base, atol=2e-5, rtol=0)
    stretched = np.asarray(jit_forward(params, cfg, tokens, positions=pos * 2))
    assert np.abs(stretched - base).max() > VISIBLE


# ---------------------------------------------------------------------------------------------------------------
# (c) the canvas over a cached prefix (QwenDLM)
# ---------------------------------------------------------------------------------------------------------------

PROMPT_LEN = 6
LENGTHS = (6, 3, 1)  # row 0 unpadded, rows 1 and 2 left-padded
BLOCK = preset("tiny-qwendlm").block_length
REF_LEN = PROMPT_LEN + 3 * BLOCK  # every cache-free reference runs at this length (one compile)

jit_prefill = jax.jit(qwendlm.prefill, static_argnums=(1, 4))
jit_decode = jax.jit(qwendlm.decode, static_argnums=(1,), static_argnames=("return_hidden",))
jit_commit = jax.jit(qwendlm.commit, static_argnums=(1,))


@functools.partial(jax.jit, static_argnums=(1, 4))
def _prefill_decode(params, cfg, prompt, lengths, cache_size, canvas):
    last, cache = qwendlm.prefill(params, cfg, prompt, lengths, cache_size)
    return last, qwendlm.decode(params, cfg, canvas, cache)


@functools.partial(jax.jit, static_argnums=(1, 4))
def _prefill_commit_decode(params, cfg, prompt, lengths, cache_size, blocks, canvas):
    _, cache = qwendlm.prefill(params, cfg, prompt, lengths, cache_size)
    for blk in blocks:
        cache = qwendlm.commit(params, cfg, blk, cache)
    return qwendlm.decode(params, cfg, canvas, cache), cache


def _padded_prompts(cfg, seed):
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, cfg.vocab_size, (len(LENGTHS), PROMPT_LEN)).astype(np.int32)  # pads random too
    real = [prompt[b, PROMPT_LEN - n:] for b, n in enumerate(LENGTHS)]
    return prompt, np.array(LENGTHS, np.int32), real


def _seg(*parts):
    """seg_start [n] for [part0; part1; ...]: each part ("causal", n) or ("one", n) (one bidirectional segment)."""
    out, at = [], 0
    for kind, n in parts:
        out.append(np.arange(at, at + n) if kind == "causal" else np.full(n, at))
        at += n
    return np.concatenate(out).astype(np.int32)


def _cache_free(params, cfg, seqs, segs):
    """qwen3.forward of each (1-D tokens, 1-D seg_start), batched by right-padding to REF_LEN; the padding gets
    segment starts after every real token, so no real token sees it."""
    toks = np.zeros((len(seqs), REF_LEN), np.int32)
    seg = np.broadcast_to(np.arange(REF_LEN, 2 * REF_LEN, dtype=np.int32), toks.shape).copy()
    for b, (t, s) in enumerate(zip(seqs, segs, strict=True)):
        toks[b, :len(t)], seg[b, :len(s)] = t, s
    out = np.asarray(jit_forward(params, cfg.replace(prefix_attention="causal"), jnp.asarray(toks),
                                 seg_start=jnp.asarray(seg)))
    return [out[b, :len(t)] for b, t in enumerate(seqs)]


def test_canvas_dependencies(dlm):
    """Canvas logits depend on every canvas token and every real prompt token, never on left-padding; rows do not
    interact (every perturbation hits all rows at once)."""
    cfg, params = dlm
    L = BLOCK
    prompt, lengths, _ = _padded_prompts(cfg, 0)
    canvas = _rand_tokens((len(LENGTHS), L), cfg.vocab_size, 1)

    def run(p, c):
        last, out = _prefill_decode(params, cfg, jnp.asarray(p), jnp.asarray(lengths), PROMPT_LEN + 2 * L,
                                    jnp.asarray(c))
        return np.asarray(last), np.asarray(out)

    last0, out0 = run(prompt, canvas)
    for s in range(PROMPT_LEN):
        p2 = prompt.copy()
        p2[:, s] = (p2[:, s] + 11) % cfg.vocab_size
        last, out = run(p2, canvas)
        for b, n_real in enumerate(LENGTHS):
            d_canvas, d_last = np.abs(out[b] - out0[b]).max(-1), np.abs(last[b] - last0[b]).max()
            if s >= PROMPT_LEN - n_real:  # a real prompt token: every canvas position sees it
                assert (d_canvas > VISIBLE).all() and d_last > VISIBLE, (s, b, d_canvas, d_last)
            else:  # a pad token: nothing changes
                assert (d_canvas <= INVISIBLE).all() and d_last <= INVISIBLE, (s, b, d_canvas, d_last)
    for j in range(L):  # a canvas token: every canvas position of its row (before and after it) sees it
        c2 = canvas.copy()
        c2[:, j] = (c2[:, j] + 13) % cfg.vocab_size
        last, out = run(prompt, c2)
        assert (np.abs(out - out0).max(-1) > VISIBLE).all(), j
        np.testing.assert_array_equal(last, last0)  # the prompt never sees the canvas


def test_decode_equals_cache_free_forward(dlm):
    cfg, params = dlm
    L = BLOCK
    prompt, lengths, real = _padded_prompts(cfg, 2)
    canvas = _rand_tokens((len(LENGTHS), L), cfg.vocab_size, 3)
    last, out = _prefill_decode(params, cfg, jnp.asarray(prompt), jnp.asarray(lengths), PROMPT_LEN + 2 * L,
                                jnp.asarray(canvas))
    seqs = [np.concatenate([real[b], canvas[b]]) for b in range(len(LENGTHS))]
    segs = [_seg(("causal", n), ("one", L)) for n in LENGTHS]
    refs = _cache_free(params, cfg, seqs, segs)
    # prefill's last-token logits are the causal forward's last logits over the unpadded prompt
    causal = _cache_free(params, cfg, real, [_seg(("causal", n)) for n in LENGTHS])
    for b, n in enumerate(LENGTHS):
        np.testing.assert_allclose(np.asarray(out[b]), refs[b][n:], atol=1e-5, rtol=0)
        np.testing.assert_allclose(np.asarray(last[b]), causal[b][-1], atol=1e-5, rtol=0)
    # the default (causal) forward agrees with the right-padded reference on the unpadded row
    full = np.asarray(jit_forward(params, cfg, jnp.asarray(real[0][None])))
    np.testing.assert_allclose(full[0], causal[0], atol=1e-5, rtol=0)


def test_unrolled_layer_scan_equals_the_scan(dlm):
    """layer_unroll (cached passes only) changes how XLA sees the layer loop, never the numbers."""
    cfg, params = dlm
    prompt, lengths, _ = _padded_prompts(cfg, 2)
    canvas = jnp.asarray(_rand_tokens((len(LENGTHS), BLOCK), cfg.vocab_size, 3))
    args = (jnp.asarray(prompt), jnp.asarray(lengths), PROMPT_LEN + 2 * BLOCK, canvas)
    last, out = _prefill_decode(params, cfg, *args)
    last_u, out_u = _prefill_decode(params, cfg.replace(layer_unroll=cfg.num_layers), *args)
    np.testing.assert_allclose(np.asarray(out_u), np.asarray(out), atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(last_u), np.asarray(last), atol=1e-5, rtol=0)
    last_s, out_s = _prefill_decode(params, cfg.replace(layer_unroll=1), *args)
    np.testing.assert_array_equal(np.asarray(out_s), np.asarray(out))  # None (the default) scans outside generate()
    with pytest.raises(ValueError, match="layer_unroll"):
        cfg.replace(layer_unroll=0)
    with pytest.raises(ValueError, match="layer_unroll must be 1 or >= num_layers=6"):
        cfg.replace(num_layers=6, layer_unroll=3)


def test_left_padding_matches_unpadded_row(dlm):
    cfg, params = dlm
    L = BLOCK
    prompt, lengths, real = _padded_prompts(cfg, 4)
    canvas = _rand_tokens((len(LENGTHS), L), cfg.vocab_size, 5)
    last, out = _prefill_decode(params, cfg, jnp.asarray(prompt), jnp.asarray(lengths), PROMPT_LEN + 2 * L,
                                jnp.asarray(canvas))
    b, n = 1, LENGTHS[1]  # a padded row, run alone without padding
    last1, out1 = _prefill_decode(params, cfg, jnp.asarray(real[b][None]), jnp.asarray([n], jnp.int32),
                                  PROMPT_LEN + 2 * L, jnp.asarray(canvas[b:b + 1]))
    np.testing.assert_allclose(np.asarray(last[b]), np.asarray(last1[0]), atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(out[b]), np.asarray(out1[0]), atol=1e-5, rtol=0)


def _commit_case(params, cfg, prefix_attention):
    cfg = cfg.replace(prefix_attention=prefix_attention)
    prompt, lengths, real = _padded_prompts(cfg, 6)
    blocks = [_rand_tokens((len(LENGTHS), BLOCK), cfg.vocab_size, s) for s in (7, 8)]
    canvas = _rand_tokens((len(LENGTHS), BLOCK), cfg.vocab_size, 9)
    out, cache = _prefill_commit_decode(params, cfg, jnp.asarray(prompt), jnp.asarray(lengths), REF_LEN + BLOCK,
                                        tuple(jnp.asarray(b) for b in blocks), jnp.asarray(canvas))
    return np.asarray(out), cache, real, blocks, canvas


@pytest.mark.parametrize("prefix_attention", ["causal", "block_causal"])
def test_commit_then_decode_equals_cache_free_forward(dlm, prefix_attention):
    """Two committed blocks, then a canvas: equal to the cache-free forward over [prompt; block1; block2; canvas]
    with the committed blocks causal (prefix_attention='causal') or bidirectional inside each block."""
    cfg, params = dlm
    L = BLOCK
    out, cache, real, blocks, canvas = _commit_case(params, cfg, prefix_attention)
    assert int(cache.length) == PROMPT_LEN + 2 * L
    np.testing.assert_array_equal(np.asarray(cache.start), PROMPT_LEN - np.array(LENGTHS))
    kind = "causal" if prefix_attention == "causal" else "one"
    seqs = [np.concatenate([real[b], blocks[0][b], blocks[1][b], canvas[b]]) for b in range(len(LENGTHS))]
    segs = [_seg(("causal", n), (kind, L), (kind, L), ("one", L)) for n in LENGTHS]
    if prefix_attention == "block_causal":  # the same visibility as the training-time helper
        for n, s in zip(LENGTHS, segs, strict=True):
            np.testing.assert_array_equal(s, attention.block_segments(1, n + 3 * L, n, L)[0])
    refs = _cache_free(params, cfg, seqs, segs)
    for b, n in enumerate(LENGTHS):
        np.testing.assert_allclose(out[b], refs[b][n + 2 * L:], atol=1e-5, rtol=0)


def test_prefix_attention_modes_differ(dlm):
    """The commit visibility matters (otherwise the test above could not tell the modes apart)."""
    cfg, params = dlm
    a = _commit_case(params, cfg, "causal")[0]
    b = _commit_case(params, cfg, "block_causal")[0]
    assert np.abs(a - b).max() > VISIBLE


def test_decode_does_not_write_cache(dlm):
    cfg, params = dlm
    prompt, lengths, _ = _padded_prompts(cfg, 13)
    _, cache = jit_prefill(params, cfg, jnp.asarray(prompt), jnp.asarray(lengths), PROMPT_LEN + 2 * BLOCK)
    k, v, length = np.asarray(cache.k), np.asarray(cache.v), int(cache.length)
    assert length == PROMPT_LEN
    assert np.asarray(cache.k[:, :, :PROMPT_LEN]).any() and not np.asarray(cache.k[:, :, PROMPT_LEN:]).any()
    jit_decode(params, cfg, jnp.asarray(_rand_tokens((3, BLOCK), cfg.vocab_size, 14)), cache)
    np.testing.assert_array_equal(np.asarray(cache.k), k)
    np.testing.assert_array_equal(np.asarray(cache.v), v)


def test_kv_cache_positions_and_write():
    """Row b's tokens live in slots [start[b], length) and the RoPE position of slot j is j - start[b]."""
    from orl_jax.model.cache import KVCache

    c = KVCache.empty(2, 2, 8, 1, 2, jnp.float32).replace(start=jnp.asarray([0, 3], jnp.int32),
                                                         length=jnp.asarray(5, jnp.int32))
    np.testing.assert_array_equal(c.positions(3), [[5, 6, 7], [2, 3, 4]])
    new = jnp.arange(2 * 2 * 2 * 1 * 2, dtype=jnp.float32).reshape(2, 2, 2, 1, 2) + 1
    c2 = c.write(new, -new)
    assert int(c2.length) == 7 and c2.size == 8
    np.testing.assert_array_equal(c2.k[:, :, 5:7], new)
    np.testing.assert_array_equal(c2.v[:, :, 5:7], -new)
    assert not np.asarray(c2.k[:, :, :5]).any() and not np.asarray(c2.k[:, :, 7:]).any()
    m = attention.cache_mask(c2.start, c2.length, c2.size, 1)
    np.testing.assert_array_equal(m[:, 0], [[1, 1, 1, 1, 1, 1, 1, 0], [0, 0, 0, 1, 1, 1, 1, 0]])


def test_prefill_errors(dlm):
    cfg, params = dlm
    prompt, lengths, _ = _padded_prompts(cfg, 0)
    with pytest.raises(ValueError, match="cache_size"):
        qwendlm.prefill(params, cfg, jnp.asarray(prompt), jnp.asarray(lengths), PROMPT_LEN - 1)
    with pytest.raises(ValueError, match="tokens"):
        qwendlm.prefill(params, cfg, jnp.asarray(prompt[0]), jnp.asarray(lengths), 16)
    with pytest.raises(ValueError, match="tokens"):
        qwendlm.prefill(params, cfg, jnp.asarray(prompt + cfg.vocab_size), jnp.asarray(lengths), 16)


# ---------------------------------------------------------------------------------------------------------------
# (d) the zero-initialized residual adapter
# ---------------------------------------------------------------------------------------------------------------

ADAPTER_SHAPE = (2, BLOCK)


def test_adapter_starts_at_zero_and_is_exact_identity(dlm, dlm_init):
    cfg, _ = dlm
    params = dlm_init  # the real initializer
    assert not np.asarray(params["adapter"]["down"]).any()
    assert np.asarray(params["adapter"]["gate"]).any() and np.asarray(params["adapter"]["up"]).any()
    tokens = jnp.asarray(_rand_tokens(ADAPTER_SHAPE, cfg.vocab_size, 0))
    z = jax.random.normal(jax.random.key(1), (*ADAPTER_SHAPE, cfg.hidden_size))
    np.testing.assert_array_equal(np.asarray(jit_forward(params, cfg, tokens, residual=z)),
                                  np.asarray(jit_forward(params, cfg, tokens)))


def test_adapter_changes_logits_once_trained(dlm):
    cfg, params = dlm
    tokens = jnp.asarray(_rand_tokens(ADAPTER_SHAPE, cfg.vocab_size, 0))
    z1 = jax.random.normal(jax.random.key(1), (*ADAPTER_SHAPE, cfg.hidden_size))
    z2 = jax.random.normal(jax.random.key(2), (*ADAPTER_SHAPE, cfg.hidden_size))
    base = np.asarray(jit_forward(params, cfg, tokens))
    np.testing.assert_array_equal(np.asarray(jit_forward(params, cfg, tokens, residual=z1)), base)

    down = 0.05 * jax.random.normal(jax.random.key(3), (cfg.adapter_hidden, cfg.hidden_size))
    trained = dict(params, adapter=dict(params["adapter"], down=down))
    np.testing.assert_array_equal(np.asarray(jit_forward(trained, cfg, tokens)), base)  # no residual: no adapter
    with_z1 = np.asarray(jit_forward(trained, cfg, tokens, residual=z1))
    with_z2 = np.asarray(jit_forward(trained, cfg, tokens, residual=z2))
    assert np.abs(with_z1 - base).max() > VISIBLE
    assert np.abs(with_z1 - with_z2).max() > VISIBLE
    # the adapter of position i only feeds position i's embedding: with a causal mask, changing z at the last
    # position leaves the earlier logits unchanged
    z3 = z1.at[:, -1].set(z2[:, -1])
    with_z3 = np.asarray(jit_forward(trained, cfg, tokens, residual=z3))
    np.testing.assert_array_equal(with_z3[:, :-1], with_z1[:, :-1])
    assert np.abs(with_z3[:, -1] - with_z1[:, -1]).max() > VISIBLE


def test_decode_residual_and_embeds(dlm):
    cfg, params = dlm
    prompt, lengths, _ = _padded_prompts(cfg, 20)
    _, cache = jit_prefill(params, cfg, jnp.asarray(prompt), jnp.asarray(lengths), PROMPT_LEN + 2 * BLOCK)
    canvas = jnp.asarray(_rand_tokens((3, BLOCK), cfg.vocab_size, 21))
    z = jax.random.normal(jax.random.key(4), (3, BLOCK, cfg.hidden_size))
    base, h = jit_decode(params, cfg, canvas, cache, return_hidden=True)
    assert h.shape == (3, BLOCK, cfg.hidden_size)
    np.testing.assert_allclose(np.asarray(qwen3.logits(params, cfg, h)), np.asarray(base), atol=1e-6, rtol=0)
    np.testing.assert_array_equal(np.asarray(jit_decode(params, cfg, canvas, cache, residual=z)), np.asarray(base))
    # explicit embeddings equal to the token embedding give the same logits
    emb = jnp.take(params["embed"], canvas, axis=0)
    np.testing.assert_allclose(np.asarray(jit_decode(params, cfg, canvas, cache, embeds=emb)), np.asarray(base),
                               atol=1e-6, rtol=0)
    trained = dict(params, adapter=dict(params["adapter"], down=params["adapter"]["gate"].T))
    moved = np.asarray(jit_decode(trained, cfg, canvas, cache, residual=z))
    assert np.abs(moved - np.asarray(base)).max() > VISIBLE


def test_residual_without_adapter_raises(q3):
    cfg, params = q3
    tokens = jnp.asarray(_rand_tokens((1, 4), cfg.vocab_size, 0))
    with pytest.raises(ValueError, match="adapter"):
        qwen3.forward(params, cfg, tokens, residual=jnp.zeros((1, 4, cfg.hidden_size)))


# ---------------------------------------------------------------------------------------------------------------
# (e) transformations: jit, grad, while_loop, sharding
# ---------------------------------------------------------------------------------------------------------------

def test_jit_matches_eager(q3):
    """Eager (concrete checks, numpy int64 input) and jitted forward agree."""
    cfg, params = q3
    tokens = _rand_tokens((2, 5), cfg.vocab_size, 30)
    np.testing.assert_allclose(np.asarray(qwen3.forward(params, cfg, tokens.astype(np.int64))),
                               np.asarray(jit_forward(params, cfg, jnp.asarray(tokens))), atol=1e-5, rtol=0)


def _lm_loss(params, cfg, tokens, residual, remat=False):
    logits = qwen3.forward(params, cfg, tokens[:, :-1], residual=residual, remat=remat)
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))


def test_grad_finite_and_remat_equal(dlm):
    """Gradients through the whole model (with a residual through the zero-init adapter) are finite; every weight
    gets one except the adapter's norm / gate / up, inert until `down` moves; remat gives the same gradients."""
    cfg, params = dlm
    tokens = jnp.asarray(_rand_tokens((2, 9), cfg.vocab_size, 31))
    z = jax.random.normal(jax.random.key(5), (2, 8, cfg.hidden_size))
    grad = jax.jit(jax.value_and_grad(_lm_loss), static_argnums=(1, 4))
    loss, g = grad(params, cfg, tokens, z, False)
    assert np.isfinite(float(loss)) and float(loss) > 0
    for path, leaf in jax.tree_util.tree_leaves_with_path(g):
        name, a = jax.tree_util.keystr(path), np.asarray(leaf)
        assert np.isfinite(a).all(), name
        if name in ("['adapter']['norm']", "['adapter']['gate']", "['adapter']['up']"):
            assert not a.any(), name  # they only feed the zero `down`
        else:  # every backbone weight (norms included), and the adapter's `down`
            assert np.abs(a).max() > 0, name
    loss_r, g_r = grad(params, cfg, tokens, z, True)
    np.testing.assert_allclose(float(loss_r), float(loss), rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=1e-5),
                 g_r, g)


def test_decode_commit_inside_while_loop(dlm):
    """A greedy block loop (decode -> argmax -> commit) under lax.while_loop equals the same steps run one by one."""
    cfg, params = dlm
    L, steps = BLOCK, 3
    prompt, lengths, _ = _padded_prompts(cfg, 40)
    canvas0 = jnp.asarray(_rand_tokens((len(LENGTHS), L), cfg.vocab_size, 41))
    size = PROMPT_LEN + steps * L

    def step(canvas, cache):
        block = jnp.argmax(qwendlm.decode(params, cfg, canvas, cache), axis=-1).astype(jnp.int32)
        return (block * 3 + 1) % cfg.vocab_size, qwendlm.commit(params, cfg, block, cache), block

    @jax.jit
    def looped(prompt, lengths, canvas):
        _, cache = qwendlm.prefill(params, cfg, prompt, lengths, size)
        out = jnp.zeros((steps, len(LENGTHS), L), jnp.int32)

        def body(carry):
            i, canvas, cache, out = carry
            canvas, cache, block = step(canvas, cache)
            return i + 1, canvas, cache, out.at[i].set(block)

        _, _, cache, out = jax.lax.while_loop(lambda c: c[0] < steps, body, (0, canvas, cache, out))
        return out, cache

    out, cache = looped(jnp.asarray(prompt), jnp.asarray(lengths), canvas0)
    assert int(cache.length) == size

    _, ref_cache = jit_prefill(params, cfg, jnp.asarray(prompt), jnp.asarray(lengths), size)
    canvas, ref, jstep = canvas0, [], jax.jit(step)
    for _ in range(steps):
        canvas, ref_cache, block = jstep(canvas, ref_cache)
        ref.append(np.asarray(block))
    np.testing.assert_array_equal(np.asarray(out), np.stack(ref))
    assert len(np.unique(np.asarray(out))) > 3  # the loop really produced varied tokens
    np.testing.assert_allclose(np.asarray(cache.k), np.asarray(ref_cache.k), atol=1e-5, rtol=0)


def test_sharded_init_matches_unsharded(dlm, dlm_init):
    cfg, _ = dlm
    specs = qwen3.param_specs(cfg)
    mesh = sharding.make_mesh(data=1, fsdp=2, tensor=2)
    assert mesh.devices.size == 4
    sharded, plain = P.init(specs, INIT_KEY, mesh=mesh), dlm_init
    q = sharded["layers"]["qkv"]
    assert q.sharding.spec == PS(None, "fsdp", "tensor", None, None)
    Ly, D, K, T, H = q.shape
    assert {s.data.shape for s in q.addressable_shards} == {(Ly, D // 2, K // 2, T, H)}
    assert len({s.device for s in q.addressable_shards}) == 4
    assert sharded["adapter"]["down"].sharding.spec == PS("tensor", "fsdp")
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), sharded, plain)
    # a trained-looking model (random weights, adapter on) gives the same logits sharded and unsharded
    rand = random_params(cfg, seed=9, adapter_down_zero=False)
    rand_sh = jax.device_put(rand, P.shardings(specs, mesh))
    tokens = jnp.asarray(_rand_tokens(ADAPTER_SHAPE, cfg.vocab_size, 50))
    z = jax.random.normal(jax.random.key(6), (*ADAPTER_SHAPE, cfg.hidden_size))
    tokens_sh = jax.device_put(tokens, sharding.named_sharding(mesh, ("batch", "length"), tokens.shape))
    out_sh = jit_forward(rand_sh, cfg, tokens_sh, residual=z)
    np.testing.assert_allclose(np.asarray(out_sh), np.asarray(jit_forward(rand, cfg, tokens, residual=z)),
                               atol=1e-5, rtol=0)


def test_shard_map_data_parallel(q3):
    cfg, params = q3
    mesh = sharding.make_mesh(data=4, fsdp=1, tensor=1)
    tokens = jnp.asarray(_rand_tokens((8, 6), cfg.vocab_size, 51))
    f = jax.jit(jax.shard_map(lambda p, t: qwen3.forward(p, cfg, t), mesh=mesh,
                              in_specs=(PS(), PS("data")), out_specs=PS("data")))
    out = f(params, jax.device_put(tokens, NamedSharding(mesh, PS("data"))))
    assert len(out.sharding.device_set) == 4
    np.testing.assert_allclose(np.asarray(out), np.asarray(jit_forward(params, cfg, tokens)), atol=1e-5, rtol=0)


def test_make_mesh_errors():
    assert sharding.make_mesh(data=2, fsdp=-1).shape == {"data": 2, "fsdp": 2, "tensor": 1}
    with pytest.raises(ValueError, match="at most one"):
        sharding.make_mesh(data=-1, fsdp=-1)
    with pytest.raises(ValueError, match="needs 8 devices"):
        sharding.make_mesh(data=2, fsdp=2, tensor=2)
    with pytest.raises(ValueError, match="do not divide"):
        sharding.make_mesh(data=3, fsdp=-1)
    with pytest.raises(ValueError, match="no sharding rule"):
        sharding.logical_to_spec(("embed", "bogus"))


def test_indivisible_dims_stay_replicated():
    mesh = sharding.make_mesh(data=1, fsdp=2, tensor=2)
    assert sharding.named_sharding(mesh, ("embed", "heads"), (6, 3)).spec == PS("fsdp", None)
    assert sharding.named_sharding(mesh, ("batch", "length"), (4, 3)).spec == PS("fsdp", None)


def test_model_traces_under_rank_promotion_raise(dlm):
    cfg, params = dlm
    tokens = jnp.asarray(_rand_tokens((2, 4), cfg.vocab_size, 0))
    with jax.numpy_rank_promotion("raise"):
        _, cache = qwendlm.prefill(params, cfg, tokens, jnp.asarray([4, 2], jnp.int32), 12)
        cache = qwendlm.commit(params, cfg, tokens, cache)
        qwendlm.decode(params, cfg, tokens, cache, residual=jnp.zeros((2, 4, cfg.hidden_size)))
        qwen3.forward(params, cfg, tokens)


# ---------------------------------------------------------------------------------------------------------------
# (f) bad inputs
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("tokens,exc,match", [
    (np.zeros((1, 4), np.float32), TypeError, "integer dtype"),
    (np.zeros((4,), np.int32), ValueError, r"tokens must have shape \[batch, length\].*\(4,\)"),
    (np.zeros((1, 2, 4), np.int32), ValueError, r"tokens must have shape \[batch, length\].*\(1, 2, 4\)"),
    (np.array([[1, 256, 3]], np.int32), ValueError, r"tokens contains id 256"),
    (np.array([[1, -1, 3]], np.int32), ValueError, r"tokens contains id -1"),
    (np.zeros((1, 0), np.int32), ValueError, "tokens must be non-empty"),
    (np.zeros((0, 3), np.int32), ValueError, "tokens must be non-empty"),
    ([[1, 2, 3]], TypeError, "tokens must be an integer array"),
])
def test_forward_rejects_bad_tokens(q3, tokens, exc, match):
    cfg, params = q3
    t = tokens if isinstance(tokens, list) else jnp.asarray(tokens)
    with pytest.raises(exc, match=match):
        qwen3.forward(params, cfg, t)


@pytest.mark.parametrize("kw,match", [
    (dict(num_heads=5, num_kv_heads=2), "multiple of num_kv_heads"),
    (dict(noise="mask"), "mask_token_id"),
    (dict(noise="gaussian"), "noise"),
    (dict(hidden_size=-64), "hidden_size"),
    (dict(vocab_size=0), "vocab_size"),
    (dict(num_layers=True), "num_layers"),
    (dict(intermediate_size=12.0), "intermediate_size"),
    (dict(block_length=0), "block_length"),
    (dict(head_dim=15), "head_dim"),
    (dict(dtype="float64"), "dtype"),
    (dict(dtype="bf16"), "dtype"),
    (dict(prefix_attention="bidirectional"), "prefix_attention"),
    (dict(adapter_hidden=-1), "adapter_hidden"),
    (dict(adapter_act="relu"), "adapter_act"),
    (dict(mask_token_id=256), "mask_token_id"),
    (dict(mask_token_id=-1), "mask_token_id"),
    (dict(eos_token_ids=(2, 300)), "eos_token_ids"),
])
def test_model_config_rejects(kw, match):
    with pytest.raises(ValueError, match=match):
        preset("tiny-qwen3").replace(**kw)


def test_model_config_valid_and_hashable():
    cfg = preset("tiny-qwen3").replace(noise="mask", mask_token_id=255, eos_token_ids=(2,))
    assert hash(cfg) == hash(preset("tiny-qwen3").replace(noise="mask", mask_token_id=255, eos_token_ids=(2,)))
    assert cfg.jnp_dtype == jnp.float32 and not cfg.has_adapter and preset("tiny-qwendlm").has_adapter
    with pytest.raises(ValueError, match="unknown preset"):
        preset("qwen3-5b")


def test_auto_kernels_are_the_pallas_ones_on_a_gpu_only(monkeypatch):
    """"auto" (the default of cached_attention_impl and moe_impl): the XLA path on CPU, the kernel on a GPU, and the
    XLA path again for weights sharded over a mesh (generate(mesh=...)); explicit settings are kept."""
    assert preset("tiny-qwen3").cached_attention_impl == "auto" and DG_PRESETS["tiny-dg"].moe_impl == "auto"
    assert kernel_choice("auto", "pallas", "orl_jax") == "orl_jax"
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert kernel_choice("auto", "pallas", "orl_jax") == "pallas"
    assert kernel_choice("orl_jax", "pallas", "orl_jax") == "orl_jax"
    assert xla_for_auto(preset("tiny-qwen3")).cached_attention_impl == "orl_jax"
    assert xla_for_auto(DG_PRESETS["tiny-dg"]).moe_impl == "bucketed"
    assert xla_for_auto(preset("tiny-qwen3").replace(cached_attention_impl="pallas")).cached_attention_impl == "pallas"
    with pytest.raises(ValueError, match="cached_attention_impl"):
        preset("tiny-qwen3").replace(cached_attention_impl="fused")


def test_pack_vectors_round_trip():
    """The per-layer vectors of one dtype join one [L, sum n] array; unpacking a row gives layer i's vectors back
    exactly; matrices and vectors of another dtype stay apart."""
    from orl_jax.model.streamed import pack_vectors, unpack_vectors, vector_offsets

    key = iter(jax.random.split(jax.random.key(0), 5))
    layers = {"a_norm": jax.random.normal(next(key), (3, 8)), "q": jax.random.normal(next(key), (3, 8, 4)),
              "b_norm": jax.random.normal(next(key), (3, 2)), "scalar": jax.random.normal(next(key), (3, 1)),
              "half": jax.random.normal(next(key), (3, 4)).astype(jnp.bfloat16)}
    rest, packed, layout = pack_vectors(layers)
    assert set(rest) == {"q", "half"} and packed.shape == (3, 11)
    assert layout == (("a_norm", 0, 8), ("b_norm", 8, 2), ("scalar", 10, 1))
    for i in range(3):
        got = unpack_vectors(packed[i], layout)
        for n in ("a_norm", "b_norm", "scalar"):
            np.testing.assert_array_equal(np.asarray(got[n]), np.asarray(layers[n][i]))
    assert pack_vectors({"q": layers["q"], "a_norm": layers["a_norm"]})[1] is None  # one vector: nothing to join
    assert vector_offsets(layout, "b_norm", "scalar") == (8, 10)  # where a kernel reads them in place
    assert vector_offsets(layout, "b_norm", "half") is None  # "half" was not packed
