"""Every algorithm of the family trains the embedded tiny model on the default
task and raises its validation score (a short run each)."""

import math
import statistics

import pytest

from posttrain.config.presets import ALGORITHMS
from posttrain.driver.build import build_run
from posttrain.config import load_config
from posttrain.driver.loop import train

from helpers import read_metrics

STEPS = 20


def short_run(tmp_path, name, *extra):
    cfg = load_config(None, [f"algorithm.name={name}", f"trainer.total_training_steps={STEPS}", "trainer.test_freq=-1",
                             "trainer.save_last=false", "data.val_max_samples=256", "trainer.logger=[]",
                             f"trainer.run_dir={tmp_path / name}", *extra])
    summary = train(build_run(cfg))
    return summary, [x for x in read_metrics(tmp_path / name) if "critic/score/mean" in x]


@pytest.mark.slow
# grpo is the default: test_end_to_end.py's default run trains it for 100 steps on the same task. gdpo normalizes a
# reward's parts one by one: the default task's reward has one (test_nemo_rl_config runs gdpo)
@pytest.mark.parametrize("name", [n for n in ALGORITHMS if n not in ("grpo", "gdpo")])
def test_each_algorithm_raises_the_validation_score(tmp_path, trained_tiny_model_dir, name):
    """20 steps of each algorithm raise the validation score by more than 0.08.

    Spread of the gain (bench/learning_spread.py algorithms, trainer.seed 0-4, 2 threads), min..max:
    grpo 0.234..0.262, ppo 0.223..0.281, rloo 0.230..0.262, reinforce_pp 0.219..0.270,
    reinforce_pp_baseline 0.230..0.262, drgrpo 0.238..0.266, dapo 0.203..0.266, gspo 0.211..0.258,
    grpo_passk 0.145..0.195, grpo_loo 0.211..0.254. The threshold sits 0.065 under the lowest, more than any algorithm's
    whole spread (0.063 at most).

    PPO's critic is not judged here: over 20 steps its explained variance rose by 0.048..0.120 and its
    value loss fell only to 0.92..1.00 of the first steps', too little against the noise for a
    threshold (a rise of 0.05 failed once on a fresh clone). test_critic.py's fixed-batch fit tests
    that the critic learns."""
    summary, steps = short_run(tmp_path, name)
    seconds = statistics.median(x["timing_s/step"] for x in steps)  # the last step also validates
    print(f"{name}: val {summary['val_before']:.3f} -> {summary['val_after']:.3f}, {seconds:.2f} s/step (median)")
    assert len(steps) == STEPS
    assert summary["val_after"] > summary["val_before"] + 0.08
    if name == "ppo":  # the critic ran and reported every step
        assert all(math.isfinite(x["critic/vf_explained_var"]) and x["critic/vf_loss"] >= 0 for x in steps)
    if name == "dapo":
        assert all(x["train/num_gen_batches"] >= 1 for x in steps)
