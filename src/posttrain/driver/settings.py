"""The config turned into the plain settings components take (configs do not
intrude): the workers' WorkerSpec (with its RefSpec, RolloutSpec and
CriticSpec), the actor's and critic's update settings, LoRA's, the rollout
correction's, and the sampling parameters of training and validation.

    spec = worker_spec(cfg, model_dir, policy_dir=None, device="cpu", total_steps=100)
    train_sampling, val_sampling = sampling_params(cfg)
"""

from __future__ import annotations

import dataclasses
import os

from posttrain.algorithms import estimator, is_weighted_loss
from posttrain.algorithms.distill import DistillSettings
from posttrain.algorithms.rollout_corr import RolloutCorrection
from posttrain.config import VLLM_SETTINGS, uses_lora
from posttrain.config.schema_distill import teachers_of
from posttrain.config.dialects.verl.rollout_correction import from_config
from posttrain.models.lora import LoraSettings
from posttrain.rollout.base import SamplingParams
from posttrain.training.actor import UpdateSettings, warmup_steps
from posttrain.training.critic import CriticSettings
from posttrain.worker.spec import CriticSpec, RefSpec, RolloutSpec, TeacherSpec, WorkerSpec


def worker_spec(cfg, model_dir: str, policy_dir: str | None, device: str, total_steps: int,
                critic_dir: str | None = None) -> WorkerSpec:
    """What every worker needs to build its models, optimizer and rollout engine
    (and critic: from `critic_dir` when resuming, else critic.model.path or the actor's model)."""
    a, r = cfg.actor, cfg.rollout
    critic = None
    if estimator(cfg.algorithm.adv_estimator).needs_critic:
        critic = critic_spec(cfg, critic_dir or cfg.critic.model.path or model_dir, total_steps)
    return WorkerSpec(
        model_dir=model_dir, policy_dir=policy_dir, tokenizer_dir=cfg.model.tokenizer_path, update=update_settings(cfg),
        dtype=cfg.model.dtype,
        trust_remote_code=cfg.model.trust_remote_code, gradient_checkpointing=cfg.model.enable_gradient_checkpointing,
        small_attention=cfg.model.small_attention, reuse_cpu_memory=cfg.trainer.reuse_cpu_memory, device=device, lr=a.lr,
        param_offload=a.param_offload, optimizer_offload=a.optimizer_offload,
        weight_decay=a.weight_decay, betas=tuple(a.betas), eps=a.eps,
        warmup_steps=warmup_steps(a.lr_warmup_steps, a.lr_warmup_steps_ratio, total_steps),
        warmup_start_factor=a.lr_warmup_start_factor, lr_scheduler_type=a.lr_scheduler_type,
        min_lr_ratio=a.min_lr_ratio, num_cycles=a.num_cycles, total_steps=total_steps,
        log_prob_micro_batch_size=r.log_prob_micro_batch_size,
        log_prob_max_tokens=r.log_prob_max_token_len_per_gpu if r.log_prob_use_dynamic_bsz else None,
        log_prob_budget_from_memory=cfg.model.log_prob_budget_from_memory,
        forward_prefetch=a.forward_prefetch, freeze_vision_tower=a.freeze_vision_tower,
        sequence_parallel=a.ulysses_sequence_parallel_size, tensor_parallel=a.tensor_parallel_size,
        tensor_sequence_parallel=a.sequence_parallel and a.tensor_parallel_size > 1,
        tensor_parallel_plan=a.tensor_parallel_plan, lora=lora_settings(cfg), temperature=r.temperature,
        mixed_precision=mixed_precision(cfg, device), reduce_dtype=a.mixed_precision.reduce_dtype,
        seed=cfg.trainer.seed, collective_timeout_s=cfg.trainer.collective_timeout_s,
        threads=split_threads(cfg, device)[0], ref=ref_spec(cfg), rollout=rollout_spec(cfg, device), critic=critic,
        teachers=teacher_specs(cfg),
    )


