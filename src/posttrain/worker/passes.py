"""The worker's forward passes without gradients: log-probs under the policy, the reference or a teacher,
a teacher's top-k for distillation, the critic's values. Each runs under the policy's autocast
(engines.autocast_of) with the micro-batches and token budget of the model it runs.
"""

from __future__ import annotations

import contextlib

import torch

from posttrain.training.logprobs import compute_log_probs, compute_topk_log_probs
from posttrain.worker.engines import autocast_of
from posttrain.worker.spec import TeacherSpec, WorkerSpec


def teacher_spec(spec: WorkerSpec, key: str | None) -> TeacherSpec:
    """The teacher of routing key `key` (None: the only one)."""
    return next(t for t in spec.teachers if t.key == key or len(spec.teachers) == 1)


def log_probs(spec: WorkerSpec, batch, which: str, teacher: str | None, policy, ref, teachers: dict, sp
              ) -> torch.Tensor:
    """-> log-probs [N, R] of batch.responses under the policy, the reference or the teacher (`which`; of key
    `teacher` when there are several). `sp`: training.ulysses.SequenceParallel, or None."""
    from posttrain.models.lora import base_only

    lora_ref = which == "ref" and spec.lora is not None  # the reference is the base: the policy, adapters off
    if which == "teacher":
        t = teacher_spec(spec, teacher)
        model, size, budget = teachers[t.key], t.log_prob_micro_batch_size, t.log_prob_max_tokens
    else:
        model = {"policy": policy, "ref": policy if lora_ref else ref}[which]
        size, budget = {"policy": (spec.log_prob_micro_batch_size, spec.log_prob_max_tokens),
                        "ref": (spec.ref.log_prob_micro_batch_size, spec.ref.log_prob_max_tokens)}[which]
    options = spec.update.pass_options(compile=None if which == "policy" else spec.ref.torch_compile, sp=sp)
    with autocast_of(spec), base_only(model) if lora_ref else contextlib.nullcontext():
        return compute_log_probs(model, batch, size, spec.temperature, options=options, max_tokens=budget)[0]


def teacher_topk(spec: WorkerSpec, batch, k: int, teacher: str | None, teachers: dict, sp):
    """The teacher's pass of distillation's top-k modes: -> (log-probs of batch.responses [N, R], its k likeliest
    tokens' log-probs [N, R, k] and ids [N, R, k])."""
    t = teacher_spec(spec, teacher)
    options = spec.update.pass_options(compile=False, sp=sp)
    with autocast_of(spec):
        return compute_topk_log_probs(teachers[t.key], batch, k, t.log_prob_micro_batch_size, spec.temperature,
                                      options=options, max_tokens=t.log_prob_max_tokens)


def values(spec: WorkerSpec, batch, critic, sp) -> torch.Tensor:
    """-> the critic's values [N, R] of batch's response positions."""
    from posttrain.training.critic import compute_values

    c = spec.critic.update
    with autocast_of(spec):
        return compute_values(critic, batch, c.forward_micro_batch_size, c.remove_padding, c.forward_max_tokens, sp)
