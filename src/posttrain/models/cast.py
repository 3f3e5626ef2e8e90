"""A frozen model's Linear weights stored in autocast's lower dtype: the casts autocast would make at every
forward, made once.

Under torch.autocast (bf16, say) every nn.Linear runs as `linear` in the lower dtype: its float32 weight and
bias are cast at each call (a frozen weight is not in autocast's cache, which keeps only leaves that need a
gradient). Stored already in that dtype they are not cast again, and the forward's arithmetic is the same, bit
for bit: the rounding float32 -> bf16 is one, made at load or at each call. Everything else keeps its dtype:
autocast runs embeddings and norms in float32 (an nn.Embedding of bf16 weights would hand bf16 to the residual
stream), so they stay float32. A weight a Linear shares with another module (tied embeddings: lm_head.weight is
embed_tokens.weight) stays as it is there; the Linear gets a cast copy of its own, where there is room for it.
"""

from __future__ import annotations

import torch


def cast_linear_weights(model: torch.nn.Module, dtype: torch.dtype, room: int | None = None) -> dict:
    """Store the weight and bias of each nn.Linear of `model` (frozen, run under autocast to `dtype`) in `dtype`.
    A parameter that a module other than an nn.Linear also holds (a tied embedding) is left there and the Linear
    given a cast copy, if copies fit in `room` bytes (None: no limit); else that Linear is left as it is.
    -> {"cast": parameters cast in place, "copied": copies made, "skipped": tied ones left, "bytes": the change}"""
    # exactly nn.Linear: a subclass (peft's LoRA layers, quantized ones) may compute other than by `linear`
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    held_elsewhere = {id(p) for m in model.modules() if type(m) is not torch.nn.Linear
                      for p in m.parameters(recurse=False)}
    size = torch.tensor([], dtype=dtype).element_size()
    wanted = {id(p): p for m in linears for p in (m.weight, m.bias) if _castable(p, dtype)}
    copies = sum(p.numel() * size for p in wanted.values() if id(p) in held_elsewhere)
    make_copies = room is None or copies <= room
    done: dict[int, torch.nn.Parameter] = {}  # a parameter two Linears share stays shared, cast once
    out = {"cast": 0, "copied": 0, "skipped": 0, "bytes": 0}
    for m in linears:
        for name in ("weight", "bias"):
            p = getattr(m, name)
            if id(p) not in wanted:
                continue
            tied = id(p) in held_elsewhere
            if tied and not make_copies:
                out["skipped"] += 1
                continue
            if id(p) not in done:
                done[id(p)] = torch.nn.Parameter(p.detach().to(dtype), requires_grad=False)
                out["copied" if tied else "cast"] += 1
                out["bytes"] += p.numel() * size - (0 if tied else p.numel() * p.element_size())
            setattr(m, name, done[id(p)])
    return out


def _castable(p: torch.nn.Parameter | None, dtype: torch.dtype) -> bool:
    """A frozen floating-point parameter held whole (not a DTensor's shard) in a dtype other than `dtype`."""
    if p is None or not p.is_floating_point() or p.dtype == dtype or p.requires_grad:
        return False
    from torch.distributed.tensor import DTensor

    return not isinstance(p, DTensor)
