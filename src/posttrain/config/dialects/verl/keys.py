"""verl's config keys, as tutorials pass them, mapped onto posttrain's keys; and verl's keys that posttrain's schema
does not hold, which the dialect reads itself before the merge (READ: resolve.py). describe() gives the lines of
`posttrain train --help-config` on them."""

from __future__ import annotations

# verl's keys that posttrain takes and does not use, by posttrain's former spelling of each (an older run's
# config.yaml holds them; verl's spellings map onto them as onto posttrain's keys) -> (type, default): taken out of
# the layers before the merge; one set to anything but its default is named in one warning line as unused
UNUSED = {
    # verl's input for its async rollout server; posttrain tokenizes the chat itself
    "data.return_raw_chat": ("bool", False),
    # verl's choice of its own worker classes: posttrain has one kind
    "trainer.use_legacy_worker_impl": ("str", "auto"),
    "reward.model.use_reward_loop": ("bool", False),  # verl's choice of its reward workers
    "reward.model.rollout": ("Dict[str, Any]", {}),  # verl's vLLM server for the reward model
    "model.use_shm": ("bool", False),  # verl copies the model to /dev/shm first: posttrain reads it where it is
    "rollout.layered_summon": ("bool", False),  # verl's layer-by-layer LoRA weight sync: posttrain syncs its own way
    "rollout.trace": ("Dict[str, Any]", {}),  # verl's rollout tracing (backend, token2text)
    "ref.entropy_from_logits_with_chunking": ("bool", False),  # verl's: the reference pass computes no entropy
    "actor.use_orig_params": ("bool", False),  # FSDP1's flag: FSDP2 always keeps the original parameters
    "data.gen_batch_size": ("Optional[int]", None),  # verl's prompts per generation request (fully async: 1)
    # verl's: validation on the trainer's devices (posttrain's always are)
    "async_training.use_trainer_do_validate": ("bool", False),
    "async_training.checkpoint_engine": ("Dict[str, Any]", {}),  # verl's bucketed NCCL weight sync
    # verl's switch for handing a prompt's image tensors to the model: posttrain always hands them (data/images.py)
    "data.return_multi_modal_inputs": ("bool", True),
    # verl's patch size for its Qwen-VL image preprocessing: posttrain uses the processor's own settings
    "data.image_patch_size": ("int", 14),
}
# what --help-config says of the UNUSED keys above that are not simply "unused"
UNUSED_STATUS = {
    "data.return_multi_modal_inputs": "true: posttrain always passes the images' tensors; false named unused",
    "data.image_patch_size": "the processor's own patch size is used; another value named unused",
}

# verl's deprecated global micro-batch sizes -> posttrain's former keys of a size over all workers (each
# Optional[int], null by default); before the merge, global_sizes.py divides each into the per-worker key
# (GLOBAL_SIZES) as verl's workers divide theirs
GLOBAL = {
    "actor_rollout_ref.actor.ppo_micro_batch_size": "actor.ppo_micro_batch_size_global",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size": "rollout.log_prob_micro_batch_size_global",
    "actor_rollout_ref.ref.log_prob_micro_batch_size": "ref.log_prob_micro_batch_size_global",
    "critic.ppo_micro_batch_size": "critic.ppo_micro_batch_size_global",
    "critic.forward_micro_batch_size": "critic.forward_micro_batch_size_global",
    "reward_model.micro_batch_size": "reward.model.micro_batch_size_global",
}
# a global key -> (the per-worker key it becomes, whether verl divides it by the workers over the Ulysses size;
# its reward model's by the workers alone)
GLOBAL_SIZES = {
    "actor.ppo_micro_batch_size_global": ("actor.ppo_micro_batch_size", True),
    "rollout.log_prob_micro_batch_size_global": ("rollout.log_prob_micro_batch_size", True),
    "ref.log_prob_micro_batch_size_global": ("ref.log_prob_micro_batch_size", True),
    "critic.ppo_micro_batch_size_global": ("critic.ppo_micro_batch_size_per_gpu", True),
    "critic.forward_micro_batch_size_global": ("critic.forward_micro_batch_size_per_gpu", True),
    "reward.model.micro_batch_size_global": ("reward.model.micro_batch_size", False),
}

