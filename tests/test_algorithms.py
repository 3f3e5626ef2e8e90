"""Algorithms against values worked out by hand (the arithmetic is in the comments)."""

import math

import pytest
import torch

from posttrain.algorithms import (
    AdaptiveKLController, FixedKLController, agg_loss, apply_kl_penalty, entropy_from_logits,
    get_adv_estimator, grpo_advantages, kl_penalty, make_kl_controller, ppo_policy_loss,
)

T = torch.tensor


def outcome(scores, length=2):
    """Scores on the last token of rows of `length` tokens."""
    r = torch.zeros(len(scores), length)
    r[:, -1] = T(scores)
    return r


def test_grpo_two_groups_of_three():
    # group 0 scores [1, 0, 0]: mean 1/3, unbiased std sqrt(((2/3)^2 + 2 (1/3)^2) / 2) = sqrt(1/3) = 0.57735
    #   -> (2/3)/0.57735 = 1.154700, (-1/3)/0.57735 = -0.577350
    # group 1 scores [2, 4, 6]: mean 4, std sqrt((4 + 0 + 4) / 2) = 2 -> [-1, 0, 1]
    adv, ret = grpo_advantages(outcome([1, 0, 0, 2, 4, 6]), torch.ones(6, 2), [0, 0, 0, 1, 1, 1])
    expected = T([1.154700, -0.577350, -0.577350, -1.0, 0.0, 1.0])
    torch.testing.assert_close(adv[:, 0], expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(adv[:, 1], expected, atol=1e-5, rtol=0)
    assert torch.equal(adv, ret)


def test_grpo_group_of_one_all_equal_and_no_std():
    # a group of one: mean 0, std 1 -> its advantage is its score (0.7 / (1 + 1e-6))
    adv, _ = grpo_advantages(outcome([0.7]), torch.ones(1, 2), ["p"])
    assert adv[0, 0].item() == pytest.approx(0.7, abs=1e-6)
    # all equal: std 0 -> 0 / (0 + eps) = 0
    adv, _ = grpo_advantages(outcome([1.0, 1.0, 1.0]), torch.ones(3, 2), [5, 5, 5])
    assert adv.abs().max().item() == 0.0
    # without std normalisation: [1, 0, 0] - 1/3
    adv, _ = grpo_advantages(outcome([1, 0, 0]), torch.ones(3, 2), [0, 0, 0], norm_adv_by_std_in_grpo=False)
    torch.testing.assert_close(adv[:, 0], T([2 / 3, -1 / 3, -1 / 3]))


def test_grpo_zeroes_masked_tokens():
    mask = T([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    rewards = T([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    adv, _ = grpo_advantages(rewards, mask, [0, 0])
    # scores [1, 0]: mean 0.5, std sqrt(0.5) = 0.707107 -> +-0.707107
    torch.testing.assert_close(adv, T([[0.707106, 0.707106, 0.0], [-0.707106, 0.0, 0.0]]), atol=1e-5, rtol=0)
    assert get_adv_estimator("grpo") is grpo_advantages
    with pytest.raises(ValueError, match="grpo"):
        get_adv_estimator("nope")


LOSS = T([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
MASK = T([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])  # the third row is fully masked


@pytest.mark.parametrize("mode, expected", [
    ("token-mean", 7 / 3),                  # (1 + 2 + 4) / 3 tokens
    ("seq-mean-token-sum", 3.5),            # (3 + 4) / 2 valid sequences
    ("seq-mean-token-mean", 2.75),          # (1.5 + 4) / 2 valid sequences
    ("seq-mean-token-sum-norm", 7 / 9),     # 7 / T=3 / B=3
])
def test_agg_loss_modes(mode, expected):
    assert agg_loss(LOSS, MASK, mode).item() == pytest.approx(expected)
    assert agg_loss(LOSS, torch.zeros_like(MASK), mode).item() == 0.0  # nothing valid: 0, not NaN
    assert agg_loss(LOSS[:, :0], MASK[:, :0], mode).item() == 0.0  # zero-length responses
    with pytest.raises(ValueError, match="token-mean"):
        agg_loss(LOSS, MASK, "sum")


def test_ppo_policy_loss_clip_cases():
    # token: A, ratio -> loss1 = -A r, loss2 = -A clip(r, 0.8, 1.2), max, then dual clip for A < 0
    #   1:  1, 1.5 -> -1.5, -1.2 -> -1.2 (clipped)
    #   2:  1, 1.1 -> -1.1, -1.1 -> -1.1
    #   3: -1, 0.5 ->  0.5,  0.8 ->  0.8 (clipped); min(3, 0.8) = 0.8
    #   4: -1, 5.0 ->  5.0,  1.2 ->  5.0; dual: min(3, 5) = 3 (lower clip)
    # token-mean: (-1.2 - 1.1 + 0.8 + 3) / 4 = 0.375; clipfrac 2/4; clipfrac_lower 1/4
    # ppo_kl = -(ln 1.5 + ln 1.1 + ln 0.5 + ln 5) / 4 = -0.354267
    old = torch.zeros(1, 4)
    logp = torch.log(T([[1.5, 1.1, 0.5, 5.0]])).requires_grad_()
    adv = T([[1.0, 1.0, -1.0, -1.0]])
    out = ppo_policy_loss(old, logp, adv, torch.ones(1, 4))
    assert out["pg_loss"].item() == pytest.approx(0.375, abs=1e-6)
    assert out["pg_clipfrac"].item() == pytest.approx(0.5)
    assert out["pg_clipfrac_lower"].item() == pytest.approx(0.25)
    assert out["ppo_kl"].item() == pytest.approx(-0.354267, abs=1e-5)
    out["pg_loss"].backward()
    # only token 2 is unclipped: d(-A r)/d logp = -A r = -1.1, over 4 tokens
    torch.testing.assert_close(logp.grad, T([[0.0, -1.1 / 4, 0.0, 0.0]]))


def test_ppo_policy_loss_asymmetric_clip_and_mask():
    # clip-higher: ratio 1.25 with high 0.28 is inside the range: loss = -1.25
    logp = torch.log(T([[1.25, 9.0]]))
    out = ppo_policy_loss(torch.zeros(1, 2), logp, T([[1.0, 1.0]]), T([[1.0, 0.0]]),
                          clip_ratio_low=0.2, clip_ratio_high=0.28)
    assert out["pg_loss"].item() == pytest.approx(-1.25)
    assert out["pg_clipfrac"].item() == 0.0  # the masked token's clip does not count
    with pytest.raises(ValueError):
        ppo_policy_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1), clip_ratio_c=1.0)


def test_kl_estimators():
    logp, ref = T([-1.0, -2.0]), T([-2.0, -1.0])
    torch.testing.assert_close(kl_penalty(logp, ref, "kl"), T([1.0, -1.0]))
    torch.testing.assert_close(kl_penalty(logp, ref, "k1"), T([1.0, -1.0]))
    torch.testing.assert_close(kl_penalty(logp, ref, "abs"), T([1.0, 1.0]))
    torch.testing.assert_close(kl_penalty(logp, ref, "mse"), T([0.5, 0.5]))
    # k3: d = ref - logp; e^d - d - 1: d=-1 -> 0.367879, d=1 -> 0.718282
    torch.testing.assert_close(kl_penalty(logp, ref, "low_var_kl"), T([0.367879, 0.718282]), atol=1e-6, rtol=0)
    torch.testing.assert_close(kl_penalty(logp, ref, "k3"), T([0.367879, 0.718282]), atol=1e-6, rtol=0)
    # clamps: d = -30 -> -20 -> e^-20 + 19 = 19.0 -> 10; d = 30 -> 20 -> e^20 - 21 -> 10
    torch.testing.assert_close(kl_penalty(T([0.0, -30.0]), T([-30.0, 0.0]), "k3"), T([10.0, 10.0]))
    with pytest.raises(ValueError, match="low_var_kl"):
        kl_penalty(logp, ref, "full")


def test_kl_controllers():
    c = AdaptiveKLController(0.1, target_kl=0.1, horizon=1000)
    c.update(0.2, n_steps=100)   # err clip(1) = 0.2 -> x(1 + 0.2 * 0.1) -> 0.102
    assert c.value == pytest.approx(0.102)
    c = AdaptiveKLController(0.1, target_kl=0.1, horizon=1000)
    c.update(0.05, n_steps=100)  # err -0.5 -> -0.2 -> 0.098
    assert c.value == pytest.approx(0.098)
    c.update(0.11, n_steps=100)  # err 0.1 -> x1.01 -> 0.09898
    assert c.value == pytest.approx(0.09898)
    f = FixedKLController(0.3)
    f.update(5.0, 10)
    assert f.value == 0.3
    restored = make_kl_controller("adaptive", 1.0, target_kl=0.1, horizon=10)
    restored.load_state_dict(c.state_dict())
    assert restored.value == c.value
    with pytest.raises(ValueError):
        make_kl_controller("adaptive", 0.1)
    with pytest.raises(ValueError):
        make_kl_controller("pid", 0.1)


def test_apply_kl_penalty():
    scores = T([[0.0, 0.0, 1.0], [0.0, 1.0, 0.0]])
    logp = torch.full((2, 3), -1.0)
    ref = T([[-1.5, -1.0, -1.0], [-1.0, -1.0, -2.0]])
    mask = T([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    # k1 = logp - ref = [[0.5, 0, 0], [0, 0, 1]], masked -> [[0.5, 0, 0], [0, 0, 0]]; beta 0.1
    rewards, m = apply_kl_penalty(scores, logp, ref, mask, FixedKLController(0.1), "kl")
    torch.testing.assert_close(rewards, T([[-0.05, 0.0, 1.0], [0.0, 1.0, 0.0]]))
    assert m["actor/reward_kl_penalty"] == pytest.approx((0.5 / 3 + 0.0) / 2)
    assert m["actor/reward_kl_penalty_coeff"] == 0.1


def test_entropy():
    assert entropy_from_logits(torch.zeros(2, 7)).tolist() == pytest.approx([math.log(7)] * 2)
    # one-hot-ish: p = softmax([0, -inf]) -> entropy 0
    assert entropy_from_logits(T([0.0, -1e9])).item() == pytest.approx(0.0, abs=1e-6)
    # p = [0.5, 0.25, 0.25]: H = 0.5 ln2 + 2 * 0.25 ln4 = 1.5 ln 2 = 1.039721
    assert entropy_from_logits(torch.log(T([0.5, 0.25, 0.25]))).item() == pytest.approx(1.039721, abs=1e-6)
