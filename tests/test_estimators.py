"""The algorithm family's pure functions against values worked out by hand
(the arithmetic is in the comments), with the edge cases: groups of one,
all-equal scores, fully masked rows, zero-length responses."""

import math

import pytest
import torch

from posttrain.algorithms import (
    compute_advantages, explained_variance, gae_advantages, grpo_loo_advantages, grpo_passk_advantages,
    gspo_policy_loss, masked_whiten,
    overlong_penalty, reinforce_pp_advantages, reinforce_pp_baseline_advantages, rloo_advantages, value_loss,
    varied_groups,
)

T = torch.tensor


def close(a, b, atol=1e-5):
    torch.testing.assert_close(a, T(b, dtype=a.dtype) if not isinstance(b, torch.Tensor) else b, atol=atol, rtol=0)


# ---------------------------------------------------------------- whitening

def test_masked_whiten():
    # valid 1, 2, 3: mean 2, unbiased var (1 + 0 + 1) / 2 = 1; the masked 100 is shifted and scaled too
    close(masked_whiten(T([1.0, 2.0, 3.0, 100.0]), T([1, 1, 1, 0])), [-1.0, 0.0, 1.0, 98.0])
    close(masked_whiten(T([1.0, 2.0, 3.0]), T([1, 1, 1]), shift_mean=False), [1.0, 2.0, 3.0])
    # one valid entry: variance 0 (verl raises), the entry whitens to 0; nothing is NaN
    out = masked_whiten(T([5.0, 7.0]), T([1, 0]))
    assert out[0] == 0 and torch.isfinite(out).all()
    assert torch.isfinite(masked_whiten(T([[5.0, 7.0]]), T([[0, 0]]))).all()
    assert masked_whiten(torch.zeros(2, 0), torch.zeros(2, 0)).shape == (2, 0)


# ---------------------------------------------------------------- outcome estimators

ROWS_MASK = T([[1, 1], [1, 0], [0, 0], [1, 1]])


def outcome(scores, mask=ROWS_MASK):
    """Scores placed on each row's last valid token (a fully masked row keeps its score nowhere)."""
    out = torch.zeros(mask.shape)
    for i, s in enumerate(scores):
        n = int(mask[i].sum())
        if n:
            out[i, n - 1] = s
    return out


def test_rloo_leave_one_out_and_a_group_of_one():
    # group 0 = rows 0-2, scores [1, 0, 0] (row 2 fully masked: its score counts in the group, 0):
    # row 0: 1 - mean(0, 0) = 1; rows 1, 2: 0 - mean(1, 0) = -0.5. Group 1 = row 3 alone: keeps its score 1.
    adv, ret = rloo_advantages(outcome([1, 0, 0, 1]), ROWS_MASK, [0, 0, 0, 1])
    close(adv, [[1.0, 1.0], [-0.5, 0.0], [0.0, 0.0], [1.0, 1.0]])
    assert ret is adv
    # all-equal scores: every advantage is 0
    full = torch.ones(4, 2)
    close(rloo_advantages(outcome([1, 1, 1, 1], full), full, [0, 0, 0, 0])[0], torch.zeros(4, 2))


