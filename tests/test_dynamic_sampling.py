"""DAPO's dynamic sampling and overlong shaping in the loop, and batch
concatenation, on literal rollouts from a scripted engine."""

from types import SimpleNamespace

import pytest
import torch

from posttrain.driver.batch import RolloutBatch
from posttrain.config import load_config
from posttrain.driver.rollouts import rollout_and_score
from posttrain.driver.run import Run
from posttrain.models import load_tokenizer
from posttrain.rewards.pool import in_process
from posttrain.rollout.base import RolloutOutput, SamplingParams

from helpers import pad

PAD = 0  # helpers.pad's id


class ScriptedActor:
    """generate() answers each prompt (bytes of a letter) with the texts of SCRIPT[letter]."""

    SCRIPT = {"A": ["1", "1"], "B": ["1", "22"], "C": ["333", "1"], "D": ["4", "4"], "E": ["1", "55"]}

    def __init__(self):
        self.calls = []

    def generate(self, prompts, params):
        letters = [bytes(p).decode() for p in prompts]
        self.calls.append(letters)
        texts = [t for letter in letters for t in self.SCRIPT[letter]]
        p_ids, p_mask = pad([list(letter.encode()) for letter in letters for _ in range(params.n)], left=True)
        r_ids, r_mask = pad([list(t.encode()) for t in texts], left=False)
        return RolloutOutput(p_ids, p_mask, r_ids, r_mask)


class ListSampler:
    def __init__(self, batches):
        self.batches = list(batches)

    def next_batch(self):
        return 0, self.batches.pop(0)


def make_run(tiny_model_dir, overrides, draws):
    cfg = load_config(None, [f"model.path={tiny_model_dir}", "data.train_batch_size=2", "actor.ppo_mini_batch_size=2",
                             "actor.ppo_micro_batch_size=4", "rollout.n=2", "data.max_response_length=3", *overrides])
    letters = "ABCDE"
    data = [SimpleNamespace(prompt_ids=list(c.encode()), data_source="arith", ground_truth="1", extra_info={}, messages=c)
            for c in letters]
    return Run(cfg=cfg, run_dir=None, actor=ScriptedActor(), tokenizer=load_tokenizer(tiny_model_dir), kl_ctrl=None,
               rewards=in_process(lambda source, text, truth, extra=None: float(text == truth)), train_data=data,
               val_data=None, sampler=ListSampler(draws), sampling=SamplingParams(max_new_tokens=3, n=2),
               val_sampling=None, total_steps=1)


def texts_by_group(batch):
    out = {}
    for g, t in zip(batch.group.tolist(), batch.response_text):
        out.setdefault(g, []).append(t)
    return out


def test_without_filtering_the_batch_is_the_rollout(tiny_model_dir):
    run = make_run(tiny_model_dir, [], [])
    m = {}
    batch = rollout_and_score(run.rollouts, [run.train_data[0], run.train_data[1]], m)
    assert texts_by_group(batch) == {0: ["1", "1"], 1: ["1", "22"]}
    assert batch.scores.tolist() == [1.0, 1.0, 1.0, 0.0]
    assert "train/num_gen_batches" not in m


def test_uniform_groups_are_dropped_and_more_prompts_drawn(tiny_model_dir, capsys):
    run = make_run(tiny_model_dir, ["algorithm.filter_groups.enable=true"], [[2, 3], [4, 0]])
    m = {}
    batch = rollout_and_score(run.rollouts, [run.train_data[0], run.train_data[1]], m)  # A uniform, B varied
    # round 2 draws C (varied) and D (uniform): two varied groups, B then C, renumbered 0 and 1
    assert run.actor.calls == [["A", "B"], ["C", "D"]]
    assert texts_by_group(batch) == {0: ["1", "22"], 1: ["333", "1"]}
    assert batch.scores.tolist() == [1.0, 0.0, 0.0, 1.0]
    # re-padded to the widest response (3 tokens), the token-level score on each last token
    assert batch.responses.shape == (4, 3) and batch.response_mask.sum(-1).tolist() == [1, 2, 3, 1]
    assert batch.token_level_scores.tolist() == [[1, 0, 0], [0, 0, 0], [0, 0, 0], [1, 0, 0]]
    assert torch.equal(batch.position_ids, (batch.attention_mask.cumsum(-1) - 1).clamp(min=0))
    assert (m["train/num_gen_batches"], m["train/kept_groups_ratio"]) == (2.0, 1.0)
    assert "warning" not in capsys.readouterr().err


