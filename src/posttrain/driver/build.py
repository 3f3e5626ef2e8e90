"""Build a run's components from a resolved config.

The only place that reads the config object to construct things; the
components themselves take plain arguments (specs.py turns the config into
the settings they take; checkpoint/run_dir.py keeps the run directory).
"""

from __future__ import annotations

import dataclasses
import os
import random
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from posttrain.algorithms import make_kl_controller
from posttrain.algorithms.distill import TOPK_MODES
from posttrain.driver.ahead import RolloutsAhead
from posttrain.checkpoint import CheckpointWriter, find_checkpoint, static_model_files
from posttrain.checkpoint.run_dir import check_start, open_run_dir, resume, resumed_model_dirs
from posttrain.config import config_to_dict, config_to_yaml
from posttrain.config.schema_distill import teacher_entries
from posttrain.data import named
from posttrain.data.dataset import PromptDataset, PromptSampler
from posttrain.data.preprocess import arith
from posttrain.data.prompts import read_templates
from posttrain.data.schema import read_rows
from posttrain.distributed.cluster import connect
from posttrain.distributed.group import WorkerGroup
from posttrain.errors import ConfigError, DataError
from posttrain.metrics.flops import ModelFlops
from posttrain.envs import EnvPool, InProcessEnvs
from posttrain.envs.interactions import interaction_class, read_interaction_config
from posttrain.driver.env_side import EnvSide
from posttrain.driver.rollouts import load_tool_use
from posttrain.driver.loop import Run
from posttrain.runtime.debugging import announce
from posttrain.files.cache import cache_root
from posttrain.models import load_tokenizer
from posttrain.models.loader import eos_token_ids
from posttrain.runtime.profiling import ROLE_PHASES, StepProfiler, rank_selected, tool_settings, warn
from posttrain.text.redact import redact_mapping, redact_url
from posttrain.rewards.model import ModelRewards, RewardModel
from posttrain.rewards.pool import RewardPool, in_process, reward_loader
from posttrain.rewards.sandbox import SandboxSettings
from posttrain.rollout.multiturn import MultiTurnSettings
from posttrain.rollout.vllm import check_vllm_available
from posttrain.metrics.sinks import check_sinks
from posttrain.driver.settings import lora_settings, rollout_correction, sampling_params, worker_spec
from posttrain.tiny.arith import ensure_tiny_model
from posttrain.tools import ToolSet
from posttrain.tools.functions import canonical_spec, import_function
from posttrain.worker.verbs import Worker
from posttrain.worker.spec import WorkerSpec

EMBEDDED_DATA_VERSION = "arith-v1"


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("trainer.device=cuda but no CUDA device is visible; use trainer.device=cpu or auto")
    return torch.device(name)


def embedded_data_files() -> tuple[str, str]:
    """The arith task's train/test parquet, generated once into the cache."""
    out = cache_root() / "data" / EMBEDDED_DATA_VERSION
    train, test = out / "train.parquet", out / "test.parquet"
    if not (train.exists() and test.exists()):
        arith.run(out, seed=0)
    return str(train), str(test)


def model_dir_of(cfg) -> str:
    return cfg.model.path or str(ensure_tiny_model())


def data_files(cfg) -> tuple[list[str], list[str] | None]:
    """The run's train and validation files, resolved once: data.train_files, else data.dataset_name's file
    (data.named.resolve), else the embedded arith task; data.val_files, else data.val_dataset_name's file, else
    the default of the training data (the embedded task's test split; a named set's own test split or its
    paired set, when prepared: named.default_validation), else none."""
    d = cfg.data
    train, val, default_val = d.train_files, d.val_files, None
    if train is None and d.dataset_name is not None:
        train = [str(named.resolve(d.dataset_name, "train"))]
        if val is None and d.val_dataset_name is None and not d.val_split_size:  # else: held out of train
            found = named.default_validation(d.dataset_name)
            default_val = str(found) if found is not None else None
    elif train is None:
        train_file, default_val = embedded_data_files()
        train = [train_file]
    if val is None and d.val_dataset_name is not None:
        val = [str(named.resolve(d.val_dataset_name, "test"))]
    elif val is None and default_val is not None:
        val = [default_val]
    return train, val


def load_data(files, tokenizer, cfg, name: str, max_samples: int | None = None, templates=None,
              tool_schemas: list | None = None):
    """files' rows as a PromptDataset; `templates`: data.prompts.PromptTemplates (None: read the config's
    data.prompt_file / system_prompt_file, if any); `tool_schemas`: the tools the chat template tells the
    model about (multi-turn rollouts)."""
    if templates is None:
        templates = read_templates(cfg.data.prompt_file, cfg.data.system_prompt_file)
    rows = read_rows(files, prompt_key=cfg.data.prompt_key)
    if max_samples is not None:
        rows = rows[:max_samples]
    refuse_images(rows, cfg.data.image_key, name)
    return PromptDataset.build(
        rows, tokenizer, cfg.data.max_prompt_length, prompt_key=cfg.data.prompt_key,
        filter_overlong=cfg.data.filter_overlong_prompts, truncation=cfg.data.truncation, name=name,
        template_kwargs=template_kwargs(cfg, tool_schemas), templates=templates,
    )


