"""DiffusionGemma against transformers' DiffusionGemmaForBlockDiffusion.

A tiny HF model is built in-process in fp32 with every weight re-randomized (norms, router scales, per-expert
scales and both sets of layer_scalar buffers included), saved with save_pretrained and loaded through
orl_jax.convert.hf.load_hf. Covered: encoder and decoder logits (with / without self-conditioning, left-padded
rows, after a commit; prompts and canvas longer than the sliding window of 4), the checkpoint round trip, loader /
config errors, generate() against HF's own generate() fed the engine's random draws, and the 26B-A4B shape.
"""

from __future__ import annotations

import copy
import json
import unittest.mock as um

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hf_compat import CACHE
from safetensors.torch import load_file, save_file

from orl_jax import params as P
from orl_jax.convert.hf import DG_SKIPPED_PREFIXES, load_hf, save_hf
from orl_jax.decode.engine import generate, make_sampler
from orl_jax.decode.samplers import UniformSampler, categorical
from orl_jax.diffusion_gemma_config import DG_PRESETS, FULL, SLIDING, DiffusionGemmaConfig
from orl_jax.model import diffusion_gemma as dg
from orl_jax.model import diffusion_gemma_inference as dgi
from orl_jax.model.moe import experts_mlp

pytestmark = pytest.mark.hf

TINY = DG_PRESETS["tiny-dg"]
EOS = 1
TINY_VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                   num_key_value_heads=2, head_dim=8, max_position_embeddings=64, position_embedding_size=16,
                   patch_size=4, pooling_kernel_size=1)


def hf_config(cfg: DiffusionGemmaConfig):
    """transformers' config written out by hand from the preset (independent of to_hf_config)."""
    from transformers import DiffusionGemmaConfig as HFConfig

    text = dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, global_head_dim=cfg.global_head_dim, num_global_key_value_heads=cfg.num_global_kv_heads,
        attention_k_eq_v=True, enable_moe_block=True, num_experts=cfg.num_experts, top_k_experts=cfg.top_k_experts,
        moe_intermediate_size=cfg.moe_intermediate_size, sliding_window=cfg.sliding_window,
        layer_types=list(cfg.layer_types), max_position_embeddings=cfg.max_position_embeddings,
        final_logit_softcapping=30.0, pad_token_id=0, eos_token_id=EOS, bos_token_id=2,
        rope_parameters={SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
                         FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6}})
    c = HFConfig(text_config=text, vision_config=TINY_VISION, canvas_length=cfg.block_length,
                 image_token_id=cfg.image_token_id, boi_token_id=cfg.boi_token_id, eoi_token_id=cfg.eoi_token_id)
    c._attn_implementation = "eager"
    return c


def random_hf_model(cfg: DiffusionGemmaConfig, seed: int = 0):
    """transformers' DiffusionGemmaForBlockDiffusion for cfg with every weight and layer_scalar buffer drawn at
    random (norm weights and scalars around 1): its own init leaves logits flat or, in some buffers, undefined."""
    from transformers import DiffusionGemmaForBlockDiffusion

    torch.manual_seed(seed)
    model = DiffusionGemmaForBlockDiffusion(hf_config(cfg)).eval()
    with torch.no_grad():
        for _, p in model.named_parameters():  # encoder weights are the decoder's (tied): visited once
            if p.ndim == 1:
                p.data.normal_(0, 0.5).add_(1.0)
            else:
                p.data.normal_(0, 0.1)
        for name, b in model.named_buffers():  # encoder and decoder layer_scalar are separate buffers
            if name.endswith("layer_scalar"):
                b.data.normal_(0, 0.3).add_(1.0)
    return model


@pytest.fixture(scope="session")
def dg_hf(tmp_path_factory):
    """(HF model, its save_pretrained directory)."""
    model = random_hf_model(TINY)
    d = tmp_path_factory.mktemp("tiny-dg")
    model.save_pretrained(d)
    return model, d


@pytest.fixture(scope="session")
def dg_ours(dg_hf):
    return load_hf(dg_hf[1], dtype="float32")


_prefill = jax.jit(dg.prefill, static_argnums=(1, 4))
_decode = jax.jit(dg.decode, static_argnums=(1,))
_commit = jax.jit(dg.commit, static_argnums=(1,))
_forward = jax.jit(dg.forward, static_argnums=(1,), static_argnames=("return_hidden",))
_soft = jax.jit(dg.soft_embed, static_argnums=(1,))
_real_prefill_decode, _real_commit_decode = dg.prefill_decode, dg.commit_decode


def _tokens(shape, seed, high=240):  # below the tiny preset's image / boi / eoi ids
    return np.random.default_rng(seed).integers(3, high, size=shape).astype(np.int32)


def _left_padded(lengths, seed):
    """Prompts of these lengths (prompt i from seed + its length) and them left-padded with 0 into one array."""
    prompts = [_tokens((n,), seed + n) for n in lengths]
    padded = np.zeros((len(lengths), max(lengths)), np.int32)
    for i, p in enumerate(prompts):
        padded[i, -len(p):] = p
    return prompts, padded


def _torch(a, dtype=torch.long):
    return torch.as_tensor(np.asarray(a)).to(dtype)


def test_config_from_checkpoint(dg_ours, dg_hf):
    cfg, params = dg_ours
    assert cfg.eos_token_ids == (EOS,) and cfg.pad_token_id == 0 and cfg.vision_config_json is not None
    assert cfg.replace(eos_token_ids=(), vision_config_json=None) == TINY.replace(eos_token_ids=())
    assert jax.tree.all(jax.tree.map(lambda x: x.dtype == jnp.float32, params))
    # nothing is trivially 0 / 1: the norms, scales and both layer_scalar sets were re-randomized
    for name in ("attn_norm", "router_scale", "expert_scale", "layer_scalar", "encoder_layer_scalar"):
        for stack in ("sliding", "full"):
            a = np.asarray(params[stack][name])
            assert np.abs(a - 1).min() > 0, (stack, name)
    assert not np.allclose(params["full"]["layer_scalar"], params["full"]["encoder_layer_scalar"])


def test_encoder_matches_hf(dg_ours, dg_hf):
    """The encoder (causal, sliding window 4 over 13 tokens): last hidden state and the logits it implies."""
    cfg, params = dg_ours
    model, _ = dg_hf
    tokens = _tokens((2, 13), 0)
    with torch.no_grad():
        h_ref = model.model.encoder(input_ids=_torch(tokens)).last_hidden_state
        z_ref = model.lm_head(h_ref) / 30.0
        logits_ref = (torch.tanh(z_ref) * 30.0).numpy()
    logits, h = _forward(params, cfg, jnp.asarray(tokens), return_hidden=True)
    np.testing.assert_array_less(np.abs(np.asarray(h) - h_ref.numpy()).max(), 1e-4)
    assert np.abs(logits_ref).max() > 1.0
    np.testing.assert_array_less(np.abs(np.asarray(logits) - logits_ref).max(), 1e-4)


def _hf_row(model, prompt, canvases, scs, blocks):
    """HF per row, unpadded: encode the prompt, decode canvases[0]; commit blocks[0] with the encoder, decode
    canvases[1]."""
    from transformers.cache_utils import DynamicCache

    out = []
    with torch.no_grad():
        cache = DynamicCache(config=model.config.text_config)
        model.model.encoder(input_ids=_torch(prompt[None]), **{CACHE: cache})
        for j, canvas in enumerate(canvases):
            if j:
                model.model.encoder(input_ids=_torch(blocks[j - 1][None]), **{CACHE: cache})
            sc = None if scs[j] is None else _torch(scs[j][None], torch.float32)
            out.append(model(decoder_input_ids=_torch(canvas[None]), **{CACHE: cache},
                             self_conditioning_logits=sc).logits[0].numpy())
    return out


def test_expert_kernel_gather_changes_no_logit(dg_ours, monkeypatch):
    """moe.GATHER_IN_KERNEL (on by default): the pallas MoE's gate/up kernel reads each sorted row from its token's
    row. In fp32 the decoder's logits equal those with XLA's sorted copy of x."""
    from orl_jax.model import moe

    cfg, params = dg_ours
    cfg = cfg.replace(moe_impl="pallas")
    prompt, canvas = jnp.asarray(_tokens((2, 11), 5)), jnp.asarray(_tokens((2, cfg.block_length), 6))
    _, cache = jax.jit(dg.prefill, static_argnums=(1, 4))(params, cfg, prompt, jnp.asarray([11, 7], jnp.int32), 19)
    want = np.asarray(jax.jit(dg.decode, static_argnums=(1,))(params, cfg, canvas, cache))
    monkeypatch.setattr(moe, "GATHER_IN_KERNEL", False)
    jax.clear_caches()  # jit's trace cache is keyed by the function: the switch is read at trace time
    got = np.asarray(jax.jit(dg.decode, static_argnums=(1,))(params, cfg, canvas, cache))
    assert np.abs(want).max() > 1.0
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=0)


