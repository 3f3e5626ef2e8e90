"""Build a run's components from a resolved config: `build_run` (posttrain train), and what every run starts
with (`start_run`, `checkpoint_writer`; build_sft.py builds posttrain sft's).

With build_data.py (the prompts) and placement.py (devices, Ray, workers, profiler), the only place that reads
the config object to construct things; the components themselves take plain arguments (settings.py turns the
config into the settings they take; checkpoint/run_dir.py keeps the run directory).
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from posttrain.algorithms import make_kl_controller
from posttrain.algorithms.distill import TOPK_MODES
from posttrain.driver.ahead import RolloutsAhead
from posttrain.driver.build_data import data_files, load_datasets, model_dir_of, tokenizer_of
from posttrain.checkpoint import CheckpointWriter, find_checkpoint, static_model_files
from posttrain.checkpoint.run_dir import check_start, open_run_dir, resume, resumed_model_dirs
from posttrain.config import config_to_dict, config_to_yaml
from posttrain.config.schema_distill import teacher_entries
from posttrain.data.dataset import PromptSampler
from posttrain.data.prompts import read_templates
from posttrain.errors import ConfigError
from posttrain.envs import EnvPool, InProcessEnvs
from posttrain.envs.interactions import interaction_class, read_interaction_config
from posttrain.driver.env_side import EnvSide
from posttrain.driver.sampling import load_tool_use
from posttrain.driver.placement import (
    connect_cluster, flop_model, make_actor, make_profiler, measured_peaks, peak_flops_of, uses_ray, worker_device,
)
from posttrain.driver.run import Run
from posttrain.runtime.debugging import announce
from posttrain.files.cache import cache_root
from posttrain.models import load_tokenizer
from posttrain.models.processor import is_vision_dir, load_processor
from posttrain.models.loader import eos_token_ids
from posttrain.text.redact import redact_mapping
from posttrain.rewards.model import ModelRewards, RewardModel
from posttrain.rewards.pool import RewardPool, in_process, reward_loader
from posttrain.rewards.sandbox import SandboxSettings
from posttrain.rollout.multiturn import MultiTurnSettings
from posttrain.metrics.sinks import check_sinks
from posttrain.driver.settings import lora_settings, rollout_correction, sampling_params, worker_spec
from posttrain.tools import ToolSet
from posttrain.tools.functions import canonical_spec, import_function


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def make_env(cfg, model_dir: str, tokenizer) -> tuple[EnvSide | None, MultiTurnSettings | None]:
    """rollout.multi_turn.environment, interaction_config_path or agent: -> (the other side of the
    conversations, the multi-turn rollout's settings), or (None, None). The class, function or interaction config
    (and its classes) is imported here first, so that a mistake stops the run before the model loads."""
    mt = cfg.rollout.multi_turn
    if not mt.enable or not (mt.environment or mt.interaction_config_path or mt.agent):
        return None, None
    settings = MultiTurnSettings(max_assistant_turns=mt.max_assistant_turns or 5,
                                 max_tool_response_length=mt.max_tool_response_length,
                                 max_response_length=cfg.data.max_response_length,
                                 max_prompt_length=cfg.data.max_prompt_length, max_user_turns=mt.max_user_turns,
                                 template_kwargs=dict(cfg.data.apply_chat_template_kwargs),
                                 eos_token_ids=tuple(driver_eos_ids(model_dir, tokenizer)))
    if mt.agent:
        agent = import_function(canonical_spec(mt.agent), "rollout.multi_turn.agent")
        return EnvSide(agent=agent, reward_from=mt.reward_from or "env", agent_workers=mt.agent_workers,
                       agent_timeout_s=mt.agent_timeout_s, model_name=Path(model_dir).name or "policy"), settings
    if mt.environment:
        spec = canonical_spec(mt.environment)
        import_function(spec, "rollout.multi_turn.environment", want_class=True)
        factory, reward_from = ("class", spec, dict(mt.environment_kwargs)), mt.reward_from or "env"
    else:
        entries = read_interaction_config(mt.interaction_config_path)
        for e in entries:
            interaction_class(e["class_name"])
        factory, reward_from = ("interactions", entries), mt.reward_from or "rule"
    pool = (InProcessEnvs(factory) if cfg.trainer.debug else
            EnvPool(factory, mt.environment_workers, mt.environment_timeout_s, mt.environment_memory_mb))
    return EnvSide(pool, reward_from), settings


def make_tools(cfg, model_dir: str, tokenizer) -> tuple[ToolSet | None, MultiTurnSettings | None]:
    """rollout.multi_turn.*: -> (the tools, the multi-turn rollout's settings: generation.load_tool_use),
    or (None, None)."""
    mt = cfg.rollout.multi_turn
    if not mt.enable or not (mt.tool_config_path or mt.tools):
        return None, None
    return load_tool_use(mt.tool_config_path, mt.tools, cfg.reward.timeout_s, in_process=cfg.trainer.debug,
                         max_assistant_turns=mt.max_assistant_turns or 5,
                         max_tool_response_length=mt.max_tool_response_length,
                         max_response_length=cfg.data.max_response_length,
                         eos_token_ids=driver_eos_ids(model_dir, tokenizer),
                         template_kwargs=cfg.data.apply_chat_template_kwargs)


def driver_eos_ids(model_dir: str, tokenizer) -> list[int]:
    """The tokens that end a response (models.loader.eos_token_ids), without loading the model: its
    generation_config.json, if any, and the tokenizer's EOS."""
    try:
        from transformers import GenerationConfig

        gen = GenerationConfig.from_pretrained(model_dir)
    except (OSError, ValueError):
        gen = None
    return eos_token_ids(tokenizer, SimpleNamespace(generation_config=gen))


def check_teacher(cfg, tokenizer) -> None:
    """On-policy distillation: a teacher scores the student's token ids, so it needs the same vocabulary."""
    for name, _, teacher in teacher_entries(cfg.distillation):
        path = str(teacher["model_path"])
        theirs = load_tokenizer(path, trust_remote_code=cfg.model.trust_remote_code)
        if theirs.get_vocab() != tokenizer.get_vocab():
            raise ConfigError(f"distillation.teacher_models.{name}.model_path={path}: its tokenizer's vocabulary "
                              "differs from the student's; the teacher scores the student's token ids, so it needs "
                              "the same tokenizer (a teacher of the same model family)")
    loss = cfg.distillation.distillation_loss
    if loss.loss_mode in TOPK_MODES and loss.topk > len(tokenizer):
        raise ConfigError(f"distillation.distillation_loss.topk={loss.topk} is more than the vocabulary's "
                          f"{len(tokenizer)} tokens; set it at most that")


def make_rewards(cfg) -> RewardPool | ModelRewards:
    """The run's rewards: rule functions in a RewardPool, or a reward model (reward.model.enable) on this
    process's GPU if it has one, with the pool only when a custom function combines the two."""
    r = cfg.reward
    sandbox = None
    if r.sandbox_fusion.url:  # code sources (apps, taco, ...) run in a SandboxFusion service: rewards.sandbox
        sf = r.sandbox_fusion
        sandbox = SandboxSettings(sf.url, sf.max_concurrent, sf.memory_limit_mb)
    if not r.model.enable:
        return make_reward_pool(r.custom_fn, r.num_workers, r.timeout_s, sandbox, cfg.trainer.debug, r.data_source,
                                r.functions)
    device = "cuda" if torch.cuda.is_available() and cfg.trainer.device != "cpu" else "cpu"
    model = RewardModel(r.model.path, device=device, micro_batch_size=r.model.micro_batch_size,
                        max_length=r.model.max_length, trust_remote_code=r.model.trust_remote_code,
                        remove_padding=r.model.use_remove_padding, param_offload=r.model.param_offload)
    return ModelRewards(model, make_reward_pool(r.custom_fn, r.num_workers, r.timeout_s, sandbox, cfg.trainer.debug,
                                                r.data_source) if r.custom_fn else None)


def make_reward_pool(custom_fn: str | None, num_workers: int | None, timeout_s: float,
                     sandbox: SandboxSettings | None = None, debug: bool = False, data_source: str | None = None,
                     functions: dict | None = None):
    """The run's RewardPool (reward.custom_fn or the built-ins; num_workers None:
    min(8, CPUs)). The function is loaded here once, so a file that fails to
    import stops the run now with its RewardError; the workers load their own.
    sandbox (rewards.sandbox.SandboxSettings): where code sources run, its
    max_concurrent shared by the workers. debug (trainer.debug): rewards.pool.in_process.
    data_source (reward.data_source): every row scored as this source. functions (reward.functions): every row
    scored by that weighted sum of rewards.vlm's functions."""
    if debug:
        return in_process(reward_loader(custom_fn, sandbox, functions)(), data_source)
    if num_workers is None:
        num_workers = min(8, os.cpu_count() or 1)
    sandbox = sandbox.per_process(num_workers) if sandbox else None
    pool = RewardPool(reward_loader(custom_fn, sandbox, functions), num_workers, timeout_s, data_source=data_source)
    pool.load()
    return pool


def training_steps(tr, steps_per_epoch: int) -> int:
    """The run's RL steps: trainer.total_training_steps when set (verl: it
    overrides total_epochs), else total_epochs x steps_per_epoch; with
    trainer.max_epochs, at most max_epochs x steps_per_epoch (NeMo-RL's
    min(max_num_steps, max_num_epochs x batches per epoch)).

    Example: 10 steps an epoch, total_training_steps 25: 25 steps; with
    max_epochs 2: 20."""
    total = tr.total_training_steps or steps_per_epoch * tr.total_epochs
    if tr.max_epochs is not None:
        total = min(total, steps_per_epoch * tr.max_epochs)
    return total


def start_run(cfg) -> tuple[Path, object, Path | None, str, bool]:
    """What every run (posttrain train's and sft's) begins with, before anything is loaded or written: the
    loggers importable, the seed, the run directory (staged here for a remote one), the checkpoint to resume
    from, the model, and whether they agree. -> (run_dir, remote, resume_from, model_dir, distributed)"""
    tr = cfg.trainer
    check_sinks(tr.logger)  # a missing logger package stops the run before anything is loaded or written
    if tr.debug:
        announce(tr.nnodes * tr.n_gpus_per_node, bool(tr.use_ray or tr.ray_address or os.environ.get("RAY_ADDRESS")))
    seed_everything(tr.seed)
    distributed = uses_ray(cfg)
    run_dir, remote = open_run_dir(tr.run_dir, tr.project_name, tr.experiment_name, tr.nnodes,
                                   cache_root() / "staging")
    resume_from = find_checkpoint(run_dir, tr.resume_mode, tr.resume_from_path)
    model_dir = model_dir_of(cfg)
    check_start(run_dir, resume_from, tr.resume_mode, config_to_dict(cfg), model_dir, distributed)
    return run_dir, remote, resume_from, model_dir, distributed


def checkpoint_writer(cfg, run_dir: Path, remote, model_dir: str, tokenizer) -> tuple[CheckpointWriter, str]:
    """The run's CheckpointWriter and its config.yaml text. config.yaml (in the run directory and every
    checkpoint) is read by people, reports and other runs: no credential in it; a resume compares it with
    redaction in mind (checkpoint.check_compatible)."""
    tr = cfg.trainer
    config_yaml = config_to_yaml(redact_mapping(config_to_dict(cfg)))
    writer = CheckpointWriter(
        run_dir, static_model_files(model_dir, tokenizer, cfg.model.tokenizer_path is not None), config_yaml, async_save=tr.async_save,
        max_to_keep=tr.max_ckpt_to_keep, keep_top_k=tr.keep_top_k, metric=tr.keep_top_k_metric,
        mode=tr.keep_top_k_mode, remote=remote)
    return writer, config_yaml


def build_run(cfg) -> Run:
    """Everything `posttrain.driver.loop.train` needs, checked before anything is
    written; resumes from a checkpoint when trainer.resume_mode finds one."""
    tr = cfg.trainer
    run_dir, remote, resume_from, model_dir, distributed = start_run(cfg)
    rewards = make_rewards(cfg)
    train_files, val_files = data_files(cfg)  # data.dataset_name / val_dataset_name resolved here, once
    templates = read_templates(cfg.data.prompt_file, cfg.data.system_prompt_file)
    processor = (load_processor(model_dir, trust_remote_code=cfg.model.trust_remote_code)
                 if is_vision_dir(model_dir) else None)  # a vision-language model: prompts with images
    if processor is not None and cfg.rollout.name == "vllm":
        from posttrain.rollout.vllm_vision import vllm_vision_family

        refused = vllm_vision_family(model_dir)
        if refused:
            raise ConfigError(f"model.path '{model_dir}': {refused}")
    if processor is not None and cfg.model.tokenizer_path is not None:
        raise ConfigError(f"model.tokenizer_path={cfg.model.tokenizer_path} with a vision-language model: its "
                          "processor holds the tokenizer; put the tokenizer's files in its directory and set it null")
    tokenizer = processor.tokenizer if processor is not None else tokenizer_of(cfg, model_dir)
    if cfg.distillation.enabled:
        check_teacher(cfg, tokenizer)
    tools, multi_turn = make_tools(cfg, model_dir, tokenizer)
    env, env_turns = make_env(cfg, model_dir, tokenizer)
    train_data, val_data = load_datasets(cfg, train_files, val_files, tokenizer, templates, tools, processor=processor)
    sampler = PromptSampler(len(train_data), cfg.data.train_batch_size, seed=cfg.data.seed, shuffle=cfg.data.shuffle)
    total_steps = training_steps(tr, sampler.steps_per_epoch)
    kc = cfg.algorithm.kl_ctrl
    kl_ctrl = (make_kl_controller(kc.type, kc.kl_coef, kc.target_kl, kc.horizon) if cfg.algorithm.use_kl_in_reward
               else None)
    train_sampling, val_sampling = sampling_params(cfg)
    if distributed:
        connect_cluster(cfg)
    device = worker_device(tr.device, distributed)
    policy_dir, critic_dir = resumed_model_dirs(resume_from)
    actor, workers = make_actor(cfg, worker_spec(cfg, model_dir, policy_dir, device, total_steps, critic_dir), run_dir)
    flops = flop_model(model_dir, frozen_base=lora_settings(cfg) is not None)
    peak = peak_flops_of(tr.peak_flops, workers)
    writer, config_yaml = checkpoint_writer(cfg, run_dir, remote, model_dir, tokenizer)
    run = Run(
        cfg=cfg, run_dir=run_dir, actor=actor, tokenizer=tokenizer, kl_ctrl=kl_ctrl, rewards=rewards,
        train_data=train_data, val_data=val_data, sampler=sampler, sampling=train_sampling,
        val_sampling=val_sampling, total_steps=total_steps, writer=writer, model_dir=model_dir,
        resumed_from=resume_from, flops=flops, peak_flops=peak, peak_keys=measured_peaks(tr.peak_flops, workers),
        profiler=make_profiler(cfg, run_dir, device, distributed), tools=tools, multi_turn=multi_turn or env_turns,
        env=env, correction=rollout_correction(cfg), processor=processor,
    )
    if cfg.async_training.enable:  # started by train(), after any resume and the first validation
        a = cfg.async_training
        run.ahead = RolloutsAhead(run.rollouts, run.draw, total_steps, a.max_trajectory_age_steps,
                                 in_flight=a.in_flight_weight_updates, start_step=run.global_step,
                                 stream=a.stream_samples, seed=tr.seed)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(config_yaml)
    if resume_from is not None:
        resume(run, resume_from)  # last: nothing after this draws random numbers
    return run
