"""Build a run's components from a resolved config.

The only place that reads the config object to construct things; the
components themselves take plain arguments.
"""

from __future__ import annotations

import dataclasses

import json
import os
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch

from posttrain.algorithms import NEEDS_CRITIC
from posttrain.errors import CheckpointError, ConfigError
from posttrain.rollout.base import SamplingParams
from posttrain.training.actor import UpdateSettings, warmup_steps
from posttrain.training.critic import CriticSettings
from posttrain.worker import CriticSpec, WorkerSpec

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


def resolve_run_dir(cfg) -> Path:
    """trainer.run_dir, else runs/<project_name>/<experiment_name or a timestamp>."""
    tr = cfg.trainer
    name = tr.experiment_name or time.strftime("run-%Y%m%d-%H%M%S")
    return Path(tr.run_dir) if tr.run_dir else Path("runs") / tr.project_name / name


def check_fresh_run_dir(run_dir: Path, resume_mode: str) -> None:
    """Without a checkpoint to resume from, an earlier run's files are never
    mixed into. With resume_mode=auto the earlier run died before its first
    complete checkpoint: its metrics are set aside and its unfinished saves,
    never loaded, are overwritten. With disable the directory must be new."""
    metrics = run_dir / "metrics.jsonl"
    if resume_mode == "auto":
        set_aside(metrics, keep_up_to=-1)
        return
    leftovers = [p for p in (metrics, run_dir / "checkpoints") if p.exists()]
    if leftovers:
        raise ConfigError(
            f"run directory '{run_dir}' already holds an earlier run ({leftovers[0].name}) and "
            f"trainer.resume_mode={resume_mode}; choose another trainer.run_dir or trainer.experiment_name"
        )


def set_aside(metrics: Path, keep_up_to: int) -> None:
    """Keep the metrics of steps <= keep_up_to; move the rest (steps of a
    timeline abandoned by a crash) to metrics.discarded.jsonl."""
    if not metrics.exists():
        return
    keep, drop = [], []
    for line in metrics.read_text().splitlines():
        try:
            (keep if json.loads(line).get("step", 0) <= keep_up_to else drop).append(line)
        except ValueError:
            drop.append(line)  # a line cut short by a kill
    if drop:
        with open(metrics.with_name("metrics.discarded.jsonl"), "a", encoding="utf-8") as fh:
            fh.write("\n".join(drop) + "\n")
        metrics.write_text("".join(line + "\n" for line in keep))


def embedded_data_files() -> tuple[str, str]:
    """The arith task's train/test parquet, generated once into the cache."""
    from posttrain.data.preprocess import arith
    from posttrain.files import cache_root

    out = cache_root() / "data" / EMBEDDED_DATA_VERSION
    train, test = out / "train.parquet", out / "test.parquet"
    if not (train.exists() and test.exists()):
        arith.run(out, seed=0)
    return str(train), str(test)


def model_dir_of(cfg) -> str:
    from posttrain.tiny.arith import ensure_tiny_model

    return cfg.model.path or str(ensure_tiny_model())


def data_files(cfg) -> tuple[list[str], list[str] | None]:
    """The run's train and validation files, resolved once: data.train_files, else data.dataset_name's file
    (data.named.resolve), else the embedded arith task; data.val_files, else data.val_dataset_name's file, else
    the default of the training data (the embedded task's test split; a named set's own test split or its
    paired set, when prepared: named.default_validation), else none."""
    from posttrain.data import named

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
    from posttrain.data.dataset import PromptDataset
    from posttrain.data.prompts import read_templates
    from posttrain.data.schema import read_rows

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


def make_tools(cfg, model_dir: str, tokenizer):
    """rollout.multi_turn.*: -> (posttrain.tools.ToolSet, rollout.multiturn.MultiTurnSettings), or (None, None)."""
    mt = cfg.rollout.multi_turn
    if not mt.enable:
        return None, None
    from posttrain.rollout.multiturn import MultiTurnSettings
    from posttrain.tools import load_tools

    tools = load_tools(tool_config_path=mt.tool_config_path, functions=mt.tools, timeout_s=cfg.reward.timeout_s,
                       in_process=cfg.trainer.debug)
    settings = MultiTurnSettings(max_assistant_turns=mt.max_assistant_turns or 5,
                                 max_tool_response_length=mt.max_tool_response_length,
                                 max_response_length=cfg.data.max_response_length,
                                 template_kwargs=template_kwargs(cfg, tools.schemas),
                                 eos_token_ids=tuple(driver_eos_ids(model_dir, tokenizer)))
    return tools, settings


