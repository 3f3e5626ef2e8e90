"""ReMax and GPG: the estimators against values worked out by hand (the
arithmetic is in the comments) and in the loop (ReMax's greedy baseline,
dynamic sampling, GPG's loss in the update). tests/test_verl_crosscheck.py
compares them (and every other estimator and loss verl has) with verl's own."""

import copy
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from posttrain.algorithms import compute_advantages, gpg_advantages, grpo_advantages, remax_advantages
from posttrain.driver.build import build_run
from posttrain.config import load_config
from posttrain.driver.rollouts import greedy_baselines, rollout_and_score
from posttrain.driver.loop import rl_step, train
from posttrain.driver.run import Run
from posttrain.models import load_tokenizer
from posttrain.rewards.pool import in_process
from posttrain.rollout.base import RolloutOutput, SamplingParams
from posttrain.training.logprobs import compute_log_probs

from helpers import pad, read_metrics, run_overrides, write_prompts

T = torch.tensor
# row 0 full, row 1 padded (1 token), row 2 fully masked (an empty response), row 3 full
ROWS_MASK = T([[1, 1], [1, 0], [0, 0], [1, 1]])


def close(a, b, atol=1e-5):
    torch.testing.assert_close(a, T(b, dtype=a.dtype), atol=atol, rtol=0)


# ---------------------------------------------------------------- ReMax

def test_remax_reward_to_go_minus_the_greedy_score():
    # per-token rewards (an outcome plus a KL penalty, say); masked rewards count nowhere
    rewards = T([[0.1, 1.0], [0.7, 5.0], [3.0, 3.0], [-0.2, 0.5]])
    adv, ret = remax_advantages(rewards, ROWS_MASK, T([0.5, 1.0, 2.0, 0.5]))
    # returns-to-go: row 0 [0.1 + 1, 1]; row 1 [0.7] (its masked 5 is no reward); row 2 nothing;
    # row 3 [-0.2 + 0.5, 0.5]
    close(ret, [[1.1, 1.0], [0.7, 0.0], [0.0, 0.0], [0.3, 0.5]])
    # minus each row's baseline on valid tokens only: the fully masked row's baseline 2 goes nowhere
    close(adv, [[0.6, 0.5], [-0.3, 0.0], [0.0, 0.0], [-0.2, 0.0]])
    assert not adv.requires_grad and ret is not adv
    # a masked token inside a row (tool output): the return flows past it, and it keeps 0 itself
    adv, ret = remax_advantages(T([[0.0, 9.0, 1.0]]), T([[1, 0, 1]]), T([0.25]))
    close(ret, [[1.0, 0.0, 1.0]])
    close(adv, [[0.75, 0.0, 0.75]])


def test_remax_through_the_dispatcher_needs_its_baselines():
    rewards, mask = T([[0.0, 1.0], [0.0, 0.0]]), torch.ones(2, 2)
    with pytest.raises(ValueError, match="'remax' estimator needs reward_baselines"):
        compute_advantages("remax", rewards, mask, [0, 0])
    with pytest.raises(ValueError, match=r"reward_baselines has shape \(3,\); one per row is \(2,\)"):
        compute_advantages("remax", rewards, mask, [0, 0], reward_baselines=torch.zeros(3))
    # the extras the loop passes (index, gamma, epsilon, ...) are not ReMax's: left out
    adv, ret = compute_advantages("remax", rewards, mask, [0, 0], values=torch.zeros(2, 2), gamma=0.5, epsilon=1e-3,
                                  reward_baselines=T([1.0, 1.0]))
    close(adv, [[0.0, 0.0], [-1.0, -1.0]])
    close(ret, [[1.0, 1.0], [0.0, 0.0]])
    adv, ret = compute_advantages("remax", torch.zeros(2, 0), torch.zeros(2, 0), [0, 1],
                                  reward_baselines=torch.ones(2))
    assert adv.shape == ret.shape == (2, 0)


# ---------------------------------------------------------------- GPG

def test_gpg_group_mean_scaled_by_batch_over_nonzero():
    # groups "a" = rows 0-2, "b" = row 3 alone, "c" = row 4 alone; scores [1, 0.2, 0, 2, 0]
    mask = T([[1, 1], [1, 0], [0, 0], [1, 1], [1, 1]])
    rewards = T([[0.0, 1.0], [0.2, 0.0], [0.0, 0.0], [0.0, 2.0], [0.0, 0.0]])
    adv, ret = gpg_advantages(rewards, mask, ["a", "a", "a", "b", "c"])
    # alpha = B / #non-zero scores = 5 / 3. "a": mean 1.2 / 3 = 0.4 -> centred [0.6, -0.2, -0.4] x 5/3 =
    # [1, -1/3, -2/3] (row 2 is fully masked: 0); "b" alone: mean 0 -> 2 x 5/3; "c" alone: 0
    close(adv, [[1.0, 1.0], [-1 / 3, 0.0], [0.0, 0.0], [10 / 3, 10 / 3], [0.0, 0.0]])
    assert ret is adv and not adv.requires_grad
    # no division by the std: GRPO's would be (1 - 0.4) / std([1, 0.2, 0]) = 0.6 / 0.5292 for row 0
    # all scores 0: alpha = 5 / max(0, 1), every advantage 0
    zero, _ = gpg_advantages(torch.zeros(5, 2), mask, [0, 0, 0, 1, 2])
    assert zero.eq(0).all()


