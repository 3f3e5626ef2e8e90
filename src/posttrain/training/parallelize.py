"""Data parallelism for a model that knows nothing of it: FSDP2.

`parallelize(model, mesh)` shards every decoder layer (and a vision-language
model's image-encoder blocks) and then the root (embeddings, final norm, LM
head) with `fully_shard`, so parameters,
gradients and optimizer state are split across the mesh and each layer is
gathered only while it runs. Activation checkpointing wraps each layer
first; mixed precision is for GPUs (bf16 compute, fp32 gradient reduction).
With `offload_params` (verl's fsdp_config.param_offload) FSDP2's
CPUOffloadPolicy keeps the sharded parameters and their gradients in CPU
memory: each layer is copied to the device for its pass, and the optimizer
steps on the CPU.
"""

from __future__ import annotations

import torch
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The repeated blocks of a Hugging Face causal LM (`model.model.layers`
    for Llama/Qwen/Mistral-style models), or of a vision-language model's
    language model (`model.model.language_model.layers` for Qwen-VL,
    `model.model.text_model.layers` for Idefics3)."""
    if hasattr(model, "get_base_model"):  # a peft model (LoRA): its wrapped causal LM's layers
        model = model.get_base_model()
    inner = getattr(model, "model", None)
    for owner in (inner, getattr(inner, "language_model", None), getattr(inner, "text_model", None)):
        layers = getattr(owner, "layers", None)
        if isinstance(layers, torch.nn.ModuleList):
            return layers
    raise ValueError(f"{type(model).__name__} has no .model.layers; posttrain shards decoder-only models "
                     "laid out like Llama/Qwen2 (and their vision-language models)")


VISION_BLOCKS = ("visual.blocks", "vision_model.encoder.layers", "vision_tower.vision_model.encoder.layers")


def vision_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """A vision-language model's image-encoder blocks (Qwen-VL's `visual.blocks`, SigLIP-style
    `vision_model.encoder.layers`), sharded each as a unit of its own; [] for a text model."""
    if hasattr(model, "get_base_model"):
        model = model.get_base_model()
    for root in (model, getattr(model, "model", None)):
        for path in VISION_BLOCKS:
            found = root
            for name in path.split("."):
                found = getattr(found, name, None)
            if isinstance(found, torch.nn.ModuleList):
                return list(found)
    return []


def parallelize(model: torch.nn.Module, mesh=None, *, param_dtype: str | None = None,
                activation_checkpointing: bool = False, reshard_after_forward: bool = True,
                offload_params: bool = False, forward_prefetch: bool = False,
                reduce_dtype: str = "float32") -> torch.nn.Module:
    """Shard `model` in place over `mesh` (a 1-D DeviceMesh; None: the
    default process group) and return it.

    param_dtype: compute dtype of gathered parameters (e.g. "bfloat16" on
    GPUs); None keeps the stored dtype. Gradients are reduced in
    `reduce_dtype` (fp32 unless verl's mixed_precision.reduce_dtype says otherwise).
    forward_prefetch (verl's fsdp_config.forward_prefetch): each layer starts
    the next one's all-gather as its forward begins, overlapping the
    communication with its compute (FSDP2 otherwise gathers a layer when it is
    reached, or after the previous layer's forward with reshard_after_forward).
    """
    if activation_checkpointing:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        layers = decoder_layers(model)
        for i, layer in enumerate(layers):
            layers[i] = checkpoint_wrapper(layer, preserve_rng_state=False)
        model._posttrain_ac = True  # recomputed layers: no pass may carry a key/value cache through them
    mp = MixedPrecisionPolicy(param_dtype=DTYPES[param_dtype] if param_dtype else None,
                              reduce_dtype=DTYPES[reduce_dtype])
    # pinned host memory makes the copies to a GPU asynchronous; a CPU run has no GPU to copy to
    offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if offload_params else OffloadPolicy()
    layers = list(decoder_layers(model))
    for layer in vision_blocks(model) + layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward,
                    offload_policy=offload)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward, offload_policy=offload)
    if forward_prefetch:
        for layer, following in zip(layers, layers[1:]):
            layer.set_modules_to_forward_prefetch([following])
    return model