def template_kwargs(cfg, tool_schemas: list | None) -> dict:
    """The chat template's extra arguments: data.apply_chat_template_kwargs, and the tools (`tools=`, which
    templates with tool support render into the system prompt) when there are tools."""
    kwargs = dict(cfg.data.apply_chat_template_kwargs)
    if tool_schemas:
        kwargs["tools"] = tool_schemas
    return kwargs


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


def hold_out(train, val, share: float, seed: int | None, max_samples: int | None = None):
    """data.val_split_size (NeMo-RL's split_validation_size): with no validation set, a seeded random
    `share` of the training prompts (at least one) becomes the validation set and leaves training.
    -> (train, val); with a validation set given, both unchanged (and one line says so)."""
    if val is not None:
        print(f"posttrain: data.val_split_size={share} unused: a validation set is given", file=sys.stderr)
        return train, val
    count = max(1, round(share * len(train)))
    if count >= len(train):
        raise ConfigError(f"data.val_split_size={share} holds out all {len(train)} training prompts; make it smaller")
    order = list(range(len(train)))
    random.Random(seed).shuffle(order)
    held, kept = sorted(order[:count]), sorted(order[count:])
    if isinstance(train, list):  # posttrain sft's examples
        return [train[i] for i in kept], [train[i] for i in held][:max_samples]
    val_items = [train.items[i] for i in held][:max_samples]
    return (PromptDataset([train.items[i] for i in kept], train.num_dropped, train.num_invalid),
            PromptDataset(val_items))


def refuse_images(rows, image_key: str, name: str) -> None:
    """A row that carries images (verl's data.image_key column) needs a vision model's processor: not yet."""
    for i, row in enumerate(rows):
        if row.get(image_key) not in (None, [], ""):
            raise DataError(f"{name} row {i} has images in its '{image_key}' column (data.image_key): vision inputs "
                            "are not supported yet; train on text-only rows")


def uses_ray(cfg) -> bool:
    """Workers on Ray when asked, when there is more than one, or when a
    cluster address is given (a job's driver: its devices are on the workers)."""
    tr = cfg.trainer
    if tr.debug:  # everything in this process (debugging.py)
        return False
    if tr.use_ray is not None:
        return tr.use_ray
    return tr.nnodes * tr.n_gpus_per_node > 1 or bool(tr.ray_address or os.environ.get("RAY_ADDRESS"))


def connect_cluster(cfg) -> None:
    tr = cfg.trainer
    world = tr.nnodes * tr.n_gpus_per_node
    where = connect(tr.ray_address, num_cpus=max(world * tr.cpus_per_worker, os.cpu_count() or 1))
    print(f"posttrain: {world} worker{'s' if world > 1 else ''} on {redact_url(where)}", file=sys.stderr)


def check_offload(spec: WorkerSpec, sharded: bool) -> None:
    """Parameter offload is FSDP2's: on a GPU it needs sharded workers (on the CPU there is nothing to move)."""
    asked = [k for k, on in (("actor.param_offload", spec.param_offload), ("ref.param_offload", spec.ref.param_offload),
                             ("critic.model.param_offload", spec.critic is not None and spec.critic.param_offload))
             if on]
    if asked and spec.device == "cuda" and not sharded:
        raise ConfigError(f"{', '.join(asked)} (verl's fsdp_config.param_offload) keeps FSDP2's sharded parameters "
                          "in CPU memory, but this run is one process, unsharded: run FSDP2 workers "
                          "(trainer.use_ray=true, or trainer.n_gpus_per_node > 1) or set it to false")


def make_actor(cfg, spec: WorkerSpec, run_dir: Path) -> tuple[Worker | WorkerGroup, list[dict]]:
    """One `Worker` in this process, or a `WorkerGroup` of Ray actors. -> (it, where each worker runs)."""
    tr = cfg.trainer
    check_offload(spec, sharded=uses_ray(cfg))
    if spec.rollout.name == "vllm":
        check_vllm_available(spec.device, spec.rollout.engine_kwargs)
        if spec.device == "cpu" and spec.rollout.free_cache_engine:
            print("posttrain: vLLM's CPU build has no sleep mode: its engine keeps its weights and KV cache between "
                  "generations (rollout.free_cache_engine has no effect on the CPU)", file=sys.stderr)
    if not uses_ray(cfg):
        worker = Worker(spec)
        return worker, [worker.setup()]
    hint = (f"The newest valid checkpoint in {run_dir / 'checkpoints'} is kept: run the same command again "
            "to resume from it (trainer.resume_mode=auto)")
    group = WorkerGroup(spec, tr.nnodes, tr.n_gpus_per_node, tr.cpus_per_worker, resume_hint=hint)
    for w in group.info:
        print(f"posttrain: worker {w['rank']}: pid {w['pid']} on {w['host']} ({w['device']})", file=sys.stderr)
    return group, group.info


