"""The algorithm family's pure functions, more hand-worked cases (the arithmetic
is in the comments): whitening with 0/1 valid entries, gamma and lam < 1 on
rows of different lengths, fully masked rows, T = 0, the dispatcher passing
each estimator only its own arguments, GSPO's gradient on both sides of the
clip, the value clip on both sides, explained variance with Var[returns] = 0.
The base cases are in test_estimators.py."""

import inspect

import pytest
import torch

from posttrain.algorithms import (
    ADV_ESTIMATORS, NEEDS_CRITIC, POLICY_LOSSES, compute_advantages, explained_variance, gae_advantages,
    grpo_passk_advantages, gspo_policy_loss, masked_whiten, overlong_penalty, ppo_policy_loss,
    reinforce_pp_advantages, reinforce_pp_baseline_advantages, rloo_advantages, value_loss, varied_groups,
)

T = torch.tensor


def close(a, b, atol=1e-5):
    torch.testing.assert_close(a, T(b, dtype=a.dtype), atol=atol, rtol=0)


# ---------------------------------------------------------------- masked_whiten

def test_masked_whiten_statistics_span_rows():
    # valid [1, 3, 5] across two rows: mean 3, unbiased var (4 + 0 + 4) / 2 = 4, std 2;
    # the masked 0 is shifted and scaled too: (0 - 3) / 2 = -1.5
    values, mask = T([[1.0, 3.0], [5.0, 0.0]]), T([[1, 1], [1, 0]])
    close(masked_whiten(values, mask), [[-1.0, 0.0], [1.0, -1.5]])
    close(masked_whiten(values, mask.bool()), [[-1.0, 0.0], [1.0, -1.5]])
    # shift_mean=False adds the mean 3 back
    close(masked_whiten(values, mask, shift_mean=False), [[2.0, 3.0], [4.0, 1.5]])
    # all valid entries equal: var 0 -> 0 * rsqrt(1e-8) = 0
    close(masked_whiten(T([2.0, 2.0, 2.0]), T([1, 1, 1])), [0.0, 0.0, 0.0])


def test_masked_whiten_with_one_or_no_valid_entry():
    # one valid entry (verl raises): shift only, by its value 5: [0, 2]; shift_mean=False: unchanged
    close(masked_whiten(T([5.0, 7.0]), T([1, 0])), [0.0, 2.0])
    close(masked_whiten(T([5.0, 7.0]), T([1, 0]), shift_mean=False), [5.0, 7.0])
    # no valid entry: mean 0, no scaling: the values come back as they are, nothing NaN or inf
    close(masked_whiten(T([[5.0, -7.0]]), T([[0, 0]])), [[5.0, -7.0]])
    big = masked_whiten(T([3e38, -3e38]), T([0, 0]))
    assert torch.isfinite(big).all()
    assert masked_whiten(torch.zeros(3, 0), torch.zeros(3, 0)).shape == (3, 0)


# ---------------------------------------------------------------- RLOO

def test_rloo_pairs_singletons_and_all_equal():
    # "a" = [3, 1]: 3 - 1 = 2, 1 - 3 = -2; "b" = [0.5] alone keeps 0.5; "c" = [2, 2, 2]: 2 - 2 = 0
    # row 5 is fully masked: its advantage is 0 on every token (its score still counts in "c")
    rewards = T([[0.0, 3.0], [0.0, 1.0], [0.0, 0.5], [0.0, 2.0], [0.0, 2.0], [0.0, 2.0]])
    mask = torch.ones(6, 2)
    mask[5] = 0
    adv, ret = rloo_advantages(rewards, mask, ["a", "a", "b", "c", "c", "c"])
    close(adv, [[2.0, 2.0], [-2.0, -2.0], [0.5, 0.5], [0.0, 0.0], [0.0, 0.0], [0.0, 0.0]])
    assert ret is adv and not adv.requires_grad
    # zero-length responses: every score is 0, shape [B, 0]
    adv, _ = rloo_advantages(torch.zeros(3, 0), torch.zeros(3, 0), T([0, 0, 1]))
    assert adv.shape == (3, 0)


