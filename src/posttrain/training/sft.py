"""The supervised update: next-token cross-entropy on the learned tokens, over micro-batches.

A batch is what `data.sft.collate` makes: input_ids, attention_mask and labels [B, L], right-padded, labels
-100 where nothing is learned (the prompt, other turns, padding) and the token itself where it is. The loss
is the mean over the batch's learned tokens of -log p(token | the tokens before it), whatever the
micro-batches: each micro-batch's summed loss is divided by the whole batch's learned-token count (NeMo-RL's
global token mean; verl's SFT trainer averages the micro-batches' own means instead, which weighs a token of a
short micro-batch more).

    m = sft_update(model, optimizer, batch, SFTSettings(micro_batch_size=4, grad_clip=1.0))
    # m["train/loss"], m["train/grad_norm"], m["train/lr"], m["train/nonfinite_updates"]

The loss is computed as transformers' causal-LM loss is (logits in float32, labels shifted by one, summed
cross-entropy over labels != -100, divided by the count), so a one-micro-batch update without clipping is the
same float operations as `model(input_ids, attention_mask, labels=labels).loss.backward()`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from posttrain.training.actor import full_value
from posttrain.training.tally import all_finite
from posttrain.training.fused import stats_head
from posttrain.training.logprobs import compute_device
from posttrain.training.microbatch import spans
from posttrain.training.tensor_parallel import clip_grad_norm, vocab_parallel_stats

IGNORE = -100


@dataclass(frozen=True)
class SFTSettings:
    micro_batch_size: int = 4  # rows per forward/backward
    grad_clip: float | None = 1.0  # None: no clipping
    remove_padding: bool = True  # rows ordered by length, each micro-batch cut to its longest row
    micro_max_tokens: int | None = None  # micro-batches of at most this many real tokens (use_dynamic_bsz)
    fused: bool = False  # model.use_fused_kernels: -log p from the hidden states a chunk at a time (training/fused.py)


def learned_tokens(batch: dict) -> int:
    """How many tokens `batch` learns: labels != -100 after the shift (the first position predicts nothing)."""
    return int((batch["labels"][:, 1:] != IGNORE).sum())


def nll_sum(model, batch: dict, device, fused: bool = False, sp=None, tp=None) -> torch.Tensor:
    """The summed -log p of `batch`'s learned tokens (a scalar with grad), as transformers' causal-LM loss
    computes it before its division; `fused`: from the hidden states a chunk of tokens at a time, the [b, L, V]
    logits never whole (the same sum to float rounding); `sp` (training/ulysses.py): this worker runs its 1/P
    of the positions, the per-position losses are gathered, so every worker of the group has the whole sum;
    `tp` (training/tensor_parallel.py): the logits are this rank's vocabulary columns [b, L, V/T], log p(label)
    comes from every rank's share, and every rank of the group has the whole sum."""
    inputs = {"input_ids": batch["input_ids"].to(device), "attention_mask": batch["attention_mask"].to(device)}
    labels = F.pad(batch["labels"].to(device), (0, 1), value=IGNORE)[:, 1:]  # [b, L]: position t predicts t + 1
    if sp is not None:
        return _sequence_parallel_nll(model, inputs, labels, sp, tp)
    learned = labels != IGNORE
    if fused:
        with stats_head(model, labels.clamp(min=0), tp=tp):
            log_p = model(**inputs).logits[..., 0]  # [b, L]: log p(label), 0's on unlearned positions
        return -(log_p * learned).sum()
    if tp is not None:
        log_p, _ = vocab_parallel_stats(model(**inputs).logits.float(), labels.clamp(min=0), tp)  # [b, L]
        return -(log_p * learned).sum()
    logits = model(**inputs).logits.float()  # [b, L, V]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE,
                           reduction="sum")