def driver_eos_ids(model_dir: str, tokenizer) -> list[int]:
    """The tokens that end a response (models.loader.eos_token_ids), without loading the model: its
    generation_config.json, if any, and the tokenizer's EOS."""
    from types import SimpleNamespace

    from posttrain.models.loader import eos_token_ids

    try:
        from transformers import GenerationConfig

        gen = GenerationConfig.from_pretrained(model_dir)
    except (OSError, ValueError):
        gen = None
    return eos_token_ids(tokenizer, SimpleNamespace(generation_config=gen))


def hold_out(train, val, share: float, seed: int | None, max_samples: int | None = None):
    """data.val_split_size (NeMo-RL's split_validation_size): with no validation set, a seeded random
    `share` of the training prompts (at least one) becomes the validation set and leaves training.
    -> (train, val); with a validation set given, both unchanged (and one line says so)."""
    from posttrain.data.dataset import PromptDataset

    if val is not None:
        print(f"posttrain: data.val_split_size={share} unused: a validation set is given", file=sys.stderr)
        return train, val
    count = max(1, round(share * len(train)))
    if count >= len(train):
        raise ConfigError(f"data.val_split_size={share} holds out all {len(train)} training prompts; make it smaller")
    order = list(range(len(train)))
    random.Random(seed).shuffle(order)
    held, kept = sorted(order[:count]), sorted(order[count:])
    val_items = [train.items[i] for i in held][:max_samples]
    return (PromptDataset([train.items[i] for i in kept], train.num_dropped, train.num_invalid),
            PromptDataset(val_items))


def refuse_images(rows, image_key: str, name: str) -> None:
    """A row that carries images (verl's data.image_key column) needs a vision model's processor: not yet."""
    for i, row in enumerate(rows):
        if row.get(image_key) not in (None, [], ""):
            from posttrain.errors import DataError

            raise DataError(f"{name} row {i} has images in its '{image_key}' column (data.image_key): vision inputs "
                            "are not supported yet; train on text-only rows")


def worker_spec(cfg, model_dir: str, policy_dir: str | None, device: str, total_steps: int,
                critic_dir: str | None = None) -> WorkerSpec:
    """What every worker needs to build its models, optimizer and rollout engine
    (and critic: from `critic_dir` when resuming, else critic.model.path or the actor's model)."""
    a, r = cfg.actor, cfg.rollout
    critic = None
    if cfg.algorithm.adv_estimator in NEEDS_CRITIC:
        critic = critic_spec(cfg, critic_dir or cfg.critic.model.path or model_dir, total_steps)
    return WorkerSpec(critic=critic,
        model_dir=model_dir, policy_dir=policy_dir, update=update_settings(cfg), dtype=cfg.model.dtype,
        trust_remote_code=cfg.model.trust_remote_code, gradient_checkpointing=cfg.model.enable_gradient_checkpointing,
        small_attention=cfg.model.small_attention,
        need_ref=a.use_kl_loss or cfg.algorithm.use_kl_in_reward, device=device, lr=a.lr,
        param_offload=a.param_offload, ref_param_offload=cfg.ref.param_offload, optimizer_offload=a.optimizer_offload,
        weight_decay=a.weight_decay, betas=tuple(a.betas),
        warmup_steps=warmup_steps(a.lr_warmup_steps, a.lr_warmup_steps_ratio, total_steps),
        warmup_start_factor=a.lr_warmup_start_factor,
        log_prob_micro_batch_size=r.log_prob_micro_batch_size,
        ref_log_prob_micro_batch_size=cfg.ref.log_prob_micro_batch_size,
        log_prob_max_tokens=r.log_prob_max_token_len_per_gpu if r.log_prob_use_dynamic_bsz else None,
        ref_log_prob_max_tokens=cfg.ref.log_prob_max_token_len_per_gpu if cfg.ref.log_prob_use_dynamic_bsz else None,
        ref_torch_compile=cfg.ref.use_torch_compile, forward_prefetch=a.forward_prefetch,
        ref_forward_prefetch=cfg.ref.forward_prefetch, freeze_vision_tower=a.freeze_vision_tower,
        sequence_parallel=a.ulysses_sequence_parallel_size, lora=lora_settings(cfg),
        temperature=r.temperature, rollout=r.name,
        rollout_micro_batch_size=r.micro_batch_size, rollout_shared_prefill=r.shared_prefill,
        rollout_remove_padding=r.remove_padding, rollout_early_stop=r.early_stop, tensor_parallel_size=r.tensor_model_parallel_size,
        gpu_memory_utilization=r.gpu_memory_utilization,
        max_model_len=r.max_model_len or cfg.data.max_prompt_length + cfg.data.max_response_length,
        engine_kwargs=vllm_engine_kwargs(r), free_cache_engine=r.free_cache_engine,
        weights_from_policy=r.name == "vllm" and (r.load_format or "").startswith("dummy"),
        mixed_precision=mixed_precision(cfg, device), reduce_dtype=a.mixed_precision.reduce_dtype,
        seed=cfg.trainer.seed, collective_timeout_s=cfg.trainer.collective_timeout_s,
    )


