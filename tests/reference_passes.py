"""The log-prob and update passes' old steps, kept as a reference for the tests (and bench/dynamic_bsz.py):
a batch's micro-batches ordered and trimmed by reading its tensors back, where training/microbatch.py's plan
reads nothing. tests/test_fast_paths.py and tests/test_update_syncs.py check the plan against them.
"""

from __future__ import annotations

import dataclasses

import torch

from posttrain.training.microbatch import FULL_WIDTH


def trim_padding(mb):
    """The micro-batch without the columns that are padding in every row: left
    of its longest prompt and right of its longest response. Every [N, P+R]
    and [N, R] tensor is cut alike; positions keep their values, so the
    forward of what is left is that of the whole."""
    prompt_width = mb.prompt_width
    real = mb.attention_mask.bool()  # [N, P+R]
    has_prompt = real[:, :prompt_width].any(0)
    left = int(has_prompt.float().argmax()) if bool(has_prompt.any()) else prompt_width - 1
    left = min(left, prompt_width - 1)  # a pass needs the last prompt position (it predicts the first token)
    alive = mb.response_mask.bool().any(0) | real[:, prompt_width:].any(0)  # [R]
    keep_r = int(torch.nonzero(alive).max()) + 1 if bool(alive.any()) else 1
    if left == 0 and keep_r == mb.response_length:
        return mb
    cut = {}
    for f in dataclasses.fields(mb):
        value = getattr(mb, f.name)
        if isinstance(value, torch.Tensor) and value.dim() >= 2:  # [N, R, k]: the teacher's top-k, cut as [N, R]
            cut[f.name] = value[:, left:prompt_width + keep_r] if f.name in FULL_WIDTH else value[:, :keep_r]
    return dataclasses.replace(mb, **cut)


def length_order(batch) -> torch.Tensor:
    """A row order that puts alike lengths side by side, samples of one prompt
    together: by prompt length, then prompt (group), then response length. -> [N]"""
    prompt_len = batch.attention_mask[:, :batch.prompt_width].sum(-1).tolist()
    response_len = batch.response_mask.sum(-1).tolist()
    group = batch.group.tolist()
    order = sorted(range(len(batch)), key=lambda i: (-prompt_len[i], group[i], -response_len[i], i))
    return torch.tensor(order, dtype=torch.long)