def ref_spec(cfg) -> RefSpec:
    ref = cfg.ref
    return RefSpec(needed=cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward, param_offload=ref.param_offload,
                   log_prob_micro_batch_size=ref.log_prob_micro_batch_size,
                   log_prob_max_tokens=ref.log_prob_max_token_len_per_gpu if ref.log_prob_use_dynamic_bsz else None,
                   torch_compile=ref.use_torch_compile, forward_prefetch=ref.forward_prefetch,
                   cast_weights=ref.cast_weights)


def rollout_spec(cfg, device: str = "cpu") -> RolloutSpec:
    r = cfg.rollout
    return RolloutSpec(
        name=r.name, micro_batch_size=r.micro_batch_size, shared_prefill=r.shared_prefill,
        remove_padding=r.remove_padding, early_stop=r.early_stop, stop_check_every=r.stop_check_every,
        static_decoding=r.static_decoding, enforce_eager=r.enforce_eager,
        tensor_parallel_size=r.tensor_model_parallel_size,
        gpu_memory_utilization=r.gpu_memory_utilization,
        max_model_len=r.max_model_len or cfg.data.max_prompt_length + cfg.data.max_response_length,
        engine_kwargs=vllm_engine_kwargs(r), free_cache_engine=r.free_cache_engine,
        weights_from_policy=r.name == "vllm" and (r.load_format or "").startswith("dummy"),
        kv_cache_sequences=cfg.data.train_batch_size * r.n, dtype=r.dtype, stale_updates=r.stale_updates,
        remote=cfg.async_training.enable, threads=split_threads(cfg, device)[1],
        in_flight=cfg.async_training.enable and cfg.async_training.in_flight_weight_updates,
        workers=rollout_workers(cfg), max_failures=cfg.async_training.max_rollout_failures,
        piece_size=stream_piece_size(cfg),
    )


