"""The critic: values of response positions and its clipped value-loss update."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch

from posttrain.algorithms.critic import value_loss
from posttrain.algorithms.losses import masked_mean
from posttrain.training.actor import pinned_loss_scale, run_updates
from posttrain.training.forward import planned_mask
from posttrain.rollout.vision import join_vision, vision_forward_kwargs
from posttrain.training.logprobs import compute_device, refuse_images
from posttrain.training.microbatch import micro_batches


@dataclass(frozen=True)
class CriticSettings:
    """Plain knobs of one critic update (sizes count sequences)."""

    mini_batch_size: int
    micro_batch_size: int
    forward_micro_batch_size: int = 64
    ppo_epochs: int = 1
    cliprange_value: float = 0.5
    loss_coef: float = 1.0  # the value loss times this (NeMo-RL's value_loss_fn.scale)
    loss_agg_mode: str = "token-mean"
    loss_scale_factor: float | None = None
    grad_clip: float = 1.0
    remove_padding: bool = True  # model.use_remove_padding: length-ordered, trimmed micro-batches
    micro_max_tokens: int | None = None  # critic.use_dynamic_bsz: update micro-batches of at most this many tokens
    forward_max_tokens: int | None = None  # ... and value passes' micro-batches


def response_values(model, input_ids, attention_mask, position_ids, response_length: int, sp=None,
                    layout=None, vision: list | None = None) -> torch.Tensor:
    """-> values [N, R] (float32): V at the position that predicts each
    response token, i.e. of the state before the token is chosen (the same
    positions as `forward.response_logits`). sp: this worker's
    sequence-parallel group (training/ulysses.py), its positions gathered. `layout`: the micro-batch's plan
    (microbatch.Layout): the attention mask built without transformers' read of it. `vision`: a
    vision-language model's rows' images (rollout/vision.py), or None."""
    length = input_ids.shape[1]
    if sp is not None:
        from posttrain.training import ulysses

        refuse_images(SimpleNamespace(vision=vision))
        local, _ = ulysses.sharded_forward(model, input_ids, attention_mask, position_ids, sp)  # [N, L'/P, 1]
        return ulysses.gather(local[..., 0].float(), sp)[:, length - response_length - 1:length - 1]
    if layout is not None:
        attention_mask = planned_mask(model, attention_mask, layout.padded_all, cached=False)
    extra = {}
    if vision and any(vision):
        extra = vision_forward_kwargs(model, input_ids, attention_mask, position_ids,
                                      join_vision(vision, input_ids.device))
        position_ids = extra.pop("position_ids")
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **extra)
    return out.logits[:, -response_length - 1:-1, 0].float()  # [N, R]


@torch.no_grad()
def compute_values(model, batch, micro_batch_size: int, remove_padding: bool = True,
                   max_tokens: int | None = None, sp=None) -> torch.Tensor:
    """Values [N, R] of `batch` in micro-batches (of `micro_batch_size` rows or
    `max_tokens` tokens), no grad, zero outside the response mask. Planned on the host, each micro-batch moved
    once and its values gathered on the device: one copy back, at the end."""
    was_training = model.training
    model.eval()
    device = compute_device(model)
    values = torch.zeros(batch.responses.shape, dtype=torch.float32, device=device)
    try:
        for _, mb in micro_batches(batch, micro_batch_size, remove_padding, max_tokens):
            mb = mb.to(device)
            v = response_values(model, mb.input_ids, mb.attention_mask, mb.position_ids, mb.response_length, sp,
                                layout=mb.layout, vision=mb.vision or None)
            values[mb.rows, :mb.response_length] = v * mb.response_mask
    finally:
        model.train(was_training)
    return values.cpu()


def critic_micro_loss(model, mb, s: CriticSettings, device, sp=None) -> tuple[torch.Tensor, dict]:
    """Clipped value loss of one micro-batch (with grad) and its metrics (0-d tensors: read once per update).
    mb needs values (the critic's before the update) and returns."""
    mask = mb.response_mask.to(device)
    vpreds = response_values(model, mb.input_ids.to(device), mb.attention_mask.to(device),
                             mb.position_ids.to(device), mb.response_length, sp,
                             layout=getattr(mb, "layout", None),  # [n, R]; a planned micro-batch's: nothing read
                             vision=getattr(mb, "vision", None) or None)
    out = value_loss(vpreds, mb.returns.to(device), mb.values.to(device), mask, cliprange_value=s.cliprange_value,
                     loss_agg_mode=s.loss_agg_mode, loss_scale_factor=s.loss_scale_factor)
    return out["vf_loss"] * s.loss_coef, {
        "critic/vf_loss": out["vf_loss"].detach(),
        "critic/vf_clipfrac": out["vf_clipfrac"].detach(),
        "critic/vpred_mean": masked_mean(vpreds.detach(), mask),
    }


def update_critic(model, optimizer, batch, s: CriticSettings, mini_totals: list[float] | None = None,
                  world_size: int = 1, sp=None) -> dict[str, float]:
    """`ppo_epochs` passes of the clipped value loss over `batch` in
    mini-batches (see `actor.run_updates`); -> critic/* metrics."""
    device = compute_device(model)
    s = pinned_loss_scale(s, batch)
    return run_updates(model, optimizer, batch, lambda mb: critic_micro_loss(model, mb, s, device, sp),
                       s.mini_batch_size, s.micro_batch_size, s.ppo_epochs, s.loss_agg_mode, s.grad_clip,
                       mini_totals, world_size, sp_size=sp.size if sp is not None else 1, prefix="critic",
                       remove_padding=s.remove_padding, max_tokens=s.micro_max_tokens)
