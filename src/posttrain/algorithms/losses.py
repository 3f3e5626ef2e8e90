"""Policy losses and their aggregation over tokens: pure tensor functions."""

from __future__ import annotations

from typing import Callable

import torch

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of x over mask == 1; 0 when the mask is empty (never NaN)."""
    return (x * mask).sum() / mask.sum().clamp(min=1)


def agg_loss(loss_mat: torch.Tensor, loss_mask: torch.Tensor, loss_agg_mode: str) -> torch.Tensor:
    """[B, T] per-token losses -> scalar.

    token-mean:              sum over valid tokens / number of valid tokens
    seq-mean-token-sum:      mean over sequences of each sequence's token sum
    seq-mean-token-mean:     mean over sequences of each sequence's token mean
    seq-mean-token-sum-norm: sum over valid tokens / T (Dr. GRPO: a constant
                             normaliser, T = the padded response length), / B

    Sequences without valid tokens are left out of the sequence means, so a
    fully masked row contributes nothing (and an all-masked batch gives 0).

    Example: loss [[1, 2, 3], [4, 5, 6]], mask [[1, 1, 0], [1, 0, 0]]:
    token-mean 7/3; seq-mean-token-sum (3 + 4)/2 = 3.5;
    seq-mean-token-mean (1.5 + 4)/2 = 2.75; seq-mean-token-sum-norm 7/3/2 = 7/6.
    """
    mask = loss_mask.to(loss_mat.dtype)
    if loss_agg_mode == "token-mean":
        return masked_mean(loss_mat, mask)
    seq_valid = (mask.sum(-1) > 0).to(loss_mat.dtype)  # [B]
    num_seqs = seq_valid.sum().clamp(min=1)
    if loss_agg_mode == "seq-mean-token-sum":
        return (loss_mat * mask).sum(-1).sum() / num_seqs
    if loss_agg_mode == "seq-mean-token-mean":
        seq_means = (loss_mat * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        return (seq_means * seq_valid).sum() / num_seqs
    if loss_agg_mode == "seq-mean-token-sum-norm":
        return (loss_mat * mask).sum() / max(loss_mat.shape[-1], 1) / max(loss_mat.shape[0], 1)
    raise ValueError(f"unknown loss_agg_mode '{loss_agg_mode}'; supported: {', '.join(LOSS_AGG_MODES)}")


def ppo_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
) -> dict[str, torch.Tensor]:
    """PPO's clipped surrogate with dual clip, all inputs [B, T].

    r = exp(log_prob - old_log_prob) (the log-ratio clamped to [-20, 20]);
    per token: max(-A r, -A clip(r, 1 - low, 1 + high)), and for A < 0 at
    most -A * clip_ratio_c (dual clip, Ye et al. 2020).

    Returns pg_loss (scalar, with grad) and, detached: pg_clipfrac (share of
    tokens where the clipped term won), ppo_kl (mean old - new log-prob),
    pg_clipfrac_lower (share where the dual clip bound).

    Example: A = 1, r = 1.5, clip 0.2: max(-1.5, -1.2) = -1.2 (clipped, no grad).
    """
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1, got {clip_ratio_c}")
    mask = response_mask.to(log_prob.dtype)
    log_ratio = torch.clamp(log_prob - old_log_prob, -20.0, 20.0)
    ratio = torch.exp(log_ratio)
    loss1 = -advantages * ratio
    loss2 = -advantages * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    clipped = torch.maximum(loss1, loss2)
    loss3 = -advantages * clip_ratio_c
    dual = torch.minimum(loss3, clipped)
    per_token = torch.where(advantages < 0, dual, clipped)
    with torch.no_grad():
        clipfrac = masked_mean((loss2 > loss1).to(mask.dtype), mask)
        clipfrac_lower = masked_mean(((clipped > loss3) & (advantages < 0)).to(mask.dtype), mask)
        ppo_kl = masked_mean(-log_ratio, mask)
    return {
        "pg_loss": agg_loss(per_token, mask, loss_agg_mode),
        "pg_clipfrac": clipfrac,
        "ppo_kl": ppo_kl,
        "pg_clipfrac_lower": clipfrac_lower,
    }


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """[..., V] logits -> [...] entropy of softmax(logits), computed stably
    as logsumexp(l) - sum softmax(l) * l."""
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)


POLICY_LOSSES: dict[str, Callable] = {"vanilla": ppo_policy_loss}


def get_policy_loss(name: str) -> Callable:
    try:
        return POLICY_LOSSES[name]
    except KeyError:
        raise ValueError(f"unknown policy loss '{name}'; supported: {', '.join(POLICY_LOSSES)}") from None