def test_grpo_loo_compares_each_sample_with_the_others_only():
    # scores [1, 0, 0, 0], one group:
    # row 0: others [0, 0, 0]: baseline 0, std 0 -> not divided: A = 1 - 0 = 1
    # rows 1-3: others [1, 0, 0]: baseline 1/3; unbiased std: deviations 2/3, -1/3, -1/3,
    #   var (4/9 + 1/9 + 1/9) / 2 = 1/3, std sqrt(1/3) = 0.577350 -> A = (0 - 1/3) / (0.577350 + 1e-6) = -0.577349
    a = -(1 / 3) / (math.sqrt(1 / 3) + 1e-6)
    full = torch.ones(4, 2)
    adv, ret = grpo_loo_advantages(outcome([1, 0, 0, 0], full), full, [0, 0, 0, 0])
    close(adv, [[1.0, 1.0], [a, a], [a, a], [a, a]], atol=1e-6)
    assert ret is adv
    # norm_adv_by_std_in_grpo=False: score - baseline, never divided: [1, -1/3, -1/3, -1/3]
    adv, _ = grpo_loo_advantages(outcome([1, 0, 0, 0], full), full, [0, 0, 0, 0], norm_adv_by_std_in_grpo=False)
    close(adv[:, 0], [1.0, -1 / 3, -1 / 3, -1 / 3])
    # undivided, it is RLOO's advantage in every group of two or more: score - mean of the others
    scores, groups = torch.rand(12, 1), [0, 0, 0, 1, 1, 2, 2, 2, 2, 2, 3, 3]
    close(grpo_loo_advantages(scores, torch.ones(12, 1), groups, norm_adv_by_std_in_grpo=False)[0],
          rloo_advantages(scores, torch.ones(12, 1), groups)[0])
    # scores [2, 0, 1] (group 0, rows 0-2; row 1 one token long) and [5] alone (group 1, row 3):
    # row 0: others [0, 1]: baseline 0.5, std sqrt(0.5) = 0.707107 -> 1.5 / 0.707108 = 2.121318
    # row 1: others [2, 1]: baseline 1.5, std 0.707107 -> -1.5 / 0.707108 = -2.121318, on its one token
    # row 2: others [2, 0]: baseline 1, std sqrt(2) -> 0 / 1.414215 = 0
    # row 3: a group of one: advantage 0 (its baseline is its own score)
    mask = T([[1, 1], [1, 0], [1, 1], [1, 1]])
    adv, _ = grpo_loo_advantages(T([[0.0, 2.0], [0.0, 0.0], [0.0, 1.0], [0.0, 5.0]]), mask, [0, 0, 0, 1])
    b = 1.5 / (math.sqrt(0.5) + 1e-6)
    close(adv, [[b, b], [-b, 0.0], [0.0, 0.0], [0.0, 0.0]])
    # a group of two: one other score, whose std is undefined (NaN -> 0): not divided, A = +-(r0 - r1)
    adv, _ = grpo_loo_advantages(T([[3.0], [1.0]]), torch.ones(2, 1), [0, 0])
    close(adv, [[2.0], [-2.0]])
    # all equal: 0 everywhere, never NaN; the dispatcher passes norm_adv_by_std_in_grpo and epsilon
    close(grpo_loo_advantages(full, full, [0, 0, 0, 0])[0], torch.zeros(4, 2))
    adv, _ = compute_advantages("grpo_loo", outcome([1, 0, 0, 0], full), full, [0, 0, 0, 0], epsilon=1.0)
    close(adv[1], [-(1 / 3) / (math.sqrt(1 / 3) + 1.0)] * 2)


def test_reinforce_pp_returns_to_go_and_batch_whitening():
    rewards = T([[0.0, 0.0, 1.0], [0.0, 5.0, 1.0], [0.0, 3.0, 0.0]])
    mask = T([[1, 1, 1], [1, 0, 1], [0, 0, 0]])
    adv, ret = reinforce_pp_advantages(rewards, mask, gamma=0.5)
    # row 0: 1, 0.5 * 1, 0.5 * 0.5; row 1: token 1 is masked (tool output, say): its 5 is no reward and no
    # step, token 0 gets 0.5 * 1; row 2 is fully masked
    close(ret, [[0.25, 0.5, 1.0], [0.5, 0.0, 1.0], [0.0, 0.0, 0.0]])
    # whitened over the valid [0.25, 0.5, 1, 0.5, 1]: mean 0.65, deviations [-0.4, -0.15, 0.35, -0.15, 0.35],
    # unbiased var 0.45 / 4 = 0.1125, std 0.335410
    close(adv, [[-1.192570, -0.447214, 1.043498], [-0.447214, 0.0, 1.043498], [0.0, 0.0, 0.0]])
    _, ret1 = reinforce_pp_advantages(rewards, mask, gamma=1.0)
    close(ret1[:2], [[1.0, 1.0, 1.0], [1.0, 0.0, 1.0]])


