"""The rollout's settings checked: the engine and its sampling, the engine's own weights (rollout.dtype,
rollout.stale_updates), multi-turn tools, and algorithm.rollout_correction (driver/settings.py builds its settings)."""

from __future__ import annotations

import warnings

from posttrain.config.checks import choice, in_range, need, positive, positive_or_null, whole
from posttrain.config.schema import DTYPE_SPELLINGS, Config, uses_lora
from posttrain.config.schema_rollout import VLLM_SETTINGS, RolloutConfig
from posttrain.config.dialects.verl.rollout_correction import from_config
from posttrain.errors import ConfigError
from posttrain.text.lines import printable


def validate_rollout(cfg: Config) -> None:
    r = cfg.rollout
    positive(cfg, "rollout.n", "rollout.log_prob_micro_batch_size", "rollout.val_kwargs.n",
              "rollout.tensor_model_parallel_size")
    positive_or_null(cfg, "rollout.micro_batch_size")
    in_range(cfg, ">= 0", "rollout.temperature")
    in_range(cfg, "in (0, 1]", "rollout.top_p", "rollout.gpu_memory_utilization")
    need(r.name not in ("sglang", "trtllm"), f"rollout.name={r.name}: posttrain has no {r.name} engine; use "
          "rollout.name=vllm (GPUs) or hf")
    choice("rollout.name", r.name, ("hf", "vllm"))
    if r.lora_sync is not None:
        choice("rollout.lora_sync", r.lora_sync, ("adapter", "merged"))
    choice("rollout.mode", r.mode, ("sync", "async"))
    need(isinstance(r.engine_kwargs, dict) and all(isinstance(v, dict) for v in r.engine_kwargs.values()),
          "rollout.engine_kwargs maps an engine's name to its arguments (rollout.engine_kwargs.vllm.swap_space=4)")
    need(r.static_decoding in (None, True, False),
         f"rollout.static_decoding must be true, false or null (on with CUDA), got {printable(r.static_decoding)}")
    need(r.stop_check_every is None or whole(r.stop_check_every, 1),
         "rollout.stop_check_every must be an integer >= 1 (tokens decoded between two checks for ended sequences) "
         f"or null (1 on the CPU, 8 on a GPU), got {printable(r.stop_check_every)}")
    for key in ("max_num_batched_tokens", "max_num_seqs", "max_model_len"):
        need(getattr(r, key) is None or getattr(r, key) > 0, f"rollout.{key} must be > 0, got {getattr(r, key)}")
    validate_rollout_lag(cfg)
    validate_async(cfg)
    validate_multi_turn(cfg)
    unused = unused_engine_settings(r)
    if unused:
        warnings.warn(f"{', '.join(unused)}: set, but unused by rollout.name={r.name}", stacklevel=3)


def validate_rollout_lag(cfg: Config) -> None:
    """rollout.dtype (verl's spellings normalised in place) and rollout.stale_updates: the engine's own weights.
    With LoRA they give the engine a plain model holding the adapters merged in, which rollout.lora_sync=adapter
    would contradict."""
    r = cfg.rollout
    dtype = DTYPE_SPELLINGS.get(r.dtype, r.dtype)
    need(dtype in (None, "float32", "bfloat16", "float16"),
          f"rollout.dtype={printable(r.dtype)} is not a dtype the rollout engine takes: set bfloat16, float16 or "
          "float32 (bf16, fp16, fp32), or leave it null for the policy's compute dtype")
    r.dtype = dtype
    k = r.stale_updates
    need(whole(k),
          "rollout.stale_updates must be an integer >= 0 (the engine samples with the policy's weights of that many "
          f"updates ago; 0: the current ones), got {printable(k)}")
    own_model = [key for key, on in (("rollout.stale_updates", k > 0), ("rollout.dtype", dtype and r.name == "hf"),
                                     ("async_training.enable", cfg.async_training.enable)) if on]
    need(not (uses_lora(cfg) and r.lora_sync == "adapter" and own_model),
          f"rollout.lora_sync=adapter with {' and '.join(own_model)}: the engine then samples from a model of its own, "
          "which holds the LoRA adapters merged in; set rollout.lora_sync=merged or leave it null")


