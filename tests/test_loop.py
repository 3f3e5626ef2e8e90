"""The loop end to end on the embedded tiny model."""

import pytest
import torch

from posttrain.driver.build import build_run
from posttrain.config import load_config
from posttrain.driver.loop import train

from helpers import one_batch_overrides, read_metrics, run_overrides, write_prompts


def short_run(tmp_path, model_dir, *extra):
    """12 GRPO steps on 16 prompts, validated on the same prompts. -> (summary, step metrics, names of the
    parameters that did not move)."""
    write_prompts(tmp_path, 16)
    cfg = load_config(None, run_overrides(
        model_dir, tmp_path, tmp_path / "run", f"data.val_files={tmp_path / 'train.parquet'}",
        "data.train_batch_size=16", "data.max_response_length=6",
        "actor.ppo_mini_batch_size=16", "actor.ppo_micro_batch_size=128", "actor.lr=1e-4", "actor.weight_decay=0",
        "rollout.n=8", "trainer.total_training_steps=12", "trainer.test_freq=12", *extra,
    ))
    run = build_run(cfg)
    before = {n: p.detach().clone() for n, p in run.actor.policy.named_parameters()}
    summary = train(run)
    still = [n for n, p in run.actor.policy.named_parameters() if torch.equal(before[n], p.detach())]
    return summary, [x for x in read_metrics(tmp_path / "run") if "critic/score/mean" in x], still


def test_short_run_moves_every_parameter_and_raises_reward(tmp_path, trained_tiny_model_dir):
    """A few GRPO steps on 16 prompts: every parameter moves and the greedy
    score on those prompts rises (at the embedded preset's lr 1e-4: 3e-4 first
    drops the score and recovers or not depending on the seed).

    Spread (bench/learning_spread.py loop, trainer.seed 0-4, 2 threads and 1 alike): the validation
    gain 0.250..0.375 (a prompt is 0.0625), the training score's rise from the first 3 steps to the
    last 3 0.094..0.180. Thresholds: a gain of 2 prompts (0.125), and any rise (0.094 under the
    lowest, more than the whole spread)."""
    summary, steps, still = short_run(tmp_path, trained_tiny_model_dir)
    assert still == [], f"parameters that did not move: {still}"
    assert summary["val_after"] - summary["val_before"] >= 0.125
    assert len(steps) == 12
    first, last = steps[:3], steps[-3:]
    assert sum(x["critic/score/mean"] for x in last) > sum(x["critic/score/mean"] for x in first)


def test_a_raising_reward_costs_only_its_samples(tmp_path, tiny_model_dir, capsys):
    reward = tmp_path / "flaky.py"
    reward.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    if extra_info['a'] % 2:\n        raise ValueError('odd operand')\n"
        "    return 1.0\n")
    rows = write_prompts(tmp_path, 8)
    cfg = load_config(None, one_batch_overrides(tiny_model_dir, tmp_path, tmp_path / "run", 1,
                                                f"reward.custom_fn={reward}", quiet=False))
    summary = train(build_run(cfg))
    assert summary["steps"] == 1
    step = read_metrics(tmp_path / "run")[-1]
    odd = sum(r["extra_info"]["a"] % 2 for r in rows)
    assert step["reward/num_errors"] == 2 * odd  # n=2 samples per prompt
    assert step["critic/score/mean"] == pytest.approx(1 - odd / 8)
    assert "odd operand" in capsys.readouterr().err