# ---------------------------------------------------------------- REINFORCE++

RPP_REWARDS = T([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0], [0.0, 0.0, 0.0]])
RPP_MASK = T([[1, 1, 1], [1, 1, 0], [0, 0, 0]])


def test_reinforce_pp_gamma_below_one_rows_of_different_lengths():
    # gamma 0.9: row 0: 1, 0.9, 0.81; row 1 (2 tokens): 2, then 0.9 * 2 = 1.8; row 2 fully masked
    adv, ret = reinforce_pp_advantages(RPP_REWARDS, RPP_MASK, gamma=0.9)
    close(ret, [[0.81, 0.9, 1.0], [1.8, 2.0, 0.0], [0.0, 0.0, 0.0]])
    # valid returns [0.81, 0.9, 1, 1.8, 2]: mean 6.51 / 5 = 1.302; deviations -0.492, -0.402, -0.302,
    # 0.498, 0.698; squares sum 1.23008, / 4 = 0.30752, std 0.554545
    close(adv, [[-0.887214, -0.724919, -0.544591], [0.898034, 1.258690, 0.0], [0.0, 0.0, 0.0]])
    # the dispatcher passes gamma (and not index, which this estimator does not take)
    a2, r2 = compute_advantages("reinforce_plus_plus", RPP_REWARDS, RPP_MASK, [0, 0, 1], gamma=0.9)
    assert torch.equal(a2, adv) and torch.equal(r2, ret)


def test_reinforce_pp_edge_cases():
    # equal returns everywhere (one token each): whitened to 0
    adv, ret = reinforce_pp_advantages(T([[1.0], [1.0]]), T([[1], [1]]))
    close(adv, [[0.0], [0.0]])
    close(ret, [[1.0], [1.0]])
    # T = 0, and a batch with no valid token: zeros, no NaN
    adv, ret = reinforce_pp_advantages(torch.zeros(2, 0), torch.zeros(2, 0), gamma=0.5)
    assert adv.shape == ret.shape == (2, 0)
    adv, ret = reinforce_pp_advantages(T([[1.0, 2.0]]), T([[0, 0]]), gamma=0.5)
    close(adv, [[0.0, 0.0]])
    close(ret, [[0.0, 0.0]])


def test_reinforce_pp_baseline_weights_tokens_and_ignores_epsilon():
    # group [1, 0]: centred [0.5, -0.5] on rows of 2 and 1 valid tokens -> valid entries [0.5, 0.5, -0.5]:
    # mean 1/6, deviations [1/3, 1/3, -2/3], var (1/9 + 1/9 + 4/9) / 2 = 1/3, std 0.577350
    # -> [0.577350, 0.577350, -1.154701]
    rewards, mask = T([[0.0, 1.0], [0.0, 0.0]]), T([[1, 1], [1, 0]])
    adv, _ = reinforce_pp_baseline_advantages(rewards, mask, ["p", "p"])
    close(adv, [[0.577350, 0.577350], [-1.154701, 0.0]])
    a2, _ = compute_advantages("reinforce_plus_plus_baseline", rewards, mask, ["p", "p"], epsilon=0.5)
    assert torch.equal(a2, adv)  # epsilon is accepted and unused (as in verl)
    # all-equal group: centred 0 -> 0
    adv, _ = reinforce_pp_baseline_advantages(T([[1.0], [1.0]]), T([[1], [1]]), [0, 0])
    close(adv, [[0.0], [0.0]])


# ---------------------------------------------------------------- pass@k