# verl's fully asynchronous trainer (verl.experimental.fully_async_policy), translated by fully_async.py when one
# is set: k = ceil(staleness_threshold); a step's batch = actor.ppo_mini_batch_size x require_batches x
# trigger_parameter_sync_step prompts (one weight version: verl's local updates between two syncs); partial_rollout:
# in-flight updates (hf or vllm); use_rollout_log_probs / compute_prox_log_prob: bypass or decoupled rollout
# correction; total_rollout_prompts (verl's rollout.total_rollout_steps): the run's prompts
FULLY_ASYNC = {
    "async_training.staleness_threshold": ("Optional[float]", None),
    "async_training.trigger_parameter_sync_step": ("Optional[int]", None),
    "async_training.require_batches": ("Optional[int]", None),
    "async_training.partial_rollout": ("Optional[bool]", None),
    "async_training.use_rollout_log_probs": ("Optional[bool]", None),
    "async_training.compute_prox_log_prob": ("Optional[bool]", None),
    "async_training.total_rollout_prompts": ("Optional[int]", None),
}

# verl's keys that posttrain takes at one value only (another is refused) or names unused when set, by posttrain's
# former spelling of each -> (type, default, the posttrain key `--help-config` lists it after, where it was listed
# while it was one): fixed.py checks them before the merge, in the words validation used
ONLY_OFF, ONLY_ACTORS = "only this value; others refused", "only the actor's value"
FIXED = {
    # verl's own dataset class (its RLHFDataset API): refused, posttrain reads the parquet rows itself
    "data.custom_cls.path": ("Optional[str]", None, "data.video_key", "only null; a dataset class is refused"),
    "data.custom_cls.name": ("Optional[str]", None, "data.custom_cls.path", "with path only"),
    # verl's torch | triton fused kernels: posttrain's chunked pass (model.use_fused_kernels) is torch either way
    "model.fused_kernel_options.impl_backend": ("Optional[str]", None, "model.use_fused_kernels",
                                                "triton: named unused (the fused pass is torch code)"),
    "actor.strategy": ("str", "fsdp2", "actor.reuse_on_policy_log_probs", None),  # fsdp | fsdp2: FSDP2 either way
    # -1: shard over every worker (verl's fsdp_config.fsdp_size; hybrid sharding is refused)
    "actor.fsdp_size": ("int", -1, "actor.strategy", ONLY_OFF),
    # FSDP1's: FSDP2 keeps buffers as stored (another value is named unused)
    "actor.mixed_precision.buffer_dtype": ("str", "float32", "actor.mixed_precision.reduce_dtype", None),
    "ref.strategy": ("str", "fsdp2", "ref.log_prob_micro_batch_size", None),
    "ref.fsdp_size": ("int", -1, "ref.strategy", ONLY_OFF),
    # null: the actor's (posttrain's workers split sequences one way for all of their models)
    "ref.ulysses_sequence_parallel_size": ("Optional[int]", None, "ref.fsdp_size", ONLY_ACTORS),
    "critic.model.fsdp_size": ("int", -1, "critic.model.optimizer_offload", ONLY_OFF),
    "critic.ulysses_sequence_parallel_size": ("Optional[int]", None, "critic.model.fsdp_size", ONLY_ACTORS),
    # verl keeps the critic's apart; a posttrain checkpoint holds both, so it may only equal max_ckpt_to_keep
    "trainer.max_critic_ckpt_to_keep": ("Optional[int]", None, "trainer.max_ckpt_to_keep",
                                        "with a critic: only trainer.max_ckpt_to_keep's value"),
    # verl's reward managers (naive | prime | dapo | batch) and the reward model's own tokenizer for responses
    "reward.model.input_tokenizer": ("Optional[str]", None, "reward.model.param_offload",
                                     "the policy's tokenizer decodes responses either way"),
    "reward.reward_manager": ("str", "naive", "reward.model.input_tokenizer",
                              "posttrain scores in worker processes whichever"),
}

# the keys the dialect reads itself, listed in their own block of `posttrain train --help-config` -> (type, default)
OWN = {**UNUSED, **{key: ("Optional[int]", None) for key in GLOBAL_SIZES}, **FULLY_ASYNC}
# every key the dialect reads itself -> (type, default), and what happens to each (`posttrain train --help-config`)
READ = {**OWN, **{key: (typ, default) for key, (typ, default, _, _) in FIXED.items()}}
STATUS = {**{key: UNUSED_STATUS.get(key, "verl only: unused") for key in UNUSED},
          **{key: f"verl's global size: {ours} = it // (trainer.nnodes x trainer.n_gpus_per_node"
                  f"{' / the Ulysses size' if ulysses else ''})" for key, (ours, ulysses) in GLOBAL_SIZES.items()},
          **{key: "verl's fully asynchronous trainer: translated (docs/async.md)" for key in FULLY_ASYNC},
          **{key: status for key, (_, _, _, status) in FIXED.items() if status}}