def lora_settings(cfg):
    """models.lora.LoraSettings with LoRA on (model.lora_rank > 0 or an adapter to start from), else None."""
    from posttrain.config import uses_lora
    from posttrain.models.lora import LoraSettings

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
    from posttrain.config import VLLM_SETTINGS

    out = {k: getattr(r, k) for k in VLLM_SETTINGS if getattr(r, k) is not None and k != "max_model_len"}
    if str(out.get("load_format", "")).startswith("dummy"):
        out["load_format"] = "dummy"
    return {**out, **r.engine_kwargs.get("vllm", {})}


def critic_spec(cfg, critic_dir: str, total_steps: int) -> CriticSpec:
    c = cfg.critic
    settings = CriticSettings(
        mini_batch_size=c.ppo_mini_batch_size * cfg.rollout.n, micro_batch_size=c.ppo_micro_batch_size,
        forward_micro_batch_size=c.forward_micro_batch_size, ppo_epochs=c.ppo_epochs,
        micro_max_tokens=c.ppo_max_token_len_per_gpu if c.use_dynamic_bsz else None,
        forward_max_tokens=c.forward_max_token_len_per_gpu if c.use_dynamic_bsz else None,
        cliprange_value=c.cliprange_value, loss_agg_mode=c.loss_agg_mode,
        loss_scale_factor=float(cfg.data.max_response_length), grad_clip=c.grad_clip,
        remove_padding=cfg.model.use_remove_padding if c.model.use_remove_padding is None else c.model.use_remove_padding)
    return CriticSpec(model_dir=str(critic_dir), update=settings, lr=c.lr, weight_decay=c.weight_decay,
                      betas=tuple(c.betas), warmup_steps=warmup_steps(c.lr_warmup_steps, c.lr_warmup_steps_ratio,
                                                                      total_steps),
                      warmup_start_factor=c.lr_warmup_start_factor,
                      gradient_checkpointing=c.model.enable_gradient_checkpointing,
                      param_offload=c.model.param_offload, optimizer_offload=c.model.optimizer_offload)


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
    from posttrain.distributed.cluster import connect
    from posttrain.redact import redact_url

    tr = cfg.trainer
    world = tr.nnodes * tr.n_gpus_per_node
    where = connect(tr.ray_address, num_cpus=max(world * tr.cpus_per_worker, os.cpu_count() or 1))
    print(f"posttrain: {world} worker{'s' if world > 1 else ''} on {redact_url(where)}", file=sys.stderr)


def check_offload(spec: WorkerSpec, sharded: bool) -> None:
    """Parameter offload is FSDP2's: on a GPU it needs sharded workers (on the CPU there is nothing to move)."""
    asked = [k for k, on in (("actor.param_offload", spec.param_offload), ("ref.param_offload", spec.ref_param_offload),
                             ("critic.model.param_offload", spec.critic is not None and spec.critic.param_offload))
             if on]
    if asked and spec.device == "cuda" and not sharded:
        raise ConfigError(f"{', '.join(asked)} (verl's fsdp_config.param_offload) keeps FSDP2's sharded parameters "
                          "in CPU memory, but this run is one process, unsharded: run FSDP2 workers "
                          "(trainer.use_ray=true, or trainer.n_gpus_per_node > 1) or set it to false")