def test_reinforce_pp_baseline():
    # groups {0: [1, 0]}, {1: [1]}, one token each: centred [0.5, -0.5, 1 - 0], then whitened over the
    # batch: mean 1/3, deviations [1/6, -5/6, 2/3], var (1 + 25 + 16) / 36 / 2 = 0.583333, std 0.763763
    mask = T([[1], [1], [1]])
    adv, ret = reinforce_pp_baseline_advantages(T([[1.0], [0.0], [1.0]]), mask, [0, 0, 1])
    close(adv, [[0.218218], [-1.091089], [0.872872]])
    assert ret is adv
    adv, _ = reinforce_pp_baseline_advantages(outcome([1, 0, 0, 1]), ROWS_MASK, [0, 0, 0, 1])
    assert adv[2].eq(0).all() and adv[1, 1] == 0  # zero outside the mask


def test_grpo_passk_only_the_best_sample_gains():
    mask = torch.ones(6, 1)
    adv, _ = grpo_passk_advantages(T([[0.0], [1.0], [0.5], [1.0], [1.0], [0.0]]), mask, [0, 0, 0, 1, 1, 1])
    # group 0: best 1, second 0.5, std of [0, 1, 0.5] = 0.5 -> 0.5 / (0.5 + 1e-6) on row 1 only;
    # group 1: two samples tie at the top: 1 - 1 = 0 for everyone
    close(adv, [[0.0], [0.5 / 0.500001], [0.0], [0.0], [0.0], [0.0]])
    adv, _ = grpo_passk_advantages(T([[0.0], [1.0], [0.5]]), torch.ones(3, 1), [0, 0, 0],
                                   norm_adv_by_std_in_grpo=False)
    close(adv, [[0.0], [0.5], [0.0]])
    with pytest.raises(ValueError, match="at least 2 samples per prompt"):
        grpo_passk_advantages(T([[1.0], [0.0]]), torch.ones(2, 1), [0, 1])


@pytest.mark.parametrize("name", ["grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "grpo_passk",
                                  "grpo_loo"])
def test_zero_length_responses_and_fully_masked_batches(name):
    for rewards, mask in ((torch.zeros(4, 0), torch.zeros(4, 0)), (torch.zeros(4, 3), torch.zeros(4, 3))):
        adv, ret = compute_advantages(name, rewards, mask, [0, 0, 1, 1])
        assert adv.shape == rewards.shape and ret.shape == rewards.shape
        assert adv.eq(0).all() and torch.isfinite(ret).all()


# ---------------------------------------------------------------- GAE

def test_gae_skips_masked_tokens_and_whitens():
    # one row, gamma 0.9, lam 0.8 (gamma * lam = 0.72); token 1 is masked (its value 9 must not count)
    # t=2: delta = 1 - 0.6 = 0.4 -> A2 = 0.4
    # t=1: masked: the next value (0.6) and A (0.4) carry over
    # t=0: delta = 0 + 0.9 * 0.6 - 0.2 = 0.34 -> A0 = 0.34 + 0.72 * 0.4 = 0.628
    rewards = T([[0.0, 0.0, 1.0]])
    values = T([[0.2, 9.0, 0.6]])
    mask = T([[1, 0, 1]])
    adv, ret = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.8)
    close(ret, [[0.628 + 0.2, 0.0, 0.4 + 0.6]])
    # whitening two values leaves +-1/sqrt(2) (unbiased std of [a, b] is |a - b| / sqrt(2))
    close(adv, [[1 / math.sqrt(2), 0.0, -1 / math.sqrt(2)]])


