"""Pure tensor functions: advantages, policy and value losses, KL estimators, DAPO's shaping, scores on tokens."""

from posttrain.algorithms.advantages import (
    ADV_ESTIMATORS, NEEDS_CRITIC, compute_advantages, gae_advantages, get_adv_estimator, gpg_advantages,
    grpo_advantages, grpo_loo_advantages, grpo_passk_advantages, masked_whiten, reinforce_pp_advantages,
    reinforce_pp_baseline_advantages, remax_advantages, rloo_advantages,
)
from posttrain.algorithms.critic import explained_variance, value_loss
from posttrain.algorithms.kl import (
    KL_KINDS, AdaptiveKLController, FixedKLController, apply_kl_penalty, kl_penalty, make_kl_controller,
)
from posttrain.algorithms.losses import (
    LOSS_AGG_MODES, POLICY_LOSSES, agg_loss, entropy_from_logits, get_policy_loss, gpg_policy_loss, gspo_policy_loss, masked_mean,
    ppo_policy_loss,
)
from posttrain.algorithms.masks import place_on_last_token, truncated_rows
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
    "place_on_last_token", "truncated_rows",
]
