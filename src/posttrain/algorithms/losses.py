"""Policy losses and their aggregation over tokens: pure tensor functions.

Shapes: B sequences, T padded response length, V vocabulary size.
`registry.POLICY_LOSSES` picks a policy loss by the name used in configs.
"""

from __future__ import annotations

import torch

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def _masked(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """x * mask, with exact zeros where mask == 0 even if x is inf or NaN
    there (x * 0 would be NaN): padding must never leak into a loss."""
    return torch.where(mask != 0, x * mask, torch.zeros((), dtype=x.dtype, device=x.device))


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of x [...] over mask [...] == 1, a scalar; 0 when the mask is
    empty (never NaN).

    Example: x [1, 2, 3], mask [1, 1, 0] -> 1.5.
    """
    mask = mask.to(x.dtype)
    return _masked(x, mask).sum() / mask.sum().clamp(min=1)


def weighted(per_token: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    """Per-token losses [B, T] times importance weights [B, T] (detached: a weight scales a token's
    gradient, it gets none); None: unchanged."""
    return per_token if weights is None else per_token * weights.detach().to(per_token.dtype)


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str,
    *,
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """Per-token losses [B, T] and mask [B, T] -> a scalar.

    token-mean:              sum over valid tokens / number of valid tokens
    seq-mean-token-sum:      mean over sequences of each sequence's token sum
    seq-mean-token-mean:     mean over sequences of each sequence's token mean
    seq-mean-token-sum-norm: seq-mean-token-sum / loss_scale_factor (Dr. GRPO:
                             a constant normaliser instead of each length;
                             default T = loss_mask.shape[-1], the padded length)

    A sequence with no valid token is left out of the sequence means (the
    divisor counts only sequences with at least one valid token), so a fully
    masked row contributes nothing; this is verl 0.9's rule. Where verl
    divides 0 by 0 (no valid token at all, or B = 0 or T = 0) this returns
    0, never NaN, so such a micro-batch adds no gradient. Masked-out
    entries of loss_mat are ignored even when they are inf or NaN.

    Pass `loss_scale_factor` (e.g. the configured max response length) to
    keep the Dr. GRPO normaliser constant when T changes from step to step.

    Example: loss [[1, 2, 3], [4, 5, 6], [7, 8, 9]],
    mask [[1, 1, 0], [1, 0, 0], [0, 0, 0]] (third row fully masked):
    token-mean 7/3; seq-mean-token-sum (3 + 4)/2 = 3.5;
    seq-mean-token-mean (1.5 + 4)/2 = 2.75; seq-mean-token-sum-norm 3.5/3.
    """
    mask = loss_mask.to(loss_mat.dtype)
    if loss_agg_mode == "token-mean":
        return masked_mean(loss_mat, mask)
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode '{loss_agg_mode}'; supported: {', '.join(LOSS_AGG_MODES)}")
    tokens = mask.sum(-1)  # [B] valid tokens per sequence
    seq_valid = (tokens > 0).to(loss_mat.dtype)  # [B]
    num_seqs = seq_valid.sum().clamp(min=1)
    seq_sums = _masked(loss_mat, mask).sum(-1)  # [B], 0 on fully masked rows
    if loss_agg_mode == "seq-mean-token-mean":
        # clamp: a fully masked row is 0 / 1 = 0 (and excluded by num_seqs)
        return (seq_sums / tokens.clamp(min=1)).sum() / num_seqs
    loss = seq_sums.sum() / num_seqs
    if loss_agg_mode == "seq-mean-token-sum-norm":
        scale = loss_mask.shape[-1] if loss_scale_factor is None else loss_scale_factor
        if scale > 0:  # T = 0 means no valid token, and the loss is 0 already
            loss = loss / scale
    return loss


def ppo_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float | None = 3.0,
    loss_agg_mode: str = "token-mean",
    *,
    loss_scale_factor: float | None = None,
    weights: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """PPO's clipped surrogate with dual clip; every input is [B, T].

    r = exp(log_prob - old_log_prob), the log-ratio clamped to [-20, 20] so
    one stale token cannot overflow exp. Per token:
        clipped = max(-A r, -A clip(r, 1 - low, 1 + high))
    and where A < 0 also at most -A * clip_ratio_c (dual clip, Ye et al.
    2020): without it a token with A < 0 and a huge r has an unbounded loss.
    clip_ratio_c=None turns the dual clip off (NeMo-RL's ratio_clip_c: null):
    the loss is `clipped` everywhere and pg_clipfrac_lower is 0.
    The per-token losses, times `weights` [B, T] when given (rollout
    correction's importance weights, no gradient), are aggregated with
    `agg_loss(loss_agg_mode)`.

    Returns a dict:
        pg_loss            scalar with grad (through log_prob only)
        pg_clipfrac        share of valid tokens where the clipped term won
        ppo_kl             mean over valid tokens of old - new log-prob
        pg_clipfrac_lower  share of valid tokens where the dual clip bound
    the last three detached.

    Example (low = high = 0.2, token-mean):
        A = 1,  r = 1.5: max(-1.5, -1.2) = -1.2   (clipped, no gradient)
        A = -1, r = 5.0: max(5.0, 1.2) = 5.0, dual: min(3.0, 5.0) = 3.0
        pg_loss = (-1.2 + 3.0) / 2 = 0.9, pg_clipfrac 0.5, pg_clipfrac_lower 0.5.
    With clip_ratio_c=None the second token keeps 5.0: pg_loss (-1.2 + 5.0) / 2
    = 1.9, pg_clipfrac_lower 0.
    """
    # Over 60 lines only by its docstring's worked example, which the tests check by hand.
    if clip_ratio_c is not None and clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c (the dual-clip bound) must be > 1 or None (no dual clip), got {clip_ratio_c}")
    mask = response_mask.to(log_prob.dtype)
    log_ratio = torch.clamp(log_prob - old_log_prob, -20.0, 20.0)  # [B, T]
    ratio = torch.exp(log_ratio)
    loss1 = -advantages * ratio
    loss2 = -advantages * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    clipped = torch.maximum(loss1, loss2)  # pessimistic of the two
    if clip_ratio_c is None:  # no dual clip
        per_token = clipped
        dual = torch.zeros_like(clipped, dtype=torch.bool)
    else:
        loss3 = -advantages * clip_ratio_c  # [B, T], the dual-clip ceiling
        negative = advantages < 0
        per_token = torch.where(negative, torch.minimum(loss3, clipped), clipped)  # [B, T]
        dual = (clipped > loss3) & negative
    per_token = weighted(per_token, weights)
    with torch.no_grad():
        clipfrac = masked_mean((loss2 > loss1).to(mask.dtype), mask)
        clipfrac_lower = masked_mean(dual.to(mask.dtype), mask)
        ppo_kl = masked_mean(-log_ratio, mask)
    return {
        "pg_loss": agg_loss(per_token, mask, loss_agg_mode, loss_scale_factor=loss_scale_factor),
        "pg_clipfrac": clipfrac,
        "ppo_kl": ppo_kl,
        "pg_clipfrac_lower": clipfrac_lower,
    }


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Logits [B, T, V] (any [..., V]) -> entropy of softmax(logits) [B, T].

    Computed as logsumexp(l) - sum softmax(l) * l, which needs no log of a
    probability (log 0 = -inf) and no exp of a large logit. Logits must be
    finite: a -inf logit (top-k style masking) gives 0 * -inf = NaN.

    Example: V equal logits -> log V; log-probs of [0.5, 0.25, 0.25] ->
    1.5 ln 2 = 1.0397.
    """
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)


def gspo_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float = 3e-4,
    clip_ratio_high: float = 4e-4,
    clip_ratio_c: float | None = 3.0,
    loss_agg_mode: str = "seq-mean-token-mean",
    *,
    loss_scale_factor: float | None = None,
    weights: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """GSPO (Zheng et al. 2025): one importance ratio per sequence, the
    geometric mean of its token ratios, s_i = exp(mean_t (log_prob - old)),
    clipped to [1 - low, 1 + high]; inputs [B, T], same returns as
    `ppo_policy_loss` (pg_clipfrac_lower is 0: GSPO has no dual clip, and
    clip_ratio_c is accepted for the same signature and unused); `weights` as
    in `ppo_policy_loss`.

    Token form with a stop-gradient, so the gradient of each token is the
    sequence's ratio times its own log-prob gradient:
        log s_it = sg[log s_i] + log_prob_t - sg[log_prob_t]   (clamped <= 10)
        loss_t   = max(-A s_it, -A clip(s_it, 1 - low, 1 + high))
    aggregated with `agg_loss(loss_agg_mode)` as verl 0.9.1 does; the paper's
    length normalisation is seq-mean-token-mean (the default here, and what
    `algorithm.name=gspo` sets). Fully masked rows add
    nothing and never NaN: a row's length is clamped to 1 (as verl), and a
    batch with no valid token gives pg_loss 0 where verl divides 0 by 0.

    Example: one sequence of 2 tokens, old [0, 0], new [0.1, -0.3], A = 1,
    low = high = 0.2: s = exp(-0.1) = 0.9048, inside the clip range:
    loss = -0.9048; d loss / d log_prob_t = -0.9048 / 2 for each token.
    """
    del clip_ratio_c  # no dual clip in GSPO
    mask = response_mask.to(log_prob.dtype)
    log_ratio = _masked(log_prob - old_log_prob, mask)  # [B, T]
    lengths = mask.sum(-1).clamp(min=1)  # [B]
    seq_log_ratio = (log_ratio.sum(-1) / lengths).detach()  # [B], log s_i
    token_log_ratio = torch.clamp(log_prob - log_prob.detach() + seq_log_ratio.unsqueeze(-1), max=10.0)
    ratio = torch.exp(token_log_ratio)  # [B, T], the value s_i on every token
    loss1 = -advantages * ratio
    loss2 = -advantages * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    per_token = weighted(torch.maximum(loss1, loss2), weights)
    with torch.no_grad():
        clipfrac = masked_mean((loss2 > loss1).to(mask.dtype), mask)
        ppo_kl = masked_mean(-log_ratio, mask)
    return {
        "pg_loss": agg_loss(per_token, mask, loss_agg_mode, loss_scale_factor=loss_scale_factor),
        "pg_clipfrac": clipfrac,
        "ppo_kl": ppo_kl,
        "pg_clipfrac_lower": torch.zeros((), dtype=log_prob.dtype),
    }


def gpg_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float | None = 3.0,
    loss_agg_mode: str = "token-mean",
    *,
    loss_scale_factor: float | None = None,
    weights: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """GPG (Chu et al. 2025, arXiv:2504.02546): the plain policy gradient,
    loss_t = -A_t log_prob_t, no ratio and no clip (the clip ratios and
    old_log_prob are accepted for the same signature and unused); inputs
    [B, T], the same returns as `ppo_policy_loss` with the clip fractions
    and ppo_kl 0.

    With `weights` w (rollout correction's importance weights, no gradient)
    loss_t = -w_t A_t log_prob_t: the IS-weighted policy gradient (verl's
    bypass-mode "reinforce" loss).

    Example: log_prob [-1, -2], A = [1, 1], token-mean: loss = (1 + 2) / 2 = 1.5;
    d loss / d log_prob_t = -1/2 each (what PPO-clip gives at ratio 1). With
    weights [2, 0.5]: (2 + 1) / 2 = 1.5, gradients -1 and -1/4.
    """
    del old_log_prob, clip_ratio_low, clip_ratio_high, clip_ratio_c
    mask = response_mask.to(log_prob.dtype)
    zero = torch.zeros((), dtype=log_prob.dtype, device=log_prob.device)
    return {"pg_loss": agg_loss(_masked(weighted(-advantages * log_prob, weights), mask), mask, loss_agg_mode,
                                loss_scale_factor=loss_scale_factor),
            "pg_clipfrac": zero, "ppo_kl": zero, "pg_clipfrac_lower": zero}

