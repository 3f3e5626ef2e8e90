"""glibc's malloc told to keep the memory a CPU step frees, for the next
allocation to reuse.

torch on the CPU allocates every tensor with malloc. glibc serves a large
block (above 128 KiB to 32 MiB, adaptively) with a fresh mmap and unmaps it
when freed, so the next tensor of that size starts as untouched pages: the
kernel zero-fills each 4 KiB page at its first write. An RL step allocates
and frees tensors of hundreds of MB over and over (a micro-batch's [n, R, V]
logits and their log-softmax, activations and their gradients), and those
page faults cost more than the arithmetic on them: a [64, 16, 49152]
log-prob and entropy with its backward takes twice as long with them
(bench/cpu_levers.py), and a whole SmolLM2-135M step ~1.2x as long
(bench/README.md).

`reuse_freed_memory()` sets two of malloc's parameters (mallopt) for the
whole process: no block is served by mmap (all come from the heap, whose
freed blocks are reused), and up to 2 GiB freed at the heap's top is kept
rather than given back to the system. The process then holds about its peak:
as a GPU's caching allocator does, memory once used stays with the process
(SmolLM2's step peaked at 6.49 GiB resident without it, 6.60 GiB with it).
Only on Linux with glibc; elsewhere it does nothing (and returns False).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform
import sys

M_TRIM_THRESHOLD = -1  # mallopt parameters (malloc.h)
M_MMAP_MAX = -4
DEFAULT_MMAP_MAX, DEFAULT_TRIM_THRESHOLD = 65536, 128 * 1024  # glibc's
NEVER_TRIM = 2**31 - 1  # the most mallopt's int holds: up to 2 GiB freed at the heap's top is kept


_on = False  # whether this process set it


def reuse_freed_memory(on: bool = True) -> bool:
    """Make this process's malloc keep and reuse what it frees; -> whether it
    could (False off glibc, where the allocator is left as it is). on=False
    puts glibc's defaults back where an earlier call set it (the same
    process trains again with trainer.reuse_cpu_memory=false), and otherwise
    leaves malloc alone."""
    global _on
    if sys.platform != "linux" or platform.libc_ver()[0] != "glibc" or (not on and not _on):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    mmap_max, trim = (0, NEVER_TRIM) if on else (DEFAULT_MMAP_MAX, DEFAULT_TRIM_THRESHOLD)
    done = bool(mallopt(M_MMAP_MAX, mmap_max)) and bool(mallopt(M_TRIM_THRESHOLD, trim))
    _on = on and done
    return done
