"""distillation.*'s checks (validate.py runs them with the rest): the teachers, the loss and its settings."""

from __future__ import annotations

import warnings

from posttrain.algorithms.distill import KL_TYPES, LOSS_MODES, TOPK_MODES
from posttrain.config.checks import choice, need, positive_or_null
from posttrain.config.schema import Config
from posttrain.config.schema_distill import teacher_entries

KEY = "distillation.distillation_loss"


def _teacher_tensor_parallel(cfg: Config) -> None:
    """distillation.tensor_parallel_size: dividing the workers; a multiple or a divisor of the workers that share
    rows (a TP group of the teacher spans whole groups of them, or lies within one)."""
    size = cfg.distillation.tensor_parallel_size
    if size is None:
        return
    positive_or_null(cfg, "distillation.tensor_parallel_size")
    world = cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node
    rows = cfg.actor.tensor_parallel_size * cfg.actor.ulysses_sequence_parallel_size
    key = f"distillation.tensor_parallel_size={size}"
    need(world % size == 0, f"{key} must divide the {world} workers (trainer.nnodes x trainer.n_gpus_per_node)")
    need(size % rows == 0 or rows % size == 0, f"{key} must be a multiple or a divisor of the {rows} workers that "
         "share rows (actor.tensor_parallel_size x actor.ulysses_sequence_parallel_size)")


def validate_distillation(cfg: Config) -> None:
    """distillation.*: teachers with a model_path (several: distinct routing keys), a known loss with its
    settings, one policy loss."""
    d = cfg.distillation
    if not d.enabled:
        if d.teacher_models:
            warnings.warn("distillation.teacher_models: set, but unused (distillation.enabled=false)", stacklevel=3)
        return
    need(bool(d.teacher_models), "distillation.enabled=true but distillation.teacher_models is empty: give "
         "distillation.teacher_models.teacher_model.model_path=DIR")
    for name, teacher in d.teacher_models.items():
        need(isinstance(teacher, dict), f"distillation.teacher_models.{name} must be a mapping (model_path, key)")
    entries = teacher_entries(d)
    for name, _, teacher in entries:
        need(bool(teacher.get("model_path")), f"distillation.teacher_models.{name}.model_path is not set: the "
             "teacher's Hugging Face model directory")
    keys = [key for _, key, _ in entries]
    shared = [k for k in keys if keys.count(k) > 1]
    need(not shared, f"distillation.teacher_models: two teachers share the routing key {shared[:1] and shared[0]!r}; "
         f"give each its own key (the value of the rows' {d.teacher_key or 'data_source'} it scores)")
    _loss(cfg)
    positive_or_null(cfg, "distillation.log_prob_micro_batch_size")
    _teacher_tensor_parallel(cfg)
    elsewhere = [k for k in ("n_gpus_per_node", "nnodes") if getattr(d, k) is not None]
    elsewhere += ["teacher_key"] * (d.teacher_key is not None and len(entries) == 1)
    elsewhere += [f"teacher_models.{n}.{k}" for n, _, t in entries for k in t
                  if k != "model_path" and not (k == "key" and len(entries) > 1)]
    if elsewhere:
        warnings.warn(f"distillation.{', distillation.'.join(elsewhere)}: verl's settings of a teacher on devices "
                      "and an engine of its own (or of routing, with one teacher); posttrain runs the teachers "
                      "beside the policy on the same workers (as the reference): set, but unused", stacklevel=3)


def _loss(cfg: Config) -> None:
    loss = cfg.distillation.distillation_loss
    need(loss.loss_mode not in ("reverse_kl_topk", "jsd_topk"),
         f"{KEY}.loss_mode={loss.loss_mode} needs the student's own top-k tokens beside the teacher's, not supported; "
         f"forward_kl_topk, or kl_topk with {KEY}.kl_type=reverse|mixed, compare the distributions on the teacher's "
         "top k")
    choice(f"{KEY}.loss_mode", loss.loss_mode, LOSS_MODES + TOPK_MODES)
    need(loss.loss_mode not in ("k1", "kl") or loss.use_policy_gradient,
         f"{KEY}.loss_mode={loss.loss_mode} as a direct loss has the gradient of the student's log-probs alone, "
         f"whatever the teacher says; set {KEY}.use_policy_gradient=true (the reverse KL's policy gradient) or use "
         "k3 as a direct loss")
    if loss.loss_mode in TOPK_MODES:
        need(isinstance(loss.topk, int) and loss.topk >= 1,
             f"{KEY}.topk={loss.topk}: loss_mode={loss.loss_mode} needs the number of the teacher's likeliest tokens "
             "kept at each position (e.g. 64)")
        need(not loss.use_policy_gradient, f"{KEY}.loss_mode={loss.loss_mode} is a direct loss over the top-k "
             f"distribution; set {KEY}.use_policy_gradient=false (k1 with it true is the policy-gradient form)")
        choice(f"{KEY}.kl_type", loss.kl_type, KL_TYPES)
        need(0.0 <= loss.mixed_kl_weight <= 1.0, f"{KEY}.mixed_kl_weight={loss.mixed_kl_weight} must be in [0, 1]")
        need(not cfg.model.use_fused_kernels, f"{KEY}.loss_mode={loss.loss_mode} needs the student's logits, which "
             "model.use_fused_kernels=true never forms; set it to false")
    mode = loss.policy_loss_mode
    need(mode is None or mode == cfg.actor.policy_loss.loss_mode or (mode == "vanilla"),
         f"{KEY}.policy_loss_mode={mode} differs from actor.policy_loss.loss_mode="
         f"{cfg.actor.policy_loss.loss_mode}: posttrain has one policy loss; set the actor's")
    need(loss.distillation_loss_coef > 0, f"{KEY}.distillation_loss_coef must be > 0")
    need(loss.loss_max_clamp is None or loss.loss_max_clamp > 0, f"{KEY}.loss_max_clamp must be > 0 or null")
