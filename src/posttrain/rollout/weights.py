"""Moving the trainer's weights to a rollout engine: full tensors under the
names of the Hugging Face checkpoint.

A sharded (FSDP2) model holds DTensors, and wrappers add parts to the
parameter names (`_checkpoint_wrapped_module.` from activation
checkpointing, `_orig_mod.` from torch.compile, `_fsdp_wrapped_module.`
from FSDP1). Engines (the HF copy, vLLM's `load_weights`) expect the names
of the model directory and whole tensors.
"""

from __future__ import annotations

from typing import Iterator

import torch

WRAPPER_PARTS = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.", "module.")


def hf_name(name: str) -> str:
    """'model.layers.0._checkpoint_wrapped_module.mlp.up_proj.weight' ->
    'model.layers.0.mlp.up_proj.weight'."""
    for part in WRAPPER_PARTS:
        if name.startswith(part):
            name = name[len(part):]
        name = name.replace("." + part, ".")
    return name


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's whole value (a collective: every rank must call it, in the
    same order); a plain tensor as it is."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def named_full_weights(model: torch.nn.Module, device: str | torch.device | None = None, lora_only: bool = False
                       ) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) for every entry of the model's state dict (`lora_only`: its LoRA adapters'
    alone), one at a time, so at most one gathered tensor is alive beyond the engine's copy."""
    for name, t in model.state_dict().items():
        if lora_only and ".lora_" not in name:
            continue  # every rank skips the same names: the gathers stay in step
        full = full_tensor(t.detach())
        yield hf_name(name), (full.to(device) if device is not None else full)
