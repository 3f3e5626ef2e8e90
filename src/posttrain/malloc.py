"""glibc's malloc told to keep the memory a CPU step frees, for the next
allocation to reuse.

torch on the CPU allocates every tensor with malloc. glibc serves a large
block (above 128 KiB to 32 MiB, adaptively) with a fresh mmap and unmaps it
when freed, so the next tensor of that size starts as untouched pages: the
kernel zero-fills each 4 KiB page at its first write. An RL step allocates
and frees tensors of hundreds of MB over and over (a micro-batch's [n, R, V]
logits and their log-softmax, activations and their gradients), and those
page faults cost more than the arithmetic on them: on SmolLM2-135M the
update took 17.2 s with them and 14.3 s without, a [64, 16, 49152] log-prob
and entropy with its backward 0.42 s against 0.13 s (bench/README.md).

`reuse_freed_memory()` sets two of malloc's parameters (mallopt) for the
whole process: no block is served by mmap (all come from the heap, whose
freed blocks are reused), and freed memory at the heap's top is not given
back to the system. The process then holds its peak: as a GPU's caching
allocator does, memory once used stays with the process until it ends.
Only on Linux with glibc; elsewhere it does nothing and says so.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform
import sys

M_TRIM_THRESHOLD = -1  # mallopt parameters (malloc.h)
M_MMAP_MAX = -4
NEVER_TRIM = 2**31 - 1  # the most mallopt's int holds: up to 2 GiB freed at the heap's top is kept


def reuse_freed_memory() -> bool:
    """Make this process's malloc keep and reuse what it frees; -> whether it
    could (False off glibc, where the allocator is left as it is)."""
    if sys.platform != "linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, NEVER_TRIM))