def test_grpo_passk_std_flag_masks_and_group_of_one():
    # scores [0, 3, 1]: best 3, second 1 -> 2; mean 4/3, deviations -4/3, 5/3, -1/3, squares
    # (16 + 25 + 1) / 9 = 42/9, / 2 = 7/3, std 1.527525 -> 2 / (1.527525 + 1e-6) = 1.309306 on row 1
    rewards = T([[0.0, 0.0], [3.0, 0.0], [0.0, 1.0]])
    mask = T([[1, 1], [1, 0], [1, 1]])
    adv, ret = grpo_passk_advantages(rewards, mask, [7, 7, 7])
    close(adv, [[0.0, 0.0], [1.309306, 0.0], [0.0, 0.0]])
    assert ret is adv
    a2, _ = compute_advantages("grpo_passk", rewards, mask, [7, 7, 7], norm_adv_by_std_in_grpo=False)
    close(a2, [[0.0, 0.0], [2.0, 0.0], [0.0, 0.0]])
    # all equal: r_max - r_second = 0
    close(grpo_passk_advantages(T([[1.0], [1.0]]), torch.ones(2, 1), [0, 0])[0], [[0.0], [0.0]])
    # a group of one among groups of two
    with pytest.raises(ValueError, match="at least 2 samples per prompt; a group has 1"):
        grpo_passk_advantages(T([[1.0], [0.0], [1.0]]), torch.ones(3, 1), [0, 0, 1])


# ---------------------------------------------------------------- GAE

