"""KL estimators between the policy and the reference, and KL controllers.

Estimators work per token on log-probs of the sampled tokens (Schulman's
k1/k2/k3, http://joschu.net/blog/kl-approx.html):

    kl / k1      logp - ref
    abs          |logp - ref|
    mse / k2     0.5 (logp - ref)^2
    low_var_kl / k3   exp(ref - logp) - (ref - logp) - 1, with ref - logp
                 clamped to [-20, 20] and the result to [-10, 10] (as verl)
"""

from __future__ import annotations

import torch

KL_KINDS = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")


def kl_penalty(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kind: str) -> torch.Tensor:
    """[B, T], [B, T] -> per-token KL estimate [B, T].

    Example (k3): logp = -1, ref = -2: d = -1, exp(-1) + 1 - 1 = 0.3679.
    """
    if kind in ("kl", "k1"):
        return log_prob - ref_log_prob
    if kind == "abs":
        return (log_prob - ref_log_prob).abs()
    if kind in ("mse", "k2"):
        return 0.5 * (log_prob - ref_log_prob).square()
    if kind in ("low_var_kl", "k3"):
        d = torch.clamp(ref_log_prob - log_prob, -20.0, 20.0)
        return torch.clamp(torch.exp(d) - d - 1.0, -10.0, 10.0)
    raise ValueError(f"unknown KL estimator '{kind}'; supported: {', '.join(KL_KINDS)}")


class FixedKLController:
    """A constant KL coefficient."""

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        pass

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Ziegler et al. 2019: move the coefficient towards a target KL.

    err = clip(current_kl / target_kl - 1, -0.2, 0.2);
    value *= 1 + err * n_steps / horizon.
    Example: value 0.1, target 0.1, kl 0.2, n 100, horizon 1000 -> 0.102.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int):
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        err = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + err * n_steps / self.horizon

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


def make_kl_controller(type: str, kl_coef: float, target_kl: float | None = None, horizon: int | None = None):
    if type == "fixed":
        return FixedKLController(kl_coef)
    if type == "adaptive":
        if not target_kl or not horizon or target_kl <= 0 or horizon <= 0:
            raise ValueError("the adaptive KL controller needs target_kl > 0 and horizon > 0")
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    raise ValueError(f"unknown KL controller '{type}'; supported: fixed, adaptive")


def apply_kl_penalty(token_level_scores, log_prob, ref_log_prob, response_mask, kl_ctrl, kind: str):
    """KL in the reward: rewards = scores - beta * kl, per token, [B, T].

    The batch's KL (mean over sequences of each sequence's token mean) then
    updates the controller. -> (token_level_rewards, metrics)
    """
    mask = response_mask.to(log_prob.dtype)
    kld = kl_penalty(log_prob, ref_log_prob, kind) * mask  # [B, T]
    beta = kl_ctrl.value
    rewards = token_level_scores - beta * kld
    current_kl = float(((kld.sum(-1) / mask.sum(-1).clamp(min=1))).mean())
    kl_ctrl.update(current_kl, n_steps=token_level_scores.shape[0])
    return rewards, {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": beta}
