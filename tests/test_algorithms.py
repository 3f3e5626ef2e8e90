"""Algorithms against values worked out by hand (the arithmetic is in the comments)."""

import math

import numpy as np
import pytest
import torch

from posttrain.algorithms import (
    KL_KINDS, AdaptiveKLController, FixedKLController, agg_loss, apply_kl_penalty, entropy_from_logits,
    get_adv_estimator, get_policy_loss, grpo_advantages, kl_penalty, make_kl_controller, ppo_policy_loss,
)

T = torch.tensor


def outcome(scores, length=2):
    """Scores on the last token of rows of `length` tokens."""
    r = torch.zeros(len(scores), length)
    r[:, -1] = T(scores, dtype=torch.float32)
    return r


# ---------------------------------------------------------------- GRPO


def test_grpo_two_groups_of_three():
    # group "a" scores [1, 0, 0]: mean 1/3; deviations 2/3, -1/3, -1/3;
    #   unbiased var (4/9 + 1/9 + 1/9) / 2 = 1/3, std 0.577350
    #   -> (2/3) / (0.577350 + 1e-6) = 1.154698, (-1/3) / 0.577351 = -0.577349
    # group "b" scores [2, 4, 6]: mean 4, var (4 + 0 + 4) / 2 = 4, std 2 -> [-1, 0, 1]
    # the groups are interleaved: grouping goes by id, not by position
    rewards = outcome([1, 2, 0, 4, 0, 6])
    adv, ret = grpo_advantages(rewards, torch.ones(6, 2), ["a", "b", "a", "b", "a", "b"])
    expected = T([1.154698, -1.0, -0.577349, 0.0, -0.577349, 1.0])
    torch.testing.assert_close(adv[:, 0], expected, atol=2e-6, rtol=0)
    torch.testing.assert_close(adv[:, 1], expected, atol=2e-6, rtol=0)
    assert torch.equal(adv, ret)
    # the same ids as a tensor or a numpy array group the same way
    for index in (T([0, 1, 0, 1, 0, 1]), np.array(["a", "b", "a", "b", "a", "b"], dtype=object)):
        torch.testing.assert_close(grpo_advantages(rewards, torch.ones(6, 2), index)[0], adv)


def test_grpo_group_of_one_all_equal_and_no_std():
    # a group of one: mean 0, std 1 -> 0.7 / (1 + 1e-6) = 0.6999993
    adv, _ = grpo_advantages(outcome([0.7]), torch.ones(1, 2), ["p"])
    assert adv[0].tolist() == pytest.approx([0.6999993, 0.6999993], abs=2e-7)
    # all equal: deviations 0 -> 0 / (0 + eps) = 0
    adv, _ = grpo_advantages(outcome([1.0, 1.0, 1.0]), torch.ones(3, 2), [5, 5, 5])
    assert adv.abs().max().item() == 0.0
    # without std normalisation: [1, 0, 0] - 1/3 and [2, 4, 6] - 4
    adv, _ = grpo_advantages(outcome([1, 0, 0, 2, 4, 6]), torch.ones(6, 2), [0, 0, 0, 1, 1, 1],
                             norm_adv_by_std_in_grpo=False)
    torch.testing.assert_close(adv[:, 0], T([2 / 3, -1 / 3, -1 / 3, -2.0, 0.0, 2.0]))


