"""Statistics over a mask's valid tokens and sequences without making the host wait for the device.

`x[mask]` is a host sync: its output's size is the mask's count, which the host must learn from the device.
`Picks` holds the same selection as integer indices (the elements `x[mask]` takes, in its order, so a
statistic over them is the same bit for bit), made with `torch.nonzero_static` from counts the caller knows
(a micro-batch's plan reads them on the host with the rest of the batch) or else reads once. `read` turns a
dict of 0-d tensors into Python floats in one read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Picks:
    """The valid tokens of a [N, R] mask (`tokens`: flat indices, row-major) and its rows with a valid token
    (`sequences`)."""

    tokens: torch.Tensor
    sequences: torch.Tensor

    @property
    def n_tokens(self) -> int:
        return self.tokens.shape[0]

    def token(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, R] -> [T]: x[mask]."""
        return x.reshape(-1)[self.tokens]

    def sequence(self, x: torch.Tensor) -> torch.Tensor:
        """x [N] -> [S]: x[mask.any(-1)]."""
        return x[self.sequences]


def picks(valid: torch.Tensor, counts: tuple[int, int] | None = None) -> Picks:
    """`valid` [N, R] bool -> its Picks. `counts`: (valid tokens, rows with one) when the caller knows them
    (they must be right: the indices are the first that many); None reads them from the device, once."""
    has = valid.any(-1)
    if counts is None:
        counts = torch.stack([valid.sum(), has.sum()]).tolist()
    n_tokens, n_sequences = counts
    return Picks(torch.nonzero_static(valid.reshape(-1), size=int(n_tokens)).reshape(-1),
                 torch.nonzero_static(has, size=int(n_sequences)).reshape(-1))


def read(metrics: dict) -> dict[str, float]:
    """A dict of 0-d tensors (and floats) -> Python floats, the tensors' in one read (as float(t) each: a
    float32 value widened to float64 exactly)."""
    tensors = [v.detach().double().reshape(()) for v in metrics.values() if isinstance(v, torch.Tensor)]
    values = iter(torch.stack(tensors).tolist() if tensors else [])
    return {k: next(values) if isinstance(v, torch.Tensor) else float(v) for k, v in metrics.items()}
