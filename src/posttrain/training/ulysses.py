"""Ulysses sequence parallelism (verl's ulysses_sequence_parallel_size): the
P workers of a sequence-parallel group take the same rows, each runs 1/P of
every sequence's positions through the model, and in each attention an
all-to-all trades the split: every worker gets the whole sequence for 1/P of
the heads, attends, and trades back. Everything else in a layer works on
positions one by one, so activations (and the logits) are 1/P per worker.

    with sequence_parallel(sp, padding_mask):          # padding_mask [N, L] (L % P == 0)
        out = model(input_ids=shard(ids, sp), position_ids=shard(pos, sp))   # [N, L/P, ...]
    full = gather(per_position_values, sp)              # [N, L, ...]

The gather's backward keeps each worker's own slice: every worker of the
group computes the same loss from the same gathered values, so the slice is
that worker's part of the gradient (FSDP2 then sums the group's parts).
"""

from __future__ import annotations

import contextlib
import types
from dataclasses import dataclass

import torch
import torch.distributed as dist

from posttrain.models.attention import grouped_attention

NAME = "posttrain_ulysses"
_state: dict = {}  # the pass in progress: {"sp": SequenceParallel, "mask": [N, 1, L, L] bool}


@dataclass(frozen=True)
class SequenceParallel:
    """This worker's sequence-parallel group: `size` workers, this one `rank` in it."""

    group: object  # a torch.distributed ProcessGroup
    size: int
    rank: int


class _AllToAll(torch.autograd.Function):
    """x [P, ...]: block i goes to group rank i, block i of the result came
    from group rank i. Its own adjoint, so the backward is the same trade."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        x = x.contiguous()
        out = torch.empty_like(x)  # like a contiguous x: the collective writes blocks in order
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None


class _GatherPositions(torch.autograd.Function):
    """[N, L/P, ...] per worker -> [N, L, ...] on each; backward: the own slice."""

    @staticmethod
    def forward(ctx, x, sp):
        ctx.sp, ctx.width = sp, x.shape[1]
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(sp.size)]
        dist.all_gather(parts, x, group=sp.group)
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx, grad):
        return grad.narrow(1, ctx.sp.rank * ctx.width, ctx.width), None


def gather(x: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
    return _GatherPositions.apply(x, sp)


def padded_length(length: int, size: int) -> int:
    return -(-length // size) * size


def pad_positions(x: torch.Tensor, size: int, value=0) -> torch.Tensor:
    """[N, L, ...] right-padded along positions to a multiple of `size`."""
    extra = padded_length(x.shape[1], size) - x.shape[1]
    if extra == 0:
        return x
    return torch.cat([x, x.new_full((x.shape[0], extra, *x.shape[2:]), value)], dim=1)


def shard(x: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
    """This worker's consecutive 1/P of the positions of [N, L, ...] (L % P == 0)."""
    width = x.shape[1] // sp.size
    return x[:, sp.rank * width:(sp.rank + 1) * width]


