"""The output layer in slices of the vocabulary, for decoding and the log-prob passes on the CPU.

A decoding step projects a few hundred hidden states onto the whole
vocabulary: [rows, H] x [H, V], with V in the tens of thousands. On the CPU
that one matmul runs well below the machine's matmul rate (its [H, V] weight
streams through the caches once per step, its [rows, V] output is written in
one piece); the same product computed a slice of VOCAB_SLICE columns at a
time, each written into its place of one output, runs ~1.2x as fast
(SmolLM2-135M, 128 rows x 49152: bench/README.md). Each logit is the same
dot product as the plain layer's (equal to float rounding). The log-prob
passes without a gradient (reference, old policy: [rows x R, H] x [H, V])
gain as well; a pass with a gradient keeps the plain layer.

    with sliced_head(model):   # within, the output layer computes its logits with sliced_linear
        out = model(...)
"""

from __future__ import annotations

import contextlib
import functools

import torch

VOCAB_SLICE = 2048  # output columns per matmul
MIN_VOCAB = 4 * VOCAB_SLICE  # below this the plain layer is as fast: left as it is


def sliced_linear(linear: torch.nn.Linear, hidden: torch.Tensor) -> torch.Tensor:
    """linear(hidden) ([..., H] -> [..., V]), VOCAB_SLICE output columns at a time, each written into its place.
    Where a gradient is wanted (mm with out= has none), or under autocast or with mixed dtypes, or with a shard,
    the plain layer's product."""
    weight, bias = linear.weight, linear.bias
    if ((torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)) or not plain(weight)
            or hidden.dtype != weight.dtype or torch.is_autocast_enabled(hidden.device.type)):
        return torch.nn.functional.linear(hidden, weight, bias)
    flat = hidden.reshape(-1, hidden.shape[-1])
    out = flat.new_empty((flat.shape[0], weight.shape[0]))
    for start in range(0, weight.shape[0], VOCAB_SLICE):
        part, rows = out[:, start:start + VOCAB_SLICE], weight[start:start + VOCAB_SLICE]
        if bias is None:
            torch.mm(flat, rows.t(), out=part)
        else:
            torch.addmm(bias[start:start + VOCAB_SLICE], flat, rows.t(), out=part)
    return out.reshape(*hidden.shape[:-1], weight.shape[0])


def plain(weight: torch.Tensor) -> bool:
    """A weight that is whole here (not a DTensor's shard: a sharded model's layer keeps its own product)."""
    from torch.distributed.tensor import DTensor

    return not isinstance(weight, DTensor)


def can_slice(model) -> bool:
    """Whether the model's output layer is a plain Linear on the CPU, large enough to gain."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return (type(head) is torch.nn.Linear and head.weight.device.type == "cpu" and plain(head.weight)
            and head.weight.shape[0] >= MIN_VOCAB)


@contextlib.contextmanager
def sliced_head(model, enabled: bool = True):
    """Within the block (no gradient) the model's output layer computes its logits with sliced_linear, when
    can_slice (else it is left as it is). The layer itself stays: its parameters and their names do not change
    (weights may be loaded into the model meanwhile)."""
    if not (enabled and can_slice(model)):
        yield
        return
    head = model.get_output_embeddings()
    head.forward = functools.partial(sliced_linear, head)  # an instance attribute: nn.Module calls it
    try:
        yield
    finally:
        del head.forward
