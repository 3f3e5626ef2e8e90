"""KL estimators between the policy and the reference, and KL controllers.

Estimators work per token on the log-probs of the sampled tokens (Schulman's
k1/k2/k3, http://joschu.net/blog/kl-approx.html), d = logp - ref:

    kl / k1          d                         unbiased, high variance, can be < 0
    abs              |d|
    mse / k2         0.5 d^2
    low_var_kl / k3  exp(-d) + d - 1 >= 0      unbiased, low variance; -d is
                     clamped to [-20, 20] and the result to [-10, 10] (as verl)

A kind ending in "+" (k1+, k3+, low_var_kl+, ...) has the value of its base
kind and the gradient of k2 (straight-through): k1 and k3 are unbiased
estimates of the KL's value but not of its gradient, k2's gradient is (verl's
"+" kinds). "full" (exact KL over the vocabulary) needs the full logits, not
two log-probs, and is not supported.
"""

from __future__ import annotations

import torch

_BASE_KINDS = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
KL_KINDS = _BASE_KINDS + tuple(k + "+" for k in _BASE_KINDS)


def _kl_value(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kind: str) -> torch.Tensor:
    if kind in ("kl", "k1"):
        return log_prob - ref_log_prob
    if kind == "abs":
        return (log_prob - ref_log_prob).abs()
    if kind in ("mse", "k2"):
        return 0.5 * (log_prob - ref_log_prob).square()
    # low_var_kl / k3: the clamps keep exp finite and one outlier token from
    # dominating the loss (k3 grows like exp(ref - logp))
    d = torch.clamp(ref_log_prob - log_prob, -20.0, 20.0)
    return torch.clamp(torch.exp(d) - d - 1.0, -10.0, 10.0)


def kl_penalty(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kind: str) -> torch.Tensor:
    """Log-probs of the sampled tokens [B, T], [B, T] -> per-token KL
    estimate [B, T] (not masked). `kind` is one of KL_KINDS.

    Example: logp = -1, ref = -2 (d = 1): k1 1, abs 1, k2 0.5,
    k3 exp(-1) + 1 - 1 = 0.3679; k3+ has value 0.3679 and gradient
    d(0.5 d^2)/d logp = 1.
    """
    if kind not in KL_KINDS:
        hint = " ('full' needs the whole vocabulary's logits)" if kind.rstrip("+") == "full" else ""
        raise ValueError(f"unknown KL estimator '{kind}'{hint}; supported: {', '.join(KL_KINDS)}")
    value = _kl_value(log_prob, ref_log_prob, kind.rstrip("+"))
    if not kind.endswith("+"):
        return value
    # straight-through: forward value of the base kind, backward of k2
    k2 = 0.5 * (log_prob - ref_log_prob).square()
    return k2 - k2.detach() + value.detach()


class FixedKLController:
    """A constant KL coefficient `value`."""

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Nothing to adapt."""

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Ziegler et al. 2019 (arXiv:1909.08593): move the coefficient towards
    a target KL, by at most 20% per `horizon` samples.

    err = clip(current_kl / target_kl - 1, -0.2, 0.2)
    value *= 1 + err * n_steps / horizon

    Example: value 0.1, target 0.1, kl 0.2 (err clipped to 0.2),
    n_steps 100, horizon 1000 -> 0.1 * 1.02 = 0.102.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int):
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        err = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + err * n_steps / self.horizon

    def state_dict(self) -> dict:
        # only the coefficient moves; target and horizon come from the config
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


def make_kl_controller(
    type: str, kl_coef: float, target_kl: float | None = None, horizon: int | None = None
) -> FixedKLController | AdaptiveKLController:
    """"fixed" or "adaptive" (which needs target_kl > 0 and horizon > 0)."""
    if type == "fixed":
        return FixedKLController(kl_coef)
    if type == "adaptive":
        if target_kl is None or horizon is None or target_kl <= 0 or horizon <= 0:
            raise ValueError(
                f"the adaptive KL controller needs target_kl > 0 and horizon > 0, "
                f"got target_kl={target_kl}, horizon={horizon}"
            )
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    raise ValueError(f"unknown KL controller type '{type}'; supported: fixed, adaptive")


def apply_kl_penalty(
    token_level_scores: torch.Tensor,
    log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    kl_ctrl: FixedKLController | AdaptiveKLController,
    kind: str,
) -> tuple[torch.Tensor, dict[str, float]]:
    """KL in the reward: rewards = scores - beta * kl per token, all [B, T].

    log_prob is the rollout policy's (old) log-prob. beta is the controller's
    value before this batch; the batch's KL (mean over the B sequences of
    each one's masked token mean; a fully masked row counts as 0) then
    updates the controller with n_steps = B.
    Returns (token_level_rewards [B, T], metrics of Python floats).

    Example: scores [[0, 1]], kl [[0.5, 0.1]], mask [[1, 1]], beta 0.1 ->
    rewards [[-0.05, 0.99]], actor/reward_kl_penalty 0.3.
    """
    mask = response_mask.to(log_prob.dtype)
    kld = kl_penalty(log_prob, ref_log_prob, kind) * mask  # [B, T]
    beta = float(kl_ctrl.value)
    rewards = token_level_scores - beta * kld
    per_seq = kld.sum(-1) / mask.sum(-1).clamp(min=1)  # [B]
    current_kl = float(per_seq.mean()) if per_seq.numel() else 0.0
    kl_ctrl.update(current_kl, n_steps=token_level_scores.shape[0])
    return rewards, {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": beta}