def validate_async(cfg: Config) -> None:
    """async_training.*: R rollout workers beside the trainer (one process or an FSDP2 worker group), k updates
    ahead at most; a dead rollout worker replaced up to max_rollout_failures times over the run."""
    a, key = cfg.async_training, "async_training"
    k = a.max_trajectory_age_steps
    need(whole(k),
         f"{key}.max_trajectory_age_steps must be an integer >= 0 (a batch trains weights at most that many updates "
         f"newer than those that sampled it; 0: synchronous), got {printable(k)}")
    need(a.rollout_threads is None or whole(a.rollout_threads, 1),
         f"{key}.rollout_threads must be an integer >= 1 or null (half the cores), got {printable(a.rollout_threads)}")
    for name in ("rollout_nnodes", "rollout_n_gpus_per_node"):
        need(whole(getattr(a, name), 1), f"{key}.{name} must be an integer >= 1 (the rollout workers' own devices), "
             f"got {printable(getattr(a, name))}")
    need(whole(a.max_rollout_failures),
         f"{key}.max_rollout_failures must be an integer >= 0 (dead rollout workers replaced over the run; 0: the "
         f"first failure stops it), got {printable(a.max_rollout_failures)}")
    need(whole(a.stream_piece_size),
         f"{key}.stream_piece_size must be an integer >= 0 (prompts per streamed piece; 0: the batch's over 4 x the "
         f"rollout workers), got {printable(a.stream_piece_size)}")
    if not a.enable:
        return
    devices, tp = a.rollout_nnodes * a.rollout_n_gpus_per_node, cfg.rollout.tensor_model_parallel_size
    need(devices % tp == 0,
         f"{key}.rollout_nnodes x {key}.rollout_n_gpus_per_node = {devices} devices is not a multiple of "
         f"rollout.tensor_model_parallel_size={tp} (each rollout worker's engine spans {tp}); give the rollout a "
         f"multiple of {tp} devices, or a tensor-parallel size that divides {devices}")
    need(not (a.in_flight_weight_updates and cfg.rollout.name not in ("hf", "vllm")),
         f"{key}.in_flight_weight_updates=true needs rollout.name=hf or vllm (hf takes new weights between two "
         f"tokens, vLLM aborts its requests and resumes them under them); with rollout.name={cfg.rollout.name} set "
         "it to false: the weights then change between batches")
    need(cfg.rollout.stale_updates == 0,
         f"rollout.stale_updates={cfg.rollout.stale_updates} with {key}.enable=true: asynchronous training's "
         f"staleness is its own ({key}.max_trajectory_age_steps); set rollout.stale_updates=0")
    rc = cfg.algorithm.rollout_correction
    if k > 0 and rc.rollout_is is None and rc.rollout_rs is None and not rc.bypass_mode:
        warnings.warn(f"{key}.max_trajectory_age_steps={k} without algorithm.rollout_correction: every batch is "
                      f"sampled by weights {k} update{'s' if k > 1 else ''} old, and uncorrected stale rollouts learn "
                      "less or collapse (docs/rollout-correction.md); set "
                      "algorithm.rollout_correction.rollout_is=token", stacklevel=3)


def unused_engine_settings(r: RolloutConfig) -> list[str]:
    """The rollout settings given that the chosen engine does not use (one warning line names them)."""
    out = [f"rollout.engine_kwargs.{name}" for name, kw in r.engine_kwargs.items() if kw and name != r.name]
    if r.name != "vllm":  # vLLM's engine settings
        out += [f"rollout.{k}" for k in VLLM_SETTINGS if getattr(r, k) is not None and k != "enforce_eager"]
        out += ["rollout.free_cache_engine=false"] if not r.free_cache_engine else []
    else:  # the hf engine's
        out += [f"rollout.{k}" for k in ("stop_check_every", "static_decoding") if getattr(r, k) is not None]
    if r.mode == "async":  # verl's server mode: posttrain's rollout generates a step's batch in one call either way
        out.append("rollout.mode=async")
    return out