def test_gpg_counts_nonzero_scores_as_verl_does():
    # verl sums each row's rewards unmasked: the fully masked row's stray 5 is a non-zero score, so
    # alpha = 3 / 2 (its own advantage is masked to 0). Group 0: [1, 0], mean 0.5 -> 1.5 x [0.5, -0.5]
    adv, _ = gpg_advantages(T([[1.0], [0.0], [5.0]]), T([[1], [1], [0]]), [0, 0, 1])
    close(adv, [[0.75], [-0.75], [0.0]])
    # through the dispatcher, with the extras it does not take; index as a tensor (0-d tensors would each be
    # a group of their own)
    a2, _ = compute_advantages("gpg", T([[1.0], [0.0], [5.0]]), T([[1], [1], [0]]), torch.tensor([0, 0, 1]),
                               values=torch.zeros(3, 1), gamma=0.9, norm_adv_by_std_in_grpo=False, epsilon=1e-3)
    assert torch.equal(a2, adv)
    adv, _ = gpg_advantages(torch.zeros(3, 0), torch.zeros(3, 0), [0, 0, 1])
    assert adv.shape == (3, 0)


# ---------------------------------------------------------------- ReMax's baseline in the loop, scripted

class ScriptedActor:
    """generate() answers a prompt (the bytes of a letter) with SAMPLES[letter] when sampling, GREEDY[letter]
    when greedy; `calls` records (letters, greedy)."""

    SAMPLES = {"A": ["1", "1"], "B": ["1", "22"], "C": ["333", "1"], "D": ["4", "4"]}
    GREEDY = {"A": "1", "B": "22", "C": "1", "D": "4"}

    def __init__(self):
        self.calls = []

    def generate(self, prompts, params):
        letters = [bytes(p).decode() for p in prompts]
        self.calls.append((letters, params.greedy))
        texts = [t for c in letters for t in ([self.GREEDY[c]] if params.greedy else self.SAMPLES[c])]
        prompts = [list(c.encode()) for c in letters for _ in range(params.n)]
        return RolloutOutput(*pad(prompts, left=True), *pad([list(t.encode()) for t in texts], left=False))


def scripted_run(tiny_model_dir, overrides, draws):
    cfg = load_config(None, [f"model.path={tiny_model_dir}", "data.train_batch_size=2", "actor.ppo_mini_batch_size=2",
                             "actor.ppo_micro_batch_size=4", "rollout.n=2", "data.max_response_length=3",
                             "algorithm.adv_estimator=remax", *overrides])
    data = [SimpleNamespace(prompt_ids=list(c.encode()), data_source="arith", ground_truth="1", extra_info={}, messages=c)
            for c in "ABCD"]
    return Run(cfg=cfg, run_dir=None, actor=ScriptedActor(), tokenizer=load_tokenizer(tiny_model_dir), kl_ctrl=None,
               rewards=in_process(lambda source, text, truth, extra=None: float(text == truth)), train_data=data,
               val_data=None, sampler=SimpleNamespace(next_batch=lambda: (0, draws.pop(0))),
               sampling=SamplingParams(max_new_tokens=3, n=2, temperature=0.7, top_k=5), val_sampling=None,
               total_steps=1)


def test_each_round_of_dynamic_sampling_gets_its_prompts_greedy_scores(tiny_model_dir):
    run = scripted_run(tiny_model_dir, ["algorithm.filter_groups.enable=true"], [[2, 3]])
    m = {}
    batch = rollout_and_score(run.rollouts, [run.train_data[0], run.train_data[1]], m)
    # round 1: A (uniform, dropped) and B; round 2: C and D (uniform, dropped); each round's prompts once greedy
    assert run.actor.calls == [(["A", "B"], False), (["A", "B"], True), (["C", "D"], False), (["C", "D"], True)]
    assert m["timing_s/gen_max"] > 0
    # kept: B samples "1", "22" (scores 1, 0; greedy "22": 0) and C samples "333", "1" (0, 1; greedy "1": 1)
    assert batch.response_text == ["1", "22", "333", "1"]
    assert batch.reward_baselines.tolist() == [0.0, 0.0, 1.0, 1.0]
    adv, _ = compute_advantages("remax", batch.token_level_scores, batch.response_mask, batch.group,
                                reward_baselines=batch.reward_baselines)
    # outcome on the last token, the return on every valid token: B [1 - 0], [0 - 0, 0 - 0]; C [0 - 1] x 3, [1 - 1]
    assert adv.tolist() == [[1, 0, 0], [0, 0, 0], [-1, -1, -1], [0, 0, 0]]