def make_actor(cfg, spec: WorkerSpec, run_dir: Path):
    """One `Worker` in this process, or a `WorkerGroup` of Ray actors."""
    from posttrain.worker import Worker

    tr = cfg.trainer
    check_offload(spec, sharded=uses_ray(cfg))
    if cfg.rollout.name == "vllm":
        from posttrain.rollout.vllm import check_vllm_available

        check_vllm_available(spec.device, spec.engine_kwargs)
    if not uses_ray(cfg):
        worker = Worker(spec)
        return worker, [worker.setup()]
    from posttrain.distributed.group import WorkerGroup

    hint = (f"The newest valid checkpoint in {run_dir / 'checkpoints'} is kept: run the same command again "
            "to resume from it (trainer.resume_mode=auto)")
    group = WorkerGroup(spec, tr.nnodes, tr.n_gpus_per_node, tr.cpus_per_worker, resume_hint=hint)
    for w in group.info:
        print(f"posttrain: worker {w['rank']}: pid {w['pid']} on {w['host']} ({w['device']})", file=sys.stderr)
    return group, group.info


def make_rewards(cfg):
    """The run's rewards: rule functions in a RewardPool, or a reward model (reward.model.enable) on this
    process's GPU if it has one, with the pool only when a custom function combines the two."""
    r = cfg.reward
    sandbox = None
    if r.sandbox_fusion.url:  # code sources (apps, taco, ...) run in a SandboxFusion service: rewards.sandbox
        from posttrain.rewards.sandbox import SandboxSettings

        sf = r.sandbox_fusion
        sandbox = SandboxSettings(sf.url, sf.max_concurrent, sf.memory_limit_mb)
    if not r.model.enable:
        return make_reward_pool(r.custom_fn, r.num_workers, r.timeout_s, sandbox, cfg.trainer.debug)
    from posttrain.rewards.model import ModelRewards, RewardModel

    device = "cuda" if torch.cuda.is_available() and cfg.trainer.device != "cpu" else "cpu"
    model = RewardModel(r.model.path, device=device, micro_batch_size=r.model.micro_batch_size,
                        max_length=r.model.max_length, trust_remote_code=r.model.trust_remote_code,
                        remove_padding=r.model.use_remove_padding, param_offload=r.model.param_offload)
    return ModelRewards(model, make_reward_pool(r.custom_fn, r.num_workers, r.timeout_s, sandbox, cfg.trainer.debug)
                        if r.custom_fn else None)


def make_reward_pool(custom_fn: str | None, num_workers: int | None, timeout_s: float, sandbox=None,
                     debug: bool = False):
    """The run's RewardPool (reward.custom_fn or the built-ins; num_workers None:
    min(8, CPUs)). The function is loaded here once, so a file that fails to
    import stops the run now with its RewardError; the workers load their own.
    sandbox (rewards.sandbox.SandboxSettings): where code sources run, its
    max_concurrent shared by the workers. debug (trainer.debug): rewards.pool.in_process."""
    from posttrain.rewards.pool import RewardPool, in_process, reward_loader

    if debug:
        return in_process(reward_loader(custom_fn, sandbox)())
    if num_workers is None:
        num_workers = min(8, os.cpu_count() or 1)
    sandbox = sandbox.per_process(num_workers) if sandbox else None
    pool = RewardPool(reward_loader(custom_fn, sandbox), num_workers, timeout_s)
    pool.load()
    return pool


def sampling_params(cfg) -> tuple[SamplingParams, SamplingParams]:
    r, v = cfg.rollout, cfg.rollout.val_kwargs
    train = SamplingParams(max_new_tokens=cfg.data.max_response_length, n=r.n, temperature=r.temperature,
                           top_p=r.top_p, top_k=r.top_k, do_sample=r.do_sample, ignore_eos=r.ignore_eos)
    val = SamplingParams(max_new_tokens=cfg.data.max_response_length, n=v.n, temperature=v.temperature,
                         top_p=v.top_p, top_k=v.top_k, do_sample=v.do_sample, ignore_eos=r.ignore_eos)
    return train, val


