"""NeMo-RL's keys as posttrain reads them: tables only (so longer than a module of code would be).

What each key of NeMo-RL's GRPO layout becomes: renamed (RENAMES), accepted only
"off" (OFF), read together into another framework's settings (IS_CORRECTION), a
section a file switches off (SWITCHED), or a tuning knob with no effect on what is
trained (TUNING); files.py reads the files, grpo.py applies them.
The guide docs/coming-from-nemo-rl.md lists the same keys for people.
"""

# top-level sections only NeMo-RL has (posttrain and verl have `data` too)
SECTIONS = ("grpo", "loss_fn", "policy", "checkpointing", "cluster", "logger", "env", "reward_penalties",
            "data_plane", "on_policy_distillation", "sft", "dpo", "rm", "distillation", "ppo", "value", "value_loss_fn",
            "teacher", "teachers")
# NeMo-RL's other trainers, each known by its own section: what a file with one runs (refused by posttrain train)
OTHER_TRAINERS = {
    "sft": "NeMo-RL's supervised fine-tuning (examples/run_sft.py; `posttrain sft --config FILE` reads it)",
    "dpo": "NeMo-RL's DPO (examples/run_dpo.py)",
    "rm": "NeMo-RL's reward-model training (examples/run_rm.py)",
}
# a PPO file's value.* (the critic), translated as a policy section: its posttrain keys -> the critic's
VALUE_KEYS = {
    "model.path": "critic.model.path", "actor.lr": "critic.lr", "actor.weight_decay": "critic.weight_decay",
    "actor.betas": "critic.betas", "actor.eps": "critic.eps", "actor.grad_clip": "critic.grad_clip",
    "actor.ppo_mini_batch_size": "critic.ppo_mini_batch_size",
    "actor.ppo_micro_batch_size": "critic.ppo_micro_batch_size_per_gpu",
    "actor.lr_warmup_steps": "critic.lr_warmup_steps", "actor.lr_warmup_start_factor": "critic.lr_warmup_start_factor",
    "actor.param_offload": "critic.model.param_offload", "actor.optimizer_offload": "critic.model.optimizer_offload",
    "actor.use_dynamic_bsz": "critic.use_dynamic_bsz",
    "actor.ppo_max_token_len_per_gpu": "critic.ppo_max_token_len_per_gpu",
    "model.enable_gradient_checkpointing": "critic.model.enable_gradient_checkpointing",
    "actor.ulysses_sequence_parallel_size": "critic.ulysses_sequence_parallel_size",
}
# data.* keys only NeMo-RL has (its newer per-split layout and loader settings)
DATA_KEYS = ("data.max_input_seq_length", "data.num_workers", "data.use_multiple_dataloader", "data.train.",
             "data.validation.", "data.default.")

# NeMo-RL key -> posttrain key, the value as it is
RENAMES = {
    "grpo.num_prompts_per_step": "data.train_batch_size",
    "grpo.num_generations_per_prompt": "rollout.n",
    "grpo.max_num_steps": "trainer.total_training_steps",
    "grpo.max_num_epochs": "trainer.max_epochs",
    "grpo.val_period": "trainer.test_freq",
    "grpo.val_at_start": "trainer.val_before_train",
    "grpo.val_at_end": "trainer.val_at_end",
    "grpo.max_val_samples": "data.val_max_samples",
    "grpo.val_batch_size": "data.val_batch_size",
    "grpo.val_num_generations_per_prompt": "rollout.val_kwargs.n",
    "grpo.seed": "trainer.seed",
    "grpo.use_dynamic_sampling": "algorithm.filter_groups.enable",
    "grpo.dynamic_sampling_max_gen_batches": "algorithm.filter_groups.max_num_gen_batches",
    "grpo.overlong_filtering": "algorithm.overlong_filtering",
    "grpo.reward_shaping.overlong_buffer_length": "reward.overlong_buffer.len",
    "grpo.reward_shaping.overlong_buffer_penalty": "reward.overlong_buffer.penalty_factor",
    "grpo.reward_shaping.max_response_length": "reward.overlong_buffer.max_resp_len",
    "loss_fn.ratio_clip_min": "actor.clip_ratio_low",
    "loss_fn.ratio_clip_max": "actor.clip_ratio_high",
    "loss_fn.ratio_clip_c": "actor.clip_ratio_c",
    "policy.model_name": "model.path",
    "policy.train_micro_batch_size": "actor.ppo_micro_batch_size",
    "policy.precision": "model.dtype",
    "policy.generation.temperature": "rollout.temperature",
    "policy.generation.top_p": "rollout.top_p",
    "policy.generation.max_new_tokens": "data.max_response_length",
    "policy.generation.val_top_p": "rollout.val_kwargs.top_p",
    "policy.generation.vllm_cfg.tensor_parallel_size": "rollout.tensor_model_parallel_size",
    "policy.generation.vllm_cfg.gpu_memory_utilization": "rollout.gpu_memory_utilization",
    "policy.dtensor_cfg.activation_checkpointing": "model.enable_gradient_checkpointing",
    "policy.dtensor_cfg.context_parallel_size": "actor.ulysses_sequence_parallel_size",
    "policy.dtensor_cfg.tensor_parallel_size": "actor.tensor_parallel_size",
    "policy.dtensor_cfg.sequence_parallel": "actor.sequence_parallel",
    "policy.dtensor_cfg.custom_parallel_plan": "actor.tensor_parallel_plan",
    "policy.optimizer.kwargs.lr": "actor.lr",
    "policy.optimizer.kwargs.weight_decay": "actor.weight_decay",
    "policy.optimizer.kwargs.betas": "actor.betas",
    "policy.optimizer.kwargs.eps": "actor.eps",
    "checkpointing.save_period": "trainer.save_freq",
    "cluster.gpus_per_node": "trainer.n_gpus_per_node",
    "cluster.num_nodes": "trainer.nnodes",
    "logger.num_val_samples_to_print": "trainer.log_val_generations",
    "data.shuffle": "data.shuffle",
    "data.max_input_seq_length": "data.max_prompt_length",
    "env.math.num_workers": "reward.num_workers",
}

