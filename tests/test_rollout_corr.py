"""The rollout/trainer log-prob gap: verl's diagnostics on hand-computed tensors, and a run
that logs them (rollout.calculate_log_probs)."""

import math

import pytest
import torch

from posttrain.algorithms.rollout_corr import mismatch_metrics
from posttrain.build import build_run
from posttrain.config import load_config
from posttrain.loop import train

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
    from posttrain.specs import rollout_log_probs

    assert not rollout_log_probs(load_config(None, ["model.path=/m"]))
    assert rollout_log_probs(load_config(None, ["model.path=/m", "rollout.name=vllm"]))
    assert not rollout_log_probs(load_config(None, ["model.path=/m", "rollout.name=vllm",
                                                    "actor_rollout_ref.rollout.calculate_log_probs=False"]))