def test_router_kernel_changes_no_logit(dg_ours, monkeypatch):
    """moe.ROUTER_TOPK_KERNEL (on by default): the pallas MoE picks its top-k with kernels/expert_sort/router_topk (the
    tiny model's k = 3 of E = 8 padded inside). The decoder's jaxpr has the kernel and no XLA top-k; in fp32 its logits
    equal those of XLA's top-k. moe.EXPERT_SORT_BY_TOKEN (on): the same logits with the per-assignment sort."""
    from orl_jax.model import moe

    cfg, params = dg_ours
    cfg = cfg.replace(moe_impl="pallas")
    prompt, canvas = jnp.asarray(_tokens((2, 11), 5)), jnp.asarray(_tokens((2, cfg.block_length), 6))
    _, cache = jax.jit(dg.prefill, static_argnums=(1, 4))(params, cfg, prompt, jnp.asarray([11, 7], jnp.int32), 19)

    def run():
        jaxpr = str(jax.make_jaxpr(lambda p: dg.decode(p, cfg, canvas, cache))(params))
        jax.clear_caches()  # jit's trace cache is keyed by the function: the switches are read at trace time
        return jaxpr, np.asarray(jax.jit(dg.decode, static_argnums=(1,))(params, cfg, canvas, cache))

    jaxpr, want = run()
    assert "name=router_topk" in jaxpr and "top_k[" not in jaxpr and "name=expert_sort_by_token" in jaxpr
    monkeypatch.setattr(moe, "EXPERT_SORT_BY_TOKEN", False)
    jaxpr, got = run()
    assert "name=expert_sort_by_token" not in jaxpr
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=0)
    monkeypatch.setattr(moe, "ROUTER_TOPK_KERNEL", False)
    jaxpr, got = run()
    assert "name=router_topk" not in jaxpr and "top_k[" in jaxpr
    assert np.abs(want).max() > 1.0
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=0)


@pytest.mark.parametrize("self_cond", [False, True], ids=["no-sc", "sc"])
def test_decoder_matches_hf(dg_ours, dg_hf, self_cond):
    """Decoder logits after a prefill and after a commit, rows of different prompt lengths (left-padded here,
    unpadded in HF), with and without self-conditioning logits; prompt 11 / 6, canvas 8, window 4."""
    cfg, params = dg_ours
    model, _ = dg_hf
    L, lengths = cfg.block_length, [11, 6]
    prompts, padded = _left_padded(lengths, 10)
    canvases = [_tokens((2, L), 20), _tokens((2, L), 21)]
    block = _tokens((2, L), 22)
    rng = np.random.default_rng(23)
    scs = [rng.normal(0, 3, (2, L, cfg.vocab_size)).astype(np.float32) if self_cond else None for _ in range(2)]

    _, cache = _prefill(params, cfg, jnp.asarray(padded), jnp.asarray(lengths, jnp.int32), max(lengths) + 2 * L)
    ours = []
    for j in range(2):
        if j:
            cache = _commit(params, cfg, jnp.asarray(block), cache)
        z = None if scs[j] is None else _soft(params, cfg, jax.nn.softmax(jnp.asarray(scs[j]), axis=-1))
        ours.append(np.asarray(_decode(params, cfg, jnp.asarray(canvases[j]), cache, residual=z)))
    for r in range(2):
        ref = _hf_row(model, prompts[r], [c[r] for c in canvases], [None if s is None else s[r] for s in scs],
                      [block[r]])
        for j in range(2):
            assert np.abs(ref[j]).max() > 1.0
            err = np.abs(ours[j][r] - ref[j]).max()
            assert err < 1e-4, (r, j, err)


def _self_cond_input(params, cfg, canvas, seed):
    """Random previous-step logits sc [2, L, V] for a canvas [2, L], and the decoder input with self-conditioning on
    their softmax's soft embedding."""
    b, length = canvas.shape
    sc = np.random.default_rng(seed).normal(0, 3, (b, length, cfg.vocab_size)).astype(np.float32)
    z = _soft(params, cfg, jax.nn.softmax(jnp.asarray(sc), axis=-1))
    return sc, dg.residual_embed(params, cfg, jnp.asarray(canvas), z, jnp.ones((b, length), jnp.float32))


def _check_fused_pass(got, got_cache, want, want_cache, hf_rows):
    """A fused pass's logits and cache against our two passes' (2e-5), and each row's logits against transformers'
    (1e-4)."""
    assert np.abs(np.asarray(want)).max() > 1.0
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=0)
    for a, b in zip(jax.tree.leaves(got_cache), jax.tree.leaves(want_cache)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5, rtol=0)
    for r, ref in enumerate(hf_rows):
        assert np.abs(np.asarray(got)[r] - ref).max() < 1e-4, r


@pytest.mark.parametrize("self_cond", [False, True], ids=["no-sc", "sc"])
def test_prefill_decode_is_prefill_then_decode(dg_ours, dg_hf, self_cond):
    """The fused pass (generate()'s first step): the canvas logits equal HF's decoder after its encoder and our
    decode after our prefill, and the cache it writes equals the prefill's; left-padded rows, prompt 11 / 6 over a
    window of 4, a moe_impl that sorts rows by expert (so the prompt and canvas rows share each expert's GEMM)."""
    cfg, params = dg_ours
    cfg = cfg.replace(moe_impl="bucketed")
    model, _ = dg_hf
    L, lengths = cfg.block_length, [11, 6]
    prompts, padded = _left_padded(lengths, 30)
    canvas = _tokens((2, L), 40)
    sc, embeds = _self_cond_input(params, cfg, canvas, 41) if self_cond else (None, None)
    args = (params, cfg, jnp.asarray(padded), jnp.asarray(lengths, jnp.int32), max(lengths) + L)
    got, cache = jax.jit(dg.prefill_decode, static_argnums=(1, 4))(*args, jnp.asarray(canvas), embeds=embeds)
    _, want_cache = _prefill(*args)
    want = _decode(params, cfg, jnp.asarray(canvas), want_cache, embeds=embeds)
    refs = [_hf_row(model, prompts[r], [canvas[r]], [None if sc is None else sc[r]], [])[0] for r in range(2)]
    _check_fused_pass(got, cache, want, want_cache, refs)


@pytest.mark.parametrize("moe_impl,attention", [("bucketed", "orl_jax"), ("pallas", "pallas")])
def test_commit_decode_is_commit_then_decode(dg_ours, dg_hf, moe_impl, attention):
    """The fused pass at a block boundary: the next canvas's logits equal HF's decoder after its encoder took the
    block, and our decode after commit; the cache equals commit's. Left-padded rows, prompt 11 / 6, block and canvas
    8 over a window of 4 (the canvas's window reaches into the block), self-conditioning input."""
    cfg, params = dg_ours
    cfg = cfg.replace(moe_impl=moe_impl, cached_attention_impl=attention)
    model, _ = dg_hf
    L, lengths = cfg.block_length, [11, 6]
    prompts, padded = _left_padded(lengths, 50)
    block, canvas = _tokens((2, L), 60), _tokens((2, L), 61)
    sc, embeds = _self_cond_input(params, cfg, canvas, 62)
    _, cache = _prefill(params, cfg, jnp.asarray(padded), jnp.asarray(lengths, jnp.int32), max(lengths) + 2 * L)
    got, got_cache = jax.jit(dg.commit_decode, static_argnums=(1,))(params, cfg, jnp.asarray(block), cache,
                                                                     jnp.asarray(canvas), embeds=embeds)
    want_cache = _commit(params, cfg, jnp.asarray(block), cache)
    want = _decode(params, cfg, jnp.asarray(canvas), want_cache, embeds=embeds)
    refs = [_hf_row(model, prompts[r], [canvas[r], canvas[r]], [None, sc[r]], [block[r]])[1] for r in range(2)]
    _check_fused_pass(got, got_cache, want, want_cache, refs)