def _sequence_parallel_nll(model, inputs: dict, labels: torch.Tensor, sp, tp=None) -> torch.Tensor:
    from posttrain.training import ulysses

    ids = inputs["input_ids"]
    positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)  # as the plain pass's default
    logits, _ = ulysses.sharded_forward(model, ids, inputs["attention_mask"], positions, sp)  # [b, L'/P, V]
    targets = ulysses.shard(ulysses.pad_positions(labels, sp.size, IGNORE), sp)  # [b, L'/P]
    if tp is not None:  # [b, L'/P, V/T]: this rank's positions and vocabulary columns
        nll = -vocab_parallel_stats(logits.float(), targets.clamp(min=0), tp)[0] * (targets != IGNORE)
    else:
        nll = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1),
                              ignore_index=IGNORE, reduction="none").reshape(targets.shape)
    return ulysses.gather(nll, sp).sum()


def micro_batches(batch: dict, s: SFTSettings) -> list[dict]:
    """Consecutive rows of `batch` (length-ordered and trimmed with remove_padding), micro_batch_size rows each
    or at most micro_max_tokens real tokens each."""
    lengths = batch["attention_mask"].sum(-1)  # [B]
    order = torch.argsort(lengths, descending=True, stable=True) if s.remove_padding else torch.arange(len(lengths))
    cuts = spans(lengths[order].tolist(), s.micro_batch_size, s.micro_max_tokens)
    out = []
    for a, b in cuts:
        rows = order[a:b]
        width = int(lengths[rows].max()) if s.remove_padding else batch["input_ids"].shape[1]
        out.append({k: v[rows, :width] for k, v in batch.items()})
    return out


def sft_update(model, optimizer, batch: dict, s: SFTSettings, total_tokens: int | None = None,
               world_size: int = 1, sp=None, tp=None) -> dict[str, float]:
    """One optimizer step on `batch`, gradients accumulated over its micro-batches.

    Data parallel (world_size > 1: the workers whose gradients FSDP2 averages, a sharded model): `batch`
    is this worker's share of the rows and `total_tokens` the whole batch's learned tokens, so each worker's
    loss is scaled by world_size and the averaged gradient is that of the whole batch's token mean. With
    sequence parallelism (`sp`) the P workers of a group hold the same rows and each its part of the gradient.
    With tensor parallelism (`tp`) the T ranks of a group hold the same rows, each computes the whole loss and
    the gradient of its share of each layer: world_size is then the data-parallel size (workers // T), and the
    gradient norm is taken over the TP-split and whole parameters together.
    A step whose loss or gradient norm is not finite is skipped (the weights stay; on every worker).
    -> train/loss (the whole batch's token mean: summed over workers), train/grad_norm, train/lr,
    train/nonfinite_updates, train/learned_tokens."""
    device = compute_device(model)
    own = learned_tokens(batch)  # this worker's rows'
    total = total_tokens if total_tokens is not None else own
    params = [p for p in model.parameters() if p.requires_grad]
    model.train()
    optimizer.zero_grad(set_to_none=True)
    loss_sum = 0.0
    for mb in micro_batches(batch, s):
        loss = nll_sum(model, mb, device, s.fused, sp, tp) / max(total, 1)
        (loss * world_size if world_size > 1 else loss).backward()
        loss_sum += float(loss.detach())
    # torch's clip, or each mesh's norm combined with TP; no clip: an infinite bound scales every gradient by 1
    grad_norm = float(full_value(clip_grad_norm(params, s.grad_clip if s.grad_clip is not None else math.inf)))
    stepped = all_finite(loss_sum * world_size, grad_norm, world_size, params[0].device)
    if stepped:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return {"train/loss": loss_sum, "train/grad_norm": grad_norm if stepped else float("nan"),
            "train/lr": optimizer.param_groups[0]["lr"], "train/nonfinite_updates": float(not stepped),
            "train/learned_tokens": float(own)}


@torch.no_grad()
def nll_of(model, batch: dict, s: SFTSettings, sp=None, tp=None) -> tuple[float, int]:
    """(summed -log p of the learned tokens, their count) of `batch`, for the validation loss."""
    device = compute_device(model)
    model.eval()
    total = 0.0
    for mb in micro_batches(batch, s):
        total += float(nll_sum(model, mb, device, s.fused, sp, tp))
    return total, learned_tokens(batch)