def make_rewards(cfg) -> RewardPool | ModelRewards:
    """The run's rewards: rule functions in a RewardPool, or a reward model (reward.model.enable) on this
    process's GPU if it has one, with the pool only when a custom function combines the two."""
    r = cfg.reward
    sandbox = None
    if r.sandbox_fusion.url:  # code sources (apps, taco, ...) run in a SandboxFusion service: rewards.sandbox
        sf = r.sandbox_fusion
        sandbox = SandboxSettings(sf.url, sf.max_concurrent, sf.memory_limit_mb)
    if not r.model.enable:
        return make_reward_pool(r.custom_fn, r.num_workers, r.timeout_s, sandbox, cfg.trainer.debug, r.data_source)
    device = "cuda" if torch.cuda.is_available() and cfg.trainer.device != "cpu" else "cpu"
    model = RewardModel(r.model.path, device=device, micro_batch_size=r.model.micro_batch_size,
                        max_length=r.model.max_length, trust_remote_code=r.model.trust_remote_code,
                        remove_padding=r.model.use_remove_padding, param_offload=r.model.param_offload)
    return ModelRewards(model, make_reward_pool(r.custom_fn, r.num_workers, r.timeout_s, sandbox, cfg.trainer.debug,
                                                r.data_source) if r.custom_fn else None)


def make_reward_pool(custom_fn: str | None, num_workers: int | None, timeout_s: float,
                     sandbox: SandboxSettings | None = None, debug: bool = False, data_source: str | None = None):
    """The run's RewardPool (reward.custom_fn or the built-ins; num_workers None:
    min(8, CPUs)). The function is loaded here once, so a file that fails to
    import stops the run now with its RewardError; the workers load their own.
    sandbox (rewards.sandbox.SandboxSettings): where code sources run, its
    max_concurrent shared by the workers. debug (trainer.debug): rewards.pool.in_process.
    data_source (reward.data_source): every row scored as this source."""
    if debug:
        return in_process(reward_loader(custom_fn, sandbox)(), data_source)
    if num_workers is None:
        num_workers = min(8, os.cpu_count() or 1)
    sandbox = sandbox.per_process(num_workers) if sandbox else None
    pool = RewardPool(reward_loader(custom_fn, sandbox), num_workers, timeout_s, data_source=data_source)
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
        run_dir, static_model_files(model_dir, tokenizer), config_yaml, async_save=tr.async_save,
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
    tokenizer = load_tokenizer(model_dir, trust_remote_code=cfg.model.trust_remote_code)
    if cfg.distillation.enabled:
        check_teacher(cfg, tokenizer)
    tools, multi_turn = make_tools(cfg, model_dir, tokenizer)
    env, env_turns = make_env(cfg, model_dir, tokenizer)
    train_data, val_data = load_datasets(cfg, train_files, val_files, tokenizer, templates, tools)
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
        env=env, correction=rollout_correction(cfg),
    )
    if cfg.async_training.enable:  # started by train(), after any resume and the first validation
        a = cfg.async_training
        run.ahead = RolloutsAhead(run, a.max_trajectory_age_steps, in_flight=a.in_flight_weight_updates)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(config_yaml)
    if resume_from is not None:
        resume(run, resume_from)  # last: nothing after this draws random numbers
    return run


def load_datasets(cfg, train_files: list[str], val_files: list[str] | None, tokenizer, templates,
                  tools: ToolSet | None) -> tuple[PromptDataset, PromptDataset | None]:
    """The training and validation prompts (with data.val_split_size, validation held out of training);
    with tools, their schemas in each prompt's chat template."""
    schemas = tools.schemas if tools is not None else None
    train_data = load_data(train_files, tokenizer, cfg, "train", templates=templates, tool_schemas=schemas)
    val_data = (load_data(val_files, tokenizer, cfg, "validation", cfg.data.val_max_samples, templates, schemas)
                if val_files else None)
    if cfg.data.val_split_size:
        seed = cfg.data.seed if cfg.data.seed is not None else cfg.trainer.seed
        train_data, val_data = hold_out(train_data, val_data, cfg.data.val_split_size, seed, cfg.data.val_max_samples)
    return train_data, val_data


