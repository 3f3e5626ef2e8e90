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
