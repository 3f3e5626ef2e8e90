"""Loading and placing a worker's models: the tokenizer and the policy (LoRA adapters, a frozen vision tower),
the frozen reference and teachers, the critic, their optimizers and LR schedulers, and Ulysses sequence
parallelism over them. Sharded workers wrap each model with FSDP2 (training.parallelize); one process
switches on gradient checkpointing where asked.

`Worker.setup` calls these in its order: the random stream is drawn as the models are built (LoRA's and the
critic's fresh weights), so the order is part of the result.
"""

from __future__ import annotations

import warnings

import torch

from posttrain.training.actor import make_lr_scheduler, make_optimizer
from posttrain.training.fused import check_fusable
from posttrain.worker.spec import CriticSpec, WorkerSpec


def model_kwargs(spec: WorkerSpec, device: torch.device) -> dict:
    """models.load_model's arguments for every model of the worker."""
    return {"dtype": spec.dtype, "trust_remote_code": spec.trust_remote_code, "device": device,
            "small_attention": spec.small_attention}


def load_policy(spec: WorkerSpec, kwargs: dict, rank: int):
    """-> (tokenizer, policy, its EOS token ids): the model, or with LoRA the base, frozen, with adapters (fresh,
    or a checkpoint's (policy_dir) or lora_adapter_path); its fused kernels checked, its vision tower frozen."""
    from posttrain.models import load_model, load_tokenizer
    from posttrain.models.loader import eos_token_ids, freeze_vision_tower

    tokenizer = load_tokenizer(spec.tokenizer_dir or spec.model_dir, trust_remote_code=spec.trust_remote_code,
                               apart=spec.tokenizer_dir is not None)
    if spec.lora is None:
        policy = load_model(spec.policy_dir or spec.model_dir, **kwargs)
    else:
        from posttrain.models.lora import add_adapters

        policy = add_adapters(load_model(spec.model_dir, **kwargs), spec.lora, spec.policy_dir)
    eos = eos_token_ids(tokenizer, policy)
    if spec.update.fused_kernels:
        check_fusable(policy)
    if spec.freeze_vision_tower and not freeze_vision_tower(policy) and rank == 0:
        warnings.warn(f"actor.freeze_vision_tower=true: {type(policy).__name__} has no vision tower; "
                      "every parameter trains", stacklevel=3)
    return tokenizer, policy, eos


