"""What `posttrain sft --help-config` prints: the keys a supervised run reads, each with the default a run
gets (resolved as load_config resolves a run's: the dataclasses' defaults under configs/sft.yaml), the embedded
tiny run's value where it differs (configs/tiny_sft.yaml, without model.path), verl's SFT spellings of the key,
and what happens to it when not simply honoured. The keys only RL reads (validate_sft.rl_only: the ones a run
is told it set for nothing) and verl's unused ones are left out.

    print(describe_sft_keys())
"""

from __future__ import annotations

from typing import Any

from posttrain.config.dialects.verl import sft as verl_sft
from posttrain.config.flat import flatten
from posttrain.config.keys import SFT_ONLY_KEYS, listed, status, type_and_default
from posttrain.config.load import config_to_dict, load_config
from posttrain.config.schema import SCHEMA
from posttrain.config.validate_sft import RL_SECTIONS, rl_only

PLACEHOLDER_MODEL = "<model.path>"  # any model.path: the defaults of a run given one


def sft_keys() -> list[str]:
    """The keys `posttrain sft` reads, in the config's order (as `posttrain train --help-config` lists them)."""
    return [k for k in listed() if not rl_only(k)]


def sft_defaults() -> tuple[dict[str, Any], dict[str, Any]]:
    """-> (the defaults of a `posttrain sft` run given a model.path, the embedded default run's), flat keys; verl's
    keys that its dialect reads itself: their own defaults."""
    given = flatten(config_to_dict(load_config(None, [f"model.path={PLACEHOLDER_MODEL}"], command="sft")))
    given["model.path"] = SCHEMA["model.path"][1]
    theirs = {key: type_and_default(key)[1] for key in sft_keys() if key not in given}
    return {**given, **theirs}, {**flatten(config_to_dict(load_config(None, [], command="sft"))), **theirs}


def describe_sft_keys() -> str:
    defaults, embedded = sft_defaults()
    verl = verl_sft.spellings_by_key()
    lines = ["posttrain sft config keys (type = the default of a run given model.path) [what happens to it, when "
             "not simply honoured]:",
             "  (verl: ...) its spellings in verl's SFT trainer, read too; (embedded: ...) the default without "
             "model.path (`posttrain sft` alone: the tiny model on the arith task)"]
    for key in sft_keys():
        line = f"  {key}: {type_and_default(key)[0]} = {defaults[key]!r}"
        if key in verl:
            line += f"  (verl: {', '.join(verl[key])})"
        if embedded[key] != defaults[key] and key != "model.path":
            line += f"  (embedded: {embedded[key]!r})"
        if status(key) and key not in SFT_ONLY_KEYS:
            line += f"  [{status(key)}]"
        lines.append(line)
    lines += ["", *verl_sft.describe(),
              f"Not listed: what only RL reads ({', '.join(s + '*' for s in RL_SECTIONS)}, "
              "actor.ppo_mini_batch_size, actor.clip_ratio, ...): set for posttrain sft, they are named in one "
              "warning as unused.",
              "NeMo-RL's SFT layout (--config sft.yaml: sft.*, policy.*, data.*, checkpointing.*): docs/sft.md"]
    return "\n".join(lines)
