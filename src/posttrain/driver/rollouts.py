"""The step's first boxes: sample n responses per prompt (sampling.py) and score them (scoring.py), with DAPO's
dynamic sampling and ReMax's greedy baselines where the config asks for them.

`rollout_and_score(src, items, m)` is what `loop.rl_step` (and the rollouts-ahead thread, ahead.py) calls: a
batch of scored rollouts (scores [N], token_level_scores [N, R]). `src` is a `StepRollouts`: what the step's
sampling and scoring take (`Run.rollouts` makes one).
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, field
from typing import Callable

import torch

from posttrain.algorithms import place_on_last_token, varied_groups
from posttrain.driver.batch import RolloutBatch
from posttrain.driver.env_side import EnvSide
from posttrain.driver.sampling import multi_turn_metrics, sample
from posttrain.driver.scoring import Scoring
from posttrain.metrics.flops import ModelFlops
from posttrain.metrics.logger import timed
from posttrain.rollout.base import SamplingParams
from posttrain.rollout.multiturn import MultiTurnSettings
from posttrain.tools import ToolSet


@dataclass
class StepRollouts:
    """What the step's sampling and scoring take.

    actor: the generate verb's owner (a Worker or WorkerGroup); draw(): the next batch of prompt items (dynamic
    sampling draws more); filter_groups: algorithm.filter_groups; shared_prefill: how many samples share a
    prompt's prefill (FLOPs); greedy_baseline: the estimator wants one greedy response per prompt (ReMax);
    warned: warnings printed once a run."""

    actor: object
    tokenizer: object
    sampling: SamplingParams
    scoring: Scoring
    draw: Callable[[], list]
    filter_groups: object
    tools: ToolSet | None = None
    multi_turn: MultiTurnSettings | None = None
    env: EnvSide | None = None
    flops: ModelFlops | None = None
    shared_prefill: int = 1
    greedy_baseline: bool = False
    warned: set[str] = field(default_factory=set)
    processor: object = None  # a vision-language model's: prompts go with their images


def rollout_and_score(src: StepRollouts, items, m: dict) -> RolloutBatch:
    """The step's scored rollouts. With algorithm.filter_groups.enable (DAPO's
    dynamic sampling) groups whose samples all got the same score carry no
    signal: they are dropped and more prompts are drawn until len(items)
    groups differ, or max_num_gen_batches rounds were drawn; then the batch is
    filled with dropped groups (so its size never changes) and a warning says so.
    Metrics: train/num_gen_batches, train/kept_groups_ratio."""
    fg = src.filter_groups
    if not fg.enable:
        return generate_and_score(src, items, m)
    wanted, varied, uniform, rounds = len(items), [], [], 0
    while True:
        rounds += 1
        batch = generate_and_score(src, items, m)
        keep = varied_groups(filter_metric(batch, fg.metric), batch.group)  # [N] bool
        varied.append(batch.select(torch.nonzero(keep).squeeze(-1)))
        uniform.append(batch.select(torch.nonzero(~keep).squeeze(-1)))
        found = sum(len(set(b.group.tolist())) for b in varied)
        if found >= wanted or (fg.max_num_gen_batches > 0 and rounds >= fg.max_num_gen_batches):
            break
        items = src.draw()
    m["train/num_gen_batches"] = float(rounds)
    m["train/kept_groups_ratio"] = min(found, wanted) / wanted
    if found < wanted and "filter_groups" not in src.warned:
        src.warned.add("filter_groups")
        print(f"posttrain: warning: dynamic sampling found {found} of {wanted} prompts with differing scores in "
              f"{rounds} rounds (algorithm.filter_groups.max_num_gen_batches={fg.max_num_gen_batches}); the batch "
              "is filled with uniform groups, which carry no group-relative signal. Raise the cap, or use data "
              "the model solves sometimes but not always", file=sys.stderr)
    parts = [b for b in varied + uniform if len(b)]
    batch = RolloutBatch.concat(parts, src.tokenizer.pad_token_id)
    return batch.select(torch.nonzero(batch.group < wanted).squeeze(-1))


def filter_metric(batch: RolloutBatch, metric: str) -> torch.Tensor:
    """[N] what dynamic sampling compares within a group: acc/score are the
    reward function's scores, seq_reward/seq_final_reward the shaped ones."""
    return batch.scores if metric in ("acc", "score") else batch.token_level_scores.sum(-1)


def generate_and_score(src: StepRollouts, items, m: dict) -> RolloutBatch:
    """Sample n responses per prompt and score them (scores [N] and
    token_level_scores [N, R]); timings and reward counts add up in `m`."""
    with timed(m, "gen"):
        batch, trajectories = sample(src.actor, src.tokenizer, items, src.sampling, src.tools, src.multi_turn,
                                     src.env, src.processor)
    if src.flops is not None:  # every round of dynamic sampling counts toward perf/mfu/rollout
        prompt_lengths = batch.attention_mask[:, :batch.prompt_width].sum(-1)
        flops = src.flops.rollout(prompt_lengths, batch.response_mask.sum(-1), src.shared_prefill)
        m["perf/flops/rollout"] = m.get("perf/flops/rollout", 0.0) + flops
    if trajectories and src.env is not None:  # conversations with an environment or agent runs
        for key, value in src.env.metrics(trajectories).items():
            m[key] = m.get(key, 0.0) + value if key.startswith("env/num_") else value
    elif trajectories:  # tool use: the metrics count it
        for key, value in multi_turn_metrics(trajectories).items():
            m[key] = m.get(key, 0.0) + value if key == "multi_turn/tool_errors" else value
    with timed(m, "reward"):
        batch.scores, shaped, reward_metrics = src.scoring.score(
            batch, [items[g].messages for g in batch.group.tolist()], trajectories)
        # an empty response (only EOS or special tokens) scored 0 unjudged, so it carries no signal: a zero mask
        # gives it no reward token (place_on_last_token), no advantage (estimators multiply by the mask) and
        # no loss (agg_loss leaves fully masked rows out of its means)
        empty = torch.tensor([text == "" for text in batch.response_text], dtype=torch.bool)
        batch.response_mask = batch.response_mask.masked_fill(empty.unsqueeze(-1), 0)
        reward_metrics["response/empty_ratio"] = float(empty.sum()) / max(len(empty), 1)
        batch.token_level_scores = place_on_last_token(shaped, batch.response_mask)
    for key, value in reward_metrics.items():
        m[key] = m.get(key, 0.0) + value if key.endswith(("num_errors", "num_timeouts", "num_crashes")) else value
    if src.greedy_baseline:  # per round, so dynamic sampling's rows keep theirs
        batch.reward_baselines = greedy_baselines(src, items, m)[batch.group]  # [N]
    return batch


def greedy_baselines(src: StepRollouts, items, m: dict) -> torch.Tensor:
    """ReMax's baselines: one greedy response per prompt (as long as the
    samples may be; with tools, a greedy conversation), scored as the samples are: the reward function, plus
    DAPO's overlong penalty where it is on. -> [len(items)] (verl: gen_max)."""
    greedy = dataclasses.replace(src.sampling, n=1, do_sample=False, temperature=0.0, top_p=1.0, top_k=-1,
                                 logprobs=False)
    with timed(m, "gen_max"):  # with tools, a greedy conversation, as the samples are conversations
        batch, trajectories = sample(src.actor, src.tokenizer, items, greedy, src.tools, src.multi_turn, src.env,
                                     src.processor)
    with timed(m, "reward"):  # failures printed, not counted
        _, scores, _ = src.scoring.score(batch, [it.messages for it in items], trajectories)
    return scores
