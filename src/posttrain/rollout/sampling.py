"""Sampling a token from a decoding step's logits: top-k/top-p filtering and exact CDF inversion with a given
uniform number per row (so a seed fixes the samples whatever the batching), with the chosen token's log-prob."""

from __future__ import annotations

import torch

from posttrain.rollout.base import SamplingParams


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask out (set to -inf) tokens outside top-k and outside the top-p
    nucleus. logits: [N, V]. The most likely token always survives."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]  # [N, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the mass before it already exceeds top_p.
        drop_sorted = (probs.cumsum(dim=-1) - probs) > top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_next(logits: torch.Tensor, params: SamplingParams, uniform: torch.Tensor | None) -> torch.Tensor:
    """logits [N, V], uniform [N] in [0, 1) -> next token ids [N]: the token
    whose CDF interval holds the uniform number (exact sampling; None: greedy)."""
    return next_tokens(logits, params, uniform, log_probs=False)[0]


def next_tokens(logits: torch.Tensor, params: SamplingParams, uniform: torch.Tensor | None, log_probs: bool
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """sample_next, and with `log_probs` each chosen token's log-probability [N] under the distribution at the
    sampling temperature (before top-k/top-p: the one the trainer's passes compute). Without top-k/top-p the
    sampling distribution is the exp of that same log-softmax: one pass over the vocabulary serves both."""
    if params.greedy:
        token = logits.argmax(dim=-1)
        if not log_probs:
            return token, None
        return token, torch.log_softmax(logits.float(), -1).gather(-1, token[:, None]).squeeze(-1)
    # [N, V] float32 passes over the vocabulary, each as many bytes as the step's weights at a real model's shape:
    # the scaling and the running sum are done in place where the tensor is already a copy
    scaled = logits.float().div_(params.temperature) if logits.dtype != torch.float32 else logits / params.temperature
    log_p = torch.log_softmax(scaled, dim=-1) if log_probs else None  # [N, V]
    kept = filter_logits(scaled, params.top_k, params.top_p)
    probs = log_p.exp() if log_p is not None and kept is scaled else torch.softmax(kept, dim=-1)  # [N, V]
    cdf = probs.cumsum_(dim=-1)
    total = cdf[:, -1:]
    # the point u * total, kept below the total where rounding would put it on it: then it falls in the
    # interval of the last token with mass (past it the CDF is flat), never past the vocabulary
    point = torch.minimum(uniform[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    token = torch.searchsorted(cdf, point.contiguous(), right=True).squeeze(-1)
    return token, (log_p.gather(-1, token[:, None]).squeeze(-1) if log_p is not None else None)
