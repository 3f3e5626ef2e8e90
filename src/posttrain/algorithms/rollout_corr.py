"""How far the rollout engine's log-probs are from the trainer's, on the same sampled tokens,
and verl's corrections for that gap.

The engine that samples (vLLM, its own kernels, maybe bf16, maybe stale weights) and the
trainer (its forward, float32 master weights) compute the same policy differently, so the
rollout is slightly off-policy even when the weights are the same.

`mismatch_metrics` is verl's diagnostics of that gap (its `training/rollout_probs_diff_*` and
`rollout_corr/*` names), over the response tokens:

- `training/rollout_probs_diff_{mean,max,std}`: |p_rollout - p_train| per token;
- `rollout_corr/logp_abs_diff_{mean,max}`: |log p_rollout - log p_train| per token;
- `rollout_corr/kl`: KL(rollout || train) estimated on the rollout's own samples,
  the mean of log p_rollout - log p_train; `rollout_corr/k3_kl`: the k3 estimator,
  mean of exp(d) - 1 - d with d = log p_train - log p_rollout (never negative);
- `rollout_corr/{rollout,training}_ppl`: each sequence's perplexity (exp of its
  mean token negative log-prob) averaged over sequences, and
  `rollout_corr/log_ppl_diff`: the mean over sequences of rollout minus training log-perplexity.

`correct` is verl's rollout correction (verl/trainer/ppo/rollout_corr_helper.py,
docs/algo/rollout_corr.md), configured by a `RolloutCorrection`. It takes two log-prob
tensors, the target policy's and the behaviour policy's (the engine's), so the ratio
rho = pi_target / pi_behaviour is pi_old / pi_rollout in decoupled mode and
pi_theta / pi_rollout in bypass or pure-IS mode. Log-ratios are bounded to [-20, 20]
before any exp (the safety bound). Independent mechanisms:

- IS weights (`is_level`): "token", rho_t per token; "sequence", the product of the
  sequence's rho_t (exp of the sum of its log-ratios) on each of its tokens. Truncated
  from above at `is_threshold` (TIS), and from below at `is_threshold_lower` when set (not
  in verl; OpenRLHF's and NeMo-RL's `tis` have it); then, with `is_batch_normalize`, divided
  by their batch mean (token level: over the valid tokens; sequence level: over the
  sequences). Zero at padding, detached. The returned mask is not applied to them.
- Rejection sampling (`rs_level`): "token", "sequence" (product) or "geometric" (the
  geometric mean, exp of the mean log-ratio over the sequence's tokens); a token, or the
  whole sequence, whose safety-bounded ratio lies outside [`rs_threshold_lower`
  (default 1 / rs_threshold), `rs_threshold`] leaves the response mask (verl 0.6's `rollout_rs`).
- Rejection rules (`rs_rules`): verl's newer `rollout_rs` options (token_k1 ... seq_max_k3, a bound
  on a divergence statistic of the token or the sequence; rollout_rules.py), each a `RejectRule`.
  A token stays only if rs_level's band and every rule keep it.
- Veto (`token_veto_threshold`): a sequence with any token whose unbounded ratio is below
  the threshold leaves the response mask entirely.

Rejection metrics: `rollout_rs_{mean,max,min,ratio_fraction_high,ratio_fraction_low,std,
eff_sample_size}` are rs_level's ratio statistics (verl 0.6's names); each rule's are named after
its option, `rollout_rs_{option}_{masked_fraction,seq_masked_fraction,mean,max}` and at sequence
level `_seq_mean` (`_mean` is over the valid tokens, as verl's: a sequence's statistic counts once a
token; `_seq_mean` is over the sequences; `_max` over tokens or sequences); rs_level's own shares are `rollout_rs_{rs_level}_{masked_fraction,seq_masked_fraction}`
(`rollout_rs_sequence_masked_fraction`, ...). The totals `rollout_rs_masked_fraction` and
`rollout_rs_seq_masked_fraction` count everything rs_level and the rules reject together (not the veto).

Other frameworks' names, as combinations (C, m: their upper and lower bounds):

- NeMo-RL `truncated_importance_sampling_type: tis` (`truncated_importance_sampling_ratio`
  C, optional `..._ratio_min` m), TRL `vllm_importance_sampling_mode: token_truncate` ([m, C]),
  OpenRLHF `--vllm_is_correction_type tis` ([m, C]): is_level="token", is_threshold=C,
  is_threshold_lower=m (None where they have none). TRL `sequence_truncate`: is_level="sequence".
- IcePop (NeMo-RL and OpenRLHF `icepop`, [m, C]): is_level="token", is_threshold=C,
  rs_level="token", rs_threshold=C, rs_threshold_lower=m: raw ratios, two-sided token masking.
- `seq-mask-tis` (NeMo-RL and OpenRLHF, [m, C]): rs_level="geometric", rs_threshold=C,
  rs_threshold_lower=m, and token IS weights; both multiply by the raw, untruncated token
  ratio, which is is_level="token", is_threshold=math.inf (a finite threshold gives the
  truncated variant the name suggests).
- TRL `token_mask` / `sequence_mask` ([m, C], ratios outside zeroed; m 0 unless given): is_level
  "token" / "sequence" with is_threshold=C, and rs_level the same with rs_threshold=C,
  rs_threshold_lower=m. (TRL's C is `vllm_importance_sampling_clip_max`, formerly `_cap`; m
  `vllm_importance_sampling_clip_min`.)
- verl 0.6's presets: decoupled_token_is / decoupled_seq_is: is_level "token" / "sequence";
  decoupled_seq_is_rs: both at "sequence"; decoupled_geo_rs: rs_level="geometric" with a
  token veto, no IS weights. Its newer ones spell rejection as rules: decoupled_seq_is_rs
  seq_sum_k1 "0.5_2.0", the geo_rs presets seq_mean_k1, the k3_rs presets seq_mean_k3.

The translators of other frameworks' settings live with their dialects: dialects/verl/rollout_correction.py's
`from_verl` reads verl's keys (posttrain's algorithm.rollout_correction.*), either spelling, into a
RolloutCorrection; dialects/nemo_rl/rollout_correction.py's `from_nemo_rl` writes NeMo-RL's loss_fn settings as
those keys (the combinations above).

One difference: those other frameworks give a masked token a zero weight and keep it in the
loss's denominator; here, as in verl, rejection removes it from the response mask, so a
token-mean loss divides by the tokens kept.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from posttrain.algorithms.picks import Picks, picks, read
from posttrain.algorithms.rollout_rules import RejectRule, rule_rejects, shares

SAFETY_BOUND = 20.0  # log-ratios are clamped to [-20, 20] before exp: weights within [2e-9, 4.9e8]
IS_LEVELS = ("token", "sequence")
RS_LEVELS = ("token", "sequence", "geometric")


def mismatch_metrics(train_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor,
                     response_mask: torch.Tensor, counts: tuple[int, int] | None = None,
                     on_device: bool = False) -> dict:
    """train_log_probs, rollout_log_probs, response_mask: [N, R] (1 on the tokens the policy sampled).
    `counts`: the mask's valid tokens and rows with one, when the caller knows them (else read once);
    `on_device`: the metrics as 0-d tensors, for the caller to read with its others (else floats, one read)."""
    mask = response_mask.bool()
    p = picks(mask, counts)
    if p.n_tokens == 0:
        return {}
    train, roll = train_log_probs.float(), rollout_log_probs.float()
    d = p.token(roll - train)
    p_diff = p.token((roll.exp() - train.exp()).abs())
    lengths = p.sequence(mask.sum(-1).clamp(min=1))
    train_log_ppl = -p.sequence((train * mask).sum(-1)) / lengths
    roll_log_ppl = -p.sequence((roll * mask).sum(-1)) / lengths
    metrics = {
        "training/rollout_probs_diff_mean": p_diff.mean(),
        "training/rollout_probs_diff_max": p_diff.max(),
        "training/rollout_probs_diff_std": p_diff.std() if p.n_tokens > 1 else 0.0,
        "rollout_corr/logp_abs_diff_mean": d.abs().mean(),
        "rollout_corr/logp_abs_diff_max": d.abs().max(),
        "rollout_corr/kl": d.mean(),
        "rollout_corr/k3_kl": ((-d).exp() - 1 + d).mean(),  # exp(r) - 1 - r, r = log p_train - log p_rollout
        "rollout_corr/rollout_ppl": roll_log_ppl.exp().mean(),
        "rollout_corr/training_ppl": train_log_ppl.exp().mean(),
        "rollout_corr/log_ppl_diff": (roll_log_ppl - train_log_ppl).mean(),
    }
    return metrics if on_device else read(metrics)


@dataclass(frozen=True)
class RolloutCorrection:
    """verl's `rollout_correction` settings (rollout_is, rollout_is_threshold, ...); all off by default."""

    is_level: str | None = None  # "token", "sequence", or None: no IS weights
    is_threshold: float = 2.0  # IS weights truncated above (math.inf: not truncated)
    is_threshold_lower: float | None = None  # and below, when set (OpenRLHF's and NeMo-RL's tis)
    is_batch_normalize: bool = False  # IS weights divided by their batch mean, after truncation
    rs_level: str | None = None  # "token", "sequence", "geometric", or None: no rejection
    rs_threshold: float | None = None  # the band's upper bound, needed with rs_level
    rs_threshold_lower: float | None = None  # its lower bound, 1 / rs_threshold when None (0: none)
    token_veto_threshold: float | None = None  # a token ratio below it rejects its sequence
    rs_rules: tuple[RejectRule, ...] = ()  # verl's newer rejection options (rollout_rules.py), ANDed with rs_level

    def is_bounds(self) -> tuple[float, float]:
        """(lower, upper) of the IS metrics' band: the truncation floor, else 1 / is_threshold."""
        lower = 1.0 / self.is_threshold if self.is_threshold_lower is None else self.is_threshold_lower
        return lower, self.is_threshold

    def rs_bounds(self) -> tuple[float, float]:
        """(lower, upper) of the rejection band."""
        upper = self.rs_threshold
        lower = 1.0 / upper if self.rs_threshold_lower is None else self.rs_threshold_lower
        return lower, upper

    def validate(self) -> RolloutCorrection:
        """Raises ValueError on an unknown level, a bound that is not positive, an empty band,
        or a setting that does nothing (its level off); returns self."""
        def fail(message: str):
            raise ValueError(f"rollout correction: {message}")

        if self.is_level not in (None, *IS_LEVELS):
            fail(f"is_level must be one of {', '.join(IS_LEVELS)} or None (off), got {self.is_level!r}")
        if self.is_threshold is None or not self.is_threshold > 0:
            fail(f"is_threshold must be > 0 (the IS weights' upper truncation), got {self.is_threshold!r}")
        if self.is_level is None and (self.is_threshold_lower is not None or self.is_batch_normalize):
            fail("is_threshold_lower and is_batch_normalize act on IS weights: set is_level too")
        if self.is_threshold_lower is not None and not 0 <= self.is_threshold_lower < self.is_threshold:
            fail(f"is_threshold_lower must be >= 0 and below is_threshold ({self.is_threshold!r}), "
                 f"got {self.is_threshold_lower!r}")
        if self.rs_level not in (None, *RS_LEVELS):
            fail(f"rs_level must be one of {', '.join(RS_LEVELS)} or None (off), got {self.rs_level!r}")
        if self.rs_level is None:
            if self.rs_threshold is not None or self.rs_threshold_lower is not None:
                fail("rs_threshold and rs_threshold_lower bound rejection sampling: set rs_level too")
        elif self.rs_threshold is None:
            fail(f"rs_level={self.rs_level!r} needs rs_threshold (the accepted band's upper bound)")
        elif not self.rs_threshold > 0:
            fail(f"rs_threshold must be > 0, got {self.rs_threshold!r}")
        else:
            lower, upper = self.rs_bounds()
            if not 0 <= lower < upper:
                default = " (1 / rs_threshold by default: a threshold <= 1 needs its own rs_threshold_lower)" \
                    if self.rs_threshold_lower is None else ""
                fail(f"the rejection band [{lower!r}, {upper!r}] is empty: rs_threshold_lower must be >= 0 "
                     f"and below rs_threshold{default}")
        if self.token_veto_threshold is not None and not self.token_veto_threshold > 0:
            fail(f"token_veto_threshold must be > 0, got {self.token_veto_threshold!r}")
        if not isinstance(self.rs_rules, tuple):
            fail(f"rs_rules must be a tuple of RejectRule, got {type(self.rs_rules).__name__}")
        for rule in self.rs_rules:
            if not isinstance(rule, RejectRule):
                fail(f"rs_rules holds RejectRule, got {rule!r}")
            if rule.problem():
                fail(f"rs_rules: {rule.problem()}")
        options = [rule.option for rule in self.rs_rules]
        if len(set(options)) < len(options):
            fail(f"rs_rules lists an option twice: {', '.join(options)}")
        return self


