"""Group-relative advantage estimators: each sample's score against the other samples of its prompt.

Every estimator here takes `token_level_rewards [B, T]` (GDPO: `reward_components [B, K]`),
`response_mask [B, T]` and `index` (a group id per row: the prompt the row was sampled from),
and returns `(advantages [B, T], returns [B, T])`, zero outside the mask. The estimators that
work on each token's return instead (REINFORCE++, ReMax, GAE) are in returns.py; registry.py
picks one by the name used in configs (verl's names) and says what each needs.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Hashable, Sequence

import torch

from posttrain.algorithms.returns import masked_whiten


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
