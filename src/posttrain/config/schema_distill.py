"""The distillation section's dataclasses (distillation.*): on-policy distillation from a teacher model, in
verl's spelling (its `distillation:` config), so its commands' keys are posttrain's own."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Optional


@dataclass
class DistillationLossConfig:
    # the per-token divergence of the sampled tokens: k1 | kl | abs | mse | k2 | low_var_kl | k3; or of the
    # teacher's top-k distribution at each position: forward_kl_topk (verl's) | kl_topk (NeMo-RL's, kl_type below)
    # (verl's reverse_kl_topk / jsd_topk also need the student's own top k: refused)
    loss_mode: str = "k3"
    # false: the divergence is the loss (its gradient through the student's log-probs); true: minus the
    # divergence is each token's advantage in the policy loss (Thinking Machines' on-policy distillation)
    use_policy_gradient: bool = False
    use_task_rewards: bool = False  # also the reward's policy loss; the distillation's times distillation_loss_coef
    distillation_loss_coef: float = 1.0
    loss_max_clamp: Optional[float] = None  # each token's divergence at most this
    log_prob_min_clamp: Optional[float] = None  # both log-probs at least this
    topk: Optional[int] = None  # the top-k modes: the teacher's k likeliest tokens at each position
    kl_type: str = "mixed"  # kl_topk (NeMo-RL's loss_fn.kl_type): forward | reverse | mixed
    mixed_kl_weight: float = 0.5  # kl_topk mixed: the forward KL's weight, the reverse's 1 - it
    zero_outside_topk: bool = False  # kl_topk: the student's probabilities unrenormalised, the teacher's ~0 outside k
    jsd_beta: float = 0.5  # verl's jsd_topk only
    policy_loss_mode: Optional[str] = None  # the policy loss of use_policy_gradient; null: actor.policy_loss's


@dataclass
class DistillationConfig:
    enabled: bool = False
    # {name: {model_path: DIR, key: ROUTE, ...}}: the teachers (Hugging Face directories with the student's
    # tokenizer); with several, each scores the rows whose teacher_key value is its key (verl's MOPD); verl's
    # inference.* (a teacher's own engine) and num_replicas are named unused
    teacher_models: Dict[str, Any] = field(default_factory=dict)
    teacher_key: Optional[str] = None  # several teachers: the row's field that routes it (null: data_source)
    n_gpus_per_node: Optional[int] = None  # verl's devices of the teacher's own: posttrain runs it beside the policy
    nnodes: Optional[int] = None
    param_offload: bool = False  # the teacher's sharded parameters in CPU memory (FSDP2 workers), as ref.param_offload
    log_prob_micro_batch_size: Optional[int] = None  # the teacher's pass; null: ref.log_prob_micro_batch_size
    # the teachers' own tensor-parallel size (a large teacher split wider than its student; NeMo-RL's
    # teacher.dtensor_cfg.tensor_parallel_size); null: actor.tensor_parallel_size. A multiple of the workers that
    # share rows (actor.tensor_parallel_size x ulysses_sequence_parallel_size: their rows are gathered for it) or
    # a divisor of it
    tensor_parallel_size: Optional[int] = None
    distillation_loss: DistillationLossConfig = field(default_factory=DistillationLossConfig)


PLACEHOLDER = "teacher_model"  # verl's config names its one teacher so; with several, an entry of that name left empty


def teacher_entries(d: DistillationConfig) -> list[tuple[str, str | None, dict]]:
    """distillation.teacher_models as run: [(name, routing key, entry)], the key None with one teacher. With
    several, verl's empty `teacher_model` entry is left out and each one's key is its `key` (else its name)."""
    entries = {name: dict(t) if isinstance(t, dict) else {} for name, t in d.teacher_models.items()}
    if len(entries) > 1 and not entries.get(PLACEHOLDER, {}).get("model_path"):
        entries.pop(PLACEHOLDER, None)
    if len(entries) == 1:
        return [(name, None, t) for name, t in entries.items()]
    return [(name, str(t.get("key") or name), t) for name, t in entries.items()]


def teachers_of(d: DistillationConfig) -> dict[str | None, dict]:
    """{routing key (None with one teacher): entry} of teacher_entries."""
    return {key: t for _, key, t in teacher_entries(d)}
