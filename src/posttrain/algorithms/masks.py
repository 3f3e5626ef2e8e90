"""A row's score on its tokens, and the rows a response mask leaves out: pure tensor functions."""

from __future__ import annotations

import torch


def place_on_last_token(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """scores [N], response_mask [N, R] -> [N, R], zero except at each row's
    last valid token (an empty response keeps nothing). The mask may have
    holes (a multi-turn response: tool messages between generated turns):
    the last 1 counts, not the count of 1s.

    Example: scores [1, 2], mask [[1, 1, 0], [0, 0, 0]] -> [[0, 1, 0], [0, 0, 0]].
    """
    mask = response_mask.bool()
    width = mask.shape[-1]
    last = width - 1 - mask.flip(-1).int().argmax(-1)  # [N], the last 1 of each row
    out = torch.zeros(response_mask.shape, dtype=torch.float32)
    rows = torch.nonzero(mask.any(-1)).squeeze(-1)
    out[rows, last[rows]] = scores[rows]
    return out


def truncated_rows(truncated: torch.Tensor | None, response_mask: torch.Tensor,
                   max_response_length: int) -> torch.Tensor:
    """[N] bool: the responses that ran out of tokens before an EOS, as the
    rollout engine reported (`truncated` [N]; an engine that does not say,
    None: those whose response_mask [N, R] counts max_response_length tokens).

    Example: truncated None, mask [[1, 1, 1], [1, 0, 0]], limit 3 -> [True, False].
    """
    if truncated is not None:
        return truncated.bool()
    return response_mask.sum(-1) >= max_response_length