def test_the_cap_fills_the_batch_with_dropped_groups_and_warns_once(tiny_model_dir, capsys):
    run = make_run(tiny_model_dir, ["algorithm.filter_groups.enable=true",
                                    "algorithm.filter_groups.max_num_gen_batches=2"], [[3, 0], [3, 0]])
    m = {}
    batch = rollout_and_score(run.rollouts, [run.train_data[0], run.train_data[1]], m)  # A uniform, B varied; D, A uniform
    assert texts_by_group(batch) == {0: ["1", "22"], 1: ["1", "1"]}  # B, then the first dropped group (A)
    assert (m["train/num_gen_batches"], m["train/kept_groups_ratio"]) == (2.0, 0.5)
    err = capsys.readouterr().err
    assert "dynamic sampling found 1 of 2 prompts with differing scores in 2 rounds" in err
    rollout_and_score(run.rollouts, [run.train_data[0], run.train_data[3]], {})
    assert "dynamic sampling" not in capsys.readouterr().err  # once per run


def test_overlong_shaping_lowers_long_responses_and_seq_reward_filters_on_it(tiny_model_dir):
    # limit 3 tokens, buffer 2: length 1 -> 0, length 2 -> -0.5, length 3 -> -1.0 (times the factor 1)
    run = make_run(tiny_model_dir, ["reward.overlong_buffer.enable=true", "reward.overlong_buffer.len=2"], [])
    m = {}
    batch = rollout_and_score(run.rollouts, [run.train_data[1], run.train_data[2]], m)  # "1", "22" | "333", "1"
    assert batch.scores.tolist() == [1.0, 0.0, 0.0, 1.0]  # the reward function's own
    assert batch.token_level_scores.sum(-1).tolist() == [1.0, -0.5, -1.0, 1.0]
    assert m["reward/overlong_penalty/mean"] == pytest.approx(-1.5 / 4)
    assert m["reward/overlong_ratio"] == 0.5
    # verl's DAPO reward manager counts back from reward_kwargs.max_resp_len: 4 here, so the buffer is
    # lengths 3..4 -> length 2: 0, length 3: -0.5
    run4 = make_run(tiny_model_dir, ["reward.overlong_buffer.enable=true", "reward.overlong_buffer.len=2",
                                     "reward_model.reward_kwargs.max_resp_len=4"], [])
    batch = rollout_and_score(run4.rollouts, [run4.train_data[1], run4.train_data[2]], {})
    assert batch.token_level_scores.sum(-1).tolist() == [1.0, 0.0, -0.5, 1.0]
    # D answers "4", "4": the same length and score -> uniform under both metrics; E "1", "55": varied
    run = make_run(tiny_model_dir, ["reward.overlong_buffer.enable=true", "reward.overlong_buffer.len=2",
                                    "algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=seq_reward"],
                   [[1, 2]])
    m = {}
    batch = rollout_and_score(run.rollouts, [run.train_data[3], run.train_data[4]], m)
    assert texts_by_group(batch) == {0: ["1", "55"], 1: ["1", "22"]}
    assert m["train/num_gen_batches"] == 2.0


