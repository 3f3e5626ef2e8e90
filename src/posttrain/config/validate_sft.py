"""`posttrain sft`'s config checked: the sections a supervised run reads (data, model, actor's optimizer and
micro-batches, trainer), its own keys, and a warning naming the RL settings a run gave that SFT does not use.

    validate_sft(cfg, given={"data.train_files", "actor.lr"})
"""

from __future__ import annotations

import warnings
from typing import Sequence

from posttrain.config.checks import need, positive, positive_or_null
from posttrain.config.schema import Config, data_parallel_groups
from posttrain.config.validate import (validate_actor, validate_data, validate_model, validate_sequence_parallel,
                                       validate_tensor_parallel, validate_trainer, warn_unused)

# what a supervised run has no use for: the rollout, rewards, advantages, the critic, the reference, the teachers,
# the RL loss's knobs, the sampled completions' logs (a run that sets them is told, in one line; `posttrain sft
# --help-config` leaves them out: help_config.py)
RL_SECTIONS = ("rollout.", "algorithm.", "reward.", "critic.", "ref.", "async_training.", "distillation.",
               "profiler.ref.", "profiler.rollout.", "profiler.critic.")
RL_KEYS = ("actor.ppo_mini_batch_size", "actor.ppo_epochs", "actor.clip_ratio", "actor.clip_ratio_low",
           "actor.clip_ratio_high", "actor.clip_ratio_c", "actor.loss_agg_mode", "actor.loss_scale_factor",
           "actor.policy_loss.loss_mode", "actor.entropy_coeff", "actor.use_kl_loss", "actor.kl_loss_coef",
           "actor.kl_loss_type", "actor.reuse_on_policy_log_probs", "actor.entropy_from_logits_with_chunking",
           "actor.entropy_checkpointing", "actor.use_torch_compile", "data.max_prompt_length",
           "data.max_response_length", "data.filter_overlong_prompts", "data.val_batch_size", "data.image_key",
           "data.video_key", "model.share_prompt", "trainer.critic_warmup", "trainer.max_critic_ckpt_to_keep",
           "trainer.log_val_generations", "trainer.log_samples_freq", "trainer.log_samples_prompts")


def rl_only(key: str) -> bool:
    """A key that only reinforcement learning reads."""
    return key.startswith(RL_SECTIONS) or key in RL_KEYS

def validate_sft(cfg: Config, given: set[str], unused: Sequence[str] = ()) -> None:
    """Ranges and rules of a supervised run (in place, as validate does); RL keys in `given` (the run's own
    keys) named unused, and `unused` (verl's keys its dialect dropped, as validate's)."""
    d, a = cfg.data, cfg.actor
    a.ppo_mini_batch_size = d.train_batch_size  # one optimizer step per batch (what the shared checks read)
    validate_data(cfg)
    validate_model(cfg)
    validate_actor(cfg)
    validate_trainer(cfg)
    warn_unused(cfg, unused, sft_keys_used=True)
    positive(cfg, "data.max_length")
    positive_or_null(cfg, "data.train_max_samples")
    validate_sequence_parallel(cfg)  # the group's workers take the same rows, each 1/P of their positions
    validate_tensor_parallel(cfg)  # the group's workers take the same rows, each its share of every layer
    groups = data_parallel_groups(cfg)
    need(d.train_batch_size % groups == 0, f"data.train_batch_size={d.train_batch_size} rows must divide evenly "
          f"over the {groups} workers (trainer.nnodes x trainer.n_gpus_per_node); make it a multiple")
    need(d.custom_chat_template is None or bool(str(d.custom_chat_template).strip()),
          "data.custom_chat_template is empty; give a Jinja chat template or a .jinja file, or null for the "
          "tokenizer's own")
    templates = [k for k in ("prompt_file", "system_prompt_file") if getattr(d, k) is not None]
    need(not (templates and d.multiturn.enable), f"data.{templates[0] if templates else ''} with "
          "data.multiturn.enable=true: prompt files rewrite a single-turn row's prompt; put the text in the "
          "conversations themselves, or leave it out")
    rl = sorted(k for k in given if rl_only(k))
    if rl:
        warnings.warn(f"{', '.join(rl)}: reinforcement-learning settings; posttrain sft does not use them",
                      stacklevel=3)
