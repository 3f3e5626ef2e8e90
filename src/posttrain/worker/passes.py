"""The worker's forward passes without gradients: log-probs under the policy, the reference or a teacher,
a teacher's top-k for distillation, the critic's values. Each runs under the policy's autocast
(engines.autocast_of) with the micro-batches and token budget of the model it runs; the policy's and the
reference's log-prob passes without a budget take one from the device's free memory on CUDA
(model.log_prob_budget_from_memory, `memory_budget`).
"""

from __future__ import annotations

import contextlib
import os

import torch

from posttrain.training.logprobs import compute_device, compute_log_probs, compute_topk_log_probs
from posttrain.training.microbatch import memory_token_budget
from posttrain.worker.engines import autocast_of
from posttrain.worker.spec import TeacherSpec, WorkerSpec


def teacher_spec(spec: WorkerSpec, key: str | None) -> TeacherSpec:
    """The teacher of routing key `key` (None: the only one)."""
    return next(t for t in spec.teachers if t.key == key or len(spec.teachers) == 1)


def log_probs(spec: WorkerSpec, batch, which: str, teacher: str | None, policy, ref, teachers: dict, sp,
              tp=None) -> torch.Tensor:
    """-> log-probs [N, R] of batch.responses under the policy, the reference or the teacher (`which`; of key
    `teacher` when there are several). `sp`: training.ulysses.SequenceParallel, or None; `tp`: this worker's
    training.tensor_parallel.TensorParallel (every model split alike), or None."""
    from posttrain.models.lora import base_only

    lora_ref = which == "ref" and spec.lora is not None  # the reference is the base: the policy, adapters off
    if which == "teacher":
        t = teacher_spec(spec, teacher)
        model, size, budget = teachers[t.key], t.log_prob_micro_batch_size, t.log_prob_max_tokens
    else:
        model = {"policy": policy, "ref": policy if lora_ref else ref}[which]
        size, budget = {"policy": (spec.log_prob_micro_batch_size, spec.log_prob_max_tokens),
                        "ref": (spec.ref.log_prob_micro_batch_size, spec.ref.log_prob_max_tokens)}[which]
    options = spec.update.pass_options(compile=None if which == "policy" else spec.ref.torch_compile, sp=sp, tp=tp)
    # the token counts stand for the memory only on trimmed, length-ordered micro-batches (remove_padding)
    if budget is None and which != "teacher" and sp is None and options.remove_padding \
            and budget_from_memory(spec, model):
        budget = memory_budget(model, spec.mixed_precision)
    with autocast_of(spec), base_only(model) if lora_ref else contextlib.nullcontext():
        return compute_log_probs(model, batch, size, spec.temperature, options=options, max_tokens=budget)[0]


def budget_from_memory(spec: WorkerSpec, model) -> bool:
    """model.log_prob_budget_from_memory, or its default: on where the model computes on CUDA."""
    on = spec.log_prob_budget_from_memory
    return compute_device(model).type == "cuda" if on is None else on


def free_bytes(device: torch.device) -> int:
    """The memory a pass on `device` may take: on CUDA the driver's free bytes plus what torch's allocator
    holds unused (cached blocks are free to it); on the CPU the free physical memory."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def memory_budget(model, compute_dtype: str | None = None, fraction: float = 0.5) -> int:
    """A token budget per micro-batch for `model`'s no-gradient log-prob pass, from the free memory of its
    device now and its shape (microbatch.memory_token_budget; `compute_dtype`: the autocast's, else the
    weights')."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    hidden, heads = config.hidden_size, config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv_width = (getattr(config, "num_key_value_heads", None) or heads) * head_dim
    intermediate = getattr(config, "intermediate_size", None) or 4 * hidden
    dtype = getattr(torch, compute_dtype) if compute_dtype else next(model.parameters()).dtype
    return memory_token_budget(free_bytes(compute_device(model)), config.vocab_size, hidden, intermediate,
                               config.num_hidden_layers, kv_width, dtype.itemsize, fraction)


def teacher_topk(spec: WorkerSpec, batch, k: int, teacher: str | None, teachers: dict, sp, tp=None):
    """The teacher's pass of distillation's top-k modes: -> (log-probs of batch.responses [N, R], its k likeliest
    tokens' log-probs [N, R, k] and ids [N, R, k]). `tp`: the teacher is split as the policy is."""
    t = teacher_spec(spec, teacher)
    options = spec.update.pass_options(compile=False, sp=sp, tp=tp)
    with autocast_of(spec):
        return compute_topk_log_probs(teachers[t.key], batch, k, t.log_prob_micro_batch_size, spec.temperature,
                                      options=options, max_tokens=t.log_prob_max_tokens)


def over_teacher_group(spec: WorkerSpec, batch, tp, pad_token_id: int, fn):
    """fn(rows) -> a tuple of [rows, R, ...] tensors, for this worker's `batch`. A teacher split by a TP size of its
    own wider than the groups of workers that share rows (spec.sequence_parallel x spec.tensor_parallel) runs on
    the rows of every such group its TP group spans: those are gathered (one copy per group, in rank order,
    re-padded), `fn` runs on all of them on each rank of the TP group, and each worker keeps its own rows."""
    shared = spec.sequence_parallel * spec.tensor_parallel
    if tp is None or tp.size <= shared:
        return fn(batch)
    import torch.distributed as dist

    parts = [None] * tp.size
    dist.all_gather_object(parts, batch, group=tp.group)
    parts = parts[::shared]  # one worker of each group of workers that share rows
    start = sum(len(b) for b in parts[:tp.rank // shared])
    out = fn(type(batch).concat(parts, pad_token_id))
    return tuple(t[start:start + len(batch), :batch.response_length] for t in out)


def values(spec: WorkerSpec, batch, critic, sp) -> torch.Tensor:
    """-> the critic's values [N, R] of batch's response positions."""
    from posttrain.training.critic import compute_values

    c = spec.critic.update
    with autocast_of(spec):
        return compute_values(critic, batch, c.forward_micro_batch_size, c.remove_padding, c.forward_max_tokens, sp)
