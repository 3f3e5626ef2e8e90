"""Advantage estimators: rewards -> advantages, as pure tensor functions.

Every estimator takes `token_level_rewards [B, T]`, `response_mask [B, T]`
and `index` (a group id per row: the prompt the row was sampled from) and
returns `(advantages [B, T], returns [B, T])`, zero outside the mask.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable, Hashable, Sequence

import torch


def grpo_advantages(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence[Hashable],
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO: each sequence's score against its group's mean (and std).

    score_i = sum_t rewards[i, t]; A_i = (score_i - mean_g) / (std_g + eps),
    with the unbiased std of the group; a group of one has mean 0 and std 1
    (its advantage is its score). A_i is broadcast over the response tokens.

    Example: scores [1, 0, 0] in one group: mean 1/3, std 0.5774, so
    A = [1.1547, -0.5773, -0.5773].
    """
    scores = token_level_rewards.sum(dim=-1)  # [B]
    groups: dict[Hashable, list[int]] = defaultdict(list)
    for row, gid in enumerate(index):
        groups[gid].append(row)
    mean = torch.zeros_like(scores)
    std = torch.ones_like(scores)
    for rows in groups.values():
        if len(rows) > 1:
            group_scores = scores[rows]
            mean[rows] = group_scores.mean()
            std[rows] = group_scores.std()  # unbiased (n - 1)
    centred = scores - mean
    adv = centred / (std + epsilon) if norm_adv_by_std_in_grpo else centred
    adv = adv.unsqueeze(-1) * response_mask  # [B, T]
    return adv, adv


ADV_ESTIMATORS: dict[str, Callable] = {"grpo": grpo_advantages}


def get_adv_estimator(name: str) -> Callable:
    try:
        return ADV_ESTIMATORS[name]
    except KeyError:
        raise ValueError(f"unknown advantage estimator '{name}'; supported: {', '.join(ADV_ESTIMATORS)}") from None
