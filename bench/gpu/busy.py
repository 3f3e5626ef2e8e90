"""How busy the device is over one training step: torch.profiler over the step,
the union of the device's activity intervals over the step's wall time.

On CUDA the profiler records CUDA activity only (no CPU ops: a decoding loop
launches hundreds of thousands of kernels a step, and recording each CPU op
beside them would slow the step it measures); the busy time is the union of
the kernel, memcpy and memset intervals (kernels replayed from a CUDA graph
count as they run: CUPTI records each), user annotations left out. On the CPU (the dry run) the
same over the CPU ops' intervals: how much of the step is spent inside torch
ops rather than in Python between them.

The wall time runs from the device being idle at the start (synchronised) to
it being idle at the end (synchronised), so every interval recorded lies
within it. Used by bench/gpu/speed.py (posttrain's step) and bench/trl_side.py
(TRL's); importing this module imports nothing but torch.
"""

from __future__ import annotations

import sys
import time
from contextlib import contextmanager

import torch

DEVICE_KINDS = ("kernel", "gpu_memcpy", "gpu_memset")
CPU_KINDS = ("cpu_op",)


def prepare_for_cuda_graphs() -> None:
    """Call before a CUDA graph is captured in a process that profiles a step later: a graph captured before
    the profiler's first start and replayed under it has crashed CUPTI (pytorch/pytorch#75504; the workaround
    torch.profiler._utils._init_for_cuda_graphs, pytorch/pytorch#100441). Nothing without CUDA."""
    if not torch.cuda.is_available():
        return
    try:
        from torch.profiler._utils import _init_for_cuda_graphs

        _init_for_cuda_graphs()
    except Exception as e:  # noqa: BLE001 (a private helper that may go: the profile is then taken without it)
        print(f"busy.py: torch.profiler._utils._init_for_cuda_graphs failed ({e}); profiling without it",
              file=sys.stderr)


def union_ns(intervals: list[tuple[int, int]]) -> int:
    """The total length of the union of [start, end) intervals (ns)."""
    total, cur_start, cur_end = 0, None, None
    for start, end in sorted(intervals):
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        elif end > cur_end:
            cur_end = end
    if cur_end is not None:
        total += cur_end - cur_start
    return total


def _sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


class StepBusy:
    """start() ... stop() -> {"busy_fraction", "busy_s", "wall_s", "intervals", "source"}; never raises
    out of stop(): a profiler that fails gives busy_fraction None and the error."""

    def __init__(self, cuda: bool | None = None):
        self.cuda = torch.cuda.is_available() if cuda is None else cuda
        self._prof = None
        self._t0 = 0.0
        self.error: str | None = None
        self.kinds: dict[str, int] = {}

    def start(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        activity = ProfilerActivity.CUDA if self.cuda else ProfilerActivity.CPU
        try:
            self._prof = profile(activities=[activity], record_shapes=False, profile_memory=False, with_stack=False)
            _sync(self.cuda)
            self._prof.start()
        except Exception as e:  # noqa: BLE001 (a profiler that cannot start leaves the run as it is)
            self._prof, self.error = None, f"{type(e).__name__}: {e}"
        _sync(self.cuda)
        self._t0 = time.perf_counter()

    def stop(self) -> dict:
        _sync(self.cuda)
        wall = time.perf_counter() - self._t0
        out = {"busy_fraction": None, "busy_s": None, "wall_s": round(wall, 4), "intervals": 0,
               "source": "CUDA kernels, memcpy and memset" if self.cuda else "CPU ops (the dry run: no GPU)"}
        if self._prof is None:
            out["error"] = self.error or "the profiler did not start"
            return out
        try:
            self._prof.stop()
            intervals = self._intervals()
        except Exception as e:  # noqa: BLE001
            out["error"] = f"{type(e).__name__}: {e}"
            return out
        finally:
            self._prof = None
        busy = union_ns(intervals) / 1e9
        out.update(busy_s=round(busy, 4), intervals=len(intervals), kinds=self.kinds,
                   busy_fraction=round(min(1.0, busy / wall), 4) if wall > 0 else None)
        return out

    def _intervals(self) -> list[tuple[int, int]]:
        """The kept events' [start, end) in ns: on CUDA kineto's "kernel", "gpu_memcpy" and "gpu_memset"
        activities (not "gpu_user_annotation", the CPU's ranges mirrored onto the device's timeline), on the
        CPU its "cpu_op"s; self.kinds counts the kept ones by kind."""
        want = DEVICE_KINDS if self.cuda else CPU_KINDS
        out, self.kinds = [], {}
        for e in self._prof.profiler.kineto_results.events():
            kind = str(e.activity_type())
            if kind not in want or e.duration_ns() <= 0:
                continue
            self.kinds[kind] = self.kinds.get(kind, 0) + 1
            out.append((e.start_ns(), e.start_ns() + e.duration_ns()))
        return out


@contextmanager
def profiled_step(results: dict, cuda: bool | None = None):
    """`with profiled_step(d):` the block's busy fraction into d (StepBusy.stop's dict)."""
    busy = StepBusy(cuda)
    busy.start()
    try:
        yield
    finally:
        results.update(busy.stop())