def tensor_parallel_mesh(spec: WorkerSpec, world_size: int, device: torch.device, size: int | None = None):
    """-> the workers' 2-D DeviceMesh (("dp", "tp"): groups of `size` (spec.tensor_parallel) consecutive ranks
    split each layer, FSDP2 shards over the groups) with tensor parallelism, else None."""
    size = spec.tensor_parallel if size is None else size
    if size <= 1:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, (world_size // size, size), mesh_dim_names=("dp", "tp"))


def own_tensor_parallel(spec: WorkerSpec, t) -> bool:
    """Whether teacher `t` (a TeacherSpec) is split by a TP size of its own, not the policy's."""
    return t.tensor_parallel is not None and t.tensor_parallel != spec.tensor_parallel


def split_layers(model: torch.nn.Module, mesh, spec: WorkerSpec):
    """With `mesh` (tensor_parallel_mesh), split `model`'s layers over its TP group (training/tensor_parallel.py;
    the activations between them too with the spec's tensor_sequence_parallel; by its tensor_parallel_plan if
    any). -> (this rank's TensorParallel or
    None, the mesh FSDP2 shards over: the data-parallel one, or None: all)."""
    if mesh is None:
        return None, None
    from posttrain.errors import ConfigError
    from posttrain.training.tensor_parallel import apply_tensor_parallel

    try:
        return apply_tensor_parallel(model, mesh["tp"], spec.tensor_sequence_parallel,
                                     spec.tensor_parallel_plan), mesh["dp"]
    except ValueError as e:
        raise ConfigError(f"actor.tensor_parallel_size={mesh['tp'].size()}: {e}") from None


def place_policy(spec: WorkerSpec, policy: torch.nn.Module, sharded: bool, mesh=None):
    """Split the policy's layers over its TP group (with `mesh`) and shard it (FSDP2, the spec's mixed precision,
    offload, checkpointing), or checkpoint its activations in one process. -> its TensorParallel or None."""
    from posttrain.training.parallelize import parallelize

    tp, dp_mesh = split_layers(policy, mesh, spec)
    if sharded:
        parallelize(policy, dp_mesh, param_dtype=spec.mixed_precision,
                    activation_checkpointing=spec.gradient_checkpointing, offload_params=spec.param_offload,
                    forward_prefetch=spec.forward_prefetch, reduce_dtype=spec.reduce_dtype)
    elif spec.gradient_checkpointing:
        policy.gradient_checkpointing_enable()
    return tp


def ref_cast_dtype(spec: WorkerSpec, sharded: bool) -> tuple[torch.dtype | None, str]:
    """-> (the dtype the reference's Linear weights are stored in by ref.cast_weights, or None; why not): autocast's
    lower dtype where the reference runs under it in one process, a model of its own (not LoRA's base)."""
    if spec.ref.cast_weights is False:
        return None, "ref.cast_weights=false"
    if spec.lora is not None:
        return None, "with LoRA the reference is the policy's base (adapters off), whose weights are the policy's"
    if sharded:
        return None, "sharded workers' FSDP2 casts the gathered weights to actor.mixed_precision.param_dtype"
    if not spec.mixed_precision or spec.mixed_precision == spec.dtype:  # autocast_of: no autocast
        return None, "the reference runs without autocast (no actor.mixed_precision.param_dtype below model.dtype)"
    low, high = getattr(torch, spec.mixed_precision), getattr(torch, spec.dtype)
    if torch.finfo(low).bits >= torch.finfo(high).bits:
        return None, f"autocast's {spec.mixed_precision} is not below model.dtype={spec.dtype}"
    return low, ""


def cast_ref(spec: WorkerSpec, ref: torch.nn.Module | None, sharded: bool, rank: int = 0) -> dict | None:
    """ref.cast_weights: the reference's Linear weights in autocast's dtype, cast once (models/cast.py); a tied
    output layer's copy only where the device has room for it. -> cast_linear_weights' counts, None: not cast."""
    from posttrain.models.cast import cast_linear_weights

    dtype, why_not = ref_cast_dtype(spec, sharded)
    if dtype is None:
        if spec.ref.cast_weights and rank == 0:
            warnings.warn(f"ref.cast_weights=true does not apply: {why_not}", stacklevel=3)
        return None
    device = next(ref.parameters()).device
    room = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None
    return cast_linear_weights(ref, dtype, room)


def load_frozen(spec: WorkerSpec, kwargs: dict, sharded: bool, rank: int = 0, mesh=None, world_size: int = 1
                ) -> tuple[torch.nn.Module | None, dict, dict]:
    """-> (the reference, None where unneeded or with LoRA: the policy with its adapters off; the teachers of
    on-policy distillation by routing key, None with one; each teacher's TensorParallel or None), frozen, placed
    as the policy is (split over the TP group with `mesh`; a teacher with a TP size of its own over a mesh of
    that size); the reference's Linear weights in autocast's dtype where ref.cast_weights applies (cast_ref)."""
    from posttrain.models import load_model
    from posttrain.training.parallelize import parallelize

    ref, teachers, teacher_tps = None, {}, {}
    if spec.ref.needed and spec.lora is None:
        ref = load_model(spec.model_dir, **kwargs).requires_grad_(False).eval()
        _, dp_mesh = split_layers(ref, mesh, spec)
        if sharded:
            parallelize(ref, dp_mesh, param_dtype=spec.mixed_precision, offload_params=spec.ref.param_offload,
                        forward_prefetch=spec.ref.forward_prefetch)
    if spec.ref.needed:
        cast_ref(spec, ref, sharded, rank)
    for t in spec.teachers:
        teachers[t.key] = load_model(t.model_dir, **kwargs).requires_grad_(False).eval()
        own = sharded and own_tensor_parallel(spec, t)
        device = next(teachers[t.key].parameters()).device
        own_mesh = tensor_parallel_mesh(spec, world_size, device, t.tensor_parallel) if own else mesh
        teacher_tps[t.key], dp_mesh = split_layers(teachers[t.key], own_mesh, spec)
        if sharded:
            parallelize(teachers[t.key], dp_mesh, param_dtype=spec.mixed_precision, offload_params=t.param_offload,
                        forward_prefetch=spec.ref.forward_prefetch)
    return ref, teachers, teacher_tps


def optimizer_of(model: torch.nn.Module, s: WorkerSpec | CriticSpec):
    """-> (AdamW over `model`'s trained parameters, its LR scheduler) with the settings of `s` (policy or critic)."""
    optimizer = make_optimizer(model, s.lr, s.weight_decay, s.betas, s.eps)
    scheduler = make_lr_scheduler(optimizer, s.warmup_steps, s.warmup_start_factor, s.total_steps,
                                  s.lr_scheduler_type, s.min_lr_ratio, s.num_cycles)
    return optimizer, scheduler


def load_critic(spec: WorkerSpec, kwargs: dict, tokenizer, sharded: bool, mesh=None):
    """-> (the critic: a value model, placed as the policy is (its layers split over the TP group with `mesh`, its
    one-number head whole); its optimizer; its LR scheduler)."""
    from posttrain.models import load_value_model
    from posttrain.training.parallelize import parallelize

    c = spec.critic
    critic = load_value_model(c.model_dir, **kwargs)
    config = critic.config.get_text_config() if hasattr(critic.config, "get_text_config") else critic.config
    if config.vocab_size < len(tokenizer):
        from posttrain.errors import ModelError

        raise ModelError(
            f"the critic model in '{c.model_dir}' has a vocabulary of {config.vocab_size} tokens, "
            f"fewer than the actor's tokenizer ({len(tokenizer)}): the critic reads the actor's token ids, "
            "so critic.model.path must share the actor's tokenizer")
    _, dp_mesh = split_layers(critic, mesh, spec)
    if sharded:
        parallelize(critic, dp_mesh, param_dtype=spec.mixed_precision,
                    activation_checkpointing=c.gradient_checkpointing, offload_params=c.param_offload)
    elif c.gradient_checkpointing:
        critic.gradient_checkpointing_enable()
    return (critic, *optimizer_of(critic, c))


def sequence_parallel(size: int, rank: int, world_size: int, models, tensor_parallel: int = 1):
    """Groups of `size` ranks split each sequence's positions (training/ulysses.py), in every pass of `models`
    (None: absent): consecutive ranks, or with tensor parallelism those `tensor_parallel` apart (each block of
    size x tensor_parallel consecutive ranks takes the same rows; a TP group is consecutive ranks, so each
    position group holds one rank of each TP slot). -> this rank's training.ulysses.SequenceParallel."""
    import torch.distributed as dist

    from posttrain.errors import ConfigError
    from posttrain.training.ulysses import SequenceParallel, use_ulysses

    block = size * tensor_parallel
    groups = {(b, t): dist.new_group([b + i * tensor_parallel + t for i in range(size)])  # every rank makes each
              for b in range(0, world_size, block) for t in range(tensor_parallel)}
    sp = SequenceParallel(groups[(rank - rank % block, rank % tensor_parallel)], size, rank % block // tensor_parallel)
    for model in models:
        if model is not None:
            try:
                use_ulysses(model, sp, tensor_parallel)
            except ValueError as e:
                raise ConfigError(f"actor.{e}; pick a size that divides it") from None
    return sp
