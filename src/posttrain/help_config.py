"""What `posttrain train --help-config` and `posttrain sft --help-config` print, composed from the schema (a key's type and
default), KEY_STATUS below (what happens to a key posttrain takes but does not simply honour) and each dialect's
lines on its keys (its describe()).

    print(describe_keys())       # train: every key with its type and default, then verl's and NeMo-RL's spellings
    print(describe_sft_keys())   # sft: the keys a supervised run reads, with the defaults a run gets

`posttrain sft --help-config` resolves its defaults as load_config resolves a run's (the dataclasses' defaults
under configs/sft.yaml), gives the embedded tiny run's value where it differs (configs/tiny_sft.yaml, without
model.path) and verl's SFT spellings of each key; the keys only RL reads (validate_sft.rl_only: the ones a run is
told it set for nothing) and verl's unused ones are left out.
"""

from __future__ import annotations

from typing import Any

from posttrain.config.dialects import nemo_rl
from posttrain.config.dialects.verl import keys as verl_keys
from posttrain.config.dialects.verl import sft as verl_sft
from posttrain.config.flat import flatten
from posttrain.config.keys import LORA_ONLY_KEYS, SFT_ONLY_KEYS
from posttrain.config.load import config_to_dict, load_config
from posttrain.config.schema import SCHEMA
from posttrain.config.schema_rollout import VLLM_SETTINGS
from posttrain.config.validate_sft import RL_SECTIONS, rl_only

PLACEHOLDER_MODEL = "<model.path>"  # any model.path: the defaults of a run given one

# What happens to a key, as --help-config shows it; every key not named here is honoured.
ENGINE = "vLLM's engine (named unused on hf)"
KEY_STATUS = {**{f"rollout.{k}": ENGINE for k in (*VLLM_SETTINGS, "free_cache_engine", "engine_kwargs")},
              "rollout.stop_check_every": "hf engine's (named unused on vllm); null: 1 on the CPU, 8 on CUDA",
              "rollout.static_decoding": "hf engine's (named unused on vllm); null: on with CUDA, off on the CPU",
              "rollout.enforce_eager": "vLLM's engine; hf: static decoding not recorded as CUDA graphs",
              "ref.cast_weights": "null: on under autocast to a lower dtype (bf16 on CUDA), in one process, without LoRA",
              "model.log_prob_budget_from_memory": "null: on CUDA yes, on the CPU no; a set token budget wins",
              "rollout.mode": "async: named unused", "data.image_key": "a vision-language model's prompts take the images; a text-only one refuses the rows",
              "data.video_key": "rows with videos refused (not supported yet)",
              "data.seed": "null: trainer.seed's",
              "reward.functions": "NeMo-RL's env.<name>.reward_functions: name -> weight (or {weight, kwargs}) of "
                                  "format, exact_alnum, math_expr, bbox_giou, geo3k; their weighted sum scores every "
                                  "row; {}: each row's data_source",
              **{k: "posttrain sft (named unused by posttrain train)" for k in SFT_ONLY_KEYS},
              **{k: "with model.lora_rank > 0 (without: named unused)" for k in LORA_ONLY_KEYS},
              "profiler.tool": "npu: torch's profiler instead", "profiler.global_tool_config": "named unused",
              "profiler.torch_memory.stack_depth": "named unused (torch records whole stacks)",
              **{f"profiler.{r}.{k}": "the loop's process counts as rank 0"
                 for r in ("actor", "ref", "rollout", "critic") for k in ("ranks", "all_ranks")},
              **{f"profiler.{r}.tool_config": "<tool>.discrete, <torch|npu>.contents read; the rest named unused"
                 for r in ("actor", "ref", "rollout", "critic")}}


def listed() -> list[str]:
    """The keys --help-config lists, in order: posttrain's, and verl's that posttrain takes at one value only or
    names unused (its dialect's FIXED, where they were listed while they were posttrain's)."""
    return verl_keys.listed(SCHEMA)


def type_and_default(key: str) -> tuple[str, Any]:
    """The key's type as --help-config prints it (`Optional[str]`, `int`, ...: as the schema spells it), and its
    default."""
    return SCHEMA[key] if key in SCHEMA else verl_keys.READ[key]


def status(key: str) -> str | None:
    """What happens to the key, when it is not simply honoured."""
    return KEY_STATUS.get(key) or (verl_keys.STATUS.get(key) if key in verl_keys.FIXED else None)


def describe_keys() -> str:
    lines = ["posttrain config keys (type = default) [what happens to it, when not simply honoured]:"]
    for key in listed():
        typ, default = type_and_default(key)
        lines.append(f"  {key}: {typ} = {default!r}" + (f"  [{status(key)}]" if status(key) else ""))
    return "\n".join([*lines, "", *verl_keys.describe(SCHEMA, KEY_STATUS), "", *nemo_rl.describe()])


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
