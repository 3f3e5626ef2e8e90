"""Build a supervised run (`posttrain sft`) from a resolved config: the RL run's pieces (run directory,
workers, checkpoint writer, resume; build.py) around SFT examples (data/sft.py) and the SFT loop (sft.py).
"""

from __future__ import annotations

import dataclasses

from posttrain.driver.build import checkpoint_writer, start_run, training_steps
from posttrain.driver.build_data import data_files, hold_out, tokenizer_of
from posttrain.driver.placement import (
    connect_cluster, flop_model, make_actor, make_profiler, peak_flops_of, worker_device,
)
from posttrain.checkpoint.run_dir import resume, resumed_model_dirs
from posttrain.data.dataset import PromptSampler
from posttrain.data.prompts import read_templates
from posttrain.data.sft import SFTDataSettings, chat_template_text, load_examples
from posttrain.driver.sft import SFTRun
from posttrain.driver.settings import lora_settings, worker_spec
from posttrain.training.sft import SFTSettings
from posttrain.worker.spec import RefSpec, RolloutSpec


def data_settings(cfg) -> SFTDataSettings:
    d = cfg.data
    return SFTDataSettings(
        prompt_key=d.prompt_key, response_key=d.response_key, prompt_dict_keys=tuple(d.prompt_dict_keys or ()),
        response_dict_keys=tuple(d.response_dict_keys or ()), multiturn=d.multiturn.enable,
        messages_key=d.multiturn.messages_key, tools_key=d.multiturn.tools_key,
        enable_thinking_key=d.multiturn.enable_thinking_key, max_length=d.max_length, truncation=d.truncation,
        template_kwargs=dict(d.apply_chat_template_kwargs), only_last_turn=d.only_last_turn,
        templates=read_templates(d.prompt_file, d.system_prompt_file))


def update_settings(cfg) -> SFTSettings:
    a = cfg.actor
    return SFTSettings(micro_batch_size=a.ppo_micro_batch_size, grad_clip=a.grad_clip,
                       remove_padding=cfg.model.use_remove_padding, fused=cfg.model.use_fused_kernels,
                       micro_max_tokens=a.ppo_max_token_len_per_gpu if a.use_dynamic_bsz else None)


def load_sft_data(cfg, tokenizer) -> tuple[list, list | None]:
    """The training and validation examples: data.train_files / val_files (else a named dataset's, its SFT form
    where it has one: OpenMathInstruct-2's generated_solution; else the embedded arith task's), the first
    train_max_samples / val_max_samples rows, data.val_split_size held out."""
    d = cfg.data
    train_files, val_files = data_files(cfg, sft=True)
    settings = data_settings(cfg)
    train = load_examples(train_files, tokenizer, settings, d.train_max_samples or -1, what="SFT training")
    val = (load_examples(val_files, tokenizer, settings, d.val_max_samples or -1, what="SFT validation")
           if val_files else None)
    if d.val_split_size:
        train, val = hold_out(train, val, d.val_split_size, d.seed, d.val_max_samples)
    return train, val


def build_sft_run(cfg) -> SFTRun:
    """Everything `posttrain.driver.sft.train_sft` needs, checked before anything is written; resumes from a
    checkpoint when trainer.resume_mode finds one."""
    tr = cfg.trainer
    run_dir, remote, resume_from, model_dir, distributed = start_run(cfg)
    tokenizer = tokenizer_of(cfg, model_dir)
    if cfg.data.custom_chat_template is not None:  # the rows' rendering, and the checkpoints' tokenizer
        tokenizer.chat_template = chat_template_text(cfg.data.custom_chat_template)
    train, val = load_sft_data(cfg, tokenizer)
    sampler = PromptSampler(len(train), cfg.data.train_batch_size, seed=cfg.data.seed, shuffle=cfg.data.shuffle)
    total_steps = training_steps(tr, sampler.steps_per_epoch)
    if distributed:
        connect_cluster(cfg)
    device = worker_device(tr.device, distributed)
    policy_dir, _ = resumed_model_dirs(resume_from)
    # the policy and its optimizer only: no reference, critic or teachers, and the hf engine over the policy
    # (never used)
    spec = dataclasses.replace(worker_spec(cfg, model_dir, policy_dir, device, total_steps), ref=RefSpec(),
                               rollout=RolloutSpec(), critic=None, teachers=(), sft=update_settings(cfg))
    actor, workers = make_actor(cfg, spec, run_dir)
    writer, config_yaml = checkpoint_writer(cfg, run_dir, remote, model_dir, tokenizer)
    run = SFTRun(
        cfg=cfg, run_dir=run_dir, actor=actor, tokenizer=tokenizer, train_data=train, val_data=val, sampler=sampler,
        total_steps=total_steps, writer=writer, model_dir=model_dir, resumed_from=resume_from,
        flops=flop_model(model_dir, frozen_base=lora_settings(cfg) is not None),
        peak_flops=peak_flops_of(tr.peak_flops, workers),
        profiler=make_profiler(cfg, run_dir, device, distributed))
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(config_yaml)
    if resume_from is not None:
        resume(run, resume_from)  # last: nothing after this draws random numbers
    return run
