"""Validation: sample for every held-out prompt, score, average per data
source (`validate`: the loop's, through loop.run_validation, and `posttrain eval`'s)."""

from __future__ import annotations

from collections import defaultdict

import torch

from posttrain.driver.env_side import EnvSide
from posttrain.driver.sampling import multi_turn_metrics, sample
from posttrain.rewards.pool import RewardPool
from posttrain.rewards.scoring import ScoreResult
from posttrain.rollout.base import SamplingParams
from posttrain.metrics.samples import val_sample_rows
from posttrain.rollout.multiturn import MultiTurnSettings
from posttrain.tools import ToolSet


@torch.no_grad()
def validate(engine, tokenizer, data, params: SamplingParams, rewards: RewardPool,
             batch_size: int | None = None, keep_samples: int = 0, tools: ToolSet | None = None,
             multi_turn: MultiTurnSettings | None = None, env: EnvSide | None = None, processor=None
             ) -> tuple[dict[str, float], list[dict]]:
    """Generate for every prompt of `data` (with `tools` or an `env`: multi-turn, rollout.multiturn), score
    (rewards.score_batch, and/or the environment's rewards), and average per data source.

    -> ({"val/score/mean", "val/<data_source>/score/mean", "val/response_length/mean"} (with tools also
        "val/multi_turn/*"; for a reward's dict return's other numbers "val/<key>/mean" and
        "val/<data_source>/<key>/mean"), the first `keep_samples` completions as sample rows)
    """
    per_source, lengths, errors, rows, trajs = defaultdict(list), [], 0, [], []
    extras = defaultdict(list)  # (data source or None, key) -> the values a dict return held beside the score
    items = [data[i] for i in range(len(data))]
    size = batch_size or len(items)
    for start in range(0, len(items), size):
        chunk = items[start:start + size]
        batch, turns = sample(engine, tokenizer, chunk, params, tools, multi_turn, env, processor)
        trajs += turns or []
        if env is not None and not env.needs_rule(turns):
            result = ScoreResult([0.0] * len(batch))
        else:
            result = rewards.score_batch(batch.data_source, batch.response_text, batch.ground_truth,
                                         batch.extra_info, prompts=[chunk[g].messages for g in batch.group.tolist()])
        if env is not None:
            result.scores = env.scores(torch.tensor(result.scores, dtype=torch.float32), turns).tolist()
        errors += sum(result.errors_by_source.values())  # errors + timeouts + crashes
        for source, score, extra in zip(batch.data_source, result.scores, result.extras or [{}] * len(batch)):
            per_source[source].append(score)
            for key, value in extra.items():
                extras[None, key].append(value)
                extras[source, key].append(value)
        if len(rows) < keep_samples:
            rows += val_sample_rows(batch, result.scores, tokenizer, keep_samples - len(rows))
        lengths.extend(batch.response_mask.sum(-1).tolist())
    all_scores = [s for scores in per_source.values() for s in scores]
    metrics = {"val/score/mean": sum(all_scores) / len(all_scores)}
    for source, scores in sorted(per_source.items()):
        metrics[f"val/{source}/score/mean"] = sum(scores) / len(scores)
    for (source, key), values in extras.items():
        metrics[f"val/{key}/mean" if source is None else f"val/{source}/{key}/mean"] = sum(values) / len(values)
    metrics["val/response_length/mean"] = sum(lengths) / len(lengths)
    metrics["val/reward_errors"] = float(errors)
    if trajs and env is not None:
        metrics.update(env.metrics(trajs, "val/env/"))
    elif trajs:
        metrics.update({"val/" + k: v for k, v in multi_turn_metrics(trajs).items()})
    return metrics, rows