def _seq_to_heads(x: torch.Tensor, size: int, group) -> torch.Tensor:
    """[B, H, L/P, D] (own positions, all heads) -> [B, H/P, L, D] (all positions, own heads)."""
    b, h, width, d = x.shape
    x = x.view(b, size, h // size, width, d).transpose(0, 1)  # [P (to), B, H/P, L/P, D]
    x = _AllToAll.apply(x, group)  # [P (from: whose positions), B, H/P, L/P, D]
    return x.permute(1, 2, 0, 3, 4).reshape(b, h // size, size * width, d)


def _heads_to_seq(x: torch.Tensor, size: int, group) -> torch.Tensor:
    """[B, H/P, L, D] -> [B, H, L/P, D]: the inverse of _seq_to_heads."""
    b, hp, length, d = x.shape
    x = x.view(b, hp, size, length // size, d).permute(2, 0, 1, 3, 4)  # [P (to: whose positions), B, H/P, L/P, D]
    x = _AllToAll.apply(x, group)  # [P (from: whose heads), B, H/P, L/P, D]
    return x.transpose(0, 1).reshape(b, size * hp, length // size, d)


def ulysses_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                      is_causal=None, **kwargs):
    """A transformers attention function: outside a sequence-parallel pass
    `models.attention.grouped_attention`; inside one, query [B, H, L/P, D] and
    key/value [B, KVH, L/P, D] traded to all positions of H/P heads, attended
    under the pass's whole mask, traded back. -> ([B, L/P, H, D], None)."""
    sp = _state.get("sp")
    if sp is None:
        return grouped_attention(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                 is_causal=is_causal, **kwargs)
    heads, kv_heads = query.shape[1], key.shape[1]
    if kv_heads % sp.size:  # too few key/value heads to split: each query head gets its own copy
        key = key.repeat_interleave(heads // kv_heads, dim=1)
        value = value.repeat_interleave(heads // kv_heads, dim=1)
        kv_heads = heads
    q, k, v = (_seq_to_heads(t, sp.size, sp.group) for t in (query, key, value))
    # the attention sees P times fewer heads in the same grouping (query heads per key/value head)
    shim = types.SimpleNamespace(num_key_value_groups=heads // kv_heads, is_causal=True,
                                 training=module.training)
    out, _ = grouped_attention(shim, q, k, v, _state["mask"], dropout=dropout, scaling=scaling, **kwargs)
    out = _heads_to_seq(out.transpose(1, 2), sp.size, sp.group)  # [B, H, L/P, D]
    return out.transpose(1, 2).contiguous(), None


def full_mask(padding_mask: torch.Tensor) -> torch.Tensor:
    """[N, L] (1: a real token) -> [N, 1, L, L] bool: causal, real keys only,
    as transformers masks a padded batch; a query with no real key before it
    (left padding) sees itself, so no row of the softmax is empty (its output
    is never read)."""
    length = padding_mask.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=padding_mask.device).tril()
    allowed = causal & padding_mask.bool()[:, None, :]  # [N, L, L]
    alone = ~allowed.any(-1, keepdim=True) & torch.eye(length, dtype=torch.bool, device=padding_mask.device)
    return (allowed | alone)[:, None]


@contextlib.contextmanager
def sequence_parallel(sp: SequenceParallel, padding_mask: torch.Tensor):
    """Within the block, models using `posttrain_ulysses` run sequence-parallel
    passes whose whole sequences have `padding_mask` [N, L]."""
    _state.update(sp=sp, mask=full_mask(padding_mask))
    try:
        yield
    finally:
        _state.clear()


def sharded_forward(model, input_ids, attention_mask, position_ids, sp: SequenceParallel):
    """The model's output for this worker's positions of the (padded) rows:
    -> (.logits [N, L'/P, C], L' the padded length)."""
    ids, mask = pad_positions(input_ids, sp.size), pad_positions(attention_mask, sp.size)
    pos = pad_positions(position_ids, sp.size)
    with sequence_parallel(sp, mask):
        out = model(input_ids=shard(ids, sp), position_ids=shard(pos, sp), use_cache=False)
    return out.logits, ids.shape[1]


def use_ulysses(model, sp: SequenceParallel, tensor_parallel: int = 1) -> None:
    """Switch `model` to the sequence-parallel attention, or ValueError when its heads do not split (with tensor
    parallelism each rank holds 1/tensor_parallel of them, which split again)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    heads = model.config.num_attention_heads
    if heads % (sp.size * tensor_parallel):
        by_tp = f" x tensor_parallel_size={tensor_parallel}" if tensor_parallel > 1 else ""
        raise ValueError(f"ulysses_sequence_parallel_size={sp.size}{by_tp} must divide the model's {heads} "
                         "attention heads")
    AttentionInterface.register(NAME, ulysses_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)
    model.set_attn_implementation(NAME)
