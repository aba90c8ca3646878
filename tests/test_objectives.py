"""Stage-0/1 objectives: the training forward sees exactly what the engine sees, and the losses learn."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from orl_jax import params as P
from orl_jax.config import preset
from orl_jax.decode.ar import ar_generate
from orl_jax.decode.residual import RCDResidual
from orl_jax.model import qwen3, qwendlm
from orl_jax.train.objectives import (
    DiffusionObjective,
    causal_lm_loss,
    diffusion_mask,
    packed_diffusion_mask,
    packed_rows,
    predicting_rows,
)

BL = 4


@pytest.fixture(scope="module")
def model():
    cfg = preset("tiny-qwendlm").replace(block_length=BL)
    params = P.init(qwen3.param_specs(cfg), jax.random.key(0))
    params["adapter"] = dict(params["adapter"], down=jax.random.normal(jax.random.key(3), (32, 64)) * 0.2)
    return cfg, params


def _engine_block_logits(params, cfg, tokens, p, b, noisy_block, z=None, embeds=None):
    """Logits the engine computes for block b's canvas: prefill the prompt, commit clean blocks < b, decode
    (with logit_shift, from the last committed token's hidden state, as the engine carries it). z: the adapter's
    residual; embeds: the canvas embedding itself (another residual form)."""
    _, cache, prev = qwendlm.prefill(params, cfg, tokens[None, :p], jnp.asarray([p]), p + 4 * BL, return_hidden=True)
    for j in range(b):
        cache, prev = qwendlm.commit(params, cfg, tokens[None, p + j * BL:p + (j + 1) * BL], cache, True)
    x = None if z is None else qwendlm.residual_embed(params, cfg, noisy_block[None], z[None], jnp.ones((1, BL)))
    x = x if embeds is None else embeds
    return qwendlm.decode(params, cfg, noisy_block[None], cache, embeds=x, prev_hidden=prev)[0]


def _train_logits(params, cfg, h, p, n):
    """What DiffusionObjective.loss reads: logits of the noisy tokens of one unpacked example [N, V]."""
    seg, pos, plen = packed_rows({"tokens": jnp.zeros((1, n), jnp.int32), "prompt_lengths": jnp.asarray([p]),
                                  "lengths": jnp.asarray([n])})
    return qwen3.logits(params, cfg, predicting_rows(cfg, h, seg, pos, plen, BL))[0]


@pytest.mark.parametrize("shift", [False, True])
@pytest.mark.parametrize("prefix_attention", ["causal", "block_causal"])
def test_training_forward_equals_engine_decode(model, prefix_attention, shift):
    cfg, params = model
    cfg = cfg.replace(prefix_attention=prefix_attention, logit_shift=shift)
    p, n = 5, 5 + 3 * BL
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, 250, n), jnp.int32)
    noisy = jnp.asarray(rng.integers(0, 250, n), jnp.int32)
    mask = diffusion_mask(jnp.asarray([p]), jnp.asarray([n]), n, BL, prefix_attention)
    both = jnp.concatenate([tokens, noisy])[None]
    pos = jnp.concatenate([jnp.arange(n), jnp.arange(n)])[None]
    h, _, _ = qwen3.backbone(params, cfg, qwen3.embed(params, cfg, both), pos, mask)
    train_logits = _train_logits(params, cfg, h, p, n)
    for b in range(3):
        s = slice(p + b * BL, p + (b + 1) * BL)
        eng = _engine_block_logits(params, cfg, tokens, p, b, noisy[s])
        np.testing.assert_allclose(np.asarray(train_logits[s]), np.asarray(eng), atol=2e-5)
    # the clean half is the plain causal model on the clean tokens (what prefill/commit write)
    if prefix_attention == "causal":
        ref = qwen3.forward(params, cfg, tokens[None])[0]
        np.testing.assert_allclose(np.asarray(qwen3.logits(params, cfg, h[:, :n])[0]), np.asarray(ref), atol=2e-5)


def test_noisy_tokens_never_see_their_own_clean_block(model):
    cfg, params = model
    p, n = 3, 3 + 2 * BL
    mask = np.asarray(diffusion_mask(jnp.asarray([p]), jnp.asarray([n]), n, BL))[0]
    for i in range(p, n):
        blk0 = p + (i - p) // BL * BL
        assert not mask[n + i, blk0:n].any(), "noisy token sees its own or a later clean block"
        assert mask[n + i, :blk0].all()
        others = [j for j in range(p, n) if p + (j - p) // BL * BL != blk0]
        assert not mask[n + i, [n + j for j in others]].any()
    assert not mask[:n, n:].any(), "a clean token sees noisy tokens"


def test_mask_noise_masks_at_least_one_per_block(model):
    cfg, _ = model
    mcfg = cfg.replace(noise="mask")
    obj = DiffusionObjective(block_length=BL, t_min=0.0)
    tokens = jnp.ones((64, 3 + 3 * BL), jnp.int32)
    rows = packed_rows({"tokens": tokens, "prompt_lengths": jnp.full((64,), 3), "lengths": jnp.full((64,), 3 + 3 * BL)})
    noisy, w = obj.noise(mcfg, tokens, *rows, jax.random.key(1))
    blocks = np.asarray(w)[:, 3:].reshape(64, 3, BL)
    assert blocks.sum(-1).min() >= 1
    assert np.all((np.asarray(noisy) == mcfg.mask_token_id) == (np.asarray(w) > 0))
    assert np.all(np.asarray(w)[:, :3] == 0)  # the prompt is never noised


@pytest.mark.parametrize("prefix_attention,shift", [("causal", False), ("block_causal", False), ("causal", True)])
def test_packed_rows_equal_separate_rows(model, prefix_attention, shift):
    """Two examples packed in one row (plus padding) give each example exactly the logits it gets alone."""
    cfg, params = model
    cfg = cfg.replace(prefix_attention=prefix_attention, logit_shift=shift)
    rng = np.random.default_rng(7)
    shapes = [(3, 3 + 2 * BL), (2, 2 + BL + 2)]  # (prompt length, length): the second ends in a partial block
    exs = [(rng.integers(0, 250, n), rng.integers(0, 250, n)) for _, n in shapes]
    N = sum(n for _, n in shapes) + 3
    row = {k: np.zeros((1, N), np.int32) for k in ("tokens", "noisy", "segment_ids", "positions", "prompt_mask")}
    at = 0
    for s_id, ((p, n), (clean, noisy)) in enumerate(zip(shapes, exs), 1):
        sl = slice(at, at + n)
        row["tokens"][0, sl], row["noisy"][0, sl], row["segment_ids"][0, sl] = clean, noisy, s_id
        row["positions"][0, sl], row["prompt_mask"][0, sl] = np.arange(n), np.arange(n) < p
        at += n
    batch = {k: jnp.asarray(v) for k, v in row.items()}
    seg, pos, plen = packed_rows(batch)
    mask = packed_diffusion_mask(seg, pos, plen, BL, prefix_attention)

    def noisy_logits(clean, noisy, rows, mask):
        both, pp = jnp.concatenate([clean, noisy], 1), jnp.concatenate([rows[1], rows[1]], 1)
        h, _, _ = qwen3.backbone(params, cfg, qwen3.embed(params, cfg, both), pp, mask)
        return np.asarray(qwen3.logits(params, cfg, predicting_rows(cfg, h, *rows, BL))[0])

    packed = noisy_logits(batch["tokens"], batch["noisy"], (seg, pos, plen), mask)
    at = 0
    for (p, n), (clean, noisy) in zip(shapes, exs):
        rows = packed_rows({"tokens": jnp.zeros((1, n), jnp.int32), "prompt_lengths": jnp.asarray([p]),
                            "lengths": jnp.asarray([n])})
        alone = noisy_logits(jnp.asarray(clean)[None], jnp.asarray(noisy)[None], rows,
                             diffusion_mask(jnp.asarray([p]), jnp.asarray([n]), n, BL, prefix_attention))
        np.testing.assert_allclose(packed[at + p:at + n], alone[p:], atol=2e-5)
        at += n
    m = np.asarray(mask)[0]
    n1, n2 = shapes[0][1], shapes[1][1]
    ex1, ex2 = np.arange(n1), np.arange(n1, n1 + n2)
    both = lambda idx: np.concatenate([idx, idx + N])  # clean and noisy slots
    assert not m[np.ix_(both(ex1), both(ex2))].any() and not m[np.ix_(both(ex2), both(ex1))].any()
    pad = np.arange(n1 + n2, N)
    assert not m[np.ix_(both(np.concatenate([ex1, ex2])), both(pad))].any()  # padding is never a visible key
    assert m.any(axis=1).all(), "a fully masked query row (fused attention kernels give NaN gradients)"


@pytest.mark.parametrize("noise", ["uniform", "mask"])
def test_diffusion_loss_decreases(model, noise):
    cfg, params = model
    cfg = cfg.replace(noise=noise)
    obj = DiffusionObjective(block_length=BL, sc_prob=0.5)
    rng = np.random.default_rng(1)
    batch = {"tokens": jnp.asarray(rng.integers(0, 32, (4, 3 + 2 * BL)), jnp.int32),
             "prompt_lengths": jnp.full((4,), 3), "lengths": jnp.asarray([11, 11, 9, 10])}
    opt = optax.adam(3e-3)
    state = opt.init(params)

    @jax.jit
    def step(params, state, key):
        (loss, _), g = jax.value_and_grad(lambda p: obj.loss(p, cfg, batch, key), has_aux=True)(params)
        upd, state = opt.update(g, state, params)
        return optax.apply_updates(params, upd), state, loss

    first = None
    for i in range(40):
        params, state, loss = step(params, state, jax.random.key(i % 4))
        first = float(loss) if first is None else first
    assert float(loss) < 0.7 * first


@pytest.mark.parametrize("sc_prob", [0.0, 1.0])
def test_ar_weight_adds_stage0_loss_on_the_clean_rows(model, sc_prob):
    """DiffusionObjective(ar_weight=w) = the diffusion loss + w * stage 0's next-token loss of the same packed rows
    (the clean half is the causal model: its rows never see the tokens they predict)."""
    cfg, params = model
    cfg = cfg.replace(logit_shift=True)
    rng = np.random.default_rng(5)
    seg = np.asarray([[1] * 9 + [2] * 8 + [0] * 3])
    pos = np.concatenate([np.arange(9), np.arange(8), np.zeros(3, int)])[None]
    batch = {"tokens": jnp.asarray(rng.integers(0, 250, seg.shape), jnp.int32), "segment_ids": jnp.asarray(seg),
             "positions": jnp.asarray(pos), "prompt_mask": jnp.asarray(pos < 3)}
    key = jax.random.key(4)
    plain, m0 = DiffusionObjective(block_length=BL, sc_prob=sc_prob).loss(params, cfg, batch, key)
    total, m = DiffusionObjective(block_length=BL, sc_prob=sc_prob, ar_weight=0.5).loss(params, cfg, batch, key)
    ar, _ = causal_lm_loss(params, cfg, dict(batch, loss_mask=jnp.ones_like(batch["tokens"])))
    np.testing.assert_allclose(float(m["ar_loss"]), float(ar), rtol=1e-5)
    np.testing.assert_allclose(float(m["diffusion_loss"]), float(plain), rtol=1e-6)
    np.testing.assert_allclose(float(total), float(plain) + 0.5 * float(ar), rtol=1e-5)
    assert "ar_loss" not in m0
    with pytest.raises(ValueError, match="ar_weight"):
        DiffusionObjective(block_length=BL, ar_weight=-1.0)
    with pytest.raises(ValueError, match="prefix_attention"):
        DiffusionObjective(block_length=BL, ar_weight=1.0).loss(params, cfg.replace(prefix_attention="block_causal"),
                                                                 batch, key)


def test_causal_lm_loss_and_ar_decoding(model):
    cfg, params = model
    seq = jnp.asarray([[5, 6, 7, 8, 9, 10, 11, 12]], jnp.int32)
    batch = {"tokens": seq, "loss_mask": jnp.ones_like(seq)}
    loss, _ = causal_lm_loss(params, cfg, batch)
    logits = qwen3.forward(params, cfg, seq)
    ref = -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits[0, :-1]), seq[0, 1:, None], -1))
    np.testing.assert_allclose(float(loss), float(ref), rtol=1e-6)
    # greedy AR decoding with the cache equals argmax of full recomputation, token by token
    out, _ = ar_generate(params, cfg, [[5, 6, 7], [9, 10]], max_new_tokens=5, eos_token_id=())
    for r, prompt in enumerate([[5, 6, 7], [9, 10]]):
        toks = list(prompt)
        for _ in range(5):
            toks.append(int(jnp.argmax(qwen3.forward(params, cfg, jnp.asarray([toks]))[0, -1])))
        assert np.asarray(out)[r].tolist() == toks[len(prompt):]


@pytest.mark.parametrize("shift", [False, True])
def test_self_conditioned_training_forward_equals_engine_with_residual(model, shift):
    cfg, params = model
    cfg = cfg.replace(logit_shift=shift)
    p, n = 4, 4 + 2 * BL
    rng = np.random.default_rng(2)
    tokens = jnp.asarray(rng.integers(0, 250, n), jnp.int32)
    noisy = jnp.asarray(rng.integers(0, 250, n), jnp.int32)
    z = jnp.asarray(rng.normal(size=(n, cfg.hidden_size)), jnp.float32)
    mask = diffusion_mask(jnp.asarray([p]), jnp.asarray([n]), n, BL)
    both = jnp.concatenate([tokens, noisy])[None]
    w = jnp.concatenate([jnp.zeros((1, n)), jnp.ones((1, n))], axis=1)
    x = qwendlm.residual_embed(params, cfg, both, jnp.concatenate([jnp.zeros_like(z), z])[None], w)
    pos = jnp.concatenate([jnp.arange(n), jnp.arange(n)])[None]
    h, _, _ = qwen3.backbone(params, cfg, x, pos, mask)
    train_logits = _train_logits(params, cfg, h, p, n)
    for b in range(2):
        s = slice(p + b * BL, p + (b + 1) * BL)
        eng = _engine_block_logits(params, cfg, tokens, p, b, noisy[s], z[s])
        np.testing.assert_allclose(np.asarray(train_logits[s]), np.asarray(eng), atol=2e-5)


def test_rcd_reference_residual(model):
    """RCD's frozen-reference residual: with the model itself as reference it is exactly self-conditioning;
    a different reference changes the loss; no gradient reaches the reference."""
    cfg, params = model
    obj = DiffusionObjective(block_length=BL, sc_prob=1.0)
    rng = np.random.default_rng(3)
    batch = {"tokens": jnp.asarray(rng.integers(0, 64, (2, 3 + 2 * BL)), jnp.int32),
             "prompt_lengths": jnp.full((2,), 3), "lengths": jnp.full((2,), 3 + 2 * BL)}
    key = jax.random.key(5)
    own = float(obj.loss(params, cfg, batch, key)[0])
    np.testing.assert_allclose(float(obj.loss(params, cfg, batch, key, reference_params=params)[0]), own,
                               rtol=1e-6)
    other = jax.tree.map(lambda x: x * 1.3, params)
    assert abs(float(obj.loss(params, cfg, batch, key, reference_params=other)[0]) - own) > 1e-4
    g = jax.grad(lambda ref: obj.loss(params, cfg, batch, key, reference_params=ref)[0])(other)
    assert all(float(jnp.abs(x).max()) == 0.0 for x in jax.tree.leaves(g))


def test_rcd_mask_family_trains_on_rcd_form_residuals(model):
    """RCD on the mask family: the loss is exactly the masked cross-entropy of the engine's decode passes, fed RCD's
    residual (RCDResidual: (1 - a) E[MASK] + a z at [MASK] positions) from the frozen reference's own decode of
    the same noised block."""
    cfg, params = model
    cfg = cfg.replace(noise="mask", logit_shift=True)
    obj = DiffusionObjective(block_length=BL)
    p, n = 3, 3 + 2 * BL
    tokens = jnp.asarray(np.random.default_rng(8).integers(0, 250, (1, n)), jnp.int32)
    batch = {"tokens": tokens, "prompt_lengths": jnp.asarray([p]), "lengths": jnp.asarray([n])}
    key = jax.random.key(6)
    ref = jax.tree.map(lambda x: x * 1.1, params)  # another model as the frozen reference
    got = float(obj.loss(params, cfg, batch, key, reference_params=ref)[0])
    noisy, w = obj.noise(cfg, tokens, *packed_rows(batch), jax.random.split(key)[0])
    nll, count = 0.0, 0.0
    for b in range(2):
        s = slice(p + b * BL, p + (b + 1) * BL)
        ref_logits = _engine_block_logits(ref, cfg, tokens[0], p, b, noisy[0, s])
        logp = jax.nn.log_softmax(ref_logits.at[:, cfg.mask_token_id].set(-jnp.inf), axis=-1)
        probs = jnp.exp(logp)
        a = -jnp.sum(jnp.where(probs > 0, probs * logp, 0.0), -1) / np.log(cfg.vocab_size)
        x = RCDResidual().embed(params, cfg, noisy[:, s], qwendlm.soft_embed(ref, cfg, probs[None]), a[None])
        lp = jax.nn.log_softmax(_engine_block_logits(params, cfg, tokens[0], p, b, noisy[0, s], embeds=x), -1)
        tok_nll = -jnp.take_along_axis(lp, tokens[0, s, None], axis=-1)[:, 0]
        nll += float(jnp.sum(tok_nll * w[0, s]))
        count += float(jnp.sum(w[0, s]))
    assert count > 0 and float(jnp.sum((noisy[0] == cfg.mask_token_id) * 1.0)) > 1
    np.testing.assert_allclose(got, nll / count, rtol=2e-5)
    assert abs(got - float(obj.loss(params, cfg, batch, key)[0])) > 1e-4  # the residual changed the loss


def _training_losses(lens: tuple[int, int], pad: int, rows: int, prompt: int, seed: int) -> dict:
    """Stage-0 and stage-1 losses f(params, cfg) on packed rows of two examples (lengths `lens`) + `pad` padding."""
    rng = np.random.default_rng(seed)
    n = sum(lens) + pad
    seg = np.repeat(np.array([[1] * lens[0] + [2] * lens[1] + [0] * pad]), rows, axis=0).astype(np.int32)
    pos = np.where(seg == 1, np.arange(n), np.arange(n) - lens[0]) * (seg > 0)
    batch = {"tokens": jnp.asarray(rng.integers(0, 250, seg.shape) * (seg > 0), jnp.int32),
             "segment_ids": jnp.asarray(seg), "positions": jnp.asarray(pos, jnp.int32),
             "prompt_mask": jnp.asarray((pos < prompt) & (seg > 0), jnp.int32), "loss_mask": jnp.asarray(seg > 0)}
    obj = DiffusionObjective(block_length=BL, sc_prob=1.0)
    return {"stage0": lambda p, c: causal_lm_loss(p, c, batch)[0],
            "stage1": lambda p, c: obj.loss(p, c, batch, jax.random.key(2))[0]}


def test_fused_attention_impl_gives_the_same_training_losses(model):
    """attention_impl="xla" (jax.nn.dot_product_attention, the stand-in on CPU for the fused cuDNN kernel) gives
    the same stage-0 and stage-1 losses and gradients as orl_jax's own attention, padding rows included."""
    cfg, params = model
    for name, f in _training_losses((9, 10), 5, rows=2, prompt=3, seed=11).items():
        ref, g_ref = jax.value_and_grad(f)(params, cfg)
        got, g = jax.value_and_grad(f)(params, cfg.replace(attention_impl="xla"))
        np.testing.assert_allclose(float(got), float(ref), rtol=1e-5, err_msg=name)
        for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5, err_msg=name)


@pytest.mark.gpu
def test_cudnn_attention_gives_the_same_training_losses_on_gpu(model):
    """attention_impl="cudnn" (fused flash attention, bf16) against orl_jax's attention in bf16: same stage-0 and
    stage-1 losses within bf16 noise, finite gradients of the same direction, padding rows included."""
    cfg, params = model
    cfg = cfg.replace(dtype="bfloat16", param_dtype="float32")
    for name, f in _training_losses((40, 50), 6, rows=4, prompt=8, seed=13).items():
        ref, g_ref = jax.jit(jax.value_and_grad(f), static_argnums=1)(params, cfg)
        got, g = jax.jit(jax.value_and_grad(f), static_argnums=1)(params, cfg.replace(attention_impl="cudnn"))
        np.testing.assert_allclose(float(got), float(ref), rtol=2e-2, err_msg=name)
        a, b = (jnp.concatenate([x.ravel() for x in jax.tree.leaves(t)]) for t in (g, g_ref))
        assert bool(jnp.all(jnp.isfinite(a))), name
        assert float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b)) < 5e-2, name