def validate_multi_turn(cfg: Config) -> None:
    """rollout.multi_turn.*: hermes tool calls and tools, or an environment / verl's simulated user."""
    mt = cfg.rollout.multi_turn
    if not mt.enable:
        return
    key = "rollout.multi_turn"
    choice(f"{key}.format", mt.format, ("hermes",))
    tools, env = bool(mt.tool_config_path or mt.tools), bool(mt.environment or mt.interaction_config_path or mt.agent)
    need(tools or env, f"{key}.enable=true needs the other side of the conversation: tools "
          f"({key}.tool_config_path=TOOLS.yaml in verl's format, or {key}.tools=[pkg.mod:fn]), an environment "
          f"({key}.environment=pkg.mod:Class), verl's simulated user ({key}.interaction_config_path=FILE.yaml) or an "
          f"agent program ({key}.agent=pkg.mod:function)")
    need(not (tools and env), f"{key}: tools and an environment / interaction / agent together are not supported "
          "yet; give the environment or agent the tools' work (an agent passes its tools to the endpoint itself), "
          "or use one of them")
    given = [k for k in ("environment", "interaction_config_path", "agent") if getattr(mt, k)]
    need(len(given) <= 1, f"{key}.{' and '.join(given)} both set; use one of them")
    need(whole(mt.agent_workers, 1), f"{key}.agent_workers must be an integer >= 1, got {printable(mt.agent_workers)}")
    in_range(cfg, "> 0", f"{key}.agent_timeout_s")
    need(mt.max_user_turns is None or (whole(mt.max_user_turns, 1)),
          f"{key}.max_user_turns must be an integer >= 1 or null, got {printable(mt.max_user_turns)}")
    need(mt.max_user_turns is None or (env and not mt.agent), f"{key}.max_user_turns limits an environment's or "
          "simulated user's turns; there is none (tools answer every call; an agent runs its own loop)")
    if mt.reward_from is not None:
        choice(f"{key}.reward_from", mt.reward_from, ("env", "rule", "sum"))
        need(env, f"{key}.reward_from={mt.reward_from} is where an environment's conversations get their score; "
             "there is no environment")
    need(whole(mt.environment_workers, 1), f"{key}.environment_workers must be an integer >= 1, got "
          f"{printable(mt.environment_workers)}")
    in_range(cfg, "> 0", f"{key}.environment_timeout_s")
    need(whole(mt.environment_memory_mb), f"{key}.environment_memory_mb must be an integer >= 0 (0: no limit), "
          f"got {printable(mt.environment_memory_mb)}")
    in_range(cfg, ">= 1 or null (5)", f"{key}.max_assistant_turns")
    in_range(cfg, ">= 1", f"{key}.max_tool_response_length")


def validate_rollout_correction(cfg: Config) -> None:
    rc, key = cfg.algorithm.rollout_correction, "algorithm.rollout_correction"
    choice(f"{key}.loss_type", rc.loss_type, ("ppo_clip", "reinforce"))
    try:  # the settings driver/settings.py's rollout_correction builds: a RolloutCorrection, or None when off
        on = from_config(rc) is not None or rc.bypass_mode
    except ValueError as e:
        raise ConfigError(str(e)) from None
    reinforce = rc.loss_type == "reinforce" or rc.use_policy_gradient  # as driver/settings.py's reinforce
    need(not reinforce or rc.bypass_mode,
          f"{key}.loss_type=reinforce is bypass mode's loss (pi_theta / pi_rollout weighs -A log pi): set "
          f"{key}.bypass_mode=true, or keep ppo_clip (decoupled mode's PPO loss takes the IS weights)")
    need(not (reinforce and cfg.actor.policy_loss.loss_mode != "vanilla"),
          f"{key}.loss_type=reinforce replaces the policy loss: it cannot be combined with "
          f"actor.policy_loss.loss_mode={cfg.actor.policy_loss.loss_mode}")
    need(not on or cfg.rollout.calculate_log_probs is not False,
          f"{key} weighs tokens by the engine's own log-probs: rollout.calculate_log_probs=false turns them off; "
          "leave it null (on with a correction) or true")