def test_gae_gamma_and_lam_below_one_two_rows():
    # gamma = lam = 0.5 (gamma * lam = 0.25)
    # row 0, values [0.5, 0.25, 0.5], reward 1 at the end:
    #   t2: delta = 1 + 0 - 0.5 = 0.5, A2 = 0.5
    #   t1: delta = 0 + 0.5 * 0.5 - 0.25 = 0, A1 = 0 + 0.25 * 0.5 = 0.125
    #   t0: delta = 0 + 0.5 * 0.25 - 0.5 = -0.375, A0 = -0.375 + 0.25 * 0.125 = -0.34375
    #   returns A + V = [0.15625, 0.375, 1.0]
    # row 1, values [1, 0, 7 (padding)], mask [1, 1, 0], reward 1 on t1:
    #   t2 padding: nothing carries (next value 0, A 0)
    #   t1: delta = 1 + 0 - 0 = 1, A1 = 1;  t0: delta = 0 + 0 - 1 = -1, A0 = -1 + 0.25 * 1 = -0.75
    #   returns [0.25, 1.0, 0 (masked)]
    # row 2 fully masked
    rewards = T([[0.0, 0.0, 1.0], [0.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    values = T([[0.5, 0.25, 0.5], [1.0, 0.0, 7.0], [3.0, 3.0, 3.0]])
    mask = T([[1, 1, 1], [1, 1, 0], [0, 0, 0]])
    adv, ret = gae_advantages(rewards, values, mask, gamma=0.5, lam=0.5)
    close(ret, [[0.15625, 0.375, 1.0], [0.25, 1.0, 0.0], [0.0, 0.0, 0.0]])
    # raw A over valid tokens [-0.34375, 0.125, 0.5, -0.75, 1.0]: mean 0.10625,
    # unbiased var 0.4724609375, std 0.687358
    close(adv, [[-0.654681, 0.027278, 0.572846], [-1.245712, 1.300269, 0.0], [0.0, 0.0, 0.0]])
    a2, r2 = compute_advantages("gae", rewards, mask, [0, 1, 2], values=values, gamma=0.5, lam=0.5)
    assert torch.equal(a2, adv) and torch.equal(r2, ret)


def test_gae_lam_zero_is_one_step_td_and_empty_cases():
    # lam 0: A_t = delta_t only. One row, gamma 1, values [0, 1], rewards [0, 2]:
    # t1: 2 - 1 = 1; t0: 0 + 1 - 0 = 1 -> raw [1, 1], returns [1, 2]; equal A whiten to 0
    adv, ret = gae_advantages(T([[0.0, 2.0]]), T([[0.0, 1.0]]), T([[1, 1]]), gamma=1.0, lam=0.0)
    close(ret, [[1.0, 2.0]])
    close(adv, [[0.0, 0.0]])
    # no valid token, and T = 0: zeros, nothing NaN
    adv, ret = gae_advantages(T([[1.0, 1.0]]), T([[5.0, 5.0]]), T([[0, 0]]), gamma=0.9, lam=0.9)
    close(adv, [[0.0, 0.0]])
    close(ret, [[0.0, 0.0]])
    adv, ret = gae_advantages(torch.zeros(2, 0), torch.zeros(2, 0), torch.zeros(2, 0))
    assert adv.shape == ret.shape == (2, 0)


# ---------------------------------------------------------------- the dispatcher

def test_dispatcher_registry_and_errors():
    assert set(ADV_ESTIMATORS) == {"grpo", "gae", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline",
                                   "grpo_passk", "remax", "gpg", "grpo_loo", "gdpo"}
    assert NEEDS_CRITIC == frozenset({"gae"})
    rewards, mask = T([[0.0, 1.0], [0.0, 0.0]]), torch.ones(2, 2)
    # every estimator gets only the arguments it takes (no TypeError for the extras)
    for name in ADV_ESTIMATORS:
        adv, ret = compute_advantages(name, rewards, mask, [0, 0], values=torch.zeros(2, 2), gamma=0.9, lam=0.9,
                                      norm_adv_by_std_in_grpo=False, epsilon=1e-3, reward_baselines=torch.zeros(2),
                                      reward_components=torch.eye(2))
        assert adv.shape == ret.shape == (2, 2) and torch.isfinite(adv).all()
    with pytest.raises(ValueError, match="needs the critic's values"):
        compute_advantages("gae", rewards, mask, [0, 0])
    with pytest.raises(ValueError, match="unknown advantage estimator 'ppo'.*grpo, gae, rloo"):
        compute_advantages("ppo", rewards, mask, [0, 0])


def test_registry_entries_declare_what_they_need():
    from posttrain.algorithms import estimator, get_adv_estimator, get_policy_loss, is_weighted_loss, policy_loss

    assert estimator("gae").needs_critic and not estimator("grpo").needs_critic
    assert estimator("remax").greedy_baseline and not estimator("grpo").greedy_baseline
    gdpo = estimator("gdpo")
    assert gdpo.reward_components and gdpo.min_samples == 2 and "reward component" in gdpo.compares
    assert [n for n in ADV_ESTIMATORS if estimator(n).min_samples >= 2] == ["grpo_passk", "grpo_loo", "gdpo"]
    assert all(estimator(n).compares for n in ADV_ESTIMATORS if estimator(n).min_samples > 1)
    # the declarations agree with what each function takes, so compute_advantages' checks and the loop's agree
    for name in ADV_ESTIMATORS:
        entry, takes = estimator(name), inspect.signature(ADV_ESTIMATORS[name]).parameters
        assert entry.fn is ADV_ESTIMATORS[name] is get_adv_estimator(name)
        assert (entry.needs_critic, entry.greedy_baseline, entry.reward_components) == (
            "values" in takes, "reward_baselines" in takes, "reward_components" in takes), name
    assert NEEDS_CRITIC == frozenset(n for n in ADV_ESTIMATORS if estimator(n).needs_critic)
    # GPG's loss has no ratio: bypass mode's IS weights multiply it; PPO-clip's and GSPO's ratios carry them
    assert policy_loss("gpg").applies_is_weights and is_weighted_loss() == "gpg"
    assert not policy_loss("vanilla").applies_is_weights and not policy_loss("gspo").applies_is_weights
    assert all(policy_loss(n).fn is POLICY_LOSSES[n] is get_policy_loss(n) for n in POLICY_LOSSES)
    rewards, mask = T([[1.0], [0.0]]), torch.ones(2, 1)
    with pytest.raises(ValueError, match="needs reward_baselines"):
        compute_advantages("remax", rewards, mask, [0, 0])
    with pytest.raises(ValueError, match="needs reward_components"):
        compute_advantages("gdpo", rewards, mask, [0, 0])
    # an unknown name: the same messages as before the entries
    with pytest.raises(ValueError, match=r"^unknown advantage estimator 'opo'; supported: grpo, gae, rloo, "):
        estimator("opo")
    with pytest.raises(ValueError, match=r"^unknown policy loss 'sapo'; supported: vanilla, gspo, gpg$"):
        policy_loss("sapo")
    with pytest.raises(ValueError, match=r"^unknown policy loss 'sapo'; supported: vanilla, gspo, gpg$"):
        get_policy_loss("sapo")


# ---------------------------------------------------------------- GPG's loss

def test_gpg_policy_loss_is_the_plain_policy_gradient():
    from posttrain.algorithms import gpg_policy_loss

    # row 0: -A log p = -(1 * -1), -(1 * -2) = 1, 2; row 1: one valid token -(-0.5 * -4) = -2 (the 9 is padding)
    new = T([[-1.0, -2.0], [-4.0, 9.0]]).requires_grad_()
    adv, mask = T([[1.0, 1.0], [-0.5, -0.5]]), T([[1, 1], [1, 0]])
    out = gpg_policy_loss(torch.zeros(2, 2), new, adv, mask, loss_agg_mode="token-mean")
    close(out["pg_loss"], (1.0 + 2.0 - 2.0) / 3)
    assert out["pg_clipfrac"] == 0 and out["ppo_kl"] == 0
    out["pg_loss"].backward()
    close(new.grad, [[-1 / 3, -1 / 3], [0.5 / 3, 0.0]])  # -A / 3 on valid tokens, nothing on padding
    seq = gpg_policy_loss(torch.zeros(2, 2), new.detach(), adv, mask, loss_agg_mode="seq-mean-token-mean")
    close(seq["pg_loss"], ((1.0 + 2.0) / 2 + -2.0) / 2)


# ---------------------------------------------------------------- GSPO

def gspo_case():
    # row 0: log-ratios [0.3, -0.1, 0.1], mean 0.1, s = e^0.1 = 1.105171, A = 2: inside [0.8, 1.2]
    #   per token max(-2 * 1.105171, -2 * 1.105171) = -2.210342
    # row 1: log-ratios [-0.4, -0.2] (the 9 is padding), mean -0.3, s = e^-0.3 = 0.740818, A = -1:
    #   max(0.740818, 0.8) = 0.8, the clipped term: no gradient
    old = torch.zeros(2, 3)
    new = T([[0.3, -0.1, 0.1], [-0.4, -0.2, 9.0]]).requires_grad_()
    adv = T([[2.0, 2.0, 2.0], [-1.0, -1.0, -1.0]])
    return old, new, adv, T([[1, 1, 1], [1, 1, 0]])


def test_gspo_gradient_and_clip_per_agg_mode():
    old, new, adv, mask = gspo_case()
    out = gspo_policy_loss(old, new, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.2)
    # seq-mean-token-mean: (-2.210342 + 0.8) / 2 = -0.705171
    assert out["pg_loss"].item() == pytest.approx(-0.705171, abs=1e-6)
    out["pg_loss"].backward()
    # each token of row 0: d/dlogp_t of (-A s) = -2 * 1.105171, / 3 tokens / 2 sequences = -0.368390
    close(new.grad, [[-0.368390, -0.368390, -0.368390], [0.0, 0.0, 0.0]])
    # clipped: row 1's 2 tokens of the 5 valid; ppo_kl = mean(old - new) = -(-0.3) / 5 = 0.06
    assert out["pg_clipfrac"].item() == pytest.approx(0.4)
    assert out["ppo_kl"].item() == pytest.approx(0.06, abs=1e-6)
    assert out["pg_clipfrac_lower"].item() == 0.0
    assert not any(out[k].requires_grad for k in ("pg_clipfrac", "ppo_kl", "pg_clipfrac_lower"))
    # token-mean: (3 * -2.210342 + 2 * 0.8) / 5 = -1.006205; gradient -2 * 1.105171 / 5 = -0.442068
    old, new, adv, mask = gspo_case()
    out = gspo_policy_loss(old, new, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.2, loss_agg_mode="token-mean")
    assert out["pg_loss"].item() == pytest.approx(-1.006205, abs=1e-6)
    out["pg_loss"].backward()
    close(new.grad, [[-0.442068, -0.442068, -0.442068], [0.0, 0.0, 0.0]])


@pytest.mark.parametrize("mode, expected", [
    # on policy (s = 1): per-token loss -A; A = [[1, 3], [-1, pad]]
    ("token-mean", -1.0),                # -(1 + 3 - 1) / 3
    ("seq-mean-token-mean", -0.5),       # (-2 + 1) / 2
    ("seq-mean-token-sum", -1.5),        # (-4 + 1) / 2
    ("seq-mean-token-sum-norm", -0.75),  # -1.5 / T = 2
])
def test_gspo_on_policy_is_minus_the_aggregated_advantage(mode, expected):
    lp = T([[-0.7, -1.3], [-2.0, -0.1]])
    out = gspo_policy_loss(lp, lp.clone(), T([[1.0, 3.0], [-1.0, 5.0]]), T([[1, 1], [1, 0]]), loss_agg_mode=mode)
    assert out["pg_loss"].item() == pytest.approx(expected)
    assert out["pg_clipfrac"].item() == 0.0 and out["ppo_kl"].item() == 0.0


def test_gspo_fully_masked_and_zero_length_and_same_signature_as_ppo():
    for shape in ((2, 3), (2, 0)):
        new = torch.full(shape, -1.0, requires_grad=True)
        out = gspo_policy_loss(torch.full(shape, -5.0), new, torch.ones(shape), torch.zeros(shape))
        assert all(v.item() == 0.0 for v in out.values())  # 0 / 0 lengths: 0, not NaN
        out["pg_loss"].backward()
        assert new.grad is None or new.grad.eq(0).all()
    assert POLICY_LOSSES["gspo"] is gspo_policy_loss
    assert list(inspect.signature(gspo_policy_loss).parameters) == list(inspect.signature(ppo_policy_loss).parameters)


# ---------------------------------------------------------------- value loss

def test_value_loss_both_sides_of_the_clip():
    # cliprange 0.2, old values 1 -> clip range [0.8, 1.2]
    # token  vpred  return  clipped  (v-R)^2  (c-R)^2  max
    #   1    1.1    2.0     1.1      0.81     0.81     0.81   inside the range
    #   2    1.5    2.0     1.2      0.25     0.64     0.64   clipped above, the clipped error wins
    #   3    1.5    1.6     1.2      0.01     0.16     0.16   clipped above, the clipped error wins
    #   4    0.5    0.0     0.8      0.25     0.64     0.64   clipped below, the clipped error wins
    #   5    0.5    1.5     0.8      1.00     0.49     1.00   clipped below, the unclipped error wins
    # token-mean: 0.5 * 3.25 / 5 = 0.325; vf_clipfrac 3/5
    vpreds = T([[1.1, 1.5, 1.5, 0.5, 0.5]]).requires_grad_()
    returns = T([[2.0, 2.0, 1.6, 0.0, 1.5]])
    out = value_loss(vpreds, returns, torch.ones(1, 5), torch.ones(1, 5), cliprange_value=0.2)
    assert out["vf_loss"].item() == pytest.approx(0.325)
    assert out["vf_clipfrac"].item() == pytest.approx(0.6)
    assert not out["vf_clipfrac"].requires_grad
    out["vf_loss"].backward()
    # d/dv 0.5 * (v - R)^2 / 5 = (v - R) / 5 where the unclipped error counts: -0.9 / 5, -1 / 5
    close(vpreds.grad, [[-0.18, 0.0, 0.0, 0.0, -0.2]])


def test_value_loss_agg_modes_and_empty_mask():
    # all inside the range (values = vpreds): per-token (v - R)^2 = [[1, 4], [9, pad]]
    vpreds, returns, mask = T([[1.0, 2.0], [3.0, 0.0]]), torch.zeros(2, 2), T([[1, 1], [1, 0]])
    assert value_loss(vpreds, returns, vpreds, mask, loss_agg_mode="seq-mean-token-sum")["vf_loss"].item() \
        == pytest.approx(0.5 * (5 + 9) / 2)
    assert value_loss(vpreds, returns, vpreds, mask, loss_agg_mode="seq-mean-token-mean")["vf_loss"].item() \
        == pytest.approx(0.5 * (2.5 + 9) / 2)
    v = T([[1.0, 2.0]], requires_grad=True)
    out = value_loss(v, torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1, 2))
    assert out["vf_loss"].item() == 0.0 and out["vf_clipfrac"].item() == 0.0
    out["vf_loss"].backward()
    assert v.grad.eq(0).all()


# ---------------------------------------------------------------- explained variance

def test_explained_variance_constant_returns_and_mean_values():
    mask = torch.ones(1, 3)
    # Var[returns] = 0: the divisor is 1e-5; constant errors -> 1 (bias is not counted),
    # errors [1, 0, -1] (var 1) -> 1 - 1 / 1e-5 = -99999
    assert explained_variance(T([[2.0, 2.0, 2.0]]), T([[2.0, 2.0, 2.0]]), mask).item() == 1.0
    assert explained_variance(T([[0.0, 0.0, 0.0]]), T([[2.0, 2.0, 2.0]]), mask).item() == 1.0
    assert explained_variance(T([[1.0, 2.0, 3.0]]), T([[2.0, 2.0, 2.0]]), mask).item() == pytest.approx(-99999.0)
    # values = the mean return: returns [0, 4] (var 8), values [2, 2]: 1 - 8 / 8.00001 = 1.25e-6, about 0
    ev = explained_variance(T([[2.0, 2.0]]), T([[0.0, 4.0]]), torch.ones(1, 2))
    assert ev.item() == pytest.approx(0.0, abs=2e-6)
    # a perfect critic on valid tokens, garbage under the mask -> 1; float64 in, float64 out; detached
    values = T([[0.5, -1.0, 99.0]], dtype=torch.float64, requires_grad=True)
    ev = explained_variance(values, T([[0.5, -1.0, 3.0]], dtype=torch.float64), T([[1, 1, 0]]))
    assert ev.item() == 1.0 and ev.dtype == torch.float64 and not ev.requires_grad
    # 0 or 1 valid token: 0, not NaN
    assert explained_variance(T([[1.0, 2.0]]), T([[3.0, 5.0]]), T([[0, 1]])).item() == 0.0
    assert explained_variance(T([[1.0, 2.0]]), T([[3.0, 5.0]]), T([[0, 0]])).item() == 0.0


# ---------------------------------------------------------------- DAPO

def test_overlong_penalty_boundaries():
    # L = 10, buffer 10: the penalty starts at 0 tokens: -length / 10
    close(overlong_penalty(T([0, 5, 10]), 10, 10), [0.0, -0.5, -1.0])
    # L = 10, buffer 4, factor 0.5: 0 up to 6 tokens; 8 -> -(2 / 4) * 0.5 = -0.25; 10 -> -0.5
    close(overlong_penalty(T([6, 7, 8, 10]), 10, 4, penalty_factor=0.5), [0.0, -0.125, -0.25, -0.5])
    assert overlong_penalty(torch.zeros(0, dtype=torch.long), 10, 4).shape == (0,)
    with pytest.raises(ValueError, match="overlong buffer"):
        overlong_penalty(T([1]), 10, -1)


def test_varied_groups_float_metrics_and_tensor_ids():
    # equal floats are equal (no rounding: 0.1 three times is dropped); a singleton is kept
    metric = T([0.1, 0.1, 0.1, 0.2, 0.3, 5.0], dtype=torch.float64)
    keep = varied_groups(metric, T([4, 4, 4, 9, 9, 1]))
    assert keep.tolist() == [False, False, False, True, True, True]
    assert keep.dtype == torch.bool
    with pytest.raises(ValueError, match="2 group ids for 6 rows"):
        varied_groups(metric, [0, 1])
