"""Advantage estimators: rewards -> advantages, as pure tensor functions.

Every estimator takes `token_level_rewards [B, T]`, `response_mask [B, T]`
and `index` (a group id per row: the prompt the row was sampled from), or
ReMax's `reward_baselines [B]` instead of `index`, and returns
`(advantages [B, T], returns [B, T])`, zero outside the mask.
`ADV_ESTIMATORS` picks one by the name used in configs (verl's names).
"""

from __future__ import annotations

import inspect
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


def grpo_loo_advantages(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence[Hashable] | torch.Tensor,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO with a leave-one-out baseline (NeMo-RL's GRPO default,
    use_leave_one_out_baseline=true): each sample is compared with the
    other samples of its group only.

    Args and returns as `grpo_advantages`: token_level_rewards [B, T],
    response_mask [B, T], index B group ids -> (advantages [B, T],
    returns [B, T]), the same tensor, zero outside the mask.

    For sample i of a group of n >= 2, over the other n - 1 scores:
        b_i = their mean,  s_i = their unbiased (n - 2) std (0 when n = 2:
              one other score has no spread; NaN -> 0, as NeMo-RL)
        A_i = (score_i - b_i) / (s_i + epsilon)  where s_i > 0
        A_i = score_i - b_i                      where s_i = 0 (not divided:
              NeMo-RL does not sharpen samples whose peers all agree)
    norm_adv_by_std_in_grpo=False: A_i = score_i - b_i always. A group of
    one has advantage 0 (NeMo-RL sets its baseline to its own score). Note
    score_i - b_i = n/(n-1) (score_i - mean_g): RLOO's advantage.

    Example: scores [1, 0, 0, 0] in one group:
        row 0: others [0, 0, 0], b = 0, s = 0 -> A = 1 (not divided)
        rows 1-3: others [1, 0, 0], b = 1/3, s = sqrt(1/3) = 0.5774
                  -> A = -1/3 / (0.5774 + 1e-6) = -0.5773
    """
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)  # [B]
        baseline = scores.clone()  # [B]; a group of one: its own score, advantage 0
        std = torch.zeros_like(scores)  # [B]
        for rows in _group_rows(index, scores.shape[0]):
            if len(rows) < 2:
                continue
            group = scores[rows]  # [n]
            others = ~torch.eye(len(rows), dtype=torch.bool)  # [n, n]: row i marks the samples other than i
            peers = group.unsqueeze(0).expand(len(rows), -1)[others].view(len(rows), len(rows) - 1)  # [n, n-1]
            baseline[rows] = peers.mean(dim=-1)
            if len(rows) > 2:
                std[rows] = peers.std(dim=-1).nan_to_num(0.0)  # unbiased over the n - 1 others
        adv = scores - baseline
        if norm_adv_by_std_in_grpo:
            adv = torch.where(std > 0, adv / (std + epsilon), adv)
        adv = adv.unsqueeze(-1) * response_mask  # [B, T]
    return adv, adv


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


def _group_means(scores: torch.Tensor, index) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (mean of each row's group [B], size of each row's group [B]); a
    group of one has mean 0 (nothing to compare with)."""
    mean = torch.zeros_like(scores)
    size = torch.ones_like(scores)
    for rows in _group_rows(index, scores.shape[0]):
        size[rows] = float(len(rows))
        if len(rows) > 1:
            mean[rows] = scores[rows].mean()
    return mean, size


def rloo_advantages(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index) -> tuple[torch.Tensor,
                                                                                                     torch.Tensor]:
    """RLOO (Ahmadian et al. 2024): each score minus the mean of the others
    in its group: A_i = (n s_i - sum_g) / (n - 1) = n/(n-1) (s_i - mean_g).
    A group of one keeps its score (verl). Shapes as `grpo_advantages`.

    Example: scores [1, 0, 0] -> [1 - 0, 0 - 0.5, 0 - 0.5] = [1, -0.5, -0.5].
    """
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)  # [B]
        mean, n = _group_means(scores, index)
        factor = torch.where(n > 1, n / (n - 1).clamp(min=1), torch.ones_like(n))
        adv = (scores - mean) * factor
        adv = adv.unsqueeze(-1) * response_mask
    return adv, adv


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


