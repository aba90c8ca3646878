"""ORL losses on hand-computed toy cases (METHOD.md §3)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from orl_jax.train.orl_losses import (
    ORLLossConfig,
    aec_loss,
    anchor_loss,
    certainty_loss,
    orl_loss,
    per_response_mean,
    pred_loss,
    state_entropy,
)


def test_aec_hinge_gate_and_stop_gradient():
    rho, gate = 0.25, 0.01
    h = jnp.asarray([0.5, 0.45, 0.30, 0.005, 0.004, 0.5, 0.9])
    prev = jnp.asarray([-1, 0, 1, 2, 3, 4, 5])  # one block: 0 -> 1 -> 2 -> 3 -> 4 -> 5 -> 6
    has = jnp.asarray([True, True, True, True, True, True, False])
    out = np.asarray(aec_loss(h, has, prev, rho, gate))
    np.testing.assert_allclose(out[0], 0.0)  # first state of the block
    np.testing.assert_allclose(out[1], (0.45 - 0.75 * 0.5) ** 2, rtol=1e-6)  # 0.075^2 = 0.005625
    np.testing.assert_allclose(out[2], 0.0)  # 0.30 <= 0.75 * 0.45: contracted enough
    np.testing.assert_allclose(out[3], 0.0)
    np.testing.assert_allclose(out[4], 0.0)  # previous state (0.005) below the gate: already confident
    np.testing.assert_allclose(out[5], 0.0)  # a rise (0.004 -> 0.5), but the previous state is below the gate
    np.testing.assert_allclose(out[6], 0.0)  # nothing unresolved in s'
    # the gradient flows into H(s') only, never into the detached H(s)
    g = jax.grad(lambda h: aec_loss(h, has, prev, rho, gate)[1])(h)
    np.testing.assert_allclose(np.asarray(g), [0, 2 * 0.075, 0, 0, 0, 0, 0], atol=1e-6)


def test_capped_reverse_kl_on_confident_positions():
    p = jnp.asarray([[[0.7, 0.2, 0.1], [0.98, 0.01, 0.01]]])  # current model, 2 positions
    q = jnp.asarray([[[0.2, 0.5, 0.3], [0.97, 0.02, 0.01]]])  # behaviour
    logits, beh = jnp.log(p), jnp.log(q)
    ent = jnp.asarray([[0.01, 0.01]])  # both confident under a 0.02 gate
    valid = jnp.ones((1, 2), bool)
    kl = [float(np.sum(np.asarray(p[0, i]) * np.log(np.asarray(p[0, i]) / np.asarray(q[0, i])))) for i in range(2)]
    assert kl[0] > 0.5 > kl[1]
    got = float(anchor_loss(logits, beh, ent, valid, gate=0.02, cap=0.5)[0])
    np.testing.assert_allclose(got, (0.5 + kl[1]) / 2, rtol=1e-5)  # first position capped at 0.5 nats
    uncertain = jnp.asarray([[0.01, 0.5]])  # the second position is uncertain: no anchor there
    np.testing.assert_allclose(float(anchor_loss(logits, beh, uncertain, valid, 0.02, 0.5)[0]), 0.5, rtol=1e-5)


def test_pred_loss_only_on_uncertain_positions():
    logits = jnp.log(jnp.asarray([[[0.5, 0.25, 0.25], [0.1, 0.8, 0.1], [0.2, 0.2, 0.6]]]))
    targets = jnp.asarray([[0, 1, 0]])
    ent = jnp.asarray([[0.5, 0.01, 0.3]])  # position 1 is confident: excluded
    valid = jnp.asarray([[True, True, True]])
    np.testing.assert_allclose(float(pred_loss(logits, targets, ent, valid, 0.02)[0]),
                               (-math.log(0.5) - math.log(0.2)) / 2, rtol=1e-5)
    # "block": the same two cross-entropies summed over the block's 3 positions, so a state with one uncertain
    # position weighs a third of one with three (the "state" mean gives both the same weight)
    np.testing.assert_allclose(float(pred_loss(logits, targets, ent, valid, 0.02, "block")[0]),
                               (-math.log(0.5) - math.log(0.2)) / 3, rtol=1e-5)


def test_certainty_loss_on_positions_already_right():
    p = jnp.asarray([[[0.5, 0.3, 0.2], [0.1, 0.8, 0.1], [0.2, 0.2, 0.6], [0.9, 0.05, 0.05]]])
    logits = jnp.log(p)
    targets = jnp.asarray([[0, 0, 2, 0]])  # position 1's argmax (1) is wrong: left to L_pred
    unresolved = jnp.asarray([[True, True, True, False]])  # position 3 is already filled
    ent = lambda q: -sum(v * math.log(v) for v in q)  # noqa: E731
    want = (ent([0.5, 0.3, 0.2]) + ent([0.2, 0.2, 0.6])) / 2
    np.testing.assert_allclose(float(certainty_loss(logits, targets, unresolved)[0]), want, rtol=1e-5)
    # its gradient raises the right token's logit (sharpening towards the argmax) at positions 0 and 2 only
    g = np.asarray(jax.grad(lambda lg: certainty_loss(lg, targets, unresolved)[0])(logits))[0]
    assert g[0, 0] < 0 and g[2, 2] < 0 and np.all(g[1] == 0) and np.all(g[3] == 0)
    # in the batch loss it adds l_cert times itself to the state's sum
    args = dict(targets=targets, beh_logp=jnp.log(p), beh_entropy=jnp.full((1, 4), 0.5), valid=jnp.ones((1, 4), bool),
                unresolved=unresolved, temperature=jnp.ones(1), prev=jnp.asarray([-1]), response_id=jnp.asarray([0]),
                num_responses=1)
    off, _ = orl_loss(ORLLossConfig(), logits, **args)
    on, parts = orl_loss(ORLLossConfig(l_cert=2.0), logits, **args)
    np.testing.assert_allclose(float(on) - float(off), 2 * want, rtol=1e-5)
    np.testing.assert_allclose(float(parts["l_cert"]), want, rtol=1e-5)


def test_per_response_normalization():
    # response 0 has two states (losses 1 and 3), response 1 one state (5), a padding state is ignored
    loss = per_response_mean(jnp.asarray([1.0, 3.0, 5.0, 100.0]), jnp.asarray([0, 0, 1, 0]), 2,
                             state_valid=jnp.asarray([True, True, True, False]))
    np.testing.assert_allclose(float(loss), (2.0 + 5.0) / 2)
    # a response with no states (all failed verification) does not dilute the mean
    np.testing.assert_allclose(float(per_response_mean(jnp.asarray([4.0]), jnp.asarray([2]), 3)), 4.0)


def test_state_entropy_over_unresolved_positions_with_temperature():
    logits = jnp.asarray([[[0.0, 0.0], [10.0, 0.0]]])  # uniform, then nearly one-hot
    h, has = state_entropy(logits, jnp.asarray([[True, False]]), jnp.asarray([1.0]))
    np.testing.assert_allclose(float(h[0]), 1.0, rtol=1e-6)
    assert bool(has[0])
    h, has = state_entropy(logits, jnp.asarray([[False, False]]), jnp.asarray([1.0]))
    assert not bool(has[0]) and float(h[0]) == 0.0


def test_full_loss_is_finite_and_differentiable():
    ks = jax.random.split(jax.random.key(0), 3)
    S, L, V = 4, 3, 7
    logits = jax.random.normal(ks[0], (S, L, V))
    beh = jax.nn.log_softmax(jax.random.normal(ks[1], (S, L, V)))
    args = dict(targets=jax.random.randint(ks[2], (S, L), 0, V), beh_logp=beh,
                beh_entropy=jnp.full((S, L), 0.5).at[0, 0].set(0.0), valid=jnp.ones((S, L), bool),
                unresolved=jnp.ones((S, L), bool), temperature=jnp.full((S,), 0.8), prev=jnp.asarray([-1, 0, 1, -1]),
                response_id=jnp.asarray([0, 0, 0, 1]), num_responses=2)
    cfg = ORLLossConfig()
    (loss, parts), g = jax.value_and_grad(lambda lg: orl_loss(cfg, lg, **args), has_aux=True)(logits)
    assert np.isfinite(float(loss)) and np.all(np.isfinite(np.asarray(g)))
    assert set(parts) == {"l_pred", "l_anchor", "l_aec", "entropy"}


def test_bad_config():
    with pytest.raises(ValueError, match="pred_norm"):
        ORLLossConfig(pred_norm="token")
    with pytest.raises(ValueError, match="rho"):
        ORLLossConfig(rho=1.5)
    with pytest.raises(ValueError, match="anchor_cap"):
        ORLLossConfig(anchor_cap=float("nan"))