def stream_piece_size(cfg) -> int:
    """async_training.stream_samples: prompts per streamed piece (async_training.stream_piece_size, or the batch's
    prompts over 4 x the rollout workers); 0: not streamed."""
    a = cfg.async_training
    if not (a.enable and a.stream_samples):
        return 0
    return a.stream_piece_size or max(1, -(-cfg.data.train_batch_size // (4 * rollout_workers(cfg))))


def rollout_workers(cfg) -> int:
    """Asynchronous training's rollout workers: its devices (async_training.rollout_nnodes x
    rollout_n_gpus_per_node) over the engine's tensor-parallel size (validation checks that it divides)."""
    a = cfg.async_training
    return max(1, a.rollout_nnodes * a.rollout_n_gpus_per_node // cfg.rollout.tensor_model_parallel_size)


def split_threads(cfg, device: str) -> tuple[int | None, int | None]:
    """Asynchronous training on a CPU: (the trainer's torch threads, the rollout process's), the cores split
    between them (async_training.rollout_threads, or half each); (None, None) otherwise: torch's defaults."""
    a = cfg.async_training
    if not a.enable or device != "cpu":
        return None, None
    cores = os.cpu_count() or 1
    rollout = a.rollout_threads or max(1, cores // 2)
    return max(1, cores - rollout), rollout


def critic_spec(cfg, critic_dir: str, total_steps: int) -> CriticSpec:
    c = cfg.critic
    settings = CriticSettings(
        mini_batch_size=c.ppo_mini_batch_size * cfg.rollout.n, micro_batch_size=c.ppo_micro_batch_size_per_gpu,
        forward_micro_batch_size=c.forward_micro_batch_size_per_gpu, ppo_epochs=c.ppo_epochs,
        micro_max_tokens=c.ppo_max_token_len_per_gpu if c.use_dynamic_bsz else None,
        forward_max_tokens=c.forward_max_token_len_per_gpu if c.use_dynamic_bsz else None,
        cliprange_value=c.cliprange_value, loss_coef=c.loss_coef, loss_agg_mode=c.loss_agg_mode,
        loss_scale_factor=float(cfg.data.max_response_length), grad_clip=c.grad_clip,
        remove_padding=cfg.model.use_remove_padding if c.model.use_remove_padding is None
        else c.model.use_remove_padding)
    return CriticSpec(model_dir=str(critic_dir), update=settings, lr=c.lr, weight_decay=c.weight_decay,
                      betas=tuple(c.betas), eps=c.eps, warmup_steps=warmup_steps(c.lr_warmup_steps, c.lr_warmup_steps_ratio,
                                                                      total_steps),
                      warmup_start_factor=c.lr_warmup_start_factor, lr_scheduler_type=c.lr_scheduler_type,
                      min_lr_ratio=c.min_lr_ratio, num_cycles=c.num_cycles, total_steps=total_steps,
                      gradient_checkpointing=c.model.enable_gradient_checkpointing,
                      param_offload=c.model.param_offload, optimizer_offload=c.model.optimizer_offload)


def update_settings(cfg) -> UpdateSettings:
    a = cfg.actor
    settings = UpdateSettings(
        mini_batch_size=a.ppo_mini_batch_size * cfg.rollout.n,  # verl counts prompts; we count sequences
        micro_batch_size=a.ppo_micro_batch_size, ppo_epochs=a.ppo_epochs,
        micro_max_tokens=a.ppo_max_token_len_per_gpu if a.use_dynamic_bsz else None,
        clip_ratio_low=a.clip_ratio_low, clip_ratio_high=a.clip_ratio_high, clip_ratio_c=a.clip_ratio_c,
        loss_agg_mode=a.loss_agg_mode, loss_mode=a.policy_loss.loss_mode,
        loss_scale_factor=float(a.loss_scale_factor or cfg.data.max_response_length),
        entropy_coeff=a.entropy_coeff, use_kl_loss=a.use_kl_loss, kl_loss_coef=a.kl_loss_coef, kl_loss_type=a.kl_loss_type, temperature=cfg.rollout.temperature,
        grad_clip=a.grad_clip, remove_padding=cfg.model.use_remove_padding, share_prompt=cfg.model.share_prompt,
        fused_kernels=cfg.model.use_fused_kernels, entropy_chunking=a.entropy_from_logits_with_chunking,
        entropy_checkpointing=a.entropy_checkpointing, torch_compile=a.use_torch_compile,
        bypass_correction=rollout_correction(cfg) if cfg.algorithm.rollout_correction.bypass_mode else None,
        distill=distill_settings(cfg),
    )
    if cfg.algorithm.rollout_correction.bypass_mode and reinforce(cfg):  # pi_theta / pi_rollout weighs -A log pi
        settings = dataclasses.replace(settings, loss_mode=is_weighted_loss())
    return settings


def distill_settings(cfg) -> DistillSettings | None:
    """algorithms.distill.DistillSettings with distillation.enabled, else None."""
    if not cfg.distillation.enabled:
        return None
    d = cfg.distillation.distillation_loss
    return DistillSettings(loss_mode=d.loss_mode, use_policy_gradient=d.use_policy_gradient,
                           use_task_rewards=d.use_task_rewards, coef=d.distillation_loss_coef,
                           loss_max_clamp=d.loss_max_clamp, log_prob_min_clamp=d.log_prob_min_clamp, topk=d.topk,
                           kl_type=d.kl_type, mixed_kl_weight=d.mixed_kl_weight, zero_outside_topk=d.zero_outside_topk)


def teacher_specs(cfg) -> tuple[TeacherSpec, ...]:
    """The teachers' models and passes with distillation.enabled (one, or one per routing key), else ()."""
    d = cfg.distillation
    if not d.enabled:
        return ()
    ref = cfg.ref
    return tuple(TeacherSpec(model_dir=str(t["model_path"]), key=key, param_offload=d.param_offload,
                             log_prob_micro_batch_size=d.log_prob_micro_batch_size or ref.log_prob_micro_batch_size,
                             log_prob_max_tokens=ref.log_prob_max_token_len_per_gpu if ref.log_prob_use_dynamic_bsz
                             else None, tensor_parallel=d.tensor_parallel_size)
                 for key, t in teachers_of(d).items())


def lora_settings(cfg) -> LoraSettings | None:
    """models.lora.LoraSettings with LoRA on (model.lora_rank > 0 or an adapter to start from), else None."""
    m = cfg.model
    if not uses_lora(cfg):
        return None
    sync = cfg.rollout.lora_sync or ("merged" if cfg.rollout.name == "vllm" else "adapter")
    return LoraSettings(rank=m.lora_rank, alpha=m.lora_alpha, target_modules=m.target_modules,
                        exclude_modules=m.exclude_modules, dropout=m.lora_dropout, adapter_path=m.lora_adapter_path,
                        sync=sync)


def mixed_precision(cfg, device: str) -> str | None:
    """The compute dtype over the stored weights: actor.mixed_precision.param_dtype, else bf16 over
    float32 weights on a GPU; None when it is the weights' own dtype (nothing to cast)."""
    dtype = cfg.actor.mixed_precision.param_dtype
    if dtype is None:
        dtype = "bfloat16" if device == "cuda" and cfg.model.dtype == "float32" else None
    return None if dtype == cfg.model.dtype else dtype


def vllm_engine_kwargs(r) -> dict:
    """rollout.* settings of vLLM's engine and rollout.engine_kwargs.vllm, as vllm.LLM arguments. verl's
    dummy_* load formats (its trainer pushes the weights) become vLLM's "dummy": the worker pushes them."""
    out = {k: getattr(r, k) for k in VLLM_SETTINGS if getattr(r, k) is not None and k != "max_model_len"}
    if str(out.get("load_format", "")).startswith("dummy"):
        out["load_format"] = "dummy"
    return {**out, **r.engine_kwargs.get("vllm", {})}


def rollout_log_probs(cfg) -> bool:
    """Whether the engine returns its log-probs of the sampled tokens (rollout.calculate_log_probs; null: with
    vLLM, whose numerics differ from the trainer's; always with algorithm.rollout_correction on)."""
    c = cfg.rollout.calculate_log_probs
    if rollout_correction(cfg) is not None:  # the correction's behaviour policy
        return True
    return cfg.rollout.name == "vllm" if c is None else bool(c)


def sampling_params(cfg) -> tuple[SamplingParams, SamplingParams]:
    """-> (training's, validation's (rollout.val_kwargs)) sampling parameters."""
    r, v = cfg.rollout, cfg.rollout.val_kwargs
    train = SamplingParams(max_new_tokens=cfg.data.max_response_length, n=r.n, temperature=r.temperature,
                           top_p=r.top_p, top_k=r.top_k, do_sample=r.do_sample, ignore_eos=r.ignore_eos,
                           logprobs=rollout_log_probs(cfg))
    val = SamplingParams(max_new_tokens=cfg.data.max_response_length, n=v.n, temperature=v.temperature,
                         top_p=v.top_p, top_k=v.top_k, do_sample=v.do_sample, ignore_eos=r.ignore_eos)
    return train, val


def rollout_correction(cfg):
    """algorithm.rollout_correction as algorithms.rollout_corr's settings; None when it sets no IS weights,
    rejection or veto, except in bypass mode (then a RolloutCorrection with everything off: its metrics only).
    ValueError (naming the key) on a bad setting."""
    rc = cfg.algorithm.rollout_correction
    c = from_config(rc)
    return RolloutCorrection() if c is None and rc.bypass_mode else c


def reinforce(cfg) -> bool:
    """Bypass mode's IS-weighted policy gradient (loss_type=reinforce, or verl's earlier use_policy_gradient)."""
    rc = cfg.algorithm.rollout_correction
    return rc.loss_type == "reinforce" or rc.use_policy_gradient