# Exact renames (checked first).
EXACT = {
    **GLOBAL,
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": "actor.ppo_micro_batch_size",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": "rollout.log_prob_micro_batch_size",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": "ref.log_prob_micro_batch_size",
    "trainer.default_local_dir": "trainer.run_dir",
    "trainer.max_actor_ckpt_to_keep": "trainer.max_ckpt_to_keep",
    "actor_rollout_ref.nccl_timeout": "trainer.collective_timeout_s",  # seconds a collective may take
    "data.trust_remote_code": "model.trust_remote_code",  # verl's, for the tokenizer and processor
    "reward_model.micro_batch_size_per_gpu": "reward.model.micro_batch_size",
    "reward_model.num_workers": "reward.num_workers",  # verl's reward loop workers: our reward processes
    "reward_model.reward_manager": "reward.reward_manager",
    "rollout.nnodes": "async_training.rollout_nnodes",  # verl's one-step off-policy: the rollout's own devices
    "rollout.n_gpus_per_node": "async_training.rollout_n_gpus_per_node",
    # verl's fully asynchronous trainer's rollouter: its run length in prompts, its epochs and validation period
    "rollout.total_rollout_steps": "async_training.total_rollout_prompts",
    "rollout.total_epochs": "trainer.total_epochs",
    "rollout.test_freq": "trainer.test_freq",
    "global_profiler.tool": "profiler.tool",
    "global_profiler.steps": "profiler.steps",
    "global_profiler.save_path": "profiler.save_path",
    "global_profiler.discrete": "profiler.discrete",
    "global_profiler.profile_continuous_steps": "profiler.continuous_steps",
    "global_profiler.global_tool_config.nsys.discrete": "profiler.discrete",
    "reward_model.reward_kwargs.max_resp_len": "reward.overlong_buffer.max_resp_len",  # verl's DAPO reward manager
    "algorithm.gdpo_reward_keys": "algorithm.gdpo.reward_keys",  # verl's GDPO (its whitening: docs/algorithms.md)
    "algorithm.gdpo_reward_weights": "algorithm.gdpo.reward_weights",
    "actor_rollout_ref.actor.fsdp_config.model_dtype": "model.dtype",  # the dtype the policy's weights are kept in
    # verl's deprecated spelling of lr_scheduler_type (constant | cosine), which verl copies onto it
    "actor_rollout_ref.actor.optim.warmup_style": "actor.lr_scheduler_type",
    "critic.optim.warmup_style": "critic.lr_scheduler_type",
    # verl's nested LoRA spelling (its Megatron configs)
    "actor_rollout_ref.model.lora.rank": "model.lora_rank",
    "actor_rollout_ref.model.lora.alpha": "model.lora_alpha",
    "actor_rollout_ref.model.lora.dropout": "model.lora_dropout",
    "actor_rollout_ref.model.lora.target_modules": "model.target_modules",
    "actor_rollout_ref.model.lora.exclude_modules": "model.exclude_modules",
}

# Prefix renames: a verl key maps when the renamed key is one of ours.
PREFIXES = (
    ("actor_rollout_ref.actor.profiler.", "profiler.actor."),  # before the generic actor_rollout_ref.* ones
    ("actor_rollout_ref.ref.profiler.", "profiler.ref."),
    ("actor_rollout_ref.rollout.profiler.", "profiler.rollout."),
    ("critic.profiler.", "profiler.critic."),
    ("global_profiler.global_tool_config.torch_memory.", "profiler.torch_memory."),
    ("global_profiler.global_tool_config.", "profiler.global_tool_config."),  # the rest: named unused
    ("actor_rollout_ref.actor.optim.", "actor."),
    ("actor_rollout_ref.actor.fsdp_config.", "actor."),
    ("actor_rollout_ref.ref.fsdp_config.", "ref."),
    ("actor_rollout_ref.actor.", "actor."),
    ("actor_rollout_ref.rollout.", "rollout."),
    ("actor_rollout_ref.model.", "model."),
    ("actor_rollout_ref.ref.", "ref."),
    ("critic.optim.", "critic."),
    ("critic.model.fsdp_config.", "critic.model."),
    ("reward_model.overlong_buffer.", "reward.overlong_buffer."),  # verl's DAPO recipe
    ("reward_model.reward_kwargs.overlong_buffer_cfg.", "reward.overlong_buffer."),  # ... and its newer spelling
    ("reward_model.model.fsdp_config.", "reward.model."),
    ("reward_model.model.", "reward.model."),
    ("reward_model.sandbox_fusion.", "reward.sandbox_fusion."),  # before the catch-all below
    ("reward_model.", "reward.model."),  # enable, use_reward_loop, rollout.*
)