@pytest.mark.parametrize("fold", ["attention", "ffw"])
@pytest.mark.parametrize("moe_impl,attention", [("bucketed", "orl_jax"), ("pallas", "pallas")])
def test_folded_norms_keep_both_fused_passes(dg_ours, dg_hf, moe_impl, attention, fold, monkeypatch):
    """The norm folds inference_params makes of a bf16 / fp16 model under FOLD_ATTENTION_NORMS / FOLD_FFW_NORMS,
    through generate()'s two fused passes (kernels in interpret mode with "pallas": the router top-k and q/k norm
    kernels, the grouped expert GEMMs). fold_ffw_norms is exact up to rounding: the unfolded passes' logits and
    cache, transformers' rows (1e-4). fold_attention_norms with a vanishing eps is too (1e-4, float32 rounding);
    with the model's eps (which then weighs r(x)^2 / c^2 as much against each head's mean square) its logits lie
    within 2e-4 of transformers' rows, far below a bf16 model's rounding (~4e-3). Left-padded rows, prompt 11 / 6,
    window 4, self-conditioning input on the second canvas."""
    cfg, params = dg_ours
    cfg = cfg.replace(moe_impl=moe_impl, cached_attention_impl=attention)
    switch, fn, dropped = {
        "attention": ("FOLD_ATTENTION_NORMS", dgi.fold_attention_norms, ["attn_norm"]),
        "ffw": ("FOLD_FFW_NORMS", dgi.fold_ffw_norms, ["mlp_norm", "router_scale", "moe_norm"])}[fold]
    monkeypatch.setattr(dgi, switch, True)
    assert dgi.inference_params(params, cfg.replace(moe_impl="bucketed")) is params  # float32: never folded
    folded = fn(params)
    assert not {n for t in ("sliding", "full") for n in folded[t]} & set(dropped)
    with pytest.raises(ValueError, match="already folded"):
        fn(folded)
    model, _ = dg_hf
    L, lengths = cfg.block_length, [11, 6]
    prompts, padded = _left_padded(lengths, 70)
    canvas, block, canvas2 = _tokens((2, L), 71), _tokens((2, L), 72), _tokens((2, L), 73)
    sc, embeds = _self_cond_input(params, cfg, canvas2, 74)
    pd = jax.jit(dg.prefill_decode, static_argnums=(1, 4))
    cd = jax.jit(dg.commit_decode, static_argnums=(1,))
    args = (jnp.asarray(padded), jnp.asarray(lengths, jnp.int32), max(lengths) + 2 * L, jnp.asarray(canvas))
    refs = ([_hf_row(model, prompts[r], [canvas[r]], [None], [])[0] for r in range(2)],
            [_hf_row(model, prompts[r], [canvas[r], canvas2[r]], [None, sc[r]], [block[r]])[1] for r in range(2)])
    for c in ((cfg.replace(rms_norm_eps=1e-30),) if fold == "attention" else ()) + (cfg,):
        (got, got_cache), (want, want_cache) = (pd(p, c, *args) for p in (folded, params))
        step = (jnp.asarray(block), want_cache, jnp.asarray(canvas2))
        (got2, got2_cache), (want2, want2_cache) = (cd(p, c, *step, embeds=embeds) for p in (folded, params))
        if c is not cfg or fold == "ffw":  # float32 rounding apart (the kernels' in interpret mode reach ~3e-5)
            for a, b in zip(jax.tree.leaves((got, got_cache, got2, got2_cache)),
                            jax.tree.leaves((want, want_cache, want2, want2_cache))):
                np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4, rtol=0)
        if c is cfg:
            for logits, hf in ((got, refs[0]), (got2, refs[1])):
                for r, ref in enumerate(hf):
                    assert np.abs(np.asarray(logits)[r] - ref).max() < (2e-4 if fold == "attention" else 1e-4), r


@pytest.mark.parametrize("moe_impl", ["bucketed", "pallas"])
def test_prefill_decode_in_two_parts(dg_ours, moe_impl):
    """prefill_decode_first (the first layer group) then prefill_decode_rest (the engine's SPLIT_START_GROUPS, two
    programs): prefill_decode's logits and cache. Left-padded rows, self-conditioning input; the carry jitted apart
    from the rest as the engine runs them."""
    cfg, params = dg_ours
    cfg = cfg.replace(moe_impl=moe_impl)
    L, lengths = cfg.block_length, [11, 6]
    _, padded = _left_padded(lengths, 70)
    canvas = jnp.asarray(_tokens((2, L), 71))
    _, embeds = _self_cond_input(params, cfg, np.asarray(canvas), 72)
    args = (params, cfg, jnp.asarray(padded), jnp.asarray(lengths, jnp.int32), max(lengths) + L, canvas)
    want, want_cache = jax.jit(dg.prefill_decode, static_argnums=(1, 4))(*args, embeds=embeds)
    first = jax.jit(dg.prefill_decode_first, static_argnums=(1, 4), static_argnames="groups")(
        *args, embeds=embeds, groups=1)
    assert first["full"][0].shape[0] == 1 and first["sliding"][0].shape[0] == cfg.sliding_per_group
    got, cache = jax.jit(dg.prefill_decode_rest, static_argnums=(1, 4))(*args, first)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=0)
    for a, b in zip(jax.tree.leaves(cache), jax.tree.leaves(want_cache), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5, rtol=0)
    # the carry's layers are the pass's first ones: another pass's carry (other canvas inputs) moves the logits
    other = jax.jit(dg.prefill_decode_first, static_argnums=(1, 4), static_argnames="groups")(
        *args, embeds=None, groups=1)
    moved, _ = jax.jit(dg.prefill_decode_rest, static_argnums=(1, 4))(*args, other)
    assert np.abs(np.asarray(moved) - np.asarray(want)).max() > 1e-2
    for bad in (0, cfg.num_groups, 1.5):
        with pytest.raises(ValueError, match=f"groups must be an int in \\[1, {cfg.num_groups - 1}\\].*{bad}"):
            dg.prefill_decode_first(*args, groups=bad)


@pytest.mark.parametrize("moe_impl,attention", [("bucketed", "orl_jax"), ("pallas", "pallas")])
def test_trimmed_last_layer(dg_ours, moe_impl, attention, monkeypatch):
    """TRIM_LAST_LAYER: the passes that keep some rows (prefill: the last prompt token; prefill_decode and
    commit_decode: the canvas) run the last layer's MoE for those rows alone, with the logits and cache of the
    untrimmed passes (float32 rounding apart; a sliced row would move them by ~1). Left-padded rows,
    self-conditioning input on the commit's canvas; with "pallas" the kernels in interpret mode. (The attention of
    fewer queries than own keys: test_cached_attention_impls.py.)"""
    cfg, params = dg_ours
    cfg = cfg.replace(moe_impl=moe_impl, cached_attention_impl=attention)
    L, lengths = cfg.block_length, [11, 6]
    _, padded = _left_padded(lengths, 80)
    p = padded.shape[1]
    canvas, block = jnp.asarray(_tokens((2, L), 81)), jnp.asarray(_tokens((2, L), 82))
    _, embeds = _self_cond_input(params, cfg, np.asarray(canvas), 83)
    prompt = (jnp.asarray(padded), jnp.asarray(lengths, jnp.int32))

    def passes():  # the three passes' outputs and each pass's experts_mlp rows, call by call
        rows = []
        record = lambda x, *a, **k: rows[-1].append(x.shape[0]) or experts_mlp(x, *a, **k)  # noqa: E731
        fresh = lambda f, **k: jax.jit(lambda *a, **kw: f(*a, **kw), **k)  # noqa: E731  (traced anew: the switch)
        with um.patch.object(dg, "experts_mlp", record):
            rows.append([])
            out = fresh(dg.prefill, static_argnums=(1, 4))(params, cfg, *prompt, p + 2 * L)
            rows.append([])
            fused = fresh(dg.prefill_decode, static_argnums=(1, 4))(params, cfg, *prompt, p + 2 * L, canvas)
            rows.append([])
            commit = fresh(dg.commit_decode, static_argnums=(1,))(params, cfg, block, fused[1], canvas, embeds=embeds)
        return (out, fused, commit), rows

    want, trimmed = passes()
    monkeypatch.setattr(dg, "TRIM_LAST_LAYER", False)
    got, untrimmed = passes()
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5, rtol=0)
    for t, u, n, kept in zip(trimmed, untrimmed, (p, p + L, 2 * L), (1, L, L), strict=True):
        assert set(u) == {2 * n} and t == u[:-1] + [2 * kept]  # batch 2: the last layer's rows only


def test_prefill_decode_refuses(dg_ours):
    cfg, params = dg_ours
    prompt = jnp.asarray(_tokens((2, 6), 1))
    with pytest.raises(ValueError, match="cache_size=4"):
        dg.prefill_decode(params, cfg, prompt, jnp.asarray([6, 6]), 4, jnp.asarray(_tokens((2, 8), 2)))
    with pytest.raises(ValueError, match="canvas has 1 rows"):
        dg.prefill_decode(params, cfg, prompt, jnp.asarray([6, 6]), 14, jnp.asarray(_tokens((1, 8), 2)))


def test_bf16_logits_round_the_head_product_before_the_soft_cap(dg_ours):
    """As transformers' forward: lm_head in the model dtype (one rounding of the float32 sums), then float32,
    / cap, tanh, * cap. Keeping the float32 sums would give other logits (the check can fail)."""
    cfg, params = dg_ours
    p16 = jax.tree.map(lambda a: a.astype(jnp.bfloat16), params)
    h = jax.random.normal(jax.random.key(0), (2, 5, cfg.hidden_size), jnp.bfloat16)
    head = p16["embed"] if cfg.tie_word_embeddings else p16["lm_head"]
    cap = cfg.final_logit_softcapping
    sums = jnp.einsum("bld,vd->blv", h, head, preferred_element_type=jnp.float32)
    want = jnp.tanh(sums.astype(jnp.bfloat16).astype(jnp.float32) / cap) * cap
    got = dg.logits(p16, cfg, h)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
    assert np.abs(np.asarray(got) - np.asarray(jnp.tanh(sums / cap) * cap)).max() > 1e-4