def make_profiler(cfg, run_dir: Path, device: str, distributed: bool) -> StepProfiler:
    """The run's profiling.StepProfiler (profiler.*). It profiles the loop's process, counted as rank 0: in one
    process the only worker; on Ray workers the driver (the loop's phases as it dispatches and waits for them),
    not the workers' passes. The roles whose enable and ranks pick rank 0 name the phases captured (discrete
    when all of theirs are); none: nothing is profiled (torch_memory snapshots every listed step either way)."""
    p = cfg.profiler
    if p.tool is None or (p.steps is None and p.tool != "torch_memory"):
        return StepProfiler()
    read, _ = tool_settings(p.tool, {r: getattr(p, r).tool_config for r in ROLE_PHASES})
    roles = [r for r in ROLE_PHASES if getattr(p, r).enable and rank_selected(0, getattr(p, r).all_ranks,
                                                                               getattr(p, r).ranks)]
    if not roles and p.tool != "torch_memory":
        why = ", ".join(f"profiler.{r}.ranks={getattr(p, r).ranks}" for r in ROLE_PHASES if getattr(p, r).enable)
        warn(f"profiler.tool={p.tool}: nothing is profiled: posttrain profiles the loop's process, rank 0, which "
             f"no enabled role picks ({why or 'none is enabled'}); set e.g. profiler.actor.enable=true (verl's "
             "actor_rollout_ref.actor.profiler.enable=True) with ranks [] or [0], or all_ranks=true")
        return StepProfiler()
    if distributed:
        warn("profiler: the workers' passes run in Ray actors, which are not profiled yet: this profiles the driver "
             "(the loop's phases as it dispatches and waits for them)")
    settings = [read.get(r) or (read.get("actor", {}) if r == "rollout" else {}) for r in roles]
    tm = p.torch_memory
    return StepProfiler(
        p.tool, p.steps, p.save_path or run_dir / "profile", continuous=p.continuous_steps,
        discrete=bool(settings) and all(s.get("discrete", p.discrete) for s in settings),
        phases=[ph for r in roles for ph in ROLE_PHASES[r]],
        contents={c for s in settings for c in s.get("contents") or ()},
        memory_max_entries=tm.trace_alloc_max_entries, memory_context=tm.context, memory_stacks=tm.stacks,
        cuda=device == "cuda" and torch.cuda.is_available())  # a Ray driver may see no GPU


def flop_model(model_dir: str, frozen_base: bool = False) -> ModelFlops | None:
    """The policy's FLOPs per token (flops.ModelFlops), or None with a
    warning when its config.json lacks a field the count needs. frozen_base
    (LoRA): no weight gradients to count in the backward pass."""
    try:
        flops = ModelFlops.from_model_dir(model_dir)
    except (KeyError, TypeError, ValueError, OSError) as e:
        print(f"posttrain: warning: no perf/mfu metrics: cannot count the FLOPs of the model in {model_dir} from its "
              f"config.json ({type(e).__name__}: {e})", file=sys.stderr)
        return None
    return dataclasses.replace(flops, backward_factor=1.0) if frozen_base else flops


def peak_flops_of(configured: float | None, workers: list[dict]) -> float | None:
    """Peak FLOP/s per device: trainer.peak_flops, else the slowest worker's
    own (known GPU or measured CPU); None, with a warning, when unknown."""
    if configured:
        return float(configured)
    peaks = [w.get("peak_flops") for w in workers]
    if any(p is None for p in peaks):
        names = sorted({w.get("device_name", "?") for w, p in zip(workers, peaks) if p is None})
        print(f"posttrain: warning: no perf/mfu metrics: the peak FLOP/s of {', '.join(names)} is not known; set "
              "trainer.peak_flops to one device's dense peak (FLOP/s, e.g. 989e12 for an H100's bf16)",
              file=sys.stderr)
        return None
    return min(peaks)


def measured_peaks(configured: float | None, workers: list[dict]) -> list[str]:
    """The CPU peaks (flops.cpu_peak_key) the run's MFU is measured against, which a step that beats them
    raises (metrics.raise_measured_peak); none when trainer.peak_flops is set or a device is no CPU."""
    keys = [w.get("peak_key") for w in workers]
    return [] if configured or not all(keys) else sorted(set(keys))


def worker_device(name: str, distributed: bool) -> str:
    """The workers' device. On Ray, `auto` means cuda when the cluster has GPUs."""
    if not distributed:
        return pick_device(name).type
    if name != "auto":
        return name
    import ray

    return "cuda" if ray.is_initialized() and ray.cluster_resources().get("GPU", 0) > 0 else "cpu"