# verl's one-step off-policy recipe: rollout and trainer on resources of their own, the rollout one update ahead
# (posttrain's asynchronous training with k = 1, unless the run sets k itself)
HYBRID_ENGINE = "actor_rollout_ref.hybrid_engine"
SEPARATE_ROLLOUT = {"async_training.enable": True}  # k: async_training.max_trajectory_age_steps's default, 1

# vLLM's former engine argument in verl's VLM scripts -> its current one (translate.py: true -> 0, false dropped)
OLD_MM_CACHE = "rollout.engine_kwargs.vllm.disable_mm_preprocessor_cache"
MM_CACHE = "rollout.engine_kwargs.vllm.mm_processor_cache_gb"

# verl's custom reward is two keys; posttrain's is one: reward.custom_fn=FILE.py:FUNCTION.
CUSTOM_REWARD_PATH = "custom_reward_function.path"
CUSTOM_REWARD_NAME = "custom_reward_function.name"

# Key prefixes that only verl uses: an unknown key under them is "not supported yet".
VERL_PREFIXES = ("actor_rollout_ref.", "critic.", "reward_model.", "custom_reward_function.", "ray_init.",
                 "global_profiler.")


def spellings() -> list[str]:
    """verl's keys and key prefixes, and the keys the dialect reads itself (for config/flat.py's flatten: an empty
    `actor_rollout_ref:` or `data.custom_cls:` is a section)."""
    return [*EXACT, *READ, *(verl for verl, _ in PREFIXES)]


def listed(keys) -> list[str]:
    """posttrain's `keys` in order, with FIXED's keys where `--help-config` lists them (each after its key)."""
    out: list[str] = []

    def add(key: str) -> None:
        out.append(key)
        for fixed, (_, _, after, _) in FIXED.items():
            if after == key:
                add(fixed)
    for key in keys:
        add(key)
    return out


def to_canonical(key: str, canonical_keys) -> str | None:
    """The posttrain key (or the key of READ) for `key`, or None when there is none."""
    if key in canonical_keys or key in READ:
        return key
    if key in EXACT:
        return EXACT[key]
    for verl, ours in PREFIXES:
        if key.startswith(verl) and (ours + key[len(verl):] in canonical_keys or ours + key[len(verl):] in READ):
            return ours + key[len(verl):]
    return None


def alias_table(canonical_keys) -> dict[str, str]:
    """Every verl spelling we accept -> our key, or the key of READ (for help and suggestions)."""
    table = dict(EXACT)
    for verl, ours in PREFIXES:
        for key in [*canonical_keys, *READ]:
            if key.startswith(ours):
                table.setdefault(verl + key[len(ours):], key)
    table[CUSTOM_REWARD_PATH] = "reward.custom_fn"
    table[CUSTOM_REWARD_NAME] = "reward.custom_fn"
    return table


def describe(canonical_keys, status: dict[str, str]) -> list[str]:
    """`posttrain train --help-config`'s lines on verl's keys: each spelling -> posttrain's key, with what happens
    to it (`status`: posttrain's for its keys, else STATUS; neither: honoured), and the keys READ names."""
    lines = ["verl keys accepted (verl key -> posttrain key [what happens to it]):"]
    lines += [f"  {verl} -> {ours}  [{status.get(ours) or STATUS.get(ours, 'honoured')}]"
              for verl, ours in sorted(alias_table(canonical_keys).items())]
    lines.append("  actor_rollout_ref.rollout.engine_kwargs.vllm.* -> rollout.engine_kwargs.vllm.*  "
                 f"[{status['rollout.engine_kwargs']}]")
    lines.append(f"  actor_rollout_ref.{OLD_MM_CACHE} -> {MM_CACHE}  [true: 0 (no "
                 "cache of the image processor's outputs; vLLM's spelling since the old one went, as verl converts "
                 "it); false: dropped, vLLM's default cache]")
    lines.append("  global_profiler.global_tool_config.* (the rest) -> profiler.global_tool_config.*  "
                 f"[{status['profiler.global_tool_config']}]")
    lines += ["", "verl keys that are not posttrain's, read by its dialect before the merge (an older posttrain's "
                  "config.yaml holds them too; type = default [what happens to it]):"]
    lines += [f"  {key}: {typ} = {default!r}  [{STATUS[key]}]" for key, (typ, default) in OWN.items()]
    return [*lines, "", "Any other verl key is refused with a line naming it (`not supported yet`)."]