def test_soft_embed_of_the_samplers_unnormalized_probs(dg_ours):
    """generate()'s form of the soft embedding: UniformSampler's StepOut.probs = exp(x - max), the row's 1 / sum
    applied to the float32 product after the GEMM, equals the soft embedding of softmax(x) (fp32)."""
    cfg, params = dg_ours
    sampler = UniformSampler()
    x = jnp.asarray(np.random.default_rng(33).normal(0, 3, (2, cfg.block_length, cfg.vocab_size)), jnp.float32)
    canvas, state = sampler.init(jax.random.key(0), 2, cfg.block_length, cfg)
    out = sampler.step(x, canvas, state, jax.random.key(1), 5, jnp.ones((2,), bool))
    assert out.probs_scale is not None and float(jnp.max(out.probs)) == 1.0
    want = np.asarray(_soft(params, cfg, jax.nn.softmax(x / sampler.temperature(5), axis=-1)))
    got = np.asarray(dg.soft_embed(params, cfg, out.probs, out.probs_scale))
    assert np.abs(want).max() > 1e-2
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_window_and_self_conditioning_matter(dg_ours, dg_hf):
    """The parity above is not vacuous: a wider window, or dropping the self-conditioning input, changes the
    logits well beyond the tolerance."""
    cfg, params = dg_ours
    model, _ = dg_hf
    prompt, canvas = _tokens((11,), 30), _tokens((cfg.block_length,), 31)
    sc = np.random.default_rng(32).normal(0, 3, (cfg.block_length, cfg.vocab_size)).astype(np.float32)
    ref = _hf_row(model, prompt, [canvas], [sc], [])[0]
    wide = cfg.replace(sliding_window=64)
    _, cache = dg.prefill(params, wide, jnp.asarray(prompt[None]), jnp.asarray([11]), 11 + cfg.block_length)
    z = _soft(params, cfg, jax.nn.softmax(jnp.asarray(sc[None]), axis=-1))
    assert np.abs(np.asarray(dg.decode(params, wide, jnp.asarray(canvas[None]), cache, residual=z))[0]
                  - ref).max() > 1e-2
    _, cache = _prefill(params, cfg, jnp.asarray(prompt[None]), jnp.asarray([11], jnp.int32), 11 + cfg.block_length)
    assert np.abs(np.asarray(_decode(params, cfg, jnp.asarray(canvas[None]), cache))[0] - ref).max() > 1e-2


def test_residual_embed_forms(dg_ours):
    """embed == residual_embed with w = 0 == residual_embed with z = 0 (SC(0) = 0): HF's decoder input without
    self-conditioning logits, so a block's first step needs no special case."""
    cfg, params = dg_ours
    tokens = jnp.asarray(_tokens((2, cfg.block_length), 40))
    z = jax.random.normal(jax.random.key(0), (2, cfg.block_length, cfg.hidden_size))
    e = dg.embed(params, cfg, tokens)
    np.testing.assert_allclose(dg.residual_embed(params, cfg, tokens, z, jnp.zeros(tokens.shape)), e, atol=1e-6)
    np.testing.assert_allclose(dg.residual_embed(params, cfg, tokens, jnp.zeros_like(z), jnp.ones(tokens.shape)), e,
                               atol=1e-6)


def test_moe_matches_dense_loop():
    """The ragged dispatch equals the per-token loop over its chosen experts (what HF computes)."""
    rng = np.random.default_rng(0)
    T, D, E, F, k = 10, 6, 5, 4, 2
    x = rng.normal(size=(T, D)).astype(np.float32)
    gu, dn = rng.normal(size=(E, D, 2 * F)).astype(np.float32), rng.normal(size=(E, F, D)).astype(np.float32)
    experts = np.stack([rng.choice(E, k, replace=False) for _ in range(T)]).astype(np.int32)
    weights = rng.random((T, k)).astype(np.float32)
    out = np.asarray(experts_mlp(jnp.asarray(x), jnp.asarray(weights), jnp.asarray(experts), jnp.asarray(gu),
                                 jnp.asarray(dn), "gelu_tanh"))
    gelu = lambda v: np.asarray(jax.nn.gelu(jnp.asarray(v), approximate=True))
    ref = np.zeros_like(x)
    for t in range(T):
        for j in range(k):
            e = experts[t, j]
            h = x[t] @ gu[e]
            ref[t] += weights[t, j] * ((gelu(h[:F]) * h[F:]) @ dn[e])
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


def test_router_equals_softmax_topk_renormalized_in_bf16(monkeypatch):
    """moe.route in bf16, its top-k on the bf16 logits (moe.ROUTER_TOPK_F32 = False), then a float32 softmax over
    k, gives HF's choice and weights (softmax over all experts in float32, top-k, renormalized, per-expert scales),
    ties included (exactly equal logits keep the lower expert first), and the same as top-k after a float32 cast
    (the default)."""
    from orl_jax.model import moe

    rng = np.random.default_rng(3)
    T, D, E, k = 12, 16, 8, 3
    x = jnp.asarray(rng.normal(size=(T, D)), jnp.bfloat16)
    proj = rng.normal(size=(D, E)).astype(np.float32)
    proj[:, 5] = proj[:, 2]  # experts 2 and 5 always tie
    proj = jnp.asarray(proj, jnp.bfloat16)
    scale, eps = jnp.asarray(1 + 0.1 * rng.normal(size=D), jnp.bfloat16), 1e-6
    expert_scale = jnp.asarray(rng.uniform(0.5, 1.5, size=E), jnp.bfloat16)
    monkeypatch.setattr(moe, "ROUTER_TOPK_F32", False)
    w, e = moe.route(x, scale, proj, expert_scale, k, eps)
    h = moe.rms_norm_fp32(x, None, eps) * scale[None] * (D ** -0.5)
    probs = np.asarray(jax.nn.softmax(jnp.einsum("td,de->te", h, proj).astype(jnp.float32), axis=-1))
    want_e = np.argsort(-probs, axis=-1, kind="stable")[:, :k]
    want_w = np.take_along_axis(probs, want_e, axis=-1)
    want_w = want_w / want_w.sum(-1, keepdims=True) * np.asarray(expert_scale, np.float32)[want_e]
    np.testing.assert_array_equal(np.asarray(e), want_e)
    np.testing.assert_allclose(np.asarray(w), want_w, rtol=1e-6, atol=1e-6)
    assert ((want_e == 2) | (want_e == 5)).any()  # the tie is exercised
    monkeypatch.setattr(moe, "ROUTER_TOPK_F32", True)
    w32, e32 = moe.route(x, scale, proj, expert_scale, k, eps)
    np.testing.assert_array_equal(np.asarray(e32), np.asarray(e))
    np.testing.assert_array_equal(np.asarray(w32), np.asarray(w))


# --- checkpoints ---------------------------------------------------------------------------------------------

def _text_tensors(directory):
    t = {}
    for f in sorted(directory.glob("*.safetensors")):
        t.update(load_file(str(f)))
    return {k: v for k, v in t.items() if not k.startswith(DG_SKIPPED_PREFIXES)}


def test_round_trip_exact(dg_ours, dg_hf, tmp_path):
    """HF -> ours -> HF: the same text tensors bit for bit, config and generation config round-trip, and
    transformers loads the export into the same model (the vision tower is not exported)."""
    from transformers import DiffusionGemmaForBlockDiffusion

    cfg, params = dg_ours
    model, src = dg_hf
    out = save_hf(tmp_path / "export", cfg, params)
    orig, back = _text_tensors(src), _text_tensors(out)
    assert sorted(orig) == sorted(back)
    assert len(orig) < len(load_file(str(src / "model.safetensors")))  # the source had vision weights
    for name, t in orig.items():
        assert back[name].dtype == t.dtype and bool((back[name] == t).all()), name
    cfg2, params2 = load_hf(out, dtype="float32")
    assert cfg2 == cfg
    jax.tree.map(np.testing.assert_array_equal, params2, params)
    hf = json.loads(json.dumps(cfg.to_hf_config()))
    assert DiffusionGemmaConfig.from_hf_config(hf, cfg.to_hf_generation_config(), dtype="float32") == cfg

    # transformers builds the same model from the export: every text tensor of its state dict (encoder copies and
    # buffers included) is bit-equal; logits agree to float rounding (CPU kernels' results depend on how the loaded
    # tensors happen to be aligned, so they are not compared bit for bit)
    model1 = DiffusionGemmaForBlockDiffusion.from_pretrained(src, attn_implementation="eager").eval()
    model2 = DiffusionGemmaForBlockDiffusion.from_pretrained(out, attn_implementation="eager").eval()
    assert model2.generation_config.max_denoising_steps == cfg.max_denoising_steps
    sd1, sd2 = model1.state_dict(), model2.state_dict()
    assert sorted(sd1) == sorted(sd2)
    for name, t in sd1.items():
        assert name.startswith(("model.encoder.vision_tower.", "model.encoder.embed_vision.")) or \
            torch.equal(t, sd2[name]), name
    prompt, canvas = _tokens((1, 9), 50), _tokens((1, cfg.block_length), 51)
    with torch.no_grad():
        a = model(input_ids=_torch(prompt), decoder_input_ids=_torch(canvas)).logits
        b = model2(input_ids=_torch(prompt), decoder_input_ids=_torch(canvas)).logits
    assert (a - b).abs().max() < 1e-5


