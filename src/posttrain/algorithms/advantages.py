"""Advantage estimators: rewards -> advantages, as pure tensor functions.

Every estimator takes `token_level_rewards [B, T]`, `response_mask [B, T]`
and `index` (a group id per row: the prompt the row was sampled from) and
returns `(advantages [B, T], returns [B, T])`, zero outside the mask.
`ADV_ESTIMATORS` picks one by the name used in configs (verl's names).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable, Hashable, Sequence

import torch


def _group_rows(index: Sequence[Hashable] | torch.Tensor, batch_size: int) -> list[list[int]]:
    """Row numbers of each group, in order of first appearance."""
    if isinstance(index, torch.Tensor):
        # 0-d tensors hash by identity, so every row would be its own group
        index = index.tolist()
    if len(index) != batch_size:
        raise ValueError(f"index has {len(index)} group ids for a batch of {batch_size} rows")
    groups: dict[Hashable, list[int]] = defaultdict(list)
    for row, gid in enumerate(index):
        groups[gid].append(row)
    return list(groups.values())


def grpo_advantages(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence[Hashable] | torch.Tensor,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO (outcome reward): each sequence's score against its group.

    Args:
        token_level_rewards: [B, T] rewards per response token (an outcome
            reward sits on one token; the row sum is the sequence's score).
        response_mask: [B, T] 1 on response tokens, 0 on padding.
        index: B hashable group ids (list, numpy array or 1-d tensor);
            rows with equal ids were sampled from the same prompt.
        epsilon: added to the std so an all-equal group divides by epsilon.
        norm_adv_by_std_in_grpo: False gives Dr. GRPO's score - mean.

    Returns:
        (advantages [B, T], returns [B, T]); the two are the same tensor,
        as in verl, since GRPO has no value function to regress.

    score_i = sum_t rewards[i, t]; A_i = (score_i - mean_g) / (std_g + eps)
    with the unbiased (n - 1) std of the group. A group of one has mean 0
    and std 1, so its advantage is its score (there is nothing to compare
    it with, and std of one sample would be NaN). A_i is broadcast over the
    row and zeroed outside the mask.

    Example: scores [1, 0, 0] in one group: mean 1/3, std 0.5774, so
    A = [1.1547, -0.5774, -0.5774] on every response token.
    """
    with torch.no_grad():  # advantages are targets, never differentiated
        scores = token_level_rewards.sum(dim=-1)  # [B]
        mean = torch.zeros_like(scores)  # [B], the group's mean on each row
        std = torch.ones_like(scores)  # [B]
        for rows in _group_rows(index, scores.shape[0]):
            if len(rows) > 1:
                group = scores[rows]
                mean[rows] = group.mean()
                std[rows] = group.std()  # unbiased, as torch.std and verl
        centred = scores - mean
        adv = centred / (std + epsilon) if norm_adv_by_std_in_grpo else centred
        adv = adv.unsqueeze(-1) * response_mask  # [B, T]
    return adv, adv


ADV_ESTIMATORS: dict[str, Callable] = {"grpo": grpo_advantages}


def get_adv_estimator(name: str) -> Callable:
    """The estimator registered as `name`; ValueError lists the known ones."""
    try:
        return ADV_ESTIMATORS[name]
    except KeyError:
        raise ValueError(
            f"unknown advantage estimator '{name}'; supported: {', '.join(ADV_ESTIMATORS)}"
        ) from None
