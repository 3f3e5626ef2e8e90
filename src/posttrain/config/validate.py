"""A loaded Config's ranges, choices and cross-field rules, one function per
section; the first broken rule is a ConfigError of one line that says the fix.

    validate(cfg)   # in place: nulls that mean "as the actor's" are filled in, verl's dtype spellings normalised

Keys set but unused (verl's inputs, LoRA's keys without LoRA, another
engine's settings) are named in one warning line each, not refused; verl's
keys that posttrain's schema does not hold come named by its dialect (`unused`).
"""

from __future__ import annotations

import warnings
from typing import Sequence

from posttrain.algorithms import (
    ADV_ESTIMATORS, KL_KINDS, LOSS_AGG_MODES, NEEDS_CRITIC, PF_PPO_METHODS, POLICY_LOSSES, estimator,
)
from posttrain.config.keys import LORA_ONLY_KEYS, SFT_ONLY_KEYS
from posttrain.config.checks import (adamw, choice, dtype, fill, get, in_range, lr_schedule, need, positive,
                                     positive_or_null)
from posttrain.config.schema import (FILTER_METRICS, LOGGERS, SCHEMA, Config, DataConfig, ProfilerRoleConfig,
                                     data_parallel_groups, uses_lora)
from posttrain.config.validate_distill import validate_distillation
from posttrain.config.validate_rollout import validate_rollout, validate_rollout_correction
from posttrain.text.lines import printable, repr_cut


def validate(cfg: Config, unused: Sequence[str] = ()) -> None:
    """Ranges, choices and cross-field rules; fills derived values in place. The sections first, then the
    rules that join them (they divide by sizes the sections checked). `unused`: verl's keys its dialect dropped,
    set to anything but their default (named in warn_unused's line). posttrain sft's: validate_sft.py."""
    validate_data(cfg)
    validate_model(cfg)
    validate_rollout(cfg)
    validate_actor(cfg)
    validate_ref(cfg)
    validate_trainer(cfg)
    validate_sequence_parallel(cfg)
    validate_tensor_parallel(cfg)
    warn_unused(cfg, unused)
    validate_reward(cfg)
    validate_algorithm(cfg)
    validate_rollout_correction(cfg)
    validate_critic(cfg)
    validate_profiler(cfg)
    validate_distillation(cfg)
    validate_across_sections(cfg)


# ---------------------------------------------------------------- the sections

def validate_data(cfg: Config) -> None:
    d = cfg.data
    positive(cfg, "data.train_batch_size", "data.max_prompt_length", "data.max_response_length")
    positive_or_null(cfg, "data.val_batch_size", "data.val_max_samples")
    in_range(cfg, "in [0, 1) (the share of training prompts held out for validation)", "data.val_split_size")
    choice("data.truncation", d.truncation, ("error", "left", "right"))
    validate_dataset_names(d)
    taken = sorted({"conversation", "tokenize", "add_generation_prompt", "return_dict"} & set(d.apply_chat_template_kwargs))
    need(not taken, f"data.apply_chat_template_kwargs.{', '.join(taken)}: posttrain sets it (prompts are tokenized "
                     "for the assistant's turn); leave it out")
    fill(cfg, {"data.seed": "trainer.seed"})


def validate_dataset_names(d: DataConfig) -> None:
    """data.dataset_name / val_dataset_name: known, usable for their split, and not set beside the files they
    replace. Names only: whether the files are there is for build time (data.named.resolve)."""
    from posttrain.data import named

    for files, name, split in (("train_files", "dataset_name", "train"), ("val_files", "val_dataset_name", "test")):
        value = getattr(d, name)
        need(value is None or getattr(d, files) is None,
              f"data.{files} and data.{name}={printable(value)} are both set; keep one (files, or a known dataset name)")
        if value is not None:
            named.lookup(value, split)


def validate_model(cfg: Config) -> None:
    m = cfg.model
    dtype(cfg, "model.dtype")
    in_range(cfg, ">= 0 (0: train all weights)", "model.lora_rank")
    in_range(cfg, "in [0, 1)", "model.lora_dropout")
    need(not uses_lora(cfg) or m.lora_alpha > 0, f"model.lora_alpha must be > 0, got {m.lora_alpha}")