def test_the_greedy_score_takes_the_overlong_penalty_as_the_samples_do(tiny_model_dir):
    # limit 3, buffer 2: a 2-token response gets -0.5 (B's greedy "22": 0 - 0.5); a 1-token one nothing
    run = scripted_run(tiny_model_dir, ["reward.overlong_buffer.enable=true", "reward.overlong_buffer.len=2"], [])
    m = {}
    assert greedy_baselines(run.rollouts, [run.train_data[0], run.train_data[1]], m).tolist() == [1.0, -0.5]
    assert "reward/num_errors" not in m  # the counts are the samples'
    batch = rollout_and_score(run.rollouts, [run.train_data[1]], m)
    assert batch.reward_baselines.tolist() == [-0.5, -0.5]
    assert batch.token_level_scores.sum(-1).tolist() == [1.0, -0.5]  # the samples: "1", "22"


# ---------------------------------------------------------------- the loop on the embedded model

def tiny_config(run_dir, model_dir, *extra):
    write_prompts(run_dir, 8)
    return load_config(None, run_overrides(
        model_dir, run_dir, run_dir / "run", "data.train_batch_size=4", "data.max_response_length=6",
        "actor.ppo_mini_batch_size=4", "actor.ppo_micro_batch_size=16", "rollout.n=4", "actor.lr=1e-3",
        "actor.weight_decay=0", "trainer.total_training_steps=2", *extra))


def step_metrics(run_dir):
    return [x for x in read_metrics(run_dir / "run") if "critic/score/mean" in x]


def test_remax_step_advantage_is_score_minus_the_greedy_score(tmp_path, trained_tiny_model_dir):
    run = build_run(tiny_config(tmp_path / "step", trained_tiny_model_dir, "algorithm.adv_estimator=remax"))
    _, indices = run.sampler.next_batch()
    items = [run.train_data[i] for i in indices]
    expected = greedy_baselines(run.rollouts, items, {})  # [4] before the step: the same weights as the step's greedy pass
    m, batch = rl_step(run, items)
    assert torch.equal(batch.reward_baselines, expected.repeat_interleave(4))  # n = 4 rows per prompt
    assert m["critic/reward_baseline/mean"] == pytest.approx(float(expected.mean()))
    assert m["timing_s/gen_max"] > 0
    valid = batch.response_mask.bool()
    score = batch.token_level_rewards.sum(-1, keepdim=True).expand_as(valid)  # outcome reward: returns = score
    torch.testing.assert_close(batch.returns[valid], score[valid])
    torch.testing.assert_close(batch.advantages[valid], (score - batch.reward_baselines.unsqueeze(-1))[valid])
    assert batch.advantages[~valid].eq(0).all()
    run.actor.shutdown()
    run.rewards.close()

    run = build_run(tiny_config(tmp_path / "train", trained_tiny_model_dir, "algorithm.adv_estimator=remax"))
    assert train(run)["steps"] == 2
    steps = step_metrics(tmp_path / "train")
    assert len(steps) == 2 and all("critic/reward_baseline/mean" in s and "timing_s/gen_max" in s for s in steps)


def test_gpg_step_takes_gpg_advantages_and_the_plain_policy_gradient(tmp_path, trained_tiny_model_dir):
    """algorithm.name=gpg: the step's advantages are GPG's (alpha-scaled, not divided by the std) and its
    loss is GPG's -A log p, with no ratio: on-policy, PPO's loss would be mean(-A) whatever the log-probs."""
    run = build_run(tiny_config(tmp_path / "gpg", trained_tiny_model_dir, "algorithm.name=gpg"))
    start = copy.deepcopy(run.actor.policy)
    _, indices = run.sampler.next_batch()
    m, batch = rl_step(run, [run.train_data[i] for i in indices])
    mask = batch.response_mask.float()
    adv, _ = gpg_advantages(batch.token_level_rewards, mask, batch.group)
    assert torch.equal(batch.advantages, adv)
    assert adv.abs().max() > 0 and not torch.allclose(adv, grpo_advantages(batch.token_level_rewards, mask,
                                                                           batch.group)[0])
    log_prob, _ = compute_log_probs(start, batch, 16)  # [16, R] what the update's own forward saw
    gpg_loss = float((-adv * log_prob * mask).sum() / mask.sum())
    ppo_loss = float((-adv * mask).sum() / mask.sum())  # PPO-clip at ratio 1
    assert m["actor/pg_loss"] == pytest.approx(gpg_loss, rel=1e-4, abs=1e-6)
    assert abs(gpg_loss - ppo_loss) > 0.1
    assert m["actor/pg_clipfrac"] == 0 and m["actor/ppo_kl"] == 0
    moved = [n for n, p in run.actor.policy.named_parameters()
             if not torch.equal(dict(start.named_parameters())[n], p.detach())]
    assert moved  # weight decay 0: only the gradient of non-zero advantages moves them
    assert all(np.isfinite(v) for v in m.values() if isinstance(v, float))
    assert "critic/reward_baseline/mean" not in m and "timing_s/gen_max" not in m
    run.actor.shutdown()
    run.rewards.close()
