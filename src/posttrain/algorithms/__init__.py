"""Pure tensor functions: advantages, policy and value losses, KL estimators, DAPO's shaping, scores on tokens;
the registry of estimators and losses by name, with what each needs."""

from posttrain.algorithms.advantages import (
    gdpo_advantages, gpg_advantages, grpo_advantages, grpo_loo_advantages, grpo_passk_advantages,
    reinforce_pp_baseline_advantages, rloo_advantages,
)
from posttrain.algorithms.critic import explained_variance, value_loss
from posttrain.algorithms.kl import (
    KL_KINDS, AdaptiveKLController, FixedKLController, apply_kl_penalty, kl_penalty, make_kl_controller,
)
from posttrain.algorithms.losses import (
    LOSS_AGG_MODES, agg_loss, entropy_from_logits, gpg_policy_loss, gspo_policy_loss, masked_mean, ppo_policy_loss,
)
from posttrain.algorithms.masks import place_on_last_token, truncated_rows
from posttrain.algorithms.registry import (
    ADV_ESTIMATORS, NEEDS_CRITIC, POLICY_LOSSES, Estimator, PolicyLoss, compute_advantages, estimator,
    get_adv_estimator, get_policy_loss, is_weighted_loss, policy_loss,
)
from posttrain.algorithms.returns import gae_advantages, masked_whiten, reinforce_pp_advantages, remax_advantages
from posttrain.algorithms.shaping import (
    PF_PPO_METHODS, overlong_penalty, pf_ppo_resample, pf_ppo_weights, rescale, scale_truncated, varied_groups,
)

__all__ = [
    "ADV_ESTIMATORS", "NEEDS_CRITIC", "compute_advantages", "gae_advantages", "get_adv_estimator", "grpo_advantages",
    "grpo_loo_advantages", "grpo_passk_advantages", "masked_whiten", "reinforce_pp_advantages",
    "reinforce_pp_baseline_advantages",
    "rloo_advantages", "gpg_advantages", "remax_advantages", "explained_variance", "value_loss", "KL_KINDS",
    "AdaptiveKLController", "FixedKLController",
    "apply_kl_penalty", "kl_penalty", "make_kl_controller", "LOSS_AGG_MODES", "POLICY_LOSSES", "agg_loss",
    "entropy_from_logits", "get_policy_loss", "gpg_policy_loss", "gspo_policy_loss", "masked_mean", "ppo_policy_loss",
    "overlong_penalty", "rescale", "scale_truncated", "varied_groups", "PF_PPO_METHODS", "pf_ppo_weights", "pf_ppo_resample",
    "place_on_last_token", "truncated_rows", "gdpo_advantages", "Estimator", "PolicyLoss", "estimator", "policy_loss",
    "is_weighted_loss",
]