def test_gae_with_gamma_lam_one_is_reward_to_go_minus_value():
    # gamma = lam = 1: A_t = (sum of rewards from t) - V_t; returns = the row's outcome on every token
    rewards = T([[0.0, 1.0], [0.0, 0.0]])
    values = T([[0.5, 0.5], [0.25, 0.0]])
    mask = T([[1, 1], [1, 0]])
    adv, ret = gae_advantages(rewards, values, mask)
    close(ret, [[1.0, 1.0], [0.0, 0.0]])
    # raw A: [0.5, 0.5, -0.25]; mean 0.25, unbiased var (0.0625 * 2 + 0.25) / 2 = 0.1875
    s = math.sqrt(0.1875)
    close(adv, [[0.25 / s, 0.25 / s], [-0.5 / s, 0.0]])
    with pytest.raises(ValueError, match="needs the critic's values"):
        compute_advantages("gae", rewards, mask, [0, 1])
    a2, r2 = compute_advantages("gae", rewards, mask, [0, 1], values=values, gamma=1.0, lam=1.0)
    assert torch.equal(a2, adv) and torch.equal(r2, ret)
    with pytest.raises(ValueError, match="unknown advantage estimator 'opo'"):
        compute_advantages("opo", rewards, mask, [0, 1])


# ---------------------------------------------------------------- GSPO

def test_gspo_sequence_ratio_and_its_gradient():
    old = torch.zeros(2, 2)
    new = T([[0.1, -0.3], [5.0, 5.0]]).requires_grad_()
    adv = T([[1.0, 1.0], [1.0, 1.0]])
    mask = T([[1, 1], [0, 0]])  # the second row is fully masked: it adds nothing, and no NaN
    out = gspo_policy_loss(old, new, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.2)
    s = math.exp(-0.1)  # the geometric mean of the token ratios: exp((0.1 - 0.3) / 2)
    assert out["pg_loss"].item() == pytest.approx(-s, abs=1e-6)
    out["pg_loss"].backward()
    # each token: d(-A s)/d log_prob_t = -A s, averaged over the row's 2 tokens
    close(new.grad, [[-s / 2, -s / 2], [0.0, 0.0]])
    assert out["pg_clipfrac"].item() == 0 and out["ppo_kl"].item() == pytest.approx(0.1)


def test_gspo_clips_the_sequence_ratio_and_on_policy_is_minus_the_mean_advantage():
    old = torch.zeros(1, 2)
    new = T([[0.5, 0.5]]).requires_grad_()  # s = e^0.5 = 1.6487 > 1.2: clipped, no gradient
    out = gspo_policy_loss(old, new, torch.ones(1, 2), torch.ones(1, 2), clip_ratio_low=0.2, clip_ratio_high=0.2)
    assert out["pg_loss"].item() == pytest.approx(-1.2) and out["pg_clipfrac"].item() == 1.0
    out["pg_loss"].backward()
    assert new.grad.eq(0).all()
    # on policy (ratio 1) the loss is -A aggregated: rows [-1, -1] and [2, 2 (masked)]
    lp, adv, mask = torch.zeros(2, 2), T([[1.0, 1.0], [-2.0, -2.0]]), T([[1, 1], [1, 0]])
    assert gspo_policy_loss(lp, lp, adv, mask)["pg_loss"].item() == pytest.approx(0.5)  # mean(-1, 2): the paper's
    assert gspo_policy_loss(lp, lp, adv, mask, loss_agg_mode="token-mean")["pg_loss"].item() == pytest.approx(0.0)


# ---------------------------------------------------------------- the critic's loss