def reinforce_pp_baseline_advantages(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index,
                                     epsilon: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ with a group baseline: score minus its group's mean (a
    group of one: minus 0), on every valid token, then whitened over the
    batch's valid tokens (verl 0.9.1). Shapes as `grpo_advantages`.
    `epsilon` is accepted for verl's signature and unused (as in verl: the
    batch whitening has its own 1e-8).

    Example: groups {0: [1, 0]}, {1: [1]}, one token each -> centred
    [0.5, -0.5, 1], whitened by mean 1/3 and std 0.7638: [0.2182, -1.0911, 0.8729].
    """
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        mean, _ = _group_means(scores, index)
        mask = response_mask.to(token_level_rewards.dtype)
        centred = (scores - mean).unsqueeze(-1) * mask  # [B, T]
        adv = masked_whiten(centred, mask) * mask
    return adv, adv


def grpo_passk_advantages(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index,
                          epsilon: float = 1e-6, norm_adv_by_std_in_grpo: bool = True) -> tuple[torch.Tensor,
                                                                                                  torch.Tensor]:
    """Pass@k (Tang et al. 2025, arXiv:2503.19595, as verl): only the best
    sample of a group gets an advantage, r_max - r_second (divided by the
    group's std + epsilon unless norm_adv_by_std_in_grpo=False); the others
    get 0. If the top two tie, r_max - r_second = 0 and every row gets 0. A
    group of one is a ValueError, as in verl: pass@k needs n >= 2
    (rollout.n). (verl 0.9.1 reads norm_adv_by_std_in_grpo from its config
    object; here it is the argument.)

    Example: scores [0, 1, 0.5] -> best 1, second 0.5, std 0.5:
    A = [0, 0.5 / (0.5 + 1e-6), 0] = [0, 0.999998, 0].
    """
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        adv = torch.zeros_like(scores)
        for rows in _group_rows(index, scores.shape[0]):
            if len(rows) < 2:
                raise ValueError(f"pass@k advantages need at least 2 samples per prompt; a group has {len(rows)} "
                                 "(set rollout.n >= 2)")
            group = scores[rows]
            top, where = torch.topk(group, 2)
            value = top[0] - top[1]
            if norm_adv_by_std_in_grpo:
                value = value / (group.std() + epsilon)
            adv[rows[int(where[0])]] = value
        adv = adv.unsqueeze(-1) * response_mask
    return adv, adv


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


def gpg_advantages(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index,
                   epsilon: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """GPG (Chu et al. 2025, arXiv:2504.02546, as verl): score minus its
    group's mean (a group of one: minus 0, as GRPO), scaled by
    alpha = B / M, M the number of rows of the whole batch whose score is
    non-zero (at least 1), to undo the dilution of the batch-mean gradient
    by samples that carry no signal. No division by the std. Shapes as
    `grpo_advantages`; advantages and returns are the same tensor.
    `epsilon` is accepted for verl's signature and unused (as in verl). verl's
    function also has f_norm and alpha arguments that its trainer never sets:
    f_norm stays 1 and alpha is always recomputed as B / M, so neither is here.

    Example: scores [1, 0, 0, 1], groups [0, 0, 0, 1]: M = 2, alpha = 4 / 2 = 2;
    group 0 has mean 1/3 -> 2 * [2/3, -1/3, -1/3]; row 3 alone -> 2 * 1:
    A = [1.3333, -0.6667, -0.6667, 2].
    """
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)  # [B]
        alpha = scores.shape[0] / max(int(torch.count_nonzero(scores)), 1)
        mean, _ = _group_means(scores, index)
        adv = (alpha * (scores - mean)).unsqueeze(-1) * response_mask  # [B, T]
    return adv, adv


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


def gdpo_advantages(reward_components: torch.Tensor, response_mask: torch.Tensor, index,
                    reward_weights: Sequence[float] | None = None, epsilon: float = 1e-6,
                    norm_adv_by_std_in_grpo: bool = True, leave_one_out: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """GDPO (group reward-decoupled normalization, arXiv:2601.05242; NeMo-RL's `gdpo` estimator): each reward
    component against its group on its own, then their weighted sum, whitened over the batch.

    Args:
        reward_components: [B, K] one column per reward (e.g. correctness, format), K >= 1.
        response_mask: [B, T]; index: B group ids, as `grpo_advantages`.
        reward_weights: K weights of the sum (None: all 1).
        norm_adv_by_std_in_grpo: divide each component's centred score by its group's unbiased std (where > 0).
        leave_one_out: each component's baseline the other samples of the group (as `grpo_loo_advantages`).

    Per component k, in a group of n >= 2: A_k = (r_k - mean_g) / (std_g + epsilon) (not divided where the
    group's std is 0); a group of one has A_k = 0 (nothing to compare with, as NeMo-RL). A = sum_k w_k A_k over
    the components, then (A - mean) / std over the B sequences (unbiased std; only centred when it is 0), on
    every response token. -> (advantages [B, T], the same tensor as returns).

    Example: one group of 3, correctness [1, 0, 0], format [1, 1, 0]: each component's advantages are
    [1.1547, -0.5774, -0.5774] and [0.5774, 0.5774, -1.1547]; their sum [1.7321, 0, -1.7321] has mean 0 and
    std 1.7321, so A = [1, 0, -1].
    """
    with torch.no_grad():
        rows, k = reward_components.shape
        ones = torch.ones(rows, 1, dtype=reward_components.dtype)
        per = grpo_loo_advantages if leave_one_out else grpo_advantages  # one component = one GRPO outcome
        parts = torch.cat([per(reward_components[:, c:c + 1], ones, index, epsilon, norm_adv_by_std_in_grpo)[0]
                           for c in range(k)], dim=-1)  # [B, K]
        alone = torch.zeros(rows, dtype=torch.bool)  # groups of one: GRPO keeps their score, NeMo-RL's GDPO 0
        for group in _group_rows(index, rows):
            alone[group] = len(group) == 1
        parts = parts.masked_fill(alone.unsqueeze(-1), 0.0)
        weights = torch.ones(k) if reward_weights is None else torch.tensor(list(reward_weights), dtype=torch.float32)
        if weights.numel() != k:
            raise ValueError(f"{weights.numel()} reward weights for {k} reward components")
        total = (parts * weights.to(reward_components.dtype)).sum(-1)  # [B]
        std = total.std() if rows > 1 else torch.zeros(())
        total = (total - total.mean()) / std if std > 0 else total - total.mean()
        adv = total.unsqueeze(-1) * response_mask  # [B, T]
    return adv, adv


ADV_ESTIMATORS: dict[str, Callable] = {
    "grpo": grpo_advantages,
    "gae": gae_advantages,
    "rloo": rloo_advantages,
    "reinforce_plus_plus": reinforce_pp_advantages,
    "reinforce_plus_plus_baseline": reinforce_pp_baseline_advantages,
    "grpo_passk": grpo_passk_advantages,
    "remax": remax_advantages,
    "gpg": gpg_advantages,
    "grpo_loo": grpo_loo_advantages,
    "gdpo": gdpo_advantages,
}
NEEDS_CRITIC = frozenset({"gae"})


def compute_advantages(name: str, token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index, *,
                       values: torch.Tensor | None = None, gamma: float = 1.0, lam: float = 1.0,
                       norm_adv_by_std_in_grpo: bool = True, epsilon: float = 1e-6,
                       reward_baselines: torch.Tensor | None = None, reward_components: torch.Tensor | None = None,
                       reward_weights: Sequence[float] | None = None,
                       leave_one_out: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The estimator `name` with the arguments it takes (from these;
    reward_baselines [B]: ReMax's greedy scores; reward_components [B, K], reward_weights, leave_one_out: GDPO's).
    -> (advantages [B, T], returns [B, T])."""
    fn = get_adv_estimator(name)
    if name in NEEDS_CRITIC and values is None:
        raise ValueError(f"the '{name}' estimator needs the critic's values")
    wanted = inspect.signature(fn).parameters
    if "reward_baselines" in wanted and reward_baselines is None:
        raise ValueError(f"the '{name}' estimator needs reward_baselines: one per row, the score of its "
                         "prompt's greedy response")
    if "reward_components" in wanted and reward_components is None:
        raise ValueError(f"the '{name}' estimator needs reward_components: each row's reward components")
    given = {"token_level_rewards": token_level_rewards, "response_mask": response_mask, "index": index,
             "values": values, "gamma": gamma, "lam": lam, "norm_adv_by_std_in_grpo": norm_adv_by_std_in_grpo,
             "epsilon": epsilon, "reward_baselines": reward_baselines, "reward_components": reward_components,
             "reward_weights": reward_weights, "leave_one_out": leave_one_out}
    return fn(**{k: v for k, v in given.items() if k in wanted})


def get_adv_estimator(name: str) -> Callable:
    """The estimator registered as `name`; ValueError lists the known ones."""
    try:
        return ADV_ESTIMATORS[name]
    except KeyError:
        raise ValueError(
            f"unknown advantage estimator '{name}'; supported: {', '.join(ADV_ESTIMATORS)}"
        ) from None