# accepted only with the value(s) that mean "off" (what posttrain does); any other is refused
OFF = {
    "grpo.val_start_at": (-1, 0, None),
    "grpo.advantage_clip_low": (None,), "grpo.advantage_clip_high": (None,),
    "grpo.stop_at_validation_metric": (None,), "grpo.stop_at_validation_threshold": (None,),
    "grpo.seq_logprob_error_threshold": (None,),
    "grpo.invalid_tool_call_advantage": (None,), "grpo.malformed_thinking_advantage": (None,),
    "loss_fn.kl_input_clamp_value": (20, None), "loss_fn.kl_output_clamp_value": (10, None),  # posttrain's k3 clamps
    "loss_fn.use_on_policy_kl_approximation": (False,),
    "loss_fn.use_cispo": (False,), "loss_fn.disable_ppo_ratio": (False,),
    "loss_fn.positive_example_nll_weight": (0,),
    "checkpointing.checkpoint_must_save_by": (None,),
    "checkpointing.save_optimizer": (True,),  # posttrain always saves it: resume is exact
    "policy.hf_config_overrides": ({}, None),
    "policy.tokenizer.chat_template": (None, "default"),
    "policy.dtensor_cfg.expert_parallel_size": (1,),
    "policy.generation.stop_token_ids": (None, []), "policy.generation.stop_strings": (None, []),
    "policy.generation.vllm_cfg.pipeline_parallel_size": (1,),
    "policy.generation.vllm_cfg.expert_parallel_size": (1,),
    "policy.generation.vllm_cfg.kv_cache_dtype": ("auto",),
    "grpo.async_grpo.recompute_kv_cache_after_weight_updates": (False, None),  # the KV cache in flight stays as it is
    "grpo.async_grpo": (None,),  # null: NeMo-RL's single-controller path (async_rl.*) decides instead
    "data.use_multiple_dataloader": (False,),
    "data.default.env_name": ("math", "reward_model", "math_multi_reward", None),
    "data.train.env_name": ("math", "reward_model", "math_multi_reward", None),
    "data.validation.env_name": ("math", "reward_model", "math_multi_reward", None),
    # vlm_hf_data_processor: the processor's chat template and images, what posttrain does with a VLM's processor
    "data.default.processor": ("math_hf_data_processor", "math_data_processor", "vlm_hf_data_processor", None),
    "data.train.processor": ("math_hf_data_processor", "math_data_processor", "vlm_hf_data_processor", None),
    "data.validation.processor": ("math_hf_data_processor", "math_data_processor", "vlm_hf_data_processor", None),
    "reward_penalties.*": (False, None),
    "on_policy_distillation": (None,),
}

# loss_fn's importance-sampling correction (pi_old / pi_rollout): read together by
# dialects/nemo_rl/rollout_correction.py's from_nemo_rl (its arguments are these names after `loss_fn.`, with
# loss_fn.sequence_level_importance_ratios), written as algorithm.rollout_correction.* (verl's names)
IS_CORRECTION = ("loss_fn.use_importance_sampling_correction", "loss_fn.truncated_importance_sampling_type",
                 "loss_fn.truncated_importance_sampling_ratio", "loss_fn.truncated_importance_sampling_ratio_min")

# mappings read as one value (not leaf by leaf): handed on as they are, or refused as a whole by OFF
WHOLE = ("policy.generation.vllm_kwargs", "policy.hf_config_overrides", "on_policy_distillation",
         "policy.tokenizer.chat_template_kwargs")

# sections a file switches off with `enabled: false`: then nothing below them matters; on, refused (the why)
SWITCHED = {
    "policy.megatron_cfg": "posttrain trains with FSDP2, not Megatron; set policy.megatron_cfg.enabled=false "
                           "policy.dtensor_cfg.enabled=true (FSDP2 shards every weight over all workers: Megatron's "
                           "tensor/pipeline sizes have no counterpart)",
    "policy.draft": "draft-model training is not supported; set policy.draft.enabled=false",
    "policy.router_replay": "MoE router replay is not supported; set policy.router_replay.enabled=false",
}