def test_transposed_projections_keep_the_logits(dg_ours, dg_hf, monkeypatch):
    """diffusion_gemma_inference.transposed_projections (TRANSPOSED_PROJECTIONS): o and the dense down stored as
    [out, in] give prefill_decode's logits the model's layout gives (float32: the same products and sums, up to the
    order XLA adds them) and transformers' rows (1e-4); inference_params applies them under the switch; the copies
    are what is read; a second transpose is refused."""
    cfg, params = dg_ours
    monkeypatch.setattr(dgi, "TRANSPOSED_PROJECTIONS", True)
    with_t = dgi.inference_params(params, cfg.replace(moe_impl="bucketed"))
    names = ["o", "down"]
    assert dgi.applied(with_t) == ["transposed o", "transposed down"]
    assert dgi.applied(params) == []
    for t in ("sliding", "full"):
        for n in names:
            if n in params[t]:
                assert n not in with_t[t]
                np.testing.assert_array_equal(np.asarray(with_t[t][n + "_t"]),
                                              np.asarray(params[t][n]).transpose(dgi.TRANSPOSES[n]))
    with pytest.raises(ValueError, match="transposed already"):
        dgi.transposed_projections(with_t)
    with pytest.raises(ValueError, match="unknown names.*'router'"):
        dgi.transposed_projections(params, ("o", "router"))
    monkeypatch.setattr(dgi, "TRANSPOSED_PROJECTIONS", "auto")  # the default: on a GPU only
    kept = dgi.inference_params(params, cfg.replace(moe_impl="bucketed")) is params
    assert kept == (jax.default_backend() != "gpu")
    monkeypatch.setattr(dgi, "TRANSPOSED_PROJECTIONS", "yes")
    with pytest.raises(ValueError, match="TRANSPOSED_PROJECTIONS.*'yes'"):
        dgi.inference_params(params, cfg)
    model, _ = dg_hf
    lengths = [11, 6]
    prompts, padded = _left_padded(lengths, 82)
    canvas = _tokens((2, cfg.block_length), 83)
    pd = jax.jit(dg.prefill_decode, static_argnums=(1, 4))
    args = (jnp.asarray(padded), jnp.asarray(lengths, jnp.int32), max(lengths) + cfg.block_length, jnp.asarray(canvas))
    (got, _), (want, _) = (pd(p, cfg, *args) for p in (with_t, params))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=0)
    for t in ("sliding", "full"):  # each copy is what is read: reversing its last axis changes the logits
        for n in names:
            if n + "_t" in with_t[t]:
                flipped = with_t | {t: with_t[t] | {n + "_t": with_t[t][n + "_t"][..., ::-1]}}
                other, _ = pd(flipped, cfg, *args)
                assert np.abs(np.asarray(other) - np.asarray(want)).max() > 1e-3, (t, n)
    for r in range(2):
        assert np.abs(np.asarray(got)[r] - _hf_row(model, prompts[r], [canvas[r]], [None], [])[0]).max() < 1e-4


def test_export_refuses_inference_params(dg_ours, tmp_path):
    """save_hf of params from inference_params (folded norms, the fused expert layout, transposed projections) names
    the cause and leaves no directory behind."""
    cfg, params = dg_ours
    for p, what in ((dgi.fold_attention_norms(params), "attn_norm"), (dgi.fold_ffw_norms(params), "moe_norm"),
                    (params | {"sliding": params["sliding"] | {"experts_gate_up": params["sliding"][
                        "experts_gate_up"][..., None]}}, "fused expert layout"),
                    (dgi.transposed_projections(params), "transposed o")):
        with pytest.raises(ValueError, match=f"inference params.*{what}|{what}.*export"):
            save_hf(tmp_path / "export", cfg, p)
        assert not (tmp_path / "export").exists()


def _copy_with(src, dst, edit_tensors=None, edit_config=None):
    dst.mkdir()
    tensors = dict(load_file(str(src / "model.safetensors")))
    if edit_tensors:
        tensors = edit_tensors(tensors)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst / "model.safetensors"),
              metadata={"format": "pt"})
    c = json.loads((src / "config.json").read_text())
    if edit_config:
        edit_config(c)
    (dst / "config.json").write_text(json.dumps(c))
    return dst


def _drop(name):
    return lambda t: {k: v for k, v in t.items() if k != name}


LAYER = "model.decoder.layers"
BAD_CHECKPOINTS = [
    (_drop(f"{LAYER}.4.self_attn.v_proj.weight"), rf"missing tensor '{LAYER}\.4\.self_attn\.v_proj"),
    (_drop(f"{LAYER}.5.experts.gate_up_proj"), rf"missing tensor '{LAYER}\.5\.experts\.gate_up_proj'"),
    (_drop("model.encoder.language_model.layers.2.layer_scalar"), r"missing tensor 'model\.encoder\..*2\.layer_sc"),
    (_drop("model.decoder.self_conditioning.pre_norm.weight"), "missing tensor 'model.decoder.self_conditioning"),
    (lambda t: t | {f"{LAYER}.2.self_attn.v_proj.weight": t[f"{LAYER}.1.self_attn.k_proj.weight"].clone()},
     rf"unexpected tensor '{LAYER}\.2\.self_attn\.v_proj"),  # a full layer has no v_proj (K = V)
    (lambda t: t | {f"{LAYER}.0.experts.down_proj": t[f"{LAYER}.0.experts.down_proj"].transpose(1, 2).clone()},
     rf"tensor '{LAYER}\.0\.experts\.down_proj' has shape"),
    (lambda t: t | {"model.encoder.language_model.norm.weight": t["model.decoder.norm.weight"] + 1},
     r"model\.encoder\.language_model\.norm\.weight.*differs"),
    (lambda t: t | {"model.encoder.language_model.extra.weight": torch.zeros(3)}, "unexpected tensor"),
]


@pytest.mark.parametrize("edit,match", BAD_CHECKPOINTS)
def test_bad_checkpoint_named(dg_hf, tmp_path, edit, match):
    d = _copy_with(dg_hf[1], tmp_path / "d", edit_tensors=edit)
    with pytest.raises(ValueError, match=match):
        load_hf(d, dtype="float32")


def test_tied_copies_accepted_and_vision_skipped(dg_hf, dg_ours, tmp_path):
    """Redundant encoder copies equal to their decoder twins load; vision weights are skipped by name."""
    def add(t):
        t = dict(t)
        t["model.encoder.language_model.norm.weight"] = t["model.decoder.norm.weight"].clone()
        t["model.encoder.language_model.embed_tokens.weight"] = t["model.decoder.embed_tokens.weight"].clone()
        assert any(k.startswith("model.encoder.vision_tower.") for k in t)
        return t

    _, params = load_hf(_copy_with(dg_hf[1], tmp_path / "d", edit_tensors=add), dtype="float32")
    jax.tree.map(np.testing.assert_array_equal, params, dg_ours[1])


def _set_text(**kw):
    return lambda c: c["text_config"].update(kw)


@pytest.mark.parametrize("edit,match", [
    (_set_text(use_bidirectional_attention="all"), "use_bidirectional_attention"),
    (_set_text(hidden_activation="silu"), "hidden_activation"),
    (_set_text(attention_bias=True), "attention_bias"),
    (_set_text(num_experts=None), "num_experts"),
    (_set_text(layer_types=[SLIDING, FULL, SLIDING, SLIDING, SLIDING, FULL], per_layer_config={}), "layer_types"),
    (_set_text(top_k_experts=9), "top_k_experts"),
    (_set_text(num_attention_heads=3), "num_heads"),
    (lambda c: c["text_config"]["rope_parameters"][FULL].update(rope_type="yarn"), "rope_type='yarn'"),
])
def test_unsupported_config(dg_hf, tmp_path, edit, match):
    d = _copy_with(dg_hf[1], tmp_path / "d", edit_config=edit)
    with pytest.raises(ValueError, match=match):
        load_hf(d, dtype="float32")


