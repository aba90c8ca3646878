"""ORL replay: packed states reproduce the rollout's own distributions, and staircase visibility holds."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from orl_jax import params as P
from orl_jax.config import preset
from orl_jax.decode.engine import generate
from orl_jax.decode.residual import ORLResidual, RCDResidual
from orl_jax.decode.samplers import MaskSampler, UniformSampler
from orl_jax.model import qwen3
from orl_jax.train.orl_losses import normalized_entropy
from orl_jax.train.replay import behaviour_logp, build_replay, policy_logits, replay_logits

BL = 4
PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12]]
SAMPLER = UniformSampler(max_denoising_steps=3, entropy_bound=1.0)
MASK_SAMPLER = MaskSampler(mask_token_id=255, threshold=0.3, temperature=1.0)  # sampled: a few steps per block


@pytest.fixture(scope="module", params=["own_row", "logit_shift", "mask", "mask_rcd"])
def rollout(request):
    """(cfg, params, out, batch, sampler, residual): a captured rollout of 3 blocks and its replay batch. "mask":
    the mask family with the ORL residual (g_phi weighted by the previous step's entropy at [MASK] positions);
    "mask_rcd": with RCD's residual form (the recipe's orl_rcd variant)."""
    mask = request.param.startswith("mask")
    residual = RCDResidual() if request.param == "mask_rcd" else ORLResidual()
    cfg = preset("tiny-qwendlm").replace(block_length=BL, logit_shift=request.param != "own_row",
                                         noise="mask" if mask else "uniform")
    sampler = MASK_SAMPLER if mask else SAMPLER
    params = P.init(qwen3.param_specs(cfg), jax.random.key(0))
    params["embed"] = params["embed"] * 4.0  # decisive enough to accept tokens, far from one-hot
    params["adapter"] = dict(params["adapter"], down=jax.random.normal(jax.random.key(4), (32, 64)) * 0.3)
    out = generate(params, cfg, PROMPTS, key=jax.random.key(1), max_new_tokens=3 * BL, sampler=sampler,
                   residual=residual, capture=True, eos_token_id=(), pad_token_id=0)
    batch = build_replay(PROMPTS, out, [True, True], block_length=BL, pad_id=0,
                         mask_token_id=cfg.mask_token_id if mask else None)
    if mask:  # later steps of a block carry a residual at [MASK] positions: the replay must feed it back
        assert batch.a.max() > 0.05 and (batch.tokens == cfg.mask_token_id).any()
    return cfg, params, out, batch, sampler, residual


def test_replayed_logits_reproduce_the_rollout(rollout):
    cfg, params, out, batch, sampler, residual = rollout
    assert len(batch.step) == int(np.sum(np.asarray(out.capture["active"])[:int(out.total_forwards)]))
    logits = replay_logits(params, cfg, residual, batch)
    ent = normalized_entropy(behaviour_logp(sampler, policy_logits(sampler, logits), jnp.asarray(batch.step)))
    assert 0.05 < float(batch.entropy.mean()) < 0.95  # non-trivial distributions
    np.testing.assert_allclose(np.asarray(ent), batch.entropy, atol=2e-5)
    # a perturbed model does not reproduce them: the check can fail
    bad = dict(params, final_norm=params["final_norm"] * 1.5)
    bad_logits = policy_logits(sampler, replay_logits(bad, cfg, residual, batch))
    ent_bad = normalized_entropy(behaviour_logp(sampler, bad_logits, jnp.asarray(batch.step)))
    assert np.abs(np.asarray(ent_bad) - batch.entropy).max() > 1e-3
    if cfg.noise == "mask":  # the residual form reaches the replay: the other form does not reproduce the rollout
        other = ORLResidual() if isinstance(residual, RCDResidual) else RCDResidual()
        other_logits = policy_logits(sampler, replay_logits(params, cfg, other, batch))
        ent_other = normalized_entropy(behaviour_logp(sampler, other_logits, jnp.asarray(batch.step)))
        assert np.abs(np.asarray(ent_other) - batch.entropy).max() > 1e-3


def test_staircase_visibility_by_gradients(rollout):
    cfg, params, out, batch, _, residual = rollout
    r, L = 0, BL
    states = [s for s in range(len(batch.step)) if batch.state_row[s] == r]
    p = len(PROMPTS[0])

    def state_logits(x, s):
        h, _, _ = qwen3.backbone(params, cfg, x, jnp.asarray(batch.positions[r:r + 1]),
                                 jnp.asarray(batch.mask[r:r + 1]))
        return qwen3.logits(params, cfg, h[:, batch.state_start[s]:batch.state_start[s] + L]).sum()

    x0 = residual.embed(params, cfg, jnp.asarray(batch.tokens[r:r + 1]), jnp.asarray(batch.z[r:r + 1]),
                             jnp.asarray(batch.a[r:r + 1]))
    for s in states:
        g = np.abs(np.asarray(jax.grad(state_logits)(x0, s))[0]).sum(-1)  # [N]
        blk = (batch.positions[r, batch.state_start[s]] - p) // L
        own = slice(batch.state_start[s], batch.state_start[s] + L)
        assert np.all(g[:p + blk * L] > 0), "a state must see the prompt and earlier clean blocks"
        assert np.all(g[own] > 0), "a state sees itself"
        hidden = np.ones_like(g, bool)
        hidden[:p + blk * L] = False
        hidden[own] = False
        assert np.all(g[hidden] == 0), "a state saw its own clean answer, a later block or another state"


def test_states_read_their_own_capture_records(rollout):
    """Each replayed state carries its (record, row)'s canvas, z, a and entropy, read here from the whole capture
    on the host (build_replay gathers only the chosen states on the device); unresolved = [MASK] positions (mask
    family) or what the block's previous step did not accept (uniform; all at a block's first step)."""
    cfg, params, out, batch, _, _ = rollout
    cap = {k: np.asarray(v) for k, v in out.capture.items()}
    n = int(out.total_forwards)
    pairs = [(rec, b) for b in range(len(PROMPTS)) for rec in range(n) if cap["active"][rec, b]]
    assert len(pairs) == len(batch.step)
    for k, (rec, b) in enumerate(pairs):
        r, s0 = batch.state_row[k], batch.state_start[k]
        assert r == b and batch.step[k] == cap["step"][rec]
        np.testing.assert_array_equal(batch.tokens[r, s0:s0 + BL], cap["canvas"][rec, b])
        np.testing.assert_array_equal(batch.z[r, s0:s0 + BL], cap["z"][rec, b])
        np.testing.assert_array_equal(batch.a[r, s0:s0 + BL], cap["a"][rec, b])
        np.testing.assert_array_equal(batch.entropy[k], cap["entropy"][rec, b])
        prev = batch.prev[k]
        if cfg.noise == "mask":
            want = cap["canvas"][rec, b] == cfg.mask_token_id
        elif prev < 0:
            want = np.ones(BL, bool)
        else:
            assert pairs[prev][1] == b and cap["block"][pairs[prev][0]] == cap["block"][rec]
            want = ~cap["resolved"][pairs[prev][0], b]
        np.testing.assert_array_equal(batch.unresolved[k], want)
    assert (batch.prev >= 0).any()  # some states have a predecessor: the uniform branch above is exercised


def test_unverified_responses_are_dropped(rollout):
    cfg, params, out, _, _, _ = rollout
    batch = build_replay(PROMPTS, out, [False, True], block_length=BL, pad_id=0,
                         mask_token_id=cfg.mask_token_id if cfg.noise == "mask" else None)
    assert set(batch.state_row.tolist()) == {0} and batch.tokens.shape[0] == 1
    assert batch.tokens[0, :len(PROMPTS[1])].tolist() == PROMPTS[1]


def test_state_selection_takes_whole_blocks_in_a_random_order():
    from orl_jax.train.replay import select_states

    recs, blocks = list(range(10)), [0, 0, 0, 1, 1, 2, 2, 2, 2, 3]
    assert select_states(recs, blocks, None) == recs
    assert select_states(recs, blocks, 20, np.random.default_rng(0)) == recs
    assert select_states(recs, blocks, 4) == [0, 1, 2, 3]  # no rng: the first ones
    seen = set()
    for seed in range(20):
        got = select_states(recs, blocks, 5, np.random.default_rng(seed))
        assert got == sorted(got) and 0 < len(got) <= 5
        chosen = {blocks[i] for i in got}
        assert all(i in got for i in recs if blocks[i] in chosen)  # whole blocks only
        seen |= chosen
    assert seen == {0, 1, 2, 3}  # every block gets its turn
    assert select_states(recs, [0] * 10, 3, np.random.default_rng(0)) == [0, 1, 2]  # one long block: its first


def test_orl_config_rejects_unknown_state_selection():
    from orl_jax.train.orl import ORLConfig

    with pytest.raises(ValueError, match="state_selection"):
        ORLConfig(state_selection="last")