def update_settings(cfg) -> UpdateSettings:
    a = cfg.actor
    return UpdateSettings(
        mini_batch_size=a.ppo_mini_batch_size * cfg.rollout.n,  # verl counts prompts; we count sequences
        micro_batch_size=a.ppo_micro_batch_size, ppo_epochs=a.ppo_epochs,
        micro_max_tokens=a.ppo_max_token_len_per_gpu if a.use_dynamic_bsz else None,
        clip_ratio_low=a.clip_ratio_low, clip_ratio_high=a.clip_ratio_high, clip_ratio_c=a.clip_ratio_c,
        loss_agg_mode=a.loss_agg_mode, loss_mode=a.policy_loss.loss_mode,
        loss_scale_factor=float(a.loss_scale_factor or cfg.data.max_response_length), entropy_coeff=a.entropy_coeff, use_kl_loss=a.use_kl_loss,
        kl_loss_coef=a.kl_loss_coef, kl_loss_type=a.kl_loss_type, temperature=cfg.rollout.temperature,
        grad_clip=a.grad_clip, remove_padding=cfg.model.use_remove_padding, share_prompt=cfg.model.share_prompt,
        fused_kernels=cfg.model.use_fused_kernels, entropy_chunking=a.entropy_from_logits_with_chunking,
        entropy_checkpointing=a.entropy_checkpointing, torch_compile=a.use_torch_compile,
    )


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


def build_run(cfg):
    """Everything `posttrain.loop.train` needs, checked before anything is
    written; resumes from a checkpoint when trainer.resume_mode finds one."""
    from posttrain import checkpoint
    from posttrain.algorithms import make_kl_controller
    from posttrain.config import config_to_dict, config_to_yaml
    from posttrain.data.dataset import PromptSampler
    from posttrain.data.prompts import read_templates
    from posttrain.loop import Run
    from posttrain.models import load_tokenizer
    from posttrain.redact import redact_mapping
    from posttrain.sinks import check_sinks

    tr = cfg.trainer
    check_sinks(tr.logger)  # a missing logger package stops the run before anything is loaded or written
    if tr.debug:
        from posttrain.debugging import announce

        announce(tr.nnodes * tr.n_gpus_per_node, bool(tr.use_ray or tr.ray_address or os.environ.get("RAY_ADDRESS")))
    seed_everything(tr.seed)
    distributed = uses_ray(cfg)
    remote = None
    if checkpoint.is_url(tr.run_dir):
        from posttrain.files import cache_root

        if tr.nnodes > 1:
            raise ConfigError(f"trainer.run_dir={tr.run_dir} is a URL, but workers on {tr.nnodes} nodes write "
                              "their shards to a path they all see: use a shared file system path")
        remote = checkpoint.RemoteRunDir(tr.run_dir, cache_root() / "staging")
        run_dir = remote.pull()  # work locally; checkpoints and metrics are mirrored to the URL
    else:
        run_dir = resolve_run_dir(cfg)
    resume_from = checkpoint.find_checkpoint(run_dir, tr.resume_mode, tr.resume_from_path)
    model_dir = model_dir_of(cfg)
    if resume_from is not None:
        checkpoint.check_compatible(resume_from, config_to_dict(cfg), model_dir)
        check_resumable(resume_from, distributed)
    else:
        check_fresh_run_dir(run_dir, tr.resume_mode)
    rewards = make_rewards(cfg)
    train_files, val_files = data_files(cfg)  # data.dataset_name / val_dataset_name resolved here, once
    templates = read_templates(cfg.data.prompt_file, cfg.data.system_prompt_file)
    tokenizer = load_tokenizer(model_dir, trust_remote_code=cfg.model.trust_remote_code)
    tools, multi_turn = make_tools(cfg, model_dir, tokenizer)
    schemas = tools.schemas if tools is not None else None
    train_data = load_data(train_files, tokenizer, cfg, "train", templates=templates, tool_schemas=schemas)
    val_data = (load_data(val_files, tokenizer, cfg, "validation", cfg.data.val_max_samples, templates, schemas)
                if val_files else None)
    if cfg.data.val_split_size:
        seed = cfg.data.seed if cfg.data.seed is not None else cfg.trainer.seed
        train_data, val_data = hold_out(train_data, val_data, cfg.data.val_split_size, seed, cfg.data.val_max_samples)
    sampler = PromptSampler(len(train_data), cfg.data.train_batch_size, seed=cfg.data.seed, shuffle=cfg.data.shuffle)
    total_steps = training_steps(tr, sampler.steps_per_epoch)
    kc = cfg.algorithm.kl_ctrl
    kl_ctrl = make_kl_controller(kc.type, kc.kl_coef, kc.target_kl, kc.horizon) if cfg.algorithm.use_kl_in_reward else None
    train_sampling, val_sampling = sampling_params(cfg)
    if distributed:
        connect_cluster(cfg)
    device = worker_device(tr.device, distributed)
    one_process_ckpt = resume_from is not None and not checkpoint.is_sharded(resume_from)
    policy_dir = str(resume_from / "actor") if one_process_ckpt else None
    critic_dir = str(resume_from / "critic") if one_process_ckpt and (resume_from / "critic").is_dir() else None
    spec = worker_spec(cfg, model_dir, policy_dir, device, total_steps, critic_dir)
    actor, workers = make_actor(cfg, spec, run_dir)
    flops, peak = flop_model(model_dir), peak_flops_of(tr.peak_flops, workers)
    if flops is not None and lora_settings(cfg) is not None:  # frozen base: no weight gradients to count
        flops = dataclasses.replace(flops, backward_factor=1.0)
    # config.yaml (here and in every checkpoint) is read by people, reports and other runs: no credential
    # in it. A resume compares it with redaction in mind (checkpoint.check_compatible).
    config_yaml = config_to_yaml(redact_mapping(config_to_dict(cfg)))
    writer = checkpoint.CheckpointWriter(
        run_dir, checkpoint.static_model_files(model_dir, tokenizer), config_yaml, async_save=tr.async_save,
        max_to_keep=tr.max_ckpt_to_keep, keep_top_k=tr.keep_top_k, metric=tr.keep_top_k_metric,
        mode=tr.keep_top_k_mode, remote=remote)
    run = Run(
        cfg=cfg, run_dir=run_dir, actor=actor, tokenizer=tokenizer, kl_ctrl=kl_ctrl, rewards=rewards,
        train_data=train_data, val_data=val_data, sampler=sampler, sampling=train_sampling,
        val_sampling=val_sampling, total_steps=total_steps, writer=writer, model_dir=model_dir,
        resumed_from=resume_from, flops=flops, peak_flops=peak,
        profiler=make_profiler(cfg, run_dir, device, distributed), tools=tools, multi_turn=multi_turn,
    )
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(config_yaml)
    if resume_from is not None:
        checkpoint.restore(run, resume_from)  # last: nothing after this draws random numbers
        set_aside(run_dir / "metrics.jsonl", keep_up_to=run.global_step)
        print(f"posttrain: resuming from {resume_from} (step {run.global_step})", file=sys.stderr)
    return run


