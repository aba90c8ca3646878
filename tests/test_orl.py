"""The ORL round: rollouts under the current params, one update per fresh batch, and it learns."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from orl_jax import params as P
from orl_jax.config import preset
from orl_jax.decode.residual import ORLResidual, RCDResidual
from orl_jax.decode.samplers import MaskSampler, UniformSampler
from orl_jax.model import qwen3
from orl_jax.sharding import make_mesh
from orl_jax.train.optim import OptimConfig, ParamGroup, make_optimizer
from orl_jax.train.orl import ORLConfig, make_orl_loss, orl_iteration, replay_arrays_batch
from orl_jax.train.orl_losses import ORLLossConfig, normalized_entropy
from orl_jax.train.replay import behaviour_logp, policy_logits, replay_logits
from orl_jax.train.step import make_train_step

BL = 4
PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12]]
SAMPLER = UniformSampler(max_denoising_steps=3, entropy_bound=1.0)
OCFG = ORLConfig(group_size=2, max_new_tokens=8, max_states=4, max_prompt=8,
                 loss=ORLLossConfig(pred_gate=0.0, l_aec=10.0))


def _params(cfg, adapter: bool = True):
    """Random params decisive enough to accept tokens (embeddings x4), far from one-hot; with adapter, g_phi's
    output is random too (its zero init would hide the residual)."""
    params = P.init(qwen3.param_specs(cfg), jax.random.key(0))
    params["embed"] = params["embed"] * 4.0
    if adapter:
        params["adapter"] = dict(params["adapter"], down=jax.random.normal(jax.random.key(4), (32, 64)) * 0.3)
    return params


def _optimizer(total_steps: int = 100):
    return make_optimizer(OptimConfig(lr=3e-3, warmup_steps=0, total_steps=total_steps, weight_decay=0.0,
                                      groups={"adapter": ParamGroup(lr_scale=0.5, clip_norm=1.0)}))


def _one_device(loss_fn, opt, cfg):
    return make_train_step(loss_fn, opt, make_mesh(data=1, fsdp=1, tensor=1, devices=jax.devices()[:1]),
                           qwen3.param_specs(cfg))


@pytest.fixture(scope="module")
def setup():
    cfg = preset("tiny-qwendlm").replace(block_length=BL)
    params = _params(cfg)
    loss_fn = make_orl_loss(cfg, SAMPLER, len(PROMPTS) * OCFG.group_size, OCFG.loss)
    step = make_train_step(loss_fn, _optimizer(), make_mesh(data=1, fsdp=-1, tensor=1), qwen3.param_specs(cfg))
    return cfg, params, loss_fn, step


def _entropy_err(params, cfg, arrays):
    b = replay_arrays_batch(arrays)
    lg = policy_logits(SAMPLER, replay_logits(params, cfg, ORLResidual(), b))
    ent = normalized_entropy(behaviour_logp(SAMPLER, lg, jnp.asarray(arrays["step"])))
    m = arrays["state_valid"][:, None] & arrays["valid"]
    return float(np.abs(np.asarray(ent) - arrays["entropy"])[m].max())


def test_one_update_lowers_l_pred_and_rollouts_are_always_fresh(setup):
    cfg, params, loss_fn, step = setup
    state = step.init_state(params, jax.random.key(0))
    p0 = jax.tree.map(np.asarray, state.params)  # the step donates its input state
    accept_all = lambda responses: [True] * len(responses)  # noqa: E731
    state1, m1, arrays1 = orl_iteration(state, step, cfg, PROMPTS, accept_all, jax.random.key(1), SAMPLER, OCFG)
    assert m1["replayed_states"] > 0 and m1["verified"] == 1.0
    assert all(m1[k] > 0 for k in ("rollout_s", "replay_s", "update_s"))  # where the round's time went
    assert int(state1.step) == 1  # exactly one update for the rollout batch
    # the rollout ran under the pre-update params: its captured distributions are theirs
    assert _entropy_err(p0, cfg, arrays1) < 2e-5
    p1 = jax.tree.map(np.asarray, state1.params)
    before = float(loss_fn(p0, arrays1, None)[1]["l_pred"])
    after = float(loss_fn(p1, arrays1, None)[1]["l_pred"])
    assert after < before
    # the next round rolls out again with the updated params (no stale trajectories reach the loss)
    state2, m2, arrays2 = orl_iteration(state1, step, cfg, PROMPTS, accept_all, jax.random.key(2), SAMPLER, OCFG)
    assert int(state2.step) == 2
    assert _entropy_err(p1, cfg, arrays2) < 2e-5
    assert _entropy_err(p0, cfg, arrays2) > 1e-4


def test_failed_responses_give_no_gradient(setup):
    cfg, params, loss_fn, step = setup
    state = step.init_state(params, jax.random.key(0))
    none = lambda responses: [False] * len(responses)  # noqa: E731
    state1, m, _ = orl_iteration(state, step, cfg, PROMPTS, none, jax.random.key(1), SAMPLER, OCFG)
    assert m["verified"] == 0.0 and m["replayed_states"] == 0 and int(state1.step) == 0
    only_first = lambda responses: [r == 0 for r in range(len(responses))]  # noqa: E731
    _, m, arrays = orl_iteration(state1, step, cfg, PROMPTS, only_first, jax.random.key(1), SAMPLER, OCFG)
    assert set(arrays["response_id"][arrays["state_valid"]].tolist()) == {0}
    with pytest.raises(ValueError, match="verify returned 1 results for 4"):
        orl_iteration(step.init_state(params, jax.random.key(0)), step, cfg, PROMPTS, lambda responses: [True],
                      jax.random.key(1), SAMPLER, OCFG)  # a fresh state: the update above donated state1


def test_group_baseline_weighs_responses_by_their_prompts_failures(setup):
    """ORLConfig.group_baseline: a verified response weighs 1 - its prompt's verified share; a prompt whose responses
    all verify gives no gradient (ORL's part and the AR term both 0)."""
    cfg, params, _, _ = setup
    ocfg = dataclasses.replace(OCFG, group_baseline=True, loss=dataclasses.replace(OCFG.loss, ar_weight=1.0))
    loss_fn = make_orl_loss(cfg, SAMPLER, len(PROMPTS) * ocfg.group_size, ocfg.loss)
    step = _one_device(loss_fn, _optimizer(), cfg)
    three = lambda responses: [r != 3 for r in range(len(responses))]  # noqa: E731  prompt 0: 2 of 2, prompt 1: 1 of 2
    _, m, arrays = orl_iteration(step.init_state(params, jax.random.key(0)), step, cfg, PROMPTS, three,
                                 jax.random.key(1), SAMPLER, ocfg)
    np.testing.assert_allclose(arrays["row_weight"], [0.0, 0.0, 0.5, 0.0])
    np.testing.assert_allclose(m["mean_weight"], 0.5 / 3)
    full = float(loss_fn(params, arrays | {"row_weight": np.asarray([1.0, 1.0, 1.0, 0.0], np.float32)}, None)[0])
    only_third = float(loss_fn(params, arrays | {"row_weight": np.asarray([0.0, 0.0, 1.0, 0.0], np.float32)}, None)[0])
    assert 0 < only_third < full
    np.testing.assert_allclose(float(loss_fn(params, arrays, None)[0]), 0.5 * only_third, rtol=1e-5)
    zero = float(loss_fn(params, arrays | {"row_weight": np.zeros(4, np.float32)}, None)[0])
    assert zero == 0.0


def test_replay_without_residual_zeroes_what_the_rollout_consumed(setup):
    """ORLConfig.replay_residual=False (a diagnostic): the replayed states carry z = 0 and a = 0."""
    cfg, params, loss_fn, step = setup
    accept_all = lambda responses: [True] * len(responses)  # noqa: E731
    runs = [orl_iteration(step.init_state(params, jax.random.key(0)), step, cfg, PROMPTS, accept_all,
                          jax.random.key(1), SAMPLER, dataclasses.replace(OCFG, replay_residual=flag))[2]
            for flag in (True, False)]
    assert np.abs(runs[0]["z"]).max() > 0 and np.abs(runs[1]["z"]).max() == 0 and np.abs(runs[1]["a"]).max() == 0
    np.testing.assert_array_equal(runs[0]["tokens"], runs[1]["tokens"])  # the same rollout


def test_round_on_a_four_device_mesh_equals_one_device(setup):
    """The whole round (rollout split over the data axes, replay, update) on fsdp=4 equals one device."""
    cfg, params, loss_fn, step4 = setup
    assert step4.mesh.size == 4
    opt = step4.optimizer
    step1 = _one_device(loss_fn, opt, cfg)
    accept_all = lambda responses: [True] * len(responses)  # noqa: E731
    outs = [orl_iteration(s.init_state(params, jax.random.key(0)), s, cfg, PROMPTS, accept_all,
                          jax.random.key(1), SAMPLER, OCFG) for s in (step1, step4)]
    (st1, m1, a1), (st4, m4, a4) = outs
    np.testing.assert_array_equal(a1["tokens"], a4["tokens"])  # identical rollouts
    np.testing.assert_allclose(float(m1["loss"]), float(m4["loss"]), rtol=1e-5)
    # Adam divides by sqrt(v): a near-zero gradient summed in another order can move a weight by a few percent of
    # the step (lr 3e-3) differently; 1e-4 is 3% of one update
    for x, y in zip(jax.tree.leaves(jax.device_get(st1.params)), jax.tree.leaves(jax.device_get(st4.params))):
        np.testing.assert_allclose(x, y, atol=1e-4)
    assert not any(a.is_deleted() for a in jax.tree.leaves(params)), "a step donated the caller's params"


def test_ar_weight_adds_the_clean_rows_next_token_loss(setup):
    """ORLLossConfig.ar_weight adds w x the AR model's next-token loss of each verified row's prompt + response,
    computed here by a plain causal forward of those tokens alone (states after them change nothing)."""
    cfg, params, loss_fn, step = setup
    state = step.init_state(params, jax.random.key(0))
    only_first = lambda responses: [r % 2 == 0 for r in range(len(responses))]  # noqa: E731
    _, _, arrays = orl_iteration(state, step, cfg, PROMPTS, only_first, jax.random.key(5), SAMPLER, OCFG)
    w = 0.5
    ar_fn = make_orl_loss(cfg, SAMPLER, len(PROMPTS) * OCFG.group_size,
                          dataclasses.replace(OCFG.loss, ar_weight=w))
    (l0, parts0), (l1, parts1) = loss_fn(params, arrays, None), ar_fn(params, arrays, None)
    nll, count = 0.0, 0
    for r, n in enumerate(arrays["clean_len"]):
        if n == 0:
            continue  # a padding row
        row = jnp.asarray(arrays["tokens"][r:r + 1, :n])
        logp = jax.nn.log_softmax(qwen3.forward(params, cfg, row), axis=-1)[0, :-1]
        nll -= float(jnp.sum(jnp.take_along_axis(logp, row[0, 1:, None], axis=-1)))
        count += int(n) - 1
    assert count > 0 and int((arrays["clean_len"] > 0).sum()) == len(PROMPTS)  # the verified rows only
    np.testing.assert_allclose(float(parts1["ar_loss"]), nll / count, rtol=1e-5)
    np.testing.assert_allclose(float(l1), float(l0) + w * nll / count, rtol=1e-5)
    assert "ar_loss" not in parts0
    with pytest.raises(ValueError, match="ar_weight"):
        make_orl_loss(cfg.replace(prefix_attention="block_causal"), SAMPLER, 4, OCFG.loss.__class__(ar_weight=1.0))
    with pytest.raises(ValueError, match="ar_weight"):
        ORLLossConfig(ar_weight=-1.0)


def test_supervised_term_adds_the_conversion_objective_on_its_batch(setup):
    """make_orl_loss(supervised=(fn, w)) adds w x fn's loss of arrays["supervised"] (the recipe's --orl-sup-weight:
    stage 1's objective on ground-truth rows), with the step's key; a round carrying such a batch updates."""
    from orl_jax.train.objectives import DiffusionObjective
    from orl_jax.train.stages import diffusion_loss_fn

    cfg, params, loss_fn, _ = setup
    sup_fn = diffusion_loss_fn(DiffusionObjective(block_length=BL), cfg)
    seg = np.repeat(np.asarray([[1] * 12 + [2] * 12]), 4, axis=0)  # rows split over the 4 test devices
    pos = np.concatenate([np.arange(12), np.arange(12)])[None].repeat(4, 0)
    rows = {"tokens": np.random.default_rng(0).integers(1, 200, seg.shape).astype(np.int32),
            "segment_ids": seg.astype(np.int32), "positions": pos.astype(np.int32),
            "prompt_mask": (pos < 4).astype(np.int32)}
    w = 0.3
    mixed = make_orl_loss(cfg, SAMPLER, len(PROMPTS) * OCFG.group_size, OCFG.loss, supervised=(sup_fn, w))
    step = make_train_step(mixed, _optimizer(), make_mesh(data=1, fsdp=-1, tensor=1), qwen3.param_specs(cfg))
    state, m, arrays = orl_iteration(step.init_state(params, jax.random.key(0)), step, cfg, PROMPTS,
                                     lambda rs: [True] * len(rs), jax.random.key(1), SAMPLER, OCFG,
                                     supervised_batch=rows)
    assert int(state.step) == 1 and np.isfinite(float(m["sup_loss"])), sorted(m)
    key = jax.random.key(7)
    ls, _ = sup_fn(params, rows, key)
    (l1, parts), (l0, _) = mixed(params, arrays, key), loss_fn(params, arrays, key)
    np.testing.assert_allclose(float(parts["sup_loss"]), float(ls), rtol=1e-6)
    np.testing.assert_allclose(float(l1), float(l0) + w * float(ls), rtol=1e-5)


def test_remat_replay_gives_the_same_loss_and_gradients(setup):
    cfg, params, loss_fn, step = setup
    state = step.init_state(params, jax.random.key(0))
    _, _, arrays = orl_iteration(state, step, cfg, PROMPTS, lambda rs: [True] * len(rs), jax.random.key(3), SAMPLER,
                                 OCFG)
    remat_fn = make_orl_loss(cfg, SAMPLER, len(PROMPTS) * OCFG.group_size, OCFG.loss, remat=True)
    (l0, _), g0 = jax.value_and_grad(loss_fn, has_aux=True)(params, arrays, None)
    (l1, _), g1 = jax.value_and_grad(remat_fn, has_aux=True)(params, arrays, None)
    np.testing.assert_allclose(float(l1), float(l0), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)


@pytest.mark.parametrize("residual", [ORLResidual(), RCDResidual()])
def test_mask_family_round_is_finite_and_learns(residual):
    """The mask family: rollouts fill [MASK] positions (sampled), the residual is g_phi weighted by the previous
    step's entropy at [MASK] positions (or RCD's interpolation: the orl_rcd variant), and [MASK] is outside the
    policy (the sampler never proposes it): every loss term and gradient stays finite, and one update lowers
    L_pred on its own replay batch."""
    cfg = preset("tiny-qwendlm").replace(block_length=BL, noise="mask", logit_shift=True)
    params = _params(cfg)
    sampler = MaskSampler(mask_token_id=cfg.mask_token_id, threshold=0.3, temperature=1.0)
    ocfg = ORLConfig(group_size=2, max_new_tokens=8, max_states=4, max_prompt=8,
                     loss=ORLLossConfig(pred_gate=0.3, l_aec=10.0, aec_gate=0.0), residual=residual)
    loss_fn = make_orl_loss(cfg, sampler, len(PROMPTS) * ocfg.group_size, ocfg.loss, residual)
    step = _one_device(loss_fn, _optimizer(), cfg)
    p0 = jax.tree.map(np.asarray, params)
    state, m, arrays = orl_iteration(step.init_state(params, jax.random.key(0)), step, cfg, PROMPTS,
                                     lambda rs: [True] * len(rs), jax.random.key(1), sampler, ocfg)
    assert int(state.step) == 1 and m["skipped"] == 0
    parts = loss_fn(p0, arrays, None)[1]
    assert all(np.isfinite(float(v)) for v in parts.values())
    assert float(parts["l_pred"]) > 0
    # the replay reproduces the rollout's behaviour distributions (float32), and the metric would see it if not
    assert float(parts["replay_entropy_gap"]) < 1e-4
    shifted = dict(arrays, entropy=np.clip(arrays["entropy"] + 0.05, 0, 1))
    assert float(loss_fn(p0, shifted, None)[1]["replay_entropy_gap"]) > 0.02
    # sampled at temperature 1 with one update per rollout, the behaviour distribution is the policy itself: the
    # capped reverse KL is exactly 0 where the update is taken (it acts only through a temperature != 1)
    assert float(parts["l_anchor"]) == 0.0
    # rollouts sampled below temperature 1 (the recipe's --orl-temperature): the anchor pulls the policy towards the
    # sharper tempered distribution on confident positions (here every position counts as confident: the random
    # model is nowhere below the default gate)
    every = dataclasses.replace(ocfg.loss, pred_gate=1.0)
    for temperature, anchored in ((1.0, False), (0.5, True)):
        s = MaskSampler(mask_token_id=cfg.mask_token_id, threshold=0.3, temperature=temperature)
        la = float(make_orl_loss(cfg, s, len(PROMPTS) * ocfg.group_size, every, residual)(p0, arrays, None)[1][
            "l_anchor"])
        assert (la > 1e-4) == anchored, (temperature, la)
    # only the positions the decoder still decides ([MASK]) train: other targets at filled positions change nothing,
    # unless decided_only=False (every position of the response)
    filled = arrays["valid"] & ~arrays["unresolved"]
    assert filled.any() and (arrays["valid"] & arrays["unresolved"]).any()
    moved = dict(arrays, targets=np.where(filled, (arrays["targets"] + 1) % cfg.vocab_size, arrays["targets"]))
    every_pos = make_orl_loss(cfg, sampler, len(PROMPTS) * ocfg.group_size, ocfg.loss, residual, decided_only=False)
    assert float(loss_fn(p0, moved, None)[1]["l_pred"]) == float(parts["l_pred"])
    assert float(every_pos(p0, moved, None)[1]["l_pred"]) != float(every_pos(p0, arrays, None)[1]["l_pred"])
    # certainty forcing (our l_cert) finds positions whose argmax already is the verified token, and stays finite
    lc = make_orl_loss(cfg, sampler, len(PROMPTS) * ocfg.group_size, dataclasses.replace(ocfg.loss, l_cert=1.0),
                       residual)(p0, arrays, None)[1]["l_cert"]
    assert 0 < float(lc) < np.log(cfg.vocab_size)
    assert np.isfinite(float(m["grad_norm"]))
    # g_phi is trained in ORL's form, and unused in RCD's
    assert (float(m["grad_norm/adapter"]) > 0) == isinstance(residual, ORLResidual)
    after = float(loss_fn(jax.tree.map(np.asarray, state.params), arrays, None)[1]["l_pred"])
    assert after < float(parts["l_pred"])


@pytest.mark.parametrize("family", ["uniform", "mask"])
def test_rounds_raise_the_rollout_tpf(family):
    """The mechanism end to end: on-policy rounds (every response accepted) make the model confident on its own
    decoding, so later rollouts need fewer forwards per token, in both families. The same six prompts come back
    every round, so this shows the loop working, not that the confidence generalizes to new prompts."""
    cfg = preset("tiny-qwendlm").replace(block_length=8, logit_shift=True, noise=family)
    params = _params(cfg, adapter=False)
    sampler = (UniformSampler(max_denoising_steps=8) if family == "uniform" else
               MaskSampler(mask_token_id=cfg.mask_token_id, threshold=0.9, temperature=1.0))
    prompts = PROMPTS + [[20, 21, 22, 23], [30, 31]]
    ocfg = ORLConfig(group_size=4, max_new_tokens=16, max_states=8, max_prompt=8, loss=ORLLossConfig(l_aec=10.0))
    step = _one_device(make_orl_loss(cfg, sampler, len(prompts) * 4, ocfg.loss), _optimizer(1000), cfg)
    state, tpf = step.init_state(params, jax.random.key(0)), []
    for i in range(36):
        state, m, _ = orl_iteration(state, step, cfg, prompts, lambda rs: [True] * len(rs), jax.random.key(i),
                                    sampler, ocfg)
        tpf.append(m["rollout_tpf"])
    assert tpf[-1] > 2 * tpf[0], tpf


def test_bad_orl_config():
    with pytest.raises(ValueError, match="group_size"):
        ORLConfig(group_size=0)