def test_value_loss_clipping_cases_and_gradient():
    # cliprange 0.5; (values, returns, vpred): (0, 1, 0.3) inside the range: 0.49;
    # (0, 1, 2.0) the clipped prediction 0.5 is closer to the return: the unclipped 1.0 counts;
    # (2, 1, 1.0) the clipped prediction 1.5 is farther: 0.25 counts (clipped, no gradient)
    vpreds = T([[0.3, 2.0, 1.0]]).requires_grad_()
    out = value_loss(vpreds, T([[1.0, 1.0, 1.0]]), T([[0.0, 0.0, 2.0]]), torch.ones(1, 3), cliprange_value=0.5)
    assert out["vf_loss"].item() == pytest.approx(0.5 * (0.49 + 1.0 + 0.25) / 3)
    assert out["vf_clipfrac"].item() == pytest.approx(1 / 3)
    out["vf_loss"].backward()
    # d/dv of 0.5 * mean((v - R)^2) = (v - R) / 3 on unclipped tokens
    close(vpreds.grad, [[-0.7 / 3, 1.0 / 3, 0.0]])
    masked = value_loss(T([[1.0, float("nan")]]), T([[0.0, 0.0]]), T([[0.0, 0.0]]), T([[1, 0]]))
    assert masked["vf_loss"].item() == pytest.approx(0.5 * 0.5 ** 2 * 4)  # vpred 1 clipped to 0.5: max(1, 0.25)


def test_explained_variance():
    mask = torch.ones(1, 3)
    assert explained_variance(T([[1.0, 2.0, 3.0]]), T([[1.0, 2.0, 3.0]]), mask).item() == pytest.approx(1.0)
    # values = the mean return: 1 - Var[r - 2] / (Var[r] + 1e-5) = 1 - 1 / 1.00001
    assert explained_variance(T([[2.0, 2.0, 2.0]]), T([[1.0, 2.0, 3.0]]), mask).item() == pytest.approx(1e-5, abs=1e-7)
    # only valid tokens count; fewer than 2 -> 0
    assert explained_variance(T([[1.0, 2.0, 9.0]]), T([[1.0, 2.0, 3.0]]), T([[1, 1, 0]])).item() == pytest.approx(1.0)
    assert explained_variance(T([[1.0]]), T([[3.0]]), T([[1]])).item() == 0.0
    assert explained_variance(torch.zeros(2, 0), torch.zeros(2, 0), torch.zeros(2, 0)).item() == 0.0


# ---------------------------------------------------------------- DAPO

def test_overlong_penalty():
    lengths = T([10, 16, 18, 20])
    close(overlong_penalty(lengths, 20, 4), [0.0, 0.0, -0.5, -1.0])
    close(overlong_penalty(lengths, 20, 4, penalty_factor=2.0), [0.0, 0.0, -1.0, -2.0])
    close(overlong_penalty(T([0, 1]), 1, 1), [0.0, -1.0])  # the whole response is the buffer
    for bad in (0, 21):
        with pytest.raises(ValueError, match="overlong buffer must be 1..20"):
            overlong_penalty(lengths, 20, bad)


def test_varied_groups():
    keep = varied_groups(T([1.0, 1.0, 0.0, 1.0, 0.0]), [0, 0, 1, 1, 2])
    assert keep.tolist() == [False, False, True, True, True]  # group 0 all equal; group 2 has one sample
    assert varied_groups(T([0.5, 0.5]), torch.tensor([3, 3])).tolist() == [False, False]
    assert varied_groups(torch.zeros(0), []).tolist() == []