def make_profiler(cfg, run_dir: Path, device: str, distributed: bool):
    """The run's profiling.StepProfiler (profiler.*). It profiles the loop's process, counted as rank 0: in one
    process the only worker; on Ray workers the driver (the loop's phases as it dispatches and waits for them),
    not the workers' passes. The roles whose enable and ranks pick rank 0 name the phases captured (discrete
    when all of theirs are); none: nothing is profiled (torch_memory snapshots every listed step either way)."""
    from posttrain.profiling import ROLE_PHASES, StepProfiler, rank_selected, tool_settings, warn

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


def flop_model(model_dir: str):
    """The policy's FLOPs per token (flops.ModelFlops), or None with a
    warning when its config.json lacks a field the count needs."""
    from posttrain.flops import ModelFlops

    try:
        return ModelFlops.from_model_dir(model_dir)
    except (KeyError, TypeError, ValueError, OSError) as e:
        print(f"posttrain: warning: no perf/mfu metrics: cannot count the FLOPs of the model in {model_dir} from its "
              f"config.json ({type(e).__name__}: {e})", file=sys.stderr)
        return None


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


def worker_device(name: str, distributed: bool) -> str:
    """The workers' device. On Ray, `auto` means cuda when the cluster has GPUs."""
    if not distributed:
        return pick_device(name).type
    if name != "auto":
        return name
    import ray

    return "cuda" if ray.is_initialized() and ray.cluster_resources().get("GPU", 0) > 0 else "cpu"


def check_resumable(ckpt: Path, distributed: bool) -> None:
    """A one-process checkpoint resumes in one process only (its optimizer
    state is not sharded); a sharded one resumes with any number of workers."""
    from posttrain.checkpoint import is_sharded

    if distributed and not is_sharded(ckpt):
        raise CheckpointError(
            f"checkpoint {ckpt} was written by a one-process run; resume it with trainer.n_gpus_per_node=1 "
            f"trainer.nnodes=1, or start a new run on Ray workers from its weights: model.path={ckpt / 'actor'}")
