"""The weight plumbing between the policy and its rollout engine: which weights the engine holds and how they
reach it.

The hf engine samples from the policy's own module in one process; it has a model of its own (`rollout_copy`)
beside sharded workers, with merged LoRA weights, in a dtype of its own (rollout.dtype) or with the weights of
k updates ago (rollout.stale_updates). vLLM's engine and a rollout process of its own always hold their own.
What is sent (`Sending`): nothing but the module (hf over the policy), the LoRA adapters alone (vLLM's LoRA
requests), or the full weights under Hugging Face names, with the adapters merged in where the engine holds a
plain model (`merged_rollout`).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from enum import Enum

import torch

from posttrain.rollout.weights import named_full_weights
from posttrain.worker.engines import rollout_dtype_of
from posttrain.worker.spec import WorkerSpec


class Sending(Enum):
    """How the policy's weights reach an engine in this process."""

    MODULE = "module"  # the hf engine samples from the policy's module: nothing to copy
    ADAPTERS = "adapters"  # vLLM's engine takes a LoRA policy's adapters as a LoRA request
    FULL = "full"  # full tensors (merged LoRA weights) into the engine's own model


def merged_rollout(spec: WorkerSpec) -> bool:
    """A LoRA policy whose rollout engine holds the base with the adapters merged in: rollout.lora_sync=merged,
    and the engines that sample from weights of their own (rollout.stale_updates, a rollout process of its own,
    an hf engine's rollout.dtype): their copies and snapshots are of a plain model."""
    if spec.lora is None:
        return False
    r = spec.rollout
    own = r.stale_updates > 0 or r.remote or (r.name == "hf" and rollout_dtype_of(spec) is not None)
    return spec.lora.sync == "merged" or own


def has_rollout_copy(spec: WorkerSpec, sharded: bool) -> bool:
    """The hf engine in this process samples from a model of its own, not the policy's module: beside sharded
    workers, with merged LoRA weights, in a dtype of its own, or with the weights of k updates ago."""
    r = spec.rollout
    return r.name == "hf" and not r.remote and (
        sharded or merged_rollout(spec) or rollout_dtype_of(spec) is not None or r.stale_updates > 0)


def sending(spec: WorkerSpec, sharded: bool) -> Sending:
    """How the policy's weights reach the engine in this process (module docstring)."""
    if spec.rollout.name == "hf" and not has_rollout_copy(spec, sharded):
        return Sending.MODULE
    if spec.lora is not None and spec.rollout.name == "vllm" and not merged_rollout(spec):
        return Sending.ADAPTERS
    return Sending.FULL


def make_rollout_copy(spec: WorkerSpec, policy: torch.nn.Module, kwargs: dict) -> torch.nn.Module:
    """The hf engine's own model, made before sharding (it is whole): the plain base for merged LoRA weights
    (W + s B A at every sync), else a copy of the policy; its parameters in rollout.dtype where that differs
    from the policy's compute dtype (buffers such as RoPE's frequencies stay as they are, as a model loaded in
    that dtype keeps them). `kwargs`: models.load_model's, as the policy was loaded with."""
    from posttrain.models import load_model

    model = load_model(spec.model_dir, **kwargs) if merged_rollout(spec) else copy.deepcopy(policy)
    # its parameters keep requires_grad as the policy's (no optimizer holds them): torch picks kernels by it,
    # and the copy then samples bit for bit as the policy's own module would
    model.eval()
    dtype = rollout_dtype_of(spec)
    if dtype is not None:
        for p in model.parameters():
            p.data = p.data.to(getattr(torch, dtype))
    return model


def pushed_at_start(spec: WorkerSpec, history) -> bool:
    """The engine is given the policy's weights at setup: vLLM loaded none (rollout.weights_from_policy), a
    history starts from them (asynchronous training's on every worker of a group: the gathers are collectives),
    or the engine's own weights are not the policy's (resuming from policy_dir, starting from
    lora_adapter_path): pushed now, not one step late."""
    not_model_dir = spec.policy_dir is not None or (spec.lora is not None and spec.lora.adapter_path is not None)
    return spec.rollout.weights_from_policy or spec.rollout.remote or history is not None or not_model_dir


def full_weights(policy: torch.nn.Module, merged: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) of the policy (a collective when sharded); `merged`: a LoRA policy's adapters merged
    into the base (W + s B A), under the plain model's names."""
    weights = named_full_weights(policy)
    if merged:
        from posttrain.models.lora import lora_scaling, merged_weights

        weights = merged_weights(weights, lora_scaling(policy))
    return weights


def adapters(policy: torch.nn.Module) -> tuple[dict[str, torch.Tensor], str]:
    """A LoRA policy's adapters as vLLM's LoRA request takes them: (tensors, adapter_config.json's text)."""
    from posttrain.models.lora import adapter_config_json, adapter_weights

    return adapter_weights(named_full_weights(policy, lora_only=True)), adapter_config_json(policy)
