"""Numerical faults: which quantity of a step first went NaN or inf, and
when a run of such steps stops training.

A step's update inputs are checked in the order the step makes them, then
the update's own losses and gradient norms; the first that is not finite
names the fault. An update whose loss or gradient norm is not finite never
steps (training/actor.py), so a faulty step leaves the weights as they were.

    first_nonfinite_input(batch)                   # None, or e.g. "advantages"
    update_fault({"actor/pg_loss": nan, ...})      # "actor/pg_loss"
    guard = NonfiniteGuard(limit=3)
    guard.observe(7, "actor/pg_loss")              # -> 1.0, the run's count of faulty steps
    guard.exhausted                                # True after 3 faulty steps in a row
"""

from __future__ import annotations

import math

import torch

# batch fields an update reads, in the order the step computes them
UPDATE_INPUTS = ("old_log_probs", "rollout_is_weights", "ref_log_probs", "teacher_log_probs", "values",
                 "token_level_rewards", "advantages", "returns")
# update metrics, in the order the update computes them (the critic updates first)
UPDATE_LOSSES = ("critic/vf_loss", "critic/loss", "actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/loss",
                 "train/loss")  # the last: posttrain sft's
# a skipped step with finite losses was skipped for its gradient norm
SKIP_COUNTS = {"critic/nonfinite_updates": "critic/grad_norm", "actor/nonfinite_updates": "actor/grad_norm",
               "train/nonfinite_updates": "train/grad_norm"}


def first_nonfinite_input(batch) -> str | None:
    """The first of the batch's UPDATE_INPUTS with a NaN or inf on a valid
    response token (padding may hold anything), or None."""
    valid = batch.response_mask.bool()  # [N, R]
    for name in UPDATE_INPUTS:
        t = getattr(batch, name, None)
        if t is not None and not bool(torch.isfinite(t[valid]).all()):
            return name
    return None


def update_fault(metrics: dict[str, float]) -> str | None:
    """The first non-finite update loss of a step's metrics, else the
    gradient norm of an update that was skipped, else None."""
    for key in UPDATE_LOSSES:
        if key in metrics and not math.isfinite(metrics[key]):
            return key
    for count, norm in SKIP_COUNTS.items():
        if metrics.get(count, 0.0) > 0:
            return norm
    return None


class NonfiniteGuard:
    """Counts faulty steps: `total` over the run (actor/nonfinite_steps) and
    the current streak; `exhausted` once `limit` faulty steps came in a row
    (limit <= 0: never)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.total = 0
        self.streak = 0
        self.first: tuple[int, str] | None = None  # (step, quantity) that began the current streak

    def observe(self, step: int, fault: str | None) -> float:
        """Record step `step` (1-based) and its fault (None: a good step) -> total."""
        if fault is None:
            self.streak, self.first = 0, None
            return float(self.total)
        self.total += 1
        self.streak += 1
        if self.first is None:
            self.first = (step, fault)
        return float(self.total)

    @property
    def exhausted(self) -> bool:
        return self.limit > 0 and self.streak >= self.limit

    def message(self, step: int, checkpoint_dir) -> str:
        first_step, quantity = self.first or (step, "?")
        return (f"stopped at step {step}: {self.streak} steps in a row had a non-finite {quantity} (first at step "
                f"{first_step}), so their updates were skipped; the weights of the last good step are saved in "
                f"{checkpoint_dir}. Lower actor.lr, look at those steps' data and rewards (metrics.jsonl, "
                f"samples.jsonl), or raise trainer.max_nonfinite_steps (now {self.limit})")

    def state_dict(self) -> dict:
        return {"total": self.total, "streak": self.streak, "first": list(self.first) if self.first else None}

    def load_state_dict(self, state: dict) -> None:
        self.total, self.streak = int(state.get("total", 0)), int(state.get("streak", 0))
        self.first = tuple(state["first"]) if state.get("first") else None