def test_per_layer_config_form_and_generation_config(dg_hf, tmp_path):
    """transformers >= 5.24 writes per_layer_config instead of global_head_dim; generation_config.json gives the
    sampler defaults and the EOS list, which make_sampler / generate pick up."""
    src = dg_hf[1]
    saved = json.loads((src / "config.json").read_text())["text_config"]
    assert "per_layer_config" in saved or "global_head_dim" in saved
    d = _copy_with(src, tmp_path / "d", edit_config=lambda c: (
        c["text_config"].pop("global_head_dim", None), c["text_config"].pop("num_global_key_value_heads", None),
        c["text_config"].update(per_layer_config={"2": {"head_dim": 16, "num_key_value_heads": 1},
                                                  "5": {"head_dim": 16, "num_key_value_heads": 1}})))
    (d / "generation_config.json").write_text(json.dumps({
        "max_denoising_steps": 12, "t_min": 0.3, "t_max": 0.9, "stability_threshold": 2,
        "confidence_threshold": 0.01,
        "sampler_config": {"_cls_name": "EntropyBoundSamplerConfig", "entropy_bound": 0.2},
        "eos_token_id": [1, 106], "pad_token_id": 0}))
    cfg, _ = load_hf(d, dtype="float32")
    assert (cfg.global_head_dim, cfg.num_global_kv_heads) == (16, 1)
    assert cfg.eos_token_ids == (1, 106)
    assert make_sampler(cfg) == UniformSampler(t_max=0.9, t_min=0.3, max_denoising_steps=12, entropy_bound=0.2,
                                               stability=2, confidence=0.01)
    assert make_sampler(TINY) == UniformSampler()  # no generation_config: transformers' global defaults
    with pytest.raises(ValueError, match="per_layer_config"):
        load_hf(_copy_with(src, tmp_path / "e", edit_config=_set_text(
            per_layer_config={"2": {"head_dim": 16}, "5": {"head_dim": 32}})), dtype="float32")


@pytest.mark.parametrize("kw,match", [
    (dict(layer_types=(SLIDING,) * 6), "layer_types"),
    (dict(num_global_kv_heads=3), "num_global_kv_heads"),
    (dict(global_head_dim=15), "global_head_dim"),
    (dict(top_k_experts=0), "top_k_experts"),
    (dict(sliding_window=0), "sliding_window"),
    (dict(final_logit_softcapping=-1.0), "final_logit_softcapping"),
    (dict(t_min=0.9), "t_min"),
    (dict(eos_token_ids=(300,)), "eos_token_ids"),
    (dict(dtype="float64"), "dtype"),
])
def test_config_rejects(kw, match):
    with pytest.raises(ValueError, match=match):
        TINY.replace(**kw)


def test_image_inputs_refused(dg_ours):
    cfg, params = dg_ours
    with pytest.raises(ValueError, match="image_token_id=250"):
        generate(params, cfg, [[5, 6, cfg.image_token_id]], key=jax.random.key(0), max_new_tokens=8)
    with pytest.raises(ValueError, match="image"):
        dg.prefill(params, cfg, jnp.asarray([[5, cfg.image_token_id]], jnp.int32), jnp.asarray([2]), 16)
    # a canvas or a generated block may hold any id (the canvas starts uniformly random)
    dg.check_tokens(jnp.asarray([[5, cfg.image_token_id]], jnp.int32), cfg, "canvas")


# --- generate() against transformers' generate() --------------------------------------------------------------

class _EngineDraws:
    """Stand-ins for torch.randint / torch.multinomial that replay the engine's jax.random draws, in the order HF's
    generate makes them: a block's initial canvas, then per step one categorical sample and one re-noise draw.
    Engine keys: key, k_init = split(key); each step key, k_step, k_init = split(key, 3) and
    k_sample, k_noise = split(k_step); a new block's canvas uses the k_init of the step that finished the last."""

    def __init__(self, key, rng: str):
        self.key, self.k_init = jax.random.split(key)
        self.k_noise = None
        self.rng = rng

    def randint(self, low=0, high=None, size=None, **kw):
        k, self.k_noise = (self.k_noise, None) if self.k_noise is not None else (self.k_init, None)
        return torch.from_numpy(np.array(jax.random.randint(k, tuple(size), low, high, jnp.int32))).long()

    def multinomial(self, probs, num_samples, **kw):
        self.key, k_step, self.k_init = jax.random.split(self.key, 3)
        k_sample, self.k_noise = jax.random.split(k_step)
        # HF's [B * L, V] rows draw as the engine's [B, L, V]: jax.random's draws are laid out row-major either way
        logp = jnp.log(jnp.asarray(probs.numpy()))
        return torch.from_numpy(np.array(categorical(k_sample, logp, self.rng))).long()[:, None]


def test_categorical_is_gumbel_argmax():
    """rng="threefry" is jax.random.categorical: argmax(gumbel(k, shape) + logits)."""
    k = jax.random.key(5)
    logits = jax.random.normal(jax.random.key(6), (3, 4, 50)) * 3
    g = jax.random.gumbel(k, logits.shape, jnp.float32)
    np.testing.assert_array_equal(categorical(k, logits, "threefry"), jnp.argmax(g + logits, axis=-1))


@pytest.fixture(scope="session")
def sharp(dg_hf, dg_ours):
    """The tiny model with a 10x embedding, so that distributions are peaked enough for rows to stop early."""
    model = copy.deepcopy(dg_hf[0])
    with torch.no_grad():
        model.model.decoder.embed_tokens.weight.mul_(10.0)
    cfg, params = dg_ours
    return model, cfg, dict(params, embed=params["embed"] * 10.0)


GEN = dict(max_denoising_steps=8, t_min=0.4, t_max=0.8, entropy_bound=100.0, stability=1, confidence=1.5)
KEY_CDF = 8  # a key whose inverse-CDF draws let rows stop early (after 16 and 23 of 24 forwards)


def _hf_generate(model, prompts, key, eos, rng: str = UniformSampler.rng):
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import EntropyBoundSamplerConfig

    draws = _EngineDraws(key, rng)
    with um.patch.object(torch, "randint", draws.randint), um.patch.object(torch, "multinomial", draws.multinomial):
        return model.generate(
            _torch(prompts), max_new_tokens=24, max_denoising_steps=GEN["max_denoising_steps"], t_min=GEN["t_min"],
            t_max=GEN["t_max"], sampler_config=EntropyBoundSamplerConfig(entropy_bound=GEN["entropy_bound"]),
            stability_threshold=GEN["stability"], confidence_threshold=GEN["confidence"], eos_token_id=eos,
            pad_token_id=0)


@pytest.mark.parametrize("rng,seed,fused,sliding_loop", [
    ("inverse_cdf", KEY_CDF, True, "while"), ("threefry", 3, True, "while"), ("inverse_cdf", KEY_CDF, False, "while"),
    ("inverse_cdf", KEY_CDF, True, "unrolled")])
def test_generate_matches_transformers(sharp, rng, seed, fused, sliding_loop, monkeypatch):
    """3 blocks of 8 tokens, 2 rows: every token, the per-row forward counts (through tokens_per_forward) and the
    early per-row stops equal transformers' generate() run with the engine's random draws. generate() defaults to
    self-conditioning for DiffusionGemma, as transformers always does. fused (the defaults): the prompt's prefill
    and the first step in one pass, and each commit with the next block's first step (engine.FUSED_FIRST_STEP,
    FUSED_COMMIT; each fused pass traced once per generate()), else separate passes. sliding_loop:
    diffusion_gemma.SLIDING_LOOP (the cached passes' sliding layers as a loop or at static indices). The soft
    embeddings that run are counted: one per step."""
    from orl_jax.decode import engine

    model, cfg, params = sharp
    prompts = np.stack([_tokens((7,), 60), _tokens((7,), 61)])
    sampler = UniformSampler(**GEN, rng=rng)
    monkeypatch.setattr(engine, "FUSED_FIRST_STEP", fused)
    monkeypatch.setattr(engine, "FUSED_COMMIT", fused)
    monkeypatch.setattr(dg, "SLIDING_LOOP", sliding_loop)
    embeds, real_embed = [], engine.soft_embed

    def counted_embed(*a):
        jax.debug.callback(lambda: embeds.append(1))
        return real_embed(*a)

    monkeypatch.setattr(engine, "soft_embed", counted_embed)
    calls = []
    for name, real in (("prefill_decode", _real_prefill_decode), ("commit_decode", _real_commit_decode)):
        monkeypatch.setattr(dg, name, lambda *a, _n=name, _f=real, **k: calls.append(_n) or _f(*a, **k))
    jax.clear_caches()  # the switches are read at trace time
    out = generate(params, cfg, prompts, key=jax.random.key(seed), max_new_tokens=24, sampler=sampler,
                   pad_token_id=0, eos_token_id=())
    assert sorted(calls) == (["commit_decode", "prefill_decode"] if fused else [])
    assert int(out.commits) == 2
    jax.effects_barrier()
    assert len(embeds) == int(out.total_forwards)
    ref = _hf_generate(model, prompts, jax.random.key(seed), eos=None, rng=rng)
    np.testing.assert_array_equal(np.asarray(out.tokens), ref.sequences[:, 7:].numpy())
    np.testing.assert_allclose(np.asarray(out.tpf_hf), ref.tokens_per_forward.numpy(), rtol=1e-6)
    assert np.asarray(out.forwards).min() < 3 * GEN["max_denoising_steps"]  # some row stopped early