def validate_actor(cfg: Config) -> None:
    a = cfg.actor
    positive(cfg, "actor.ppo_mini_batch_size", "actor.ppo_micro_batch_size", "actor.ppo_epochs")
    adamw(cfg, "actor")
    in_range(cfg, "> 1, or null (no dual clip)", "actor.clip_ratio_c")
    lr_schedule(cfg, "actor")
    for key in ("actor.mixed_precision.param_dtype", "actor.mixed_precision.reduce_dtype"):
        dtype(cfg, key)
    choice("actor.loss_agg_mode", a.loss_agg_mode, LOSS_AGG_MODES)
    choice("actor.kl_loss_type", a.kl_loss_type, KL_KINDS)
    choice("actor.policy_loss.loss_mode", a.policy_loss.loss_mode, POLICY_LOSSES)
    in_range(cfg, "> 0 or null", "actor.loss_scale_factor")
    fill(cfg, {"actor.clip_ratio_low": "actor.clip_ratio", "actor.clip_ratio_high": "actor.clip_ratio"})
    need(0 <= a.clip_ratio_low < 1 and a.clip_ratio_high >= 0, "actor.clip_ratio_low must be in [0, 1) and "
          "actor.clip_ratio_high >= 0")


def validate_ref(cfg: Config) -> None:
    positive(cfg, "ref.log_prob_micro_batch_size")


def validate_tensor_parallel(cfg: Config) -> None:
    """actor.tensor_parallel_size: dividing the workers; what does not combine with it yet, named. The model's
    heads and sizes are checked when it loads (training.tensor_parallel.check_plan)."""
    size = cfg.actor.tensor_parallel_size
    in_range(cfg, ">= 1", "actor.tensor_parallel_size")
    if size == 1:
        for key in ("sequence_parallel", "tensor_parallel_plan"):
            if getattr(cfg.actor, key):
                warnings.warn(f"actor.{key}={getattr(cfg.actor, key)} has no effect without tensor parallelism "
                              "(actor.tensor_parallel_size=1)".replace("=True ", "=true "), stacklevel=3)
        return
    need(not (cfg.actor.sequence_parallel and cfg.actor.tensor_parallel_plan), "actor.sequence_parallel=true with "
         f"actor.tensor_parallel_plan={cfg.actor.tensor_parallel_plan}: the plan decides every layout; set "
         "sequence_parallel to false (put SequenceParallel styles in the plan for it)")
    world = cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node
    key = f"actor.tensor_parallel_size={size}"
    need(world % size == 0, f"{key} must divide the {world} workers (trainer.nnodes x trainer.n_gpus_per_node)")
    ulysses = cfg.actor.ulysses_sequence_parallel_size
    need(world % (size * ulysses) == 0, f"{key} x actor.ulysses_sequence_parallel_size={ulysses} must divide the "
         f"{world} workers (trainer.nnodes x trainer.n_gpus_per_node)")
    for on, what in ((ulysses > 1 and cfg.actor.sequence_parallel, "actor.sequence_parallel=true and actor."
                      "ulysses_sequence_parallel_size > 1 (both split the positions)"),
                     (uses_lora(cfg), "LoRA (model.lora_rank)")):
        need(not on, f"{key} with {what}: not supported together yet; set one of them off")


def validate_sequence_parallel(cfg: Config) -> None:
    """Ulysses: one size for a worker's models (verl's reference's and critic's sizes: its dialect's), dividing
    the workers; each group of that many workers takes the same rows."""
    size = cfg.actor.ulysses_sequence_parallel_size
    world = cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node
    in_range(cfg, ">= 1", "actor.ulysses_sequence_parallel_size")
    if size == 1:
        return
    need(world % size == 0, f"actor.ulysses_sequence_parallel_size={size} must divide the {world} workers "
          "(trainer.nnodes x trainer.n_gpus_per_node)")
    need(not cfg.model.use_fused_kernels, f"model.use_fused_kernels=true with actor.ulysses_sequence_parallel_size="
          f"{size}: the fused pass does not split sequences yet; turn one of them off")


