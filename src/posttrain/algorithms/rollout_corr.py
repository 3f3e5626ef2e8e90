"""How far the rollout engine's log-probs are from the trainer's, on the same sampled tokens.

The engine that samples (vLLM, its own kernels, maybe bf16) and the trainer
(its forward, float32 master weights) compute the same policy differently, so
the rollout is slightly off-policy even when the weights are the same. These
are verl's diagnostics of that gap (its `training/rollout_probs_diff_*` and
`rollout_corr/*` names), over the response tokens:

- `training/rollout_probs_diff_{mean,max,std}`: |p_rollout - p_train| per token;
- `rollout_corr/logp_abs_diff_{mean,max}`: |log p_rollout - log p_train| per token;
- `rollout_corr/kl`: KL(rollout || train) estimated on the rollout's own samples,
  the mean of log p_rollout - log p_train; `rollout_corr/k3_kl`: the k3 estimator,
  mean of exp(d) - 1 - d with d = log p_train - log p_rollout (never negative);
- `rollout_corr/{rollout,training}_ppl`: each sequence's perplexity (exp of its
  mean token negative log-prob) averaged over sequences, and
  `rollout_corr/log_ppl_diff`: the mean over sequences of rollout minus training log-perplexity.
"""

from __future__ import annotations

import torch


def mismatch_metrics(train_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor,
                     response_mask: torch.Tensor) -> dict[str, float]:
    """train_log_probs, rollout_log_probs, response_mask: [N, R] (1 on the tokens the policy sampled)."""
    mask = response_mask.bool()
    if not bool(mask.any()):
        return {}
    train, roll = train_log_probs.float(), rollout_log_probs.float()
    d = (roll - train)[mask]
    p_diff = (roll.exp() - train.exp()).abs()[mask]
    r = (train - roll)[mask]
    lengths = mask.sum(-1).clamp(min=1)
    has = mask.any(-1)
    train_log_ppl = -(train * mask).sum(-1)[has] / lengths[has]
    roll_log_ppl = -(roll * mask).sum(-1)[has] / lengths[has]
    return {
        "training/rollout_probs_diff_mean": float(p_diff.mean()),
        "training/rollout_probs_diff_max": float(p_diff.max()),
        "training/rollout_probs_diff_std": float(p_diff.std()) if p_diff.numel() > 1 else 0.0,
        "rollout_corr/logp_abs_diff_mean": float(d.abs().mean()),
        "rollout_corr/logp_abs_diff_max": float(d.abs().max()),
        "rollout_corr/kl": float(d.mean()),
        "rollout_corr/k3_kl": float((r.exp() - 1 - r).mean()),
        "rollout_corr/rollout_ppl": float(roll_log_ppl.exp().mean()),
        "rollout_corr/training_ppl": float(train_log_ppl.exp().mean()),
        "rollout_corr/log_ppl_diff": float((roll_log_ppl - train_log_ppl).mean()),
    }
