"""Splitting a batch over workers and putting the answers back together.

Every worker must run the same number of forward passes (each one gathers
FSDP2 shards with the others), so rows are split into equal counts; within
that, rows are spread so each worker gets about the same number of tokens.
"""

from __future__ import annotations

import torch

from posttrain.rollout.base import RolloutOutput


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


def even_chunks(count: int, parts: int) -> list[range]:
    """Consecutive ranges of nearly equal size covering 0..count-1 (some may be empty).
    10, 3 -> [range(0, 4), range(4, 7), range(7, 10)]"""
    base, extra = divmod(count, parts)
    out, start = [], 0
    for p in range(parts):
        end = start + base + (1 if p < extra else 0)
        out.append(range(start, end))
        start = end
    return out


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


def concat_rollouts(outs: list[RolloutOutput], pad_token_id: int) -> RolloutOutput:
    """Rollouts of consecutive prompt chunks -> one, re-padded to common widths
    (prompts stay left-padded, responses right-padded)."""
    outs = [o for o in outs if o is not None and o.prompt_ids.shape[0] > 0]
    p_width = max(o.prompt_ids.shape[1] for o in outs)
    r_width = max(o.response_ids.shape[1] for o in outs)

    def pad(t, width, value, left):
        extra = width - t.shape[1]
        if extra == 0:
            return t
        fill = torch.full((t.shape[0], extra), value, dtype=t.dtype)
        return torch.cat([fill, t] if left else [t, fill], dim=1)

    log_probs = None
    if all(o.log_probs is not None for o in outs):
        log_probs = torch.cat([pad(o.log_probs, r_width, 0.0, False) for o in outs])
    truncated = torch.cat([o.truncated for o in outs]) if all(o.truncated is not None for o in outs) else None
    seen = None  # multi-turn rollouts' attention over the responses (tool tokens included)
    if any(o.response_attention_mask is not None for o in outs):
        seen = torch.cat([pad(o.response_mask if o.response_attention_mask is None else o.response_attention_mask,
                              r_width, 0, False) for o in outs])
    return RolloutOutput(
        prompt_ids=torch.cat([pad(o.prompt_ids, p_width, pad_token_id, True) for o in outs]),
        prompt_mask=torch.cat([pad(o.prompt_mask, p_width, 0, True) for o in outs]),
        response_ids=torch.cat([pad(o.response_ids, r_width, pad_token_id, False) for o in outs]),
        response_mask=torch.cat([pad(o.response_mask, r_width, 0, False) for o in outs]),
        log_probs=log_probs,
        truncated=truncated,
        response_attention_mask=seen,
    )
