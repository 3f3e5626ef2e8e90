"""Rollout correction inside the step: the policy losses take IS weights, the decoupled mode's weights and
rejections reach the update (loop.rollout_corrected), bypass mode corrects with the live pi_theta in each
micro-batch (training.actor.is_weights), the config's keys, and short runs of each mode."""

import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch

from posttrain.algorithms.losses import gpg_policy_loss, gspo_policy_loss, ppo_policy_loss
from posttrain.algorithms.rollout_corr import RolloutCorrection
from posttrain.driver.build import build_run
from posttrain.config import load_config
from posttrain.errors import ConfigError
from posttrain.driver.loop import rollout_corrected, train
from posttrain.driver.settings import rollout_correction, rollout_log_probs, update_settings
from posttrain.training.actor import is_weights

from helpers import one_batch_overrides, read_metrics, write_prompts

LN = math.log
RC = "algorithm.rollout_correction."


def test_the_ppo_loss_multiplies_each_tokens_loss_by_its_weight():
    # A = 1, r = 1.5: clipped to -1.2; A = -1, r = 5: dual clip 3.0 (the docstring's example)
    old = torch.zeros(1, 2)
    new = torch.tensor([[LN(1.5), LN(5.0)]], requires_grad=True)
    adv, mask = torch.tensor([[1.0, -1.0]]), torch.ones(1, 2)
    plain = ppo_policy_loss(old, new, adv, mask)["pg_loss"]
    w = torch.tensor([[0.5, 2.0]], requires_grad=True)
    out = ppo_policy_loss(old, new, adv, mask, weights=w)["pg_loss"]
    assert plain.item() == pytest.approx(0.9) and out.item() == pytest.approx((-1.2 * 0.5 + 3.0 * 2.0) / 2)
    out.backward()
    assert w.grad is None  # the weights are constants of the loss


def test_the_reinforce_loss_is_the_weighted_policy_gradient():
    lp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    out = gpg_policy_loss(torch.zeros(1, 2), lp, torch.ones(1, 2), torch.ones(1, 2),
                          weights=torch.tensor([[2.0, 0.5]]))["pg_loss"]
    assert out.item() == pytest.approx((2 * 1 + 0.5 * 2) / 2)
    out.backward()
    assert lp.grad.tolist() == [[-1.0, -0.25]]  # -w A / 2 per token


def test_the_gspo_loss_takes_weights_on_its_token_form():
    # one sequence, ratio 1 everywhere (new == old), A = 1: per token -1; weights [1, 3], seq-mean-token-mean
    lp = torch.zeros(1, 2, requires_grad=True)
    out = gspo_policy_loss(torch.zeros(1, 2), lp, torch.ones(1, 2), torch.ones(1, 2),
                           weights=torch.tensor([[1.0, 3.0]]))["pg_loss"]
    assert out.item() == pytest.approx(-(1 + 3) / 2)


@dataclasses.dataclass
class Rows:
    """The fields of a RolloutBatch that rollout_corrected reads and replaces."""

    old_log_probs: torch.Tensor
    rollout_log_probs: torch.Tensor
    response_mask: torch.Tensor
    rollout_is_weights: torch.Tensor | None = None


