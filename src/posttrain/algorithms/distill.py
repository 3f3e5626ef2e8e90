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

The top-k modes compare whole next-token distributions on the teacher's k most likely tokens at each position
(the teacher's pass keeps their ids and log-probs; the student's log-probs are gathered at those ids), always as a
direct loss:

- forward_kl_topk (verl): sum over the k of p_t (log p_t - log p_s), both log-probs over the whole vocabulary
  (the k carry less than all the mass, so a token's term may be negative: the sum is clamped at 0);
- kl_topk (NeMo-RL's distillation loss): the teacher's top-k renormalised to a distribution over the k, against
  the student's renormalised over the same k (or, with zero_outside_topk, the student's own probabilities, the
  teacher's taken as e^-100 outside the k), KL forward (teacher || student), reverse (student || teacher) or mixed
  (mixed_kl_weight x forward + (1 - mixed_kl_weight) x reverse).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from posttrain.algorithms.kl import kl_penalty

# the estimators of the sampled tokens' log-probs
LOSS_MODES = ("k1", "kl", "abs", "mse", "k2", "low_var_kl", "k3")
TOPK_MODES = ("forward_kl_topk", "kl_topk")  # over the teacher's top-k tokens' distribution (the teacher's pass keeps k)
KL_TYPES = ("forward", "reverse", "mixed")  # kl_topk's direction
LOG_INFINITESIMAL = -100.0  # kl_topk with zero_outside_topk: the teacher's log-prob outside its top k (NeMo-RL's)


@dataclass(frozen=True)
class DistillSettings:
    loss_mode: str = "k3"
    use_policy_gradient: bool = False
    use_task_rewards: bool = False
    coef: float = 1.0  # distillation_loss_coef: the distillation loss's weight beside the task's (use_task_rewards)
    loss_max_clamp: float | None = None  # each token's divergence at most this
    log_prob_min_clamp: float | None = None  # both log-probs at least this (a token the teacher finds impossible)
    topk: int | None = None  # the top-k modes: the teacher's k most likely tokens at each position
    kl_type: str = "mixed"  # kl_topk: forward | reverse | mixed
    mixed_kl_weight: float = 0.5  # kl_topk mixed: the forward KL's weight
    zero_outside_topk: bool = False  # kl_topk: the student's probabilities as they are, the teacher's 0 outside k

    @property
    def uses_topk(self) -> bool:
        return self.loss_mode in TOPK_MODES


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
    return _clamped(d, s)


def route(values: list, keys: list[str]) -> dict[str, list[int]]:
    """Several teachers: each row to the teacher whose key is the row's routing value -> {key: row indices},
    teachers without rows left out. A value no teacher has is a ValueError naming it and the keys.

    Example: route(["gsm8k", "geo", "gsm8k"], ["gsm8k", "geo"]) -> {"gsm8k": [0, 2], "geo": [1]}."""
    rows: dict[str, list[int]] = {}
    for i, value in enumerate(values):
        if str(value) not in keys:
            raise ValueError(f"row {i}'s routing value {value!r} names no teacher (their keys: {', '.join(keys)})")
        rows.setdefault(str(value), []).append(i)
    return rows


def _clamped(d: torch.Tensor, s: DistillSettings) -> torch.Tensor:
    """loss_max_clamp on both sides, as verl clamps (k1 may be negative)."""
    return d.clamp(-s.loss_max_clamp, s.loss_max_clamp) if s.loss_max_clamp is not None else d


def topk_divergence(student_topk_lp: torch.Tensor, teacher_topk_lp: torch.Tensor, s: DistillSettings,
                    student_neg_entropy: torch.Tensor | None = None) -> torch.Tensor:
    """Per-position divergence [n, R] of the top-k modes (module docstring). student_topk_lp, teacher_topk_lp
    [n, R, k]: each model's log-probs over the whole vocabulary at the teacher's top-k ids; student_neg_entropy
    [n, R]: sum over the vocabulary of p_s log p_s (kl_topk with zero_outside_topk, reverse or mixed only).

    Example, forward_kl_topk with k = 2: teacher log-probs [log 0.5, log 0.3], student [log 0.25, log 0.25]
    -> 0.5 log 2 + 0.3 log 1.2 = 0.401. kl_topk forward renormalises both over the k first: teacher [0.625,
    0.375], student [0.5, 0.5] -> 0.625 log 1.25 + 0.375 log 0.75 = 0.0316."""
    t, st = teacher_topk_lp.float(), student_topk_lp.float()
    if s.loss_mode == "forward_kl_topk":
        if s.log_prob_min_clamp is not None:
            t, st = t.clamp(min=s.log_prob_min_clamp), st.clamp(min=s.log_prob_min_clamp)
        return _clamped((t.exp() * (t - st)).sum(-1).clamp(min=0.0), s)
    if s.loss_mode != "kl_topk":
        raise ValueError(f"distillation loss_mode {s.loss_mode!r} is not one of the top-k modes {TOPK_MODES}")
    t = torch.log_softmax(t, dim=-1)  # the teacher's distribution over its top k
    if not s.zero_outside_topk:
        st = torch.log_softmax(st, dim=-1)
    forward = (t.exp() * (t - st)).sum(-1)
    reverse = (st.exp() * (st - t)).sum(-1)
    if s.zero_outside_topk and s.kl_type != "forward":  # the student's mass outside the k, the teacher's ~0 there
        rest_neg_entropy = student_neg_entropy - (st.exp() * st).sum(-1)
        reverse = reverse + rest_neg_entropy - LOG_INFINITESIMAL * (1.0 - st.exp().sum(-1))
    w = {"forward": 1.0, "reverse": 0.0}.get(s.kl_type, s.mixed_kl_weight)
    return _clamped(w * forward + (1.0 - w) * reverse, s)


def distillation_advantages(old_lp: torch.Tensor, teacher_lp: torch.Tensor, mask: torch.Tensor,
                            s: DistillSettings) -> torch.Tensor:
    """use_policy_gradient: each token's advantage [n, R], -d_t of the sampling policy's log-probs, masked.

    Example, k1: old [[-1.0, -0.5]], teacher [[-3.0, -0.5]], mask [[1, 1]] -> [[-2.0, 0.0]]: the token the
    teacher likes less is pushed down, the one they agree on is left alone."""
    return -token_divergence(old_lp.detach(), teacher_lp, s) * mask
