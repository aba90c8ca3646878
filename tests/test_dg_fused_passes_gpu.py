"""generate()'s fused passes (prefill + first step, commit + next block's first step) on a GPU, through the kernels
they take there: the Pallas MoE with fused experts, the cached-attention kernel, the q/k norm kernel. A small
DiffusionGemma (head dims and expert sizes the kernels take) in float32 with full-precision products: each fused pass
against its two passes. In bf16 a random model's logits move by 16-55% (relative L2) between two implementations of
the same math (another attention or MoE path), too much for a test to tell a wrong mask from rounding. The CPU
tests (test_diffusion_gemma_vs_hf.py) hold both passes to transformers in float32."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from orl_jax import params as P
from orl_jax.diffusion_gemma_config import DG_PRESETS
from orl_jax.model import diffusion_gemma as dg
from orl_jax.model import diffusion_gemma_inference as dgi
from orl_jax.model import diffusion_gemma_vis

pytestmark = pytest.mark.gpu

CFG = DG_PRESETS["tiny-dg"].replace(
    vocab_size=4096, hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=128, global_head_dim=256,
    intermediate_size=512, num_experts=16, top_k_experts=4, moe_intermediate_size=128, sliding_window=64,
    block_length=64, dtype="float32", moe_impl="pallas", cached_attention_impl="pallas",
    image_token_id=None, boi_token_id=None, eoi_token_id=None)


def _rel(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.fixture(autouse=True)
def _full_precision():
    with jax.default_matmul_precision("highest"):
        yield


@pytest.fixture(scope="module")
def setup():
    params = dgi.inference_params(P.init(dg.param_specs(CFG), jax.random.key(0)), CFG)
    rng = np.random.default_rng(0)
    prompt = jnp.asarray(rng.integers(3, 4000, (2, 96)), jnp.int32)
    lengths = jnp.asarray([96, 70], jnp.int32)
    canvas, block = (jnp.asarray(rng.integers(3, 4000, (2, 64)), jnp.int32) for _ in range(2))
    return params, prompt, lengths, canvas, block


def test_prefill_decode_on_gpu(setup):
    params, prompt, lengths, canvas, _ = setup
    got, got_cache = jax.jit(dg.prefill_decode, static_argnums=(1, 4))(params, CFG, prompt, lengths, 224, canvas)
    _, cache = jax.jit(dg.prefill, static_argnums=(1, 4))(params, CFG, prompt, lengths, 224)
    want = jax.jit(dg.decode, static_argnums=(1,))(params, CFG, canvas, cache)
    assert _rel(got, want) < 1e-3 and float(jnp.std(want)) > 0.1
    for a, b in zip(jax.tree.leaves(got_cache), jax.tree.leaves(cache)):
        assert _rel(a, b) < 1e-3


def test_commit_decode_on_gpu(setup):
    params, prompt, lengths, canvas, block = setup
    _, cache = jax.jit(dg.prefill, static_argnums=(1, 4))(params, CFG, prompt, lengths, 224)
    got, got_cache = jax.jit(dg.commit_decode, static_argnums=(1,))(params, CFG, block, cache, canvas)
    committed = jax.jit(dg.commit, static_argnums=(1,))(params, CFG, block, cache)
    want = jax.jit(dg.decode, static_argnums=(1,))(params, CFG, canvas, committed)
    assert _rel(got, want) < 1e-3 and float(jnp.std(want)) > 0.1
    assert int(got_cache.length) == int(committed.length) == 160
    for a, b in zip(jax.tree.leaves(got_cache), jax.tree.leaves(committed)):
        assert _rel(a, b) < 1e-3


def test_uncached_cudnn_attention_on_gpu(monkeypatch):
    """The cache-free passes' sliding-layer attention through cuDNN (UNCACHED_ATTENTION "auto", bf16) against the
    float32 einsums it replaces, under prefill_decode's visibility (causal prompt with its window, the canvas one
    segment after it, a left-padded row)."""
    from orl_jax.diffusion_gemma_config import SLIDING
    from orl_jax.model.attention import attention

    monkeypatch.setattr(dg, "UNCACHED_ATTENTION", "auto")
    bf16 = CFG.replace(dtype="bfloat16")
    assert dg._uncached_attention(bf16) == "cudnn" and dg._uncached_attention(CFG) == "orl_jax"
    b, p, l, n, kv, h = 2, 96, 64, 4, 2, 256
    valid = jnp.arange(p + l)[None] >= jnp.asarray([0, 26])[:, None]
    mask = diffusion_gemma_vis.fused_vis(bf16, b, p, l, valid)[SLIDING]
    q, k, v = (0.25 * jax.random.normal(key, (b, p + l, heads, h), jnp.bfloat16)
               for key, heads in zip(jax.random.split(jax.random.key(3), 3), (n, kv, kv)))
    got = jax.jit(lambda *a: attention(a[0], [a[1:]], "cudnn", scale=1.0))(q, k, v, mask)
    want = jax.jit(lambda *a: attention(a[0], [a[1:]], "orl_jax", scale=1.0))(q, k, v, mask)
    assert _rel(got, want) < 2e-2 and float(jnp.std(want.astype(jnp.float32))) > 0.05


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_generate_commits_the_argmax_on_gpu(setup, dtype):
    """At batch 1 (the benchmark's) every committed token, the argmax of the last step's temperature-scaled logits,
    is in the vocabulary: the samplers' chunk pass once found that argmax by testing z == 0, which an FMA contraction
    of the recomputed logits broke on CPU (every token id V; session 50). It was never checked on a GPU."""
    from orl_jax.decode.engine import generate
    from orl_jax.decode.samplers import UniformSampler

    params, prompt, _, _, _ = setup
    cfg = CFG.replace(dtype=dtype)
    p = jax.tree.map(lambda a: a.astype(cfg.jnp_dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a, params)
    out = generate(p, cfg, [np.asarray(prompt[0]).tolist()], key=jax.random.key(2), max_new_tokens=128,
                   sampler=UniformSampler(max_denoising_steps=4), eos_token_id=())
    tokens = np.asarray(out.tokens)
    assert tokens.shape == (1, 128) and tokens.min() >= 0 and tokens.max() < cfg.vocab_size, tokens
