"""DAPO's reward shaping and group filtering: pure tensor functions."""

from __future__ import annotations

from collections import defaultdict

import torch


def overlong_penalty(response_lengths: torch.Tensor, max_response_length: int, buffer_length: int,
                     penalty_factor: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment: [B] lengths -> [B] penalties <= 0.

    0 up to L - buffer tokens (L = max_response_length), then falling
    linearly to -penalty_factor at L:
        penalty = min(0, -(length - (L - buffer)) / buffer * penalty_factor)

    Example: L = 20, buffer 4: lengths [10, 16, 18, 20] -> [0, 0, -0.5, -1].
    """
    if not 0 < buffer_length <= max_response_length:
        raise ValueError(f"the overlong buffer must be 1..{max_response_length} tokens (the response limit), "
                         f"got {buffer_length}")
    exceed = response_lengths.float() - (max_response_length - buffer_length)
    return torch.clamp(-exceed / buffer_length * penalty_factor, max=0.0)


def rescale(scores: torch.Tensor, source: tuple[float, float], target: tuple[float, float]) -> torch.Tensor:
    """NeMo-RL's reward scaling (grpo.reward_scaling): [B] scores clamped to the source range, then mapped
    linearly onto the target range.

    Example: source (0, 1), target (-1, 1): scores [0, 0.25, 1, 3] -> [-1, -0.5, 1, 1].
    """
    lo, hi = source
    r = scores.clamp(min=lo, max=hi)
    return target[0] + (r - lo) / (hi - lo) * (target[1] - target[0])


def scale_truncated(scores: torch.Tensor, truncated: torch.Tensor, scale: float) -> torch.Tensor:
    """ProRL v2's "stop properly" penalty (NeMo-RL's grpo.reward_shaping.stop_properly_penalty_coef): [B]
    scores, [B] bool truncated (no EOS within the response limit) -> [B] scores, the truncated ones times
    `scale` (0: a truncated response earns nothing; 1: no penalty).

    Example: scores [1, 1, 0.5], truncated [F, T, T], scale 0.1 -> [1, 0.1, 0.05].
    """
    return torch.where(truncated.bool(), scores * scale, scores)


def varied_groups(metric: torch.Tensor, index) -> torch.Tensor:
    """DAPO's dynamic sampling: which rows to keep. [B] metric (a score per
    sequence), B group ids -> [B] bool: True for every row of a group whose
    metric is not the same for all its rows, and for groups of one (as verl).
    "Not the same" is exact inequality; verl's np.std(values) > 0 can also
    keep a group of equal floats through rounding (np.std([0.1] * 3) is
    1.4e-17), which this does not.

    Example: metric [1, 1, 0, 1, 0], index [0, 0, 1, 1, 2] -> [F, F, T, T, T].
    """
    ids = index.tolist() if isinstance(index, torch.Tensor) else list(index)
    if len(ids) != metric.shape[0]:
        raise ValueError(f"index has {len(ids)} group ids for {metric.shape[0]} rows")
    rows = defaultdict(list)
    for row, gid in enumerate(ids):
        rows[gid].append(row)
    keep = torch.zeros(metric.shape[0], dtype=torch.bool)
    for members in rows.values():
        values = metric[members]
        if len(members) == 1 or bool((values != values[0]).any()):
            keep[members] = True
    return keep


PF_PPO_METHODS = ("pow", "max_min", "max_random")


def pf_ppo_weights(scores: torch.Tensor, method: str = "pow", weight_pow: float = 2.0) -> torch.Tensor:
    """PF-PPO's sampling weights (policy filtration: verl's algorithm.use_pf_ppo):
    [B] sequence scores -> [B] weights > 0 that favour reliable rewards.

    pow: |score| ** weight_pow; max_min: 1 for the batch's highest and lowest
    score, else 0; max_random: 0.4 for the highest, else 0.1. Every weight
    gets 1e-8 so that all-zero weights still sample.

    Example: scores [1, -0.5, 0, 2], pow 2 -> [1, 0.25, 1e-8, 4];
    max_min -> [1e-8, 1, 1e-8, 1]; max_random -> [0.1, 0.1, 0.1, 0.4].
    """
    if method == "pow":
        weights = scores.abs().pow(weight_pow)
    elif method == "max_min":
        weights = ((scores == scores.max()) | (scores == scores.min())).float()
    elif method == "max_random":
        weights = torch.where(scores == scores.max(), 0.4, 0.1)
    else:
        raise ValueError(f"PF-PPO reweight method {method!r} is not one of: {', '.join(PF_PPO_METHODS)}")
    return torch.clamp(weights + 1e-8, min=1e-8)


def pf_ppo_resample(weights: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """[B] weights -> [B] row indices drawn with replacement in proportion to
    them: the batch the update trains on (as large as the one sampled)."""
    return torch.multinomial(weights, weights.shape[0], replacement=True, generator=generator)
