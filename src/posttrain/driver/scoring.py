"""Scoring: the reward functions' scores of a batch's responses, reshaped as reward.* asks (rescaling, DAPO's
overlong penalty, ProRL v2's truncated scale), GDPO's reward components, the reward errors shown once a run.

`Scoring` holds what it takes; the step (rollouts.py) and ReMax's greedy baselines score through it."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import torch

from posttrain.algorithms import overlong_penalty, rescale, scale_truncated, truncated_rows
from posttrain.driver.batch import RolloutBatch
from posttrain.driver.env_side import EnvSide
from posttrain.errors import RewardError
from posttrain.text.redact import redact_text


@dataclass
class Scoring:
    """What scoring takes: the reward functions (`rewards.score_batch`), the config's reward section (`reward`:
    scaling, overlong_buffer, truncated_scale), data.max_response_length, the other side of a conversation
    (`env`, which may score alone), and the reward error messages shown so far (`shown`, five at most a run)."""

    rewards: object
    reward: object
    max_response_length: int
    env: EnvSide | None = None
    shown: set[str] = field(default_factory=set)

    def score(self, batch: RolloutBatch, prompts: list, trajectories) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """-> ([N] the scores: the reward function's (unless the environment scores alone) with the environment's
        on top, [N] those shaped for the advantages (shape_scores), the reward's metrics). prompts: each row's
        prompt messages; trajectories: the conversations (or None)."""
        if self.env is not None and not self.env.needs_rule(trajectories):  # scored by the environment alone
            scores, metrics = torch.zeros(len(batch)), {}
        else:
            scores, metrics = score_responses(self, batch, prompts)
        if self.env is not None:
            scores = self.env.scores(scores, trajectories)
        return scores, shape_scores(self, batch, scores, metrics), metrics


def shape_scores(s: Scoring, batch: RolloutBatch, scores: torch.Tensor, metrics: dict | None = None) -> torch.Tensor:
    """[N] scores -> [N] the scores the advantages see: rescaled (reward.scaling), then DAPO's soft penalty for
    responses that run into the length limit (reward.overlong_buffer), or ProRL v2's scale for truncated ones
    (reward.truncated_scale); its figures into `metrics` (when given)."""
    rw = s.reward
    scores = scaled(rw.scaling, scores, metrics)
    ob = rw.overlong_buffer
    if ob.enable:
        penalty = overlong_penalty(batch.response_mask.sum(-1), ob.max_resp_len, ob.len, ob.penalty_factor)
        scores = scores + penalty
        if ob.log and metrics is not None:
            metrics["reward/overlong_penalty/mean"] = float(penalty.mean())
            metrics["reward/overlong_ratio"] = float((penalty < 0).float().mean())
    if rw.truncated_scale is not None:
        cut = truncated_rows(batch.truncated, batch.response_mask, s.max_response_length)  # [N]
        scores = scale_truncated(scores, cut, rw.truncated_scale)
        if metrics is not None:
            metrics["reward/truncated_ratio"] = float(cut.float().mean())
    return scores


def score_responses(s: Scoring, batch: RolloutBatch, prompts: list) -> tuple[torch.Tensor, dict[str, float]]:
    """-> scores [N] (0 where the reward function failed, or the response is
    empty), metrics: failures by kind, and by data source where there are any
    (and a reward model's mean score). prompts: each row's prompt messages."""
    result = s.rewards.score_batch(batch.data_source, batch.response_text, batch.ground_truth, batch.extra_info,
                                     prompts=prompts)
    batch.reward_extras = list(result.extras) if result.extras else [{} for _ in range(len(batch))]
    report_reward_errors(s.shown, result)
    metrics = {"reward/num_errors": float(result.num_errors), "reward/num_timeouts": float(result.num_timeouts),
               "reward/num_crashes": float(result.num_crashes)}
    if result.model_scores:
        metrics["reward/rm_score/mean"] = sum(result.model_scores) / len(result.model_scores)
    for key, mean in result.extra_means().items():  # a dict return's other numbers (verl's acc, ...)
        metrics[f"reward/{key}/mean"] = mean
    for source, count in sorted(result.errors_by_source.items()):  # errors + timeouts + crashes
        metrics[f"reward/{source}/num_errors"] = float(count)
    return torch.tensor(result.scores, dtype=torch.float32), metrics


def scaled(sc, scores: torch.Tensor, metrics: dict | None = None) -> torch.Tensor:
    """reward.scaling (`sc`) applied to [N] or [N, K] scores; the share clamped into `metrics` (when given)."""
    if not sc.enable:
        return scores
    if metrics is not None:
        metrics["reward/scaling_clipped_ratio"] = float(((scores < sc.source_min) | (scores > sc.source_max))
                                                        .float().mean())
    return rescale(scores, (sc.source_min, sc.source_max), (sc.target_min, sc.target_max))


def reward_components(batch: RolloutBatch, keys: list[str]) -> tuple[torch.Tensor, list[str]]:
    """GDPO's [N, K] reward components: the numbers `keys` of each row's reward_extras (a row without one: 0),
    or, with no keys, every number any row's reward returned, sorted by name. -> (components, their names)."""
    returned = {k for extra in batch.reward_extras for k in extra}
    names = list(keys) or sorted(returned)
    fix = ("score with a reward that returns its parts, {'score': ..., 'correctness': ..., 'format': ...} "
           "(e.g. reward.data_source=math_multi_reward), or use grpo")
    if len(names) < 2:
        raise RewardError(f"algorithm.adv_estimator=gdpo normalizes several rewards one by one, but the reward "
                          f"function returned {len(names)} beside its score ({', '.join(names) or 'none'}); {fix}")
    missing = [k for k in names if k not in returned]
    if missing:
        raise RewardError(f"algorithm.gdpo.reward_keys names {', '.join(missing)}, which no response's reward "
                          f"returned (it returned: {', '.join(sorted(returned)) or 'none'}); fix the keys, or {fix}")
    rows = [[float(extra.get(k, 0.0)) for k in names] for extra in batch.reward_extras]
    return torch.tensor(rows, dtype=torch.float32).reshape(len(batch), len(names)), names


def report_reward_errors(shown: set[str], result) -> None:
    """Print each distinct reward error message once per run."""
    for msg in result.messages:
        if msg not in shown and len(shown) < 5:
            shown.add(msg)
            # an exception's text may quote a URL with a password, or a token the function was handed
            print(redact_text(f"posttrain: warning: reward function failed (scored 0): {msg}"), file=sys.stderr)
