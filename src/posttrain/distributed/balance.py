"""Splitting a batch over workers (the answers are joined by rollout/base.py's concat_rollouts).

Every worker must run the same number of forward passes (each one gathers
FSDP2 shards with the others), so rows are split into equal counts; within
that, rows are spread so each worker gets about the same number of tokens.
"""

from __future__ import annotations


def balanced_partition(lengths: list[int], parts: int) -> list[list[int]]:
    """Indices of `lengths` in `parts` groups of equal size (len % parts == 0),
    with nearly equal sums: longest first, each to the lightest group that
    still has room. Each group's indices are in ascending order.

    [5, 1, 4, 2], 2 -> [[0, 1], [2, 3]] (sums 6 and 6)
    """
    if len(lengths) % parts:
        raise ValueError(f"{len(lengths)} rows cannot be split evenly over {parts} workers")
    size = len(lengths) // parts
    groups: list[list[int]] = [[] for _ in range(parts)]
    sums = [0] * parts
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        open_groups = [g for g in range(parts) if len(groups[g]) < size]
        g = min(open_groups, key=lambda g: (sums[g], g))
        groups[g].append(i)
        sums[g] += lengths[i]
    return [sorted(g) for g in groups]


def minibatch_shards(lengths: list[int], mini_batch_size: int, parts: int) -> list[list[int]]:
    """For data-parallel training: each worker's rows, mini-batch by mini-batch.

    Mini-batch k is rows [k*M, (k+1)*M) as in one process; its rows are
    balanced over the workers, and worker w's list is its share of mini-batch
    0, then of mini-batch 1, ... so its own mini-batches have M / parts rows.
    """
    shards: list[list[int]] = [[] for _ in range(parts)]
    for start in range(0, len(lengths), mini_batch_size):
        rows = list(range(start, min(start + mini_batch_size, len(lengths))))
        for w, group in enumerate(balanced_partition([lengths[i] for i in rows], parts)):
            shards[w].extend(rows[i] for i in group)
    return shards