def warn_unused(cfg: Config, unused: Sequence[str] = (), sft_keys_used: bool = False) -> None:
    """verl's switches for what posttrain does not do (`unused`: the ones its dialect dropped, set to anything but
    their default or set for nothing), and settings of a feature that is off (LoRA, multi-turn rollouts, posttrain
    sft's data keys in an RL run), set to anything but their default, are named in one warning line each."""
    sft_only = [k for k in SFT_ONLY_KEYS if get(cfg, k) != SCHEMA[k][1]] if not sft_keys_used else []
    if sft_only:
        warnings.warn(f"{', '.join(sft_only)}: settings of posttrain sft's data; set, but unused by posttrain train",
                      stacklevel=3)
    lora_only = [k for k in LORA_ONLY_KEYS if get(cfg, k) != SCHEMA[k][1]] if not uses_lora(cfg) else []
    if not cfg.rollout.multi_turn.enable:
        lora_only += [k for k in SCHEMA if k.startswith("rollout.multi_turn.") and get(cfg, k) != SCHEMA[k][1]]
    if lora_only:
        warnings.warn(f"{', '.join(lora_only)}: settings of LoRA (off: model.lora_rank=0) or multi-turn rollouts "
                      "(rollout.multi_turn.enable=false), which are off; set, but unused", stacklevel=3)
    if unused:
        warnings.warn(f"{', '.join(unused)}: verl's settings for what posttrain does its own way (its servers, "
                      "worker classes, kernels: `posttrain train --help-config` says each); set, but unused",
                      stacklevel=3)


def validate_reward(cfg: Config) -> None:
    rw, rm, sf = cfg.reward, cfg.reward.model, cfg.reward.sandbox_fusion
    in_range(cfg, "> 0", "reward.timeout_s")
    in_range(cfg, ">= 0 (0: score in the trainer process) or null (min(8, CPUs))", "reward.num_workers")
    need(not rm.enable or bool(rm.path), "reward.model.enable=true needs reward.model.path (verl's "
          "reward_model.model.path): a Hugging Face sequence-classification model directory")
    in_range(cfg, "> 0", "reward.model.micro_batch_size")
    need(not sf.url or (sf.url.startswith(("http://", "https://")) and sf.url.isprintable() and " " not in sf.url),
          f"reward.sandbox_fusion.url must be an http:// or https:// URL (a SandboxFusion /run_code endpoint), "
          f"got {printable(sf.url)}")
    in_range(cfg, "> 0", "reward.sandbox_fusion.max_concurrent", "reward.sandbox_fusion.memory_limit_mb")
    if rw.data_source is not None and not rw.custom_fn:  # a custom function reads the name as it likes
        from posttrain.rewards import reward_fn_for

        try:
            reward_fn_for(rw.data_source)
        except ValueError as e:
            need(False, f"reward.data_source={printable(rw.data_source)}: {e}")
    if rw.functions:  # NeMo-RL's env.<name>.reward_functions: the weighted sum scores every row
        from posttrain.rewards.vlm import combine, specs

        need(isinstance(rw.functions, dict), "reward.functions maps a reward function's name to its weight "
             "(reward.functions.format=0.2 reward.functions.exact_alnum=0.8)")
        try:
            combine(specs(rw.functions))
        except ValueError as e:
            need(False, f"reward.functions: {e}")
        for key, other in (("reward.custom_fn", rw.custom_fn), ("reward.data_source", rw.data_source),
                           ("reward.model.enable", rm.enable)):
            need(not other, f"reward.functions and {key}={printable(other)}: one reward scores the rows; drop one "
                 "of them")
    validate_overlong(cfg)