# engine, launcher and monitoring knobs: no effect on what is trained (the guide lists them)
TUNING = (
    "policy.generation.port_range_*", "policy.generation.refit_*", "policy.generation.real_quant_export_cpu_offload",
    "policy.generation.mcore_generation_config.*",
    "policy.generation.vllm_cfg.use_tqdm", "policy.generation.vllm_cfg.enable_vllm_metrics_logger",
    "policy.generation.vllm_cfg.vllm_metrics_logger_interval", "policy.generation.vllm_cfg.http_refit_*",
    "policy.generation.vllm_cfg.zmq_refit_*", "policy.generation.vllm_cfg.reset_encoder_cache_after_weight_update",
    "policy.generation.vllm_cfg.use_deep_gemm", "policy.generation.vllm_cfg.num_last_layers_in_bf16",
    "policy.generation.vllm_cfg.num_first_layers_in_bf16", "policy.generation.vllm_cfg.logprobs_mode",
    "policy.generation.vllm_cfg.precision", "policy.generation.vllm_cfg.skip_tokenizer_init",
    "policy.generation.vllm_cfg.load_format", "policy.generation.vllm_cfg.distributed_executor_backend", "policy.generation_batch_size", "policy.logprob_chunk_size",
    "policy.offload_optimizer_for_logprob", "policy.make_sequence_length_divisible_by",
    "policy.tokenizer.use_fastokens", "policy.dtensor_cfg._v2", "policy.dtensor_cfg.automodel_kwargs.*",
    "policy.dtensor_cfg.clear_cache_every_n_steps", "policy.dtensor_cfg.env_vars.*",
    "policy.dtensor_cfg.lora_cfg.use_triton", "policy.dtensor_cfg.lora_cfg.dropout_position",
    "policy.dtensor_cfg.lora_cfg.lora_A_init",
    "policy.sequence_packing.algorithm", "policy.sequence_packing.microbatch_order",
    "policy.sequence_packing.sequence_length_round", "policy.dynamic_batching.sequence_length_round",
    "policy.optimizer.kwargs.foreach", "policy.optimizer.kwargs.fused",
    "cluster.master_port_range_*", "cluster.segment_size", "grpo.calculate_advantages_on_gpu",
    "logger.monitor_gpus", "logger.gpu_monitoring.*", "logger.wandb.log_nemo_gym_full_result_tables",
    "logger.swanlab.*", "logger.tensorboard.*", "logger.mlflow.*", "logger.wandb.*",
    "data.num_workers", "env.math.math_verify_impl", "checkpointing.save_consolidated",
    "checkpointing.model_save_format", "policy.generation.vllm_cfg.async_engine",
    "data_plane.*",  # how batches move between NeMo-RL's workers (TransferQueue): posttrain moves its own
    "policy.generation.vllm_cfg.enable_prefix_caching", "policy.generation.vllm_cfg.env_vars.*",
    "grpo.skip_reference_policy_logprobs_calculation",  # posttrain runs the reference only when a KL term needs it
    "grpo.batch_multiplier",  # prompts per round of dynamic sampling: posttrain draws rounds until the batch fills
    # a VLM file's: images shared between a group's rows in NeMo-RL's Ray payloads (posttrain keeps a row's images
    # once, undecoded, and a group's prompt is prefilled once), and its payload telemetry
    "grpo.deduplicate_multimodal_data", "grpo.debug_payload_metrics",
)

# NeMo-RL's VLM environment (a section env.<name> with reward_functions; examples/run_vlm_grpo.py registers every
# environment as it): its keys, and the reward functions it knows (rewards.vlm.FUNCTIONS has the same names)
VLM_ENV_KEYS = ("num_workers", "reward_functions", "stop_strings")
# a named dataset's NeMo-RL split names (data.validation.split) that are posttrain's test split of it
# (data/named.py); any other named dataset: test or validation
VALIDATION_SPLITS = {"clevr-cogent": ("valA", "test"), "geometry3k": ("test",), "refcoco": ("validation", "test")}

# checkpointing.metric_name -> posttrain's metric of the same meaning
METRICS = {"val:accuracy": "val/score/mean", "val:avg_length": "val/response_length/mean",
           "train:reward": "critic/score/mean", "train:loss": "actor/pg_loss", "train:grad_norm": "actor/grad_norm",
           "train:kl_penalty": "actor/kl_loss", "train:mean_gen_tokens_per_sample": "response_length/mean"}
BACKENDS = {"vllm": "vllm", "hf": "hf"}
KL_TYPES = {"k1": "k1", "k2": "k2", "k3": "k3"}
KL_IN_REWARD = {"k1": "kl", "k2": "mse", "k3": "low_var_kl"}