def test_gdpo_normalizes_each_reward_in_its_group_then_whitens_the_weighted_sum():
    """GDPO by hand: one group of 3, correctness [1, 0, 0], format [1, 1, 0] (the docstring's example), then
    weights [2, 1]; a second group of one gets 0 from every component; leave-one-out per component."""
    from posttrain.algorithms import compute_advantages
    from posttrain.algorithms.advantages import gdpo_advantages

    comps = torch.tensor([[1.0, 1.0], [0.0, 1.0], [0.0, 0.0]])
    mask = torch.tensor([[1, 1], [1, 0], [1, 1]], dtype=torch.float32)
    adv, ret = gdpo_advantages(comps, mask, [0, 0, 0])
    assert torch.allclose(adv, torch.tensor([[1.0, 1.0], [0.0, 0.0], [-1.0, -1.0]]), atol=1e-5) and adv is ret
    # weights [2, 1]: sum [2.3094 + 0.5774, -1.1547 + 0.5774, -1.1547 - 1.1547] = [2.8868, -0.5774, -2.3094],
    # mean 0, std sqrt(7) = 2.6458 -> [1.0911, -0.2182, -0.8729]
    adv, _ = gdpo_advantages(comps, torch.ones(3, 1), [0, 0, 0], reward_weights=[2.0, 1.0])
    assert torch.allclose(adv[:, 0], torch.tensor([1.0911, -0.2182, -0.8729]), atol=1e-4)
    # a group of one (row 3) adds 0 before the whitening: [1.7321, 0, -1.7321, 0] -> mean 0, std sqrt(2) = 1.4142
    four = torch.cat([comps, torch.tensor([[1.0, 0.0]])])
    adv, _ = gdpo_advantages(four, torch.ones(4, 1), [0, 0, 0, 1])
    assert torch.allclose(adv[:, 0], torch.tensor([1.2247, 0.0, -1.2247, 0.0]), atol=1e-4)
    # leave one out: correctness [1, 0, 0] -> [1, -0.7071, -0.7071]; format [1, 1, 0] -> [0.7071, 0.7071, -1]
    # (each row against the other two: baselines [0, 0.5, 0.5] / [0.5, 0.5, 1], stds [0, 0.7071, 0.7071] /
    # [0.7071, 0.7071, 0]: divided where > 0); sum [1.7071, 0, -1.7071] whitens to [1, 0, -1]
    from posttrain.algorithms.advantages import grpo_loo_advantages

    loo, _ = grpo_loo_advantages(torch.tensor([[1.0], [0.0], [0.0]]), torch.ones(3, 1), [0, 0, 0])
    assert torch.allclose(loo[:, 0], torch.tensor([1.0, -0.7071, -0.7071]), atol=1e-4)
    adv, _ = gdpo_advantages(comps, torch.ones(3, 1), [0, 0, 0], leave_one_out=True)
    assert torch.allclose(adv[:, 0], torch.tensor([1.0, 0.0, -1.0]), atol=1e-4)
    # through the dispatcher, which insists on the components
    got, _ = compute_advantages("gdpo", torch.zeros(3, 2), mask, [0, 0, 0], reward_components=comps)
    assert torch.allclose(got, torch.tensor([[1.0, 1.0], [0.0, 0.0], [-1.0, -1.0]]), atol=1e-5)
    with pytest.raises(ValueError, match="needs reward_components"):
        compute_advantages("gdpo", torch.zeros(3, 2), mask, [0, 0, 0])
    with pytest.raises(ValueError, match="1 reward weights for 2 reward components"):
        gdpo_advantages(comps, mask, [0, 0, 0], reward_weights=[1.0])


def test_gdpo_components_come_from_the_rewards_dict_returns_by_name():
    """generation.reward_components: each row's numbers beside "score", in name order (or the keys given); a
    row without one counts 0; fewer than two parts, or a key no reward returned, is a RewardError with the fix."""
    from posttrain.errors import RewardError
    from posttrain.driver.scoring import reward_components

    class Rows(list):
        @property
        def reward_extras(self):
            return list(self)

    batch = Rows([{"format": 1.0, "correctness": 0.0}, {"correctness": 1.0}, {}])
    comps, names = reward_components(batch, [])
    assert names == ["correctness", "format"] and comps.tolist() == [[0.0, 1.0], [1.0, 0.0], [0.0, 0.0]]
    comps, names = reward_components(batch, ["format", "correctness"])
    assert names == ["format", "correctness"] and comps.tolist() == [[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]]
    with pytest.raises(RewardError, match=r"returned 1 beside its score \(acc\).*reward.data_source=math_multi_reward"):
        reward_components(Rows([{"acc": 1.0}, {"acc": 0.0}]), [])
    with pytest.raises(RewardError, match="reward_keys names length, which no response's reward returned"):
        reward_components(batch, ["format", "length"])