def test_fused_passes_keep_capture_and_streaming(dg_ours, monkeypatch):
    """What the ORL trainer and a streamer read is the same with and without the fused passes: the capture records
    (float32: up to rounding) and the streamed blocks, also when a block ends in the first step, which runs before
    the loop (max_steps=1)."""
    from orl_jax.decode import engine

    cfg, params = dg_ours
    prompts = [_tokens((5,), 70).tolist(), _tokens((7,), 71).tolist()]
    runs = {}
    for fused in (True, False):
        monkeypatch.setattr(engine, "FUSED_FIRST_STEP", fused)
        monkeypatch.setattr(engine, "FUSED_COMMIT", fused)
        jax.clear_caches()
        for steps in (1, 3):
            seen = []
            out = generate(params, cfg, prompts, key=jax.random.key(5), max_new_tokens=16, eos_token_id=(),
                           sampler=UniformSampler(max_denoising_steps=steps), capture=steps == 3,
                           streamer=lambda t, i, seen=seen: seen.append((i, t)))
            assert [i for i, _ in seen] == [0, 1]
            for i, t in seen:
                np.testing.assert_array_equal(t, np.asarray(out.tokens)[:, 8 * i:8 * i + 8])
            runs[fused, steps] = out
    for steps in (1, 3):
        np.testing.assert_array_equal(np.asarray(runs[True, steps].tokens), np.asarray(runs[False, steps].tokens))
    a, b = runs[True, 3].capture, runs[False, 3].capture
    for k in a:
        np.testing.assert_allclose(np.asarray(a[k], np.float32), np.asarray(b[k], np.float32), atol=1e-5, rtol=0)


def test_generate_eos_matches_transformers(sharp):
    """One row with an EOS in its second block: padding after the EOS, the early end and tokens_per_forward."""
    model, cfg, params = sharp
    prompt = _tokens((1, 7), 62)
    sampler = UniformSampler(**GEN)
    free = _hf_generate(model, prompt, jax.random.key(4), eos=None).sequences[0, 7:].numpy()
    eos = next(int(t) for t in free[10:16] if t not in free[:10] and t != 0)
    out = generate(params, cfg, prompt, key=jax.random.key(4), max_new_tokens=24, sampler=sampler, pad_token_id=0,
                   eos_token_id=eos)
    ref = _hf_generate(model, prompt, jax.random.key(4), eos=eos)
    seq = ref.sequences[0, 7:].numpy()
    assert len(seq) == 16  # transformers stopped after the EOS block
    toks = np.asarray(out.tokens)[0]
    np.testing.assert_array_equal(toks, np.pad(seq, (0, 24 - len(seq))))
    first = int(np.argmax(toks == eos))
    assert 8 <= first < 16 and np.all(toks[first + 1:] == 0) and int(out.lengths[0]) == first + 1
    np.testing.assert_allclose(np.asarray(out.tpf_hf), ref.tokens_per_forward.numpy(), rtol=1e-6)


# --- the real shape ------------------------------------------------------------------------------------------

# google/diffusiongemma-26B-A4B-it's config.json, text part (keys as transformers' DiffusionGemmaTextConfig reads).
REAL_CONFIG = {
    "architectures": ["DiffusionGemmaForBlockDiffusion"], "model_type": "diffusion_gemma", "canvas_length": 256,
    "tie_word_embeddings": True, "image_token_id": 258880, "boi_token_id": 255999, "eoi_token_id": 258882,
    "text_config": {
        "model_type": "diffusion_gemma_text", "vocab_size": 262144, "hidden_size": 2816, "num_hidden_layers": 30,
        "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256, "global_head_dim": 512,
        "num_global_key_value_heads": 2, "attention_k_eq_v": True, "intermediate_size": 2112,
        "enable_moe_block": True, "num_experts": 128, "top_k_experts": 8, "moe_intermediate_size": 704,
        "hidden_activation": "gelu_pytorch_tanh", "sliding_window": 1024, "final_logit_softcapping": 30.0,
        "layer_types": ([SLIDING] * 5 + [FULL]) * 5, "max_position_embeddings": 262144, "rms_norm_eps": 1e-6,
        "rope_parameters": {FULL: {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0, "rope_type": "proportional"},
                            SLIDING: {"rope_theta": 10000.0, "rope_type": "default"}},
        "attention_bias": False, "use_bidirectional_attention": "vision", "tie_word_embeddings": True,
        "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2,
    },
    "vision_config": {"model_type": "gemma4_vision"},
}


def test_26b_a4b_instantiates_abstractly():
    """The real config: ~25.25 B text parameters (+ the ~0.17 B vision tower transformers counts = ~25.4 B),
    ~3.8 B active per token, and a decoder step traces at full size (abstractly: no memory, no compile)."""
    from transformers import AutoConfig, AutoModel

    cfg = DiffusionGemmaConfig.from_hf_config(REAL_CONFIG, dtype="bfloat16")
    assert cfg == DG_PRESETS["diffusiongemma-26b-a4b"].replace(
        eos_token_ids=(1,), vision_config_json=cfg.vision_config_json)
    specs = dg.param_specs(cfg)
    abstract = jax.eval_shape(lambda k: P.init(specs, k), jax.random.key(0))
    n = sum(x.size for x in jax.tree.leaves(abstract))
    experts = sum(abstract[s][w].size for s in ("sliding", "full") for w in ("experts_gate_up", "experts_down"))
    assert abs(n - 25.251e9) < 0.01e9, n
    assert abs(n - experts + experts * 8 / 128 - 3.84e9) < 0.02e9
    with torch.device("meta"):
        vision = AutoModel.from_config(AutoConfig.for_model("gemma4_vision"))
    n_vision = sum(p.numel() for p in vision.parameters()) + 2816 * vision.config.hidden_size  # + embed_vision
    assert abs(n + n_vision - 25.4e9) < 0.05e9, (n, n_vision)
    assert abstract["full"]["qk"].shape == (5, 2816, 2, 9, 512) and "qkv" not in abstract["full"]  # K = V
    assert abstract["sliding"]["qkv"].shape == (25, 2816, 8, 4, 256)
    assert abstract["sliding"]["gate_up"].shape == (25, 2816, 2, 2112)

    cache = jax.eval_shape(lambda: dg.init_cache(cfg, 1, 2048))
    out = jax.eval_shape(lambda p, c, x: dg.decode(p, cfg, x, c), abstract, cache,
                         jax.ShapeDtypeStruct((1, 256), jnp.int32))
    assert out.shape == (1, 256, 262144) and out.dtype == jnp.float32


def test_dense_and_grouped_expert_paths_agree():
    """The decode-size dense path (all experts, unchosen weighted 0) equals the grouped ragged_dot path and the
    bucketed path (each expert's tokens in capacity slots)."""
    from orl_jax.model import moe

    ks = jax.random.split(jax.random.key(11), 5)
    t, d, e, f, k = 64, 16, 16, 12, 2
    x = jax.random.normal(ks[0], (t, d))
    gate_up = jax.random.normal(ks[1], (e, d, 2 * f)) * 0.3
    down = jax.random.normal(ks[2], (e, f, d)) * 0.3
    experts = jax.vmap(lambda kk: jax.random.choice(kk, e, (k,), replace=False))(jax.random.split(ks[3], t))
    weights = jax.nn.softmax(jax.random.normal(ks[4], (t, k)), axis=-1)
    dense = moe.dense_experts_mlp(x, weights, experts, gate_up, down, "gelu_tanh")
    grouped = moe.grouped_experts_mlp(x, weights, experts, gate_up, down, "gelu_tanh")
    np.testing.assert_allclose(np.asarray(dense), np.asarray(grouped), atol=1e-5)
    assert float(jnp.abs(dense).max()) > 0.1
    c = moe.capacity(t, k, e)
    assert c < t and int(jnp.bincount(experts.reshape(-1), length=e).max()) <= c  # this routing fits the slots
    bucketed = moe.bucketed_experts_mlp(x, weights, experts, gate_up, down, "gelu_tanh", c)
    np.testing.assert_allclose(np.asarray(bucketed), np.asarray(dense), atol=1e-5)
    np.testing.assert_allclose(np.asarray(jax.jit(moe.experts_mlp, static_argnums=5)(
        x, weights, experts, gate_up, down, "gelu_tanh")), np.asarray(dense), atol=1e-5)