def validate_overlong(cfg: Config) -> None:
    ob = cfg.reward.overlong_buffer
    fill(cfg, {"reward.overlong_buffer.max_resp_len": "data.max_response_length"})
    in_range(cfg, "> 0", "reward.overlong_buffer.max_resp_len")
    max_len = ob.max_resp_len
    if ob.len is None:
        ob.len = max(1, max_len // 5)
    if ob.enable:
        need(0 < ob.len <= max_len, f"reward.overlong_buffer.len={ob.len} must be in 1..reward.overlong_buffer."
              f"max_resp_len={max_len} (the penalty grows over the last len tokens before it)")
        in_range(cfg, ">= 0", "reward.overlong_buffer.penalty_factor")
    sc = cfg.reward.scaling
    if sc.enable:
        need(sc.source_max > sc.source_min, f"reward.scaling.source_max={sc.source_max} must be above "
                                            f"reward.scaling.source_min={sc.source_min}")
    scale = cfg.reward.truncated_scale
    if scale is not None:
        need(0 <= scale <= 1, f"reward.truncated_scale must be in 0..1 (a truncated response's score times it), "
                              f"got {scale}")
        need(not ob.enable, "reward.truncated_scale and reward.overlong_buffer.enable=true both shape the scores of "
                            "long responses: pick one (NeMo-RL's stop_properly_penalty_coef turns the overlong "
                            "buffer off)")


def validate_algorithm(cfg: Config) -> None:
    alg, r = cfg.algorithm, cfg.rollout
    choice("algorithm.kl_penalty", alg.kl_penalty, KL_KINDS)
    choice("algorithm.kl_ctrl.type", alg.kl_ctrl.type, ("fixed", "adaptive"))
    need(alg.adv_estimator in ADV_ESTIMATORS, f"algorithm.adv_estimator={printable(alg.adv_estimator)} is not "
          f"supported; supported: {', '.join(ADV_ESTIMATORS)}")
    if alg.kl_ctrl.type == "adaptive":
        need(alg.kl_ctrl.target_kl > 0 and alg.kl_ctrl.horizon > 0,
              "the adaptive KL controller needs algorithm.kl_ctrl.target_kl > 0 and algorithm.kl_ctrl.horizon > 0")
    choice("algorithm.filter_groups.metric", alg.filter_groups.metric, FILTER_METRICS)
    need(alg.gamma >= 0 and 0 <= alg.lam <= 1, f"algorithm.gamma must be >= 0 and algorithm.lam in [0, 1], got "
          f"{alg.gamma} and {alg.lam}")
    est = estimator(alg.adv_estimator)  # a known name: checked above
    need(r.n >= est.min_samples, f"algorithm.adv_estimator={alg.adv_estimator} {est.compares}: it needs "
          f"rollout.n >= {est.min_samples}{f' ({est.too_few})' if est.too_few else ''}, got {r.n}")
    g = alg.gdpo
    need(g.reward_weights is None or not g.reward_keys or len(g.reward_weights) == len(g.reward_keys),
          f"algorithm.gdpo.reward_weights has {len(g.reward_weights or [])} weights for the "
          f"{len(g.reward_keys)} algorithm.gdpo.reward_keys: give one per key, in the same order")
    need(not (alg.overlong_filtering and r.ignore_eos),
          "algorithm.overlong_filtering=true with rollout.ignore_eos=true: every response runs to "
          "data.max_response_length without ending, so every one would be filtered out of the loss; turn one off")
    if alg.use_pf_ppo:
        choice("algorithm.pf_ppo.reweight_method", alg.pf_ppo.reweight_method, PF_PPO_METHODS)
        need(alg.adv_estimator in NEEDS_CRITIC, f"algorithm.use_pf_ppo=true resamples the batch after GAE (as verl): "
              f"it needs algorithm.adv_estimator=gae, got {alg.adv_estimator}")


def validate_trainer(cfg: Config) -> None:
    tr, critic = cfg.trainer, cfg.algorithm.adv_estimator in NEEDS_CRITIC
    positive(cfg, "trainer.n_gpus_per_node", "trainer.nnodes", "trainer.total_epochs", "trainer.cpus_per_worker")
    positive_or_null(cfg, "trainer.total_training_steps")
    in_range(cfg, ">= 1 or null (no cap on passes over the data)", "trainer.max_epochs")
    in_range(cfg, "> 0", "trainer.collective_timeout_s")
    choice("trainer.device", tr.device, ("auto", "cpu", "cuda"))
    choice("trainer.keep_top_k_mode", tr.keep_top_k_mode, ("max", "min"))
    need(tr.resume_mode != "resume_path" or bool(tr.resume_from_path),
          "trainer.resume_mode=resume_path needs trainer.resume_from_path=<a global_step_N directory>")
    for key in ("trainer.max_ckpt_to_keep", "trainer.keep_top_k"):
        need(get(cfg, key) is None or get(cfg, key) > 0, f"{key} must be a positive integer or null")
    in_range(cfg, ">= 0", "trainer.critic_warmup")
    need(tr.critic_warmup == 0 or critic,
          f"trainer.critic_warmup={tr.critic_warmup} needs a critic: set algorithm.adv_estimator=gae "
          "(or algorithm.name=ppo), or trainer.critic_warmup=0")
    for sink in tr.logger:
        need(sink in LOGGERS, f"trainer.logger {sink!r} is not one of: {', '.join(LOGGERS)} (metrics.jsonl is always "
                               "written in the run directory)")
    need(tr.peak_flops is None or tr.peak_flops > 0, f"trainer.peak_flops must be > 0 FLOP/s, got {tr.peak_flops}")
    need(tr.log_samples_prompts >= 0 and tr.log_val_generations >= 0,
          "trainer.log_samples_prompts and trainer.log_val_generations must be >= 0")


def validate_critic(cfg: Config) -> None:
    """Fill the critic's null sizes from the actor's and check them (only
    when a critic is used: algorithm.adv_estimator=gae)."""
    c = cfg.critic
    lr_schedule(cfg, "critic")
    fill(cfg, {"critic.ppo_mini_batch_size": "actor.ppo_mini_batch_size",
               "critic.ppo_micro_batch_size_per_gpu": "actor.ppo_micro_batch_size",
               "critic.ppo_epochs": "actor.ppo_epochs", "critic.loss_agg_mode": "actor.loss_agg_mode",
               "critic.forward_micro_batch_size_per_gpu": "rollout.log_prob_micro_batch_size",
               "critic.use_dynamic_bsz": "actor.use_dynamic_bsz",
               "critic.forward_max_token_len_per_gpu": "critic.ppo_max_token_len_per_gpu"})
    in_range(cfg, "a positive number of tokens", "critic.forward_max_token_len_per_gpu")
    if cfg.algorithm.adv_estimator not in NEEDS_CRITIC:
        return
    positive(cfg, "critic.ppo_mini_batch_size", "critic.ppo_micro_batch_size_per_gpu", "critic.ppo_epochs",
              "critic.forward_micro_batch_size_per_gpu")
    adamw(cfg, "critic")
    in_range(cfg, "> 0", "critic.cliprange_value")
    in_range(cfg, "> 0 (the value loss times it)", "critic.loss_coef")
    choice("critic.loss_agg_mode", c.loss_agg_mode, LOSS_AGG_MODES)
    n, d = cfg.rollout.n, cfg.data
    need(d.train_batch_size % c.ppo_mini_batch_size == 0,
          f"data.train_batch_size={d.train_batch_size} must be divisible by critic.ppo_mini_batch_size="
          f"{c.ppo_mini_batch_size}")
    world = data_parallel_groups(cfg)
    need((c.ppo_mini_batch_size * n) % world == 0,
          f"critic.ppo_mini_batch_size x rollout.n = {c.ppo_mini_batch_size * n} sequences must be divisible by the "
          f"{world} workers")


def validate_profiler(cfg: Config) -> None:
    """profiler.*: checked; the roles' nulls filled (rollout's from the actor's, as verl's colocated worker;
    the others': off, rank 0); what posttrain does not use named in one warning line."""
    from posttrain.runtime.profiling import CONTENTS, ROLE_PHASES, TOOLS, tool_settings

    p, tm = cfg.profiler, cfg.profiler.torch_memory
    need(p.tool is None or p.tool in TOOLS,
          f"profiler.tool={printable(p.tool)} (verl's global_profiler.tool) is not one of: {', '.join(TOOLS)}")
    need(all(s > 0 for s in p.steps or ()), f"profiler.steps must list RL steps counted from 1, got {p.steps}")
    need(tm.trace_alloc_max_entries > 0, "profiler.torch_memory.trace_alloc_max_entries must be > 0")
    choice("profiler.torch_memory.context", tm.context, (None, "alloc", "state", "all"))
    choice("profiler.torch_memory.stacks", tm.stacks, ("python", "all"))
    for name in ROLE_PHASES:  # the actor's first
        role, base = getattr(p, name), p.actor if name == "rollout" else ProfilerRoleConfig(False, False, [])
        role.enable = base.enable if role.enable is None else role.enable
        role.all_ranks = base.all_ranks if role.all_ranks is None else role.all_ranks
        role.ranks = list(base.ranks) if role.ranks is None else role.ranks
        need(all(r >= 0 for r in role.ranks), f"profiler.{name}.ranks must be ranks >= 0, got {role.ranks}")
    for key in [f"profiler.{name}.tool_config" for name in ROLE_PHASES] + ["profiler.global_tool_config"]:
        need(all(isinstance(v, dict) for v in get(cfg, key).values()),
              f"{key} maps a tool's name to its settings ({key}.nsys.discrete=true)")
    read, unused = tool_settings(p.tool, {name: getattr(p, name).tool_config for name in ROLE_PHASES})
    for name, settings in read.items():
        contents = settings.get("contents") or []
        discrete = settings.get("discrete", False)
        need(isinstance(discrete, bool),
              f"profiler.{name}.tool_config.{p.tool}.discrete must be true or false, got {repr_cut(discrete)}")
        need(isinstance(contents, list) and all(c in CONTENTS for c in contents),
              f"profiler.{name}.tool_config.{p.tool}.contents={repr_cut(contents)} must list some of: "
              f"{', '.join(CONTENTS)}")
    unused += [f"profiler.global_tool_config.{t}.{k}" for t, kw in p.global_tool_config.items()
               for k, v in kw.items() if v not in (None, {})]
    unused += ["profiler.torch_memory.stack_depth"] * (tm.stack_depth != SCHEMA["profiler.torch_memory.stack_depth"][1])
    unused += ["profiler.steps (profiler.tool is null)"] * (p.tool is None and bool(p.steps))
    npu = ("profiler.tool=npu: posttrain runs on CUDA or the CPU, not Ascend NPUs; traced with torch's profiler "
           "instead (torch_npu's profiler is its API), chrome traces in profiler.save_path") if p.tool == "npu" else ""
    if npu or unused:
        warnings.warn("; ".join(filter(None, [npu, unused and f"{', '.join(unused)}: set, but unused"])),
                      stacklevel=3)


# ---------------------------------------------------------------- rules that join sections

def validate_across_sections(cfg: Config) -> None:
    """Mini-batches count prompts, micro-batches sequences (as in verl); every worker takes an equal share."""
    a, d, r, tr = cfg.actor, cfg.data, cfg.rollout, cfg.trainer
    need(a.ppo_mini_batch_size <= d.train_batch_size,
          f"actor.ppo_mini_batch_size={a.ppo_mini_batch_size} is larger than data.train_batch_size={d.train_batch_size}")
    need(d.train_batch_size % a.ppo_mini_batch_size == 0,
          f"data.train_batch_size={d.train_batch_size} must be divisible by actor.ppo_mini_batch_size="
          f"{a.ppo_mini_batch_size}")
    need(a.use_dynamic_bsz or (a.ppo_mini_batch_size * r.n) % a.ppo_micro_batch_size == 0,
          f"actor.ppo_mini_batch_size x rollout.n = {a.ppo_mini_batch_size * r.n} sequences must be divisible by "
          f"actor.ppo_micro_batch_size={a.ppo_micro_batch_size}")
    validate_token_budgets(cfg)
    world = data_parallel_groups(cfg)
    need((a.ppo_mini_batch_size * r.n) % world == 0,
          f"actor.ppo_mini_batch_size x rollout.n = {a.ppo_mini_batch_size * r.n} sequences must be divisible by the "
          f"{world} workers (trainer.nnodes x trainer.n_gpus_per_node"
          f"{' / actor.ulysses_sequence_parallel_size' if world != tr.nnodes * tr.n_gpus_per_node else ''}): each "
          "takes an equal share of every mini-batch")
    if a.use_kl_loss and cfg.algorithm.use_kl_in_reward:
        warnings.warn("both actor.use_kl_loss and algorithm.use_kl_in_reward are on: KL is penalised twice",
                      stacklevel=3)


def validate_token_budgets(cfg: Config) -> None:
    """Fill the log-prob passes' null dynamic-batch settings from the actor's
    (as verl does) and check every budget."""
    for sec in ("rollout", "ref"):
        fill(cfg, {f"{sec}.log_prob_use_dynamic_bsz": "actor.use_dynamic_bsz",
                   f"{sec}.log_prob_max_token_len_per_gpu": "actor.ppo_max_token_len_per_gpu"})
    in_range(cfg, "a positive number of tokens", "actor.ppo_max_token_len_per_gpu",
             "rollout.log_prob_max_token_len_per_gpu", "ref.log_prob_max_token_len_per_gpu",
             "critic.ppo_max_token_len_per_gpu")
