"""verl's newer rejection rules (0.7 on): `rollout_rs` as a comma list of options, each a statistic
of the log-ratio log r = log pi_target - log pi_behaviour (safety-bounded to [-20, 20] per token)
and a bound on it. `RolloutCorrection.rs_rules` holds them; `correct` applies them.

Per token: k1 = -log r, k2 = 0.5 (log r)^2, k3 = r - 1 - log r (k2 and k3 are never negative,
0 at r = 1; k3 weighs r > 1 more than r < 1 for the same |log r|). Options:

- token_k1, token_k2, token_k3: the token's own statistic; a token failing leaves the mask;
- seq_sum_k*, seq_mean_k*, seq_max_k2/k3: the sum, mean or max of the token statistic over the
  sequence's valid tokens; a sequence failing leaves the mask whole.

k2/k3 options keep what is <= `upper`. k1 options keep log(lower) <= k1 <= log(upper), as verl
compares them: since k1 = -log r, the kept ratio band is [1 / upper, 1 / lower] (the token's ratio,
the sequence's product for seq_sum_k1, its geometric mean for seq_mean_k1), which is [lower, upper]
only when lower = 1 / upper, as verl's single-value spelling U (lower 1 / U) gives. So verl 0.6's
`rollout_rs` sequence / geometric with the ratio band [lo, hi] is seq_sum_k1 / seq_mean_k1 with
lower 1 / hi, upper 1 / lo; the same mask, except that 0.6 bounds the sequence's summed or mean
log-ratio to [-20, 20] where the rules bound each token's.

dialects/verl/rollout_correction.py's `parse_rules` reads verl's `rollout_rs` / `rollout_rs_threshold`
pair into these rules.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from posttrain.algorithms.picks import Picks

RS_OPTIONS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
              "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")


@dataclass(frozen=True)
class RejectRule:
    """One of verl's newer `rollout_rs` options with its bounds; `lower` only for the k1 options."""

    option: str  # one of RS_OPTIONS
    lower: float | None  # k1: the lower bound of exp(k1) = 1 / r (the ratio's upper bound is 1 / lower)
    upper: float  # k1: the upper bound of 1 / r (the ratio's lower bound is 1 / upper); k2/k3: of the statistic

    @property
    def level(self) -> str:
        """"token" for the token_* options, else "sequence"."""
        return "token" if self.option.startswith("token_") else "sequence"

    def ratio_band(self) -> tuple[float, float]:
        """A k1 rule's kept band on the ratio (token, product or geometric mean): [1 / upper, 1 / lower]."""
        if not self.option.endswith("k1"):
            raise ValueError(f"{self.option} bounds a divergence, not the ratio")
        return 1.0 / self.upper, 1.0 / self.lower

    def problem(self) -> str | None:
        """Why the rule is not valid, or None."""
        if self.option not in RS_OPTIONS:
            return f"unknown option {self.option!r}; known: {', '.join(RS_OPTIONS)}"
        k1 = self.option.endswith("k1")
        if k1 and self.lower is None:
            return f"{self.option} needs lower and upper (verl's 'lower_upper'; a single U means lower 1 / U)"
        if not k1 and self.lower is not None:
            return f"{self.option} takes one upper bound, no lower bound (only the k1 options have two)"
        bounds = (self.lower, self.upper) if k1 else (self.upper,)
        if not all(isinstance(b, (int, float)) and not isinstance(b, bool) and b > 0 for b in bounds):
            return f"{self.option}'s bounds must be numbers > 0, got {', '.join(repr(b) for b in bounds)}"
        if k1 and not self.lower < self.upper:
            return f"{self.option}'s lower bound {self.lower!r} must be below its upper bound {self.upper!r}"
        return None


def shares(prefix: str, rejected: torch.Tensor, p: Picks) -> dict[str, torch.Tensor]:
    """`{prefix}_masked_fraction` over the valid tokens and `{prefix}_seq_masked_fraction` over the
    sequences with a valid token (those with any token rejected); 0-d tensors, read by the caller."""
    return {f"{prefix}_masked_fraction": p.token(rejected).float().mean(),
            f"{prefix}_seq_masked_fraction": p.sequence(rejected.any(-1)).float().mean()}


def rule_rejects(rule: RejectRule, bounded_log_ratio: torch.Tensor, valid: torch.Tensor,
                 p: Picks) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """bounded_log_ratio [N, R] (0 at padding, clamped to the safety bound), valid [N, R] bool, `p` its
    valid tokens and rows with one (picks.py) -> (the valid tokens the rule rejects [N, R] bool, its metrics
    (0-d tensors), named
    `rollout_rs_{option}_*`: the masked shares; the statistic's mean over the valid tokens (a sequence's
    counting once a token, as verl) and max (over the valid tokens, or over the sequences); and at
    sequence level `_seq_mean`, the mean over the sequences)."""
    x = bounded_log_ratio
    kind = rule.option[-2:]
    token = -x if kind == "k1" else 0.5 * x.square() if kind == "k2" else x.exp() - 1 - x  # 0 at padding
    if rule.level == "token":
        stat = token
    elif rule.option.startswith("seq_sum"):
        stat = token.sum(-1)
    elif rule.option.startswith("seq_mean"):
        stat = token.sum(-1) / valid.sum(-1).clamp(min=1)
    else:  # seq_max; a row without a valid token gets -inf and counts nowhere
        stat = token.masked_fill(~valid, -math.inf).amax(-1)
    if kind == "k1":
        kept = (stat >= math.log(rule.lower)) & (stat <= math.log(rule.upper))
    else:
        kept = stat <= rule.upper
    if rule.level == "sequence":
        kept, stat = kept.unsqueeze(-1).expand_as(valid), stat.unsqueeze(-1).expand_as(x)
    rejected = valid & ~kept
    prefix = f"rollout_rs_{rule.option}"
    metrics = shares(prefix, rejected, p)
    metrics[f"{prefix}_mean"] = p.token(stat).mean()
    if rule.level == "token":
        metrics[f"{prefix}_max"] = p.token(stat).max()
    else:
        per_sequence = p.sequence(stat[:, 0])
        metrics[f"{prefix}_max"] = per_sequence.max()
        metrics[f"{prefix}_seq_mean"] = per_sequence.mean()
    return rejected, metrics
