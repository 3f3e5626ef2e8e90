"""Pure tensor functions: advantages, policy losses, KL estimators."""

from posttrain.algorithms.advantages import ADV_ESTIMATORS, get_adv_estimator, grpo_advantages
from posttrain.algorithms.kl import (
    KL_KINDS, AdaptiveKLController, FixedKLController, apply_kl_penalty, kl_penalty, make_kl_controller,
)
from posttrain.algorithms.losses import (
    LOSS_AGG_MODES, POLICY_LOSSES, agg_loss, entropy_from_logits, get_policy_loss, masked_mean, ppo_policy_loss,
)

__all__ = [
    "ADV_ESTIMATORS", "get_adv_estimator", "grpo_advantages", "KL_KINDS", "AdaptiveKLController",
    "FixedKLController", "apply_kl_penalty", "kl_penalty", "make_kl_controller", "LOSS_AGG_MODES",
    "POLICY_LOSSES", "agg_loss", "entropy_from_logits", "get_policy_loss", "masked_mean", "ppo_policy_loss",
]