def _ratios(log_ratio: torch.Tensor, valid: torch.Tensor, level: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log_ratio [N, R] (0 at padding) -> (the safety-bounded ratio at `level`, on every token
    [N, R]; the unbounded log-ratio of each sequence [N] at a sequence level, else None)."""
    if level == "token":
        return log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND).exp(), None
    per_sequence = log_ratio.sum(-1)
    if level == "geometric":
        per_sequence = per_sequence / valid.sum(-1).clamp(min=1)
    bounded = per_sequence.clamp(-SAFETY_BOUND, SAFETY_BOUND).exp()
    return bounded.unsqueeze(-1).expand_as(log_ratio), per_sequence


def _log(x: float) -> float:
    return math.log(x) if x > 0 else -math.inf


def _ratio_stats(prefix: str, ratio: torch.Tensor, per_sequence: torch.Tensor | None, p: Picks,
                 lower: float, upper: float) -> dict:
    """verl's statistics of a ratio before truncation or rejection (0-d tensors): mean over the valid tokens;
    max, min and the shares above `upper` / below `lower` over the valid tokens at token level,
    over the sequences (unbounded, in log space; max capped at e^20) at a sequence level; std and
    effective sample size (1 / mean((w / mean w)^2), a fraction of the tokens) of the ratios
    clamped to [lower, upper], over the valid tokens."""
    w = p.token(ratio)
    stats = {f"{prefix}_mean": w.mean()}
    if per_sequence is None:
        high, low = (w > upper).float().mean(), (w < lower).float().mean()
        stats[f"{prefix}_max"], stats[f"{prefix}_min"] = w.max(), w.min()
    else:
        s = p.sequence(per_sequence)
        high, low = (s > _log(upper)).float().mean(), (s < _log(lower)).float().mean()
        # exp in float64 on the device (was math.exp of the read value: an ulp apart at times)
        stats[f"{prefix}_max"] = s.max().double().clamp(max=SAFETY_BOUND).exp()
        stats[f"{prefix}_min"] = s.min().double().exp()
    stats[f"{prefix}_ratio_fraction_high"], stats[f"{prefix}_ratio_fraction_low"] = high, low
    clamped = w.clamp(min=lower, max=upper)
    mean = clamped.mean()
    stats[f"{prefix}_std"] = (clamped.square().mean() - mean.square()).clamp(min=0).sqrt() \
        if p.n_tokens > 1 else 0.0
    stats[f"{prefix}_eff_sample_size"] = 1.0 / (clamped / (mean + 1e-8)).square().mean()
    return stats


def correct(target_log_probs: torch.Tensor, behaviour_log_probs: torch.Tensor, response_mask: torch.Tensor,
            c: RolloutCorrection, counts: tuple[int, int] | None = None,
            on_device: bool = False) -> tuple[torch.Tensor | None, torch.Tensor, dict]:
    """target_log_probs (pi_old, or pi_theta in bypass mode), behaviour_log_probs (the rollout
    engine's), response_mask: [N, R] -> (IS weights [N, R] float32, or None without is_level;
    the response mask less the rejected tokens and sequences, same dtype; `rollout_corr/*`
    metrics, none when no token is valid). Sequence shares count the sequences with at least
    one valid token (verl divides by every row: the same when none is empty). `counts` and
    `on_device` as `mismatch_metrics`'s: with both, nothing is read back.

    Example: target probs [[0.5, 0.25]], behaviour [[0.25, 0.5]], mask [[1, 1]], is_level
    "token", is_threshold 1.5 -> weights [[1.5, 0.5]] (ratios 2 and 0.5), mask unchanged.
    """
    c.validate()
    if target_log_probs.shape != behaviour_log_probs.shape or target_log_probs.shape != response_mask.shape:
        raise ValueError(f"rollout correction: target log-probs {tuple(target_log_probs.shape)}, behaviour "
                         f"log-probs {tuple(behaviour_log_probs.shape)} and response mask "
                         f"{tuple(response_mask.shape)} must have one shape")
    valid = response_mask.bool()
    diff = target_log_probs.detach().float() - behaviour_log_probs.detach().float()
    log_ratio = torch.where(valid, diff, torch.zeros_like(diff))  # padding's values never count
    weights = None if c.is_level is None else torch.zeros_like(log_ratio)
    p = picks(valid, counts)
    if p.n_tokens == 0:
        return weights, response_mask.clone(), {}
    metrics: dict = {}
    keep = torch.ones_like(valid)

    if c.is_level is not None:
        lower, upper = c.is_bounds()
        ratio, per_sequence = _ratios(log_ratio, valid, c.is_level)
        metrics.update(_ratio_stats("rollout_is", ratio, per_sequence, p, lower, upper))
        weights = torch.where(valid, ratio.clamp(min=c.is_threshold_lower, max=upper), weights)
        if c.is_batch_normalize:
            if c.is_level == "token":
                mean = p.token(weights).mean()
            else:  # one weight a sequence
                mean = (p.sequence(weights.sum(-1)) / p.sequence(valid.sum(-1))).mean()
            usable = mean.double() > 1e-8  # else the weights stay as they are (factor 1): decided on the device
            weights = torch.where(usable, weights / mean, weights)
            metrics["rollout_is_batch_norm_factor"] = torch.where(usable, mean.double(), 1.0)

    rejected = torch.zeros_like(valid)  # by rs_level or any of rs_rules
    if c.rs_level is not None:
        lower, upper = c.rs_bounds()
        ratio, per_sequence = _ratios(log_ratio, valid, c.rs_level)
        metrics.update(_ratio_stats("rollout_rs", ratio, per_sequence, p, lower, upper))
        by_band = valid & ~((ratio >= lower) & (ratio <= upper))
        metrics.update(shares(f"rollout_rs_{c.rs_level}", by_band, p))
        rejected |= by_band
    bounded = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)  # per token, as verl's rules
    for rule in c.rs_rules:
        by_rule, rule_metrics = rule_rejects(rule, bounded, valid, p)
        metrics.update(rule_metrics)
        rejected |= by_rule
    if c.rs_level is not None or c.rs_rules:
        metrics.update(shares("rollout_rs", rejected, p))
        keep &= ~rejected

    if c.token_veto_threshold is not None:
        catastrophic = valid & (log_ratio < math.log(c.token_veto_threshold))  # the unbounded ratio
        vetoed = catastrophic.any(-1)
        metrics["rollout_is_veto_fraction"] = p.sequence(vetoed).float().mean()
        metrics["rollout_is_catastrophic_token_fraction"] = p.token(catastrophic).float().mean()
        keep &= ~vetoed.unsqueeze(-1)

    new_mask = torch.where(keep, response_mask, torch.zeros_like(response_mask))
    metrics = {f"rollout_corr/{k}": v for k, v in metrics.items()}
    return weights, new_mask, metrics if on_device else read(metrics)
