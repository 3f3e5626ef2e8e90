"""The critic's loss and how well its values explain the returns: pure tensor functions."""

from __future__ import annotations

import torch

from posttrain.algorithms.losses import agg_loss, masked_mean


def value_loss(vpreds: torch.Tensor, returns: torch.Tensor, values: torch.Tensor, response_mask: torch.Tensor,
               cliprange_value: float = 0.5, loss_agg_mode: str = "token-mean", *,
               loss_scale_factor: float | None = None) -> dict[str, torch.Tensor]:
    """PPO's clipped value loss; every input is [B, T].

    vpreds are the critic's new predictions (with grad), values its
    predictions when the batch was made, returns the targets. Per token:
        clipped = clip(vpreds, values - cliprange_value, values + cliprange_value)
        loss_t  = max((vpreds - returns)^2, (clipped - returns)^2)
    and vf_loss = 0.5 * agg_loss(loss, mask, loss_agg_mode).

    -> {"vf_loss": scalar with grad through vpreds, "vf_clipfrac": share of
    valid tokens where the clipped error was the larger (detached)}
    Both are 0 when no token is valid (verl divides 0 by 0 there).

    Example (cliprange 0.5, token-mean), three tokens:
        values 0, returns 1, vpred 0.3: clipped 0.3, max(0.49, 0.49) = 0.49
        values 0, returns 1, vpred 2.0: clipped 0.5, max(1.0, 0.25)  = 1.0
        values 2, returns 1, vpred 1.0: clipped 1.5, max(0.0, 0.25)  = 0.25 (the clipped term wins)
    vf_loss = 0.5 * (0.49 + 1.0 + 0.25) / 3 = 0.29, vf_clipfrac 1/3.
    """
    mask = response_mask.to(vpreds.dtype)
    # clamp to tensors (not values + clamp(vpreds - values)): inside the range the result is vpreds exactly
    clipped = torch.clamp(vpreds, values - cliprange_value, values + cliprange_value)
    loss1 = (vpreds - returns) ** 2
    loss2 = (clipped - returns) ** 2
    per_token = torch.maximum(loss1, loss2)
    with torch.no_grad():
        clipfrac = masked_mean((loss2 > loss1).to(mask.dtype), mask)
    return {"vf_loss": 0.5 * agg_loss(per_token, mask, loss_agg_mode, loss_scale_factor=loss_scale_factor),
            "vf_clipfrac": clipfrac}


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """1 - Var[returns - values] / (Var[returns] + 1e-5) over valid tokens
    (unbiased variances, verl's critic/vf_explained_var). values, returns,
    mask: [B, T] -> a detached scalar, float32 (float64 for float64 inputs).

    1 when the values predict the returns exactly (or up to a constant: the
    measure ignores bias), about 0 for values equal to the mean return,
    negative when they are worse than that. When Var[returns] = 0 the
    divisor is 1e-5: 1 if the errors are constant, -Var[errors] / 1e-5 + 1
    (very negative) otherwise, as in verl. Fewer than 2 valid tokens -> 0
    (verl gives NaN: an unbiased variance of one sample, or of none).

    Example: returns [1, 2, 3], values [1, 2, 3] -> 1.0; values [2, 2, 2] -> 1 - 1 / 1.00001 = 1e-5.
    """
    m = mask.bool()
    dtype = torch.promote_types(returns.dtype, torch.float32)
    r, v = returns.detach().to(dtype), values.detach().to(dtype)
    n = m.sum().to(dtype)
    # masked sums instead of r[m] and a count read: no host sync (the sums' rounding differs from torch.var's
    # over the selected elements by a few ulps)

    def var(x):  # unbiased, over the valid tokens
        x = torch.where(m, x, 0)
        return torch.where(m, x - x.sum() / n.clamp(min=1), 0).square().sum() / (n - 1).clamp(min=1)

    ev = 1.0 - var(r - v) / (var(r) + 1e-5)
    return torch.where(n >= 2, ev, torch.zeros((), dtype=dtype, device=returns.device))
