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
    # {name: {model_path: DIR, ...}}: one teacher (a Hugging Face directory with the student's tokenizer); verl's
    # inference.* (the teacher's own engine), key and num_replicas are named unused
    teacher_models: Dict[str, Any] = field(default_factory=dict)
    teacher_key: Optional[str] = None  # verl's routing of rows to several teachers: one teacher only
    n_gpus_per_node: Optional[int] = None  # verl's devices of the teacher's own: posttrain runs it beside the policy
    nnodes: Optional[int] = None
    param_offload: bool = False  # the teacher's sharded parameters in CPU memory (FSDP2 workers), as ref.param_offload
    log_prob_micro_batch_size: Optional[int] = None  # the teacher's pass; null: ref.log_prob_micro_batch_size
    distillation_loss: DistillationLossConfig = field(default_factory=DistillationLossConfig)
