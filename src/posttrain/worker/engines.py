"""The rollout engine a worker builds from its WorkerSpec: vLLM's, or the HF engine over a given model; and the
one a rollout process of its own builds (asynchronous training: `build_rollout_engine`, which
rollout/remote.py calls in that process).

The engine computes as the worker would: in rollout.dtype where that differs from the policy's compute dtype,
else under the policy's autocast (`autocast_of`: mixed precision over float32 weights).
"""

from __future__ import annotations

import contextlib
import os

import torch

from posttrain.rollout.masks import takes_sdpa_masks
from posttrain.worker.spec import WorkerSpec


def autocast_of(spec: WorkerSpec):
    """Matrix work in `mixed_precision` (bf16) over float32 weights, as FSDP2's mixed precision does for sharded
    parameters: in one process, and for the rollout's full copy of the policy, this context gives bf16 compute."""
    if not spec.mixed_precision or spec.mixed_precision == spec.dtype:
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(spec.device).type, dtype=getattr(torch, spec.mixed_precision))


def rollout_dtype_of(spec: WorkerSpec) -> str | None:
    """rollout.dtype where it differs from the policy's compute dtype (None: the engine computes as the policy
    does)."""
    d = spec.rollout.dtype
    return d if d is not None and d != (spec.mixed_precision or spec.dtype) else None


def engine_dtype_of(spec: WorkerSpec) -> str:
    """The dtype of the engine's weights: vLLM's engine dtype; the hf engine's stored weights (its compute dtype
    comes from autocast unless rollout.dtype gave it one of its own)."""
    if spec.rollout.name == "vllm":
        return spec.rollout.dtype or spec.mixed_precision or spec.dtype
    return rollout_dtype_of(spec) or spec.dtype


def make_engine(spec: WorkerSpec, rollout_model, eos: list[int], pad_token_id: int, rank: int, progress: bool,
                lora_rank: int = 0):
    """vLLM's engine (it loads its own weights; `lora_rank` > 0: it takes the policy's adapters as LoRA
    requests), or the HF engine over `rollout_model`."""
    r = spec.rollout
    if r.name == "vllm":
        from posttrain.rollout.vllm import VLLMRolloutEngine

        return VLLMRolloutEngine(
            spec.model_dir, eos_token_ids=eos, pad_token_id=pad_token_id,
            tensor_parallel_size=r.tensor_parallel_size, gpu_memory_utilization=r.gpu_memory_utilization,
            dtype=engine_dtype_of(spec), max_model_len=r.max_model_len, seed=spec.seed + rank,
            trust_remote_code=spec.trust_remote_code, enable_sleep_mode=r.free_cache_engine,
            engine_kwargs=r.engine_kwargs, device=spec.device, kv_cache_sequences=r.kv_cache_sequences,
            lora_rank=lora_rank)
    from posttrain.rollout.hf import HFRolloutEngine

    return HFRolloutEngine(rollout_model, eos, pad_token_id, micro_batch_size=r.micro_batch_size, seed=spec.seed + rank,
                           progress=progress, shared_prefill=r.shared_prefill, remove_padding=r.remove_padding,
                           early_stop=r.early_stop, stop_check_every=stop_check_every_of(r, rollout_model),
                           static_decoding=static_decoding_of(r, rollout_model), cuda_graphs=not r.enforce_eager)


# rollout.stop_check_every=null: on the CPU a check costs nothing to wait for, and every token's check lets ended
# rows leave the batch at once (fastest: bench/README.md); on a GPU each check drains the kernel queue. 8 there is
# a first guess, not measured on a GPU yet.
STOP_CHECK_EVERY = {"cpu": 1, "cuda": 8}


def stop_check_every_of(r, model) -> int:
    """The hf engine's stop_check_every: rollout.stop_check_every, or its default for the model's device."""
    if r.stop_check_every is not None:
        return r.stop_check_every
    return STOP_CHECK_EVERY.get(next(model.parameters()).device.type, 1)


def static_decoding_of(r, model) -> bool:
    """The hf engine's static decoding: rollout.static_decoding, or (null) on with CUDA where the model takes
    prebuilt SDPA masks. On the CPU the eager loop is as fast (no launches to save), and it reads only the
    columns written so far."""
    if r.static_decoding is not None:
        return r.static_decoding
    weights = list(model.parameters())
    # not over sharded weights (FSDP2's DTensors): their forward gathers them, a collective in every step
    return (weights[0].device.type == "cuda" and takes_sdpa_masks(model)
            and not any(type(p).__name__ == "DTensor" for p in weights))


class InAutocast:
    """An engine whose `generate` runs under the policy's autocast, as `rollout.LocalRollout` runs a colocated one."""

    def __init__(self, engine, spec: WorkerSpec):
        self.engine, self.spec = engine, spec

    def generate(self, prompts, params):
        with autocast_of(self.spec):
            return self.engine.generate(prompts, params)

    def __getattr__(self, name):
        return getattr(self.engine, name)


def build_rollout_engine(spec: WorkerSpec, eos: list[int], pad_token_id: int, rank: int):
    """The engine of a rollout process of its own: vLLM's, or the HF engine over a plain model of its own (a LoRA
    policy's adapters arrive merged into its weights), its weights from the version the driver loads into it."""
    from posttrain.models import load_model
    from posttrain.runtime.quiet import quiet_libraries

    os.environ.update(spec.env)
    quiet_libraries()
    model = None
    if spec.rollout.name == "hf":
        model = load_model(spec.model_dir, dtype=engine_dtype_of(spec), trust_remote_code=spec.trust_remote_code,
                           device=torch.device(spec.device), small_attention=spec.small_attention)
        model.eval()  # requires_grad kept as the policy's (weights.make_rollout_copy): the same kernels and samples
    engine = make_engine(spec, model, eos, pad_token_id, rank, progress=False)
    return InAutocast(engine, spec) if model is not None and rollout_dtype_of(spec) is None else engine
