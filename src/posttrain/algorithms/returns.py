"""Advantage estimators on each token's return-to-go, and the batch whitening they share.

REINFORCE++ (returns-to-go whitened over the batch), ReMax (returns minus the score of the
prompt's greedy response) and GAE (with the critic's values). Each takes
`token_level_rewards [B, T]` and `response_mask [B, T]` (ReMax also `reward_baselines [B]`,
GAE `values [B, T]`) and returns `(advantages [B, T], returns [B, T])`, zero outside the mask.
"""

from __future__ import annotations

import torch


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """(values - mean) * rsqrt(var + 1e-8), with the mean and the unbiased
    (n - 1) variance over the n entries where mask == 1 (verl's semantics);
    shift_mean=False adds the mean back. values and mask: any same shape
    (e.g. [B, T]); the statistics are over every valid entry of the whole
    tensor, and every entry, masked or not, is shifted and scaled (callers
    multiply by the mask).

    Where verl raises (fewer than 2 valid entries: no variance to divide
    by) there is no scaling here, only the shift: one valid entry whitens to
    exactly 0, and with no valid entry the mean is 0 and the result is
    `values` unchanged. Never NaN or inf for finite values. (verl also
    divides its sums by n + 1e-8 rather than n: a relative 1e-8 that is
    invisible in float32.)

    Example: values [1, 2, 3, 100], mask [1, 1, 1, 0]: mean 2, var 1 ->
    [-1, 0, 1, 98]; values [5, 7], mask [1, 0] -> [0, 2].
    """
    mask = mask.to(values.dtype)
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    count = mask.sum()
    mean = torch.where(mask != 0, values, zero).sum() / count.clamp(min=1)
    if count >= 2:
        centred = torch.where(mask != 0, values - mean, zero)
        var = (centred ** 2).sum() / (count - 1)
        whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    else:  # verl raises: nothing to scale by
        whitened = values - mean
    return whitened if shift_mean else whitened + mean


def reinforce_pp_advantages(token_level_rewards: torch.Tensor, response_mask: torch.Tensor,
                            gamma: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu 2025): returns-to-go G_t = r_t + gamma G_{t'} per valid
    token, t' the next valid token (masked tokens inside a row, such as tool
    output, are skipped: the return flows past them, as in verl 0.9.1);
    advantages = the returns whitened over every valid token of the batch.
    -> (advantages, returns), both [B, T] and zero outside the mask.

    Example: rewards [[0, 0, 1], [0, 5, 1]], masks [[1, 1, 1], [1, 0, 1]],
    gamma 0.5 -> returns [[0.25, 0.5, 1], [0.5, 0, 1]] (the masked 5 is
    neither a reward nor a step); whitened over [0.25, 0.5, 1, 0.5, 1].
    """
    with torch.no_grad():
        mask = response_mask.to(token_level_rewards.dtype)
        returns = torch.zeros_like(token_level_rewards)
        running = torch.zeros_like(token_level_rewards[:, 0]) if token_level_rewards.shape[1] else None
        for t in reversed(range(token_level_rewards.shape[1])):
            here = token_level_rewards[:, t] + gamma * running
            running = torch.where(mask[:, t] != 0, here, running)
            returns[:, t] = torch.where(mask[:, t] != 0, here, torch.zeros_like(here))
        adv = masked_whiten(returns, mask) * mask
    return adv, returns


def remax_advantages(token_level_rewards: torch.Tensor, response_mask: torch.Tensor,
                     reward_baselines: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax (Li et al. 2023, arXiv:2310.10505, as verl): the baseline of a
    sample is the score of its prompt's greedy response.

    Args:
        token_level_rewards: [B, T]; response_mask: [B, T] as `grpo_advantages`.
        reward_baselines: [B] each row's baseline (its prompt's greedy score,
            repeated over the prompt's samples).

    Returns:
        (advantages [B, T], returns [B, T]): returns are the undiscounted
        rewards-to-go over valid tokens, G_t = sum_{t' >= t} r_t' m_t', and
        A_t = G_t - baseline (so with an outcome reward A = score - baseline
        on every valid token). Both are zero outside the mask; verl (0.8.0.dev)
        leaves G_t in masked tokens *inside* a row (tool output), which no
        loss reads; everywhere else the two agree.

    Example: rewards [[0, 0, 1], [0, 2, 0]], masks [[1, 1, 1], [1, 1, 0]],
    baselines [0.5, 2]: returns [[1, 1, 1], [2, 2, 0]],
    A = [[0.5, 0.5, 0.5], [0, 0, 0]] (the second sample only matched greedy).
    """
    with torch.no_grad():
        mask = response_mask.to(token_level_rewards.dtype)
        baselines = torch.as_tensor(reward_baselines, dtype=token_level_rewards.dtype)
        if baselines.shape != token_level_rewards.shape[:1]:
            raise ValueError(f"reward_baselines has shape {tuple(baselines.shape)}; one per row is "
                             f"{tuple(token_level_rewards.shape[:1])}")
        returns = (token_level_rewards * mask).flip(-1).cumsum(-1).flip(-1) * mask  # [B, T] reward-to-go
        adv = returns - baselines.unsqueeze(-1) * mask
    return adv, returns


def gae_advantages(token_level_rewards: torch.Tensor, values: torch.Tensor, response_mask: torch.Tensor,
                   gamma: float = 1.0, lam: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE (Schulman et al. 2015) over response tokens, backwards:
        delta_t = r_t + gamma V_{t+1} - V_t;  A_t = delta_t + gamma lam A_{t+1}
    where t+1 is the next valid token (masked tokens inside a row are
    skipped, as verl does); returns = A + V; the advantages are then
    whitened over the batch's valid tokens.
    values [B, T] are the critic's. -> (advantages, returns), zero outside
    the mask (a deliberate difference: verl 0.9.1 leaves A + V and the
    whitened A in the masked positions; on valid tokens the two agree).

    Example: one row, rewards [0, 1], values [0.5, 0.5], gamma = lam = 1:
    A_1 = 1 - 0.5 = 0.5, A_0 = 0 + 0.5 - 0.5 + 0.5 = 0.5; returns [1, 1];
    both advantages equal, so they whiten to [0, 0].
    """
    with torch.no_grad():
        mask = response_mask.to(token_level_rewards.dtype)
        B, T = token_level_rewards.shape
        next_value = torch.zeros(B, dtype=token_level_rewards.dtype)
        last = torch.zeros(B, dtype=token_level_rewards.dtype)
        adv = torch.zeros_like(token_level_rewards)
        for t in reversed(range(T)):
            delta = token_level_rewards[:, t] + gamma * next_value - values[:, t]
            here = delta + gamma * lam * last
            next_value = torch.where(mask[:, t] != 0, values[:, t], next_value)
            last = torch.where(mask[:, t] != 0, here, last)
            adv[:, t] = last
        returns = (adv + values) * mask
        adv = masked_whiten(adv, mask) * mask
    return adv, returns
