"""The rollout/trainer log-prob gap: verl's diagnostics and corrections (IS weights, rejection
sampling, veto) on hand-computed tensors, and a run that logs the diagnostics
(rollout.calculate_log_probs)."""

import math
import re

import pytest
import torch

from posttrain.algorithms.rollout_corr import RolloutCorrection, correct, mismatch_metrics
from posttrain.algorithms.rollout_rules import RejectRule
from posttrain.config.dialects.nemo_rl.rollout_correction import from_nemo_rl
from posttrain.config.dialects.verl.rollout_correction import from_verl, parse_rules
from posttrain.driver.build import build_run
from posttrain.config import load_config
from posttrain.driver.loop import train

from helpers import read_metrics, run_overrides, write_prompts


def test_the_gap_on_two_tokens_by_hand():
    # row 0: the trainer gives its tokens p = 0.5 and 0.25, the rollout 0.4 and 0.25 (a third column is padding);
    # row 1 has no response token and counts nowhere
    train_lp = torch.log(torch.tensor([[0.5, 0.25, 1.0], [0.3, 1.0, 1.0]]))
    roll_lp = torch.log(torch.tensor([[0.4, 0.25, 1.0], [0.9, 1.0, 1.0]]))
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])
    m = mismatch_metrics(train_lp, roll_lp, mask)
    d = math.log(0.8)  # log p_rollout - log p_train on the first token; 0 on the second
    assert m["training/rollout_probs_diff_mean"] == pytest.approx(0.05)
    assert m["training/rollout_probs_diff_max"] == pytest.approx(0.1)
    assert m["training/rollout_probs_diff_std"] == pytest.approx(0.1 / math.sqrt(2))  # std of (0.1, 0), n - 1
    assert m["rollout_corr/logp_abs_diff_mean"] == pytest.approx(-d / 2)
    assert m["rollout_corr/logp_abs_diff_max"] == pytest.approx(-d)
    assert m["rollout_corr/kl"] == pytest.approx(d / 2)
    assert m["rollout_corr/k3_kl"] == pytest.approx((1.25 - 1 + d) / 2, rel=1e-5)  # exp(-d) - 1 + d, and 0 (float32)
    assert m["rollout_corr/training_ppl"] == pytest.approx(math.sqrt(8))  # exp((log 2 + log 4) / 2)
    assert m["rollout_corr/rollout_ppl"] == pytest.approx(math.sqrt(10))  # exp((log 2.5 + log 4) / 2)
    assert m["rollout_corr/log_ppl_diff"] == pytest.approx(-d / 2)
    assert mismatch_metrics(train_lp, roll_lp, torch.zeros_like(mask)) == {}


def test_a_run_with_rollout_log_probs_logs_the_gap_after_its_own_log_prob_pass(tmp_path, tiny_model_dir):
    """The hf engine's log-probs (same module, same float32 numerics) against the trainer's separate
    pass: the gap is rounding-sized, and the on-policy shortcut gives way to that pass."""
    write_prompts(tmp_path, 8)
    cfg = load_config(None, run_overrides(
        tiny_model_dir, tmp_path, tmp_path / "run", "data.train_batch_size=4", "data.max_response_length=6",
        "actor.ppo_mini_batch_size=4", "actor.ppo_micro_batch_size=16", "rollout.n=4", "actor.lr=1e-2",
        "rollout.calculate_log_probs=true", "trainer.total_training_steps=2"))
    run = build_run(cfg)
    assert run.sampling.logprobs and not run.on_policy_update
    train(run)
    steps = [m for m in read_metrics(tmp_path / "run") if "timing_s/step" in m]
    assert len(steps) == 2
    for m in steps:
        assert m["timing_s/old_log_prob"] > 0
        assert 0 <= m["rollout_corr/logp_abs_diff_max"] < 1e-4
        assert m["rollout_corr/training_ppl"] > 1


def test_rollout_log_probs_are_off_by_default_on_the_hf_engine_and_on_with_vllm():
    from posttrain.driver.settings import rollout_log_probs

    assert not rollout_log_probs(load_config(None, ["model.path=/m"]))
    assert rollout_log_probs(load_config(None, ["model.path=/m", "rollout.name=vllm"]))
    assert not rollout_log_probs(load_config(None, ["model.path=/m", "rollout.name=vllm",
                                                    "actor_rollout_ref.rollout.calculate_log_probs=False"]))


def lp(rows):
    """Log-probs of literal probabilities."""
    return torch.log(torch.tensor(rows, dtype=torch.float32))


def close(actual, expected):
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=torch.float32))