def test_eval_prints_the_score_per_data_source(capsys, trained_tiny_model_dir):
    from posttrain.driver.build_data import embedded_data_files
    from posttrain.cli import main

    assert main(["eval", "--model", str(trained_tiny_model_dir), "--data", embedded_data_files()[1],
                 "--max-samples", "64", "--max-response-length", "6"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("arith") and out[-1].startswith("all")
    score = float(out[-1].split()[1])
    assert 0.1 < score < 0.9  # the warmed-up model: competent but imperfect


def test_kl_in_the_reward_with_an_adaptive_controller(tmp_path, tiny_model_dir):
    write_prompts(tmp_path, 8)
    cfg = load_config(None, run_overrides(
        tiny_model_dir, tmp_path, tmp_path / "run", "data.train_batch_size=4", "data.max_response_length=4",
        "actor.ppo_mini_batch_size=2", "actor.ppo_micro_batch_size=4", "rollout.n=4", "actor.lr=1e-2",
        "algorithm.use_kl_in_reward=True", "algorithm.kl_penalty=low_var_kl", "algorithm.kl_ctrl.type=adaptive",
        "algorithm.kl_ctrl.kl_coef=0.1", "algorithm.kl_ctrl.target_kl=0.01", "algorithm.kl_ctrl.horizon=10",
        "actor.entropy_coeff=0.01", "trainer.total_training_steps=3", quiet=False,
    ))
    run = build_run(cfg)
    assert run.actor.ref is not None
    train(run)
    steps = read_metrics(tmp_path / "run")
    coeffs = [s["actor/reward_kl_penalty_coeff"] for s in steps]
    assert coeffs[0] == pytest.approx(0.1)
    assert steps[0]["actor/reward_kl_penalty"] == pytest.approx(0.0, abs=1e-6)  # policy == reference at first
    assert coeffs[1] < coeffs[0]  # KL 0 < target: the controller lowers the coefficient
    assert steps[-1]["actor/reward_kl_penalty"] > 0  # two mini-batches a step at lr 1e-2: the policy moved away
    assert run.kl_ctrl.value == pytest.approx(coeffs[-1] * (1 + min(max(steps[-1]["actor/reward_kl_penalty"] / 0.01 - 1, -0.2), 0.2) * 16 / 10))


def test_training_steps_total_epochs_and_max_epochs():
    from types import SimpleNamespace

    from posttrain.driver.build import training_steps

    def tr(total_epochs=1, total_training_steps=None, max_epochs=None):
        return SimpleNamespace(total_epochs=total_epochs, total_training_steps=total_training_steps,
                               max_epochs=max_epochs)

    # 10 prompts, 4 a step (drop_last): 2 steps an epoch
    assert training_steps(tr(total_epochs=3), 2) == 6
    assert training_steps(tr(total_epochs=3, total_training_steps=25), 2) == 25  # verl: the step count wins
    assert training_steps(tr(total_training_steps=25, max_epochs=2), 2) == 4  # NeMo-RL: min(25, 2 x 2)
    assert training_steps(tr(total_training_steps=3, max_epochs=2), 2) == 3
    assert training_steps(tr(total_epochs=5, max_epochs=2), 2) == 4


def tiny_run(tmp_path, model_dir, *extra):
    """8 prompts, 4 a step: an epoch is 2 steps; validated on 4 prompts. -> (run, summary, logged lines)"""
    write_prompts(tmp_path, 8, val=4)
    cfg = load_config(None, run_overrides(
        model_dir, tmp_path, tmp_path / "run", "data.train_batch_size=4", "data.max_response_length=4",
        "actor.ppo_mini_batch_size=4", "actor.ppo_micro_batch_size=8", "rollout.n=2", "trainer.val_before_train=false",
        *extra, val=True))
    run = build_run(cfg)
    summary = train(run)
    return run, summary, read_metrics(tmp_path / "run")


def test_max_epochs_caps_total_training_steps(tmp_path, tiny_model_dir):
    run, summary, lines = tiny_run(tmp_path, tiny_model_dir, "trainer.total_training_steps=10", "trainer.max_epochs=2")
    assert run.total_steps == 4 and summary["steps"] == 4
    assert [x["training/epoch"] for x in lines if "training/epoch" in x] == [0, 0, 1, 1]


@pytest.mark.parametrize("val_at_end, test_freq, validated", [
    (True, -1, [3]),        # today's rule: the last step validates
    (False, -1, []),        # no final validation
    (False, 2, [2]),        # ... periodic ones still run; 3 is no multiple of 2
    (False, 3, [3]),        # the last step is a test_freq multiple: it validates anyway
])
def test_val_at_end(tmp_path, tiny_model_dir, val_at_end, test_freq, validated):
    _, summary, lines = tiny_run(tmp_path, tiny_model_dir, "trainer.total_training_steps=3",
                                 f"trainer.test_freq={test_freq}", f"trainer.val_at_end={val_at_end}")
    assert [x["training/global_step"] for x in lines if "val/score/mean" in x] == validated
    assert ("val_after" in summary) == bool(validated)


def test_overlong_filtering_in_a_run(tmp_path, trained_tiny_model_dir):
    """The step reports the share of rows it filtered; response lengths still count them. With a 3-token
    limit the embedded model's 3-digit answers are cut (filtered) and its 2-digit ones end with their EOS on
    the last token (kept, though response_length/clip_ratio counts them as at the limit)."""
    _, _, lines = tiny_run(tmp_path, trained_tiny_model_dir, "trainer.total_training_steps=2",
                           "data.max_response_length=3", "algorithm.overlong_filtering=true")
    steps = [x for x in lines if "critic/score/mean" in x]
    assert len(steps) == 2
    for x in steps:
        assert 0 < x["actor/overlong_filtered_ratio"] <= x["response_length/clip_ratio"]
        assert x["response_length/max"] == 3
    _, _, off = tiny_run(tmp_path / "off", trained_tiny_model_dir, "trainer.total_training_steps=1")
    assert "actor/overlong_filtered_ratio" not in off[-1]
