"""On-policy distillation: a teacher scores the student's own samples token by token.

The signal is the per-token divergence of the student from the teacher on the sampled tokens, d_t =
kl_penalty(log pi_student(y_t), log pi_teacher(y_t), loss_mode) (k1: log pi_s - log pi_t, whose mean over the
student's samples is the reverse KL(student || teacher)). verl's two ways to learn from it
(`distillation.distillation_loss.*`):

- direct (use_policy_gradient=false): the loss is agg(d_t), its gradient taken through the student's
  log-probs (GKD style);
- policy gradient (use_policy_gradient=true): -d_t, computed with the sampling policy's log-probs and
  detached, is each token's advantage in the policy loss (PPO-clip by default): Thinking Machines'
  on-policy distillation, the reverse KL's own gradient.

With use_task_rewards the step's usual policy loss (the reward's advantages) is kept and the distillation
loss added times distillation_loss_coef; without, the distillation loss alone trains.

    s = DistillSettings(loss_mode="k1", use_policy_gradient=True)
    d = token_divergence(student_lp, teacher_lp, s)         # [n, R]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from posttrain.algorithms.kl import kl_penalty

# the estimators of the sampled tokens' log-probs (verl's also has top-k modes over whole distributions)
LOSS_MODES = ("k1", "kl", "abs", "mse", "k2", "low_var_kl", "k3")


@dataclass(frozen=True)
class DistillSettings:
    loss_mode: str = "k3"
    use_policy_gradient: bool = False
    use_task_rewards: bool = False
    coef: float = 1.0  # distillation_loss_coef: the distillation loss's weight beside the task's (use_task_rewards)
    loss_max_clamp: float | None = None  # each token's divergence at most this
    log_prob_min_clamp: float | None = None  # both log-probs at least this (a token the teacher finds impossible)


def token_divergence(student_lp: torch.Tensor, teacher_lp: torch.Tensor, s: DistillSettings) -> torch.Tensor:
    """Per-token divergence [n, R] of the student from the teacher on the sampled tokens (not masked), clamped as
    the settings say.

    Example, k1: student -1.0, teacher -3.0 -> 2.0 (the student likes the token more than the teacher does);
    with log_prob_min_clamp -2.0: -1.0 - (-2.0) = 1.0; with loss_max_clamp 0.5: 0.5.
    """
    if s.log_prob_min_clamp is not None:
        student_lp = student_lp.clamp(min=s.log_prob_min_clamp)
        teacher_lp = teacher_lp.clamp(min=s.log_prob_min_clamp)
    d = kl_penalty(student_lp, teacher_lp, s.loss_mode)
    return d.clamp(max=s.loss_max_clamp) if s.loss_max_clamp is not None else d


def distillation_advantages(old_lp: torch.Tensor, teacher_lp: torch.Tensor, mask: torch.Tensor,
                            s: DistillSettings) -> torch.Tensor:
    """use_policy_gradient: each token's advantage [n, R], -d_t of the sampling policy's log-probs, masked.

    Example, k1: old [[-1.0, -0.5]], teacher [[-3.0, -0.5]], mask [[1, 1]] -> [[-2.0, 0.0]]: the token the
    teacher likes less is pushed down, the one they agree on is left alone."""
    return -token_divergence(old_lp.detach(), teacher_lp, s) * mask
