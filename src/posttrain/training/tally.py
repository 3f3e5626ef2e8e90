"""The update's numbers kept on the device and read back rarely: the micro-batches' weighted metric sums
(read once, at the end of the update) and each optimizer step's loss and gradient norm (read once per step,
which must know whether they are finite).

A metric that is a 0-d tensor is summed as a float64 tensor where it was computed, with the same float64
arithmetic as a Python float (`float(v) * w` then `+`), so the values read equal the Python sums exactly;
a Python float is summed as one.
"""

from __future__ import annotations

import math

import torch


class Tally:
    """Weighted sums of metrics: `add(metrics, w)` per micro-batch, `read()` once."""

    def __init__(self):
        self.sums: dict[str, float | torch.Tensor] = {}

    def add(self, metrics: dict, weight: float) -> None:
        for key, value in metrics.items():
            term = value.detach().double() * weight if isinstance(value, torch.Tensor) else value * weight
            self.sums[key] = self.sums.get(key, 0.0) + term

    def read(self) -> dict[str, float]:
        """-> the sums as Python floats: the tensors' in one read."""
        return dict(zip(self.sums, host_values(list(self.sums.values()))))


def host_values(values: list) -> list[float]:
    """Python floats of `values` (0-d tensors, anywhere, and floats): the tensors' in one read."""
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    if not tensors:
        return [float(v) for v in values]
    device = tensors[0].device
    read = iter(torch.stack([t.detach().double().to(device).reshape(()) for t in tensors]).tolist())
    return [next(read) if isinstance(v, torch.Tensor) else float(v) for v in values]


def step_values(loss, grad_norm, world_size: int = 1, device=None) -> tuple[bool, float, float]:
    """An optimizer step's (may it step, loss, gradient norm), in one read: it may when its loss and
    gradient norm are finite here and, with several workers, on every worker (a worker whose own loss was
    inf while the summed gradients stayed finite must not step alone; `device`: where they agree)."""
    if world_size > 1:
        import torch.distributed as dist

        if dist.is_initialized():
            loss_t = torch.as_tensor(loss, dtype=torch.float64, device=device)
            norm_t = torch.as_tensor(grad_norm, dtype=torch.float64, device=device)
            # NCCL reduces device tensors only
            flag = (~(torch.isfinite(loss_t) & torch.isfinite(norm_t))).double().reshape(1)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            loss_v, norm_v, bad = host_values([loss_t, norm_t, flag[0]])
            return bad == 0.0, loss_v, norm_v
    loss_v, norm_v = host_values([loss, grad_norm])
    return math.isfinite(loss_v) and math.isfinite(norm_v), loss_v, norm_v


def all_finite(loss: float, grad_norm: float, world_size: int = 1, device=None) -> bool:
    """Whether an update whose values were read already (the SFT update's) may
    step: loss and gradient norm finite here and, with several workers, on
    every worker (a worker whose own loss was inf while the summed gradients
    stayed finite must not step alone)."""
    ok = math.isfinite(loss) and math.isfinite(grad_norm)
    if world_size > 1:
        import torch.distributed as dist

        if dist.is_initialized():
            flag = torch.tensor([0.0 if ok else 1.0], device=device)  # NCCL reduces device tensors only
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            ok = flag.item() == 0.0
    return ok