def test_concat_repads_prompts_left_and_responses_right():
    def batch(prompts, responses, groups):
        p, pm = pad(prompts, left=True)
        r, rm = pad(responses, left=False)
        out = RolloutBatch.from_rollout(RolloutOutput(p, pm, r, rm), 1, ["s"] * len(prompts), ["t"] * len(prompts),
                                        [{}] * len(prompts), [str(x) for x in responses])
        out.group = torch.tensor(groups)
        out.scores = torch.arange(len(prompts), dtype=torch.float32)
        return out

    a = batch([[5, 6, 7], [8]], [[9], [9]], [3, 3])
    b = batch([[4, 4]], [[1, 2, 3]], [0])
    c = RolloutBatch.concat([a, b], PAD)
    assert c.input_ids.tolist() == [[5, 6, 7, 9, 0, 0], [0, 0, 8, 9, 0, 0], [0, 4, 4, 1, 2, 3]]
    assert c.attention_mask.tolist() == [[1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 0, 0], [0, 1, 1, 1, 1, 1]]
    assert c.position_ids.tolist() == [[0, 1, 2, 3, 3, 3], [0, 0, 0, 1, 1, 1], [0, 0, 1, 2, 3, 4]]
    assert c.responses.tolist() == [[9, 0, 0], [9, 0, 0], [1, 2, 3]]
    assert c.response_mask.tolist() == [[1, 0, 0], [1, 0, 0], [1, 1, 1]]
    assert c.group.tolist() == [0, 0, 1] and c.scores.tolist() == [0.0, 1.0, 0.0]
    assert c.response_text == ["[9]", "[9]", "[1, 2, 3]"] and c.old_log_probs is None


def test_truncated_scale_scales_only_the_responses_that_hit_the_limit(tiny_model_dir):
    """ProRL v2's stop-properly penalty (reward.truncated_scale): limit 3 tokens, every response scored 1; "333"
    ran into the limit without an EOS, so it keeps a quarter; the reward function's own scores stay as they were."""
    run = make_run(tiny_model_dir, ["reward.truncated_scale=0.25"], [])
    run.rewards = in_process(lambda source, text, truth, extra=None: 1.0)
    m = {}
    batch = rollout_and_score(run.rollouts, [run.train_data[1], run.train_data[2]], m)  # "1", "22" | "333", "1"
    assert batch.scores.tolist() == [1.0, 1.0, 1.0, 1.0]
    assert batch.token_level_scores.sum(-1).tolist() == [1.0, 1.0, 0.25, 1.0]
    assert m["reward/truncated_ratio"] == 0.25 and "reward/overlong_penalty/mean" not in m
    for bad, said in (("reward.truncated_scale=1.5", "reward.truncated_scale must be in 0..1"),
                      ("reward.overlong_buffer.enable=true", "reward.truncated_scale and reward.overlong_buffer.enable"
                                                             "=true both shape the scores of long responses")):
        with pytest.raises(Exception, match=said):
            make_run(tiny_model_dir, ["reward.truncated_scale=0.25", bad], [])


def test_reward_scaling_clamps_then_maps_the_scores_before_other_shaping(tiny_model_dir):
    """reward.scaling (NeMo-RL's grpo.reward_scaling): source [0, 1] -> target [-1, 1], then ProRL's truncated
    scale: "1" -> 1, "22" -> 1, "333" (truncated) -> 1 * 0.5; scores 2.0 clamp to 1 first."""
    from posttrain.algorithms import rescale

    assert rescale(torch.tensor([0.0, 0.25, 1.0, 3.0]), (0.0, 1.0), (-1.0, 1.0)).tolist() == [-1.0, -0.5, 1.0, 1.0]
    run = make_run(tiny_model_dir, ["reward.scaling.enable=true", "reward.scaling.target_min=-1",
                                    "reward.truncated_scale=0.5"], [])
    run.rewards = in_process(lambda source, text, truth, extra=None: {"1": 0.0, "22": 0.5}.get(text, 2.0))
    m = {}
    batch = rollout_and_score(run.rollouts, [run.train_data[1], run.train_data[2]], m)  # "1", "22" | "333", "1"
    assert batch.scores.tolist() == [0.0, 0.5, 2.0, 0.0]  # the reward function's own
    assert batch.token_level_scores.sum(-1).tolist() == [-1.0, 0.0, 0.5, -1.0]
    assert m["reward/scaling_clipped_ratio"] == 0.25
    with pytest.raises(Exception, match="reward.scaling.source_max=0.0 must be above reward.scaling.source_min=0.0"):
        make_run(tiny_model_dir, ["reward.scaling.enable=true", "reward.scaling.source_max=0"], [])