def test_grpo_scores_are_row_sums_and_masked_tokens_zeroed():
    # row sums: 0.25 + 0.75 = 1 and 0; mean 0.5, std sqrt(((0.5)^2 * 2) / 1) = 0.707107
    # -> +-0.5 / 0.707108 = +-0.707106 on valid tokens, 0 on padding
    mask = T([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    rewards = T([[0.25, 0.75, 0.0], [0.0, 0.0, 0.0]])
    adv, _ = grpo_advantages(rewards, mask, [0, 0])
    torch.testing.assert_close(adv, T([[0.707106, 0.707106, 0.0], [-0.707106, 0.0, 0.0]]), atol=2e-6, rtol=0)
    with pytest.raises(ValueError, match="3 group ids"):
        grpo_advantages(rewards, mask, [0, 0, 1])


def test_adv_estimator_registry():
    assert get_adv_estimator("grpo") is grpo_advantages
    with pytest.raises(ValueError, match="supported: grpo"):
        get_adv_estimator("nope")


# ---------------------------------------------------------------- loss aggregation

LOSS = T([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])


@pytest.mark.parametrize("mode, both_valid, one_masked", [
    # mask A = [[1, 1, 0], [1, 1, 1]]: row sums 3 and 15, row lengths 2 and 3
    # mask B = [[1, 1, 0], [0, 0, 0]]: the second response has no valid token
    ("token-mean", 3.6, 1.5),                # A: 18 / 5 tokens        B: 3 / 2 tokens
    ("seq-mean-token-sum", 9.0, 3.0),        # A: (3 + 15) / 2         B: 3 / 1 valid sequence
    ("seq-mean-token-mean", 3.25, 1.5),      # A: (1.5 + 5) / 2        B: 1.5 / 1
    ("seq-mean-token-sum-norm", 3.0, 1.0),   # A: (3 + 15) / 2 / T=3   B: 3 / 1 / 3
])
def test_agg_loss_modes(mode, both_valid, one_masked):
    assert agg_loss(LOSS, T([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]]), mode).item() == pytest.approx(both_valid)
    mask_b = T([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    assert agg_loss(LOSS, mask_b, mode).item() == pytest.approx(one_masked)
    # what sits under the mask never leaks in, not even inf or NaN
    poisoned = T([[1.0, 2.0, float("nan")], [float("inf"), float("nan"), 6.0]])
    assert agg_loss(poisoned, mask_b, mode).item() == pytest.approx(one_masked)
    assert agg_loss(LOSS, mask_b.bool(), mode).item() == pytest.approx(one_masked)  # bool masks work
    assert agg_loss(LOSS, torch.zeros(2, 3), mode).item() == 0.0  # nothing valid: 0, not NaN
    assert agg_loss(LOSS[:, :0], mask_b[:, :0], mode).item() == 0.0  # zero-length responses (T = 0)
    assert agg_loss(LOSS[:0], mask_b[:0], mode).item() == 0.0  # an empty batch


def test_agg_loss_gradient_and_errors():
    loss = LOSS.clone().requires_grad_()
    agg_loss(loss, T([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]]), "seq-mean-token-mean").backward()
    # 1.5 = (l00 + l01) / 2 over one valid sequence: d/dl = 0.5 on its tokens, 0 elsewhere
    torch.testing.assert_close(loss.grad, T([[0.5, 0.5, 0.0], [0.0, 0.0, 0.0]]))
    # a constant Dr. GRPO normaliser: (3 + 15) / 2 / 6 = 1.5
    mask_a = T([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    assert agg_loss(LOSS, mask_a, "seq-mean-token-sum-norm", loss_scale_factor=6).item() == pytest.approx(1.5)
    with pytest.raises(ValueError, match="token-mean"):
        agg_loss(LOSS, mask_a, "sum")


# ---------------------------------------------------------------- PPO policy loss


def test_ppo_policy_loss_clip_cases():
    # old log-probs -1; ratio r = exp(logp - old); clip range [0.8, 1.2]; dual clip 3
    # token  A    r     loss1=-Ar  loss2=-A clip(r)  max      A<0: min(-3A, max)   clipped?
    #   1    1   1.1    -1.1       -1.1              -1.1                          inside
    #   2    1   1.5    -1.5       -1.2              -1.2                          yes (above)
    #   3    1   0.5    -0.5       -0.8              -0.5                          no (pessimistic)
    #   4   -1   0.5     0.5        0.8               0.8     min(3, 0.8) = 0.8    yes (below)
    #   5   -1   1.5     1.5        1.2               1.5     min(3, 1.5) = 1.5    no
    #   6   -1   5.0     5.0        1.2               5.0     min(3, 5.0) = 3.0    dual clip
    # token-mean: (-1.1 - 1.2 - 0.5 + 0.8 + 1.5 + 3.0) / 6 = 2.5 / 6 = 0.416667
    # pg_clipfrac (loss2 > loss1): tokens 2 and 4 -> 2/6; pg_clipfrac_lower: token 6 -> 1/6
    # ppo_kl = mean(old - logp) = -(ln 1.1 + 2 ln 1.5 + 2 ln 0.5 + ln 5) / 6 = -0.188231
    old = torch.full((1, 6), -1.0)
    logp = (old + torch.log(T([[1.1, 1.5, 0.5, 0.5, 1.5, 5.0]]))).requires_grad_()
    adv = T([[1.0, 1.0, 1.0, -1.0, -1.0, -1.0]])
    out = ppo_policy_loss(old, logp, adv, torch.ones(1, 6))
    assert out["pg_loss"].item() == pytest.approx(0.416667, abs=1e-6)
    assert out["pg_clipfrac"].item() == pytest.approx(1 / 3)
    assert out["pg_clipfrac_lower"].item() == pytest.approx(1 / 6)
    assert out["ppo_kl"].item() == pytest.approx(-0.188231, abs=1e-6)
    assert not any(out[k].requires_grad for k in ("pg_clipfrac", "ppo_kl", "pg_clipfrac_lower"))
    out["pg_loss"].backward()
    # d(-A r)/d logp = -A r on unclipped tokens (1, 3, 5), over 6 tokens; clipped tokens get 0
    torch.testing.assert_close(logp.grad, T([[-1.1 / 6, 0.0, -0.5 / 6, 0.0, 1.5 / 6, 0.0]]))
    assert get_policy_loss("vanilla") is ppo_policy_loss
    with pytest.raises(ValueError, match="vanilla, gspo"):
        get_policy_loss("sapo")


def test_ppo_policy_loss_without_dual_clip():
    # the six tokens of test_ppo_policy_loss_clip_cases; clip_ratio_c=None (NeMo-RL's ratio_clip_c: null) leaves
    # token 6 (A = -1, r = 5) at max(5.0, 1.2) = 5.0 instead of min(3, 5.0) = 3.0:
    # token-mean (-1.1 - 1.2 - 0.5 + 0.8 + 1.5 + 5.0) / 6 = 4.5 / 6 = 0.75 (with 3.0: 2.5 / 6)
    old = torch.full((1, 6), -1.0)
    adv = T([[1.0, 1.0, 1.0, -1.0, -1.0, -1.0]])
    losses, grads = {}, {}
    for c in (3.0, None):
        logp = (old + torch.log(T([[1.1, 1.5, 0.5, 0.5, 1.5, 5.0]]))).requires_grad_()
        out = ppo_policy_loss(old, logp, adv, torch.ones(1, 6), clip_ratio_c=c)
        out["pg_loss"].backward()
        losses[c], grads[c] = out, logp.grad
    assert losses[3.0]["pg_loss"].item() == pytest.approx(2.5 / 6, abs=1e-6)
    assert losses[None]["pg_loss"].item() == pytest.approx(0.75, abs=1e-6)
    assert losses[None]["pg_clipfrac_lower"].item() == 0.0
    assert losses[3.0]["pg_clipfrac_lower"].item() == pytest.approx(1 / 6)
    assert losses[None]["pg_clipfrac"].item() == pytest.approx(1 / 3)  # the ordinary clip is unchanged
    # token 6 now has a gradient: d(-A r)/d logp = -A r = 5 / 6 (the dual clip's constant -A c has none)
    torch.testing.assert_close(grads[None], T([[-1.1 / 6, 0.0, -0.5 / 6, 0.0, 1.5 / 6, 5.0 / 6]]))
    torch.testing.assert_close(grads[3.0], T([[-1.1 / 6, 0.0, -0.5 / 6, 0.0, 1.5 / 6, 0.0]]))
    # the other losses accept None too (they have no dual clip)
    for name in ("gspo", "gpg"):
        get_policy_loss(name)(old, old, adv, torch.ones(1, 6), clip_ratio_c=None)


def test_ppo_policy_loss_grad_only_through_log_prob():
    old = torch.zeros(1, 2, requires_grad=True)
    adv = T([[1.0, -1.0]], requires_grad=True)
    logp = torch.log(T([[1.0, 1.0]])).requires_grad_()
    ppo_policy_loss(old.detach(), logp, adv.detach(), torch.ones(1, 2))["pg_loss"].backward()
    # ratio 1 inside the range: -A r / 2 = [-0.5, 0.5]
    torch.testing.assert_close(logp.grad, T([[-0.5, 0.5]]))
    assert old.grad is None and adv.grad is None


def test_ppo_policy_loss_asymmetric_clip_mask_and_modes():
    # clip-higher: ratio 1.25 with high 0.28 is inside [0.8, 1.28]: loss -1.25; the masked
    # token (ratio 9, would be clipped) counts neither in the loss nor in clipfrac
    logp = torch.log(T([[1.25, 9.0]]))
    out = ppo_policy_loss(torch.zeros(1, 2), logp, T([[1.0, 1.0]]), T([[1.0, 0.0]]),
                          clip_ratio_low=0.2, clip_ratio_high=0.28)
    assert out["pg_loss"].item() == pytest.approx(-1.25)
    assert out["pg_clipfrac"].item() == 0.0
    # loss_agg_mode passes through: per-token losses [[-1, -1, pad], [-1, pad, pad]] (r = 1, A = 1)
    zeros, mask = torch.zeros(2, 3), T([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert ppo_policy_loss(zeros, zeros, torch.ones(2, 3), mask)["pg_loss"].item() == pytest.approx(-1.0)
    assert ppo_policy_loss(zeros, zeros, torch.ones(2, 3), mask,
                           loss_agg_mode="seq-mean-token-sum")["pg_loss"].item() == pytest.approx(-1.5)
    # the log-ratio is clamped at 20: ppo_kl = -20, and A = -1 hits the dual clip: loss 3
    out = ppo_policy_loss(torch.zeros(1, 1), T([[30.0]]), T([[-1.0]]), torch.ones(1, 1))
    assert out["ppo_kl"].item() == -20.0 and out["pg_loss"].item() == 3.0
    with pytest.raises(ValueError, match="clip_ratio_c"):
        ppo_policy_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1), clip_ratio_c=1.0)


# ---------------------------------------------------------------- KL


def test_kl_estimators():
    logp, ref = T([-1.0, -2.0]), T([-2.0, -1.0])  # d = logp - ref = [1, -1]
    for kind in ("kl", "k1"):
        torch.testing.assert_close(kl_penalty(logp, ref, kind), T([1.0, -1.0]))
    torch.testing.assert_close(kl_penalty(logp, ref, "abs"), T([1.0, 1.0]))
    for kind in ("mse", "k2"):
        torch.testing.assert_close(kl_penalty(logp, ref, kind), T([0.5, 0.5]))
    # k3 = e^x - x - 1 with x = ref - logp: x = -1 -> 0.367879; x = 1 -> 0.718282
    for kind in ("low_var_kl", "k3"):
        torch.testing.assert_close(kl_penalty(logp, ref, kind), T([0.367879, 0.718282]), atol=1e-6, rtol=0)
    # clamps, x = ref - logp: -5 -> 4.006738; 2.5 -> 8.682494; 3 -> 16.0855 -> 10;
    # -30 -> -20 -> e^-20 + 19 = 19.0 -> 10; 30 -> 20 -> e^20 - 21 -> 10
    x = T([-5.0, 2.5, 3.0, -30.0, 30.0])
    torch.testing.assert_close(kl_penalty(torch.zeros(5), x, "k3"), T([4.006738, 8.682494, 10.0, 10.0, 10.0]),
                               atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="low_var_kl"):
        kl_penalty(logp, ref, "full")
    with pytest.raises(ValueError, match="k3\\+"):
        kl_penalty(logp, ref, "k4")


def test_kl_straight_through_kinds():
    # logp = -1, ref = -2 (d = 1): k3 value 0.367879; its own gradient d/dlogp (e^(ref-logp) - (ref-logp) - 1)
    # = 1 - e^-1 = 0.632121; "k3+" keeps the value and takes k2's gradient, d = 1
    logp = T([-1.0], requires_grad=True)
    kl_penalty(logp, T([-2.0]), "k3").sum().backward()
    assert logp.grad.item() == pytest.approx(0.632121, abs=1e-6)
    logp.grad = None
    value = kl_penalty(logp, T([-2.0]), "k3+")
    assert value.item() == pytest.approx(0.367879, abs=1e-6)
    value.sum().backward()
    assert logp.grad.item() == pytest.approx(1.0)
    # k1+: value d = 1, gradient d = 1; abs+ at d = -1: value 1, gradient -1
    assert kl_penalty(T([-1.0]), T([-2.0]), "k1+").item() == pytest.approx(1.0)
    logp = T([-2.0], requires_grad=True)
    value = kl_penalty(logp, T([-1.0]), "abs+")
    value.sum().backward()
    assert (value.item(), logp.grad.item()) == (1.0, -1.0)
    assert {"k3+", "low_var_kl+", "kl+", "k1+", "abs+", "mse+", "k2+"} <= set(KL_KINDS)


def test_kl_controllers():
    c = AdaptiveKLController(0.1, target_kl=0.1, horizon=1000)
    c.update(0.2, n_steps=100)   # err 0.2/0.1 - 1 = 1 -> clipped 0.2 -> x(1 + 0.2 * 100/1000) = 0.102
    assert c.value == pytest.approx(0.102)
    c = AdaptiveKLController(0.1, target_kl=0.1, horizon=1000)
    c.update(0.05, n_steps=100)  # err -0.5 -> -0.2 -> x0.98 = 0.098
    assert c.value == pytest.approx(0.098)
    c.update(0.11, n_steps=100)  # err 0.1 (inside the clip) -> x1.01 = 0.09898
    assert c.value == pytest.approx(0.09898)
    c.update(0.1, n_steps=500)   # on target: err 0 -> unchanged
    assert c.value == pytest.approx(0.09898)
    f = FixedKLController(0.3)
    f.update(5.0, 10)
    assert f.value == 0.3
    restored = make_kl_controller("adaptive", 1.0, target_kl=0.1, horizon=10)
    restored.load_state_dict(c.state_dict())
    assert isinstance(restored, AdaptiveKLController) and restored.value == c.value
    assert isinstance(make_kl_controller("fixed", 0.2), FixedKLController)
    with pytest.raises(ValueError, match="target_kl"):
        make_kl_controller("adaptive", 0.1)
    with pytest.raises(ValueError, match="horizon"):
        make_kl_controller("adaptive", 0.1, target_kl=0.1, horizon=0)
    with pytest.raises(ValueError, match="fixed, adaptive"):
        make_kl_controller("pid", 0.1)


def test_apply_kl_penalty():
    scores = T([[0.0, 0.0, 1.0], [0.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    logp = torch.full((3, 3), -1.0)
    ref = T([[-1.5, -1.0, -1.0], [-1.0, -1.0, -2.0], [-3.0, -3.0, -3.0]])
    mask = T([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    # k1 = logp - ref = [[0.5, 0, 0], [0, 0, 1], [2, 2, 2]], masked -> [[0.5, 0, 0], 0, 0]; beta 0.1
    # current_kl = mean over 3 sequences of token means (0.5/3, 0/2, 0 for the empty row) = 1/18
    # adaptive, target 0.1: err = (1/18)/0.1 - 1 = -0.444 -> -0.2; x(1 - 0.2 * 3/10) = 0.094
    ctrl = make_kl_controller("adaptive", 0.1, target_kl=0.1, horizon=10)
    rewards, m = apply_kl_penalty(scores, logp, ref, mask, ctrl, "kl")
    torch.testing.assert_close(rewards, T([[-0.05, 0.0, 1.0], [0.0, 1.0, 0.0], [0.0, 0.0, 0.0]]))
    assert m["actor/reward_kl_penalty"] == pytest.approx(1 / 18)
    assert m["actor/reward_kl_penalty_coeff"] == 0.1  # the beta used, before the update
    assert all(type(v) is float for v in m.values())
    assert ctrl.value == pytest.approx(0.094)


def test_entropy():
    # uniform over V: H = log V, for every position of a [B, T, V] tensor
    assert entropy_from_logits(torch.zeros(2, 3, 7)).flatten().tolist() == pytest.approx([math.log(7)] * 6)
    # adding a constant to all logits changes nothing (no exp of a large logit overflows)
    assert entropy_from_logits(torch.full((5,), 100.0)).item() == pytest.approx(math.log(5), abs=2e-5)
    # one-hot-ish: p = softmax([0, -1e9]) -> entropy 0
    assert entropy_from_logits(T([0.0, -1e9])).item() == pytest.approx(0.0, abs=1e-6)
    # p = [0.5, 0.25, 0.25]: H = 0.5 ln 2 + 2 * 0.25 ln 4 = 1.5 ln 2 = 1.039721
    assert entropy_from_logits(torch.log(T([0.5, 0.25, 0.25]))).item() == pytest.approx(1.039721, abs=1e-6)
