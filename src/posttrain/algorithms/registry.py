"""The advantage estimators and policy losses by the names used in configs (verl's names), each
entry with what it needs beyond the common arguments.

The loop, the actor, the settings and validation ask an entry (`estimator("gdpo").reward_components`,
`policy_loss("gpg").applies_is_weights`), never compare names: a new algorithm that needs an extra
pass, a greedy baseline, several rewards or a special update says so here, in its entry, and
nothing else changes. `ADV_ESTIMATORS`, `NEEDS_CRITIC` and `POLICY_LOSSES` are views of the entries.

Every estimator takes `token_level_rewards [B, T]` (GDPO: `reward_components [B, K]`),
`response_mask [B, T]` and `index` (a group id per row: the prompt the row was sampled from), or
ReMax's `reward_baselines [B]` instead of `index`, and returns `(advantages [B, T], returns [B, T])`,
zero outside the mask. Every policy loss takes `(old_log_prob, log_prob, advantages, response_mask)`,
each [B, T], and the clip and aggregation settings, and returns `pg_loss` and its metrics.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from posttrain.algorithms.advantages import (
    gdpo_advantages, gpg_advantages, grpo_advantages, grpo_loo_advantages, grpo_passk_advantages,
    reinforce_pp_baseline_advantages, rloo_advantages,
)
from posttrain.algorithms.losses import gpg_policy_loss, gspo_policy_loss, ppo_policy_loss
from posttrain.algorithms.returns import gae_advantages, reinforce_pp_advantages, remax_advantages


@dataclass(frozen=True)
class Estimator:
    """An advantage estimator and what it needs beyond the rewards, the mask and the group ids."""

    fn: Callable
    needs_critic: bool = False  # the critic's values [B, T]: a critic is built, trained and checkpointed
    greedy_baseline: bool = False  # one greedy response per prompt, whose score is its rows' baseline [B]
    reward_components: bool = False  # each row's reward components [B, K], not only their sum
    min_samples: int = 1  # it compares the samples of a prompt: rollout.n must be at least this
    compares: str = ""  # what it compares, for the message when rollout.n < min_samples
    too_few: str = ""  # what fewer samples would do, for the same message


@dataclass(frozen=True)
class PolicyLoss:
    """A policy loss and how the update feeds it."""

    fn: Callable
    # The loss has no importance ratio of its own (the plain policy gradient -A log pi): in rollout
    # correction's bypass mode the IS weights pi_theta / pi_rollout multiply its per-token loss. A loss
    # with a ratio (PPO-clip's pi_theta / pi_old, pi_old = pi_rollout there) has them reported, not applied.
    applies_is_weights: bool = False


ESTIMATORS: dict[str, Estimator] = {
    "grpo": Estimator(grpo_advantages),
    "gae": Estimator(gae_advantages, needs_critic=True),
    "rloo": Estimator(rloo_advantages),
    "reinforce_plus_plus": Estimator(reinforce_pp_advantages),
    "reinforce_plus_plus_baseline": Estimator(reinforce_pp_baseline_advantages),
    "grpo_passk": Estimator(grpo_passk_advantages, min_samples=2, compares="compares the samples of a prompt"),
    "remax": Estimator(remax_advantages, greedy_baseline=True),
    "gpg": Estimator(gpg_advantages),
    "grpo_loo": Estimator(grpo_loo_advantages, min_samples=2,
                          compares="compares each sample with the other samples of its prompt",
                          too_few="with one sample every advantage is 0"),
    "gdpo": Estimator(gdpo_advantages, reward_components=True, min_samples=2,
                      compares="compares each reward component within a prompt's samples"),
}
LOSSES: dict[str, PolicyLoss] = {
    "vanilla": PolicyLoss(ppo_policy_loss),
    "gspo": PolicyLoss(gspo_policy_loss),
    "gpg": PolicyLoss(gpg_policy_loss, applies_is_weights=True),
}

# the name -> function views that configs, validation and tests have always read
ADV_ESTIMATORS: dict[str, Callable] = {name: entry.fn for name, entry in ESTIMATORS.items()}
NEEDS_CRITIC = frozenset(name for name, entry in ESTIMATORS.items() if entry.needs_critic)
POLICY_LOSSES: dict[str, Callable] = {name: entry.fn for name, entry in LOSSES.items()}


def estimator(name: str) -> Estimator:
    """The entry of the estimator registered as `name`; ValueError lists the known ones."""
    try:
        return ESTIMATORS[name]
    except KeyError:
        raise ValueError(
            f"unknown advantage estimator '{name}'; supported: {', '.join(ESTIMATORS)}"
        ) from None


def policy_loss(name: str) -> PolicyLoss:
    """The entry of the policy loss registered as `name`; ValueError lists the known ones."""
    try:
        return LOSSES[name]
    except KeyError:
        raise ValueError(f"unknown policy loss '{name}'; supported: {', '.join(LOSSES)}") from None


def is_weighted_loss() -> str:
    """The name of the loss that applies the IS weights itself (the plain policy gradient): what rollout
    correction's bypass mode with loss_type=reinforce trains with."""
    return next(name for name, entry in LOSSES.items() if entry.applies_is_weights)


def get_adv_estimator(name: str) -> Callable:
    """The estimator registered as `name`; ValueError lists the known ones."""
    return estimator(name).fn


def get_policy_loss(name: str) -> Callable:
    """The policy loss registered as `name`; ValueError lists the known ones."""
    return policy_loss(name).fn


def compute_advantages(name: str, token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index, *,
                       values: torch.Tensor | None = None, gamma: float = 1.0, lam: float = 1.0,
                       norm_adv_by_std_in_grpo: bool = True, epsilon: float = 1e-6,
                       reward_baselines: torch.Tensor | None = None, reward_components: torch.Tensor | None = None,
                       reward_weights: Sequence[float] | None = None,
                       leave_one_out: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The estimator `name` with the arguments it takes (from these;
    reward_baselines [B]: ReMax's greedy scores; reward_components [B, K], reward_weights, leave_one_out: GDPO's).
    -> (advantages [B, T], returns [B, T])."""
    entry = estimator(name)
    if entry.needs_critic and values is None:
        raise ValueError(f"the '{name}' estimator needs the critic's values")
    if entry.greedy_baseline and reward_baselines is None:
        raise ValueError(f"the '{name}' estimator needs reward_baselines: one per row, the score of its "
                         "prompt's greedy response")
    if entry.reward_components and reward_components is None:
        raise ValueError(f"the '{name}' estimator needs reward_components: each row's reward components")
    wanted = inspect.signature(entry.fn).parameters
    given = {"token_level_rewards": token_level_rewards, "response_mask": response_mask, "index": index,
             "values": values, "gamma": gamma, "lam": lam, "norm_adv_by_std_in_grpo": norm_adv_by_std_in_grpo,
             "epsilon": epsilon, "reward_baselines": reward_baselines, "reward_components": reward_components,
             "reward_weights": reward_weights, "leave_one_out": leave_one_out}
    return entry.fn(**{k: v for k, v in given.items() if k in wanted})
