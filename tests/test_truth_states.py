"""ORL's replay fed ground-truth states (train/truth_states.py): stage 1's random masks, and teacher-forced threshold
decoding whose states carry the policy's own statistics under ORL's replay."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from orl_jax import params as P
from orl_jax.config import preset
from orl_jax.decode.residual import ORLResidual
from orl_jax.decode.samplers import MaskSampler
from orl_jax.model import qwen3
from orl_jax.train.orl_losses import normalized_entropy
from orl_jax.train.replay import behaviour_logp, build_replay, policy_logits, replay_logits
from orl_jax.train.truth_states import answer_arrays, forced_capture, make_forced_step, random_mask_capture

BL = 4
PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14]]
ANSWERS = [[20, 21, 22, 23, 24, 25, 26, 3], [30, 31, 3], [40, 41, 42, 43, 44, 45, 46, 47, 48, 3]]  # 3: end of turn


@pytest.fixture(scope="module")
def model():
    cfg = preset("tiny-qwendlm").replace(block_length=BL, noise="mask", logit_shift=True)
    params = P.init(qwen3.param_specs(cfg), jax.random.key(0))
    params["embed"] = params["embed"] * 4.0  # decisive enough to pass a threshold now and then
    return cfg, params


def _blocks(tokens, lengths):
    return [(b, k) for b in range(len(lengths)) for k in range(tokens.shape[1] // BL) if k * BL < lengths[b]]


def test_answers_pad_to_a_block_with_their_end_of_turn():
    tokens, lengths = answer_arrays(ANSWERS, BL, pad_id=0)
    assert tokens.shape == (3, 12) and lengths.tolist() == [8, 3, 10]
    assert tokens[1].tolist() == [30, 31, 3, 3] + [0] * 8
    assert tokens[2, 8:].tolist() == [48, 3, 3, 3]
    with pytest.raises(ValueError, match="at least one token"):
        answer_arrays([[1], []], BL, pad_id=0)


def test_random_masks_one_state_per_block(model):
    cfg, _ = model
    cap = random_mask_capture(ANSWERS, cfg, jax.random.key(0))
    b = build_replay(PROMPTS, cap, [True] * 3, block_length=BL, pad_id=0, mask_token_id=cfg.mask_token_id)
    tokens, lengths = answer_arrays(ANSWERS, BL, pad_id=0)
    assert len(b.step) == len(_blocks(tokens, lengths)) == 6
    for s, (row, k) in enumerate(_blocks(tokens, lengths)):
        canvas = b.tokens[row, b.state_start[s]:b.state_start[s] + BL]
        masked = canvas == cfg.mask_token_id
        assert masked.any() and b.state_row[s] == row and b.prev[s] == -1
        np.testing.assert_array_equal(canvas[~masked], tokens[row, k * BL:(k + 1) * BL][~masked])
        np.testing.assert_array_equal(b.targets[s], tokens[row, k * BL:(k + 1) * BL])
        # every masked position inside the answer is one of L_pred's (entropy 1 passes any gate)
        np.testing.assert_array_equal(b.unresolved[s] & b.valid[s] & (b.entropy[s] > 0.5), masked & b.valid[s])


def test_forced_decoding_states(model):
    """Each block's states fill its ground truth in nested steps by MaskSampler's rule on the policy's confidences,
    and ORL's replay of them reproduces the entropies they carry."""
    cfg, params = model
    thr = 0.3
    sampler = MaskSampler(mask_token_id=cfg.mask_token_id, threshold=thr, temperature=1.0)
    fn = make_forced_step(cfg, ORLResidual(), thr)
    cap = forced_capture(params, cfg, PROMPTS, ANSWERS, fn, rows=3, width=64, states=12)
    b = build_replay(PROMPTS, cap, [True] * 3, block_length=BL, pad_id=0, mask_token_id=cfg.mask_token_id)
    lg = policy_logits(sampler, replay_logits(params, cfg, ORLResidual(), b))
    logp = behaviour_logp(sampler, lg, jnp.asarray(b.step))
    np.testing.assert_allclose(np.asarray(normalized_entropy(logp)), b.entropy, atol=2e-5)
    conf = np.exp(np.asarray(logp).max(-1))
    tokens, lengths = answer_arrays(ANSWERS, BL, pad_id=0)
    steps = []
    for row, k in _blocks(tokens, lengths):
        states = [s for s in range(len(b.step)) if b.state_row[s] == row and
                  b.positions[row, b.state_start[s]] == len(PROMPTS[row]) + k * BL]
        steps.append(len(states))
        truth = tokens[row, k * BL:(k + 1) * BL]
        masked_before = np.ones(BL, bool)
        for i, s in enumerate(states):
            canvas = b.tokens[row, b.state_start[s]:b.state_start[s] + BL]
            masked = canvas == cfg.mask_token_id
            np.testing.assert_array_equal(masked, masked_before)  # what the previous step left
            np.testing.assert_array_equal(canvas[~masked], truth[~masked])
            assert b.step[s] == i and b.prev[s] == (states[i - 1] if i else -1)
            above = masked & (conf[s] > thr)
            fill = above.copy()
            if not above.any():
                fill[np.argmax(np.where(masked, conf[s], -1.0))] = True
            masked_before = masked & ~fill
        assert not masked_before.any()  # the block ends full
    assert max(steps) > 1 and sum(steps) > len(steps)  # the threshold held some positions back


def test_recipe_rejects_truth_states_for_the_uniform_family():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "recipes"))
    import train_qwendlm

    for family in (["--noise", "uniform"], ["--preset", "h200"]):  # the h200 preset's family is the uniform one
        with pytest.raises(SystemExit):
            train_qwendlm.parse_args(["--orl-source", "truth_forced", *family])
    assert train_qwendlm.parse_args(["--orl-source", "truth_forced", "--noise", "mask"]).orl_source == "truth_forced"