def test_decoupled_mode_gives_the_update_weights_and_a_mask_without_the_rejected_tokens():
    # ratios pi_old / pi_rollout: [2, 0.5, 8] and [1, 1, (padding)]; token TIS at 4, token band [0.25, 4]
    rows = Rows(torch.tensor([[LN(0.5), LN(0.25), LN(0.8)], [LN(0.3), LN(0.3), 0.0]]),
                torch.tensor([[LN(0.25), LN(0.5), LN(0.1)], [LN(0.3), LN(0.3), 0.0]]),
                torch.tensor([[1, 1, 1], [1, 1, 0]]))
    c = RolloutCorrection(is_level="token", is_threshold=4.0, rs_level="token", rs_threshold=4.0)
    m = {}
    out = rollout_corrected(rows, c, m)
    assert torch.allclose(out.rollout_is_weights, torch.tensor([[2.0, 0.5, 4.0], [1.0, 1.0, 0.0]]))
    assert out.response_mask.tolist() == [[1, 1, 0], [1, 1, 0]]  # the ratio 8 is outside [0.25, 4]
    assert m["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(1 / 5)
    assert m["rollout_corr/rollout_is_mean"] == pytest.approx((2 + 0.5 + 8 + 1 + 1) / 5)


def test_bypass_mode_weighs_by_the_live_policy_and_zeroes_rejected_tokens():
    # pi_theta [0.5, 0.1], pi_rollout [0.25, 0.4]: ratios 2 and 0.25; token IS capped at 1.5, token band
    # [1/3, 3]: the second token is rejected (weight 0) but stays in the mask
    mb = SimpleNamespace(rollout_log_probs=torch.tensor([[LN(0.25), LN(0.4)]]), rollout_is_weights=None)
    live = torch.tensor([[LN(0.5), LN(0.1)]], requires_grad=True)
    c = RolloutCorrection(is_level="token", is_threshold=1.5, rs_level="token", rs_threshold=3.0)
    w, metrics = is_weights(mb, live, torch.ones(1, 2), c, "cpu")  # the reinforce loss: weighted
    assert torch.allclose(w, torch.tensor([[1.5, 0.0]]))
    assert not w.requires_grad
    assert metrics["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(0.5)
    assert metrics["rollout_corr/kl"] == pytest.approx(((LN(0.25) - LN(0.5)) + (LN(0.4) - LN(0.1))) / 2)
    # PPO-clip's ratio already is pi_theta / pi_rollout: the IS weights are reported, only rejection applies
    w, ppo_metrics = is_weights(mb, live, torch.ones(1, 2), c, "cpu", weigh=False)
    assert w.tolist() == [[1.0, 0.0]] and ppo_metrics == metrics
    # rejection alone: weights are the kept mask; no bypass: the batch's own weights, no metrics
    w, _ = is_weights(mb, live, torch.ones(1, 2), RolloutCorrection(rs_level="token", rs_threshold=3.0), "cpu")
    assert w.tolist() == [[1.0, 0.0]]
    assert is_weights(mb, live, torch.ones(1, 2), None, "cpu") == (None, {})


def cfg_of(*overrides):
    return load_config(None, list(overrides))


def test_the_config_keys_build_the_correction_and_turn_the_engines_log_probs_on():
    key = "algorithm.rollout_correction"
    assert rollout_correction(cfg_of()) is None and not rollout_log_probs(cfg_of())
    cfg = cfg_of(f"{key}.rollout_is=token", f"{key}.rollout_is_threshold=3", f"{key}.rollout_rs=geometric",
                 f"{key}.rollout_rs_threshold=1.01")
    c = rollout_correction(cfg)
    assert (c.is_level, c.is_threshold, c.rs_level, c.rs_threshold) == ("token", 3.0, "geometric", 1.01)
    assert rollout_log_probs(cfg) and update_settings(cfg).bypass_correction is None
    # verl's prefixed spelling reaches the same keys
    cfg = cfg_of("algorithm.rollout_correction.bypass_mode=true", f"{key}.loss_type=reinforce",
                 f"{key}.rollout_is=sequence")
    s = update_settings(cfg)
    assert s.loss_mode == "gpg" and s.bypass_correction.is_level == "sequence" and rollout_log_probs(cfg)
    # bypass alone: everything off, but the engine's log-probs are the old ones
    s = update_settings(cfg_of(f"{key}.bypass_mode=true"))
    assert s.bypass_correction == RolloutCorrection() and s.loss_mode == "vanilla"


@pytest.mark.parametrize("overrides, words", [
    (["rollout_is=tokens"], "rollout_is"),
    (["loss_type=reinforce"], "bypass_mode=true"),
    (["use_policy_gradient=true"], "bypass_mode=true"),
    (["loss_type=ppo"], "loss_type"),
    (["rollout_rs=token"], "rollout_rs_threshold"),
])
def test_bad_settings_are_refused_naming_the_key(overrides, words):
    with pytest.raises(ConfigError, match=words):
        cfg_of(*[f"algorithm.rollout_correction.{o}" for o in overrides])


def test_a_correction_with_the_engines_log_probs_turned_off_is_refused():
    with pytest.raises(ConfigError, match="calculate_log_probs"):
        cfg_of("algorithm.rollout_correction.rollout_is=token", "rollout.calculate_log_probs=false")


def run_of(tmp_path, model_dir, steps, *extra):
    write_prompts(tmp_path, 8)
    run = build_run(load_config(None, one_batch_overrides(model_dir, tmp_path, tmp_path / "run", steps,
                                                          "actor.lr=1e-3", *extra)))
    before = {n: p.detach().clone() for n, p in run.actor.policy.named_parameters()}
    train(run)
    moved = any(not torch.equal(before[n], p.detach()) for n, p in run.actor.policy.named_parameters())
    return [x for x in read_metrics(tmp_path / "run") if "critic/score/mean" in x], moved


def test_decoupled_token_tis_in_a_run_logs_the_correction_and_trains(tmp_path, tiny_model_dir):
    """The hf engine samples from the very weights the trainer scores: every ratio is 1 up to the two
    passes' float32 rounding, so the weights are 1 and nothing is rejected."""
    lines, moved = run_of(tmp_path, tiny_model_dir, 2, "algorithm.rollout_correction.rollout_is=token",
                          "algorithm.rollout_correction.rollout_rs=token",
                          "algorithm.rollout_correction.rollout_rs_threshold=1.5")
    assert moved and len(lines) == 2
    for x in lines:
        assert "timing_s/old_log_prob" in x
        assert x["rollout_corr/rollout_is_mean"] == pytest.approx(1.0, abs=1e-4)
        assert x["rollout_corr/rollout_rs_masked_fraction"] == 0.0
        assert x["training/rollout_probs_diff_max"] < 1e-4


def test_bypass_mode_in_a_run_skips_the_old_pass(tmp_path, tiny_model_dir):
    lines, moved = run_of(tmp_path, tiny_model_dir, 2, "algorithm.rollout_correction.bypass_mode=true",
                          "algorithm.rollout_correction.rollout_is=token")
    assert moved and len(lines) == 2
    for x in lines:
        assert "timing_s/old_log_prob" not in x
        # one mini-batch: pi_theta is still the sampling weights in every micro-batch (one optimizer step, last)
        assert x["rollout_corr/rollout_is_mean"] == pytest.approx(1.0, abs=1e-4)
        assert "rollout_corr/kl" in x


# verl's examples/rollout_correction/*.sh (volcengine/verl at b178a3c), their algorithm.rollout_correction keys as
# the shell hands them on: RLOO with self-normalised sequence IS in bypass mode, and two rejection options at once
VERL_RLOO = ["algorithm.adv_estimator=rloo", f"{RC}rollout_is=sequence", f"{RC}rollout_is_threshold=2.0",
             f"{RC}rollout_is_batch_normalize=true", f"{RC}rollout_rs=null", f"{RC}rollout_rs_threshold=null",
             f"{RC}bypass_mode=true", f"{RC}loss_type=reinforce", "actor_rollout_ref.rollout.calculate_log_probs=True"]
VERL_MULTI_RS = [f"{RC}rollout_is=token", f"{RC}rollout_is_threshold=2.0", f"{RC}rollout_is_batch_normalize=false",
                 f"{RC}rollout_rs='token_k1,seq_max_k2'", f"{RC}rollout_rs_threshold='0.6_1.6,2.5'",
                 f"{RC}bypass_mode=true", f"{RC}loss_type=ppo_clip"]


def test_verls_rollout_correction_example_scripts_load_as_they_mean():
    s = update_settings(cfg_of(*VERL_RLOO))
    c = s.bypass_correction
    assert s.loss_mode == "gpg" and (c.is_level, c.is_threshold, c.is_batch_normalize) == ("sequence", 2.0, True)
    s = update_settings(cfg_of(*VERL_MULTI_RS))
    c = s.bypass_correction
    assert s.loss_mode == "vanilla" and c.is_level == "token"
    assert [(r.option, r.lower, r.upper) for r in c.rs_rules] == [("token_k1", 0.6, 1.6), ("seq_max_k2", None, 2.5)]
