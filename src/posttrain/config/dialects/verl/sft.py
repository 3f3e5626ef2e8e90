"""verl's SFT trainer keys (`verl.trainer.fsdp_sft_trainer`, `sft_trainer.yaml`) mapped onto posttrain's, for
`posttrain sft`.

verl's SFT config is flat: data.*, model.*, optim.*, trainer.* and two top-level keys. Most data.* and
trainer.* keys are posttrain's own already (data.prompt_key, data.response_key, data.max_length,
data.truncation, trainer.total_epochs, ...); the others are renamed here, a few are accepted and named
unused, and the ones posttrain cannot honour are refused with what to do instead (describe() says so in
`posttrain sft --help-config`).

    translate({"model.partial_pretrain": "Qwen/Qwen2.5-0.5B", "optim.lr": 1e-4}, "on the command line")
    # -> {"model.path": "Qwen/Qwen2.5-0.5B", "actor.lr": 0.0001}
"""

from __future__ import annotations

import difflib
import sys
from typing import Any

from posttrain.config.dialects.verl.keys import alias_table
from posttrain.config.schema import SCHEMA
from posttrain.errors import ConfigError
from posttrain.text.lines import printable

EXACT = {
    "model.partial_pretrain": "model.path",
    "data.micro_batch_size_per_gpu": "actor.ppo_micro_batch_size",  # also the validation batch, as verl's
    "data.use_dynamic_bsz": "actor.use_dynamic_bsz",
    "data.max_token_len_per_gpu": "actor.ppo_max_token_len_per_gpu",
    "optim.clip_grad": "actor.grad_clip",
    "optim.lr_scheduler": "actor.lr_scheduler_type",
    "optim.warmup_style": "actor.lr_scheduler_type",  # verl's older spelling
    "model.fsdp_config.model_dtype": "model.dtype",
    "model.fsdp_config.cpu_offload": "actor.param_offload",
    "model.fsdp_config.offload_params": "actor.param_offload",
    "model.strategy": "actor.strategy",
    "ulysses_sequence_parallel_size": "actor.ulysses_sequence_parallel_size",
    "use_remove_padding": "model.use_remove_padding",
}
PREFIXES = (("optim.", "actor."),)  # lr, betas, weight_decay, lr_warmup_steps_ratio, lr_scheduler_type, ...
# verl's optimizer settings (its optim/fsdp.yaml) that PREFIXES reads, as `posttrain sft --help-config` names them
OPTIM = ("lr", "betas", "eps", "weight_decay", "lr_warmup_steps", "lr_warmup_steps_ratio", "lr_scheduler_type",
         "min_lr_ratio", "num_cycles")

# accepted; a value other than these is named in one warning line as unused
UNUSED = {
    "model.fsdp_config.wrap_policy.min_num_params": (0,),  # FSDP2 wraps each decoder layer
    "model.use_liger": (False,),  # liger's kernels: the loss is torch's cross-entropy
    "data.balance_dp_token": (False,),
    "data.use_shm": (False,),
    "data.pad_mode": ("no_padding", "right"),  # posttrain pads each micro-batch to its longest row
    "data.ignore_input_ids_mismatch": (False,),
    "optim.total_training_steps": (-1, None),  # verl fills it in from trainer.*
    "optim.optimizer": ("AdamW",),
    "optim.optimizer_impl": ("torch.optim",),
    "optim.override_optimizer_config": (None,),
    "trainer.checkpoint.save_contents": (),  # a checkpoint holds the model, optimizer and state: resumable
    "trainer.checkpoint.load_contents": (),
    "trainer.default_hdfs_dir": (None,),
}

REFUSED = {
    # verl's SFT trainer never read it (fsdp_sft_trainer.py reads micro_batch_size_per_gpu alone; verl 0.9 dropped it)
    "data.micro_batch_size": "verl's deprecated global micro-batch, which verl's SFT trainer never read: give "
                             "data.micro_batch_size_per_gpu (rows per worker)",
    "data.chat_template": "verl's name of a template in its own registry (deprecated there) is not read by "
                         "posttrain, which renders rows with the tokenizer's chat template; to replace it, give "
                         "data.custom_chat_template (a Jinja template, or a .jinja file)",
    "model.external_lib": "posttrain imports no module for the model; a model that needs code of its own loads "
                          "with model.trust_remote_code=true",
}


def translate(flat: dict[str, Any], origin: str) -> dict[str, Any]:
    """`flat` (one layer's keys) with verl's SFT spellings renamed, its unused keys dropped (a warning names the
    ones set to something else) and the keys posttrain cannot honour refused."""
    out, unused = {}, []
    for key, value in flat.items():
        if key in REFUSED and value not in (None, "", -1):
            raise ConfigError(f"{key}={printable(value)} ({origin}): {REFUSED[key]}")
        if key == "optim.warmup_style" and value is None:
            continue  # deprecated, left null beside optim.lr_scheduler (verl's own optim/fsdp.yaml)
        if key in UNUSED:
            if UNUSED[key] and value not in UNUSED[key]:
                unused.append(f"{key}={printable(value)}")
            continue
        if key in EXACT:
            key = EXACT[key]
        else:
            for theirs, ours in PREFIXES:
                if key.startswith(theirs):
                    key = _renamed(key, theirs, ours, origin)
        out[key] = value
    if unused:
        print(f"posttrain: warning: {', '.join(unused)} ({origin}): verl's SFT settings posttrain does not use",
              file=sys.stderr)
    return out


def _renamed(key: str, theirs: str, ours: str, origin: str) -> str:
    """verl's `theirs`-prefixed key as posttrain's, or a ConfigError naming the nearest of verl's spellings."""
    renamed = ours + key[len(theirs):]
    if renamed in SCHEMA:
        return renamed
    spellings = [theirs + k[len(ours):] for k in SCHEMA if k.startswith(ours)] + list(EXACT)
    match = difflib.get_close_matches(key, spellings, n=1, cutoff=0.5)
    raise ConfigError(f"unknown config key '{key}' ({origin})" + (f"; did you mean '{match[0]}'?" if match else ""))


def describe() -> list[str]:
    """`posttrain sft --help-config`'s lines on verl's SFT keys that are not posttrain's, and on its RL spellings."""
    return [f"verl's SFT keys accepted and unused (a value other than its default is named in a warning): "
            f"{', '.join(UNUSED)}",
            f"verl's SFT keys refused, each with what to give instead: {', '.join(REFUSED)}",
            "verl's RL spellings of the keys above (actor_rollout_ref.actor.optim.lr, ...) are read too: "
            "`posttrain train --help-config` lists them"]


def spellings_by_key() -> dict[str, list[str]]:
    """posttrain's key -> verl's SFT spellings of it (for `posttrain sft --help-config`); its trainer.* keys are
    its RL trainer's."""
    out: dict[str, list[str]] = {}
    for theirs, ours in alias_table(SCHEMA).items():
        if theirs.startswith("trainer."):
            out.setdefault(ours, []).append(theirs)
    for theirs, ours in PREFIXES:
        for name in OPTIM:
            out.setdefault(ours + name, []).append(theirs + name)
    for theirs, ours in EXACT.items():
        out.setdefault(ours, []).append(theirs)
    return out
