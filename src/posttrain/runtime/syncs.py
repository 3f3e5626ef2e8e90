"""Counting the operations that make the host wait for the device, on any device (the CPU included).

A GPU runs ahead of the Python that queues its kernels until the host needs a result: a scalar read
(`.item()`, `bool(t)`, `int(t)`), an output whose size depends on the data (`nonzero`, a boolean mask's
indexing, `unique`), a comparison answered on the host (`torch.equal`), a copy to host memory (`.tolist()`).
Each one drains the queue. On the CPU nothing waits, but the same calls are made: counting them there tells how
often the code would stall a GPU, and a test can hold the count down without one.

    with HostSyncs() as syncs:
        engine.generate(prompts, params)
    syncs.count, syncs.by_op   # 12, {"aten._local_scalar_dense": 8, "aten.nonzero": 4}

Not counted: a copy to host memory made with `.cpu()` / `.to("cpu")` (on the CPU it is no operation at all).
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
# operations whose result the host must have before it can go on (a value, or an output's size)
SYNCING = {aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default,
           aten.unique_consecutive.default, aten._unique2.default, aten.unique_dim.default, aten.equal.default,
           aten.allclose.default, aten.repeat_interleave.Tensor, aten.repeat_interleave.self_Tensor}
# reads of a whole tensor into Python, seen as method calls (they are no dispatched operation)
HOST_READS = {torch.Tensor.tolist, torch.Tensor.numpy}


def _boolean_index(func, args) -> bool:
    """t[mask] or t[mask] = v: indexing by a boolean tensor, whose output size is the mask's count."""
    if func not in (aten.index.Tensor, aten.index_put_.default, aten.index_put.default):
        return False
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or ()))


class _Dispatched(TorchDispatchMode):
    def __init__(self, tally: Counter):
        super().__init__()
        self.tally = tally

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in SYNCING or _boolean_index(func, args):
            self.tally[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


class _Called(TorchFunctionMode):
    def __init__(self, tally: Counter):
        super().__init__()
        self.tally = tally

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in HOST_READS:
            self.tally[f"Tensor.{func.__name__}"] += 1
        return func(*args, **(kwargs or {}))


class HostSyncs:
    """A context that counts host syncs (see the module): `count` in all, `by_op` by operation."""

    def __init__(self):
        self.by_op: Counter = Counter()
        self._modes = (_Called(self.by_op), _Dispatched(self.by_op))

    @property
    def count(self) -> int:
        return sum(self.by_op.values())

    def __enter__(self) -> "HostSyncs":
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