def test_token_is_weights_are_ratios_truncated_from_above_and_detached():
    # ratios pi_target / pi_behaviour: row 0: 0.5/0.25 = 2, 0.25/0.5 = 0.5, 1; row 1: 0.2/0.8 = 0.25,
    # 0.8/0.1 = 8 -> truncated at 4, and a padding token (0.3/0.6) that weighs 0
    target = lp([[0.5, 0.25, 0.9], [0.2, 0.8, 0.3]]).requires_grad_()  # pi_theta in bypass mode has a graph
    behaviour = lp([[0.25, 0.5, 0.9], [0.8, 0.1, 0.6]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    weights, new_mask, _ = correct(target, behaviour, mask, RolloutCorrection(is_level="token", is_threshold=4.0))
    close(weights, [[2.0, 0.5, 1.0], [0.25, 4.0, 0.0]])
    assert not weights.requires_grad
    assert torch.equal(new_mask, mask)
    # a truncation floor too (OpenRLHF's and NeMo-RL's tis): 0.25 -> 0.5, the padding stays 0
    weights, _, _ = correct(target, behaviour, mask, RolloutCorrection(is_level="token", is_threshold=4.0,
                                                                       is_threshold_lower=0.5))
    close(weights, [[2.0, 0.5, 1.0], [0.5, 4.0, 0.0]])


def test_sequence_is_weight_is_the_product_of_the_sequences_ratios_truncated():
    # row 0: 2 * 2 = 4 (< 5, kept; its padding token's ratio 9 would make it 36); row 1: 4 * 2 * 1 = 8 -> 5
    target = lp([[0.5, 0.5, 0.9], [0.8, 0.5, 0.3]])
    behaviour = lp([[0.25, 0.25, 0.1], [0.2, 0.25, 0.3]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    weights, _, m = correct(target, behaviour, mask, RolloutCorrection(is_level="sequence", is_threshold=5.0))
    close(weights, [[4.0, 4.0, 0.0], [5.0, 5.0, 5.0]])
    assert m["rollout_corr/rollout_is_max"] == pytest.approx(8.0)  # before truncation


def test_batch_normalisation_divides_the_truncated_weights_by_their_mean():
    # token level: ratios 2, 0.5, 1, 4 -> truncated at 2: 2, 0.5, 1, 2, mean 5.5 / 4 = 1.375 over the tokens
    # (normalising before truncating would divide by 7.5 / 4 first)
    target, behaviour = lp([[0.5, 0.25], [0.3, 0.8]]), lp([[0.25, 0.5], [0.3, 0.2]])
    mask = torch.ones(2, 2, dtype=torch.long)
    c = RolloutCorrection(is_level="token", is_threshold=2.0, is_batch_normalize=True)
    weights, _, m = correct(target, behaviour, mask, c)
    close(weights, [[2 / 1.375, 0.5 / 1.375], [1 / 1.375, 2 / 1.375]])
    assert m["rollout_corr/rollout_is_batch_norm_factor"] == pytest.approx(1.375)
    # sequence level: one weight a sequence, 2 (one token) and 0.5 * 1 * 1 = 0.5 (three tokens): mean over
    # the sequences (2 + 0.5) / 2 = 1.25 -> 1.6 and 0.4 (over the tokens it would be 3.5 / 4)
    target, behaviour = lp([[0.5, 0.3, 0.3], [0.25, 0.4, 0.7]]), lp([[0.25, 0.9, 0.9], [0.5, 0.4, 0.7]])
    mask = torch.tensor([[1, 0, 0], [1, 1, 1]])
    c = RolloutCorrection(is_level="sequence", is_threshold=4.0, is_batch_normalize=True)
    weights, _, m = correct(target, behaviour, mask, c)
    close(weights, [[1.6, 0.0, 0.0], [0.4, 0.4, 0.4]])
    assert m["rollout_corr/rollout_is_batch_norm_factor"] == pytest.approx(1.25)


def test_token_rejection_is_two_sided_icepop():
    # ratios row 0: 2, 0.5, 4; row 1: 0.25, 1, 1.5; band [1/3, 3] (lower bound 1 / upper by default):
    # 4 is above it, 0.25 below it
    target, behaviour = lp([[0.5, 0.25, 0.8], [0.1, 0.3, 0.6]]), lp([[0.25, 0.5, 0.2], [0.4, 0.3, 0.4]])
    mask = torch.ones(2, 3)
    icepop = RolloutCorrection(is_level="token", is_threshold=3.0, rs_level="token", rs_threshold=3.0)
    weights, new_mask, m = correct(target, behaviour, mask, icepop)
    close(new_mask, [[1.0, 1.0, 0.0], [0.0, 1.0, 1.0]])
    assert new_mask.dtype == mask.dtype
    close(weights, [[2.0, 0.5, 3.0], [0.25, 1.0, 1.5]])  # raw in the band; the mask drops the rest
    assert m["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(2 / 6)
    assert m["rollout_corr/rollout_rs_seq_masked_fraction"] == pytest.approx(1.0)
    # an explicit lower bound 0.2 keeps the 0.25
    _, new_mask, m = correct(target, behaviour, mask, RolloutCorrection(rs_level="token", rs_threshold=3.0,
                                                                         rs_threshold_lower=0.2))
    close(new_mask, [[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    assert m["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(1 / 6)
    assert m["rollout_corr/rollout_rs_seq_masked_fraction"] == pytest.approx(0.5)


def test_sequence_rejection_drops_whole_sequences_by_their_product():
    # token ratios all inside [1/3, 3]; products: row 0: 2 * 2 = 4 (> 3), row 1: 2 * 0.5 * 1.5 = 1.5,
    # row 2: 0.5 * 0.5 = 0.25 (< 1/3); the padding tokens do not count
    target = lp([[0.5, 0.5, 0.7], [0.4, 0.25, 0.6], [0.25, 0.1, 0.3]])
    behaviour = lp([[0.25, 0.25, 0.1], [0.2, 0.5, 0.4], [0.5, 0.2, 0.3]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 1, 0]])
    weights, new_mask, m = correct(target, behaviour, mask, RolloutCorrection(rs_level="sequence", rs_threshold=3.0))
    assert weights is None
    assert new_mask.tolist() == [[0, 0, 0], [1, 1, 1], [0, 0, 0]]
    assert m["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(4 / 7)
    assert m["rollout_corr/rollout_rs_seq_masked_fraction"] == pytest.approx(2 / 3)
    _, new_mask, _ = correct(target, behaviour, mask, RolloutCorrection(rs_level="token", rs_threshold=3.0))
    assert torch.equal(new_mask, mask)


def test_geometric_rejection_uses_the_mean_log_ratio_over_the_valid_tokens_seq_mask_tis():
    # row 0: ratios 4 and 1 (and a padding token): geometric mean sqrt(4) = 2 > 1.8, rejected (dividing by
    # the 3 columns would give 4^(1/3) = 1.59, kept); row 1: 1.5 three times: 1.5, kept (its product 3.375
    # is above 1.8). seq-mask-tis: that mask and the raw, untruncated token ratios as weights.
    target, behaviour = lp([[0.8, 0.5, 0.5], [0.6, 0.6, 0.6]]), lp([[0.2, 0.5, 0.5], [0.4, 0.4, 0.4]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    seq_mask_tis = RolloutCorrection(is_level="token", is_threshold=math.inf, rs_level="geometric", rs_threshold=1.8)
    weights, new_mask, m = correct(target, behaviour, mask, seq_mask_tis)
    assert new_mask.tolist() == [[0, 0, 0], [1, 1, 1]]
    close(weights, [[4.0, 1.0, 0.0], [1.5, 1.5, 1.5]])
    assert m["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(2 / 5)
    assert m["rollout_corr/rollout_rs_seq_masked_fraction"] == pytest.approx(0.5)
    assert m["rollout_corr/rollout_rs_max"] == pytest.approx(2.0)
    _, new_mask, _ = correct(target, behaviour, mask, RolloutCorrection(rs_level="sequence", rs_threshold=1.8))
    assert new_mask.tolist() == [[0, 0, 0], [0, 0, 0]]


def test_a_token_below_the_veto_threshold_rejects_its_whole_sequence():
    # log-ratios: row 0 has a token at ratio 1e-4 (< 1e-3): vetoed; row 1's 1e-6 is on a padding token:
    # kept; row 2's token at log-ratio -30, beyond the safety bound, is vetoed too
    log_ratio = torch.tensor([[0.0, math.log(1e-4), 0.0], [0.0, 0.0, math.log(1e-6)], [-30.0, 0.0, 0.0]])
    behaviour = torch.full((3, 3), -1.0)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1]])
    weights, new_mask, m = correct(behaviour + log_ratio, behaviour, mask,
                                   RolloutCorrection(token_veto_threshold=1e-3))
    assert weights is None
    assert new_mask.tolist() == [[0, 0, 0], [1, 1, 0], [0, 0, 0]]
    assert m["rollout_corr/rollout_is_veto_fraction"] == pytest.approx(2 / 3)
    assert m["rollout_corr/rollout_is_catastrophic_token_fraction"] == pytest.approx(2 / 8)
    # the veto reads the unbounded ratio: e^-30 < e^-25, though bounded to e^-20 it would pass
    _, new_mask, _ = correct(behaviour + log_ratio, behaviour, mask,
                             RolloutCorrection(token_veto_threshold=math.exp(-25)))
    assert new_mask.tolist() == [[1, 1, 1], [1, 1, 0], [0, 0, 0]]


def test_padding_weighs_zero_and_its_values_count_nowhere():
    # padding (and a hole, a tool message between turns) holds nan and -inf; the valid ratios:
    # row 0: 2 and 1, row 1: 0.5 and 1
    nan, inf = math.nan, math.inf
    target = torch.tensor([[math.log(0.5), nan, math.log(0.5), -inf], [math.log(0.25), math.log(0.5), 0.0, nan]])
    behaviour = torch.tensor([[math.log(0.25), 0.0, math.log(0.5), 0.0], [math.log(0.5), math.log(0.5), -inf, nan]])
    mask = torch.tensor([[1, 0, 1, 0], [1, 1, 0, 0]])
    c = RolloutCorrection(is_level="token", is_threshold=4.0, rs_level="token", rs_threshold=4.0)
    weights, new_mask, m = correct(target, behaviour, mask, c)
    close(weights, [[2.0, 0.0, 1.0, 0.0], [0.5, 1.0, 0.0, 0.0]])
    assert torch.equal(new_mask, mask)
    assert m["rollout_corr/rollout_is_mean"] == pytest.approx(4.5 / 4)
    assert all(math.isfinite(v) for v in m.values())
    weights, _, m = correct(target, behaviour, mask, RolloutCorrection(is_level="sequence", is_threshold=4.0))
    close(weights, [[2.0, 0.0, 2.0, 0.0], [0.5, 0.5, 0.0, 0.0]])
    assert all(math.isfinite(v) for v in m.values())
    # no valid token: the mask as it was, zero weights, no metrics
    weights, new_mask, m = correct(target, behaviour, torch.zeros_like(mask), c)
    assert m == {} and not new_mask.any() and not weights.any()


def test_the_safety_bound_caps_log_ratios_at_20():
    # log-ratio 100 would be exp(100) = inf in float32, -50 would be 2e-22: bounded to e^20 and e^-20
    behaviour = torch.full((2, 2), -1.0)
    log_ratio = torch.tensor([[100.0, 0.0], [-50.0, 0.0]])
    mask = torch.ones(2, 2)
    untruncated = RolloutCorrection(is_level="token", is_threshold=math.inf)
    weights, _, m = correct(behaviour + log_ratio, behaviour, mask, untruncated)
    torch.testing.assert_close(weights, torch.tensor([[math.exp(20), 1.0], [math.exp(-20), 1.0]]))
    assert m["rollout_corr/rollout_is_max"] == pytest.approx(math.exp(20), rel=1e-5)
    assert m["rollout_corr/rollout_is_min"] == pytest.approx(math.exp(-20), rel=1e-5)
    # sequence level: the bound applies to the sum; the max metric is capped, the min is not (verl)
    weights, _, m = correct(behaviour + log_ratio, behaviour, mask,
                            RolloutCorrection(is_level="sequence", is_threshold=math.inf))
    torch.testing.assert_close(weights, torch.tensor([[math.exp(20)] * 2, [math.exp(-20)] * 2]))
    assert m["rollout_corr/rollout_is_max"] == pytest.approx(math.exp(20), rel=1e-5)
    assert m["rollout_corr/rollout_is_min"] == pytest.approx(math.exp(-50), rel=1e-5)


def test_the_is_metrics_by_hand():
    # token level, threshold 2 (band [0.5, 2]): ratios 1.5, 0.75, 4, 0.25, before truncation
    target, behaviour = lp([[0.6, 0.3], [0.8, 0.1]]), lp([[0.4, 0.4], [0.2, 0.4]])
    mask = torch.ones(2, 2)
    _, _, m = correct(target, behaviour, mask, RolloutCorrection(is_level="token", is_threshold=2.0))
    # std and ESS on the ratios clamped to the band: 1.5, 0.75, 2, 0.5: mean 1.1875, mean of squares
    # 7.0625 / 4 = 1.765625; ESS = 1 / mean((w / mean w)^2) = 1.1875^2 / 1.765625
    assert m == pytest.approx({
        "rollout_corr/rollout_is_mean": 6.5 / 4,
        "rollout_corr/rollout_is_max": 4.0,
        "rollout_corr/rollout_is_min": 0.25,
        "rollout_corr/rollout_is_ratio_fraction_high": 0.25,  # the 4
        "rollout_corr/rollout_is_ratio_fraction_low": 0.25,  # the 0.25
        "rollout_corr/rollout_is_std": math.sqrt(1.765625 - 1.1875 ** 2),
        "rollout_corr/rollout_is_eff_sample_size": 1.1875 ** 2 / 1.765625,
    }, rel=1e-5)
    # sequence level: products 2 * 2 = 4, 0.25 * 1 = 0.25, and 1 (one token); mean over the 5 tokens
    # (4 + 4 + 0.25 + 0.25 + 1) / 5, max / min / fractions over the 3 sequences; clamped: 2, 2, .5, .5, 1
    target, behaviour = lp([[0.5, 0.5], [0.1, 0.5], [0.3, 0.3]]), lp([[0.25, 0.25], [0.4, 0.5], [0.3, 0.3]])
    mask = torch.tensor([[1, 1], [1, 1], [1, 0]])
    _, _, m = correct(target, behaviour, mask, RolloutCorrection(is_level="sequence", is_threshold=2.0))
    assert m == pytest.approx({
        "rollout_corr/rollout_is_mean": 9.5 / 5,
        "rollout_corr/rollout_is_max": 4.0,
        "rollout_corr/rollout_is_min": 0.25,
        "rollout_corr/rollout_is_ratio_fraction_high": 1 / 3,
        "rollout_corr/rollout_is_ratio_fraction_low": 1 / 3,
        "rollout_corr/rollout_is_std": math.sqrt(9.5 / 5 - 1.2 ** 2),
        "rollout_corr/rollout_is_eff_sample_size": 1.2 ** 2 / (9.5 / 5),
    }, rel=1e-5)


@pytest.mark.parametrize("settings, message", [
    (dict(is_level="tokens"), "is_level must be one of token, sequence or None"),
    (dict(is_level="token", is_threshold=0.0), "is_threshold must be > 0"),
    (dict(is_level="token", is_threshold=math.nan), "is_threshold must be > 0"),
    (dict(is_threshold_lower=0.5), "set is_level too"),
    (dict(is_batch_normalize=True), "set is_level too"),
    (dict(is_level="token", is_threshold=2.0, is_threshold_lower=3.0), "is_threshold_lower must be >= 0 and below"),
    (dict(rs_level="geo", rs_threshold=2.0), "rs_level must be one of token, sequence, geometric or None"),
    (dict(rs_level="token"), "needs rs_threshold"),
    (dict(rs_threshold=2.0), "set rs_level too"),
    (dict(rs_level="token", rs_threshold=-1.0), "rs_threshold must be > 0"),
    (dict(rs_level="token", rs_threshold=2.0, rs_threshold_lower=2.0), r"band \[2.0, 2.0\] is empty"),
    (dict(rs_level="token", rs_threshold=2.0, rs_threshold_lower=-0.1), "is empty"),
    (dict(rs_level="geometric", rs_threshold=0.999), "1 / rs_threshold by default"),
    (dict(token_veto_threshold=0.0), "token_veto_threshold must be > 0"),
])
def test_bad_settings_are_refused_with_a_reason(settings, message):
    with pytest.raises(ValueError, match=message):
        RolloutCorrection(**settings).validate()
    with pytest.raises(ValueError, match=message):  # correct validates too
        correct(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), RolloutCorrection(**settings))


def test_good_settings_pass_and_shapes_must_agree():
    assert RolloutCorrection().validate() == RolloutCorrection()
    RolloutCorrection(rs_level="token", rs_threshold=5.0, rs_threshold_lower=0.0).validate()  # one-sided (TRL)
    RolloutCorrection(rs_level="geometric", rs_threshold=1.002, rs_threshold_lower=0.999).validate()
    with pytest.raises(ValueError, match="must have one shape"):
        correct(torch.zeros(2, 3), torch.zeros(2, 2), torch.ones(2, 3), RolloutCorrection())


# verl's newer rejection options (rollout_rules.py). Ratios below, pi_target / pi_behaviour:
# row 0: 2, 0.5, 1; row 1: 4, 1 and a padding token at 9; row 2: 0.25, 0.5, 1 (8 valid tokens).
# With L = ln 2, per token: k2 = (log r)^2 / 2: L^2/2 at r = 2 or 0.5, 2 L^2 at 4 or 0.25, 0 at 1;
# k3 = r - 1 - log r: 1 - L at 2, L - 0.5 at 0.5, 3 - 2L at 4, 2L - 0.75 at 0.25, 0 at 1.
RULE_TARGET = [[0.5, 0.25, 0.6], [0.8, 0.3, 0.9], [0.1, 0.2, 0.7]]
RULE_BEHAVIOUR = [[0.25, 0.5, 0.6], [0.2, 0.3, 0.1], [0.4, 0.4, 0.7]]
RULE_MASK = [[1, 1, 1], [1, 1, 0], [1, 1, 1]]
L = math.log(2)
L2 = L * L


@pytest.mark.parametrize("option, upper, kept, masked, seq_masked, mean, max_, seq_mean", [
    # k2 per token L^2/2, L^2/2, 0 | 2L^2, 0 | 2L^2, L^2/2, 0: the 4 and the 0.25 (0.96) are above 0.5
    ("token_k2", 0.5, [[1, 1, 1], [0, 1, 0], [0, 1, 1]], 2 / 8, 2 / 3, 5.5 * L2 / 8, 2 * L2, None),
    # k3 1-L, L-0.5, 0 | 3-2L, 0 | 2L-0.75, L-0.5, 0: above 0.25 the 2 (0.307), 4 and 0.25, not the 0.5
    # (0.193): k3 weighs r > 1 more than r < 1 at the same |log r|; mean (2.25 + L) / 8
    ("token_k3", 0.25, [[0, 1, 1], [0, 1, 0], [0, 1, 1]], 3 / 8, 1.0, (2.25 + L) / 8, 3 - 2 * L, None),
    # sequences: sums L^2 (0.48), 2L^2 (0.96), 2.5L^2 (1.20): row 2 above 1; the mean counts a sequence
    # once a token: (3 L^2 + 2 * 2L^2 + 3 * 2.5L^2) / 8
    ("seq_sum_k2", 1.0, [[1, 1, 1], [1, 1, 0], [0, 0, 0]], 3 / 8, 1 / 3, 14.5 * L2 / 8, 2.5 * L2, 5.5 * L2 / 3),
    # means over the valid tokens L^2/3 (0.16), 2L^2/2 (0.48; over 3 columns 0.32), 2.5L^2/3 (0.40)
    ("seq_mean_k2", 0.45, [[1, 1, 1], [0, 0, 0], [1, 1, 1]], 2 / 8, 1 / 3, 5.5 * L2 / 8, L2, 13 * L2 / 18),
    # maxima L^2/2 (0.24), 2L^2, 2L^2 (0.96): rows 1 and 2 above 0.5
    ("seq_max_k2", 0.5, [[1, 1, 1], [0, 0, 0], [0, 0, 0]], 5 / 8, 2 / 3, 11.5 * L2 / 8, 2 * L2, 1.5 * L2),
    # sums 0.5, 3 - 2L (1.61), 3L - 1.25 (0.83): row 1 above 1
    ("seq_sum_k3", 1.0, [[1, 1, 1], [0, 0, 0], [1, 1, 1]], 2 / 8, 1 / 3, (3.75 + 5 * L) / 8, 3 - 2 * L,
     (2.25 + L) / 3),
    # means 1/6, 1.5 - L (0.81), L - 5/12 (0.28): rows 1 and 2 above 0.25
    ("seq_mean_k3", 0.25, [[1, 1, 1], [0, 0, 0], [0, 0, 0]], 5 / 8, 2 / 3, (2.25 + L) / 8, 1.5 - L, 5 / 12),
    # maxima 1 - L (0.31), 3 - 2L (1.61), 2L - 0.75 (0.64): row 1 above 1
    ("seq_max_k3", 1.0, [[1, 1, 1], [0, 0, 0], [1, 1, 1]], 2 / 8, 1 / 3, (6.75 - L) / 8, 3 - 2 * L,
     (3.25 - L) / 3),
])
def test_each_divergence_rule_at_token_and_sequence_level(option, upper, kept, masked, seq_masked, mean, max_,
                                                          seq_mean):
    mask = torch.tensor(RULE_MASK)
    c = RolloutCorrection(rs_rules=(RejectRule(option, None, upper),))
    weights, new_mask, m = correct(lp(RULE_TARGET), lp(RULE_BEHAVIOUR), mask, c)
    assert weights is None
    assert new_mask.tolist() == kept
    prefix = f"rollout_corr/rollout_rs_{option}"
    expected = {f"{prefix}_masked_fraction": masked, f"{prefix}_seq_masked_fraction": seq_masked,
                f"{prefix}_mean": mean, f"{prefix}_max": max_,
                "rollout_corr/rollout_rs_masked_fraction": masked,  # one rule: the totals are its own
                "rollout_corr/rollout_rs_seq_masked_fraction": seq_masked}
    if seq_mean is not None:
        expected[f"{prefix}_seq_mean"] = seq_mean
    assert m == pytest.approx(expected, rel=1e-5, abs=1e-6)


def test_a_k1_rule_keeps_the_ratio_band_one_over_its_bounds():
    # token_k1 "0.5_4": keeps log 0.5 <= -log r <= log 4, the ratios in [1/4, 1/0.5] = [0.25, 2].
    # Ratios: row 0: 0.2 (-log r = 1.61 > log 4: rejected), 0.3, 1.5; row 1: 3 (-1.10 < log 0.5: rejected),
    # 1, 1. Read as a ratio band [0.5, 4] it would drop the 0.3 and keep the 3.
    target, behaviour = lp([[0.2, 0.3, 0.6], [0.9, 0.5, 0.5]]), lp([[1.0, 1.0, 0.4], [0.3, 0.5, 0.5]])
    mask = torch.ones(2, 3, dtype=torch.long)
    rule = RejectRule("token_k1", 0.5, 4.0)
    assert rule.ratio_band() == (0.25, 2.0)
    _, new_mask, m = correct(target, behaviour, mask, RolloutCorrection(rs_rules=(rule,)))
    assert new_mask.tolist() == [[0, 1, 1], [0, 1, 1]]
    assert m["rollout_corr/rollout_rs_token_k1_masked_fraction"] == pytest.approx(2 / 6)
    assert m["rollout_corr/rollout_rs_token_k1_seq_masked_fraction"] == pytest.approx(1.0)
    # the mean of -log r: -log(0.2 * 0.3 * 1.5 * 3 * 1 * 1) / 6; the max -log 0.2 = log 5
    assert m["rollout_corr/rollout_rs_token_k1_mean"] == pytest.approx(-math.log(0.27) / 6, rel=1e-5)
    assert m["rollout_corr/rollout_rs_token_k1_max"] == pytest.approx(math.log(5), rel=1e-5)
    # verl's single value 2 means lower 1/2: the band [0.5, 2] drops the 0.3 as well
    assert parse_rules("token_k1", 2) == (RejectRule("token_k1", 0.5, 2.0),)
    _, new_mask, _ = correct(target, behaviour, mask, RolloutCorrection(rs_rules=parse_rules("token_k1", 2)))
    assert new_mask.tolist() == [[0, 0, 1], [0, 1, 1]]


def test_rules_and_rs_level_are_anded_and_the_totals_count_their_union():
    # token_k3 <= 0.25 drops the 2, the 4 and the 0.25 (tokens (0, 0), (1, 0), (2, 0)); seq_sum_k2 <= 1
    # drops row 2 (2.5 L^2 = 1.2); rs_level "token" with the band [0.6, 3] drops the 0.5s ((0, 1), (2, 1)),
    # the 4 and the 0.25. Union: (0, 0), (0, 1), (1, 0) and row 2: 6 of the 8 tokens, every row.
    mask = torch.tensor(RULE_MASK)
    rules = (RejectRule("token_k3", None, 0.25), RejectRule("seq_sum_k2", None, 1.0))
    c = RolloutCorrection(rs_level="token", rs_threshold=3.0, rs_threshold_lower=0.6, rs_rules=rules)
    _, new_mask, m = correct(lp(RULE_TARGET), lp(RULE_BEHAVIOUR), mask, c)
    assert new_mask.tolist() == [[0, 0, 1], [0, 1, 0], [0, 0, 0]]
    assert m["rollout_corr/rollout_rs_token_k3_masked_fraction"] == pytest.approx(3 / 8)
    assert m["rollout_corr/rollout_rs_token_k3_seq_masked_fraction"] == pytest.approx(1.0)
    assert m["rollout_corr/rollout_rs_seq_sum_k2_masked_fraction"] == pytest.approx(3 / 8)
    assert m["rollout_corr/rollout_rs_seq_sum_k2_seq_masked_fraction"] == pytest.approx(1 / 3)
    assert m["rollout_corr/rollout_rs_token_masked_fraction"] == pytest.approx(4 / 8)  # rs_level's own share
    assert m["rollout_corr/rollout_rs_token_seq_masked_fraction"] == pytest.approx(1.0)
    assert m["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(6 / 8)
    assert m["rollout_corr/rollout_rs_seq_masked_fraction"] == pytest.approx(1.0)
    # the rules alone: 5 tokens ((0, 0), (1, 0) and row 2)
    _, new_mask, m = correct(lp(RULE_TARGET), lp(RULE_BEHAVIOUR), mask, RolloutCorrection(rs_rules=rules))
    assert new_mask.tolist() == [[0, 1, 1], [0, 1, 0], [0, 0, 0]]
    assert m["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(5 / 8)
    assert "rollout_corr/rollout_rs_token_masked_fraction" not in m


def test_thresholds_are_one_per_option_or_one_for_all():
    assert parse_rules("token_k3, seq_sum_k2", "0.25,1.0") == (RejectRule("token_k3", None, 0.25),
                                                               RejectRule("seq_sum_k2", None, 1.0))
    assert parse_rules("token_k2,seq_max_k3", 0.5) == (RejectRule("token_k2", None, 0.5),
                                                       RejectRule("seq_max_k3", None, 0.5))
    # one entry for a k1 and a k2 option: the k1 reads it as 1/U_U
    assert parse_rules("token_k1,token_k2", "2") == (RejectRule("token_k1", 0.5, 2.0),
                                                     RejectRule("token_k2", None, 2.0))
    assert parse_rules("seq_mean_k1,seq_mean_k3", "0.999_1.001,0.01") == (
        RejectRule("seq_mean_k1", 0.999, 1.001), RejectRule("seq_mean_k3", None, 0.01))


@pytest.mark.parametrize("rollout_rs, threshold, message", [
    ("token_k4", 1.0, "unknown option 'token_k4'; known: token_k1, token_k2, token_k3, seq_sum_k1"),
    ("seq_max_k1", "2", "unknown option 'seq_max_k1'"),
    (" , ", 1.0, "no option"),
    ("token_k2,token_k2", 1.0, "token_k2 is listed twice"),
    ("token_k1,token_k2,token_k3", "2,1", "2 entries for 3 options"),
    ("token_k2", "1,2", "2 entries for 1 options"),
    ("token_k2", None, "needs it"),
    ("token_k2", "0.5_2", "token_k2 takes one upper bound, got '0.5_2'"),
    ("seq_mean_k3", "abc", "'abc' for seq_mean_k3 is not a number"),
    ("token_k1", "0.5_", "'' for token_k1 is not a number"),
    ("token_k1", "0.5_2_0", "'2_0' for token_k1 is not a number"),  # not float()'s digit grouping, 20
    ("token_k2", 0, "bounds must be > 0, got '0'"),
    ("seq_sum_k3", "-1", "bounds must be > 0"),
    ("token_k1", "0_2", "bounds must be > 0"),
    ("token_k1", "nan", "bounds must be > 0"),
    ("token_k1", "4_0.5", "lower bound 4.0 must be below its upper bound 0.5"),
    ("seq_sum_k1", 0.5, "lower bound 2.0 must be below"),  # a single U < 1: lower 1/U above it
    ("token_k2", True, "a number or a string"),
    ("token_k2", [1.0], "a number or a string"),
])
def test_bad_rule_specs_are_refused_naming_the_verl_key(rollout_rs, threshold, message):
    with pytest.raises(ValueError, match=r"^algorithm\.rollout_correction\.rollout_rs(_threshold)?: .*"
                       + re.escape(message)):
        parse_rules(rollout_rs, threshold)


@pytest.mark.parametrize("rules, message", [
    ((RejectRule("token_k5", None, 1.0),), "unknown option 'token_k5'; known: token_k1"),
    ((RejectRule("token_k1", None, 2.0),), "token_k1 needs lower and upper"),
    ((RejectRule("token_k2", 0.5, 2.0),), "token_k2 takes one upper bound"),
    ((RejectRule("token_k2", None, 0.0),), "bounds must be numbers > 0"),
    ((RejectRule("token_k1", 2.0, 2.0),), "must be below its upper bound"),
    ((RejectRule("token_k2", None, 1.0), RejectRule("token_k2", None, 2.0)), "lists an option twice"),
    ([RejectRule("token_k2", None, 1.0)], "rs_rules must be a tuple"),
])
def test_bad_rules_are_refused_by_validate(rules, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        RolloutCorrection(rs_rules=rules).validate()


def test_from_verl_reads_both_spellings():
    assert from_verl() is None  # nothing on; the default rollout_is_threshold alone does nothing
    assert from_verl(rollout_is_threshold=5.0) is None
    assert from_verl(rollout_is="token", rollout_is_threshold="2.0") == RolloutCorrection(is_level="token",
                                                                                         is_threshold=2.0)
    assert from_verl(rollout_is="sequence", rollout_is_threshold=3).is_threshold == 3.0
    assert from_verl(rollout_is="token", rollout_is_threshold=None).is_threshold == math.inf  # not truncated
    assert from_verl(rollout_is="token", rollout_is_threshold_lower=0, rollout_is_batch_normalize=True) == \
        RolloutCorrection(is_level="token", is_threshold=2.0, is_threshold_lower=0.0, is_batch_normalize=True)
    # verl 0.6: a level and a band on the ratio, and the veto
    assert from_verl(rollout_rs="sequence", rollout_rs_threshold="2", rollout_rs_threshold_lower=0.25,
                     rollout_token_veto_threshold=1e-4) == RolloutCorrection(
        rs_level="sequence", rs_threshold=2.0, rs_threshold_lower=0.25, token_veto_threshold=1e-4)
    assert from_verl(rollout_token_veto_threshold="1e-4") == RolloutCorrection(token_veto_threshold=1e-4)
    # the newer options (verl's decoupled_seq_is_rs and decoupled_k3_rs_token_tis presets)
    assert from_verl(rollout_is="sequence", rollout_rs="seq_sum_k1", rollout_rs_threshold="0.5_2.0") == \
        RolloutCorrection(is_level="sequence", rs_rules=(RejectRule("seq_sum_k1", 0.5, 2.0),))
    assert from_verl(rollout_is="token", rollout_rs="seq_mean_k3", rollout_rs_threshold=0.01).rs_rules == \
        (RejectRule("seq_mean_k3", None, 0.01),)
    assert from_verl(rollout_rs="token_k3,seq_sum_k2", rollout_rs_threshold="0.25, 1.0") == RolloutCorrection(
        rs_rules=(RejectRule("token_k3", None, 0.25), RejectRule("seq_sum_k2", None, 1.0)))


def test_verl_0_6_sequence_and_geometric_rejection_equal_seq_sum_k1_and_seq_mean_k1_with_the_band_inverted():
    # ratios: row 0: 2, 1.5 (product 3, geometric mean 1.73); row 1: 1.5, 1 (1.5, 1.22); row 2: 0.5, 0.4
    # (0.2, 0.45); row 3: 0.6, 0.5 (0.3, 0.55); row 4: 2.5 and a padding token (2.5, 2.5)
    target = lp([[0.8, 0.6], [0.6, 0.3], [0.2, 0.2], [0.3, 0.2], [0.5, 0.7]])
    behaviour = lp([[0.4, 0.4], [0.4, 0.3], [0.4, 0.5], [0.5, 0.4], [0.2, 0.1]])
    mask = torch.tensor([[1, 1], [1, 1], [1, 1], [1, 1], [1, 0]])

    def kept(**verl):
        return correct(target, behaviour, mask, from_verl(**verl))[1].tolist()

    # products in [0.25, 2]: rows 1 and 3; seq_sum_k1 keeps -log(product) in [log 0.5, log 4], that band
    # ("0.25_2" would keep the products in [0.5, 4]: rows 0, 1 and 4)
    by_products = [[0, 0], [1, 1], [0, 0], [1, 1], [0, 0]]
    assert kept(rollout_rs="sequence", rollout_rs_threshold=2.0, rollout_rs_threshold_lower=0.25) == by_products
    assert kept(rollout_rs="seq_sum_k1", rollout_rs_threshold="0.5_4") == by_products
    assert kept(rollout_rs="seq_sum_k1", rollout_rs_threshold="0.25_2") == [[1, 1], [1, 1], [0, 0], [0, 0], [1, 0]]
    # geometric means in [0.5, 2] (a single 2 both ways, symmetric): rows 0, 1 and 3
    by_means = [[1, 1], [1, 1], [0, 0], [1, 1], [0, 0]]
    assert kept(rollout_rs="geometric", rollout_rs_threshold=2.0) == by_means
    assert kept(rollout_rs="seq_mean_k1", rollout_rs_threshold=2.0) == by_means


@pytest.mark.parametrize("settings, message", [
    (dict(rollout_is="tokens"), "rollout_is: one of token, sequence or null"),
    (dict(rollout_is="token", rollout_is_threshold="abc"), "rollout_is_threshold: a number > 0, or null"),
    (dict(rollout_is="token", rollout_is_threshold=0), "rollout_is_threshold: a number > 0"),
    (dict(rollout_is="token", rollout_is_threshold=True), "rollout_is_threshold: a number > 0"),
    (dict(rollout_is="token", rollout_is_threshold_lower=-0.1), "rollout_is_threshold_lower: a number >= 0"),
    (dict(rollout_is="token", rollout_is_threshold_lower=3), "rollout_is_threshold_lower: must be below"),
    (dict(rollout_is_threshold_lower=0.5), "rollout_is_threshold_lower: acts on IS weights"),
    (dict(rollout_is_batch_normalize=True), "rollout_is_batch_normalize: acts on IS weights"),
    (dict(rollout_is="token", rollout_is_batch_normalize="yes"), "rollout_is_batch_normalize: true or false"),
    (dict(rollout_rs_threshold=2.0), "rollout_rs_threshold: bounds rejection sampling: set rollout_rs too"),
    (dict(rollout_rs="token"), "rollout_rs_threshold: rollout_rs=token needs it"),
    (dict(rollout_rs="sequence", rollout_rs_threshold="0.5_2"), "rollout_rs_threshold: a number > 0 with "
                                                                "rollout_rs=sequence"),
    (dict(rollout_rs="geometric", rollout_rs_threshold=0.999), "rollout_rs_threshold_lower: the band"),
    (dict(rollout_rs="token_k2", rollout_rs_threshold=1, rollout_rs_threshold_lower=0.5),
     "rollout_rs_threshold_lower: is verl 0.6's"),
    (dict(rollout_rs="sequence,token_k2", rollout_rs_threshold=1), "rollout_rs: verl 0.6's token, sequence"),
    (dict(rollout_rs="token_k9", rollout_rs_threshold=1), "rollout_rs: unknown option 'token_k9'; known:"),
    (dict(rollout_rs="token_k2", rollout_rs_threshold="1_2"), "rollout_rs_threshold: token_k2 takes one"),
    (dict(rollout_rs=3), "rollout_rs: a string"),
    (dict(rollout_token_veto_threshold=0), "rollout_token_veto_threshold: a number > 0"),
])
def test_from_verl_refuses_bad_values_naming_the_key(settings, message):
    with pytest.raises(ValueError, match="^algorithm\\.rollout_correction\\." + re.escape(message)):
        from_verl(**settings)


def test_from_nemo_rl_gives_the_verl_keys_of_each_type():
    none = dict(rollout_is="token", rollout_is_threshold=None, rollout_is_threshold_lower=None,
                rollout_rs=None, rollout_rs_threshold=None, rollout_rs_threshold_lower=None)
    assert from_nemo_rl(False, None, None, None) == {}
    assert from_verl(**from_nemo_rl(False, None, None, None)) is None
    # the correction on, no type: raw IS weights, per token or per sequence
    assert from_nemo_rl(True, None, None, None) == none
    assert from_verl(**from_nemo_rl(True, None, None, None)) == RolloutCorrection(is_level="token",
                                                                                  is_threshold=math.inf)
    assert from_nemo_rl(True, None, None, None, sequence_level=True) == {**none, "rollout_is": "sequence"}
    # tis: truncated to [m or nothing, C]
    assert from_verl(**from_nemo_rl(True, "tis", 2.0, None)) == RolloutCorrection(is_level="token", is_threshold=2.0)
    assert from_verl(**from_nemo_rl(True, "tis", 5, 0.2, sequence_level=True)) == RolloutCorrection(
        is_level="sequence", is_threshold=5.0, is_threshold_lower=0.2)
    # icepop: weights up to C, rejection outside [m, C] at the weights' level
    assert from_nemo_rl(True, "icepop", 5.0, 0.5) == {**none, "rollout_is_threshold": 5.0, "rollout_rs": "token",
                                                      "rollout_rs_threshold": 5.0, "rollout_rs_threshold_lower": 0.5}
    assert from_verl(**from_nemo_rl(True, "icepop", 5.0, 0.5, sequence_level=True)) == RolloutCorrection(
        is_level="sequence", is_threshold=5.0, rs_level="sequence", rs_threshold=5.0, rs_threshold_lower=0.5)
    # seq-mask-tis: raw token weights, the geometric band [m, C]
    assert from_verl(**from_nemo_rl(True, "seq-mask-tis", 1.002, 0.999)) == RolloutCorrection(
        is_level="token", is_threshold=math.inf, rs_level="geometric", rs_threshold=1.002, rs_threshold_lower=0.999)


def test_nemo_rl_icepop_and_seq_mask_tis_on_tensors():
    # icepop [0.5, 5]: ratios 0.4 (below), 1, 6 (above): the middle token stays, its weight raw
    target, behaviour = lp([[0.4, 0.5, 0.6]]), lp([[1.0, 0.5, 0.1]])
    weights, new_mask, _ = correct(target, behaviour, torch.ones(1, 3),
                                   from_verl(**from_nemo_rl(True, "icepop", 5.0, 0.5)))
    close(new_mask, [[0.0, 1.0, 0.0]])
    assert weights[0, 1] == pytest.approx(1.0)
    # seq-mask-tis [0.8, 1.25]: geometric means row 0: sqrt(2 * 0.5) = 1 (kept, its weights the raw 2 and 0.5),
    # row 1: 1.5 (above), row 2: sqrt(0.5) = 0.71 (below)
    target, behaviour = lp([[0.8, 0.2], [0.6, 0.6], [0.2, 0.3]]), lp([[0.4, 0.4], [0.4, 0.4], [0.4, 0.3]])
    weights, new_mask, _ = correct(target, behaviour, torch.ones(3, 2),
                                   from_verl(**from_nemo_rl(True, "seq-mask-tis", 1.25, 0.8)))
    close(new_mask, [[1.0, 1.0], [0.0, 0.0], [0.0, 0.0]])
    close(weights[0], [2.0, 0.5])


@pytest.mark.parametrize("settings, message", [
    ((False, "tis", 2.0, None), "truncated_importance_sampling_type: needs use_importance_sampling_correction"),
    ((True, "clip", 2.0, None), "truncated_importance_sampling_type: one of tis, icepop, seq-mask-tis or null"),
    ((True, None, 2.0, None), "truncated_importance_sampling_ratio: needs truncated_importance_sampling_type"),
    ((False, None, 2.0, None), "truncated_importance_sampling_ratio: needs truncated_importance_sampling_type"),
    ((True, None, None, 0.5), "truncated_importance_sampling_ratio_min: needs truncated_importance_sampling_type"),
    ((True, "tis", None, None), "truncated_importance_sampling_ratio: a number > 0 with type tis"),
    ((True, "tis", 0.0, None), "truncated_importance_sampling_ratio: a number > 0"),
    ((True, "icepop", 5.0, None), "truncated_importance_sampling_ratio_min: type icepop needs it"),
    ((True, "seq-mask-tis", 1.002, None), "truncated_importance_sampling_ratio_min: type seq-mask-tis needs it"),
    ((True, "tis", 2.0, 3.0), "truncated_importance_sampling_ratio_min: must be >= 0 and below"),
    ((True, "icepop", 2.0, 2.0), "truncated_importance_sampling_ratio_min: must be >= 0 and below"),
    ((True, "icepop", 2.0, -0.5), "truncated_importance_sampling_ratio_min: must be >= 0"),
    ((True, "seq-mask-tis", 1.002, 0.999, True), "sequence_level_importance_ratios: seq-mask-tis weighs tokens"),
])
def test_from_nemo_rl_refuses_what_nemo_rl_refuses_naming_the_key(settings, message):
    with pytest.raises(ValueError, match="^loss_fn\\." + re.escape(message)):
        from_nemo_rl(*settings)