def test_overloaded_experts_take_further_rounds():
    """An expert routed more tokens than it has slots takes them in further rounds; still exact (the dense path)."""
    from orl_jax.model import moe

    ks = jax.random.split(jax.random.key(12), 4)
    t, d, e, f, k = 64, 32, 32, 16, 2
    x = jax.random.normal(ks[0], (t, d))
    gate_up, down = jax.random.normal(ks[1], (e, d, 2 * f)), jax.random.normal(ks[2], (e, f, d))
    # expert 0 takes every token, expert 1 every other one, the rest share what is left
    second = jnp.where(jnp.arange(t) % 2 == 0, 1, jnp.arange(t) % (e - 2) + 2).astype(jnp.int32)
    experts = jnp.stack([jnp.zeros(t, jnp.int32), second], axis=1)
    c = moe.capacity(t, k, e)
    assert t > 2 * c and t // 2 > c  # expert 0 needs 3+ rounds, expert 1 2+
    weights = jax.nn.softmax(jax.random.normal(ks[3], (t, k)), axis=-1)
    dense = moe.dense_experts_mlp(x, weights, experts, gate_up, down, "gelu_tanh")
    f_ = jax.jit(moe.bucketed_experts_mlp, static_argnums=(5, 6))
    got = f_(x, weights, experts, gate_up, down, "gelu_tanh", c)
    np.testing.assert_allclose(np.asarray(got), np.asarray(dense), atol=1e-4, rtol=1e-5)
    one = moe.bucketed_experts_mlp(x, weights, experts, gate_up, down, "gelu_tanh", c)
    balanced = jnp.stack([jnp.arange(t) % e, (jnp.arange(t) + 1) % e], axis=1).astype(jnp.int32)
    np.testing.assert_allclose(np.asarray(one), np.asarray(got), atol=1e-4, rtol=1e-5)  # eager too
    np.testing.assert_allclose(  # no overflow: the first round alone
        np.asarray(f_(x, weights, balanced, gate_up, down, "gelu_tanh", c)),
        np.asarray(moe.dense_experts_mlp(x, weights, balanced, gate_up, down, "gelu_tanh")), atol=1e-4, rtol=1e-5)
    jaxpr = str(jax.make_jaxpr(lambda: moe.bucketed_experts_mlp(x, weights, experts, gate_up, down, "gelu_tanh",
                                                                  c))())
    assert "while" in jaxpr


@pytest.mark.parametrize("counting", [True, False])
def test_sort_by_expert_is_a_stable_sort(counting, monkeypatch):
    """Both ways (counting sort, argsort for large passes) equal a stable argsort by expert; pos inverts order;
    sizes count each expert."""
    from orl_jax.model import moe

    monkeypatch.setattr(moe, "COUNTING_SORT_MAX", 1 << 20 if counting else 0)
    experts = jax.random.randint(jax.random.key(3), (37, 3), 0, 6).at[0].set(5)  # expert 5 takes row 0's choices
    order, pos, sizes = jax.jit(moe.sort_by_expert, static_argnums=1)(experts, 7)
    flat = np.asarray(experts).reshape(-1)
    np.testing.assert_array_equal(np.asarray(order), np.argsort(flat, kind="stable"))
    np.testing.assert_array_equal(np.asarray(order)[np.asarray(pos)], np.arange(flat.size))
    np.testing.assert_array_equal(np.asarray(sizes), np.bincount(flat, minlength=7))


def test_bucketed_experts_inside_the_model_equal_the_dense_path(dg_ours, monkeypatch):
    """The whole model with the MoE in capacity buckets gives the logits of the dense path (which the HF parity
    tests check). The tiny preset's 8 experts x top-3 never bucket at the default factor; factor 2 makes them.
    moe_impl="dense" forces the dense path."""
    with pytest.raises(ValueError, match="moe_impl"):
        TINY.replace(moe_impl="sparse")
    from orl_jax.model import moe

    cfg, params = dg_ours
    tokens = jnp.asarray(_tokens((2, 48), 51))
    monkeypatch.setattr(moe, "CAPACITY_FACTOR", 2)
    dense = jax.jit(dg.forward, static_argnums=(1,))(params, cfg.replace(moe_impl="dense"), tokens)
    assert moe.capacity(96, cfg.top_k_experts, cfg.num_experts) < 96  # 2 x 48 tokens now bucket
    bucketed = jax.jit(dg.forward, static_argnums=(1,))(params, cfg, tokens)
    np.testing.assert_allclose(np.asarray(bucketed), np.asarray(dense), atol=2e-5)


def test_pallas_experts_inside_the_model_equal_the_dense_path(dg_ours, monkeypatch):
    """moe_impl="pallas": the rows sorted by expert through the grouped kernel (interpret mode on CPU), expert
    weights read in place from each layer type's stack; same logits as the dense path."""
    from orl_jax_kernels.grouped_gemm import kernel as grouped

    cfg, params = dg_ours
    tokens = jnp.asarray(_tokens((2, 24), 51))
    dense = jax.jit(dg.forward, static_argnums=(1,))(params, cfg.replace(moe_impl="dense"), tokens)
    fast = cfg.replace(moe_impl="pallas")
    grouped_calls, real = [], grouped.grouped_matmul
    monkeypatch.setattr(grouped, "grouped_matmul", lambda *a, **k: grouped_calls.append(1) or real(*a, **k))
    jaxpr = str(jax.make_jaxpr(lambda p: dg.forward(p, fast, tokens))(params))
    assert jaxpr.count("pallas_call") >= 4 and "ragged_dot" not in jaxpr  # no XLA fallback
    assert grouped_calls
    got = jax.jit(dg.forward, static_argnums=(1,))(params, fast, tokens)
    np.testing.assert_allclose(np.asarray(got), np.asarray(dense), atol=2e-5)


def test_forward_is_differentiable_with_and_without_remat(dg_ours):
    """The cache-free pass scans each group's sliding layers (reverse-differentiable, unlike the cached passes'
    while loops); remat changes memory, not the gradient."""
    cfg, params = dg_ours
    tokens = jnp.asarray(_tokens((1, 12), 9))

    def loss(p, remat):
        return jnp.mean(jax.nn.logsumexp(dg.forward(p, cfg, tokens, remat=remat), axis=-1))

    g0 = jax.jit(jax.grad(loss), static_argnums=1)(params, False)
    g1 = jax.jit(jax.grad(loss), static_argnums=1)(params, True)
    leaves0, leaves1 = jax.tree.leaves(g0), jax.tree.leaves(g1)
    assert all(bool(jnp.all(jnp.isfinite(a))) for a in leaves0)
    assert any(float(jnp.abs(a).max()) > 0 for a in jax.tree.leaves(g0["sliding"]))
    for a, b in zip(leaves0, leaves1):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-4)


def test_sliding_loop_forms(dg_ours, monkeypatch):
    """diffusion_gemma.SLIDING_LOOP: the cached passes' sliding layers at static indices (the default: no loop in the
    decoder pass) or in a while_loop, the same logits; another value is named."""
    cfg, params = dg_ours
    prompt = jnp.asarray(_tokens((1, 6), 52))
    _, cache = dg.prefill(params, cfg, prompt, jnp.asarray([6], jnp.int32), 6 + cfg.block_length)
    canvas = jnp.asarray(_tokens((1, cfg.block_length), 53))
    decode = lambda: dg.decode(params, cfg, canvas, cache)  # noqa: E731
    jax.clear_caches()  # the switch is read at trace time
    assert dg.SLIDING_LOOP == "unrolled" and "while[" not in str(jax.make_jaxpr(decode)())
    unrolled = decode()
    monkeypatch.setattr(dg, "SLIDING_LOOP", "while")
    jax.clear_caches()
    assert "while[" in str(jax.make_jaxpr(decode)())
    np.testing.assert_allclose(np.asarray(decode()), np.asarray(unrolled), atol=1e-5, rtol=0)
    monkeypatch.setattr(dg, "SLIDING_LOOP", "scan")
    jax.clear_caches()
    with pytest.raises(ValueError, match="SLIDING_LOOP.*'scan'"):
        decode()
    jax.clear_caches()


def test_prefill_reads_layers_in_place_and_forward_scans(dg_ours):
    """The prefill is never differentiated: it loops over the sliding layers with a while_loop (weights read in
    place at the loop's index) instead of scanning group slices (copies of each group's weights on a GPU); the
    cache-free `forward`, which training differentiates, keeps the scan."""
    cfg, params = dg_ours
    tokens = jnp.asarray(_tokens((1, 6), 50))
    pre = str(jax.make_jaxpr(lambda p, t: dg.prefill(p, cfg, t, jnp.asarray([6], jnp.int32), 14))(params, tokens))
    fwd = str(jax.make_jaxpr(lambda p, t: dg.forward(p, cfg, t))(params, tokens))
    assert "while[" in pre and "scan[" not in pre
    assert "scan[" in fwd
