"""PF-PPO (verl's algorithm.use_pf_ppo): weights by hand, the redraw, the keys."""

import pytest
import torch

from posttrain.algorithms import pf_ppo_resample, pf_ppo_weights
from posttrain.driver.batch import RolloutBatch
from posttrain.config import load_config
from posttrain.errors import ConfigError
from posttrain.driver.loop import pf_ppo_batch
from posttrain.rollout.base import RolloutOutput

T = torch.tensor


def test_weights_by_hand():
    scores = T([1.0, -0.5, 0.0, 2.0])
    # pow 2: |s|^2 + 1e-8 -> [1, 0.25, 1e-8, 4]
    torch.testing.assert_close(pf_ppo_weights(scores, "pow", 2.0), T([1.0, 0.25, 1e-8, 4.0]), rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(pf_ppo_weights(scores, "pow", 1.0), T([1.0, 0.5, 1e-8, 2.0]), rtol=1e-6, atol=1e-9)
    # max_min: the highest (2) and the lowest (-0.5) -> 1, the rest 0 (+1e-8)
    torch.testing.assert_close(pf_ppo_weights(scores, "max_min"), T([1e-8, 1.0, 1e-8, 1.0]), rtol=1e-6, atol=1e-9)
    # max_random: the highest 0.4, the rest 0.1
    torch.testing.assert_close(pf_ppo_weights(scores, "max_random"), T([0.1, 0.1, 0.1, 0.4]), rtol=1e-6, atol=1e-9)
    with pytest.raises(ValueError, match="'median' is not one of: pow, max_min, max_random"):
        pf_ppo_weights(scores, "median")


def test_redraw_follows_the_weights_and_keeps_the_size():
    weights = T([1.0, 3.0, 1e-8, 0.0 + 1e-8])
    draws = torch.cat([pf_ppo_resample(weights, torch.Generator().manual_seed(s)) for s in range(1000)])
    counts = torch.bincount(draws, minlength=4)
    assert pf_ppo_resample(weights).shape == (4,)
    assert counts[2] + counts[3] == 0  # weight 1e-8 against 4: practically never
    assert counts[1] / counts[0] == pytest.approx(3.0, rel=0.1)  # 4000 draws in proportion 1 : 3


def test_the_update_batch_is_redrawn_from_the_reliable_rows():
    out = RolloutOutput(T([[5, 6], [5, 6]]), T([[1, 1], [1, 1]]), T([[7, 8], [9, 0]]), T([[1, 1], [1, 0]]))
    batch = RolloutBatch.from_rollout(out, 2, ["s"], ["t"], [{}], ["a", "b"])
    batch.token_level_scores = T([[0.0, 1.0], [0.0, 0.0]])  # row 0 scored 1, row 1 scored 0
    batch.advantages = T([[0.5, 0.5], [-0.5, 0.0]])
    pf = load_config(None, ["algorithm.adv_estimator=gae", "algorithm.use_pf_ppo=True"]).algorithm.pf_ppo
    picked = pf_ppo_batch(batch, pf, seed=3)
    assert len(picked) == 2 and picked.responses.tolist() == [[7, 8], [7, 8]]  # weights 1 : 1e-8
    assert picked.advantages.tolist() == [[0.5, 0.5], [0.5, 0.5]] and picked.response_text == ["a", "a"]
    assert torch.equal(pf_ppo_batch(batch, pf, seed=3).responses, picked.responses)  # seeded: a resume redraws alike


def test_verls_keys_load_and_misuse_is_one_line():
    c = load_config(None, ["algorithm.adv_estimator=gae", "algorithm.use_pf_ppo=True",
                           "algorithm.pf_ppo.reweight_method=max_min", "algorithm.pf_ppo.weight_pow=3"])
    assert c.algorithm.use_pf_ppo and (c.algorithm.pf_ppo.reweight_method, c.algorithm.pf_ppo.weight_pow) == (
        "max_min", 3.0)
    for overrides, message in [
        (["algorithm.use_pf_ppo=True"], "algorithm.use_pf_ppo=true resamples the batch after GAE (as verl): it needs "
                                        "algorithm.adv_estimator=gae, got grpo"),
        (["algorithm.adv_estimator=gae", "algorithm.use_pf_ppo=True", "algorithm.pf_ppo.reweight_method=mean"],
         "algorithm.pf_ppo.reweight_method=mean is not one of: pow, max_min, max_random"),
    ]:
        with pytest.raises(ConfigError) as e:
            load_config(None, overrides)
        assert str(e.value) == message
